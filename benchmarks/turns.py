"""Decoding in turns: every run (a method with its knobs) decodes prompt i before any run
decodes prompt i + 1, and the rows merge each run's one-prompt calls. A shared machine's speed
drifts by tens of percent within minutes (a 2-core VM's neighbours); in turns, that drift weighs
on every run alike instead of on whichever ran while the machine was slow. Used by
benchmarks/reproduce.py's ladder, trees and sampled sections and by benchmarks/spec_decode.py
--turns.

  lossless_rows   a row per run for each prompt set, decoded in turns (greedy: every output
                  must equal AR's)
  merged_stats    one run's stats over its one-prompt calls
  row_of          a row of reproduce.json from a run's stats and AR's ms per token
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from d2sd_jax.decode import generate as generate_lib


def per_token_ms(stats: dict) -> float:
  return 1e3 * stats['decode_s'] / max(1, stats['new_tokens'] - stats['prompts'])


def row_of(method: str, stats: dict, ar_ms: float) -> dict:
  return {'method': method, 'tau': stats.get('tau', 1.0),
          'decode_tokens_per_s': stats['decode_tokens_per_s'],
          'ms_per_token': round(per_token_ms(stats), 2),
          'speedup_vs_ar': round(ar_ms / per_token_ms(stats), 3),
          'stage_ms': stats.get('stage_ms'), 'tree_size': stats.get('tree_size'),
          'expected_tau': stats.get('expected_tau'),  # best-first trees only
          'auto_choice': stats.get('auto_choice'),  # method=auto: its first pick (method(knob))
          'auto_parts': stats.get('auto_parts'),  # and which candidate decoded how many prompts
          # (adaptive trees: nodes verified per cycle as chosen, and with lookup cycles, the
          # share of cycles that verified prompt lookup's proposal alone)
          **{k: stats[k] for k in ('mean_tree_size', 'lookup_only_share', 'accepted_histogram')
             if k in stats}}


def lossless_rows(dec, section: str, sets: dict, runs, tokens: int, sampling=None,
                  warm: bool = False, fresh_auto: bool = True) -> dict:
  """Per prompt set, a row per run (label, method, knobs) and AR once more ('ar (end)'), decoded
  in turns: prompt i by every run, in order, before prompt i + 1. The machine's drift (tens of
  percent within a set on a shared 2-core VM) then weighs on every row alike, not on whichever
  ran while the machine was slow. Every speed-up is against the mean of the two AR runs, whose
  gap shows the noise left. The prompts of every set are padded to the section's longest
  (`prompt_width`): each run compiles one program for the whole section, reused by every set
  and prompt (a decode step reads the context windows its rows fill, so the padding costs the
  prefill, not the tokens/s). method=auto learns across the
  calls as across the batches of one call (a fresh choice cache per set, from the shipped
  priors; with fresh_auto False, the one D2SD_AUTO_CACHE names). Greedy (`sampling` None), any output that differs from AR's stops the run; with
  `sampling` (temperature, top_p, seed) prompt i samples with seed + i, and outputs are draws of
  the target's law, not AR's draws, and are not compared (the law tests check the law:
  tests/spec_decode/test_speculative.py, tests/spec_decode/test_tree.py). `warm`: before its
  first timed call, every run but auto decodes the set's first prompt once, untimed (a compiled
  program's first run pays a one-off cost that would otherwise fall on that call; auto's is
  part of what a user's first request pays, and its warm-up would teach it the set)."""
  tok = generate_lib.tokenizer_of(dec.target)
  everything = (*runs, ('ar (end)', 'ar', {}))
  out = {}
  width = max(len(tok.encode_prompt(p, chat, {})) for prompts, chat in sets.values()
              for p in prompts)
  for name, (prompts, chat) in sets.items():
    if fresh_auto and any(method == 'auto' for _, method, _ in runs):  # (none from another set)
      os.environ['D2SD_AUTO_CACHE'] = tempfile.mkdtemp(prefix='d2sd-auto-')
    calls = {label: [] for label, _, _ in everything}
    warmed = set()
    for label, method, knobs in everything if warm else ():
      knobs = {k: v for k, v in knobs.items() if k != 'stage_times'}
      if method != 'auto' and (method, repr(sorted(knobs.items()))) not in warmed:
        warmed.add((method, repr(sorted(knobs.items()))))
        dec.generate(prompts[:1], tokens, method=method, chat=chat, batch_size=1,
                     prompt_width=width, **({} if sampling is None else sampling), **knobs)
    for i, prompt in enumerate(prompts):
      ar_ids = None
      for label, method, knobs in everything:
        knobs = dict(knobs)
        if i and knobs.get('stage_times'):
          knobs['stage_times'] = False  # (stage_ms comes from the first prompt)
        draw = {} if sampling is None else {**sampling, 'seed': sampling['seed'] + i}
        g = dec.generate([prompt], tokens, method=method, chat=chat, batch_size=1,
                         prompt_width=width, **draw, **knobs)
        if method == 'ar':
          ar_ids = ar_ids or g.ids
        elif sampling is None and g.ids != ar_ids:
          raise SystemExit(f'{label} on {name}, prompt {i}, changed the output: not lossless')
        calls[label].append(g.stats)
    done = [(label, merged_stats(calls[label])) for label, _, _ in everything]
    for label, st in done:
      print(json.dumps({section: name, 'method': label, 'tau': st.get('tau', 1.0),
                        'decode_tokens_per_s': st['decode_tokens_per_s']}), flush=True)
    ar_ms = np.mean([per_token_ms(st) for label, st in done if label in ('ar', 'ar (end)')])
    out[name] = [row_of(label, st, ar_ms) for label, st in done]
  return out


def merged_stats(calls: list[dict]) -> dict:
  """One run's stats over its calls, one prompt each: totals, tau over all cycles, the trees'
  expected tau, mean tree size and share of lookup-only cycles weighted by their cycles, the
  summed acceptance histogram, stage times and auto's first pick from the first call, and
  auto's parts joined (a candidate that decoded consecutive prompts is one part)."""
  first = calls[0]
  st = {'prompts': sum(c['prompts'] for c in calls),
        'new_tokens': sum(c['new_tokens'] for c in calls),
        'decode_s': sum(c['decode_s'] for c in calls),
        'tree_size': first.get('tree_size'), 'stage_ms': first.get('stage_ms'),
        'auto_choice': first.get('auto_choice')}
  decode_tokens = st['new_tokens'] - st['prompts']
  st['decode_tokens_per_s'] = round(decode_tokens / st['decode_s'], 2)
  if all('cycles' in c for c in calls):
    st['cycles'] = sum(c['cycles'] for c in calls)
    st['tau'] = round(decode_tokens / st['cycles'], 3)
    for key in ('mean_tree_size', 'lookup_only_share'):
      if all(key in c for c in calls):
        st[key] = round(sum(c[key] * c['cycles'] for c in calls) / st['cycles'], 3)
  if all(c.get('accepted_histogram') for c in calls):
    st['accepted_histogram'] = [int(h) for h in np.sum([c['accepted_histogram'] for c in calls],
                                                       axis=0)]
  scored = [c for c in calls if c.get('expected_tau') is not None]
  if scored:
    st['expected_tau'] = round(1 + sum((c['expected_tau'] - 1) * c['cycles'] for c in scored)
                               / sum(c['cycles'] for c in scored), 3)
  if first.get('auto_parts'):
    parts = []
    for c in calls:
      for part in c['auto_parts']:
        if parts and parts[-1]['choice'] == part['choice']:
          parts[-1]['prompts'] += part['prompts']
        else:
          parts.append(dict(part))
    st['auto_parts'] = parts
  return st

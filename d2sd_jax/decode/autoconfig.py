"""method='auto': the decoding configuration with the highest predicted tokens/s on this machine.

For each candidate (AR; prompt lookup; and, with the drafters at hand, drafter 1 alone, D²SD
with K = 1, 2, 4 and the hybrid d2sd_pld with K = 1, 4), the prediction is
throughput.tokens_per_s(E[τ], t_cycle):
  E[τ]    from a probe: the candidate decodes the request's first PROBE_PROMPTS prompts for
          PROBE_TOKENS tokens each and their pooled acceptance histogram gives E[τ]
          (throughput.tau_from_histogram). Acceptance depends on the prompts (prompt lookup
          thrives where the answer repeats the prompt), so it is measured on the request itself
          rather than assumed, and at the request's own length: prompt lookup also copies the
          text it generated, so its τ grows along a completion (48-token probes of 4 HumanEval
          prompts gave it τ 1.77 against 2.26 over 20 prompts of 128 tokens, and auto chose AR
          over a prompt lookup 1.25x faster).
  t_cycle the probe's own cycle time (its decode time over its cycles: the real programs on
          the real contexts), timed on the probe prompts after the first, which warms the
          programs up (a first run pays one-off costs), when they ran at least
          MIN_PROBE_CYCLES cycles; otherwise the cost model measured on this machine
          (costmodel.measure, whole cycles timed inside a loop on a synthetic context; cached
          on disk), for those candidates only: it costs minutes on a large target, and its
          cycles missed the real ones by up to 25 % on HumanEval (README), enough to swap AR
          and prompt lookup.
The stats report the choice (`auto_choice`), its prediction (`predicted_tokens_per_s`) and every
candidate's figures (`auto_candidates`); the decode's own `decode_tokens_per_s` is measured as for
any method.

The choice is remembered: probing compiles one program per candidate and decodes with each
(minutes for SmolLM2 on a 2-core CPU: 12.7 on the slowest machine measured), so the result is
written to a JSON file under ~/.cache/d2sd_jax/auto/ (D2SD_AUTO_CACHE overrides), keyed by
everything the ranking depends on but the prompts' text: the device kind and count, the JAX
version, the target's fingerprint and dtype, each drafter's config and a digest of its weights,
the batch, the sampling settings, the speculative knobs the request fixes, chat or not, and the
context window the request needs (prompt + max_new_tokens: cycle costs depend on it). A later
request with the same key decodes with the remembered configuration at once (`auto_source:
'remembered'`, `auto_file`; `auto_s`: the seconds choosing took); `auto_refresh=True` probes
again and replaces it. Acceptance also depends on the prompts (prompt lookup thrives where
answers repeat the prompt) and a little on the length (prompt lookup's τ grows along a
completion), which the key leaves out on purpose (a choice per prompt would never be reused):
the file records what it was probed on (`probed_on`), and a request of another kind should
refresh it. An unreadable or stale file (a candidate this version no longer weighs) is probed
again, never trusted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import jax
import numpy as np

from d2sd_jax.perf import costmodel
from d2sd_jax.spec import speculative as SP
from d2sd_jax.perf import throughput
from d2sd_jax.decode import options as options_lib
from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.formats import checkpoints

PROBE_TOKENS = 128  # at most; the request's own max_new_tokens when smaller
PROBE_PROMPTS = 3  # the request's first prompts each probe decodes (the first warms up)
MIN_PROBE_CYCLES = 8  # fewer probe cycles than this: the cost model's cycle time is used


def candidates(drafters: dict) -> list[tuple[str, str, dict]]:
  """(label, method, spec knobs) of every configuration auto-config weighs."""
  gamma = drafters['drafter1'][0].gamma if 'drafter1' in drafters else 8
  out = [('ar', 'ar', {}), (f'pld(gamma={gamma})', 'pld', {'gamma': gamma})]
  if 'drafter1' in drafters:
    out.append(('dflash', 'dflash', {'gamma': gamma}))
    if 'drafter2' in drafters:
      for K in (1, 2, 4):
        if K <= gamma - 1:
          out.append((f'd2sd(K={K})', 'd2sd', {'gamma': gamma, 'n_branches': K}))
      # the hybrid: D²SD's tree plus prompt lookup's proposal as one more branch
      for K in (1, 4):
        if K <= gamma - 1:
          out.append((f'd2sd_pld(K={K})', 'd2sd_pld', {'gamma': gamma, 'n_branches': K}))
  return out


def choose(target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
           log=print):
  """(the Options to decode with, auto stats) for an Options whose method is 'auto': the
  remembered choice for this key when there is one (and no auto_refresh), else a fresh probe of
  every candidate, which is then remembered."""
  started = time.perf_counter()
  longest = max(len(p) for p in prompt_ids)
  path = os.path.join(choice_dir(), remembered_key(target, drafters, options, batch, longest)
                      + '.json')
  record = None if options.auto_refresh else _read_remembered(path, drafters, log)
  source = 'remembered'
  if record is None:
    log(f'auto: probing {len(candidates(drafters))} configurations on this machine, once for '
        f'these settings (minutes; an explicit method skips it); remembered in {path}')
    record, source = probe(target, drafters, prompt_ids, options, batch, tok, log), 'probed'
    costmodel.write_json(path, record)
  best = record['auto_candidates'][record['auto_choice']]
  chosen = dataclasses.replace(options, method=best['method'],
                               spec={**options.spec, **best['spec']})
  return chosen, {'auto_choice': record['auto_choice'],
                  'predicted_tokens_per_s': record['predicted_tokens_per_s'],
                  'auto_candidates': record['auto_candidates'],
                  'cost_device': record['cost_device'], 'auto_source': source, 'auto_file': path,
                  'auto_s': round(time.perf_counter() - started, 2)}


def probe(target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
          log=print) -> dict:
  """Every candidate's predicted tokens/s from its probe (module docstring): the record
  `choose` remembers."""
  settings = options_lib.generation_settings(options, tok.eos_ids, tok.pad_id)
  longest = max(len(p) for p in prompt_ids)
  limit = runner_lib.cache_limit(target, longest, options.max_new_tokens, options.cache_len)
  params = {'target': target.params, **{n: p for n, (_, p) in drafters.items()}}
  probe_settings = dataclasses.replace(settings,
                                       max_new_tokens=min(PROBE_TOKENS, options.max_new_tokens))
  fixed = {k: v for k, v in options.spec.items() if v is not None}  # the request's own knobs
  specs, cands = {}, candidates(drafters)
  for label, method, knobs in cands:
    if method != 'ar':
      cfgs = {n: drafters[n][0] for n in options_lib.drafters_needed(method)}
      specs[label] = SP.SpecSettings(settings, method=method, **{**fixed, **knobs}, **cfgs)
  probed = {}
  probe_ids = prompt_ids[:PROBE_PROMPTS]
  width = max(map(len, probe_ids))  # one program per candidate, for every probe prompt
  for label, method, knobs in cands:
    runner = runner_lib.make_runner(target, probe_settings, method, width, limit, drafters,
                                  **({} if method == 'ar' else {**fixed, **knobs}))
    # The first prompt warms the programs up (a first run pays one-off costs): it counts for
    # E[τ], and the cycle time comes from the others.
    _, warm = runner_lib.decode_prompts(runner, tok, probe_ids[:1], 1, options.seed, width)
    _, st = runner_lib.decode_prompts(runner, tok, probe_ids[1:] or probe_ids, 1, options.seed,
                                    width)
    hist = None if method == 'ar' or warm['hist'] is None else (
        warm['hist'] + st['hist'] if len(probe_ids) > 1 else st['hist'])
    probed[label] = (hist, st['decode_s'], st['decode_steps'])
  # The cost model only for probes too short to time (it costs minutes on a big target).
  short = [label for label, (_, _, steps) in probed.items() if steps < MIN_PROBE_CYCLES]
  costs = None
  if short:
    context = runner_lib.round_up(longest, runner_lib.PROMPT_BUCKET)  # pylint: disable=protected-access
    weighed = [specs[label] for label in short if label in specs]
    sizes = sorted({2} | {spec.tree_size for spec in weighed})
    costs = costmodel.measure(params, target.cfg, weighed, batch=batch, context=context,
                              sizes=sizes, repeats=5, log=log)
  table = {}
  for label, method, knobs in cands:
    hist, decode_s, steps = probed[label]
    tau = 1.0 if hist is None or not hist.sum() else throughput.tau_from_histogram(hist)
    probe_s = decode_s / steps if steps else None
    model_s = None if label not in short else (
        costs.ar_step if method == 'ar' else costs.cycle(specs[label]))
    cycle_s = model_s if label in short else probe_s
    table[label] = {'method': method, 'spec': knobs, 'tau': round(tau, 3),
                    'cycle_ms': round(1e3 * cycle_s, 6),
                    'model_cycle_ms': None if model_s is None else round(1e3 * model_s, 6),
                    'probe_cycle_ms': None if probe_s is None else round(1e3 * probe_s, 6),
                    'probe_cycles': steps,
                    'predicted_tokens_per_s': round(throughput.tokens_per_s(tau, cycle_s, batch),
                                                    2)}
  best = max(table, key=lambda k: table[k]['predicted_tokens_per_s'])
  digest = hashlib.sha256(json.dumps(probe_ids).encode()).hexdigest()[:16]
  return {'version': RECORD_VERSION, 'auto_choice': best,
          'predicted_tokens_per_s': table[best]['predicted_tokens_per_s'],
          'auto_candidates': table,
          'cost_device': costs.device if costs else jax.devices()[0].device_kind,
          'probed_on': {'prompts': len(probe_ids), 'prompt_ids_sha256': digest,
                        'max_new_tokens': probe_settings.max_new_tokens},
          'created': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}


# ----------------------------------------------------------------------------------------------
# The remembered choice

RECORD_VERSION = 1  # a record written under another version is probed again


def choice_dir() -> str:
  return os.environ.get('D2SD_AUTO_CACHE',
                        os.path.join(os.path.expanduser('~'), '.cache', 'd2sd_jax', 'auto'))


def params_digest(params) -> str:
  """A digest of a parameter tree that tells trained drafters apart: every leaf's path, shape,
  dtype and first 256 values (float32), so a few ms even for a large drafter."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(f'{jax.tree_util.keystr(path)}{tuple(leaf.shape)}{leaf.dtype}'.encode())
    h.update(np.asarray(jax.device_get(leaf.reshape(-1)[:256]), np.float32).tobytes())
  return h.hexdigest()[:16]


def context_window(tokens: int) -> int:
  """The power of two >= 256 that holds `tokens` (costs depend on the context's window)."""
  return max(256, 1 << max(0, tokens - 1).bit_length())


def remembered_key(target, drafters: dict, options, batch: int, longest: int) -> str:
  """The key of the remembered choice (module docstring: what it holds and leaves out)."""
  dev = jax.devices()[0]
  blob = {
      'device': [dev.platform, dev.device_kind, len(jax.devices())], 'jax': jax.__version__,
      'target': checkpoints.target_fingerprint(target),
      'dtype': str(target.params['embed'].dtype),
      'drafters': {n: [repr(cfg), params_digest(p)] for n, (cfg, p) in sorted(drafters.items())},
      'batch': batch, 'sampling': [options.temperature, options.top_k, options.top_p],
      'spec': sorted((k, v) for k, v in options.spec.items() if v is not None),
      'chat': options.chat, 'chat_template_kwargs': options.chat_template_kwargs,
      'context': context_window(longest + options.max_new_tokens), 'version': RECORD_VERSION}
  return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_remembered(path: str, drafters: dict, log) -> dict | None:
  """The record at `path` if it is whole and names a configuration still weighed, else None
  (with a line saying why, when a file was there)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      record = json.load(f)
    weighed = {label: (method, knobs) for label, method, knobs in candidates(drafters)}
    table = record['auto_candidates']
    row = table[record['auto_choice']]
    stale = (record.get('version') != RECORD_VERSION or set(table) != set(weighed) or
             (row['method'], row['spec']) != weighed[record['auto_choice']])
  except (OSError, ValueError, KeyError, TypeError) as e:
    log(f'auto: the remembered choice {path} is unreadable ({type(e).__name__}: {e}); probing '
        'again')
    return None
  if stale:
    log(f'auto: the remembered choice {path} weighed other configurations; probing again')
    return None
  return record

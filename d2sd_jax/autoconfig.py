"""method='auto': the decoding configuration with the highest predicted tokens/s on this machine.

For each candidate (AR; prompt lookup; and, with the drafters at hand, drafter 1 alone and D²SD
with K = 1, 2, 4), the prediction is throughput.tokens_per_s(E[τ], t_cycle):
  E[τ]    from a probe: the candidate decodes the request's first PROBE_PROMPTS prompts for
          PROBE_TOKENS tokens each and their pooled acceptance histogram gives E[τ]
          (throughput.tau_from_histogram). Acceptance depends on the prompts (prompt lookup
          thrives where the answer repeats the prompt), so it is measured on the request itself
          rather than stored, and at the request's own length: prompt lookup also copies the
          text it generated, so its τ grows along a completion (48-token probes of 4 HumanEval
          prompts gave it τ 1.77 against 2.26 over 20 prompts of 128 tokens, and auto chose AR
          over a prompt lookup 1.25x faster).
  t_cycle the probe's own cycle time (its decode time over its cycles: the real programs on
          the real contexts), timed on the probe prompts after the first, which warms the
          programs up (a first run pays one-off costs), when they ran at least
          MIN_PROBE_CYCLES cycles; otherwise the cost model
          measured on this machine (costmodel.measure, whole cycles timed inside a loop on a
          synthetic context; cached on disk, so only the first run on a machine pays for it).
          Both are reported: the cost model's cycles missed the real ones by up to 25 % on
          HumanEval (README), enough to swap AR and prompt lookup.
The stats report the choice (`auto_choice`), its prediction (`predicted_tokens_per_s`) and every
candidate's figures (`auto_candidates`); the decode's own `decode_tokens_per_s` is measured as for
any method.
"""
from __future__ import annotations

import dataclasses

from d2sd_jax import costmodel
from d2sd_jax import speculative as SP
from d2sd_jax import throughput

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
  return out


def choose(target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
           log=print):
  """(the Options to decode with, auto stats) for an Options whose method is 'auto'."""
  from d2sd_jax import decoding  # pylint: disable=import-outside-toplevel (decoding imports us)
  settings = decoding.generation_settings(options, tok.eos_ids, tok.pad_id)
  longest = max(len(p) for p in prompt_ids)
  limit = decoding.cache_limit(target, longest, options.max_new_tokens, options.cache_len)
  params = {'target': target.params, **{n: p for n, (_, p) in drafters.items()}}
  probe_settings = dataclasses.replace(settings,
                                       max_new_tokens=min(PROBE_TOKENS, options.max_new_tokens))
  specs, cands = {}, candidates(drafters)
  for label, method, knobs in cands:
    if method != 'ar':
      cfgs = {n: drafters[n][0] for n in decoding.drafters_needed(method)}
      specs[label] = SP.SpecSettings(settings, method=method, **knobs, **cfgs)
  context = decoding._round_up(longest, decoding.PROMPT_BUCKET)  # pylint: disable=protected-access
  sizes = sorted({2} | {spec.tree_size for spec in specs.values()})  # only what is weighed
  costs = costmodel.measure(params, target.cfg, list(specs.values()), batch=batch,
                            context=context, sizes=sizes, repeats=5, log=log)
  table = {}
  probe_ids = prompt_ids[:PROBE_PROMPTS]
  for label, method, knobs in cands:
    runner = decoding.make_runner(target, probe_settings, method, max(map(len, probe_ids)),
                                  limit, drafters, **knobs)
    # The first prompt warms the programs up (a first run pays one-off costs): it counts for
    # E[τ], and the cycle time comes from the others.
    _, warm = decoding.decode_prompts(runner, tok, probe_ids[:1], 1, options.seed)
    _, st = decoding.decode_prompts(runner, tok, probe_ids[1:] or probe_ids, 1, options.seed)
    model_s = costs.ar_step if method == 'ar' else costs.cycle(specs[label])
    probe_s = st['decode_s'] / st['decode_steps'] if st['decode_steps'] else None
    hist = None if method == 'ar' or warm['hist'] is None else (
        warm['hist'] + st['hist'] if len(probe_ids) > 1 else st['hist'])
    tau = 1.0 if hist is None or not hist.sum() else throughput.tau_from_histogram(hist)
    cycle_s = probe_s if st['decode_steps'] >= MIN_PROBE_CYCLES else model_s
    table[label] = {'method': method, 'spec': knobs, 'tau': round(tau, 3),
                    'cycle_ms': round(1e3 * cycle_s, 6), 'model_cycle_ms': round(1e3 * model_s, 6),
                    'probe_cycle_ms': None if probe_s is None else round(1e3 * probe_s, 6),
                    'probe_cycles': st['decode_steps'],
                    'predicted_tokens_per_s': round(throughput.tokens_per_s(tau, cycle_s, batch),
                                                    2)}
  best = max(table, key=lambda k: table[k]['predicted_tokens_per_s'])
  chosen = dataclasses.replace(options, method=table[best]['method'],
                               spec={**options.spec, **table[best]['spec']})
  return chosen, {'auto_choice': best,
                  'predicted_tokens_per_s': table[best]['predicted_tokens_per_s'],
                  'auto_candidates': table, 'cost_device': costs.device}

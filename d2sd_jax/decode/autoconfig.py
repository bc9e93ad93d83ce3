"""method='auto': the decoding configuration with the highest predicted tokens/s on this machine.

This module chooses (`choose`); auto_record.py holds the remembered record and what every batch
teaches it (`Record.learn`); auto_policy.py runs a request batch by batch.

The candidates: AR, and every registered drafting method whose drafters are at hand, in the
configurations its registry entry declares (`drafting.Method.auto`): prompt lookup, drafter 1
alone, D²SD with K = 1, 2, 4, the hybrid d2sd_pld with K = 1, 4, and the best-first trees
ddtree and d2sd_tree at each node budget of TREE_BUDGETS (the budget is what the hardware
decides: verifying N nodes costs little more than one on an accelerator, several AR steps on
a CPU), and d2sd_tree adaptive up to drafting.ADAPTIVE_BUDGET nodes (its cycles choose their
size, or prompt lookup alone, from this machine's cycle costs, measured when it first decodes
or is probed); a method added with d2sd_jax.register, at its defaults. Each is predicted
throughput.tokens_per_s(E[τ], t_cycle), from one of three sources, in this order:

  remembered  a choice this machine made before for the same key (below), decoded at once;
  prior       the drafters' recorded acceptance and cycle costs (PRIORS: drafters/auto_priors.json,
              written by scripts/auto_priors.py on held-out prompts: E[τ] per candidate and its
              cycle in AR steps, for a platform and batch; the nearest recorded batch's for
              a batch without its own). No probing of every candidate:
              once per remembered record, the first batch's first AR_TIMING_TOKENS tokens are
              decoded by AR (this machine's AR step), then by the best prediction, and by the
              next best if the one timed fell below it, up to TIMED_FIRST programs (each run
              twice, the first warming it up; outputs dropped), and the first batch decodes
              with the best prediction after them (auto_policy.py). Every batch then teaches
              the next (`Record.learn`): the chosen candidate's measured τ and cycle time become its
              prediction (a timed candidate measured slower or faster later moves every cycle
              alike: the machine drifted), the other drafter candidates' cycles follow the AR
              step the measured ones imply (prompt lookup's follow AR's own), the drafter
              candidates' τ follow the ratio their measured ones showed to the prior (the
              prompts are easier or harder for the drafters), and the next batch, or the next
              request, decodes with whichever now predicts fastest, measuring it in turn;
  probed      with `auto_probe` (or no prior for these drafters, platform and batch): every
              candidate decodes the request's first PROBE_PROMPTS prompts for up to
              PROBE_TOKENS tokens (the first warms the programs up), and E[τ] and the cycle time
              are the probes' own (the cost model's, costmodel.measure, for probes too short to
              time). Minutes for SmolLM2 on a 2-core CPU: one program per candidate.

Acceptance depends on the prompts (prompt lookup thrives where the answer repeats the prompt,
and its τ grows along a completion), so a prior measured on other prompts is a starting point;
`Record.learn` and `auto_probe` measure the request's own. A request's spec.tree_budget caps the
candidates' trees (the budget below it is auto's to choose).

The stats report the first choice (`auto_choice`), its source (`auto_source`), its prediction
(`predicted_tokens_per_s`, or `predicted_tokens_per_ar_step` from a prior alone), every
candidate's figures (`auto_candidates`) and, where batches taught the choice, which candidate
decoded how many prompts in turn (`auto_parts`); `auto_reason` is the line printed to stderr.

The choice is remembered in a JSON file under ~/.cache/d2sd_jax/auto/ (D2SD_AUTO_CACHE
overrides), keyed by everything the ranking depends on but the prompts' text: the device kind
and count, the JAX version, the target's fingerprint and dtype, each drafter's config and a
digest of its weights, the batch, the sampling settings, the speculative knobs the request
fixes, chat or not, and the context window the request needs (prompt + max_new_tokens: cycle
costs depend on it). `auto_refresh=True` chooses again and replaces it. An unreadable or stale
file (a candidate this version no longer weighs) is chosen again, never trusted.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import time
import types

import jax
import numpy as np

from d2sd_jax.perf import costmodel
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.perf import throughput
from d2sd_jax.decode import auto_record
from d2sd_jax.decode import options as options_lib
from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.formats import checkpoints

PROBE_TOKENS = 128  # at most; the request's own max_new_tokens when smaller
PROBE_PROMPTS = 3  # the request's first prompts each probe decodes (the first warms up)


TREE_BUDGETS = drafting.TREE_BUDGETS  # nodes verified per cycle, the anchor included


def candidates(drafters: dict, max_nodes: int = 0) -> list[tuple[str, str, dict]]:
  """(label, method, spec knobs) of every configuration auto-config weighs: AR, then each
  registered method whose drafters are at hand, in the configurations its registry entry
  declares (`drafting.Method.auto`), all with drafter 1's gamma (8 without it); with
  `max_nodes` (a request's spec.tree_budget), only those that verify at most that many nodes
  per cycle."""
  gamma = drafters['drafter1'][0].gamma if 'drafter1' in drafters else 8
  out = [('ar', 'ar', {})]
  for name, method in drafting.REGISTRY.items():
    if method.auto is not None and all(d in drafters for d in method.drafters):
      out += [(label, name, {'gamma': gamma, **knobs}) for label, knobs in method.auto(name, gamma)]
  return [c for c in out if not max_nodes or nodes(c[1], c[2]) <= max_nodes]


def nodes(method: str, knobs: dict) -> int:
  """Nodes a candidate verifies per cycle, the anchor included (1 for AR)."""
  if method == 'ar':
    return 1
  defaults = {f.name: f.default for f in dataclasses.fields(SP.SpecSettings)
              if f.default is not dataclasses.MISSING}
  knobs = types.SimpleNamespace(**{**defaults, **knobs})
  full = drafting.get(method).nodes(knobs)
  return min(full, knobs.tree_budget) if knobs.tree_budget else full


def node_cap(options) -> int:
  """The request's node cap: with method='auto', spec.tree_budget bounds every candidate's tree
  (the budget itself is auto's to choose), 0 for none."""
  return options.spec.get('tree_budget') or 0


def chosen_options(options, row: dict):
  """The request's Options decoding with a candidate (`row`: a record's auto_candidates entry):
  its method and knobs (the request's own knobs kept, but tree_budget, which was auto's cap)."""
  spec = {k: v for k, v in options.spec.items() if k != 'tree_budget'}
  return dataclasses.replace(options, method=row['method'], spec={**spec, **row['spec']})


def choose(target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
           log=print, note: str = ''):
  """(the Record, where it is remembered, auto stats) for an Options whose method is 'auto':
  the remembered choice for this key (unless auto_refresh or auto_probe), else the prediction
  from the drafters' prior (unless auto_probe), else a probe of every candidate; remembered.
  `note` ends the one line that says what auto chose (why drafters were left out)."""
  started = time.perf_counter()
  longest = options_lib.width(prompt_ids, options)
  path = os.path.join(choice_dir(), remembered_key(target, drafters, options, batch, longest)
                      + '.json')
  fresh = options.auto_refresh or options.auto_probe
  record = None if fresh else _read_remembered(path, drafters, log, node_cap(options))
  source = 'remembered'
  if record is None and not options.auto_probe:
    record, source = from_prior(target, drafters, options, batch), 'prior'
  if record is None:
    log(f'auto: probing {len(candidates(drafters, node_cap(options)))} configurations on this '
        f'machine, once for these settings (minutes; an explicit method skips it); remembered '
        f'in {path}')
    record, source = probe(target, drafters, prompt_ids, options, batch, tok, log), 'probed'
  if source != 'remembered':
    record.save(path)
  reason = explain(record, source) + (f'; {note}' if note else '')
  log(reason)
  return record, path, {
      'auto_choice': record.auto_choice, 'predicted_tokens_per_s': record.predicted_tokens_per_s,
      'auto_candidates': copy.deepcopy(record.auto_candidates), 'cost_device': record.cost_device,
      'auto_source': source, 'auto_file': path, 'auto_reason': reason,
      'auto_s': round(time.perf_counter() - started, 3)}


def explain(record: auto_record.Record, source: str) -> str:
  """One line: what auto chose, from what, and the runner-up."""
  table, best = record.auto_candidates, record.auto_choice
  key = ('predicted_tokens_per_s' if record.predicted_tokens_per_s is not None else
         'predicted_tokens_per_ar_step')
  unit = 'tokens/s' if key == 'predicted_tokens_per_s' else 'tokens per AR step'
  ranked = sorted(table, key=lambda k: -table[k][key])
  row = table[best]
  runner_up = next((k for k in ranked if k != best), None)
  at = ('' if record.prior_batch in (None, record.batch) else
        f', measured at batch {record.prior_batch}')
  origin = {'prior': f"the drafters' recorded acceptance ({record.prior_file}{at})",
            'probed': 'probes of every candidate on these prompts',
            'remembered': f"this machine's remembered choice ({record.source})"
            }[source]
  detail = ', '.join(f'{name} {row[field]:.2f}' for name, field in
                     (('τ', 'tau'), ('cycle in AR steps', 'cycle_ar_steps')) if field in row)
  line = (f'auto: {best} (predicted {row[key]:.2f} {unit}' + (f': {detail}' if detail else '') +
          f') from {origin}')
  if runner_up is not None:
    line += f'; next best {runner_up} ({table[runner_up][key]:.2f})'
  if record.not_in_prior:
    line += (f"; {len(record.not_in_prior)} candidates have no prior and were not weighed "
             '(python scripts/auto_priors.py measures them)')
  return line + '; --config.auto_probe=True times every candidate on these prompts'


# ----------------------------------------------------------------------------------------------
# The prior: acceptance and cycle costs recorded with the drafters


RECORD_PRIORS = 1  # the priors file format


def priors_path() -> str:
  return os.environ.get('D2SD_AUTO_PRIORS',
                        os.path.join(checkpoints.REPO_ROOT, 'drafters', 'auto_priors.json'))


def _defaults_only(spec: dict) -> bool:
  """Whether the request fixes no speculative knob away from SpecSettings' default (a prior is
  recorded at the defaults, with each candidate's own gamma, K and node budget; a request's
  tree_budget only caps the candidates' trees)."""
  defaults = {f.name: f.default for f in dataclasses.fields(SP.SpecSettings)}
  return all(v is None or k in ('gamma', 'n_branches', 'tree_budget') or defaults.get(k) == v
             for k, v in spec.items())


def prior_for(target, drafters: dict, batch: int, path: str | None = None) -> dict | None:
  """The recorded prior for this target, these drafters (weights digests) and this platform, at
  this batch or else the nearest recorded one (in powers of two; the smaller on a tie), or
  None. Acceptance per row hardly depends on the batch; the cycles' costs in AR steps do (on
  an accelerator verification is nearly free at batch 1 and not at 32), which is why priors
  are recorded per batch and the first tokens are timed at the request's own."""
  path = path or priors_path()
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      book = json.load(f)
    records = book['records'] if book.get('version') == RECORD_PRIORS else []
  except (OSError, ValueError, KeyError, TypeError):
    return None
  platform = jax.devices()[0].platform
  fingerprint = checkpoints.target_fingerprint(target)
  digests = {n: params_digest(p) for n, (_, p) in drafters.items()}
  mine = [rec for rec in records
          if (rec.get('target') == fingerprint and rec.get('platform') == platform and
              isinstance(rec.get('batch'), int) and rec['batch'] >= 1 and
              rec.get('drafters') == digests)]
  if not mine:
    return None
  return min(mine, key=lambda rec: (abs(math.log2(rec['batch'] / batch)), rec['batch']))


def from_prior(target, drafters: dict, options, batch: int, path: str | None = None):
  """The record `choose` remembers, predicted from the drafters' prior alone (None where there
  is no prior for every candidate, or the request changes what the candidates are: knobs such
  as leniency or denoising steps). The prior was measured greedy; a sampling request starts
  from it too, and its batches' measurements correct it (`learn`: sampling accepts less)."""
  if not _defaults_only(options.spec):
    return None
  rec = prior_for(target, drafters, batch, path)
  if rec is None or 'ar' not in rec['candidates']:
    return None
  table, missing = {}, []
  for label, method, knobs in candidates(drafters, node_cap(options)):
    if label not in rec['candidates']:  # measured by a later scripts/auto_priors.py run
      missing.append(label)
      continue
    c = rec['candidates'][label]
    if (c['method'], c['spec']) != (method, knobs):
      return None
    table[label] = {'method': method, 'spec': knobs, 'tau': c['tau'],
                    'cycle_ar_steps': c['cycle_ar_steps'],
                    'predicted_tokens_per_ar_step': round(c['tau'] / c['cycle_ar_steps'], 4)}
  best = max(table, key=lambda k: table[k]['predicted_tokens_per_ar_step'])
  return auto_record.Record(
      auto_choice=best, auto_candidates=table, source='prior',
      cost_device=jax.devices()[0].device_kind, prior_file=path or priors_path(),
      prior_run=rec.get('run'), prior_batch=rec['batch'], batch=batch, not_in_prior=missing,
      created=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))


def probe(target, drafters: dict, prompt_ids: list[list[int]], options, batch: int, tok,
          log=print) -> auto_record.Record:
  """Every candidate's predicted tokens/s from its probe (module docstring): the record
  `choose` remembers."""
  settings = options_lib.generation_settings(options, tok.eos_ids, tok.pad_id)
  longest = options_lib.width(prompt_ids, options)
  limit = runner_lib.cache_limit(target, longest, options.max_new_tokens, options.cache_len,
                                 options.prompt_width)
  params = {'target': target.params, **{n: p for n, (_, p) in drafters.items()}}
  probe_settings = dataclasses.replace(settings,
                                       max_new_tokens=min(PROBE_TOKENS, options.max_new_tokens))
  fixed = {k: v for k, v in options.spec.items()  # the request's own knobs (the cap is not one)
           if v is not None and k != 'tree_budget'}
  specs, cands, fields = {}, candidates(drafters, node_cap(options)), {}
  context = runner_lib.round_up(longest, runner_lib.PROMPT_BUCKET)
  for label, method, knobs in cands:
    if method != 'ar':
      cfgs = {n: drafters[n][0] for n in options_lib.drafters_needed(method)}
      # (an adaptive tree: with this machine's costs per shape, measured and cached)
      fields[label] = runner_lib.with_adaptive_costs(
          target, drafters, method,
          {**options_lib.request_kind(options, method), **fixed, **knobs}, batch, context, log)
      specs[label] = SP.SpecSettings(settings, method=method, **fields[label], **cfgs)
  probed = {}
  probe_ids = prompt_ids[:PROBE_PROMPTS]
  width = options_lib.width(probe_ids, options)  # one program per candidate, every probe prompt
  for label, method, knobs in cands:
    runner = runner_lib.make_runner(target, probe_settings, method, width, limit, drafters,
                                    **fields.get(label, {}))
    # The first prompt warms the programs up (a first run pays one-off costs): it counts for
    # E[τ], and the cycle time comes from the others.
    _, warm = runner_lib.decode_prompts(runner, tok, probe_ids[:1], 1, options.seed, width)
    _, st = runner_lib.decode_prompts(runner, tok, probe_ids[1:] or probe_ids, 1, options.seed,
                                    width)
    hist = None if method == 'ar' or warm['hist'] is None else (
        warm['hist'] + st['hist'] if len(probe_ids) > 1 else st['hist'])
    probed[label] = (hist, st['decode_s'], st['decode_steps'])
  # The cost model only for probes too short to time (it costs minutes on a big target).
  short = [label for label, (_, _, steps) in probed.items() if steps < auto_record.MIN_PROBE_CYCLES]
  costs = None
  if short:
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
  ar_ms = table['ar']['cycle_ms']
  for row in table.values():
    row['cycle_ar_steps'] = round(row['cycle_ms'] / ar_ms, 4)
  best = max(table, key=lambda k: table[k]['predicted_tokens_per_s'])
  digest = hashlib.sha256(json.dumps(probe_ids).encode()).hexdigest()[:16]
  return auto_record.Record(
      auto_choice=best, auto_candidates=table, source='probed', batch=batch,
      predicted_tokens_per_s=table[best]['predicted_tokens_per_s'],
      cost_device=costs.device if costs else jax.devices()[0].device_kind,
      probed_on={'prompts': len(probe_ids), 'prompt_ids_sha256': digest,
                 'max_new_tokens': probe_settings.max_new_tokens},
      created=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()))


# ----------------------------------------------------------------------------------------------
# The remembered choice


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
      'context': context_window(longest + options.max_new_tokens),
      'version': auto_record.VERSION}
  return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_remembered(path: str, drafters: dict, log, cap: int = 0) -> auto_record.Record | None:
  """The record at `path` if it is whole and names a configuration still weighed, else None
  (with a line saying why, when a file was there)."""
  if not os.path.exists(path):
    return None
  try:
    record = auto_record.Record.load(path)
  except auto_record.RecordError as e:
    log(f'auto: the remembered choice {path} is unreadable ({e}); choosing again')
    return None
  weighed = {label: (method, knobs) for label, method, knobs in candidates(drafters, cap)}
  row = record.chosen()
  if (set(record.auto_candidates) | set(record.not_in_prior) != set(weighed) or
      (row['method'], row['spec']) != weighed[record.auto_choice]):
    log(f'auto: the remembered choice {path} weighed other configurations; choosing again')
    return None
  return record

"""The one generation path: `generate(target, drafters, prompts, options)`.

decode.py's config (`run`) and the notebook API's keywords (`Decoder.generate`) both become an
`Options` and go through `generate`, so they share the defaults, the checks, the compiled
programs and the stats. decode.py prints the completions, then, as its last stdout line, one
JSON object of stats (timings exclude compilation):
  method, target, prompts, new_tokens, compile_s, prefill_s, decode_s, decode_tokens_per_s, ..."""
from __future__ import annotations

import dataclasses
import json
import sys

import ml_collections

from d2sd_jax.decode import auto_policy
from d2sd_jax.decode import options as options_lib
from d2sd_jax.decode import quality_route
from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.decode.options import Options
from d2sd_jax.formats import loaders
from d2sd_jax.models import sharding
from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import drafters as drafter_formats
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.spec_decode import drafting

def tokenizer_of(target: loaders.Target):
  if target.tokenizer is None:
    raise ValueError(f'target {target.source!r} has no tokenizer (tokenizer.json): a decoder '
                     'needs one')
  return target.tokenizer


def generate(target: loaders.Target, drafters: dict, prompts: str | list[str], options: Options,
             runners: dict | None = None, auto_note: str = '') -> tuple[list[dict], dict]:
  """Completes each prompt: the one path of decode.py and Decoder.generate.

  drafters: {'drafter1': (DrafterConfig, params), ...} (those the method needs, at least);
  runners: a dict keeping compiled programs across calls (a Decoder's), or None; auto_note:
  said in method='auto''s line (why some drafters were left out).
  Returns (one {'prompt', 'completion', 'completion_ids'} per prompt, stats)."""
  options_lib.check(options, drafters)
  prompts = [prompts] if isinstance(prompts, str) else list(prompts)
  if not prompts:
    raise ValueError('no prompts: give a string or a non-empty list of strings')
  tok = tokenizer_of(target)
  prompt_ids = [tok.encode_prompt(p, options.chat, options.chat_template_kwargs)
                for p in prompts]
  longest = options_lib.width(prompt_ids, options)
  limit = runner_lib.cache_limit(target, longest, options.max_new_tokens, options.cache_len,
                                 options.prompt_width)
  batch = options.batch_size or min(len(prompts), options_lib.AUTO_BATCH)
  runners = {} if runners is None else runners
  policy, compile_s, routed = None, 0.0, {}
  if options.method == 'auto' and options.quality_budget:
    # (lossy by request: dflash at the measured frontier's point within the budget)
    options, routed = quality_route.route(options, log=lambda line: print(line, file=sys.stderr))
  if options.method == 'auto':  # (auto_policy.py: which candidate decodes each batch)
    # (its lines go to stderr: stdout carries the completions and the stats line)
    policy = auto_policy.Policy.start(target, drafters, prompt_ids, options, batch, tok,
                                      log=lambda line: print(line, file=sys.stderr),
                                      note=auto_note)
    compile_s += policy.time_first(lambda timing, label: _time_candidate(
        target, drafters, timing, tok, prompt_ids[:batch], longest, limit, batch, runners,
        label), batch)
  learns = policy is not None and policy.learns
  step = batch if learns else len(prompt_ids)
  ids, st, budgeted_cycles = [], None, 0
  for start in range(0, len(prompt_ids), step):
    options = policy.options if policy else options
    runner = _runner(target, drafters, options, tok, longest, limit, batch, runners)
    before = runner.compile_s
    part_ids, part = runner_lib.decode_prompts(runner, tok, prompt_ids[start:start + step], batch,
                                               options.seed, width=longest, first_row=start,
                                               max_new=options.max_new_tokens)
    compile_s += runner.compile_s - before
    ids += part_ids
    tokens = sum(map(len, part_ids)) - len(part_ids)  # the first of each row is the prefill's
    if learns and options.method == 'ar':
      part['cycles'] = tokens  # (an AR step commits one token)
    st = part if st is None else runner_lib.add_stats(st, part)
    if options.method != 'ar' and drafting.REGISTRY[options.method].budgeted:
      budgeted_cycles += part['cycles']
    if learns:
      policy.observe({'decode_tokens': tokens, 'cycles': part['cycles'],
                      'decode_s': part['decode_s'], 'decode_steps': part['decode_steps'],
                      'prompt_ids': prompt_ids[start:start + step], 'completion_ids': part_ids},
                     len(part_ids), batch, more=len(ids) < len(prompt_ids))
  completions = [{'prompt': p, 'completion': tok.decode([t for t in row if t not in tok.eos_ids]),
                  'completion_ids': row} for p, row in zip(prompts, ids)]
  new_tokens = sum(len(row) for row in ids)
  decode_tokens = new_tokens - len(prompts)  # each row's first token comes from the prefill
  decode_s, decode_steps = st['decode_s'], st['decode_steps']
  stats = {
      'method': options.method, 'prompts': len(prompts), 'batch_size': batch,
      'new_tokens': new_tokens, 'compile_s': round(compile_s, 3),
      'prefill_s': round(st['prefill_s'], 4), 'decode_s': round(decode_s, 4),
      'decode_tokens_per_s': round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
      'decode_steps': decode_steps,
      'ms_per_decode_step': round(1e3 * decode_s / decode_steps, 3) if decode_steps else None,
  }
  if options.method != 'ar' or st['cycles']:
    # tau: tokens committed per verification cycle, bonus included (AR would be 1; AR's part of
    # an auto request counts one cycle per token).
    cycles = st['cycles']
    stats.update(cycles=cycles, tau=round(decode_tokens / cycles, 3) if cycles else None)
    if st['hist'] is not None:
      stats['accepted_histogram'] = [int(h) for h in st['hist']]
  if budgeted_cycles:
    # what the trees' own scores predicted τ to be: a check of their calibration
    stats['expected_tau'] = round(1.0 + st['expected'] / budgeted_cycles, 3)
  if st.get('node_tally') is not None:  # spec.tally_nodes: [sources][depths][bins][3]
    stats['node_tally'] = st['node_tally'].tolist()
  if options.method != 'ar' and st['cycles']:
    stats['mean_tree_size'] = round(st['nodes'] / st['cycles'], 3)  # (adaptive: as chosen)
    if 'lookup_only' in st:  # spec.lookup_cycles: the share of cycles that verified lookup alone
      stats['lookup_only_share'] = round(st['lookup_only'] / st['cycles'], 3)
  if options.method != 'ar':
    stats.update(gamma=runner.settings.gamma, tree_size=runner.settings.tree_size)
    if options.stage_times:  # three more programs to compile: only on request
      stats['stage_ms'] = runner.stage_times(*st['first_batch'])
  if policy:
    stats.update(policy.stats())
  stats.update(routed)
  return completions, stats


def _time_candidate(target, drafters, options, tok, prompt_ids, longest, limit, batch, runners,
                    label: str):
  """auto_policy.AR_TIMING_TOKENS tokens of candidate `label` (decoding with `options`, its
  own) on one batch: (what they measured, for Record.learn; the seconds compiling).

  The program runs twice and the second run is timed: a compiled program's first run pays a
  one-off cost, large against 32 steps, that would make every other candidate look faster
  than it."""
  # (the request's runner, decoding fewer tokens: the timing compiles nothing of its own)
  runner = _runner(target, drafters, options, tok, longest, limit, batch, runners)
  max_new = min(auto_policy.AR_TIMING_TOKENS, options.max_new_tokens)
  before = runner.compile_s
  runner_lib.decode_prompts(runner, tok, prompt_ids, batch, options.seed, width=longest,
                            max_new=max_new)
  ids, t = runner_lib.decode_prompts(runner, tok, prompt_ids, batch, options.seed, width=longest,
                                     max_new=max_new)
  tokens = sum(map(len, ids)) - len(ids)
  return ({'decode_tokens': tokens, 'cycles': tokens if label == 'ar' else t['cycles'],
           'decode_s': t['decode_s'], 'decode_steps': t['decode_steps'],
           # (only AR's tokens teach prompt lookup: the others repeat them)
           **({'prompt_ids': prompt_ids[:batch], 'completion_ids': ids}
              if label == 'ar' else {})}, runner.compile_s - before)


def _runner(target, drafters, options, tok, longest, limit, batch, runners: dict):
  """A compiled runner for these options, kept in `runners`: one already made whose bound on
  new tokens covers options.max_new_tokens (a call with another length compiles nothing), or
  a new one with the bound `runner_lib.new_tokens_bound` gives."""
  settings = options_lib.generation_settings(options, tok.eos_ids, tok.pad_id)
  spec = options_lib.spec_fields(options, drafters)
  block = runner_lib.round_up(longest, runner_lib.PROMPT_BUCKET)
  # A runner's decode loop compiles for one batch shape: the batch is part of the key.
  key = (options.method, settings.eos_ids, settings.pad_id, settings.sampling, block, limit,
         batch, tuple(sorted(spec.items())))
  made = runners.setdefault(key, {})  # bound -> runner
  fits = [b for b in made if b >= options.max_new_tokens]
  if fits:
    return made[min(fits)]
  bound = runner_lib.new_tokens_bound(options.max_new_tokens, block, limit)
  # an adaptive tree: this machine's cycle cost at each shape it may choose (measured once,
  # cached)
  spec = runner_lib.with_adaptive_costs(target, drafters, options.method, spec, batch, block,
                                        log=lambda line: print(line, file=sys.stderr))
  made[bound] = runner_lib.make_runner(
      target, dataclasses.replace(settings, max_new_tokens=bound), options.method, longest,
      limit, drafters, **spec)
  return made[bound]


def _drafters_for(target, config, options, wanted) -> tuple[list[str], str]:
  """(the drafters to load, a note for auto's line). Drafters not made for the target: with
  method='auto' and the shipped drafters (the config's defaults), auto weighs the methods that
  need none; otherwise an error naming the flags that fix it."""
  misfit = {n: m for n in wanted if (m := drafter_formats.target_mismatch(config[n], target))}
  if not misfit:
    return list(wanted), ''
  if options.method == 'auto' and all(drafter_formats.is_shipped(config[n]) for n in misfit):
    # (drafter 2 alone drafts nothing: it goes with drafter 1)
    kept = [] if 'drafter1' in misfit else [n for n in wanted if n not in misfit]
    made_for = ', '.join(sorted({_recorded_target(config[n]) for n in misfit}))
    return kept, (f'the shipped drafters are for {made_for}, not this target, so auto weighs '
                  + ('the methods that need none (ar, pld)' if not kept else 'no drafter 2') +
                  '; to train drafters for it: docs/training.md, "Your own target"')
  name, why = next(iter(misfit.items()))
  raise ValueError(f'--config.{name}={config[name]}: {why}. Give drafters for this target '
                   '(--config.drafter1=PATH --config.drafter2=PATH) or decode without them '
                   '(--config.method=pld)')


def _recorded_target(path: str) -> str:
  try:
    return repr(checkpoints.read_drafter_config(checkpoints.resolve_path(path))[1].get('target'))
  except (OSError, ValueError):
    return 'another target'


def run(config: ml_collections.ConfigDict, out=sys.stdout) -> dict:
  """decode.py: checks, loads the target and the method's drafters, generates, reports."""
  options = options_lib.validate(config)
  prompts = options_lib.read_prompts(config)
  sharding.maybe_initialize_distributed(config.get('distributed', False))
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.model) if 'mesh' in config else None
  with sharding.tracing_under(mesh):
    return _generate(config, options, prompts, mesh, out)


def _generate(config, options, prompts, mesh, out) -> dict:
  split = mesh is not None and mesh.size > 1  # tensor parallel: weights split over 'model'
  target = loaders.load_target(config.target, config.dtype, mesh if split else None)
  tokenizer_of(target)
  drafters = {}
  wanted = ([n for n in options_lib.DRAFTERS if config.get(n)] if options.method == 'auto' else
            options_lib.drafters_needed(options.method))
  wanted, auto_note = _drafters_for(target, config, options, wanted)
  for name in wanted:
    dcfg, dparams, _ = load_drafter(config[name], target, config.dtype,
                                         mesh if split else None)
    drafters[name] = (dcfg, dparams)
  completions, stats = generate(target, drafters, prompts, options, auto_note=auto_note)
  for i, row in enumerate(completions):
    print(f'=== [{i}] {row["prompt"]!r}\n{row["completion"]}', file=out)
  if config.output:
    with open(config.output, 'w') as f:
      for row in completions:
        f.write(json.dumps(row) + '\n')
  stats = {'method': stats['method'], 'target': config.target, **stats}
  print(json.dumps(stats), file=out)
  return stats

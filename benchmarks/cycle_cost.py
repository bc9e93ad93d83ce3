"""What each stage of a speculative cycle costs, as a ratio to one AR decode step of the same run.

  python benchmarks/cycle_cost.py [--repeats 15] [--prompt_tokens 400] [--batch 100]
      [--json PATH] [--quick] [--xla OPTION=VALUE ...]

Batch 1, greedy, the SmolLM2 target and the shipped drafters after a real prefill (a HumanEval
prompt, plain completion, cut to --prompt_tokens): verification of 8 and 16 nodes, drafting
(d2sd with K = 4, dflash for reference), acceptance alone and acceptance + commit, each divided
by one greedy AR step. Then batch --batch (100) at T = 0.6, top_k = 2, on the same target
after a 64-token context (the first tokens of the first --batch HumanEval prompts; a shorter
cache fits memory): a sampled AR step against a greedy one, and prompt lookup's acceptance
against its verification. Every figure is the median of --repeats runs of a compiled program
(block_until_ready) that runs the stage 8 times in one `lax.fori_loop`, as the decode loop runs
it: stages that write a cache run on the last iteration's output, updated in place, and no
figure includes a program call's dispatch (about 1 ms here, as much as acceptance itself).
Prints a table with the goals, then one JSON line;
--json also writes the figures to a file. --quick: a tiny random target and drafters, batch 8,
3 repeats (a smoke test of this script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
from spec_decode import humaneval_prompts  # pylint: disable=wrong-import-position

from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position
from d2sd_jax.models import drafter as drafter_lib  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import ar as AR  # pylint: disable=wrong-import-position
from d2sd_jax.formats import loaders  # pylint: disable=wrong-import-position
from d2sd_jax.models import target as model_lib  # pylint: disable=wrong-import-position
from d2sd_jax.models import sampling as sampling_lib  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import speculative as SP  # pylint: disable=wrong-import-position
from d2sd_jax.formats.drafters import load_drafter

SAMPLED = sampling_lib.SamplingSettings(temperature=0.6, top_k=2)
# (figure, what it is divided by, goal: at most this ratio)
GOALS = {
    'verify_8': ('ar_step', 1.6), 'verify_16': ('ar_step', 2.5),
    'draft_d2sd_k4': ('ar_step', 1.0), 'draft_dflash': ('ar_step', None),
    'accept_pld_8': ('ar_step', None), 'accept_commit_pld_8': ('ar_step', 0.1),
    'accept_d2sd_16': ('ar_step', None), 'accept_commit_d2sd_16': ('ar_step', 0.1),
    'ar_step_sampled_b': ('ar_step_greedy_b', 1.3),
    'accept_pld_sampled_b': ('verify_pld_sampled_b', 0.2),
    'accept_commit_pld_sampled_b': ('verify_pld_sampled_b', None),
}


LOOP = costmodel.LOOP_ITERS  # iterations of a stage per timed program (as costmodel.measure)
COMPILER_OPTIONS: dict[str, str] = {}  # --xla: XLA options every timed program is compiled with


class Stage:
  """A stage timed as LOOP iterations of one `lax.fori_loop` program, as the decode loop runs
  it (one program: no per-call dispatch, caches updated in place). `run()` times one program
  call and returns the time per iteration (seconds, until ready).

  step(carry) -> carry. Stages that update a cache carry it (each iteration runs on the last
  one's output, donated). The others carry `tick`, a float scalar their inputs depend on
  through `unknown_false(tick)` (so XLA cannot hoist the stage out of the loop) and their
  output feeds back into (so it is computed)."""

  def __init__(self, step, carry, inputs):
    # `inputs` (everything else the stage reads) are arguments: closed-over arrays would be
    # compile-time constants, which XLA may fold (a stage computed at compile time).
    self.fn = jax.jit(lambda c, a: jax.lax.fori_loop(0, LOOP, lambda i, x: step(x, a), c),
                      donate_argnums=(0,), compiler_options=COMPILER_OPTIONS or None)
    self.inputs = inputs
    self.out = jax.block_until_ready(self.fn(carry, inputs))  # compiles, warms up

  def run(self) -> float:
    t = time.perf_counter()
    self.out = jax.block_until_ready(self.fn(self.out, self.inputs))
    return (time.perf_counter() - t) / LOOP


def unknown_false(tick):
  """A traced False: `tick` never reaches 1e30, but the compiler cannot know it."""
  return tick > 1e30


def tick_of(tick, tree) -> jax.Array:
  """The next tick: depends on every array of `tree` (float `0 *` is not folded away)."""
  return tick + sum(0.0 * jnp.sum(x).astype(jnp.float32) for x in jax.tree.leaves(tree)
                    if x is not None)


def paired_ms(stage: Stage, reference: Stage, repeats: int) -> tuple[float, float]:
  """Median ms of a stage and of its reference, run alternately: the load of a shared CPU
  shifts over minutes, and the ratio of the two medians compares them under the same load."""
  times = np.asarray([(stage.run(), reference.run()) for _ in range(repeats)])
  return tuple(1e3 * np.median(times, axis=0))


def _bumped(params, tick):
  """The bundle with each drafter's mask embedding made to depend on `tick` (unchanged)."""
  bump = lambda d: dict(d, mask_embed=jnp.where(unknown_false(tick), 0.0, d['mask_embed']))
  return {k: bump(v) if k.startswith('drafter') else v for k, v in params.items()}


def cycle_stages(params, cfg, settings, state, names) -> dict[str, Stage]:
  """The cycle's stages on one post-prefill state, each its own loop program."""
  draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
  verify = jax.jit(SP.verify, static_argnames=('cfg', 'settings'))
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  tree = draft(params, cfg, settings, state)
  verified = verify(params, cfg, settings, state, tree)
  _, accept_key_B = state.cycle_keys
  tick = lambda: jnp.zeros((), jnp.float32)  # a fresh one per stage (it is donated)

  # Each step reads (params, state, tree, verified, accept key) as loop-invariant arguments.
  def draft_step(t, a):
    p, st, _, _, _ = a
    return tick_of(t, SP.draft(_bumped(p, t), cfg, settings, st))

  def verify_step(carry, a):  # the logits, features and new K/V feed the tick: all computed
    (cache, t), (p, st, tr, _, _) = carry, a
    v = SP.verify(p, cfg, settings, st.replace(cache=cache), tr)
    return cache, tick_of(t, (v.logits_BxTxV, v.features, v.new_kv))

  def accept_step(t, a):
    _, _, tr, v, key = a
    bumped = tr.replace(tokens_BxT=tr.tokens_BxT + unknown_false(t).astype(jnp.int32))
    acc = SP.accept(settings, bumped, v, key)
    return tick_of(t, (acc.accept_len_B, acc.bonus_B, acc.path_BxC))

  def accept_commit_step(carry, a):  # the rest of the new state feeds the tick
    (cache, draft_caches, t), (p, st, tr, v, _) = carry, a
    out = SP.accept_and_commit(p, settings, st.replace(cache=cache, draft_caches=draft_caches),
                               tr, v)
    return out.cache, out.draft_caches, tick_of(t, out.replace(cache=None, draft_caches=None))

  inputs = (params, state, tree, verified, accept_key_B)
  make = {
      'draft': lambda: Stage(draft_step, tick(), inputs),
      'verify': lambda: Stage(verify_step, (copy(state.cache), tick()), inputs),
      'accept': lambda: Stage(accept_step, tick(), inputs),
      'accept_commit': lambda: Stage(
          accept_commit_step, copy((state.cache, state.draft_caches)) + (tick(),), inputs),
  }
  return {name: make[name]() for name in names}


def ar_stage(params, cfg, gen, prompt_BxP, lens_B, cache_size) -> Stage:
  """decode_step after the prefill, each iteration on the last one's state (one token each)."""
  B = prompt_BxP.shape[0]
  prefill = jax.jit(AR.prefill, static_argnames=('cfg', 'settings', 'cache_size'))
  state = prefill(params, cfg, gen, prompt_BxP, lens_B, AR.row_keys(0, range(B)), cache_size)
  return Stage(lambda s, p: AR.decode_step(p, cfg, gen, s), state, params)


def spec_state(bundle, cfg, settings, prompt_BxP, lens_B, cache_size):
  B = prompt_BxP.shape[0]
  return jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size'))(
      bundle, cfg, settings, prompt_BxP, lens_B, AR.row_keys(0, range(B)), cache_size)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def load(quick: bool):
  """(target cfg, params, drafter 1 (cfg, params), drafter 2 (cfg, params), prompts as ids,
  what was loaded)."""
  if quick:
    cfg = model_lib.ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                head_dim=8, d_ff=48)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0), scale=1.2)
    dcfg = drafter_lib.DrafterConfig(gamma=8, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
                                     head_dim=8, d_ff=48, feature_layers=(0, 2))
    d1 = drafter_lib.init_params(dcfg, cfg, jax.random.PRNGKey(1))
    d2 = drafter_lib.init_params(dcfg, cfg, jax.random.PRNGKey(2))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, 96).tolist() for _ in range(8)]
    return cfg, params, (dcfg, d1), (dcfg, d2), prompts, 'tiny random target and drafters'
  target = loaders.load_target('smollm2')
  d1cfg, d1, _ = load_drafter('drafters/smollm2-drafter1', target)
  d2cfg, d2, _ = load_drafter('drafters/smollm2-drafter2', target)
  prompts = [target.tokenizer.encode_prompt(p, chat=False) for p in humaneval_prompts(164)]
  return (target.cfg, target.params, (d1cfg, d1), (d2cfg, d2), prompts,
          'smollm2 (float32) + drafters/smollm2-drafter1, -drafter2')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=15)
  parser.add_argument('--prompt_tokens', type=int, default=400,
                      help='batch-1 context: the longest HumanEval prompt, cut to this')
  parser.add_argument('--new_tokens', type=int, default=128,
                      help='batch-1 cache room after the prompt (as decode.py sizes it)')
  parser.add_argument('--batch', type=int, default=100, help='0: skip the batch figures')
  parser.add_argument('--batch_context', type=int, default=64)
  parser.add_argument('--json', default='', help='also write the figures to this file')
  parser.add_argument('--quick', action='store_true', help='tiny target: a smoke test')
  parser.add_argument('--xla', action='append', default=[], metavar='OPTION=VALUE',
                      help='an XLA compiler option for every timed program (repeatable), e.g. '
                      'xla_cpu_experimental_ynn_fusion_type= (matmuls without YNNPACK)')
  args = parser.parse_args()
  for option in args.xla:
    if '=' not in option:
      parser.error(f'--xla {option}: give OPTION=VALUE (VALUE may be empty)')
    key, value = option.split('=', 1)
    COMPILER_OPTIONS[key] = value
  if args.quick:
    args.repeats, args.batch, args.prompt_tokens, args.new_tokens = 3, 8, 96, 16
    args.batch_context = 32

  cfg, params, (d1cfg, d1), (d2cfg, d2), prompts, loaded = load(args.quick)
  # As decoding.SpecRunner runs them (drafter heads and key/value rows gathered once); the AR
  # step reads the same target, as decoding.ARRunner does.
  bundle = SP.prepare({'target': params, 'drafter1': d1, 'drafter2': d2}, cfg)
  gamma, R = d1cfg.gamma, args.repeats
  ms, ref_ms = {}, {}  # figure -> its median; the median of its reference, run alternately

  # Batch 1, greedy, a long real context; every stage alternates with the AR step.
  prompt = max(prompts, key=len)[:args.prompt_tokens]
  gen = AR.GenerationSettings(max_new_tokens=args.new_tokens, eos_ids=(), pad_id=0)
  block, lens = AR.pad_prompts([prompt], 0, bucket=64)
  # One cache size for every program, as decode.py sizes it (an AR row stops advancing after
  # new_tokens and goes on doing the same work at the same position).
  cache_size = _round_up(block.shape[1] + args.new_tokens + 64, 64)
  ar = ar_stage(params, cfg, gen, block, lens, cache_size)
  ar_times = []

  def measure(name, stage):
    ms[name], ref_ms[name] = paired_ms(stage, ar, R)
    ar_times.append(ref_ms[name])

  spec = lambda method, **kw: SP.SpecSettings(gen, method=method, gamma=gamma, drafter1=d1cfg,
                                              drafter2=d2cfg, **kw)
  for nodes in (8, 16):
    settings = spec('d2sd', n_branches=4, tree_budget=nodes)
    stages = cycle_stages(bundle, cfg, settings,
                          spec_state(bundle, cfg, settings, block, lens, cache_size),
                          ('verify', 'accept', 'accept_commit') + (('draft',) if nodes == 16
                                                                   else ()))
    measure(f'verify_{nodes}', stages['verify'])
    measure(f'accept_d2sd_{nodes}', stages['accept'])
    measure(f'accept_commit_d2sd_{nodes}', stages['accept_commit'])
    if nodes == 16:
      measure('draft_d2sd_k4', stages['draft'])
  settings = spec('dflash')
  stages = cycle_stages(bundle, cfg, settings,
                        spec_state(bundle, cfg, settings, block, lens, cache_size), ('draft',))
  measure('draft_dflash', stages['draft'])
  settings = spec('pld')
  stages = cycle_stages(bundle, cfg, settings,
                        spec_state(bundle, cfg, settings, block, lens, cache_size),
                        ('accept', 'accept_commit'))
  measure('accept_pld_8', stages['accept'])
  measure('accept_commit_pld_8', stages['accept_commit'])
  ms['ar_step'] = float(np.median(ar_times))
  del ar, stages

  # Batch B at T > 0, a short context (--batch 0: skipped).
  B = args.batch
  cache_b = 0
  if B:
    rows = [p[:args.batch_context] for p in (prompts * B)[:B]]
    block_b, lens_b = AR.pad_prompts(rows, 0, bucket=32)
    cache_b = _round_up(block_b.shape[1] + R + 2 * gamma + 2, 32)
    ar_b = {}
    for name, sampling in (('greedy', sampling_lib.SamplingSettings()), ('sampled', SAMPLED)):
      gen_b = AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0, sampling=sampling)
      ar_b[name] = ar_stage(params, cfg, gen_b, block_b, lens_b, cache_b)
    ms['ar_step_sampled_b'], ms['ar_step_greedy_b'] = paired_ms(ar_b['sampled'], ar_b['greedy'],
                                                                R)
    ref_ms['ar_step_sampled_b'] = ms['ar_step_greedy_b']
    del ar_b
    gen_b = AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0, sampling=SAMPLED)
    settings = SP.SpecSettings(gen_b, method='pld', gamma=gamma)
    state = spec_state({'target': bundle['target']}, cfg, settings, block_b, lens_b, cache_b)
    stages = cycle_stages({'target': bundle['target']}, cfg, settings, state,
                          ('verify', 'accept', 'accept_commit'))
    ms['accept_pld_sampled_b'], verify_a = paired_ms(stages['accept'], stages['verify'], R)
    ms['accept_commit_pld_sampled_b'], verify_b = paired_ms(stages['accept_commit'],
                                                            stages['verify'], R)
    ms['verify_pld_sampled_b'] = float(np.median([verify_a, verify_b]))
    ref_ms['accept_pld_sampled_b'], ref_ms['accept_commit_pld_sampled_b'] = verify_a, verify_b

  figures = {}
  print(f'{loaded}; batch-1 context {int(lens[0])} tokens, cache {cache_size}' +
        (f'; batch {B}: context <= {args.batch_context}, cache {cache_b}, '
         f'T={SAMPLED.temperature} top_k={SAMPLED.top_k}' if B else '') +
        f'; medians of {R}, each figure run alternately with what it is divided by' +
        (f'; XLA options {COMPILER_OPTIONS}' if COMPILER_OPTIONS else ''))
  print(f'{"figure":30s} {"ms":>9s} {"ratio":>7s}  {"to (ms, same pairing)":30s} {"goal":>6s}  met')
  for name in ('ar_step', 'verify_8', 'verify_16', 'draft_d2sd_k4', 'draft_dflash',
               'accept_pld_8', 'accept_commit_pld_8', 'accept_d2sd_16', 'accept_commit_d2sd_16',
               'ar_step_greedy_b', 'ar_step_sampled_b', 'verify_pld_sampled_b',
               'accept_pld_sampled_b', 'accept_commit_pld_sampled_b'):
    if name not in ms:
      continue
    base, goal = GOALS.get(name, (None, None))
    ratio = ms[name] / ref_ms[name] if base else None
    met = None if goal is None else bool(ratio <= goal)
    figures[name] = {'ms': round(ms[name], 3), 'ratio': None if ratio is None else round(ratio, 3),
                     'ratio_to': base, 'ratio_to_ms': round(ref_ms[name], 3) if base else None,
                     'goal': goal, 'met': met}
    batch = lambda n: n[:-2] + f'_b{B}' if n.endswith('_b') else n
    to = f'{batch(base)} ({ref_ms[name]:.2f})' if base else ''
    print(f'{batch(name):30s} {ms[name]:9.2f} ' +
          (f'{ratio:7.3f}' if base else f'{"":7s}') + f'  {to:30s}' +
          (f' {"<=" + str(goal):>6s}  {"yes" if met else "NO"}' if goal else ''))
  summary = {'summary': 'cycle_cost', 'loaded': loaded, 'batch': B, 'repeats': R,
             'context_tokens': int(lens[0]), 'cache_size': cache_size, 'batch_cache_size': cache_b,
             'sampled': {'temperature': SAMPLED.temperature, 'top_k': SAMPLED.top_k},
             'xla_options': COMPILER_OPTIONS,
             'figures': figures}
  print(json.dumps(summary))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(summary, f, indent=1)


if __name__ == '__main__':
  main()

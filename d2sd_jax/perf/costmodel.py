"""What each stage of a speculative cycle costs on a device: measured here, or predicted for
hardware we cannot run on.

Measured (`measure`), on the state after a prefill of `context` tokens (median of repeats):
  - as the decode loop runs them: the AR step and each drafting configuration's whole cycle
    (speculative.spec_step), each timed as LOOP_ITERS iterations of one jitted lax.fori_loop,
    so the KV cache is updated in place as in the real while_loop. A program called on its own
    returns a fresh copy of the state (cache included) every call, whose allocation and copy
    made an AR step 35 % dearer than inside the loop;
  - the parts, each compiled and timed alone (with that overhead; for the breakdown and for
    tree sizes not measured as a whole cycle): a verification pass of T nodes for T in a grid
    (speculative.verify), each drafting configuration's draft (speculative.draft), and
    acceptance + commit of T nodes (speculative.accept_and_commit).
Every program is timed in turns (`_medians_s`: a run of each, round after round), so a drift
of the machine's speed during the measurement weighs on every figure alike and the ratios an
adaptive tree chooses by hold. The result is cached as JSON under
~/.cache/d2sd_jax/costs/ (D2SD_COST_CACHE overrides), keyed by the device kind, the target's and
drafters' shapes and dtypes, the batch, the context and what was measured; `--force` measures
again.

Predicted (`predict`): the same programs lowered (not run) at any target's shapes with abstract
parameters (jax.eval_shape: no weights needed), their FLOPs from XLA's cost analysis and the bytes
they must read counted directly (weights, plus the KV cache and drafter context that attention
reads; XLA's pre-optimisation byte count over-counts), against a chip's peak FLOP/s and memory
bandwidth, each derated by an attainable fraction:
    t = max(FLOPs / (peak · flop_eff), bytes / (bandwidth · bw_eff)) + launch overhead.

  python scripts/costmodel.py measure --drafter1 drafters/smollm2-drafter1 \\
      --drafter2 drafters/smollm2-drafter2
  python scripts/costmodel.py predict --chip h200 --target qwen3-8b
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax import files
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import drafting
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import xla_options
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_flops: float  # dense bf16 FLOP/s, the vendor's figure
  bandwidth: float  # memory bytes/s, the vendor's figure
  flop_eff: float = 0.6  # attainable fraction of peak FLOP/s for these mid-sized matmuls
  bw_eff: float = 0.8  # attainable fraction of bandwidth for streaming weights
  launch_s: float = 20e-6  # per-program overhead (kernel launches of one fused step)


CHIPS = {
    'h200': Chip('NVIDIA H200 SXM', 989e12, 4.8e12),
    'h100': Chip('NVIDIA H100 SXM', 989e12, 3.35e12),
    'tpu-v5e': Chip('TPU v5e', 197e12, 819e9),
    'tpu-v5p': Chip('TPU v5p', 459e12, 2.765e12),
}

# Public targets and the drafters the papers pair with them, by shape only (no weights).
TARGETS = {
    'qwen3-8b': model_lib.ModelConfig(vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                                      n_kv_heads=8, head_dim=128, d_ff=12288, rope_base=1e6,
                                      norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
                                      max_position=40960, dtype='bfloat16'),
    'llama-3.1-8b': model_lib.ModelConfig(vocab_size=128256, d_model=4096, n_layers=32,
                                          n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336,
                                          rope_base=5e5, tie_embeddings=False,
                                          max_position=131072, dtype='bfloat16'),
}



def machine(device: bool = True) -> str:
  """What ran a measurement: CPU count and model, OS, the JAX version and (device=True) the
  JAX device it ran on; kept with every recorded result."""
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    pass
  out = f'{os.cpu_count()} x {cpu}, {platform.system()}, jax {jax.__version__}'
  return out + f' on {jax.devices()[0].device_kind}' if device else out


def paper_drafter(tcfg: model_lib.ModelConfig, gamma: int = 16) -> drafter_lib.DrafterConfig:
  """DFlash's drafter for an 8B target: 5 target-width layers, 5 feature layers."""
  L = tcfg.n_layers
  return drafter_lib.DrafterConfig(
      gamma=gamma, n_layers=5, d_model=tcfg.d_model, n_heads=tcfg.n_heads,
      n_kv_heads=tcfg.n_kv_heads, head_dim=tcfg.head_dim, d_ff=tcfg.d_ff,
      feature_layers=tuple(int(round(x)) for x in np.linspace(1, L - 1, 5)),
      rope_base=tcfg.rope_base, norm_eps=tcfg.norm_eps, dtype=tcfg.dtype)


@dataclasses.dataclass
class CycleCosts:
  """Seconds per program on one device (one batch of `batch` rows, `context` cached tokens)."""
  device: str
  batch: int
  context: int
  ar_step: float
  verify: dict  # tree nodes T -> s
  accept: dict  # tree nodes T -> s (acceptance + commit)
  draft: dict  # draft_key(...) -> s
  cycles: dict = dataclasses.field(default_factory=dict)  # cycle_key(spec) -> s, in the loop

  def at(self, table: str, nodes: int) -> float:
    """verify / accept cost of `nodes` nodes, linear between the measured sizes."""
    by_size = getattr(self, table)  # int keys (from_json converts them)
    sizes = sorted(by_size)
    return float(np.interp(nodes, sizes, [by_size[k] for k in sizes]))

  def cycle(self, spec: SP.SpecSettings) -> float:
    """One verification cycle of `spec`: as measured inside the loop when it was, else
    draft + verify + accept from the parts."""
    if cycle_key(spec) in self.cycles:
      return self.cycles[cycle_key(spec)]
    return (self.draft[draft_key(spec)] + self.at('verify', spec.tree_size) +
            self.at('accept', spec.tree_size))

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self),
            'verify': {str(k): v for k, v in self.verify.items()},
            'accept': {str(k): v for k, v in self.accept.items()}}

  @classmethod
  def from_json(cls, d: dict) -> CycleCosts:
    return cls(**{**d, 'verify': {int(k): v for k, v in d['verify'].items()},
                  'accept': {int(k): v for k, v in d['accept'].items()}})


def draft_key(spec: SP.SpecSettings) -> str:
  """What a draft's cost depends on: the method, the block, K, the denoising steps and the
  branches' re-drafting passes (named only beyond one)."""
  passes = f':passes={spec.branch_passes}' if spec.branch_passes > 1 else ''
  return f'{spec.method}:G={spec.gamma}:K={spec.n_branches}:steps={spec.steps}{passes}'


def cycle_key(spec: SP.SpecSettings) -> str:
  """What a whole cycle's cost depends on: the draft and the verified tree's size."""
  return f'{draft_key(spec)}:T={spec.tree_size}'


LOOP_ITERS = 8  # iterations per timed loop program (its one copy of the state is amortised)


def loop_program(step):
  """jit((state, inputs) -> LOOP_ITERS applications of `step(state, inputs)` in one
  lax.fori_loop), the timed loops here and in benchmarks/matmul_layout.py. The weights come
  in as `inputs`, arguments: closed over, they would be compile-time constants that XLA may
  fold (work done at compile time, not timed)."""
  return jax.jit(lambda s, a: jax.lax.fori_loop(0, LOOP_ITERS, lambda i, x: step(x, a), s),
                 compiler_options=xla_options.for_platform(jax.devices()[0].platform))


def _medians_s(timed: dict, repeats: int) -> dict:
  """Each program's median seconds over `repeats` runs, after one warm run each, taken in
  turns: one run of every program, then the next round. A shared machine's speed drifts by
  tens of percent within minutes; timed in turns, the drift weighs on every figure alike, so
  the ratios between them hold (n nodes against m, a lookup-only cycle against a drafted one:
  what an adaptive tree chooses by), where timing each program's runs back to back put the
  drift between programs."""
  for fn in timed.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in timed}
  for _ in range(repeats):
    for k, fn in timed.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


def _chain_spec(gen, nodes: int) -> SP.SpecSettings:
  return SP.SpecSettings(gen, method='pld', gamma=nodes)


def _synthetic_prompt(vocab_size: int, batch: int, context: int):
  rng = np.random.default_rng(0)
  ids = rng.integers(1, vocab_size, (batch, context)).tolist()
  return ar.pad_prompts(ids, 0, bucket=64)


def cache_dir() -> str:
  return os.environ.get('D2SD_COST_CACHE',
                        os.path.join(os.path.expanduser('~'), '.cache', 'd2sd_jax', 'costs'))


def _cache_key(tcfg, params, specs, batch, context, sizes) -> str:
  dev = jax.devices()[0]
  shapes = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), params)
  blob = json.dumps([dev.platform, dev.device_kind, len(jax.devices()), repr(tcfg),
                     repr(shapes), sorted(draft_key(s) + repr((s.drafter1, s.drafter2))
                                          for s in specs), batch, context, list(sizes),
                     jax.__version__, 'turns-v5'], sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def measure(params: dict, tcfg: model_lib.ModelConfig, specs: list[SP.SpecSettings],
            batch: int = 1, context: int = 512, sizes=(2, 4, 8, 16, 32, 64), repeats: int = 7,
            use_cache: bool = True, log=print) -> CycleCosts:
  """Times this machine's programs (see the module docstring). `params`: {'target', and the
  drafters the specs need}; `specs`: the drafting configurations to time (their tree sizes are
  interpolated in `sizes`)."""
  key = _cache_key(tcfg, params, specs, batch, context, sizes)
  path = os.path.join(cache_dir(), f'{key}.json')
  if use_cache and os.path.exists(path):
    with open(path) as f:
      return CycleCosts.from_json(json.load(f))
  max_gamma = max((s.gamma for s in specs), default=1)
  # (rows never finish inside a timed loop: every iteration does a full step's work)
  gen = ar.GenerationSettings(max_new_tokens=LOOP_ITERS * max_gamma + 8, eos_ids=(), pad_id=0)
  block, lens = _synthetic_prompt(tcfg.vocab_size, batch, context)
  keys = ar.row_keys(0, range(batch))
  cache_size = context + 64 + LOOP_ITERS * max_gamma + max(
      max(sizes), max((s.tree_size for s in specs), default=0))
  log(f'measuring cycle costs on {jax.devices()[0].device_kind} (batch {batch}, context '
      f'{context}); cached in {path}')

  ar_params = params['target']  # as decoding.ARRunner runs it
  params = SP.prepare(params, tcfg)  # as decoding.SpecRunner runs the speculative programs
  prefill = jax.jit(ar.prefill, static_argnames=('cfg', 'settings', 'cache_size'))
  ar_state = prefill(ar_params, tcfg, gen, block, lens, keys, cache_size)
  ar_loop = loop_program(lambda s, p: ar.decode_step(p, tcfg, gen, s))
  timed = {('ar',): lambda: ar_loop(ar_state, ar_params)}  # what to time, by (kind, key)

  init = jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size'))
  verify = jax.jit(SP.verify, static_argnames=('cfg', 'settings'))
  accept = jax.jit(SP.accept_and_commit, static_argnames=('settings',))
  draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
  target_only = {'target': params['target']}
  for T in sizes:
    spec = _chain_spec(gen, T)
    state = init(target_only, tcfg, spec, block, lens, keys, cache_size)
    tree = tree_lib.chain(state.anchor_B, jnp.zeros((batch, T - 1), jnp.int32),
                          jnp.ones((batch, T - 1), bool))
    v = verify(target_only, tcfg, spec, state, tree)
    timed['verify', T] = lambda sp=spec, st=state, tr=tree: verify(target_only, tcfg, sp, st, tr)
    timed['accept', T] = lambda sp=spec, st=state, tr=tree, v=v: accept(target_only, sp, st, tr,
                                                                         v)
  for spec in specs:
    spec = dataclasses.replace(spec, generation=gen)
    bundle = {n: params[n] for n in ('target',) + spec.drafters}
    state = init(bundle, tcfg, spec, block, lens, keys, cache_size)
    loop = loop_program(lambda s, b, sp=spec: SP.spec_step(b, tcfg, sp, s))
    timed['draft', draft_key(spec)] = lambda sp=spec, b=bundle, st=state: draft(b, tcfg, sp, st)
    timed['cycle', cycle_key(spec)] = lambda lp=loop, b=bundle, st=state: lp(st, b)
  seconds = _medians_s(timed, repeats)
  ar_step = seconds['ar',] / LOOP_ITERS
  verify_s, accept_s, draft_s, cycle_s = ({k[1]: v for k, v in seconds.items() if k[0] == kind}
                                          for kind in ('verify', 'accept', 'draft', 'cycle'))
  cycle_s = {k: v / LOOP_ITERS for k, v in cycle_s.items()}
  costs = CycleCosts(device=jax.devices()[0].device_kind, batch=batch, context=context,
                     ar_step=ar_step, verify=verify_s, accept=accept_s, draft=draft_s,
                     cycles=cycle_s)
  files.write_json(path, costs.to_json())
  return costs


# ----------------------------------------------------------------------------------------------
# Prediction for other hardware


def _abstract(fn, *args):
  return jax.eval_shape(fn, *args)


def _program_flops(fn, static, *args) -> float:
  lowered = jax.jit(fn, static_argnums=static).lower(*args)
  cost = lowered.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost.get('flops', 0.0))


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _kv_bytes(n_layers, n_kv_heads, head_dim, tokens, batch, dtype) -> int:
  return 2 * n_layers * n_kv_heads * head_dim * tokens * batch * jnp.dtype(dtype).itemsize


def predict(tcfg: model_lib.ModelConfig, chip: Chip, specs: list[SP.SpecSettings],
            batch: int = 1, context: int = 1024, sizes=(1, 16, 32, 64, 96)) -> CycleCosts:
  """Roofline costs of the same programs at `tcfg`'s shapes on `chip` (module docstring)."""
  gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  tparams = _abstract(lambda: model_lib.init_params(tcfg, jax.random.PRNGKey(0)))
  tparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, tcfg.jnp_dtype), tparams)
  w_bytes = _nbytes(tparams)
  cache_size = context + 128
  block = jax.ShapeDtypeStruct((batch, context), jnp.int32)
  lens = jax.ShapeDtypeStruct((batch,), jnp.int32)
  keys = jax.ShapeDtypeStruct((batch, 2), jnp.uint32)

  def roofline(flops, nbytes):
    return max(flops / (chip.peak_flops * chip.flop_eff),
               nbytes / (chip.bandwidth * chip.bw_eff)) + chip.launch_s

  kv_read = _kv_bytes(tcfg.n_layers, tcfg.n_kv_heads, tcfg.head_dim, context, batch, tcfg.dtype)
  ar_state = _abstract(lambda p, b, l, k: ar.prefill(p, tcfg, gen, b, l, k, cache_size),
                       tparams, block, lens, keys)
  ar_flops = _program_flops(ar.decode_step, (1, 2), tparams, tcfg, gen, ar_state)
  ar_step = roofline(ar_flops, w_bytes + kv_read)
  verify_s, accept_s, draft_s, cycle_s = {}, {}, {}, {}
  for T in sizes:
    T = max(T, 2)
    spec = _chain_spec(gen, T)
    state = _abstract(lambda p, b, l, k: SP.init_state({'target': p}, tcfg, spec, b, l, k,
                                                       cache_size), tparams, block, lens, keys)
    tree = _abstract(lambda s: tree_lib.chain(s.anchor_B, jnp.zeros((batch, T - 1), jnp.int32),
                                              jnp.ones((batch, T - 1), bool)), state)
    flops = _program_flops(SP.verify, (1, 2), {'target': tparams}, tcfg, spec, state, tree)
    verify_s[T] = roofline(flops, w_bytes + kv_read)
    accept_s[T] = chip.launch_s  # fixed-shape tree math: negligible next to a target pass
  for spec in specs:
    spec = dataclasses.replace(spec, generation=gen)
    dparams = {}
    for name in spec.drafters:
      dcfg = getattr(spec, name)
      dparams[name] = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, dcfg.layer_config(1).jnp_dtype)
          if jnp.issubdtype(x.dtype, jnp.floating) else x,
          _abstract(lambda: drafter_lib.init_params(dcfg, tcfg, jax.random.PRNGKey(0))))
    bundle = {'target': tparams, **dparams}
    state = _abstract(lambda p, b, l, k: SP.init_state(p, tcfg, spec, b, l, k, cache_size),
                      bundle, block, lens, keys)
    flops = _program_flops(SP.draft, (1, 2), bundle, tcfg, spec, state)
    # Each drafter pass reads its weights, its rows of the target's LM head (all of them, or
    # the head_vocab rows decoding gathers once) and its context K/V.
    nbytes = 0
    for name in drafting.drafter_passes(spec):
      dcfg = getattr(spec, name)
      head = ((dcfg.head_vocab or tcfg.vocab_size) * tcfg.d_model *
              jnp.dtype(tcfg.dtype).itemsize)
      nbytes += _nbytes(dparams[name]) + head + _kv_bytes(
          dcfg.n_layers, dcfg.n_kv_heads, dcfg.head_dim, context, batch, tcfg.dtype)
    draft_s[draft_key(spec)] = roofline(flops, nbytes) * max(spec.steps, 1)
  return CycleCosts(device=chip.name, batch=batch, context=context, ar_step=ar_step,
                    verify=verify_s, accept=accept_s, draft=draft_s)


def table(costs: CycleCosts) -> str:
  ar_s = costs.ar_step
  lines = [f'{costs.device}, batch {costs.batch}, context {costs.context}',
           f'  AR step                {1e3 * ar_s:9.3f} ms   1.00 AR steps']
  for T in sorted(costs.verify):
    lines.append(f'  verify {T:3d} nodes       {1e3 * costs.verify[T]:9.3f} ms  '
                 f'{costs.verify[T] / ar_s:5.2f}')
  for T in sorted(costs.accept):
    lines.append(f'  accept {T:3d} nodes       {1e3 * costs.accept[T]:9.3f} ms  '
                 f'{costs.accept[T] / ar_s:5.2f}')
  for k, v in costs.draft.items():
    lines.append(f'  draft {k:28s} {1e3 * v:9.3f} ms  {v / ar_s:5.2f}')
  return '\n'.join(lines)

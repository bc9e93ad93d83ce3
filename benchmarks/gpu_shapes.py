"""The GPU check that needs no weights: a target of Qwen3-8B's shapes with random bfloat16
weights (a step's speed does not depend on the values) and the paper's drafters, its AR step
and its dflash and d2sd cycles timed on this machine's accelerator, beside what predicts them.

  python benchmarks/gpu_shapes.py [--target qwen3-8b] [--batch 1,8] [--context 1024] \\
      [--chip h100] [--repeats 5] [--json OUT]
  python benchmarks/gpu_shapes.py --tiny --chip h100   # the rehearsal on a CPU, tiny shapes

Per batch, after a prefill of --context random tokens, each program runs
costmodel.LOOP_ITERS times in one jitted lax.fori_loop, its state updated in place as in the
decode loop (costmodel.loop_program; the median of --repeats):
  ar     one AR step (ar.decode_step), against its memory roofline: the bytes it must read
         (the floor of d2sd_jax/perf/floors.py: the target's weights, its LM head, the
         embedding rows and the KV over the context) over the chip's bandwidth
         (costmodel.CHIPS: --chip, or the device's kind) and over the bandwidth an XLA
         reduction reaches here;
  dflash, d2sd  one speculative cycle (speculative.spec_step) of the paper's drafters (5 layers,
         gamma 16, K = 4), in AR steps, and against its own floor.
Beside them, the predictions for the same programs at the same shapes: the roofline of
`costmodel.predict` for the chip, and the TPU compiler's cycle estimates in AR steps for one v5p
chip at that batch (results/tpu_compile.json, benchmarks/tpu_compile.py --record), where kept.
Prints a table and writes it all, with the date, machine and command, to --json.
--tiny: a 6-layer target of width 256 (vocabulary 4,096), context 64: the same code on a CPU in
a minute (tests/cli/test_gpu_session.py), not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
from ar_decode import memory_bandwidth_gbs  # pylint: disable=wrong-import-position

from d2sd_jax import files  # pylint: disable=wrong-import-position
from d2sd_jax.models import drafter as drafter_lib  # pylint: disable=wrong-import-position
from d2sd_jax.models import target as model_lib  # pylint: disable=wrong-import-position
from d2sd_jax.perf import compiled as C  # pylint: disable=wrong-import-position
from d2sd_jax.perf import floors  # pylint: disable=wrong-import-position
from d2sd_jax.perf import tpu_records  # pylint: disable=wrong-import-position
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import ar  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import speculative as SP  # pylint: disable=wrong-import-position

TINY = model_lib.ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2,
                             head_dim=64, d_ff=512, qk_norm=True, dtype='bfloat16')
METHODS = ('dflash', 'd2sd')
TPU_RECORD = os.path.join(ROOT, 'results', 'tpu_compile.json')


def chip_for(name: str | None, device_kind: str):
  """costmodel.CHIPS entry: `name` if given, else the one whose model the device's kind names
  (an 'NVIDIA H100 80GB HBM3' is h100); None when neither (a CPU)."""
  if name:
    if name not in costmodel.CHIPS:
      raise SystemExit(f'--chip {name!r}: give one of {sorted(costmodel.CHIPS)}')
    return name
  kind = device_kind.lower()
  return next((n for n in costmodel.CHIPS if not n.startswith('tpu') and n in kind), None)


def random_bundle(tcfg, dcfg, seed: int = 0) -> dict:
  """{'target', 'drafter1', 'drafter2'}: random parameters made on the device (no host copy of
  an 8B model), drafter floats in the target's dtype."""
  kt, k1, k2 = jax.random.split(jax.random.key(seed), 3)
  target = jax.jit(lambda k: model_lib.init_params(tcfg, k))(kt)

  def drafter(k):
    p = drafter_lib.init_params(dcfg, tcfg, k)
    return jax.tree.map(lambda x: x.astype(tcfg.jnp_dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, p)
  make = jax.jit(drafter)
  return {'target': target, 'drafter1': make(k1), 'drafter2': make(k2)}


def spec_for(method: str, dcfg, gen) -> SP.SpecSettings:
  """The method's settings as benchmarks/tpu_compile.py compiles them (compiled.spec_settings)."""
  return C.spec_settings(method, gen, {'drafter1': dcfg, 'drafter2': dcfg})


def time_programs(bundle: dict, tcfg, dcfg, batch: int, context: int, repeats: int) -> dict:
  """Seconds of one AR step and of each method's cycle, inside a loop as the decode runs them."""
  gen = ar.GenerationSettings(max_new_tokens=costmodel.LOOP_ITERS * dcfg.gamma + 8, eos_ids=(),
                              pad_id=0)  # (rows never finish inside a timed loop)
  block, lens = costmodel._synthetic_prompt(tcfg.vocab_size, batch, context)  # pylint: disable=protected-access
  keys = ar.row_keys(0, range(batch))
  out = {}
  cache = -(-(block.shape[1] + gen.max_new_tokens) // 64) * 64
  state = jax.jit(ar.prefill, static_argnames=('cfg', 'settings', 'cache_size'))(
      bundle['target'], tcfg, gen, block, lens, keys, cache)
  loop = costmodel.loop_program(lambda s, p: ar.decode_step(p, tcfg, gen, s))
  # (one program at a time, its state freed before the next: Qwen3-8B's caches are large)
  median = lambda fn: costmodel._medians_s({0: fn}, repeats)[0]  # pylint: disable=protected-access
  out['ar'] = median(lambda: loop(state, bundle['target']))
  del state
  prepared = SP.prepare(bundle, tcfg)
  init = jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size'))
  for method in METHODS:
    spec = spec_for(method, dcfg, gen)
    params = {n: prepared[n] for n in ('target',) + spec.drafters}
    state = init(params, tcfg, spec, block, lens, keys,
                 SP.cache_size_needed(block.shape[1], spec))
    loop = costmodel.loop_program(lambda s, b, sp=spec: SP.spec_step(b, tcfg, sp, s))
    out[method] = median(lambda: loop(state, params))
    del state
  return {m: s / costmodel.LOOP_ITERS for m, s in out.items()}


def floors_bytes(tcfg, dcfg, batch: int, context: int) -> dict:
  """Bytes each program must read at the least, on one device (perf/floors.py)."""
  mesh = C.sharding.make_mesh(1, 1, jax.devices()[:1])
  gen = C.generation_settings(16)
  out = {'ar': sum(floors.floors('step', tcfg, {}, None, mesh, batch, context).values())}
  for method in METHODS:
    spec = spec_for(method, dcfg, gen)
    dcfgs = {n: dcfg for n in spec.drafters}
    out[method] = sum(floors.floors('step', tcfg, dcfgs, spec, mesh, batch, context).values())
  return out


def predictions(tcfg, dcfg, chip: str | None, batch: int, context: int, target: str) -> dict:
  """{'roofline': {method: s}} for the chip (costmodel.predict), and {'tpu_compiler_ar_steps':
  {method: cycle / AR step}} of a v5p chip where results/tpu_compile.json keeps this case."""
  out = {}
  if chip is not None:
    gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
    specs = [spec_for(m, dcfg, gen) for m in METHODS]
    costs = costmodel.predict(tcfg, costmodel.CHIPS[chip], specs, batch, context,
                              sizes=sorted({1, 16} | {s.tree_size for s in specs}))
    out['roofline'] = {'chip': chip, 'ar': costs.ar_step,
                       **{m: costs.cycle(s) for m, s in zip(METHODS, specs)}}
  kept = tpu_records.recorded(TPU_RECORD, 'TPU v5p', target, 'paper', batch, context)
  if kept is not None:
    est = tpu_records.step_estimates(kept)
    out['tpu_compiler_ar_steps'] = {
        m: est[m] / est['ar'] for m in METHODS if m in est and 'ar' in est}
    out['tpu_compiler_ar_steps']['libtpu'] = kept.get('toolchain', {}).get('libtpu')
  return out


def run(args) -> dict:
  tcfg = TINY if args.tiny else C.target_config(args.target, 'bfloat16')
  context = 64 if args.tiny else args.context
  dcfg = costmodel.paper_drafter(tcfg)
  device = jax.devices()[0]
  chip = chip_for(args.chip, device.device_kind)
  bandwidth = memory_bandwidth_gbs(nbytes=(64 << 20) if args.tiny else (1 << 30)) * 1e9
  print(f'{device.device_kind}: {"tiny target" if args.tiny else args.target}, random bfloat16 '
        f'weights; measured bandwidth {bandwidth / 1e9:.1f} GB/s; chip figures: {chip}',
        flush=True)
  bundle = random_bundle(tcfg, dcfg)
  rows = []
  for batch in (int(b) for b in args.batch.split(',')):
    t0 = time.perf_counter()
    secs = time_programs(bundle, tcfg, dcfg, batch, context, args.repeats)
    floor = floors_bytes(tcfg, dcfg, batch, context)
    row = {'batch': batch, 'context': context, 'seconds': secs, 'floor_bytes': floor,
           'ar_steps': {m: secs[m] / secs['ar'] for m in METHODS},
           'vs_measured_bandwidth': {m: secs[m] / (floor[m] / bandwidth) for m in secs},
           'predicted': predictions(tcfg, dcfg, chip, batch, context,
                                    'tiny' if args.tiny else args.target),
           'wall_s': time.perf_counter() - t0}
    if chip is not None:
      bw = costmodel.CHIPS[chip].bandwidth
      row['vs_chip_bandwidth'] = {m: secs[m] / (floor[m] / bw) for m in secs}
    rows.append(row)
    print(table_row(row), flush=True)
  return {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
          'machine': costmodel.machine(), 'command': ' '.join(
              ['python benchmarks/gpu_shapes.py', *sys.argv[1:]]),
          'target': 'tiny' if args.tiny else args.target, 'weights': 'random bfloat16',
          'drafters': 'paper', 'chip': chip, 'measured_bandwidth_gbs': bandwidth / 1e9,
          'rows': rows}


def table_row(row: dict) -> str:
  secs, pred = row['seconds'], row['predicted']
  roof = pred.get('roofline')
  tpu = pred.get('tpu_compiler_ar_steps', {})
  parts = [f"batch {row['batch']}: AR step {1e3 * secs['ar']:.2f} ms"]
  if 'vs_chip_bandwidth' in row:
    parts[-1] += f" ({row['vs_chip_bandwidth']['ar']:.2f}x its roofline at {roof['chip']}'s bandwidth"
    parts[-1] += f", {row['vs_measured_bandwidth']['ar']:.2f}x at the measured one)"
  else:
    parts[-1] += f" ({row['vs_measured_bandwidth']['ar']:.2f}x its roofline at the measured bandwidth)"
  for m in METHODS:
    beside = ([f"roofline {roof[m] / roof['ar']:.2f}"] if roof else []) + (
        [f'TPU compiler {tpu[m]:.2f}'] if m in tpu else [])
    parts.append(f"{m} cycle {row['ar_steps'][m]:.2f} AR steps" +
                 (f" ({', '.join(beside)})" if beside else ''))
  return '; '.join(parts)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--target', default='qwen3-8b', help='a costmodel.TARGETS name')
  parser.add_argument('--batch', default='1,8')
  parser.add_argument('--context', type=int, default=1024)
  parser.add_argument('--chip', default=None, help=f'one of {sorted(costmodel.CHIPS)} '
                      "(default: from the device's kind)")
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--tiny', action='store_true', help='rehearsal at tiny shapes (CPU)')
  parser.add_argument('--json', default=None)
  args = parser.parse_args()
  if args.target not in costmodel.TARGETS:
    raise SystemExit(f'--target {args.target!r}: give one of {sorted(costmodel.TARGETS)}')
  result = run(args)
  if args.json:
    files.write_json(args.json, result)


if __name__ == '__main__':
  main()

"""Cycle costs: measured on this machine (cached) or predicted for a chip from lowered programs:

  python scripts/costmodel.py measure [--drafter1 ... --drafter2 ...] [--force]
  python scripts/costmodel.py predict --chip h200 --target qwen3-8b
  python scripts/costmodel.py breakeven --chip tpu-v5p --target qwen3-8b [--mesh 1x8]

For TPU chips (tpu-v5e, tpu-v5p) predict takes the cycle costs the TPU compiler estimated for
the compiled programs, kept in results/tpu_compile.json by benchmarks/tpu_compile.py --record
(the single-chip record when there are several); without one, and for GPUs, the roofline.
"""
from __future__ import annotations

import argparse
import json
import os

from d2sd_jax.formats import loaders
from d2sd_jax.formats.drafters import load_drafter
from d2sd_jax.perf import compiled
from d2sd_jax.perf import tpu_records
from d2sd_jax.perf import costmodel
from d2sd_jax.perf import throughput
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import speculative as SP


RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'results',
                      'tpu_compile.json')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  sub = parser.add_subparsers(dest='cmd', required=True)
  m = sub.add_parser('measure', help='time this machine\'s programs (cached)')
  m.add_argument('--target', default='smollm2')
  m.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  m.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  m.add_argument('--batch', type=int, default=1)
  m.add_argument('--context', type=int, default=512)
  m.add_argument('--force', action='store_true', help='measure again, ignoring the cache')
  p = sub.add_parser('predict', help='roofline costs on a chip from lowered programs')
  p.add_argument('--chip', default='h200', choices=sorted(costmodel.CHIPS))
  p.add_argument('--target', default='qwen3-8b', choices=sorted(costmodel.TARGETS))
  p.add_argument('--batch', type=int, default=1)
  p.add_argument('--context', type=int, default=1024)
  p.add_argument('--tau', default='dflash=5.31,d2sd=7.05',
                 help='method=tau pairs: predicted speed-up over AR at these acceptance lengths '
                      '(default: the D2SD paper\'s Qwen3-8B means at T = 0)')
  b = sub.add_parser('breakeven', help='per batch, the tau above which each method beats AR, '
                     'from the TPU compiler\'s recorded cycle costs')
  b.add_argument('--chip', default='tpu-v5p', choices=sorted(
      n for n, c in costmodel.CHIPS.items() if c.name.startswith('TPU')))
  b.add_argument('--target', default='qwen3-8b')
  b.add_argument('--drafters', default='paper')
  b.add_argument('--mesh', default='1x1', help='DATAxMODEL, as recorded (1x8: v5e:2x4)')
  b.add_argument('--context', type=int, default=1024)
  b.add_argument('--tau', default='dflash=5.31,d2sd=7.05',
                 help='method=tau pairs: the speed-up at these acceptance lengths')
  args = parser.parse_args()
  if args.cmd == 'breakeven':
    print_breakeven(args)
    return
  if args.cmd == 'measure':
    target = loaders.load_target(args.target)
    d1cfg, d1, _ = load_drafter(args.drafter1, target)
    d2cfg, d2, _ = load_drafter(args.drafter2, target)
    gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
    specs = candidate_specs(gen, d1cfg, d2cfg)
    costs = costmodel.measure({'target': target.params, 'drafter1': d1, 'drafter2': d2}, target.cfg, specs,
                    args.batch, args.context, use_cache=not args.force)
  else:
    tcfg = costmodel.TARGETS[args.target]
    gen = ar.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
    d = costmodel.paper_drafter(tcfg)
    specs = {'dflash': SP.SpecSettings(gen, method='dflash', gamma=16, drafter1=d),
             'd2sd': SP.SpecSettings(gen, method='d2sd', gamma=16, drafter1=d, drafter2=d,
                                     n_branches=4)}
    chip = costmodel.CHIPS[args.chip]
    if chip.name.startswith('TPU'):
      kept = tpu_records.recorded(RECORD, chip.name, args.target, 'paper', args.batch,
                                  args.context)
      if kept is not None:
        print_compiled(kept, args.tau)
        return
      print(f'(no compiled {chip.name} figures for {args.target}, batch {args.batch}, context '
            f'{args.context} in {os.path.relpath(RECORD)}: the roofline below; python '
            'benchmarks/tpu_compile.py --topology ... --record compiles them)')
    costs = costmodel.predict(tcfg, chip, list(specs.values()), args.batch, args.context,
                    sizes=sorted({1, 16, 32, 64} | {s.tree_size for s in specs.values()}))
    print(costmodel.table(costs))
    for pair in filter(None, args.tau.split(',')):
      method, tau = pair.split('=')
      spec = specs[method]
      cycle = costs.cycle(spec)
      print(f'  {method}: tau {float(tau):.2f} over a {spec.tree_size}-node cycle of '
            f'{1e3 * cycle:.3f} ms -> predicted speed-up over AR '
            f'{throughput.tokens_per_s(float(tau), cycle) * costs.ar_step:.2f}x')
    return
  print(costmodel.table(costs))


def print_compiled(kept: dict, tau_pairs: str) -> None:
  """TPU cycle costs from the TPU compiler's estimates (benchmarks/tpu_compile.py --record)."""
  est = tpu_records.step_estimates(kept)
  print(f"{kept['chip']} ({kept['topology']}, mesh {kept['mesh']}), {kept['target']}, batch "
        f"{kept['batch']}, context {kept['context']}: the TPU compiler's estimates, libtpu "
        f"{kept.get('toolchain', {}).get('libtpu') or 'not recorded'} "
        f"({os.path.relpath(RECORD)}: {kept['date']}, `{kept['command']}`)")
  for method, s in est.items():
    print(f'  {method:8s} step {1e3 * s:9.3f} ms  {s / est["ar"]:5.2f} AR steps' +
          (f': beats AR where tau > {s / est["ar"]:.2f}' if method != 'ar' else ''))
  for pair in filter(None, tau_pairs.split(',')):
    method, tau = pair.split('=')
    if method in est:
      print(f'  {method}: tau {float(tau):.2f} over a cycle of {1e3 * est[method]:.3f} ms -> '
            f'predicted speed-up over AR '
            f'{throughput.tokens_per_s(float(tau), est[method]) * est["ar"]:.2f}x')


def print_breakeven(args) -> None:
  """The `breakeven` table: for every batch recorded for the chip, each method's cycle in AR
  steps (the tau above which it beats AR) and its speed-up at --tau."""
  chip = costmodel.CHIPS[args.chip].name
  with open(RECORD) as f:
    kept = json.load(f)
  table = tpu_records.breakeven(kept, chip, args.target, args.drafters, args.mesh, args.context)
  if not table:
    raise SystemExit(f'no compiled {chip} figures for {args.target} with drafters '
                     f'{args.drafters}, mesh {args.mesh}, context {args.context} in '
                     f'{os.path.relpath(RECORD)}: python benchmarks/tpu_compile.py --topology ... '
                     '--batch B --record compiles them')
  taus = dict((m, float(t)) for m, t in (p.split('=') for p in filter(None, args.tau.split(','))))
  print(f'{chip}, mesh {args.mesh}, {args.target}, drafters {args.drafters}, context '
        f'{args.context} ({os.path.relpath(RECORD)}): a cycle in AR steps is the tau above '
        'which the method beats AR')
  for batch, row in table.items():
    cells = []
    for method, c in row.items():
      tau = taus.get(compiled.method_of(method)[0])
      cells.append(f'{method} {c:.2f}' + (f' ({tau / c:.2f}x at tau {tau:g})' if tau else ''))
    print(f'  batch {batch:3d}: ' + ', '.join(cells))


def candidate_specs(gen, d1cfg, d2cfg) -> list[SP.SpecSettings]:
  """The drafting configurations `costmodel measure` times: prompt lookup, drafter 1 alone,
  and D2SD with K = 1, 2, 4 (one denoising step)."""
  specs = [SP.SpecSettings(gen, method='dflash', gamma=d1cfg.gamma, drafter1=d1cfg)]
  for K in (1, 2, 4):
    specs.append(SP.SpecSettings(gen, method='d2sd', gamma=d1cfg.gamma, drafter1=d1cfg,
                                 drafter2=d2cfg, n_branches=min(K, d1cfg.gamma - 1)))
  specs.append(SP.SpecSettings(gen, method='pld', gamma=d1cfg.gamma))
  return specs


if __name__ == '__main__':
  main()

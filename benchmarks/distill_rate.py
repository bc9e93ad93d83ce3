"""Distillation throughput: the old static batches against continuous batching, in one run.

  python benchmarks/distill_rate.py [--n 128] [--batch_sizes 64] [--length_bounds 128,448]

Both paths generate the SmolLM2 target's greedy responses (max 256 new tokens) to the same N
distillation prompts (`distill.training_prompts`, from --offset on):
  * old: what distill.py did before, static batches of --old_batch_size in shard order, each
    batch prefilled together and decoded until its longest row ends, one 704-slot cache;
  * new: `batching.Engine` per cache class (distill.py's path now): rows refilled as they end.
Prints one JSON line per path (generated tokens per second of wall time, compilation excluded;
compile seconds apart) and a summary line last with the ratio and how many responses agree.
The new path also reports `busy_tokens_per_s`: its rate until the last prompt took a row, while
every row was busy, which is what a long run (thousands of prompts, one tail) sustains; with
few prompts the tail (the last, longest rows running alone) weighs on the end-to-end figure.
"""
from __future__ import annotations

import argparse
import json
import time

import jax

from d2sd_jax.train import batching
from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.train import distill
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.formats import loaders


def old_path(target, settings, prompts, batch_size: int, cache_size: int):
  """distill.py before continuous batching (its loop, unchanged)."""
  runner = runner_lib.ARRunner(target, settings, cache_size)
  outs, t0 = [], time.perf_counter()
  for b in range(0, len(prompts), batch_size):
    rows_ids = prompts[b:b + batch_size]
    rows_ids = rows_ids + [rows_ids[0]] * (batch_size - len(rows_ids))
    block, lens = AR.pad_prompts(rows_ids, settings.pad_id, runner_lib.PROMPT_BUCKET)
    state, _, _ = runner(block, lens, AR.row_keys(0, range(batch_size)))
    out, count = jax.device_get((state.out_BxN, state.num_out_B))
    outs += [out[i, :count[i]].tolist() for i in range(min(batch_size, len(prompts) - b))]
  return outs, time.perf_counter() - t0 - runner.compile_s, runner.compile_s


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--n', type=int, default=128, help='prompts (both paths)')
  parser.add_argument('--offset', type=int, default=2560, help='first prompt (shard 40)')
  parser.add_argument('--max_new_tokens', type=int, default=256)
  parser.add_argument('--batch_sizes', default='64', help='new path, one run each')
  parser.add_argument('--old_batch_size', type=int, default=16)
  parser.add_argument('--length_bounds', default='128,448', help='new path: cache classes '
                      '(bounds on prompt tokens; several sets separated by ":", one run each)')
  parser.add_argument('--prompt_bucket', type=int, default=32, help='new path: prefill widths')
  parser.add_argument('--skip_old', action='store_true', help='time the new path alone')
  args = parser.parse_args()

  target = loaders.load_target('smollm2')
  tok = target.tokenizer
  rows = distill.encoded(distill.training_prompts(4096), tok, 448)
  prompts = [r['prompt_ids'] for r in rows[args.offset:args.offset + args.n]]
  settings = AR.GenerationSettings(max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids,
                                  pad_id=tok.pad_id)
  lens = sorted(len(p) for p in prompts)
  print(json.dumps({'prompts': len(prompts), 'prompt_tokens_median': lens[len(lens) // 2],
                    'prompt_tokens_max': lens[-1]}), flush=True)
  best, new = None, None
  for batch_size in (int(b) for b in args.batch_sizes.split(',')):
    for bounds in args.length_bounds.split(':'):
      bounds = tuple(int(b) for b in bounds.split(','))
      gen = batching.Generator(target.params, target.cfg, settings, batch_size, bounds,
                               args.prompt_bucket)
      t0 = time.perf_counter()
      outs = gen.complete(prompts)
      wall = time.perf_counter() - t0 - gen.compile_s
      stats = gen.stats()
      row = {'path': 'new', 'batch_size': batch_size, 'length_bounds': bounds,
             'tokens': sum(map(len, outs)), 'wall_s': round(wall, 1),
             'tokens_per_s': round(sum(map(len, outs)) / wall, 1),
             'busy_tokens_per_s': round(stats['busy_tokens'] / max(stats['busy_s'], 1e-9), 1),
             'compile_s': round(gen.compile_s, 1), **stats}
      print(json.dumps(row), flush=True)
      if new is not None and outs != new:
        print(json.dumps({'warning': 'configurations disagree', 'batch_size': batch_size}))
      new = outs
      if best is None or row['tokens_per_s'] > best['tokens_per_s']:
        best = row
  if args.skip_old:
    return
  old, old_s, old_compile = old_path(target, settings, prompts, args.old_batch_size, 704)
  old_row = {'path': 'old', 'batch_size': args.old_batch_size, 'tokens': sum(map(len, old)),
             'wall_s': round(old_s, 1), 'tokens_per_s': round(sum(map(len, old)) / old_s, 1),
             'compile_s': round(old_compile, 1)}
  print(json.dumps(old_row), flush=True)
  same = sum(a == b for a, b in zip(old, new))
  print(json.dumps({'summary': 'distill_rate', 'prompts': len(prompts),
                    'old_tokens_per_s': old_row['tokens_per_s'],
                    'new_tokens_per_s': best['tokens_per_s'], 'new_batch_size': best['batch_size'],
                    'new_length_bounds': best['length_bounds'],
                    'ratio': round(best['tokens_per_s'] / old_row['tokens_per_s'], 2),
                    'identical_responses': f'{same}/{len(prompts)}'}), flush=True)


if __name__ == '__main__':
  main()

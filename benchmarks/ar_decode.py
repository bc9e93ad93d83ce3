"""AR decode speed of the SmolLM2 target next to the memory roofline, measured in one run.

  python benchmarks/ar_decode.py [--new_tokens 128] [--batch_sizes 1,8] [--repeats 3]

Roofline = parameter bytes / memory bandwidth, the bandwidth measured here by XLA reading a
large array with all cores: a batch-1 decode step must stream every weight once, so it cannot be
faster. Prints one JSON line per measurement, and a summary line last.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.decode import runner as runner_lib
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as model_lib

PROMPT = 'Write a Python function that checks whether a string is a palindrome.'


def memory_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
  """Best-of-N read bandwidth of an XLA reduction over `nbytes` of float32."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    t = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return nbytes / best / 1e9


def decode_speed(target, batch_size: int, new_tokens: int, repeats: int) -> dict:
  tok = target.tokenizer
  ids = tok.encode_prompt(PROMPT, chat=True)
  settings = AR.GenerationSettings(max_new_tokens=new_tokens, eos_ids=(), pad_id=tok.pad_id)
  block, lens = AR.pad_prompts([ids] * batch_size, tok.pad_id, runner_lib.PROMPT_BUCKET)
  runner = runner_lib.ARRunner(target, settings, block.shape[1] + new_tokens)
  keys = AR.row_keys(0, range(batch_size))
  runner(block, lens, keys)  # compile and warm up
  times = []
  for _ in range(repeats):
    state, _, decode_s = runner(block, lens, keys)
    times.append(decode_s / int(state.steps))
  step_s = float(np.median(times))
  return {'batch_size': batch_size, 'ms_per_step': round(step_s * 1e3, 2),
          'tokens_per_s': round(batch_size / step_s, 1), 'compile_s': round(runner.compile_s, 1)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--batch_sizes', default='1,8')
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()

  target = loaders.load_target('smollm2')
  bandwidth = memory_bandwidth_gbs()
  weight_bytes = model_lib.param_bytes(target.params)
  roofline_ms = weight_bytes / (bandwidth * 1e9) * 1e3
  print(json.dumps({'memory_bandwidth_gbs': round(bandwidth, 2), 'param_mb': weight_bytes / 1e6,
                    'roofline_ms_per_token': round(roofline_ms, 2), 'devices': str(jax.devices())}))
  rows = []
  for b in (int(x) for x in args.batch_sizes.split(',')):
    row = decode_speed(target, b, args.new_tokens, args.repeats)
    row['step_vs_roofline'] = round(row['ms_per_step'] / roofline_ms, 2)
    rows.append(row)
    print(json.dumps(row))
  print(json.dumps({'summary': 'ar_decode', 'roofline_ms_per_token': round(roofline_ms, 2),
                    **{f'b{r["batch_size"]}_tokens_per_s': r['tokens_per_s'] for r in rows},
                    **{f'b{r["batch_size"]}_vs_roofline': r['step_vs_roofline'] for r in rows}}))


if __name__ == '__main__':
  main()

"""Continuous batching: every prompt's output is its plain AR decode alone, rows are refilled
the moment they end, and prompts are grouped into cache classes by length."""

import jax
import pytest

from d2sd_jax.train import batching
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.models import sampling as S

PROMPTS = [[5, 9, 2, 33, 7, 1, 60], [12], [40, 41, 42, 43], [7, 7, 7, 7, 7, 7, 7, 7, 7, 30],
           [3, 60, 2], [50, 1, 50, 2, 50, 3, 50, 4, 50, 5, 50, 6, 50], [9, 8]]
run = jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size'))


def alone(cfg, params, settings, prompt, row, seed=0):
  """Plain AR decoding of one prompt in a batch of its own (generate.generate)."""
  block, lens = AR.pad_prompts([prompt], settings.pad_id, bucket=16)
  state = run(params, cfg, settings, block, lens, AR.row_keys(seed, [row]),
              block.shape[1] + settings.max_new_tokens)
  return state.out_BxN[0, :state.num_out_B[0]].tolist()


def ideal_steps(lengths, batch_size):
  """Decode steps of a schedule that refills a row the moment it ends (a row's first token
  comes from its prefill, so a response of n tokens needs n - 1 steps)."""
  left, rows, steps = list(lengths), [], 0
  while left or rows:
    while left and len(rows) < batch_size:
      rows.append(left.pop(0) - 1)
    finished = [r for r in rows if r == 0]
    if not finished:
      n = min(rows)
      steps += n
      rows = [r - n for r in rows]
    rows = [r for r in rows if r > 0]
  return steps


def test_outputs_equal_ar_alone_with_eos_and_refills(tiny):
  cfg, params = tiny
  free = alone(cfg, params, AR.GenerationSettings(12, (), 0), PROMPTS[0], 0)
  settings = AR.GenerationSettings(max_new_tokens=12, eos_ids=(free[3],), pad_id=0)
  expected = [alone(cfg, params, settings, p, i) for i, p in enumerate(PROMPTS)]
  lengths = [len(e) for e in expected]
  # The check is only as good as its data: rows end at different times, some at the EOS.
  assert len(set(lengths)) >= 3 and 12 in lengths and min(lengths) < 12
  engine = batching.Engine(params, cfg, batching.BatchSettings(
      settings, batch_size=4, cache_size=32, prompt_bucket=16, min_tail_batch=1))
  done = []
  got = engine.complete(PROMPTS, on_done=lambda i, toks: done.append((i, toks)))
  assert got == expected
  assert sorted(done) == sorted(enumerate(expected))
  # A row is refilled as soon as it ends: exactly the steps of that schedule, no idle steps;
  # and the tail (no prompt left) ran in a smaller batch.
  assert engine.stats['decode_steps'] == ideal_steps(lengths, 4)
  assert engine.stats['tail_shrinks'] >= 1
  assert engine.stats['decode_steps'] < sum(lengths) - len(lengths)
  # The programs are reused: another order (other rows, other neighbours) gives the same
  # outputs and compiles nothing.
  compiled = engine.compile_s
  assert engine.complete(PROMPTS[::-1]) == expected[::-1]
  assert engine.compile_s == compiled


def test_sampled_rows_follow_their_prompt_keys(tiny):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=9, eos_ids=(3,), pad_id=0,
                                  sampling=S.SamplingSettings(temperature=1.5))
  rows = [11, 4, 7, 0, 2, 9, 5]
  engine = batching.Engine(params, cfg, batching.BatchSettings(settings, batch_size=2,
                                                               cache_size=32, prompt_bucket=16))
  got = engine.complete(PROMPTS, row_ids=rows, seed=3)
  assert got == [alone(cfg, params, settings, p, r, seed=3) for p, r in zip(PROMPTS, rows)]


def test_prompt_over_the_cache_is_refused(tiny):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0)
  engine = batching.Engine(params, cfg, batching.BatchSettings(settings, 2, cache_size=32))
  with pytest.raises(ValueError, match='prompt 1 has 13 tokens.*cache_size=32'):
    engine.complete([[1], [2] * 13])


def test_cache_classes():
  classes = batching.cache_classes([10, 130, 64, 65, 448, 1], 256, bounds=(128, 448))
  assert classes == [(384, [0, 2, 3, 5]), (704, [1, 4])]
  with pytest.raises(ValueError, match='prompt 1 has 449 tokens'):
    batching.cache_classes([3, 449], 256, bounds=(128, 448))

"""Autoregressive generation (d2sd_jax/spec_decode/ar.py): reference equivalence, batching, EOS,
seeded sampling, one program."""

import jax
import jax.numpy as jnp
import pytest

from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.models import sampling as S
from tests.helpers.programs import full_last_logits

run = jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size'))


def reference_greedy(cfg, params, prompt, n, eos_ids=()):
  """Greedy decoding by full recomputation: no cache, no batching, a Python loop."""
  seq, out = list(prompt), []
  for _ in range(n):
    token = int(jnp.argmax(full_last_logits(cfg, params, jnp.asarray([seq]))))
    out.append(token)
    seq.append(token)
    if token in eos_ids:
      break
  return out


def generate(cfg, params, prompts, settings, seed=0, rows=None):
  block, lens = AR.pad_prompts(prompts, settings.pad_id, bucket=8)
  keys = AR.row_keys(seed, range(len(prompts)) if rows is None else rows)
  state = run(params, cfg, settings, block, lens, keys, block.shape[1] + settings.max_new_tokens)
  return [state.out_BxN[b, :state.num_out_B[b]].tolist() for b in range(len(prompts))], state


PROMPTS = [[5, 9, 2, 33, 7, 1, 60], [12], [40, 41, 42, 43]]


def test_greedy_matches_full_recomputation(tiny):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=10, eos_ids=(), pad_id=0)
  outs, _ = generate(cfg, params, PROMPTS, settings)
  for prompt, out in zip(PROMPTS, outs):
    assert out == reference_greedy(cfg, params, prompt, 10)


@pytest.mark.parametrize('sampling', [S.SamplingSettings(),
                                      S.SamplingSettings(temperature=1.3, top_k=20, top_p=0.9)])
def test_batched_equals_per_prompt(tiny, sampling):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=9, eos_ids=(3,), pad_id=0, sampling=sampling)
  batched, _ = generate(cfg, params, PROMPTS, settings, seed=7)
  for r, prompt in enumerate(PROMPTS):
    single, _ = generate(cfg, params, [prompt], settings, seed=7, rows=[r])
    assert single[0] == batched[r]


def test_eos_stops_each_row_where_ar_does(tiny):
  cfg, params = tiny
  free = reference_greedy(cfg, params, PROMPTS[0], 12)
  eos = free[4]  # make the 5th greedy token an EOS for row 0
  settings = AR.GenerationSettings(max_new_tokens=12, eos_ids=(eos,), pad_id=0)
  outs, state = generate(cfg, params, PROMPTS, settings)
  assert outs[0] == free[:free.index(eos) + 1]
  for prompt, out in zip(PROMPTS, outs):
    assert out == reference_greedy(cfg, params, prompt, 12, eos_ids=(eos,))
  # Rows end padded; the loop stopped as soon as every row was done.
  assert all(t == 0 for t in state.out_BxN[0, len(outs[0]):].tolist())
  assert int(state.steps) == max(len(o) for o in outs) - 1


def test_same_seed_same_output_and_seeds_differ(tiny):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=12, eos_ids=(), pad_id=0,
                                  sampling=S.SamplingSettings(temperature=8.0))
  a, _ = generate(cfg, params, PROMPTS, settings, seed=1)
  b, _ = generate(cfg, params, PROMPTS, settings, seed=1)
  c, _ = generate(cfg, params, PROMPTS, settings, seed=2)
  assert a == b and a != c


def test_generation_runs_without_host_transfers(tiny):
  cfg, params = tiny
  settings = AR.GenerationSettings(max_new_tokens=6, eos_ids=(), pad_id=0)
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  keys = AR.row_keys(0, range(3))
  compiled = jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size')).lower(
      params, cfg, settings, block, lens, keys, 16).compile()
  # The decode loop is an XLA while loop inside the one program, not a Python loop.
  assert 'while' in compiled.as_text()
  with jax.transfer_guard('disallow'):
    state = compiled(params, block, lens, keys)
  assert state.num_out_B.tolist() == [6, 6, 6]


def test_invalid_generation_inputs():
  with pytest.raises(ValueError, match='max_new_tokens'):
    AR.GenerationSettings(max_new_tokens=0, eos_ids=(), pad_id=0)
  with pytest.raises(ValueError, match='empty prompt'):
    AR.pad_prompts([[1, 2], []], pad_id=0)

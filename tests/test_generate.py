"""Autoregressive generation: reference equivalence, batching, EOS, sampling laws, one program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.models import sampling as S
from spec_helpers import full_last_logits

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


# ----------------------------------------------------------------------------------------------
# Sampling transforms: exact distributions computed independently in numpy.


def expected_probs(logits, temperature, top_k, top_p):
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind='stable')
  keep = np.zeros_like(z, bool)
  if top_k:
    keep[order[:top_k]] = True
  else:
    keep[:] = True
  z = np.where(keep, z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  if top_p < 1:
    sorted_p = p[order]
    n_keep = int(np.searchsorted(np.cumsum(sorted_p), top_p) + 1)  # smallest set reaching top_p
    mask = np.zeros_like(keep)
    mask[order[:n_keep]] = True
    p = np.where(mask, p, 0)
    p /= p.sum()
  return p


@pytest.mark.parametrize('temperature,top_k,top_p', [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0),
                                                     (1.0, 0, 0.6), (2.0, 4, 0.8)])
def test_sampling_probs_match_definition(temperature, top_k, top_p):
  logits = jnp.asarray([1.0, 3.0, -2.0, 0.5, 2.5, 2.0, -1.0, 0.0])
  settings = S.SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
  np.testing.assert_allclose(S.probs(logits, settings), expected_probs(logits, temperature, top_k,
                                                                       top_p), atol=1e-6)


def test_samples_follow_the_distribution():
  logits = jnp.asarray([1.0, 3.0, -2.0, 0.5, 2.5, 2.0, -1.0, 0.0])
  settings = S.SamplingSettings(temperature=1.2, top_k=5, top_p=0.9)
  n = 40000
  draws = jax.vmap(lambda k: S.sample(k, logits, settings))(
      jax.random.split(jax.random.PRNGKey(0), n))
  counts = np.bincount(np.asarray(draws), minlength=8)
  p = expected_probs(logits, 1.2, 5, 0.9)
  assert counts[p == 0].sum() == 0
  support = p > 0
  chi2 = np.sum((counts[support] - n * p[support])**2 / (n * p[support]))
  assert chi2 < 20.5  # p ≈ 0.0004 for <= 4 degrees of freedom


def test_greedy_probs_are_one_hot():
  p = S.probs(jnp.asarray([0.1, 2.0, -1.0]), S.SamplingSettings())
  assert p.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize('kwargs,match', [({'temperature': -1.0}, 'temperature'),
                                          ({'top_k': -2}, 'top_k'), ({'top_p': 0.0}, 'top_p'),
                                          ({'top_p': 1.5}, 'top_p')])
def test_invalid_sampling_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    S.SamplingSettings(**kwargs)


def test_invalid_generation_inputs():
  with pytest.raises(ValueError, match='max_new_tokens'):
    AR.GenerationSettings(max_new_tokens=0, eos_ids=(), pad_id=0)
  with pytest.raises(ValueError, match='empty prompt'):
    AR.pad_prompts([[1, 2], []], pad_id=0)

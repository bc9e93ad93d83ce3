"""The sampler (d2sd_jax/models/sampling.py): the cheap sampler's argmax by blocks, top-p by
bisection, one-uniform draws by inverse CDF over blocks, exclusions, and p(token) without the
[N, V] law, against direct definitions; and the sampling transforms' laws (temperature, top-k,
top-p), exact distributions computed independently in numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.models import sampling as S


@pytest.mark.parametrize('form', ['argmax', '_argmax_reduction'])
@pytest.mark.parametrize('V', [64, 300, 1000, 49152])
def test_argmax_equals_jnp_argmax(V, form):
  """S.argmax (by blocks in a CPU program) and the reduction other platforms' programs take."""
  x = jax.random.normal(jax.random.PRNGKey(V), (4, 3, V))
  x = (x.at[0, 0, 5].set(jnp.nan).at[1, 1].set(-jnp.inf)  # a NaN, a row of -inf,
       .at[2, 2, V - 1].set(50.0).at[2, 2, 1].set(50.0))  # a tie: the first one wins
  x = x.at[3].set(jnp.round(x[3]))  # many ties
  x = x.at[0, 1, 7].set(jnp.inf).at[0, 1, 9].set(jnp.nan)  # +inf before a NaN: the +inf
  argmax = getattr(S, form)
  want = jnp.argmax(x, axis=-1).at[0, 1].set(7)
  np.testing.assert_array_equal(argmax(x), want)
  assert argmax(x).dtype == jnp.int32


@pytest.mark.parametrize('form', ['confidence_and_argmax', '_confidence_and_argmax_reduction'])
@pytest.mark.parametrize('temperature', [1.0, 0.6])
def test_confidence_and_argmax_equal_their_definitions(form, temperature):
  """max softmax(x / T) and the first argmax, in a CPU program's passes and in the one online
  reduction other platforms take: rows with forbidden (-inf) tokens, ties, wide spreads."""
  V = 3000
  x = 4.0 * jax.random.normal(jax.random.PRNGKey(3), (3, 5, V))
  x = x.at[0, :, :100].set(-jnp.inf)  # forbidden tokens
  x = x.at[1, 2, 17].set(40.0).at[1, 2, 2500].set(40.0)  # a tie: the first one wins
  x = x.at[2].set(jnp.round(x[2]))  # many ties
  x = x.at[1, 4].multiply(30.0)  # a spread that overflows exp without the max
  conf, pred = getattr(S, form)(x, temperature)
  np.testing.assert_allclose(conf, jnp.max(jax.nn.softmax(x / temperature, axis=-1), axis=-1),
                             rtol=2e-5)
  np.testing.assert_array_equal(pred, jnp.argmax(x, axis=-1))
  assert pred.dtype == jnp.int32


def chi2_pooled(counts, p):
  """Chi-square over cells expected >= 5 times (the rest pooled), and its degrees of freedom."""
  n = counts.sum()
  assert counts[p == 0].sum() == 0, 'a token of probability 0 was drawn'
  big = n * p >= 5
  stat = np.sum((counts[big] - n * p[big])**2 / (n * p[big]))
  rest_obs, rest_exp = counts[~big].sum(), n * p[~big].sum()
  if rest_exp > 0:
    stat += (rest_obs - rest_exp)**2 / rest_exp
  return stat, int(big.sum()) + (rest_exp > 0) - 1


@pytest.mark.parametrize('settings', [S.SamplingSettings(temperature=0.7),
                                      S.SamplingSettings(temperature=1.0, top_p=0.8),
                                      S.SamplingSettings(temperature=1.3, top_k=30, top_p=0.9)])
def test_draws_follow_probs_with_and_without_exclusions(settings):
  """V = 1000 > 2 blocks: the block-then-inside inverse CDF; with two tokens excluded, the
  renormalised rest (the bonus of rejected point-mass drafts)."""
  V, n = 1000, 100000
  logits = 2.0 * jax.random.normal(jax.random.PRNGKey(1), (V,))
  p = np.asarray(S.probs(logits, settings), np.float64)
  u = jax.random.uniform(jax.random.PRNGKey(2), (n,))
  draws = jax.jit(jax.vmap(lambda u: S.sample_uniform(u, logits, settings)))(u)
  stat, dof = chi2_pooled(np.bincount(np.asarray(draws), minlength=V), p)
  assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)
  gone = [int(np.argmax(p)), int(np.argsort(-p)[3])]
  exclude = jnp.asarray([gone[0], -1, gone[1]])
  draws = jax.jit(jax.vmap(lambda u: S.sample_uniform(u, logits, settings, exclude)))(u)
  rest = p.copy()
  rest[gone] = 0.0
  stat, dof = chi2_pooled(np.bincount(np.asarray(draws), minlength=V), rest / rest.sum())
  assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)


@pytest.mark.parametrize('top_p', [0.3, 0.9])
def test_nucleus_by_bisection_equals_the_sorted_definition(top_p):
  """Top-p without top-k keeps the smallest set of top tokens whose mass reaches top_p, as a
  float64 sort says (rows whose cut lies within float32 rounding of top_p are skipped)."""
  z = 3.0 * jax.random.normal(jax.random.PRNGKey(3), (6, 5000))
  kept = np.asarray(S.probs(z, S.SamplingSettings(temperature=1.0, top_p=top_p))) > 0
  checked = 0
  for row, zr in zip(kept, np.asarray(z, np.float64)):
    p = np.exp(zr - zr.max())
    p /= p.sum()
    order = np.argsort(-zr, kind='stable')
    mass = np.cumsum(p[order])
    n_keep = int(np.searchsorted(mass, top_p) + 1)
    if min(abs(mass[n_keep - 1] - top_p), abs(mass[max(n_keep - 2, 0)] - top_p)) < 1e-5:
      continue
    assert row.sum() == n_keep and row[order[:n_keep]].all()
    checked += 1
  assert checked >= 4


@pytest.mark.parametrize('settings', [S.SamplingSettings(), S.SamplingSettings(temperature=0.8),
                                      S.SamplingSettings(temperature=1.0, top_k=3),
                                      S.SamplingSettings(temperature=1.0, top_p=0.7)])
def test_token_probs_are_probs_at_the_tokens(settings):
  logits = jax.random.normal(jax.random.PRNGKey(4), (2, 5, 40))
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 5, 7), 0, 40)
  expected = jnp.take_along_axis(S.probs(logits, settings), tokens, axis=-1)
  np.testing.assert_allclose(S.token_probs(logits, tokens, settings), expected, atol=1e-6)


@pytest.mark.parametrize('top_k,top_p,temperature', [(10, 0.5, 0.7), (40, 0.9, 1.3)])
def test_top_k_then_top_p_equals_the_sorted_definition(top_k, top_p, temperature):
  """With both filters: temperature, then the top_k largest logits, then the smallest set of
  those (renormalised) whose mass reaches top_p, the token crossing top_p included; probs is
  that set's renormalised law (float64 reference, rows within rounding of top_p skipped)."""
  z = 2.0 * jax.random.normal(jax.random.PRNGKey(7), (8, 300))
  settings = S.SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
  got = np.asarray(S.probs(z, settings), np.float64)
  checked = 0
  for row, zr in zip(got, np.asarray(z, np.float64) / temperature):
    order = np.argsort(-zr, kind='stable')[:top_k]
    p = np.exp(zr[order] - zr[order].max())
    p /= p.sum()
    mass = np.cumsum(p)
    n_keep = int(np.searchsorted(mass, top_p) + 1)
    near = [abs(mass[i] - top_p) < 1e-5 for i in (n_keep - 1, n_keep - 2) if i >= 0]
    if any(near):
      continue
    want = np.zeros_like(row)
    want[order[:n_keep]] = p[:n_keep] / p[:n_keep].sum()
    np.testing.assert_allclose(row, want, atol=1e-6)
    checked += 1
  assert checked >= 6


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

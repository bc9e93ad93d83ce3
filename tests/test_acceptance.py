"""Acceptance rules: sample-and-match, recursive rejection with sibling laws, leniency λ, and the
joint law of sampled speculative decoding against the target's (chi-square on exact laws)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax import generate as G
from d2sd_jax import sampling as S
from d2sd_jax import speculative as SP
from d2sd_jax import tree as tree_lib
from spec_helpers import DCFG, DCFG2, PROMPTS, bundle_for, full_last_logits, jitted, run_both


# ----------------------------------------------------------------------------------------------
# Sample-and-match over a tree of point-mass drafts: the output law is the target's.


def toy_joint(rng_seed=0, V=4):
  """A toy 'target': p(x1) and p(x2 | x1) as explicit tables."""
  rng = np.random.default_rng(rng_seed)
  p1 = rng.dirichlet(np.ones(V))
  p2 = rng.dirichlet(np.ones(V), size=V)
  return p1, p2


def test_sample_and_match_two_tokens_is_exact():
  """Tree: anchor -> {a, b (siblings), a again (a duplicate)}; a -> c. We sample the first two
  output tokens (accepted path + bonus, then a fresh target draw if only one was emitted) and
  compare their joint law with p(x1) p(x2 | x1) by a chi-square test."""
  V = 4
  p1, p2 = toy_joint()
  a, b, c = 1, 2, 3
  # Nodes: 0 anchor, 1 = a, 2 = b, 3 = a (duplicate of node 1), 4 = c under node 1.
  tokens = jnp.asarray([[0, a, b, a, c]])
  parents = jnp.asarray([[0, 0, 0, 0, 1]])
  tree = tree_lib.Tree(tokens, parents, jnp.ones((1, 5), bool))
  anc, depth = tree_lib.structure(tree)
  # Target logits at each node: at the anchor p1; at a node with token x (depth 1), p2[x].
  node_probs = np.stack([p1, p2[a], p2[b], p2[a], p1])  # node 4's children are never drafted
  logits = jnp.log(jnp.asarray(node_probs, jnp.float32))[None]
  settings = S.SamplingSettings(temperature=1.0)

  def two_tokens(key):
    k1, k2 = jax.random.split(key)
    best, n_acc, bonus, path = tree_lib.accept_point_mass(tree, anc, depth, logits, settings,
                                                          k1[None])
    path_tokens = tokens[0][path[0]]
    x1 = jnp.where(n_acc[0] >= 1, path_tokens[1], bonus[0])
    # If only x1 was emitted, x2 comes from the next cycle: a fresh draw from p2[x1].
    fresh = jax.random.categorical(k2, jnp.log(jnp.asarray(p2, jnp.float32))[x1])
    x2 = jnp.where(n_acc[0] >= 2, path_tokens[2], jnp.where(n_acc[0] == 1, bonus[0], fresh))
    return x1 * V + x2

  n = 60000
  draws = jax.vmap(two_tokens)(jax.random.split(jax.random.PRNGKey(0), n))
  counts = np.bincount(np.asarray(draws), minlength=V * V)
  expected = (p1[:, None] * p2).reshape(-1) * n
  chi2 = np.sum((counts - expected)**2 / expected)
  assert chi2 < 45.0  # 15 degrees of freedom: p ≈ 1e-4


def test_soft_q_for_an_argmax_draft_is_detected():
  """The biased rule: accepting an argmax draft x with min(1, p(x)/q(x)), q = the drafter's soft
  probability, then resampling from norm(max(p - q, 0)). Its output law differs from p."""
  p = np.array([0.5, 0.3, 0.2])
  q = np.array([0.6, 0.3, 0.1])  # the drafter's distribution; its argmax 0 is always drafted
  x = 0
  accept = min(1.0, p[x] / q[x])
  residual = np.maximum(p - q, 0)
  residual /= residual.sum()
  biased = np.zeros(3)
  biased[x] += accept
  biased += (1 - accept) * residual
  # Point-mass rule (q one-hot at x): accept with p(x), else draw from p without x.
  exact = np.zeros(3)
  exact[x] += p[x]
  rest = p.copy()
  rest[x] = 0
  exact += (1 - p[x]) * rest / rest.sum()
  np.testing.assert_allclose(exact, p)
  assert np.abs(biased - p).max() > 0.05


def chi2(counts, probs):
  n = counts.sum()
  support = probs > 0
  assert counts[~support].sum() == 0, 'a token outside the support was emitted'
  return float(np.sum((counts[support] - n * probs[support])**2 / (n * probs[support])))


def first_token_law(tokens_fn, q_fn, p1, leniency=0.0, n=50000, V=5):
  """Monte Carlo law of the first emitted token of accept_recursive on a one-level tree whose
  children (tokens, claimed laws) are redrawn every trial."""
  logits = jnp.log(jnp.asarray(np.stack([p1] + [np.full(V, 1.0 / V)] * 2), jnp.float32))[None]
  parents = jnp.asarray([[0, 0, 0]])
  settings = S.SamplingSettings(temperature=1.0)

  def one(key):
    k_draft, k_accept = jax.random.split(key)
    tokens = tokens_fn(k_draft)
    tree = tree_lib.Tree(jnp.concatenate([jnp.zeros((1,), jnp.int32), tokens])[None], parents,
                         jnp.ones((1, 3), bool))
    anc, depth = tree_lib.structure(tree)
    _, n_acc, bonus, path = tree_lib.accept_recursive(tree, anc, depth, logits, settings,
                                                      k_accept[None], leniency, q_fn(tokens))
    return jnp.where(n_acc[0] >= 1, tree.tokens_BxT[0, path[0, 1]], bonus[0])

  draws = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(1), n))
  return np.bincount(np.asarray(draws), minlength=V)


P1 = np.array([0.35, 0.25, 0.2, 0.15, 0.05])  # the target at the anchor
PD = np.array([0.1, 0.5, 0.3, 0.05, 0.05])  # a drafter's distribution there (argmax: token 1)


def excluding(dist, token):
  out = dist.copy()
  out[token] = 0
  return out / out.sum()


def test_recursive_rejection_with_sibling_laws_is_exact():
  """Sibling 1: the drafter's argmax (a point mass); sibling 2: a draw from the drafter's law with
  sibling 1's token removed (renormalised). The first token follows the target."""
  a = int(np.argmax(PD))
  q2 = excluding(PD, a)
  tokens_fn = lambda k: jnp.asarray([a, jax.random.choice(k, 5, p=jnp.asarray(q2))], jnp.int32)
  q_fn = lambda toks: jnp.asarray(np.stack([np.zeros(5), np.eye(5)[a], q2]), jnp.float32)[None]
  counts = first_token_law(tokens_fn, q_fn, P1)
  assert chi2(counts, P1) < 18.5  # 4 degrees of freedom, p ≈ 0.001


def test_unrenormalised_second_law_is_detected():
  """The known bias: claiming the second sibling came from the drafter's full law (not
  renormalised after excluding the first sibling's token)."""
  a = int(np.argmax(PD))
  q2 = excluding(PD, a)
  tokens_fn = lambda k: jnp.asarray([a, jax.random.choice(k, 5, p=jnp.asarray(q2))], jnp.int32)
  q_bad = lambda toks: jnp.asarray(np.stack([np.zeros(5), np.eye(5)[a], PD]), jnp.float32)[None]
  counts = first_token_law(tokens_fn, q_bad, P1)
  assert chi2(counts, P1) > 100.0


@pytest.mark.parametrize('lam', [0.0, 0.3, 0.8])
def test_leniency_follows_its_formula(lam):
  """One point-mass draft x: accepted with λ + (1-λ) p(x); else a draw from p without x."""
  x = 2
  tokens_fn = lambda k: jnp.asarray([x, x], jnp.int32)  # the duplicate is never tried
  counts = first_token_law(tokens_fn, lambda toks: None, P1, leniency=lam)
  accept = lam + (1 - lam) * P1[x]
  law = (1 - accept) * excluding(P1, x)
  law[x] = accept
  assert chi2(counts, law) < 18.5
  if lam == 0.0:
    np.testing.assert_allclose(law, P1)  # λ = 0 is the exact sampler


def test_leniency_in_the_loop(tiny):
  """λ > 0 runs through the whole program; λ = 0 through the same path equals AR greedy."""
  cfg, params = tiny
  base = dict(generation=G.GenerationSettings(max_new_tokens=12, eos_ids=(), pad_id=0), gamma=5)
  ar, sp, _ = run_both(cfg, params, PROMPTS, SP.SpecSettings(**base, leniency=1e-9))
  assert sp == ar  # a vanishing λ still matches greedy
  _, lenient, state = run_both(cfg, params, PROMPTS, SP.SpecSettings(**base, leniency=0.9))
  assert all(len(o) == 12 for o in lenient)
  with pytest.raises(ValueError, match='leniency'):
    SP.SpecSettings(**base, leniency=1.5)


# ----------------------------------------------------------------------------------------------
# End to end at T > 0: the joint law of the first two generated tokens equals AR sampling's.


def exact_two_token_law(cfg, params, prompt, settings):
  """p(x1) p(x2 | x1) under the sampling transforms, enumerated from the model itself."""
  def probs(seq):
    return np.asarray(S.probs(full_last_logits(cfg, params, jnp.asarray([seq])), settings),
                      np.float64)
  law = {}
  p1 = probs(prompt)
  for x1 in np.nonzero(p1)[0]:
    p2 = probs(prompt + [int(x1)])
    for x2 in np.nonzero(p2)[0]:
      law[(int(x1), int(x2))] = p1[x1] * p2[x2]
  return law


@pytest.mark.parametrize('method', ['pld', 'dflash', 'dflash_resample', 'd2sd'])
def test_sampled_joint_law_equals_ar(tiny, method):
  cfg, params = tiny
  prompt = [40, 12, 12, 12, 12, 12, 12]  # the tiny model likes repeating: lookup drafts hit
  sampling = S.SamplingSettings(temperature=3.0, top_k=3)
  gen = G.GenerationSettings(max_new_tokens=2, eos_ids=(), pad_id=0, sampling=sampling)
  law = exact_two_token_law(cfg, params, prompt, sampling)
  bundle = bundle_for(tiny) if method != 'pld' else {'target': params}
  spec = SP.SpecSettings(gen, method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2,
                         n_branches=2)
  B, runs = 256, 4
  block, lens = G.pad_prompts([prompt] * B, 0, bucket=8)
  _, init, loop, _ = jitted()
  counts, accepted = {}, 0
  for run in range(runs):
    state = init(bundle, cfg, spec, block, lens, G.row_keys(run, range(B)),
                 SP.cache_size_needed(block.shape[1], spec))
    state = loop(bundle, cfg, spec, state)
    out = np.asarray(SP.generated(state, 2))
    accepted += int(state.accepted_hist_BxK[:, 1:].sum())
    for x1, x2 in out.tolist():
      counts[(x1, x2)] = counts.get((x1, x2), 0) + 1
  n = B * runs
  assert set(counts) <= set(law), 'a pair outside the support of the target law'
  stat = sum((counts.get(k, 0) - n * p)**2 / (n * p) for k, p in law.items())
  assert stat < 27.9  # <= 9 cells: p ≈ 0.0005 at 8 degrees of freedom
  if method == 'pld':
    assert accepted > 0.1 * n  # the drafts were accepted often enough to matter


def test_soft_q_for_an_argmax_draft_is_detected_in_the_sampler():
  """Verifying the drafter's argmax as if it were drawn from the drafter's soft law (the bias of
  several public implementations) moves the output law away from the target's."""
  a = int(np.argmax(PD))
  tokens_fn = lambda k: jnp.asarray([a, a], jnp.int32)  # the duplicate is a no-op
  soft = lambda toks: jnp.asarray(np.stack([np.zeros(5), PD, PD]), jnp.float32)[None]
  point = lambda toks: jnp.asarray(np.stack([np.zeros(5), np.eye(5)[a], np.eye(5)[a]]),
                                   jnp.float32)[None]
  assert chi2(first_token_law(tokens_fn, point, P1), P1) < 18.5
  assert chi2(first_token_law(tokens_fn, soft, P1), P1) > 100.0

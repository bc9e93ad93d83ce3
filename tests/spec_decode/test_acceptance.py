"""Acceptance rules: sample-and-match, recursive rejection with sibling laws, leniency λ, and the
joint law of sampled speculative decoding against the target's (chi-square on exact laws).

The rules are tree.py's (accept_point_mass, accept_recursive); the joint laws run them through
the speculative loop. One file, not split between test_tree.py and test_speculative.py: the
exact laws, chi-square tools and sampling settings serve both halves, and tests/test_mutations.py
calls its check_* functions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from d2sd_jax.models import sampling as S
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from tests.helpers import loop_checks
from tests.helpers import tiny_drafters
from tests.helpers.loop_checks import run_both
from tests.helpers.programs import full_last_logits, jitted
from tests.helpers.tiny_drafters import DCFG, DCFG2, PROMPTS
from tests.models.test_sampling import expected_probs

# The sampling settings users run (every speculative law below is checked at T = 1 as well).
# With top-k 4, a rejection leaves a residual of 3 tokens or more where a node has one child.
USER_SAMPLINGS = {'T0.6-k4': S.SamplingSettings(temperature=0.6, top_k=4),
                  'T1.3-k4': S.SamplingSettings(temperature=1.3, top_k=4),
                  'T1-p0.8': S.SamplingSettings(temperature=1.0, top_p=0.8)}
T1 = S.SamplingSettings(temperature=1.0)


def processed(p, settings):
  """The law a sampler with these settings draws from a target whose probabilities are p (an
  independent numpy definition: temperature, then top-k, then top-p, on log p)."""
  p = np.asarray(p, np.float64)
  return expected_probs(np.log(p), settings.temperature, settings.top_k, settings.top_p)


# ----------------------------------------------------------------------------------------------
# Sample-and-match over a tree of point-mass drafts: the output law is the target's.


def toy_joint(rng_seed=0, V=4):
  """A toy 'target': p(x1) and p(x2 | x1) as explicit tables."""
  rng = np.random.default_rng(rng_seed)
  p1 = rng.dirichlet(np.ones(V))
  p2 = rng.dirichlet(np.ones(V), size=V)
  return p1, p2


def check_sample_and_match_exact(n=60000, settings=T1):
  """Tree: anchor -> {a, b, a again (a duplicate sibling)}; a -> c, and the duplicate -> b. We
  sample the first two output tokens (accepted path + bonus, then a fresh target draw if only
  one was emitted) and compare their joint law with p(x1) p(x2 | x1) by a chi-square test, p
  the toy target's tables under the sampling settings. A walk that could also enter the
  duplicate would give x2 two chances after a; one that ignored the settings would follow the
  raw tables."""
  V = 4
  p1, p2 = toy_joint()
  law1, law2 = processed(p1, settings), np.stack([processed(row, settings) for row in p2])
  a, b, c = 1, 2, 3
  # Nodes: 0 anchor, 1 = a, 2 = b, 3 = a (duplicate of node 1), 4 = c under node 1,
  # 5 = b under node 3.
  tokens = jnp.asarray([[0, a, b, a, c, b]])
  parents = jnp.asarray([[0, 0, 0, 0, 1, 3]])
  tree = tree_lib.Tree(tokens, parents, jnp.ones((1, 6), bool))
  anc, depth = tree_lib.structure(tree)
  # Target logits at each node: at the anchor p1; at a node with token x (depth 1), p2[x].
  node_probs = np.stack([p1, p2[a], p2[b], p2[a], p1, p1])  # depth-2 nodes have no children
  logits = jnp.log(jnp.asarray(node_probs, jnp.float32))[None]

  def two_tokens(key):
    k1, k2 = jax.random.split(key)
    _, n_acc, bonus, path = tree_lib.accept_point_mass(tree, anc, depth, logits, settings,
                                                       k1[None])
    path_tokens = tokens[0][path[0]]
    x1 = jnp.where(n_acc[0] >= 1, path_tokens[1], bonus[0])
    # If only x1 was emitted, x2 comes from the next cycle: a fresh draw from p2[x1].
    fresh = jax.random.categorical(k2, jnp.log(jnp.asarray(law2, jnp.float32))[x1])
    x2 = jnp.where(n_acc[0] >= 2, path_tokens[2], jnp.where(n_acc[0] == 1, bonus[0], fresh))
    return x1 * V + x2

  draws = jax.jit(jax.vmap(two_tokens))(jax.random.split(jax.random.PRNGKey(0), n))
  counts = np.bincount(np.asarray(draws), minlength=V * V)
  law = (law1[:, None] * law2).reshape(-1)
  stat, dof = chi2(counts, law), int(np.sum(law > 0)) - 1
  assert stat < chi2_999(dof), (stat, dof)


@pytest.mark.parametrize('sampling', ['T1'] + list(USER_SAMPLINGS))
def test_sample_and_match_two_tokens_is_exact(sampling):
  check_sample_and_match_exact(settings=USER_SAMPLINGS.get(sampling, T1))


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


def first_token_law(tokens_fn, q_fn, p1, leniency=0.0, n=50000, V=5, settings=T1):
  """Monte Carlo law of the first emitted token of accept_recursive on a one-level tree whose
  children (tokens, claimed laws) are redrawn every trial; the target's probabilities at the
  anchor are p1, sampled with `settings`."""
  logits = jnp.log(jnp.asarray(np.stack([p1] + [np.full(V, 1.0 / V)] * 2), jnp.float32))[None]
  parents = jnp.asarray([[0, 0, 0]])

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


P1 = np.array([0.36, 0.25, 0.2, 0.14, 0.05])  # the target at the anchor (top-p 0.8: 3 tokens)
PD = np.array([0.1, 0.5, 0.3, 0.05, 0.05])  # a drafter's distribution there (argmax: token 1)


def excluding(dist, token):
  out = dist.copy()
  out[token] = 0
  return out / out.sum()


def check_sibling_laws_exact(n=50000, settings=T1):
  """Sibling 1: the drafter's argmax (a point mass); sibling 2: a draw from the drafter's law with
  sibling 1's token removed (renormalised). The first token follows the target under the
  sampling settings (the drafter's laws are its own, whatever the settings)."""
  a = int(np.argmax(PD))
  q2 = excluding(PD, a)
  tokens_fn = lambda k: jnp.asarray([a, jax.random.choice(k, 5, p=jnp.asarray(q2))], jnp.int32)
  q_fn = lambda toks: jnp.asarray(np.stack([np.zeros(5), np.eye(5)[a], q2]), jnp.float32)[None]
  counts = first_token_law(tokens_fn, q_fn, P1, n=n, settings=settings)
  law = processed(P1, settings)
  stat, dof = chi2(counts, law), int(np.sum(law > 0)) - 1
  assert stat < chi2_999(dof), (stat, dof)


@pytest.mark.parametrize('sampling', ['T1'] + list(USER_SAMPLINGS))
def test_recursive_rejection_with_sibling_laws_is_exact(sampling):
  check_sibling_laws_exact(settings=USER_SAMPLINGS.get(sampling, T1))


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
  base = dict(generation=AR.GenerationSettings(max_new_tokens=12, eos_ids=(), pad_id=0), gamma=5)
  ar, sp, _ = run_both(cfg, params, PROMPTS, SP.SpecSettings(**base, leniency=1e-9))
  assert sp == ar  # a vanishing λ still matches greedy
  _, lenient, state = run_both(cfg, params, PROMPTS, SP.SpecSettings(**base, leniency=0.9))
  assert all(len(o) == 12 for o in lenient)
  with pytest.raises(ValueError, match='leniency'):
    SP.SpecSettings(**base, leniency=1.5)


# ----------------------------------------------------------------------------------------------
# Leniency in trees: the true drift bound, by enumeration.


def lenient_law(p, children, lam):
  """The exact law of the token emitted at a node by accept_recursive: children = [(token,
  law)] tried in order (law None: a point mass), leniency lam, residual r starting at p."""
  out, stay, r = np.zeros_like(p), 1.0, p.copy()  # stay: probability no child accepted yet
  for x, q in children:
    q = np.eye(len(p))[x] if q is None else q
    t = (1 - lam) * r + lam * q
    out += stay * np.minimum(q, t)  # drawn x ~ q, accepted with min(1, t(x)/q(x))
    rest = np.maximum(t - q, 0.0)
    stay *= rest.sum()
    if rest.sum() == 0:
      return out
    r = rest / rest.sum()
  return out + stay * r


def tv(a, b):
  return 0.5 * np.abs(a - b).sum()


def test_leniency_drift_in_trees_by_enumeration():
  """The example from tree.py, then random cases: with m point-mass siblings every other token
  keeps exactly (1-λ)^m of its mass; any sibling laws stay within TV 1 - (1-λ)^m; one sibling
  gives exactly (1-λ) p + λ q. The single-draft claim λ·TV(p, q) fails for m > 1."""
  p = np.array([0.01, 0.01, 0.98])
  law = lenient_law(p, [(0, None), (1, None)], 0.5)
  assert abs(tv(law, p) - 0.735) < 1e-9
  assert tv(law, p) > 0.5 * tv(p, np.eye(3)[0]) + 1e-3  # the single-draft bound is exceeded
  rng = np.random.default_rng(0)
  for _ in range(300):
    V, m, lam = 6, int(rng.integers(1, 4)), float(rng.uniform(0, 1))
    p = rng.dirichlet(np.ones(V) * 0.5)
    xs = rng.choice(V, m, replace=False).tolist()
    law = lenient_law(p, [(x, None) for x in xs], lam)
    np.testing.assert_allclose(law.sum(), 1.0, atol=1e-9)
    outside = np.ones(V, bool)
    outside[xs] = False
    np.testing.assert_allclose(law[outside], (1 - lam)**m * p[outside], atol=1e-12)
    assert tv(law, p) >= (1 - (1 - lam)**m) * (1 - p[xs].sum()) - 1e-9
    assert tv(law, p) <= 1 - (1 - lam)**m + 1e-9
    # Sampled siblings: q_i drawn laws, renormalised after excluding earlier siblings' tokens.
    qs, used = [], []
    for _ in range(m):
      q = rng.dirichlet(np.ones(V))
      q[used] = 0
      q /= q.sum()
      x = int(rng.choice(V, p=q))
      qs.append((x, q))
      used.append(x)
    law = lenient_law(p, qs, lam)
    assert tv(law, p) <= 1 - (1 - lam)**m + 1e-9
    if m == 1:
      np.testing.assert_allclose(law, (1 - lam) * p + lam * qs[0][1], atol=1e-9)


def check_lenient_siblings_law(settings=T1):
  """accept_recursive itself, with two point-mass siblings and λ = 0.5, against lenient_law
  from the target's law under the sampling settings."""
  lam = 0.5
  tokens_fn = lambda k: jnp.asarray([0, 1], jnp.int32)
  counts = first_token_law(tokens_fn, lambda toks: None, P1, leniency=lam, settings=settings)
  law = lenient_law(processed(P1, settings), [(0, None), (1, None)], lam)
  stat, dof = chi2(counts, law), int(np.sum(law > 0)) - 1
  assert stat < chi2_999(dof), (stat, dof)


@pytest.mark.parametrize('sampling', ['T1'] + list(USER_SAMPLINGS))
def test_leniency_with_two_siblings_follows_the_enumerated_law(sampling):
  check_lenient_siblings_law(USER_SAMPLINGS.get(sampling, T1))


def test_empty_residual_never_emits_token_zero():
  """A sibling whose claimed law sits 1 % above p everywhere (a law off by rounding): its
  rejection probability sum(max(t - q, 0)) is 0, yet min(1, t/q) < 1. The residual must not
  be drawn from when it is empty (that 'draw' was token 0, which p excludes here)."""
  p = np.array([0.0, 0.5, 0.3, 0.2, 0.0])
  logits = jnp.log(jnp.asarray(np.stack([p, p, p]), jnp.float32))[None]
  tree = tree_lib.Tree(jnp.asarray([[0, 2, 2]]), jnp.asarray([[0, 0, 1]]), jnp.ones((1, 3), bool))
  anc, depth = tree_lib.structure(tree)
  q = jnp.asarray(np.stack([np.zeros(5), p * 1.01, p * 1.01]), jnp.float32)[None]
  settings = S.SamplingSettings(temperature=1.0)
  one = lambda k: tree_lib.accept_recursive(tree, anc, depth, logits, settings, k[None], 0.0, q)
  _, n_acc, bonus, _ = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), 4000))
  first = np.where(np.asarray(n_acc)[:, 0] >= 1, 2, np.asarray(bonus)[:, 0])
  assert (first != 0).all()
  assert (np.asarray(n_acc) >= 1).all()  # rejection is impossible here


# ----------------------------------------------------------------------------------------------
# End to end at T > 0: the joint law of a window of generated tokens equals the target's.


def window_law(cfg, params, prompt, settings, n, draft_tokens=None, lam=0.0):
  """The exact law of the first n generated tokens, enumerated from the model itself.

  draft_tokens None: AR sampling, p(x1) p(x2 | x1) ... With draft_tokens (a fixed chain the
  drafter proposes every cycle) and leniency lam: the law speculative decoding gives, cycle by
  cycle: x1 from the prefill, then at draft depth j the draft is accepted with
  lam + (1-lam) p(d_j), else a token of p without d_j ends the cycle; after the whole chain the
  bonus is drawn from p."""
  cache = {}

  def probs(seq):
    key = tuple(seq)
    if key not in cache:
      cache[key] = np.asarray(S.probs(full_last_logits(cfg, params, jnp.asarray([seq])),
                                      settings), np.float64)
    return cache[key]

  law = {}

  def emit(seq, out, prob, depth):
    """`out` generated so far; depth: drafts accepted in the current cycle (None: before the
    prefill's token)."""
    if prob == 0.0:
      return
    if len(out) == n:
      law[tuple(out)] = law.get(tuple(out), 0.0) + prob
      return
    p = probs(seq)
    if draft_tokens is None or depth is None or depth == len(draft_tokens):
      for y in np.nonzero(p)[0]:
        emit(seq + [int(y)], out + [int(y)], prob * p[y], 0)  # a new cycle starts
      return
    x = draft_tokens[depth]
    accept = lam + (1 - lam) * p[x]
    emit(seq + [x], out + [x], prob * accept, depth + 1)
    if p[x] < 1.0:
      rest = p.copy()
      rest[x] = 0.0
      rest /= rest.sum()
      for y in np.nonzero(rest)[0]:
        emit(seq + [int(y)], out + [int(y)], prob * (1 - accept) * rest[y], 0)

  emit(list(prompt), [], 1.0, None)
  return law


def pooled_chi2(counts: dict, law: dict) -> tuple[float, int]:
  """Chi-square over the law's cells, cells expected < 5 times pooled into one; (stat, dof)."""
  n = sum(counts.values())
  assert set(counts) <= set(law), f'outside the support: {set(counts) - set(law)}'
  stat, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
  for k, p in law.items():
    if n * p < 5:
      small_obs += counts.get(k, 0)
      small_exp += n * p
    else:
      stat += (counts.get(k, 0) - n * p)**2 / (n * p)
      cells += 1
  if small_exp > 0:
    stat += (small_obs - small_exp)**2 / small_exp
    cells += 1
  return stat, cells - 1


def chi2_999(dof: int) -> float:
  """The chi-square statistic a correct sampler exceeds with probability 0.001."""
  return float(scipy.stats.chi2.ppf(0.999, max(dof, 1)))


def sampled_windows(cfg, bundle, spec, prompt, runs, B=256):
  _, init, loop, _ = jitted()
  block, lens = AR.pad_prompts([prompt] * B, 0, bucket=8)
  counts, accepted, cycles, alone = {}, 0, 0, 0
  n = spec.generation.max_new_tokens
  for run in range(runs):
    state = init(bundle, cfg, spec, block, lens, AR.row_keys(run, range(B)),
                 SP.cache_size_needed(block.shape[1], spec))
    state = loop(bundle, cfg, spec, state)
    accepted += int(state.accepted_hist_BxC[:, 1:].sum())
    cycles += int(state.cycles_B.sum())
    if state.lookup_only_B is not None:  # cycles that verified prompt lookup alone
      alone += int(state.lookup_only_B.sum())
    for row in np.asarray(SP.generated(state, n)).tolist():
      counts[tuple(row)] = counts.get(tuple(row), 0) + 1
  return counts, accepted, cycles, alone


WINDOW_PROMPT = tiny_drafters.WINDOW_PROMPT
WINDOW_SAMPLING = S.SamplingSettings(temperature=1.0, top_k=2)


# dflash_resample, dflash_dflash and d2sd run in the slow tier here: their default-tier law test
# is test_sampled_window_law_through_branches (branches accepted, T != 1, larger residuals).
@pytest.mark.parametrize('method', [
    'pld', 'dflash', pytest.param('dflash_resample', marks=pytest.mark.slow),
    pytest.param('dflash_dflash', marks=pytest.mark.slow),
    pytest.param('d2sd', marks=pytest.mark.slow), 'd2sd_pld', 'oracle_tree'])
def test_sampled_window_law_equals_ar(tiny, trained, method, monkeypatch):
  """Four generated tokens (three from speculative cycles, which commit several at a time
  when drafts are accepted) follow the target's joint law, for every method."""
  cfg, params = tiny
  n = 4
  gen = AR.GenerationSettings(max_new_tokens=n, eos_ids=(), pad_id=0, sampling=WINDOW_SAMPLING)
  prompt = WINDOW_PROMPT
  if method in ('pld', 'd2sd_pld'):  # lookup needs a context that repeats: prompt, its greedy
    greedy = AR.GenerationSettings(max_new_tokens=12, eos_ids=(), pad_id=0)  # continuation, prompt
    prompt = prompt + loop_checks.ar_outputs(cfg, params, [prompt], greedy)[0] + prompt
  law = window_law(cfg, params, prompt, WINDOW_SAMPLING, n)
  if method == 'oracle_tree':
    greedy = AR.GenerationSettings(max_new_tokens=n + 2 * DCFG.gamma, eos_ids=(), pad_id=0)
    reference = jnp.asarray(loop_checks.ar_outputs(cfg, params, [WINDOW_PROMPT] * 256, greedy))
    monkeypatch.setitem(drafting.REGISTRY, method,
                        loop_checks.oracle_tree(reference, cfg.vocab_size))
    spec = loop_checks.oracle_spec(gen, method)
  else:
    spec = SP.SpecSettings(gen, method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2,
                           n_branches=2)
  counts, accepted, cycles, _ = sampled_windows(cfg, trained, spec, prompt, runs=8)
  stat, dof = pooled_chi2(counts, law)
  assert stat < chi2_999(dof), (stat, dof)
  assert accepted > 0.1 * cycles, (accepted, cycles)  # cycles really committed several tokens


# ----------------------------------------------------------------------------------------------
# End to end at the settings users run, with paths through branches accepted.

# Methods whose trees hold nodes off drafter 1's chain. Each runs the sampled law test below at
# every setting of USER_SAMPLINGS, in the default tier at BRANCH_SAMPLING (a new tree method is
# appended here, and needs nothing else).
BRANCH_METHODS = ['dflash_resample', 'dflash_dflash', 'd2sd', 'ddtree', 'd2sd_tree']
BRANCH_BUDGET = 8  # tree_budget of the budgeted methods among them (best-first trees)
BRANCH_SAMPLING = 'T0.6-k4'
# ...and top-p in the default tier too, through one method (T = 1.3: slow tier).
DEFAULT_TIER_SAMPLINGS = {('d2sd', 'T1-p0.8')}


def _branch_law_cases():
  for method in BRANCH_METHODS:
    for sampling in USER_SAMPLINGS:
      default = sampling == BRANCH_SAMPLING or (method, sampling) in DEFAULT_TIER_SAMPLINGS
      yield pytest.param(method, sampling, marks=() if default else (pytest.mark.slow,),
                         id=f'{method}-{sampling}')


@pytest.fixture(scope='module')
def sampled_drafters(tiny):
  return tiny_drafters.sampled_bundle(tiny)


def counting_step(params, cfg, settings, state):
  """spec_step, and per row whether this cycle's accepted path left drafter 1's chain (an
  accepted draft differs from drafter 1's block at its depth: whatever the tree's layout)."""
  _, accept_key_B = state.cycle_keys
  tree = SP.draft(params, cfg, settings, state)
  chain_BxG, _, _ = drafting.first_draft(params, cfg, settings, state)
  verified = SP.verify(params, cfg, settings, state, tree)
  acc = SP.accept(settings, tree, verified, accept_key_B)
  path_BxC = jnp.take_along_axis(tree.tokens_BxT, acc.path_BxC, 1)
  depth = jnp.arange(path_BxC.shape[1])[None]
  drafted = (depth >= 1) & (depth <= acc.accept_len_B[:, None])
  off_chain_B = jnp.any(drafted & (path_BxC != chain_BxG[:, :path_BxC.shape[1]]), axis=1)
  return (SP.commit(params, settings, state, tree, verified, acc),
          off_chain_B & ~state.done_B, ~state.done_B)


def branch_windows(cfg, bundle, spec, prompt, runs, B=512):
  """sampled_windows cycle by cycle: (window counts, {'cycles': row-cycles, 'off_chain':
  row-cycles that accepted a node off drafter 1's chain})."""
  _, init, _, _ = jitted()
  step = jax.jit(counting_step, static_argnames=('cfg', 'settings'))
  block, lens = AR.pad_prompts([prompt] * B, 0, bucket=8)
  counts, stats = {}, {'cycles': 0, 'off_chain': 0}
  n = spec.generation.max_new_tokens
  for run in range(runs):
    state = init(bundle, cfg, spec, block, lens, AR.row_keys(run, range(B)),
                 SP.cache_size_needed(block.shape[1], spec))
    while not bool(state.done_B.all()):
      state, off_chain_B, live_B = step(bundle, cfg, spec, state)
      stats['off_chain'] += int(off_chain_B.sum())
      stats['cycles'] += int(live_B.sum())
    for row in np.asarray(SP.generated(state, n)).tolist():
      counts[tuple(row)] = counts.get(tuple(row), 0) + 1
  return counts, stats


@pytest.mark.parametrize('method,sampling', list(_branch_law_cases()))
def test_sampled_window_law_through_branches(tiny, sampled_drafters, method, sampling):
  """At the settings users run (T 0.6 and 1.3 with top-k 4: a rejected child leaves 3 tokens
  or more; top-p 0.8), four generated tokens follow the target's joint law (enumerated from
  the model under those settings), while at least 10 % of row-cycles accept a path through a
  node off drafter 1's chain: drafters fitted to the target's samples make the branches carry
  its second choices. A verification that ignored the temperature or top-p, or mishandled
  siblings, moves the law."""
  cfg, params = tiny
  settings = USER_SAMPLINGS[sampling]
  n = 4
  gen = AR.GenerationSettings(max_new_tokens=n, eos_ids=(), pad_id=0, sampling=settings)
  budget = BRANCH_BUDGET if drafting.REGISTRY[method].budgeted else 0
  spec = SP.SpecSettings(gen, method=method, gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG,
                         n_branches=2, tree_budget=budget)
  law = window_law(cfg, params, WINDOW_PROMPT, settings, n)
  counts, stats = branch_windows(cfg, sampled_drafters, spec, WINDOW_PROMPT, runs=8)
  stat, dof = pooled_chi2(counts, law)
  assert stat < chi2_999(dof), (stat, dof)
  assert stats['off_chain'] >= 0.1 * stats['cycles'], stats


@pytest.mark.parametrize('method,lookup_cost', [
    ('d2sd_tree', 0.0), ('d2sd_tree', 0.5), pytest.param('ddtree', 0.0, marks=pytest.mark.slow)])
def test_sampled_window_law_of_adaptive_trees(tiny, sampled_drafters, method, lookup_cost):
  """spec.adaptive at T 0.6 with top-k 4: whichever size each cycle verifies (the first n nodes
  of the best-first tree, or with lookup cycles prompt lookup's proposal alone), four generated
  tokens follow the target's joint law, and cycles commit several tokens. With a lookup cost
  that low, the cycles after each row's first verify the lookup alone."""
  cfg, params = tiny
  settings = USER_SAMPLINGS[BRANCH_SAMPLING]
  gen = AR.GenerationSettings(max_new_tokens=4, eos_ids=(), pad_id=0, sampling=settings)
  spec = SP.SpecSettings(gen, method=method, gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG,
                         n_branches=2, tree_budget=BRANCH_BUDGET, adaptive=True,
                         node_costs=((2, 1.0), (4, 1.2), (BRANCH_BUDGET, 1.5)),
                         lookup_cycles=lookup_cost > 0, lookup_cost=lookup_cost)
  law = window_law(cfg, params, WINDOW_PROMPT, settings, 4)
  counts, accepted, cycles, alone = sampled_windows(cfg, sampled_drafters, spec, WINDOW_PROMPT,
                                                    runs=8)
  stat, dof = pooled_chi2(counts, law)
  assert stat < chi2_999(dof), (stat, dof)
  assert accepted > 0.1 * cycles, (accepted, cycles)
  if lookup_cost:
    assert alone > 0.2 * cycles, (alone, cycles)


@pytest.mark.parametrize('lam', [0.0, 0.5])
def test_lenient_window_law_equals_its_derived_law(tiny, lam, monkeypatch):
  """λ > 0 through the whole loop over four tokens: a drafter that always proposes the same
  chain, against the law derived cycle by cycle (window_law); λ = 0 against the target's."""
  cfg, params = tiny
  n = 4
  # The drafter proposes the greedy continuation (after the prefill's token) in every cycle.
  greedy = AR.GenerationSettings(max_new_tokens=5, eos_ids=(), pad_id=0)
  chain = loop_checks.ar_outputs(cfg, params, [WINDOW_PROMPT], greedy)[0][1:5]

  def fixed(params_, cfg_, settings, state):
    del params_, cfg_
    B = state.seq_len_B.shape[0]
    draft = jnp.broadcast_to(jnp.asarray(chain, jnp.int32), (B, len(chain)))
    return tree_lib.chain(state.anchor_B, draft, jnp.ones_like(draft, bool))

  monkeypatch.setitem(drafting.REGISTRY, 'fixed_chain', drafting.Method(fixed))
  gen = AR.GenerationSettings(max_new_tokens=n, eos_ids=(), pad_id=0, sampling=WINDOW_SAMPLING)
  spec = SP.SpecSettings(gen, method='fixed_chain', gamma=len(chain) + 1, leniency=lam)
  law = window_law(cfg, params, WINDOW_PROMPT, WINDOW_SAMPLING, n, chain, lam)
  if lam == 0.0:
    ar_law = window_law(cfg, params, WINDOW_PROMPT, WINDOW_SAMPLING, n)
    assert set(law) == set(ar_law)
    for k, p in ar_law.items():
      assert abs(law[k] - p) < 1e-6  # float32 model probabilities
  counts, accepted, cycles, _ = sampled_windows(cfg, {'target': params}, spec, WINDOW_PROMPT,
                                                runs=8)
  stat, dof = pooled_chi2(counts, law)
  assert stat < chi2_999(dof), (stat, dof)
  assert accepted > 0.2 * cycles, (accepted, cycles)


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

"""The speculative step: equal to AR, caches equal a fresh prefill, one program, exact sampling."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax import drafting
from d2sd_jax import generate as G
from d2sd_jax import model as M
from d2sd_jax import sampling as S
from d2sd_jax import speculative as SP
from d2sd_jax import tree as tree_lib

PROMPTS = [[5, 9, 2, 33, 7, 1, 60, 5, 9, 2], [12], [40, 41, 42, 43, 40, 41]]


@functools.lru_cache(maxsize=None)
def _jitted():
  return (jax.jit(G.generate, static_argnums=(1, 2, 6)),
          jax.jit(SP.init_state, static_argnums=(1, 2, 6)),
          jax.jit(SP.spec_loop, static_argnums=(1, 2)),
          jax.jit(SP.spec_step, static_argnums=(1, 2)))


def run_both(cfg, params, prompts, spec, seed=0):
  """AR tokens and speculative tokens for the same prompts and row keys."""
  gen_ar, init, loop, _ = _jitted()
  block, lens = G.pad_prompts(prompts, spec.generation.pad_id, bucket=8)
  keys = G.row_keys(seed, range(len(prompts)))
  target_params = params['target'] if 'target' in params else params
  ar = gen_ar(target_params, cfg, spec.generation, block, lens, keys,
              block.shape[1] + spec.generation.max_new_tokens)
  bundle = params if isinstance(params, dict) and 'target' in params else {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, cfg, spec, state)
  n = spec.generation.max_new_tokens
  ar_out = [ar.out_BxN[b, :ar.num_out_B[b]].tolist() for b in range(len(prompts))]
  sp_out = [SP.generated(state, n)[b, :state.num_out_B[b]].tolist() for b in range(len(prompts))]
  return ar_out, sp_out, state


@pytest.mark.parametrize('gamma', [2, 5, 8])
def test_pld_greedy_equals_ar(tiny, gamma):
  cfg, params = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=23, eos_ids=(), pad_id=0),
                         method='pld', gamma=gamma)
  ar, sp, state = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar
  assert int(state.accepted_hist_BxK[:, 1:].sum()) > 0  # drafts were accepted along the way


def test_eos_inside_accepted_path_stops_where_ar_does(tiny):
  cfg, params = tiny
  free, _, _ = run_both(cfg, params, PROMPTS, SP.SpecSettings(
      G.GenerationSettings(max_new_tokens=16, eos_ids=(), pad_id=0), gamma=6))
  for eos in {free[0][5], free[2][3]}:
    spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=16, eos_ids=(eos,), pad_id=0),
                           gamma=6)
    ar, sp, _ = run_both(cfg, params, PROMPTS, spec)
    assert sp == ar
    assert any(len(o) < 16 for o in ar)


@pytest.mark.parametrize('max_new', [1, 2, 7])
def test_length_limit_inside_accepted_path(tiny, max_new):
  cfg, params = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=max_new, eos_ids=(), pad_id=0),
                         gamma=8)
  ar, sp, _ = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar and all(len(o) == max_new for o in sp)


@functools.partial(jax.jit, static_argnums=(0,))
def fresh_prefill_cache(cfg, params, tokens_1xL):
  """Cache of a plain causal prefill (slots past the real tokens are causal junk; compare
  only the first n)."""
  L = tokens_1xL.shape[1]
  _, cache, _ = M.forward(params, cfg, tokens_1xL, jnp.arange(L)[None], M.init_cache(cfg, 1, L),
                          jnp.zeros((1,), jnp.int32))
  return cache


def test_cache_equals_fresh_prefill_after_each_cycle(tiny):
  cfg, params = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=30, eos_ids=(), pad_id=0), gamma=6)
  _, init, _, step = _jitted()
  block, lens = G.pad_prompts(PROMPTS, 0, bucket=8)
  state = init({'target': params}, cfg, spec, block, lens, G.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  for _ in range(5):
    state = step({'target': params}, cfg, spec, state)
    for b in range(3):
      n = int(state.cache_len_B[b])
      assert n == int(state.seq_len_B[b]) - 1
      ref = fresh_prefill_cache(cfg, params, state.seq_BxL[b:b + 1, :64])
      for layer, ref_layer in zip(state.cache, ref):
        for kv in ('k', 'v'):
          np.testing.assert_allclose(layer[kv][b, :, :n], ref_layer[kv][0, :, :n], rtol=1e-5,
                                     atol=1e-5)
      # Nothing but pad after the committed tokens.
      assert all(t == 0 for t in state.seq_BxL[b, int(state.seq_len_B[b]):].tolist())


def oracle_drafter(reference_BxN, corrupt):
  """Proposes the AR continuation (or, corrupted, a token that is always wrong)."""

  def draft(params, cfg, settings, state):
    k = state.num_out_B[:, None] + jnp.arange(settings.gamma - 1)[None]
    ref = jnp.take_along_axis(reference_BxN, jnp.clip(k, 0, reference_BxN.shape[1] - 1), 1)
    if corrupt:
      ref = (ref + 1) % 64
    return tree_lib.chain(state.anchor_B, ref, k < reference_BxN.shape[1])

  return draft


@pytest.mark.parametrize('corrupt', [False, True])
def test_perfect_and_adversarial_drafters(tiny, monkeypatch, corrupt):
  cfg, params = tiny
  gen = G.GenerationSettings(max_new_tokens=25, eos_ids=(), pad_id=0)
  ar, _, _ = run_both(cfg, params, PROMPTS, SP.SpecSettings(gen, gamma=5))
  reference = jnp.asarray([o + [0] * 8 for o in ar])
  method = 'oracle_wrong' if corrupt else 'oracle'  # distinct static settings -> own program
  monkeypatch.setitem(drafting.METHODS, method, oracle_drafter(reference, corrupt))
  monkeypatch.setitem(drafting.NEEDS, method, ())
  spec = SP.SpecSettings(gen, method=method, gamma=5)
  ar2, sp, state = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar == ar2
  hist = np.asarray(state.accepted_hist_BxK)
  if corrupt:  # nothing accepted: one token per cycle, tau = 1
    assert hist[:, 1:].sum() == 0 and (state.cycles_B == 24).all()
  else:  # every draft accepted: gamma tokens per cycle (the last cycle is cut by the limit)
    assert (hist[:, 4] == 5).all() and (state.cycles_B == 5).all()  # 1 + 5 * 5 >= 25


def test_batched_equals_per_prompt_and_seeded_sampling(tiny):
  cfg, params = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=15, eos_ids=(3,), pad_id=0,
                                              sampling=S.SamplingSettings(temperature=6.0)),
                         gamma=4)
  _, batched, _ = run_both(cfg, params, PROMPTS, spec, seed=3)
  _, again, _ = run_both(cfg, params, PROMPTS, spec, seed=3)
  assert batched == again
  _, init, loop, _ = _jitted()
  for r, prompt in enumerate(PROMPTS):
    block, lens = G.pad_prompts([prompt], 0, bucket=8)
    state = init({'target': params}, cfg, spec, block, lens, G.row_keys(3, [r]),
                 SP.cache_size_needed(block.shape[1], spec))
    state = loop({'target': params}, cfg, spec, state)
    assert SP.generated(state, 15)[0, :state.num_out_B[0]].tolist() == batched[r]


def test_one_program_without_host_transfers(tiny):
  cfg, params = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=10, eos_ids=(), pad_id=0), gamma=4)
  block, lens = G.pad_prompts(PROMPTS, 0, bucket=8)
  keys = G.row_keys(0, range(3))
  _, init, _, _ = _jitted()
  bundle = {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  loop = jax.jit(SP.spec_loop, static_argnums=(1, 2)).lower(bundle, cfg, spec, state).compile()
  assert 'while' in loop.as_text()
  with jax.transfer_guard('disallow'):
    out = loop(bundle, state)
  assert bool(out.done_B.all())


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


def test_pld_on_smollm2_equals_reference_greedy(smollm2):
  """Real prompts (plain and chat, one batch of 6 lengths): prompt-lookup decoding reproduces the
  reference greedy tokens (transformers, float32) exactly like AR does."""
  import json
  import os
  with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'smollm2_reference.json')) as f:
    cases = json.load(f)['generation_cases']
  tok = smollm2.tokenizer
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=32, eos_ids=(), pad_id=tok.pad_id),
                         gamma=6)
  block, lens = G.pad_prompts([c['prompt_ids'] for c in cases], tok.pad_id)
  keys = G.row_keys(0, range(len(cases)))
  _, init, loop, _ = _jitted()
  bundle = {'target': smollm2.params}
  state = init(bundle, smollm2.cfg, spec, block, lens, keys,
               SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, smollm2.cfg, spec, state)
  out = SP.generated(state, 32)
  for b, case in enumerate(cases):
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), 32)
    assert out[b, :n].tolist() == case['greedy_ids'][:n], case['prompt']
  assert int(state.accepted_hist_BxK[:, 1:].sum()) > 0


# ----------------------------------------------------------------------------------------------
# Drafter-based methods (untrained tiny drafters: acceptance is rare, correctness is the point).

from d2sd_jax import drafter as D  # pylint: disable=wrong-import-position

DCFG = D.DrafterConfig(gamma=5, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                       d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)
DCFG2 = D.DrafterConfig(**{**DCFG.__dict__, 'feature_layers': (1, 2)})


def bundle_for(tiny):
  cfg, params = tiny
  return {'target': params, 'drafter1': D.init_params(DCFG, cfg, jax.random.PRNGKey(5)),
          'drafter2': D.init_params(DCFG2, cfg, jax.random.PRNGKey(6))}


@pytest.mark.parametrize('method,steps,budget', [
    ('dflash', 1, 0), ('dflash', 2, 0), ('dflash_resample', 1, 0), ('dflash_dflash', 1, 0),
    ('d2sd', 1, 0), ('d2sd', 3, 11)])
def test_drafter_methods_equal_ar(tiny, method, steps, budget):
  cfg, _ = tiny
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=14, eos_ids=(), pad_id=0),
                         method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=3,
                         steps=steps, tree_budget=budget)
  ar, sp, state = run_both(cfg, bundle_for(tiny), PROMPTS, spec)
  assert sp == ar
  assert spec.tree_size == (11 if budget else 5 + (12 if method != 'dflash' else 0))


def test_d2sd_caches_equal_fresh_prefill(tiny):
  cfg, params = tiny
  bundle = bundle_for(tiny)
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=20, eos_ids=(), pad_id=0),
                         method='d2sd', gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=2)
  _, init, _, step = _jitted()
  block, lens = G.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(bundle, cfg, spec, block, lens, G.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  for _ in range(3):
    state = step(bundle, cfg, spec, state)
  for b in range(3):
    n = int(state.cache_len_B[b])
    toks = state.seq_BxL[b:b + 1, :n]
    _, _, feats = M.forward(params, cfg, toks, jnp.arange(n)[None], M.init_cache(cfg, 1, n),
                            jnp.zeros((1,), jnp.int32), feature_layers=(0, 1, 2))
    for name, dcfg in (('drafter1', DCFG), ('drafter2', DCFG2)):
      ref = D.context_kv(bundle[name], dcfg, D.features_of(feats[:, :, list(dcfg.feature_layers)]),
                         jnp.arange(n)[None])
      for layer, ref_layer in zip(state.draft_caches[name], ref):
        np.testing.assert_allclose(layer['k'][b, :, :n], ref_layer['k'][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(layer['v'][b, :, :n], ref_layer['v'][0], rtol=1e-4, atol=1e-5)


def test_branch_points_and_packing():
  # c = [1, .9, .5, .8]: r(0)=.1, r(1)=.9*.5=.45, r(2)=.45*.2=.09, r(3)... (gamma=5 -> i <= 3)
  conf = jnp.asarray([[1.0, 0.9, 0.5, 0.8, 0.3]])
  # r(0)=0.1, r(1)=0.45, r(2)=0.09, r(3)=0.9*0.5*0.8*0.7=0.252
  np.testing.assert_array_equal(drafting.branch_points(conf, 3), [[1, 3, 0]])
  chain = jnp.asarray([[7, 11, 12, 13, 14]])
  branches = jnp.asarray([[[0, 11, 21, 22, 23], [0, 11, 12, 13, 31], [0, 41, 42, 43, 44]]])
  cut = jnp.asarray([[1, 3, 0]])
  t = drafting.pack_tree(jnp.asarray([7]), chain, branches, cut, size=12)
  # chain 0..4; branch 0 (cut 1): nodes 5,6,7 under chain node 1; branch 1 (cut 3): node 8 under
  # chain node 3; branch 2 (cut 0): nodes 9, 10, 11 under the anchor (its 4th token is cut off).
  assert t.tokens_BxT[0].tolist() == [7, 11, 12, 13, 14, 21, 22, 23, 31, 41, 42, 43]
  assert t.parents_BxT[0].tolist() == [0, 0, 1, 2, 3, 1, 5, 6, 3, 0, 9, 10]
  assert t.valid_BxT[0].all()


def test_invalid_spec_settings():
  gen = G.GenerationSettings(max_new_tokens=4, eos_ids=(), pad_id=0)
  with pytest.raises(ValueError, match='needs drafter2'):
    SP.SpecSettings(gen, method='d2sd', gamma=5, drafter1=DCFG)
  with pytest.raises(ValueError, match='set gamma=5'):
    SP.SpecSettings(gen, method='dflash', gamma=8, drafter1=DCFG)
  with pytest.raises(ValueError, match='n_branches'):
    SP.SpecSettings(gen, method='d2sd', gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=5)
  with pytest.raises(ValueError, match='tree_budget'):
    SP.SpecSettings(gen, method='d2sd', gamma=5, drafter1=DCFG, drafter2=DCFG2, tree_budget=3)
  with pytest.raises(ValueError, match='method'):
    SP.SpecSettings(gen, method='magic')


# ----------------------------------------------------------------------------------------------
# Recursive rejection with sibling laws, and leniency λ.


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
    return np.asarray(S.probs(_full_logits_last(cfg, params, jnp.asarray([seq])), settings),
                      np.float64)
  law = {}
  p1 = probs(prompt)
  for x1 in np.nonzero(p1)[0]:
    p2 = probs(prompt + [int(x1)])
    for x2 in np.nonzero(p2)[0]:
      law[(int(x1), int(x2))] = p1[x1] * p2[x2]
  return law


@functools.partial(jax.jit, static_argnums=(0,))
def _full_logits_last(cfg, params, tokens_1xT):
  T = tokens_1xT.shape[1]
  h, _, _ = M.forward(params, cfg, tokens_1xT, jnp.arange(T)[None], M.init_cache(cfg, 1, T),
                      jnp.zeros((1,), jnp.int32))
  return M.logits(params, cfg, h)[0, -1]


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
  _, init, loop, _ = _jitted()
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


def test_d2sd_on_smollm2_equals_reference_greedy(smollm2):
  """The full method (random small drafters: acceptance is rare, losslessness is the point) on
  the real target and the reference prompts, one batch of 6 lengths."""
  import json
  import os
  with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'smollm2_reference.json')) as f:
    cases = json.load(f)['generation_cases']
  tcfg, tok = smollm2.cfg, smollm2.tokenizer
  small = D.DrafterConfig(gamma=6, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                          d_ff=128, feature_layers=(1, 15, 30))
  bundle = {'target': smollm2.params,
            'drafter1': D.init_params(small, tcfg, jax.random.PRNGKey(1)),
            'drafter2': D.init_params(small, tcfg, jax.random.PRNGKey(2))}
  spec = SP.SpecSettings(G.GenerationSettings(max_new_tokens=16, eos_ids=(), pad_id=tok.pad_id),
                         method='d2sd', gamma=6, drafter1=small, drafter2=small, n_branches=2)
  block, lens = G.pad_prompts([c['prompt_ids'] for c in cases], tok.pad_id)
  _, init, loop, _ = _jitted()
  state = init(bundle, tcfg, spec, block, lens, G.row_keys(0, range(len(cases))),
               SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, tcfg, spec, state)
  out = SP.generated(state, 16)
  for b, case in enumerate(cases):
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), 16)
    assert out[b, :min(n, 16)].tolist() == case['greedy_ids'][:min(n, 16)], case['prompt']


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

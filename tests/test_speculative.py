"""The speculative step: equal to AR (every method), caches equal a fresh prefill, one program."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax import drafter as D
from d2sd_jax import drafting
from d2sd_jax import generate as G
from d2sd_jax import model as M
from d2sd_jax import sampling as S
from d2sd_jax import speculative as SP
from d2sd_jax import tree as tree_lib
from spec_helpers import DCFG, DCFG2, PROMPTS, bundle_for, jitted, run_both

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
  _, init, _, step = jitted()
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
  monkeypatch.setitem(drafting.REGISTRY, method, drafting.Method(oracle_drafter(reference, corrupt)))
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
  _, init, loop, _ = jitted()
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
  _, init, _, _ = jitted()
  bundle = {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  loop = jax.jit(SP.spec_loop, static_argnums=(1, 2)).lower(bundle, cfg, spec, state).compile()
  assert 'while' in loop.as_text()
  with jax.transfer_guard('disallow'):
    out = loop(bundle, state)
  assert bool(out.done_B.all())




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
  _, init, loop, _ = jitted()
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
  _, init, _, step = jitted()
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
  with pytest.raises(ValueError, match='steps'):
    SP.SpecSettings(gen, method='dflash', gamma=5, drafter1=DCFG, steps=0)
  with pytest.raises(ValueError, match='order'):
    SP.SpecSettings(gen, method='dflash', gamma=5, drafter1=DCFG, order='random')


# ----------------------------------------------------------------------------------------------
# Recursive rejection with sibling laws, and leniency λ.




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
  _, init, loop, _ = jitted()
  state = init(bundle, tcfg, spec, block, lens, G.row_keys(0, range(len(cases))),
               SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, tcfg, spec, state)
  out = SP.generated(state, 16)
  for b, case in enumerate(cases):
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), 16)
    assert out[b, :min(n, 16)].tolist() == case['greedy_ids'][:min(n, 16)], case['prompt']



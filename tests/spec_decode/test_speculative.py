"""The speculative step: equal to AR (every method), caches equal a fresh prefill, one program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.models import attention as A
from d2sd_jax.models import sampling as S
from d2sd_jax.spec_decode import speculative as SP
from d2sd_jax.spec_decode import tree as tree_lib
from d2sd_jax.formats.drafters import load_drafter
from tests.helpers import loop_checks as H
from tests.helpers import programs
from tests.helpers.loop_checks import run_both
from tests.helpers.programs import jitted
from tests.helpers.tiny_drafters import DCFG, DCFG2, PROMPTS
from tests.conftest import FIXTURES


@pytest.mark.parametrize('gamma', [2, 5, 8])
def test_pld_greedy_equals_ar(tiny, gamma):
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=23, eos_ids=(), pad_id=0),
                         method='pld', gamma=gamma)
  ar, sp, state = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar
  assert int(state.accepted_hist_BxC[:, 1:].sum()) > 0  # drafts were accepted along the way


def test_tiny_target_is_not_degenerate(tiny):
  """Its greedy outputs vary, and they depend on the context beyond the last token."""
  cfg, params = tiny
  gen = AR.GenerationSettings(max_new_tokens=16, eos_ids=(), pad_id=0)
  outs = H.ar_outputs(cfg, params, PROMPTS, gen)
  assert all(len(set(o)) >= 5 for o in outs), outs
  a = programs.full_last_logits(cfg, params, jnp.asarray([[3, 9, 12]]))
  b = programs.full_last_logits(cfg, params, jnp.asarray([[50, 9, 12]]))
  assert int(jnp.argmax(a)) != int(jnp.argmax(b))


@pytest.mark.slow
def test_eos_inside_accepted_path_stops_where_ar_does(tiny, trained):
  """The oracle's accepted path runs past an EOS token: the cycle commits up to the EOS only."""
  H.check_eos_inside_accepted_path(tiny, trained)


@pytest.mark.parametrize('max_new', [1, 2, 7])
def test_length_limit_inside_accepted_path(tiny, max_new):
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=max_new, eos_ids=(), pad_id=0),
                         gamma=8)
  ar, sp, _ = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar and all(len(o) == max_new for o in sp)


@pytest.mark.slow
def test_oracle_tree_accepts_branch_paths_and_caches_stay_fresh(tiny, trained):
  """Every cycle accepts a path through a branch (compaction moves its K/V; the drafters'
  contexts take its features): after each cycle every cache equals a fresh prefill."""
  counts = H.check_oracle_tree(tiny, trained)
  assert counts['accepted'] >= 3 * counts['cycles']


def oracle_drafter(reference_BxN, corrupt):
  """Proposes the AR continuation (or, corrupted, a token that is always wrong)."""

  def draft(params, cfg, settings, state):
    k = state.num_out_B[:, None] + jnp.arange(settings.gamma - 1)[None]
    ref = jnp.take_along_axis(reference_BxN, jnp.clip(k, 0, reference_BxN.shape[1] - 1), 1)
    if corrupt:
      ref = (ref + 1) % 64
    return tree_lib.chain(state.anchor_B, ref, k < reference_BxN.shape[1])

  return draft


@pytest.mark.slow
@pytest.mark.parametrize('corrupt', [False, True])
def test_perfect_and_adversarial_drafters(tiny, monkeypatch, corrupt):
  cfg, params = tiny
  gen = AR.GenerationSettings(max_new_tokens=25, eos_ids=(), pad_id=0)
  ar, _, _ = run_both(cfg, params, PROMPTS, SP.SpecSettings(gen, gamma=5))
  reference = jnp.asarray([o + [0] * 8 for o in ar])
  method = 'oracle_wrong' if corrupt else 'oracle'  # distinct static settings -> own program
  monkeypatch.setitem(drafting.REGISTRY, method,
                      drafting.Method(oracle_drafter(reference, corrupt)))
  spec = SP.SpecSettings(gen, method=method, gamma=5)
  ar2, sp, state = run_both(cfg, params, PROMPTS, spec)
  assert sp == ar == ar2
  hist = np.asarray(state.accepted_hist_BxC)
  if corrupt:  # nothing accepted: one token per cycle, tau = 1
    assert hist[:, 1:].sum() == 0 and (state.cycles_B == 24).all()
  else:  # every draft accepted: gamma tokens per cycle (the last cycle is cut by the limit)
    assert (hist[:, 4] == 5).all() and (state.cycles_B == 5).all()  # 1 + 5 * 5 >= 25


def test_batched_equals_per_prompt_and_seeded_sampling(tiny):
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=15, eos_ids=(3,), pad_id=0,
                                              sampling=S.SamplingSettings(temperature=6.0)),
                         gamma=4)
  _, batched, _ = run_both(cfg, params, PROMPTS, spec, seed=3)
  _, again, _ = run_both(cfg, params, PROMPTS, spec, seed=3)
  assert batched == again
  _, init, loop, _ = jitted()
  for r, prompt in enumerate(PROMPTS):
    block, lens = AR.pad_prompts([prompt], 0, bucket=8)
    state = init({'target': params}, cfg, spec, block, lens, AR.row_keys(3, [r]),
                 SP.cache_size_needed(block.shape[1], spec))
    state = loop({'target': params}, cfg, spec, state)
    assert SP.generated(state, 15)[0, :state.num_out_B[0]].tolist() == batched[r]


def test_one_program_without_host_transfers(tiny):
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=10, eos_ids=(), pad_id=0), gamma=4)
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  keys = AR.row_keys(0, range(3))
  _, init, _, _ = jitted()
  bundle = {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  loop = jax.jit(SP.spec_loop, static_argnames=('cfg', 'settings')).lower(
      bundle, cfg, spec, state).compile()
  assert 'while' in loop.as_text()
  with jax.transfer_guard('disallow'):
    out = loop(bundle, state)
  assert bool(out.done_B.all())




@pytest.mark.slow
def test_pld_on_smollm2_equals_reference_greedy(smollm2):
  """Real prompts (plain and chat, one batch of 6 lengths): prompt-lookup decoding reproduces the
  reference greedy tokens (transformers, float32) exactly like AR does."""
  import json
  import os
  with open(os.path.join(FIXTURES, 'smollm2_reference.json')) as f:
    cases = json.load(f)['generation_cases']
  tok = smollm2.tokenizer
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=32, eos_ids=(), pad_id=tok.pad_id),
                         gamma=6)
  block, lens = AR.pad_prompts([c['prompt_ids'] for c in cases], tok.pad_id)
  keys = AR.row_keys(0, range(len(cases)))
  _, init, loop, _ = jitted()
  bundle = {'target': smollm2.params}
  state = init(bundle, smollm2.cfg, spec, block, lens, keys,
               SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, smollm2.cfg, spec, state)
  out = SP.generated(state, 32)
  for b, case in enumerate(cases):
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), 32)
    assert out[b, :n].tolist() == case['greedy_ids'][:n], case['prompt']
  assert int(state.accepted_hist_BxC[:, 1:].sum()) > 0


# ----------------------------------------------------------------------------------------------
# Drafter-based methods, with tiny drafters trained on the target: drafts are accepted.

SLOW = pytest.mark.slow  # multi-step denoising, a node budget and merged re-drafts: slow tier


# Every registered method at its defaults (a best-first tree at 8 nodes), so a method added with
# drafting.register gets this check without an edit here; then the variants (slow tier).
REGISTERED = [(m, 1, 8 if method.budgeted else 0, 'exclude', 1) for m, method in
              drafting.REGISTRY.items()]
VARIANTS = [pytest.param('dflash', 2, 0, 'exclude', 1, marks=SLOW),
            pytest.param('d2sd', 3, 11, 'exclude', 1, marks=SLOW),
            pytest.param('d2sd', 1, 0, 'merge', 1, marks=SLOW),
            pytest.param('d2sd_pld', 1, 0, 'merge', 1, marks=SLOW),
            # branches re-drafted in more passes (spec.branch_passes)
            pytest.param('d2sd', 1, 0, 'exclude', 2, marks=SLOW),
            pytest.param('d2sd_tree', 1, 8, 'exclude', 2, marks=SLOW),
            pytest.param('dflash_dflash', 1, 0, 'merge', 3, marks=SLOW)]


@pytest.mark.parametrize('method,steps,budget,redraft,passes', REGISTERED + VARIANTS)
def test_drafter_methods_equal_ar(tiny, trained, method, steps, budget, redraft, passes):
  """Output = AR greedy, every cache = a fresh prefill after every cycle, drafts accepted (for
  D2SD also on drafter 2's branches). The bundle is prepared as decoding.SpecRunner prepares it
  (drafter heads and key/value rows gathered once); the other tests use the plain one."""
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=14, eos_ids=(), pad_id=0),
                         method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=3,
                         steps=steps, tree_budget=budget, redraft=redraft, branch_passes=passes)
  bundle = SP.prepare(trained, cfg)
  assert 'wkv' in bundle['drafter1']['layers'][0] and 'wkv' not in trained['drafter1']['layers'][0]
  outs, counts = H.run_cycles(cfg, bundle, spec, PROMPTS)
  assert outs == H.ar_outputs(cfg, params, PROMPTS, spec.generation)
  full = {'pld': 5, 'dflash': 5, 'dflash_resample': 17, 'dflash_dflash': 17, 'd2sd': 17,
          'd2sd_pld': 5 + 12 + 4}  # a chain (+ 3 branches) (+ pld)
  assert spec.tree_size == (budget or full.get(method, spec.tree_size))
  if drafting.REGISTRY[method].drafters:
    assert counts['accepted'] >= counts['cycles'], counts
  if method in ('d2sd', 'd2sd_pld') and not budget:
    assert counts['branch_accepts'] > 0, counts


@pytest.mark.parametrize('method', ['d2sd', 'd2sd_pld'])
def test_attention_over_context_windows_stays_lossless(tiny, trained, monkeypatch, method):
  """Windows of 8, 16, 32, ... slots (attention.context_windows; 256 and up by default), so the
  cycles cross from one window into the next, in the target's verification and in the
  drafters' context: still AR greedy's output (computed over the whole cache, before the
  windows shrink), fresh caches after every cycle, drafts accepted on branches."""
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=14, eos_ids=(), pad_id=0),
                         method=method, gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=3)
  reference = H.ar_outputs(cfg, params, PROMPTS, spec.generation)
  monkeypatch.setattr(A, 'MIN_WINDOW', 8)
  block, _ = AR.pad_prompts(PROMPTS, 0, bucket=8)
  windows = A.context_windows(SP.cache_size_needed(block.shape[1], spec))
  window_of = lambda n: min(w for w in windows if w >= n)
  # the longest row's context starts in one window and ends in a larger one
  longest = max(len(p) for p in PROMPTS)
  assert window_of(longest) < window_of(longest + 14) < windows[-1], windows
  outs, counts = H.run_cycles(cfg, SP.prepare(trained, cfg), spec, PROMPTS)
  assert outs == reference
  assert counts['branch_accepts'] > 0, counts


def key_bits(key):
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return tuple(np.asarray(key).ravel().tolist())


def test_drafting_and_acceptance_keys_never_collide(tiny):
  """The drafting stream, every node's acceptance key and the bonus key are distinct, in every
  cycle, and distinct from the keys AR sampling uses for the same row (fold_in(row, n))."""
  cfg, params = tiny
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0), gamma=5)
  _, init, _, step = jitted()
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  row_keys = AR.row_keys(0, range(3))
  state = init({'target': params}, cfg, spec, block, lens, row_keys,
               SP.cache_size_needed(block.shape[1], spec))
  seen = [set() for _ in range(3)]
  for _ in range(4):
    draft_B, accept_B = state.cycle_keys
    nodes = tree_lib.node_keys(accept_B, spec.tree_size)
    for b in range(3):
      keys = [key_bits(k) for k in [draft_B[b], *nodes[b]]]
      assert len(set(keys)) == len(keys)
      assert not seen[b] & set(keys)
      seen[b] |= set(keys)
    state = step({'target': params}, cfg, spec, state)
  for b in range(3):
    ar_keys = {key_bits(jax.random.fold_in(row_keys[b], n)) for n in range(40)}
    assert not seen[b] & ar_keys


def test_invalid_spec_settings():
  gen = AR.GenerationSettings(max_new_tokens=4, eos_ids=(), pad_id=0)
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




@pytest.mark.slow
@pytest.mark.parametrize('batch', [1, 3])
def test_d2sd_on_smollm2_with_shipped_drafters_equals_reference_greedy(smollm2, batch):
  """The full method with the shipped drafters on the real target and the reference prompts
  (transformers' greedy tokens, float32), one row and three rows of different lengths."""
  import json
  import os
  with open(os.path.join(FIXTURES, 'smollm2_reference.json')) as f:
    cases = json.load(f)['generation_cases'][:batch]
  tcfg, tok = smollm2.cfg, smollm2.tokenizer
  d1cfg, d1, _ = load_drafter('drafters/smollm2-drafter1', smollm2)
  d2cfg, d2, _ = load_drafter('drafters/smollm2-drafter2', smollm2)
  bundle = {'target': smollm2.params, 'drafter1': d1, 'drafter2': d2}
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=24, eos_ids=(), pad_id=tok.pad_id),
                         method='d2sd', gamma=d1cfg.gamma, drafter1=d1cfg, drafter2=d2cfg,
                         n_branches=3, tree_budget=16)
  block, lens = AR.pad_prompts([c['prompt_ids'] for c in cases], tok.pad_id)
  _, init, loop, _ = jitted()
  state = init(bundle, tcfg, spec, block, lens, AR.row_keys(0, range(len(cases))),
               SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, tcfg, spec, state)
  out = SP.generated(state, 24)
  for b, case in enumerate(cases):
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), 24)
    assert out[b, :min(n, 24)].tolist() == case['greedy_ids'][:min(n, 24)], case['prompt']
  assert int(state.accepted_hist_BxC[:, 1:].sum()) > 0  # the drafters' tokens were accepted


@pytest.mark.parametrize('layout', ['heads', 'flat'])
@pytest.mark.parametrize('B', [1, 3])
def test_compaction_writes_the_accepted_path_after_each_rows_length(B, layout):
  """path_rows then write_path put node path[b, c]'s K/V at slot len[b] + c of row b and
  leave every other slot alone, from token-major K/V laid out [B, T, Hkv, hd] (XLA) or
  [B, T, Hkv·hd] (the TPU kernels); one row (its slices) and several (a gather) alike. A path
  read in node order, or one row's path used for all, differs."""
  Hkv, S, T, hd, C = 2, 40, 9, 4, 5
  ks = jax.random.split(jax.random.key(0), 4)
  cache = [{'k': jax.random.normal(ks[0], (B, Hkv, S, hd)),
            'v': jax.random.normal(ks[1], (B, Hkv, S, hd))}]
  new_BxTxHxd = {'k': jax.random.normal(ks[2], (B, T, Hkv, hd)),
                 'v': jax.random.normal(ks[3], (B, T, Hkv, hd))}
  new = new_BxTxHxd if layout == 'heads' else jax.tree.map(
      lambda a: a.reshape(B, T, Hkv * hd), new_BxTxHxd)
  rng = np.random.default_rng(B)
  path = np.stack([rng.choice(T, C, replace=False) for _ in range(B)]).astype(np.int32)
  lens = np.array([3, 17, 30][:B], np.int32)
  got = SP.write_path(cache, SP.path_rows([new], jnp.asarray(path), hd), jnp.asarray(lens))[0]
  for name in ('k', 'v'):
    want = np.array(cache[0][name])
    for b in range(B):
      want[b, :, lens[b]:lens[b] + C] = np.asarray(new_BxTxHxd[name])[b, path[b]].transpose(1, 0, 2)
    np.testing.assert_array_equal(got[name], want)


def test_verify_pads_a_batch_to_a_multiple_of_8_nodes_and_the_tree_is_unchanged(tiny, trained):
  """With several rows the target verifies a multiple of 8 nodes (D2SD's 17 here: 24), the
  padding invalid leaves under the anchor: each row's logits (of its 17 nodes only), K/V and
  features equal verifying that row alone, unpadded."""
  cfg, _ = tiny
  assert [SP.verified_nodes(b, n) for b, n in ((1, 17), (2, 17), (2, 16), (8, 76))] == [
      17, 24, 16, 80]
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0),
                         method='d2sd', gamma=5, drafter1=DCFG, drafter2=DCFG2, n_branches=3)
  bundle = SP.prepare(trained, cfg)
  block, lens = AR.pad_prompts(PROMPTS[:2], 0, bucket=8)
  state = SP.init_state(bundle, cfg, spec, block, lens, AR.row_keys(0, range(2)),
                        SP.cache_size_needed(block.shape[1], spec))
  # (jitted: op by op, the tiny target's verification takes seconds per call)
  draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
  verify = jax.jit(SP.verify, static_argnames=('cfg', 'settings'))
  tree = draft(bundle, cfg, spec, state)
  both = verify(bundle, cfg, spec, state, tree)
  assert both.logits_BxTxV.shape[:2] == (2, 17) and both.anc_BxTxT.shape == (2, 17, 17)
  assert both.new_kv[0]['k'].shape[1] == 24 and both.features.shape[1] == 24
  for b in range(2):
    row = lambda x, b=b: x[b:b + 1] if getattr(x, 'ndim', 0) else x
    alone = verify(bundle, cfg, spec, jax.tree.map(row, state), jax.tree.map(row, tree))
    assert alone.new_kv[0]['k'].shape[1] == 17
    close = lambda got, want: np.testing.assert_allclose(
        got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    close(both.logits_BxTxV[b], alone.logits_BxTxV[0])
    close(both.features[b, :17], alone.features[0])
    for got, want in zip(both.new_kv, alone.new_kv):
      close(got['k'][b, :17], want['k'][0])
    np.testing.assert_array_equal(both.depth_BxT[b], alone.depth_BxT[0])

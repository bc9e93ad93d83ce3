"""Drafting (d2sd_jax/spec_decode/drafting.py): where branches leave drafter 1's chain (the top-r
cuts by enumeration, merged re-drafts hanging where they leave the chain), drafter 2's
re-drafts at those cuts, packing a chain and branches into one tree, every verified node
reachable, a resampled branch of a certain drafter dropped, and every row of a batch drafting
what it drafts alone. That every registered method stays lossless is checked with the loop
(test_speculative.py's test_drafter_methods_equal_ar)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.models import drafter as D
from d2sd_jax.models import sampling as S
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP
from tests.helpers import loop_checks as H
from tests.helpers.loop_checks import run_both
from tests.helpers.programs import jitted
from tests.helpers.tiny_drafters import DCFG, PROMPTS


# Every drafter method; d2sd (drafter 1 and drafter 2 through the same drafting path) in the
# default tier, the others in the slow tier.
ROW_METHODS = [pytest.param(m, marks=() if m == 'd2sd' else (pytest.mark.slow,))
               for m, method in drafting.REGISTRY.items() if method.drafters]


@pytest.mark.parametrize('method', ROW_METHODS)
def test_rows_draft_what_they_draft_alone(tiny, trained, method):
  """Rows of different committed lengths in one batch: each row's tree is the tree it drafts
  alone (its own positions and context slots, not the longest row's)."""
  H.check_rows_draft_as_alone(tiny, trained, methods=(method,))



@pytest.mark.slow
def test_d2sd_tree_is_drafter2_at_the_top_r_cuts(tiny, trained):
  H.check_d2sd_tree_is_drafter2(tiny, trained)


def test_a_second_branch_pass_drafts_from_the_forced_token(tiny, trained):
  """spec.branch_passes=2: each branch is drafter 2's first re-drafted token, then what it
  drafts with that token given (the reference re-drafts each longer prefix alone); and the
  second pass changes some branch here, so the check compares two different programs."""
  two = H.check_d2sd_tree_is_drafter2(tiny, trained, cycles=2, branch_passes=2)
  one = H.check_d2sd_tree_is_drafter2(tiny, trained, cycles=2)
  assert two != one
  assert [[(c, b[:c + 2]) for c, b in row] for row in two] == [
      [(c, b[:c + 2]) for c, b in row] for row in one]  # the first pass's first token stays


def test_branch_passes_need_a_method_that_redrafts():
  gen = AR.GenerationSettings(max_new_tokens=8, eos_ids=(), pad_id=0)
  with pytest.raises(ValueError, match='re-drafts no branches'):
    SP.SpecSettings(gen, method='dflash', gamma=DCFG.gamma, drafter1=DCFG, branch_passes=2)
  with pytest.raises(ValueError, match=f'branch_passes={DCFG.gamma} must be in 1..gamma-1'):
    SP.SpecSettings(gen, method='d2sd', gamma=DCFG.gamma, drafter1=DCFG, drafter2=DCFG,
                    branch_passes=DCFG.gamma)
  settings = SP.SpecSettings(gen, method='dflash_dflash', gamma=DCFG.gamma, drafter1=DCFG,
                             branch_passes=3)
  assert drafting.drafter_passes(settings) == ('drafter1',) * 4


@pytest.mark.slow
def test_every_verified_node_is_reachable(tiny, trained):
  H.check_every_verified_node_reachable(tiny, trained)


def test_branch_points_are_the_top_r_by_enumeration():
  H.check_branch_points()


def test_merged_branches_hang_where_they_leave_the_chain():
  H.check_merged_cuts()



@pytest.mark.slow
def test_resampled_branch_of_a_certain_drafter_is_dropped_not_nan(tiny, trained, monkeypatch):
  """Drafter 1 with probability exactly 1 on its chain token: no other token is left to
  resample at that branch's first position. The branch is dropped; nothing is NaN; the output
  still follows the target at T > 0."""
  cfg, params = tiny
  real_first_draft = drafting.first_draft

  def certain(params_, cfg_, settings, state):
    tokens, conf, probs = real_first_draft(params_, cfg_, settings, state)
    return tokens, conf, jax.nn.one_hot(tokens, probs.shape[-1])

  monkeypatch.setattr(drafting, 'first_draft', certain)
  jax.clear_caches()
  spec = SP.SpecSettings(AR.GenerationSettings(max_new_tokens=6, eos_ids=(), pad_id=0,
                                              sampling=S.SamplingSettings(temperature=1.0)),
                         method='dflash_resample', gamma=5, drafter1=DCFG, n_branches=2)
  _, init, _, _ = jitted()
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(trained, cfg, spec, block, lens, AR.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  tree = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))(trained, cfg, spec, state)
  assert np.isfinite(np.asarray(tree.q_BxTxV)).all()
  assert not np.asarray(tree.valid_BxT[:, spec.gamma:]).any()  # every branch dropped
  _, sp, _ = run_both(cfg, trained, PROMPTS, spec)
  assert all(0 <= t < cfg.vocab_size for row in sp for t in row) and all(len(r) == 6 for r in sp)
  jax.clear_caches()


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


def test_a_drafter_window_drafts_from_the_last_w_committed_tokens_only(tiny, trained):
  """spec.drafter_window = W: drafter 1's block equals a drafter given a context of the last W
  committed tokens alone (their features, at their own positions, in a cache of W slots: no
  mask involved); it differs from the whole context's; the output stays AR's."""
  cfg, params = tiny
  W = 2
  gen = AR.GenerationSettings(max_new_tokens=10, eos_ids=(), pad_id=0)
  spec = SP.SpecSettings(gen, method='dflash', gamma=DCFG.gamma, drafter1=DCFG, drafter_window=W)
  whole = SP.SpecSettings(gen, method='dflash', gamma=DCFG.gamma, drafter1=DCFG)
  _, init, _, step = jitted()
  block, lens = AR.pad_prompts(PROMPTS, 0, bucket=8)
  state = init(trained, cfg, spec, block, lens, AR.row_keys(0, range(3)),
               SP.cache_size_needed(block.shape[1], spec))
  for _ in range(2):
    state = step(trained, cfg, spec, state)
  first = jax.jit(drafting.first_draft, static_argnames=('cfg', 'settings'))
  _, _, probs = first(trained, cfg, spec, state)
  _, _, probs_whole = first(trained, cfg, whole, state)
  G = DCFG.gamma
  for b in range(3):
    n = int(state.cache_len_B[b])
    assert n > W  # (the window leaves tokens out)
    _, feats = H._jitted_prefill(cfg, params, state.seq_BxL[b:b + 1], DCFG.feature_layers)  # pylint: disable=protected-access
    feats = D.features_of(feats[:, n - W:n])
    ctx = D.context_kv(trained['drafter1'], DCFG, feats, (n - W + jnp.arange(W))[None])
    tokens = jnp.zeros((1, G), jnp.int32).at[0, 0].set(state.seq_BxL[b, n])
    logits = D.forward(trained['drafter1'], DCFG, params, cfg, tokens, jnp.arange(G)[None] > 0,
                       n + jnp.arange(G)[None], ctx, jnp.asarray([W]),
                       jnp.ones((1, G, G), bool))[0]
    # Two programs (a masked cache against a W-token one) sum in different orders: float32
    # rounding moves a probability by up to ~5e-5 on some CPUs; a wrong window moves it > 1e-3.
    np.testing.assert_allclose(probs[b, 1:], jax.nn.softmax(logits[1:]), atol=2e-4)
    assert not np.allclose(probs[b, 1:], probs_whole[b, 1:], atol=1e-3)
  ar, sp, _ = run_both(cfg, trained, PROMPTS, spec)
  assert sp == ar
  with pytest.raises(ValueError, match='drafter_window=-1 must be >= 0'):
    SP.SpecSettings(gen, method='dflash', gamma=DCFG.gamma, drafter1=DCFG, drafter_window=-1)

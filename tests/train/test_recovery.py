"""The recovery measurement (train/recovery.py): which cuts D²SD selects, what a branch adds at the
chain's true first rejection under each redraft rule, and the tally over a tiny target."""
import types

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.models import drafter as D
from d2sd_jax.models import target as M
from d2sd_jax.spec_decode import drafting
from d2sd_jax.train import losses, recovery

DCFG = D.DrafterConfig(gamma=5, n_layers=1, d_model=24, n_heads=4, n_kv_heads=2, head_dim=6,
                       d_ff=40, feature_layers=(0, 1, 2), rope_base=10000.0, norm_eps=1e-6)


def test_selected_cuts_are_the_decoders_branch_points():
  conf = np.random.default_rng(0).uniform(0.01, 0.99, (50, 8))
  for k in (1, 2, 4):
    want = np.asarray(drafting.branch_points(jnp.asarray(conf, jnp.float32), k))
    for row, cuts in zip(conf, want):
      assert recovery.selected_cuts(row, k) == set(cuts.tolist())


def test_a_branch_adds_its_leading_matches_and_merge_adds_nothing_on_the_rejected_token():
  chain = np.array([7, 1, 2, 3, 4])
  labels = np.array([7, 1, 9, 8, 6])  # the chain is first rejected at cut 1 (label 9, draft 2)
  ok = np.ones(5, bool)
  top2 = np.array([[0, 0], [0, 0], [2, 9], [8, 5], [6, 6]])  # top-1 repeats the chain's token
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'exclude') == 3  # 9, 8, 6
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'merge') == 0
  top2[2] = [9, 2]  # top-1 already differs and is right: both rules agree
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'exclude') == 3
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'merge') == 3
  top2[3] = [5, 8]  # a wrong second draft ends the run
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'merge') == 1
  ok[2] = False  # no label there (past the completion): nothing is counted
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'exclude') == 0


def test_twopass_continues_from_the_block_that_sees_the_forced_token():
  chain = np.array([7, 1, 2, 3, 4])
  labels = np.array([7, 1, 9, 8, 6])  # first rejected at cut 1
  ok = np.ones(5, bool)
  top2 = np.array([[0, 0], [0, 0], [2, 9], [3, 5], [4, 4]])  # one pass: continues the chain
  second = np.array([[0, 0], [0, 0], [9, 9], [8, 3], [6, 1]])  # the pass that sees 9
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'exclude') == 1  # 9, then 3 != 8
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'twopass', second) == 3  # 9, 8, 6
  top2[2] = [2, 5]  # the forced token is wrong: the second pass is never right
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'twopass', second) == 0
  top2[2] = [2, 9]
  second[4] = [1, 6]  # the second pass's own drafts end the run
  assert recovery.branch_gain(top2, chain, 1, labels, ok, 'twopass', second) == 2
  # a cut whose forced token is the block's last position: that token alone
  assert recovery.branch_gain(np.array([[0, 0]] * 4 + [[4, 6]]), chain, 3, labels, ok,
                              'twopass', None) == 1


def test_the_tally_counts_every_anchor_at_the_cut_training_finds(tiny):
  """Over a tiny target's sequences: one cycle per anchor, at the cut losses.chain_cuts (the
  training path) finds, every share summing to 1, gains bounded by the tokens left."""
  tcfg, tparams = tiny
  target = types.SimpleNamespace(params=tparams, cfg=tcfg)
  d1 = D.init_params(DCFG, tcfg, jax.random.PRNGKey(1))
  d2 = D.init_params(DCFG, tcfg, jax.random.PRNGKey(2))

  @jax.jit  # (op by op, the passes below take most of the test's time)
  def features_fn(params, tok):
    B, L = tok.shape
    _, _, feats = M.forward(params, tcfg, tok, jnp.broadcast_to(jnp.arange(L), (B, L)),
                            M.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                            feature_layers=DCFG.feature_layers)
    return D.features_of(feats)

  chain_cuts = jax.jit(losses.chain_cuts, static_argnums=(1, 3))

  rng = np.random.default_rng(0)
  seqs = [(rng.integers(0, tcfg.vocab_size, 30).astype(np.int32), 6),
          (rng.integers(0, tcfg.vocab_size, 21).astype(np.int32), 4)]
  # a completion the chain gets partly right: copy drafter 1's own chain after one anchor
  tok = seqs[0][0]
  top2, _ = recovery.block_top2(d1, DCFG, tparams, tcfg, features_fn(tparams, tok[None]),
                                tok[None], jnp.array([[10]], jnp.int32), 0)
  tok[11:13] = np.asarray(top2)[0, 1:3, 0]
  tally = recovery.measure(seqs, target, {'drafter1': (DCFG, d1), 'drafter2': (DCFG, d2)},
                           features_fn, 2, (12, 1 << 30), pad_id=0, bucket_len=8)
  n_anchors = sum(len(t) - 1 - (n - 1) for t, n in seqs)
  assert tally.cycles[-1].sum() == n_anchors
  assert tally.cycles[:-1].sum() == n_anchors  # every cycle in one context bucket
  table = tally.table()
  np.testing.assert_allclose(sum(table['rejection']), 1.0, rtol=1e-6)
  # the cuts, as the training path finds them
  want = np.zeros(DCFG.gamma)
  for t, n in seqs:
    anchors = jnp.arange(n - 1, len(t) - 1, dtype=jnp.int32)[None]
    ok = jnp.asarray(np.arange(len(t)) >= n)[None]
    cut, _ = chain_cuts(d1, DCFG, tparams, tcfg, features_fn(tparams, t[None]),
                               jnp.asarray(t)[None], ok, anchors)
    want += np.bincount(np.asarray(cut[0]), minlength=DCFG.gamma)
  np.testing.assert_array_equal(tally.cycles[-1], want)
  assert want[2:].sum() >= 1  # the copied completion: a chain accepted past its first draft
  for entry in table['by_cut']:
    for key in ('drafter1_exclude', 'drafter2_merge', 'drafter2_twopass'):
      assert 0 <= entry[key] <= DCFG.gamma - 1 - entry['cut']
  assert recovery.rejection_prior(tally).count(',') == DCFG.gamma - 2

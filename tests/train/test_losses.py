"""Drafter 2's training recipe (train/losses.py, train/blocks.py): the
reference's prefix prior and loss normalisation, distinct anchors, and blocks placed at drafter
1's first rejection with the rejected token forbidden."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.models import drafter as D
from d2sd_jax.models import target as M
from d2sd_jax.train import blocks, losses, schema, training
from tests.models import test_drafter
from tests.train import test_training

DCFG = dataclasses.replace(test_drafter.DCFG, gamma=5, n_layers=1)  # the same tiny drafter


@pytest.fixture(scope='module')
def setup(tiny):
  tcfg, tparams = tiny
  dparams = D.init_params(DCFG, tcfg, jax.random.PRNGKey(1))
  seq = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, tcfg.vocab_size)
  return tcfg, tparams, dparams, seq, features_of(tparams, tcfg, seq)


def features_of(tparams, tcfg, seq):
  B, L = seq.shape
  _, _, feats = M.forward(tparams, tcfg, seq, jnp.broadcast_to(jnp.arange(L), (B, L)),
                          M.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                          feature_layers=DCFG.feature_layers)
  return D.features_of(feats)


def test_the_reference_prior_is_the_visible_prefix_from_2_to_15_by_0_9_to_the_p():
  for gamma in (8, 16, 32):
    prior = np.asarray(losses.vp_prefix_prior(gamma, 0.8, 'reference'))
    P = np.arange(gamma - 1) + 1  # visible tokens, the anchor included
    want = np.where((P >= 2) & (P <= 15), 0.9 ** P, 0.0)
    np.testing.assert_allclose(prior, want / want.sum(), rtol=1e-6)
  assert np.asarray(losses.vp_prefix_prior(8, 0.8, 'reference'))[0] == 0  # never l = 0


def test_a_measured_prior_is_taken_as_given_and_bad_ones_are_refused():
  prior = np.asarray(losses.vp_prefix_prior(8, 0.8, '0.38,0.25,0.17,0.12,0.08'))
  np.testing.assert_allclose(prior, [0.38, 0.25, 0.17, 0.12, 0.08, 0, 0], rtol=1e-6)
  for bad, says in (('0.5,x', 'comma-separated'), ('1,1,1,1,1,1,1,1', 'at most gamma-1=7'),
                    ('0,0', 'not all zero'), ('1,-1', 'non-negative')):
    with pytest.raises(ValueError, match=says):
      losses.parse_prior(bad, 8)


def test_unnormalised_weights_are_the_raw_decay_a_long_prefix_weighing_less():
  w = np.asarray(losses.vp_weights(jnp.array([0, 3]), 6, 7.0, normalize=False))
  for row, l in zip(w, (0, 3)):
    np.testing.assert_allclose(row, [np.exp(-(k - l - 1) / 7.0) if k > l else 0.0
                                     for k in range(6)], rtol=1e-6)
  assert w[1].sum() < w[0].sum()


def test_distinct_anchors_never_repeat_and_mark_what_a_short_row_lacks():
  ok = np.zeros((3, 40), bool)
  ok[0, 5:35] = True
  ok[1, 10:14] = True  # 4 positions for 6 anchors
  ok[2, ::3] = True
  anchors, valid = map(np.asarray, losses.distinct_anchors(jax.random.PRNGKey(0), ok, 6))
  for b in range(3):
    used = anchors[b][valid[b]]
    assert len(set(used.tolist())) == len(used) and ok[b, used].all()
  assert valid[0].all() and valid[2].all()
  assert valid[1].sum() == 4 and set(anchors[1][valid[1]].tolist()) == {10, 11, 12, 13}
  # uniform over the allowed positions: each of row 0's 30 positions drawn ~ 6/30 of the time
  counts = np.zeros(40)
  for i in range(300):
    a, _ = losses.distinct_anchors(jax.random.PRNGKey(i), ok[:1], 6)
    counts[np.asarray(a[0])] += 1
  assert counts[~ok[0]].sum() == 0
  assert 30 < counts[ok[0]].min() and counts[ok[0]].max() < 95  # mean 60, sd ~7


def chain_of(setup, anchors):
  """Drafter 1's chain at each anchor (its block [anchor, MASK ...]), as token ids [B, A, G]."""
  tcfg, tparams, dparams, seq, feats = setup
  B, A = anchors.shape
  prefix = jnp.zeros((B, A), jnp.int32)
  tokens, is_mask, positions, _ = losses.block_inputs(seq, anchors, prefix, DCFG.gamma)
  logits = losses.block_logits(dparams, DCFG, tparams, tcfg, feats, tokens, is_mask, positions,
                               anchors)
  return np.asarray(jnp.argmax(logits, -1)).reshape(B, A, DCFG.gamma)


def test_chain_cuts_are_the_first_rejections_of_drafter_1s_chain(setup):
  """Labels made to agree with the chain for m drafts, then not: the cut is m, the token
  reported is the chain's rejected one. A label position masked out counts as a rejection."""
  tcfg, tparams, dparams, seq, _ = setup
  G = DCFG.gamma
  anchors = jnp.array([[3], [6]], jnp.int32)
  chain = chain_of(setup, anchors)  # the chain does not depend on tokens after the anchor
  want_cut = [2, 0]
  labels = np.array(seq)
  for b, (a, m) in enumerate(zip([3, 6], want_cut)):
    labels[b, a + 1:a + 1 + m] = chain[b, 0, 1:1 + m]
    labels[b, a + 1 + m] = (chain[b, 0, 1 + m] + 1) % tcfg.vocab_size
    labels[b, a + 2 + m:a + G] = chain[b, 0, 2 + m:]  # agreeing again after: still cut at m
  labels = jnp.asarray(labels)
  feats = features_of(tparams, tcfg, labels)
  np.testing.assert_array_equal(chain_of((tcfg, tparams, dparams, labels, feats), anchors), chain)
  ok = jnp.ones(labels.shape, bool)
  cut, token = losses.chain_cuts(dparams, DCFG, tparams, tcfg, feats, labels, ok, anchors)
  np.testing.assert_array_equal(cut[:, 0], want_cut)
  np.testing.assert_array_equal(token[:, 0], [chain[0, 0, 3], chain[1, 0, 1]])
  # the whole chain accepted: cut G-1
  full = np.array(labels)
  full[0, 4:4 + G - 1] = chain[0, 0, 1:]
  full = jnp.asarray(full)
  cut, _ = losses.chain_cuts(dparams, DCFG, tparams, tcfg, features_of(tparams, tcfg, full),
                             full, ok, anchors)
  assert int(cut[0, 0]) == G - 1
  # a position that is not a label stops the chain there
  cut, _ = losses.chain_cuts(dparams, DCFG, tparams, tcfg, feats, labels, ok.at[0, 5].set(False),
                             anchors)
  assert int(cut[0, 0]) == 1


def test_a_forbidden_token_leaves_the_softmax_of_that_position_only(setup):
  tcfg, tparams, dparams, seq, feats = setup
  G = DCFG.gamma
  anchors, prefix = jnp.array([[2, 7], [4, 9]]), jnp.array([[0, 2], [1, 3]])
  w = losses.vp_weights(prefix.reshape(-1), G, 3.0).reshape(2, 2, G)
  tokens, is_mask, positions, _ = losses.block_inputs(seq, anchors, prefix, G)
  logits = np.asarray(losses.block_logits(dparams, DCFG, tparams, tcfg, feats, tokens, is_mask,
                                          positions, anchors)).reshape(2, 2, G, -1)
  labels = np.asarray(tokens).reshape(2, 2, G)
  # forbid, at each block's first masked position, a token that is not its label
  first = np.asarray(prefix) + 1
  forbid = np.full((2, 2, G), -1)
  for b in range(2):
    for a in range(2):
      forbid[b, a, first[b, a]] = (labels[b, a, first[b, a]] + 5) % tcfg.vocab_size
  loss, _ = losses.drafter_loss(dparams, DCFG, tparams, tcfg, seq, feats, jnp.ones(seq.shape, bool),
                                anchors, prefix, w, forbid_BxAxG=jnp.asarray(forbid))
  want, total = 0.0, 0.0
  for b in range(2):
    for a in range(2):
      for k in range(first[b, a], G):
        z = logits[b, a, k].astype(np.float64)
        if forbid[b, a, k] >= 0:
          z = np.where(np.arange(len(z)) == forbid[b, a, k], -np.inf, z)
        logp = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
        want += float(w[b, a, k]) * -logp[labels[b, a, k]]
        total += float(w[b, a, k])
  np.testing.assert_allclose(float(loss), want / total, rtol=1e-5)
  plain, _ = losses.drafter_loss(dparams, DCFG, tparams, tcfg, seq, feats,
                                 jnp.ones(seq.shape, bool), anchors, prefix, w)
  assert float(plain) > float(loss)  # removing a wrong token's mass lowers every CE it touches


def test_blocks_at_chain_cuts_take_the_cut_as_prefix_and_drop_accepted_chains(setup, monkeypatch):
  tcfg, tparams, dparams, seq, feats = setup
  G = DCFG.gamma
  cut = jnp.array([[0, 2, G - 1], [1, 3, 0]], jnp.int32)
  token = jnp.array([[11, 12, 13], [14, 15, 16]], jnp.int32)
  monkeypatch.setattr(losses, 'chain_cuts', lambda *a, **k: (cut, token))
  c = test_training.tiny_config('unused', 'unused', 'unused', 'drafter2')
  c.loss.update(tau=3.0, block_norm=False)
  anchors = jnp.array([[1, 5, 8], [2, 6, 9]], jnp.int32)
  drawn = (anchors, None, jnp.ones((2, 3, G)).at[1, 2].set(0.0), None, None)
  _, prefix, weights, reveal, forbid = blocks.at_chain_cuts(
      drawn, (DCFG, dparams), tparams, tcfg, feats, seq, jnp.ones(seq.shape, bool), None, c,
      jax.random.PRNGKey(0))
  np.testing.assert_array_equal(prefix, jnp.minimum(cut, G - 2))
  raw = np.asarray(losses.vp_weights(jnp.minimum(cut, G - 2).reshape(-1), G, 3.0, False))
  in_use = np.array([[1, 1, 0], [1, 1, 0]], bool)  # accepted whole; a block that was unused
  np.testing.assert_allclose(weights, raw.reshape(2, 3, G) * in_use[..., None])
  for b in range(2):
    for a in range(3):
      row = np.asarray(forbid[b, a])
      k = int(prefix[b, a]) + 1
      assert row[k] == token[b, a] and (np.delete(row, k) == -1).all()
  assert reveal is None


def test_second_pass_blocks_start_after_the_cut_with_the_true_token_given(setup, monkeypatch):
  """loss.second_pass=1: every block whose cut leaves room starts one token later, nothing
  forbidden there (the true token is given); a cut at gamma-2 stays; held-out blocks stay at
  the cut."""
  tcfg, tparams, dparams, seq, feats = setup
  G = DCFG.gamma
  cut = jnp.array([[0, 2, G - 2], [1, G - 1, 0]], jnp.int32)
  token = jnp.array([[11, 12, 13], [14, 15, 16]], jnp.int32)
  monkeypatch.setattr(losses, 'chain_cuts', lambda *a, **k: (cut, token))
  c = test_training.tiny_config('unused', 'unused', 'unused', 'drafter2')
  c.loss.update(tau=3.0, block_norm=False, second_pass=1.0)
  anchors = jnp.array([[1, 5, 8], [2, 6, 9]], jnp.int32)
  drawn = (anchors, None, jnp.ones((2, 3, G)), None, None)
  call = lambda evaluate: blocks.at_chain_cuts(
      drawn, (DCFG, dparams), tparams, tcfg, feats, seq, jnp.ones(seq.shape, bool), None, c,
      jax.random.PRNGKey(0), evaluate)
  _, prefix, weights, _, forbid = call(False)
  shifted = np.array([[1, 1, 0], [1, 0, 1]], bool)
  np.testing.assert_array_equal(prefix, np.minimum(cut, G - 2) + shifted)
  raw = np.asarray(losses.vp_weights(jnp.asarray(prefix).reshape(-1), G, 3.0, False))
  in_use = np.array([[1, 1, 1], [1, 0, 1]], bool)  # the chain accepted whole: no loss
  np.testing.assert_allclose(weights, raw.reshape(2, 3, G) * in_use[..., None])
  np.testing.assert_array_equal(np.asarray(forbid)[shifted], -1)
  assert (np.asarray(forbid)[0, 2] == np.where(np.arange(G) == G - 1, 13, -1)).all()
  _, prefix, _, _, forbid = call(True)
  np.testing.assert_array_equal(prefix, np.minimum(cut, G - 2))
  many = jnp.zeros((2, 600), jnp.int32)  # cut 0 at 1,200 blocks: about half shift
  monkeypatch.setattr(losses, 'chain_cuts', lambda *a, **k: (many, many + 11))
  c.loss.second_pass = 0.5
  _, prefix, _, _, _ = blocks.at_chain_cuts(
      (jnp.tile(anchors, (1, 200)), None, jnp.ones((2, 600, G)), None, None), (DCFG, dparams),
      tparams, tcfg, feats, seq, jnp.ones(seq.shape, bool), None, c, jax.random.PRNGKey(0))
  assert 0.44 < float(jnp.mean(prefix)) < 0.56


def test_second_pass_needs_cuts_and_a_fraction():
  c = test_training.tiny_config('unused', 'unused', 'unused', 'drafter2')
  c.loss.second_pass = 0.5
  with pytest.raises(ValueError, match='set loss.cuts_from'):
    schema.validate(c)
  c.loss.update(second_pass=1.5, cuts_from='d1')
  with pytest.raises(ValueError, match=r'loss.second_pass=1.5 must be a fraction in \[0, 1\]'):
    schema.validate(c)


def test_cuts_from_is_refused_for_drafter_1_and_for_a_drafter_built_otherwise(
    tiny_folder, distill_dir, tmp_path):
  c = test_training.tiny_config(tiny_folder, distill_dir, str(tmp_path / 'd1'), steps=2)
  training.run(c)
  bad = test_training.tiny_config(tiny_folder, distill_dir, str(tmp_path / 'x'), steps=2)
  bad.loss.cuts_from = str(tmp_path / 'd1')
  with pytest.raises(ValueError, match="kind='drafter1' trains from the anchor alone"):
    training.run(bad)
  other = test_training.tiny_config(tiny_folder, distill_dir, str(tmp_path / 'd2'), 'drafter2', 2)
  other.drafter.gamma = 5
  other.loss.cuts_from = str(tmp_path / 'd1')
  with pytest.raises(ValueError, match='gamma=4 .* this drafter has gamma=5'):
    training.run(other)
  # built alike: drafter 2 trains at the chain's cuts (its held-out loss is finite)
  ok = test_training.tiny_config(tiny_folder, distill_dir, str(tmp_path / 'd2ok'), 'drafter2', 3)
  ok.loss.cuts_from = str(tmp_path / 'd1')
  ok.train.distinct_anchors = True
  out = training.run(ok)
  assert np.isfinite(out['loss']) and np.isfinite(out['eval']['loss'])

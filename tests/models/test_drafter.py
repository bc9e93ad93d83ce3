"""Drafter model (d2sd_jax/models/drafter.py), denoising sampler and training losses on tiny
configs. The loss checks (train/losses.py) stay here: they share this file's drafter set-up."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from d2sd_jax.models import drafter as D
from d2sd_jax.train import losses
from d2sd_jax.models import target as M
from tests.helpers import loop_checks
from tests.helpers import tiny_drafters

DCFG = D.DrafterConfig(gamma=4, n_layers=2, d_model=24, n_heads=4, n_kv_heads=2, head_dim=6,
                       d_ff=40, feature_layers=(0, 1, 2), rope_base=10000.0, norm_eps=1e-6)


@pytest.fixture(scope='module')
def setup(tiny):
  tcfg, tparams = tiny
  dparams = D.init_params(DCFG, tcfg, jax.random.PRNGKey(1))
  seq = jax.random.randint(jax.random.PRNGKey(2), (2, 14), 0, tcfg.vocab_size)
  _, _, feats = M.forward(tparams, tcfg, seq, jnp.broadcast_to(jnp.arange(14), (2, 14)),
                          M.init_cache(tcfg, 2, 14), jnp.zeros((2,), jnp.int32),
                          feature_layers=DCFG.feature_layers)
  return tcfg, tparams, dparams, seq, D.features_of(feats)


def decode_time_logits(setup, anchor, block_tokens, is_mask):
  """One block at `anchor` through the decode-time path: a context cache of positions < anchor."""
  tcfg, tparams, dparams, _, feats = setup
  return _decode_time_logits(tcfg, tparams, dparams, feats, jnp.int32(anchor), block_tokens,
                             is_mask)


@functools.partial(jax.jit, static_argnums=(0,))
def _decode_time_logits(tcfg, tparams, dparams, feats, anchor, block_tokens, is_mask):
  """(One program for every anchor: the context cache holds every position's features, and
  the block reads only the slots < anchor, as decoding reads only committed ones.)"""
  B, L = feats.shape[:2]
  cache = D.init_context_cache(DCFG, B, 16)
  cache = D.write_context(cache, dparams, DCFG, feats, jnp.broadcast_to(jnp.arange(L), (B, L)),
                          jnp.zeros(B, jnp.int32))
  pos = jnp.broadcast_to(anchor + jnp.arange(DCFG.gamma), (B, DCFG.gamma))
  ctx_mask = jnp.broadcast_to(jnp.arange(16) < anchor, (B, 16))
  return D.forward(dparams, DCFG, tparams, tcfg, block_tokens, is_mask, pos, cache, ctx_mask,
                   jnp.ones((B, DCFG.gamma, DCFG.gamma), bool))


def test_masked_token_identities_do_not_matter(setup):
  tcfg, _, _, seq, _ = setup
  G = DCFG.gamma
  block = seq[:, 5:5 + G]
  is_mask = jnp.broadcast_to(jnp.arange(G) >= 2, (2, G))
  other = jnp.where(is_mask, (block * 7 + 3) % tcfg.vocab_size, block)
  np.testing.assert_allclose(decode_time_logits(setup, 5, block, is_mask),
                             decode_time_logits(setup, 5, other, is_mask), rtol=1e-6, atol=1e-6)
  # ...while the unmasked ones do.
  changed = block.at[:, 1].set((block[:, 1] + 1) % tcfg.vocab_size)
  assert not np.allclose(decode_time_logits(setup, 5, block, is_mask),
                         decode_time_logits(setup, 5, changed, is_mask))


def test_training_blocks_match_decode_time_blocks(setup):
  """Many anchors side by side (training) = each block alone with a context cache (decoding)."""
  tcfg, tparams, dparams, seq, feats = setup
  G = DCFG.gamma
  anchors = jnp.asarray([[3, 7, 1], [9, 2, 5]])
  prefix = jnp.asarray([[0, 2, 1], [0, 0, 3]])
  tokens, is_mask, pos, _ = losses.block_inputs(seq, anchors, prefix, G)
  train_logits = losses.block_logits(dparams, DCFG, tparams, tcfg, feats, tokens, is_mask, pos,
                                     anchors)
  for b in range(2):
    for i in range(3):
      a = int(anchors[b, i])
      sl = slice(i * G, (i + 1) * G)
      ref = decode_time_logits(setup, a, jnp.broadcast_to(tokens[b, sl], (2, G)),
                               jnp.broadcast_to(is_mask[b, sl], (2, G)))[b]
      # Two programs: float32 rounding relative to the block's logits (up to ~16), 3.5e-7 of
      # them on one CPU; a context one slot longer or shorter moves them by 1.5e-2 of them.
      np.testing.assert_allclose(train_logits[b, sl], ref, rtol=0,
                                 atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_vp_prior_and_weights_follow_the_formulas():
  gamma, beta, tau = 6, 0.7, 2.0
  prior = np.asarray(losses.vp_prefix_prior(gamma, beta))
  want = np.array([beta**j for j in range(gamma - 1)])
  np.testing.assert_allclose(prior, want / want.sum(), rtol=1e-6)
  w = np.asarray(losses.vp_weights(jnp.arange(gamma - 1), gamma, tau))
  for l in range(gamma - 1):
    raw = np.array([np.exp(-(k - l - 1) / tau) if k > l else 0.0 for k in range(gamma)])
    np.testing.assert_allclose(w[l], raw / raw.sum(), rtol=1e-6)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _train_steps(dparams, tcfg, vp, tparams, seq, feats, key):
  opt = optax.adamw(1e-2)
  state = opt.init(dparams)
  B, A, G = seq.shape[0], 4, DCFG.gamma

  def batch(k):
    ka, kl = jax.random.split(k)
    anchors = jax.random.randint(ka, (B, A), 1, seq.shape[1] - 1)
    if vp:
      prefix = jax.random.choice(kl, G - 1, (B, A), p=losses.vp_prefix_prior(G, 0.6))
      weights = losses.vp_weights(prefix.reshape(-1), G, 2.0).reshape(B, A, G)
    else:
      prefix = jnp.zeros((B, A), jnp.int32)
      weights = jnp.broadcast_to(losses.vp_weights(jnp.zeros(1, jnp.int32), G, 3.0), (B, A, G))
    return anchors, prefix, weights

  def loss_fn(p, k):
    anchors, prefix, weights = batch(k)
    return losses.drafter_loss(p, DCFG, tparams, tcfg, seq, feats, jnp.ones(seq.shape, bool),
                               anchors, prefix, weights)[0]

  eval_key = jax.random.PRNGKey(99)
  before = loss_fn(dparams, eval_key)

  def step(carry, k):
    p, s = carry
    g = jax.grad(loss_fn)(p, k)
    updates, s = opt.update(g, s, p)
    return (optax.apply_updates(p, updates), s), None

  (dparams, _), _ = jax.lax.scan(step, (dparams, state), jax.random.split(key, 40))
  return before, loss_fn(dparams, eval_key)


@pytest.mark.parametrize('vp', [False, True])
def test_a_few_steps_lower_the_loss(setup, vp):
  tcfg, tparams, dparams, seq, feats = setup
  before, after = _train_steps(dparams, tcfg, vp, tparams, seq, feats, jax.random.PRNGKey(0))
  assert float(after) < 0.8 * float(before)


# Jitted (compiled once per shape): op by op, a tiny drafter's passes take seconds each.
_forward = jax.jit(D.forward, static_argnums=(1, 3))
_denoise = jax.jit(D.denoise, static_argnums=(1, 3), static_argnames=('steps', 'order'))
_drafter_loss = jax.jit(losses.drafter_loss, static_argnums=(1, 3))


def test_denoise_one_pass_and_left_to_right(setup):
  tcfg, tparams, dparams, seq, feats = setup
  G, a = DCFG.gamma, 6
  B = seq.shape[0]
  cache = D.init_context_cache(DCFG, B, 16)
  cache = D.write_context(cache, dparams, DCFG, feats[:, :a],
                          jnp.broadcast_to(jnp.arange(a), (B, a)), jnp.zeros(B, jnp.int32))
  ctx_mask = jnp.broadcast_to(jnp.arange(16) < a, (B, 16))
  pos = jnp.broadcast_to(a + jnp.arange(G), (B, G))
  block = jnp.zeros((B, G), jnp.int32).at[:, 0].set(seq[:, a])
  is_mask = jnp.broadcast_to(jnp.arange(G) > 0, (B, G))
  full = jnp.ones((B, G, G), bool)

  toks, conf, probs = _denoise(dparams, DCFG, tparams, tcfg, block, is_mask, pos, cache,
                                ctx_mask, steps=1)
  logits = _forward(dparams, DCFG, tparams, tcfg, block, is_mask, pos, cache, ctx_mask, full)
  np.testing.assert_array_equal(toks[:, 1:], jnp.argmax(logits, -1)[:, 1:])
  np.testing.assert_array_equal(toks[:, 0], seq[:, a])
  # Two programs, two formulas (1 / sum exp(z - max) in denoise, softmax's max here): each sums
  # 64 float32 exponentials in its own order, a few 1e-6 apart at most. A confidence of another
  # position, token or temperature is off by 1e-2 and more.
  np.testing.assert_allclose(conf[:, 1:], jnp.max(jax.nn.softmax(logits), -1)[:, 1:], rtol=1e-5)
  assert np.all(np.asarray(conf[:, 0]) == 1.0)

  # Left to right, one position per pass: each position is drafted after the previous ones.
  toks, conf, probs = _denoise(dparams, DCFG, tparams, tcfg, block, is_mask, pos, cache,
                                ctx_mask, steps=G - 1, order='left_to_right')
  ref, ref_mask = block, is_mask
  for k in range(1, G):
    lg = _forward(dparams, DCFG, tparams, tcfg, ref, ref_mask, pos, cache, ctx_mask, full)
    np.testing.assert_allclose(probs[:, k], jax.nn.softmax(lg[:, k]), rtol=1e-5, atol=1e-6)
    ref = ref.at[:, k].set(jnp.argmax(lg[:, k], -1))
    ref_mask = ref_mask.at[:, k].set(False)
  np.testing.assert_array_equal(toks, ref)


def test_multi_step_denoising_unmasks_the_most_confident_first(tiny):
  """order='confidence' against an eager reference of the rule, on a trained drafter whose
  confidences vary (loop_checks.check_denoise_confidence_order)."""
  loop_checks.check_denoise_confidence_order(tiny, tiny_drafters.trained_bundle(tiny))


def test_bad_drafter_configs(tiny):
  tcfg, _ = tiny
  with pytest.raises(ValueError, match='gamma'):
    D.DrafterConfig(gamma=1)
  with pytest.raises(ValueError, match='feature_layers'):
    D.init_params(D.DrafterConfig(feature_layers=(0, 5)), tcfg, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='steps'):
    _denoise(None, DCFG, None, tcfg, None, None, None, None, None, steps=0)


def test_head_vocab_subset(setup):
  """A drafter with a head of N tokens: the same logits as the full head on those tokens, -inf
  elsewhere (decoding never proposes them), and training logits over the N tokens only."""
  tcfg, tparams, dparams, seq, feats = setup
  cfg_sub = D.DrafterConfig(**{**DCFG.__dict__, 'head_vocab': 16})
  ids = D.choose_head_ids(jnp.bincount(seq.reshape(-1), length=tcfg.vocab_size),
                          jnp.zeros(tcfg.vocab_size), 16)
  sub = {**dparams, 'head_ids': ids}
  counts = np.bincount(np.asarray(seq).reshape(-1), minlength=tcfg.vocab_size)
  expected = sorted(range(tcfg.vocab_size), key=lambda t: (-counts[t], t))[:16]  # most frequent
  assert np.asarray(ids).tolist() == sorted(expected)
  B, G = seq.shape[0], DCFG.gamma
  block, is_mask = seq[:, 5:5 + G], jnp.broadcast_to(jnp.arange(G) > 0, (B, G))
  full = decode_time_logits(setup, 5, block, is_mask)
  restricted = decode_time_logits((tcfg, tparams, sub, seq, feats), 5, block, is_mask)
  np.testing.assert_allclose(restricted[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
  outside = np.setdiff1d(np.arange(tcfg.vocab_size), np.asarray(ids))
  assert np.all(np.isneginf(np.asarray(restricted)[..., outside]))
  cache = D.init_context_cache(cfg_sub, B, 16)
  cache = D.write_context(cache, sub, cfg_sub, feats[:, :5],
                          jnp.broadcast_to(jnp.arange(5), (B, 5)), jnp.zeros(B, jnp.int32))
  tokens, _, probs = _denoise(sub, cfg_sub, tparams, tcfg, block, is_mask,
                               jnp.broadcast_to(5 + jnp.arange(G), (B, G)), cache,
                               jnp.broadcast_to(jnp.arange(16) < 5, (B, 16)), steps=2)
  assert set(np.asarray(tokens)[:, 1:].reshape(-1).tolist()) <= set(ids.tolist())
  np.testing.assert_allclose(np.asarray(probs)[..., outside], 0.0)
  # Training: labels outside the head carry no loss and count as misses.
  label = jnp.ones_like(seq, bool)
  anchors = jnp.asarray([[3, 7], [2, 6]])
  weights = jnp.ones((B, 2, G))
  _, m = _drafter_loss(sub, cfg_sub, tparams, tcfg, seq, feats, label, anchors,
                             jnp.zeros((B, 2), jnp.int32), weights)
  assert np.all(np.isfinite(np.asarray(m['loss'])))
  with pytest.raises(ValueError, match='head_vocab=999 exceeds'):
    D.DrafterConfig(**{**DCFG.__dict__, 'head_vocab': 999}).check_target(tcfg)


def test_random_reveal_shows_only_positions_after_the_prefix(setup):
  """Revealed positions: after the prefix, never the block's last one, only in the chosen
  fraction of blocks, with ratios spread over (0, 1); the loss ignores them."""
  tcfg, tparams, dparams, seq, feats = setup
  B, A, G = 64, 16, DCFG.gamma
  prefix = jax.random.randint(jax.random.PRNGKey(3), (B, A), 0, G - 1)
  reveal = np.asarray(losses.random_reveal(jax.random.PRNGKey(4), (B, A, G), prefix, 0.5))
  k = np.arange(G)
  assert not (reveal & (k <= np.asarray(prefix)[..., None])).any()
  assert not reveal[..., -1].any()
  partial = reveal.any(-1)
  assert 0.05 < partial.mean() < 0.5  # some, and at most the chosen half of the blocks
  assert not losses.random_reveal(jax.random.PRNGKey(4), (B, A, G), prefix, 0.0).any()
  # Revealed positions are inputs, not labels: their tokens pass through and carry no loss.
  anchors = jnp.asarray([[3, 7, 1], [9, 2, 5]])
  pre = jnp.zeros((2, 3), jnp.int32)
  shown = jnp.zeros((2, 3, G), bool).at[:, :, 1].set(True)
  _, is_mask, _, _ = losses.block_inputs(seq, anchors, pre, G, shown)
  assert not np.asarray(is_mask).reshape(2, 3, G)[:, :, 1].any()
  w = jnp.broadcast_to(losses.vp_weights(jnp.zeros(1, jnp.int32), G, 3.0), (2, 3, G))
  _, m_all = losses.drafter_loss(dparams, DCFG, tparams, tcfg, seq, feats,
                                 jnp.ones(seq.shape, bool), anchors, pre, w)
  _, m_shown = losses.drafter_loss(dparams, DCFG, tparams, tcfg, seq, feats,
                                   jnp.ones(seq.shape, bool), anchors, pre, w, reveal_BxAxG=shown)
  assert int(m_shown['count_by_pos'][1]) == 0 and int(m_all['count_by_pos'][1]) == 6


@pytest.mark.parametrize('tied', [True, False])
def test_decoding_params_give_the_plain_params_logits(tiny, tied):
  """drafter.for_decoding (the head's rows and the key/value rows of wqkv gathered once)
  changes only the summation order: same context K/V, same logits, for a full head and a
  subset head, from a tied or untied target."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  tcfg = dataclasses.replace(tiny[0], tie_embeddings=tied)
  tparams = M.init_params(tcfg, jax.random.PRNGKey(4), scale=1.2)
  seq = jax.random.randint(jax.random.PRNGKey(5), (2, 14), 0, tcfg.vocab_size)
  _, _, feats = M.forward(tparams, tcfg, seq, jnp.broadcast_to(jnp.arange(14), (2, 14)),
                          M.init_cache(tcfg, 2, 14), jnp.zeros((2,), jnp.int32),
                          feature_layers=DCFG.feature_layers)
  feats = D.features_of(feats)
  dparams = D.init_params(DCFG, tcfg, jax.random.PRNGKey(1))
  ids = jnp.asarray([1, 4, 5, 9, 17, 30, 31, 40, 41, 50, 60, 63])
  for plain in (dparams, {**dparams, 'head_ids': ids}):
    fast = D.for_decoding(plain, tparams, tcfg)
    assert D.for_decoding(fast, tparams, tcfg).keys() == fast.keys()
    assert ('head_rows' in fast) == ('head_ids' in plain)
    B, G = seq.shape[0], DCFG.gamma
    block, is_mask = seq[:, 6:6 + G], jnp.broadcast_to(jnp.arange(G) > 0, (B, G))
    got = [decode_time_logits((tcfg, tparams, p, seq, feats), 6, block, is_mask)
           for p in (plain, fast)]
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got[0])).sum() == B * G * (
        ids.shape[0] if 'head_ids' in plain else tcfg.vocab_size)

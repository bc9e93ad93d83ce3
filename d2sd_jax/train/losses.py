"""Drafter training objectives (DESIGN §3), many anchors per sequence in one pass.

Every anchor position a of a sequence becomes one block [seq[a], seq[a+1..a+l], MASK ...] that
attends to the target features of positions < a and, bidirectionally, to its own block. All
blocks of a sequence go through the drafter side by side (block-diagonal mask), so one teacher
pass over the sequence feeds A blocks. Labels are the sequence's own tokens, which in the
distillation data are the target's greedy outputs.
  drafter 1: l = 0, cross-entropy at positions 1..gamma-1, weights exp(-(k-1)/decay).
  drafter 2 (VP): l ~ a prior over 0..gamma-2 (vp_prefix_prior), or l = where drafter 1's chain
    is first rejected (chain_cuts: the cut at which D²SD's branch can add tokens, with the
    chain's token there forbidden as decoding's redraft='exclude' forbids it); positions
    l+1..gamma-1 are masked and weighted exp(-(k-l-1)/tau), per block or over the batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from d2sd_jax.train import calibration
from d2sd_jax.models import drafter as drafter_lib


def random_reveal(key, shape_BxAxG, prefix_len_BxA, fraction: float):
  """Masked-diffusion inputs for multi-step denoising: a `fraction` of the blocks get a ratio
  t ~ U(0, 1) and show each position after their prefix with probability t (the drafter then
  learns to fill a partly unmasked block, as its later denoising passes see one); the last
  position stays masked so every block keeps a label."""
  k_block, k_ratio, k_pos = jax.random.split(key, 3)
  B, A, G = shape_BxAxG
  partial_BxA = jax.random.uniform(k_block, (B, A)) < fraction
  ratio_BxA = jax.random.uniform(k_ratio, (B, A))
  shown = jax.random.uniform(k_pos, (B, A, G)) < ratio_BxA[..., None]
  after_prefix = jnp.arange(G) > prefix_len_BxA[..., None]
  return shown & after_prefix & partial_BxA[..., None] & (jnp.arange(G) < G - 1)


REFERENCE_PRIOR = 'reference'


def vp_prefix_prior(gamma: int, beta: float, weights: str = '') -> jax.Array:
  """P(l = j), j = 0..gamma-2, the prefix lengths drafter 2 trains at:
    ''           ∝ beta^j (a truncated geometric);
    'reference'  the D²SD reference's (SpecForge's VP mode): the visible prefix P = l + 1, the
                 anchor included, drawn from {2..15} ∝ 0.9^P, so l = 1..min(14, gamma-2);
    'w0,w1,...'  these weights per l (the tail missing: 0), e.g. the chain's measured first
                 rejections (benchmarks/drafter_quality.py prints them as `rejection_prior`)."""
  j = jnp.arange(gamma - 1, dtype=jnp.float32)
  if weights == REFERENCE_PRIOR:
    w = jnp.where((j >= 1) & (j <= 14), 0.9 ** (j + 1), 0.0)
  elif weights:
    given = parse_prior(weights, gamma)
    w = jnp.asarray(given + [0.0] * (gamma - 1 - len(given)), jnp.float32)
  else:
    w = beta ** j
  return w / jnp.sum(w)


def parse_prior(weights: str, gamma: int) -> list[float]:
  """The per-prefix-length weights of loss.prefix_prior, checked (ValueError naming the fix)."""
  try:
    given = [float(x) for x in weights.split(',')]
  except ValueError:
    raise ValueError(f"loss.prefix_prior={weights!r}: use '' (beta^l), '{REFERENCE_PRIOR}' or "
                     "comma-separated weights per prefix length, e.g. '0.38,0.25,0.17,0.12'"
                     ) from None
  if len(given) > gamma - 1 or min(given) < 0 or sum(given) <= 0:
    raise ValueError(f'loss.prefix_prior={weights!r}: give at most gamma-1={gamma - 1} '
                     'non-negative weights (prefix lengths 0..gamma-2), not all zero')
  return given


def vp_weights(prefix_len_N: jax.Array, gamma: int, tau: float,
               normalize: bool = True) -> jax.Array:
  """[N, gamma]: exp(-(k-l-1)/tau) at masked positions k > l, 0 elsewhere; with `normalize`
  each row sums to 1 (every block weighs alike), else the raw weights: the loss is then one
  weighted mean over the batch, as the D²SD reference takes it (a block with a long prefix has
  fewer masked positions and weighs less)."""
  k = jnp.arange(gamma)[None]
  l = prefix_len_N[:, None]
  w = jnp.where(k > l, jnp.exp(-(k - l - 1) / tau), 0.0)
  return w / jnp.sum(w, axis=1, keepdims=True) if normalize else w


def distinct_anchors(key, ok_BxL, n_anchors: int):
  """(anchors [B, A], valid [B, A]): A distinct positions where ok, uniformly (Gumbel top-k);
  a row with fewer than A such positions marks the rest invalid."""
  score = jnp.where(ok_BxL, jax.random.gumbel(key, ok_BxL.shape), -jnp.inf)
  score_BxA, anchors_BxA = jax.lax.top_k(score, n_anchors)
  return anchors_BxA.astype(jnp.int32), jnp.isfinite(score_BxA)


def chain_cuts(dparams, dcfg: drafter_lib.DrafterConfig, tparams, tcfg, features_BxLxF,
               seq_BxL, label_ok_BxL, anchors_BxA, label_ids_BxL=None):
  """Where drafter 1's chain, drafted at each anchor as decoding drafts it ([anchor, MASK...]),
  is first rejected by the labels: (cut [B, A] = drafts accepted, 0..G-1; the chain's token at
  the cut [B, A], the one a branch there re-drafts with redraft='exclude'). No gradient."""
  B, L = seq_BxL.shape
  A, G = anchors_BxA.shape[1], dcfg.gamma
  prefix = jnp.zeros((B, A), jnp.int32)
  tokens, is_mask, positions, in_range = block_inputs(seq_BxL, anchors_BxA, prefix, G)
  logits = block_logits(dparams, dcfg, tparams, tcfg, features_BxLxF, tokens, is_mask,
                        positions, anchors_BxA, head_only=True)
  pred = jnp.argmax(logits, -1)
  if 'head_ids' in dparams:
    pred = dparams['head_ids'][pred]
  at = jnp.clip(positions, 0, L - 1)
  labels = tokens if label_ids_BxL is None else jnp.take_along_axis(label_ids_BxL, at, 1)
  ok = (pred == labels) & in_range & jnp.take_along_axis(label_ok_BxL, at, 1)
  ok_BxAxG = ok.reshape(B, A, G)[..., 1:]
  cut_BxA = jnp.sum(jnp.cumprod(ok_BxAxG, axis=2), axis=2).astype(jnp.int32)
  chain_BxAxG = pred.reshape(B, A, G)
  at_cut = jnp.take_along_axis(chain_BxAxG, jnp.minimum(cut_BxA + 1, G - 1)[..., None], 2)[..., 0]
  return jax.lax.stop_gradient(cut_BxA), jax.lax.stop_gradient(at_cut)


def block_inputs(seq_BxL, anchors_BxA, prefix_len_BxA, gamma: int, reveal_BxAxG=None):
  """Block tokens/masks/positions [B, A*G] and labels [B, A*G] for anchors with given prefixes
  (reveal: positions after the prefix shown unmasked as well, carrying no loss)."""
  B, L = seq_BxL.shape
  A = anchors_BxA.shape[1]
  k = jnp.arange(gamma)
  pos_BxAxG = anchors_BxA[..., None] + k  # sequence positions of the block
  tokens = jnp.take_along_axis(seq_BxL, jnp.clip(pos_BxAxG, 0, L - 1).reshape(B, -1), 1)
  is_mask_BxAxG = k > prefix_len_BxA[..., None]
  if reveal_BxAxG is not None:
    is_mask_BxAxG = is_mask_BxAxG & ~reveal_BxAxG
  is_mask = is_mask_BxAxG.reshape(B, A * gamma)
  in_range = (pos_BxAxG < L).reshape(B, A * gamma)
  return tokens, is_mask, pos_BxAxG.reshape(B, A * gamma), in_range


def block_logits(dparams, dcfg: drafter_lib.DrafterConfig, tparams, tcfg, features_BxLxF,
                 tokens_BxQ, is_mask_BxQ, positions_BxQ, anchors_BxA, head_only: bool = False,
                 remat: bool = False):
  """Drafter logits for A blocks per sequence, each seeing the context before its anchor."""
  B, L, _ = features_BxLxF.shape
  A, G = anchors_BxA.shape[1], dcfg.gamma
  ctx = drafter_lib.context_kv(dparams, dcfg, features_BxLxF,
                               jnp.broadcast_to(jnp.arange(L), (B, L)))
  # Each block sees the context before its anchor, and its own G positions (block_size: no
  # [A·G, A·G] block-diagonal mask).
  ctx_mask_BxQxL = jnp.arange(L)[None, None, :] < jnp.repeat(anchors_BxA, G, axis=1)[..., None]
  return drafter_lib.forward(dparams, dcfg, tparams, tcfg, tokens_BxQ, is_mask_BxQ,
                             positions_BxQ, ctx, ctx_mask_BxQxL, None, head_only, remat,
                             block_size=G)


def drafter_loss(dparams, dcfg: drafter_lib.DrafterConfig, tparams, tcfg, seq_BxL,
                 features_BxLxF, label_mask_BxL, anchors_BxA, prefix_len_BxA, weights_BxAxG,
                 calibrate: bool = False, reveal_BxAxG=None, normalizer=None,
                 remat: bool = False, label_ids_BxL=None, topk=None, soft: float = 0.0,
                 forbid_BxAxG=None):
  """Weighted cross-entropy at masked block positions whose label is a target output.

  The label of sequence position t is label_ids_BxL[t] (default: the token there, which the
  target wrote: distilled responses); a teacher-forced corpus passes the target's argmax after
  the text instead. With topk = (ids [B, L, K], probs [B, L, K]), the target's K likeliest
  next tokens there, the loss is (1 - soft) x CE(argmax label) + soft x CE(the top-k
  distribution renormalised over the head's tokens).

  Returns (loss, metrics): metrics['acc_by_pos'] [G] is the top-1 agreement with the labels per
  block position, ['count_by_pos'] how many labels it averaged, ['weight'] the loss weights'
  sum. The loss is the weighted sum over `normalizer` (default: that sum, i.e. the weighted
  mean); gradient accumulation passes 1 and divides the summed gradients by the total weight,
  which gives exactly the whole batch's gradient. forbid_BxAxG: a token id per block position
  that the drafter may not propose there (-1: none), as decoding's redraft='exclude' forbids the
  chain's token at a branch's first position; the softmax there is over the other tokens."""
  B, L = seq_BxL.shape
  A, G = anchors_BxA.shape[1], dcfg.gamma
  tokens, is_mask, positions, in_range = block_inputs(seq_BxL, anchors_BxA, prefix_len_BxA, G,
                                                      reveal_BxAxG)
  # With a head_vocab subset the logits cover the head's tokens only; labels outside it count
  # as misses (the drafter cannot propose them) and carry no loss.
  logits = block_logits(dparams, dcfg, tparams, tcfg, features_BxLxF, tokens, is_mask, positions,
                        anchors_BxA, head_only=True, remat=remat)
  at = jnp.clip(positions, 0, L - 1)
  label_ok = jnp.take_along_axis(label_mask_BxL, at, 1)
  valid = is_mask & in_range & label_ok
  labels = tokens if label_ids_BxL is None else jnp.take_along_axis(label_ids_BxL, at, 1)
  target = drafter_lib.head_index(dparams, labels, tcfg.vocab_size)
  in_head = target >= 0
  if forbid_BxAxG is not None:
    forbid = drafter_lib.head_index(dparams, jnp.maximum(forbid_BxAxG.reshape(B, A * G), 0),
                                    tcfg.vocab_size)
    forbid = jnp.where(forbid_BxAxG.reshape(B, A * G) >= 0, forbid, -1)
    # A large finite penalty, not -inf: a forbidden token that is also a label (not at a true
    # cut) then costs a finite loss instead of inf x 0 = nan in the weighted sum.
    logits = jnp.where(jnp.arange(logits.shape[-1]) == forbid[..., None], -1e9, logits)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], -1)[..., 0]
  if topk is not None and soft:
    ids_BxQxK = jnp.take_along_axis(topk[0], at[..., None], 1)
    probs_BxQxK = jnp.take_along_axis(topk[1], at[..., None], 1).astype(logp.dtype)
    head_BxQxK = drafter_lib.head_index(dparams, ids_BxQxK, tcfg.vocab_size)
    probs_BxQxK = probs_BxQxK * (head_BxQxK >= 0)
    probs_BxQxK = probs_BxQxK / jnp.maximum(jnp.sum(probs_BxQxK, -1, keepdims=True), 1e-9)
    soft_nll = -jnp.sum(probs_BxQxK * jnp.take_along_axis(logp, jnp.maximum(head_BxQxK, 0), -1),
                        -1)
    nll = (1.0 - soft) * nll + soft * soft_nll
  w = weights_BxAxG.reshape(B, A * G) * (valid & in_head)
  weight = jnp.sum(w)
  loss = jnp.sum(w * nll) / (jnp.maximum(weight, 1e-9) if normalizer is None else normalizer)
  hit = (jnp.argmax(logits, -1) == target) & valid & in_head
  acc_by_pos = jnp.sum(hit.reshape(B * A, G), 0) / jnp.maximum(
      jnp.sum(valid.reshape(B * A, G), 0), 1)
  metrics = {'loss': loss, 'acc_by_pos': acc_by_pos, 'weight': weight,
             'count_by_pos': jnp.sum(valid.reshape(B * A, G), 0)}
  if calibrate:  # (costly: evaluation only) confidence bins of P(correct | earlier correct)
    hit_blocks = (hit | ~valid).reshape(B * A, G)
    earlier_ok = jnp.cumprod(
        jnp.concatenate([jnp.ones((B * A, 1), bool), hit_blocks[:, :-1]], 1).astype(jnp.int32),
        1).astype(bool).reshape(B, A * G)
    metrics['calibration'] = calibration.bin_stats(
        logits.reshape(B * A * G, -1), hit.reshape(-1),
        (valid & earlier_ok).reshape(-1).astype(jnp.float32))
  return loss, metrics

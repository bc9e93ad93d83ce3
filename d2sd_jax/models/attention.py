"""Attention of new tokens over a cached context and each other (the target's and the
drafters' layers, models/target.py): one law in three forms (general, side-by-side blocks,
fresh causal), through XLA over the smallest context window a step needs, or through the Pallas
kernels in programs compiled for a TPU (kernels/cached.py, kernels/splash.py). Shape letters as
in target.py."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from d2sd_jax.kernels import cached
from d2sd_jax.kernels import splash


def attention(q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask, tree_mask_BxTxT,
              block_size: int | None = None, fresh: bool = False):
  """Attention of T new tokens over [cached context ; the new tokens], float32 [B, T, H·hd].

  Three forms, one law (tests/models/test_target.py checks them against each other):
  - general: one softmax over the context slots `ctx_mask` allows and the new tokens
    `tree_mask_BxTxT` allows (a token tree, or causal). ctx_mask is a bool mask [B, S] or
    [B, T, S], or int lengths [B]: row b sees the first ctx_mask[b] slots (decoding's case);
  - block_size=G (tree_mask None): the new tokens are T/G independent blocks, bidirectional
    within each (the drafters' blocks side by side). Scores among new tokens are computed per
    block, [.., T/G, G, G], so memory and work grow as T·G instead of T² (training attends
    anchors·γ block tokens at once);
  - fresh=True (tree_mask None): nothing is cached yet (prefill, teacher features): causal
    attention among the new tokens alone, instead of scores against all S empty slots: in a
    program compiled for a TPU through Pallas splash attention (`splash.causal`; heads of a
    multiple of 128, `lane_dense`), elsewhere through `jax.nn.dot_product_attention` (cuDNN's
    fused kernel on GPUs where it applies, XLA on CPUs).

  With prefix lengths and `lane_dense` heads, a program compiled for a TPU takes the general
  and block forms as one Pallas kernel (`cached.attend`: flash attention over the cache blocks
  in use, then the new tokens, scores kept in VMEM). Otherwise (CPU, GPU, bool masks) they read
  only a window of the cache: the first W slots, W the smallest of `context_windows(S)` (256,
  512, 1024, ... slots and S) that holds every slot a row may attend to, chosen at run time by
  `lax.switch`. Slots past W are masked for every row, so they only cost work: their
  probabilities are exact zeros, and a cache sized for a long generation (S = 2048 with 400
  slots used) no longer costs every step the whole capacity.
  """
  if fresh:
    if tree_mask_BxTxT is not None or block_size:
      raise ValueError('fresh attention is causal: give neither tree_mask nor block_size')
    B, T, H, hd = q_BxTxHxhd.shape
    args = (q_BxTxHxhd.astype(kv['k'].dtype), k_new_BxHkvxTxhd, v_new_BxHkvxTxhd)
    out_BxTxHxhd = (jax.lax.platform_dependent(*args, tpu=splash.causal, default=_fresh_einsum)
                    if lane_dense(hd) else _fresh_einsum(*args))
    return out_BxTxHxhd.reshape(B, T, H * hd).astype(jnp.float32)
  if ctx_mask.ndim == 1 and lane_dense(q_BxTxHxhd.shape[-1]):  # prefix lengths: decoding
    return jax.lax.platform_dependent(
        q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask, tree_mask_BxTxT,
        tpu=functools.partial(cached.attention, block_size=block_size),
        default=functools.partial(_attend_windows, block_size=block_size))
  return _attend_windows(q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask,
                         tree_mask_BxTxT, block_size)


def lane_dense(head_dim: int) -> bool:
  """Whether TPU programs take the Pallas attention kernels (splash, cached) for this head
  size: a multiple of the TPU's 128 lanes. Narrower heads (SmolLM2's 64) fill half of every
  kernel tile and of the cache blocks it streams, and the XLA forms read less there (the
  compiler's figures: benchmarks/tpu_compile.py)."""
  return head_dim % 128 == 0


def _attend_windows(q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask,
                    tree_mask_BxTxT, block_size: int | None = None):
  """`attention`'s XLA form: the smallest context window that holds every allowed slot."""
  S = kv['k'].shape[2]
  if ctx_mask.ndim == 1:
    ctx_mask = jnp.arange(S)[None, :] < ctx_mask[:, None]
  ctx_mask_BxTxS = ctx_mask if ctx_mask.ndim == 3 else ctx_mask[:, None, :]
  windows = context_windows(S)
  attend = functools.partial(_attend_window, block_size=block_size)
  args = (q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask_BxTxS, tree_mask_BxTxT)
  if len(windows) == 1:
    return attend(S, *args)
  used = jnp.max(jnp.where(jnp.any(ctx_mask_BxTxS, axis=(0, 1)), jnp.arange(S) + 1, 0))
  which = jnp.searchsorted(jnp.asarray(windows), used)  # the first window >= used
  return jax.lax.switch(which, [functools.partial(attend, w) for w in windows], *args)


def _fresh_einsum(q_BxTxHxhd, k_BxHkvxTxhd, v_BxHkvxTxhd):
  return jax.nn.dot_product_attention(q_BxTxHxhd, k_BxHkvxTxhd.transpose(0, 2, 1, 3),
                                      v_BxHkvxTxhd.transpose(0, 2, 1, 3), is_causal=True)


MIN_WINDOW = 256  # the smallest context window attention compiles (see context_windows)


def context_windows(S: int) -> tuple[int, ...]:
  """The context lengths `attention` is compiled for over a cache of S slots: MIN_WINDOW,
  doubling, below S, then S. Each is a branch of every layer's attention (compile time grows
  with their number; the work of a step with the window it reads)."""
  out, w = [], MIN_WINDOW
  while w < S:
    out.append(w)
    w *= 2
  return tuple(out) + (S,)


def _attend_window(W: int, q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_mask_BxTxS,
                   tree_mask_BxTxT, block_size: int | None = None):
  """`attention`'s general and block forms over the first W cache slots (ctx_mask [B, T, S]
  must allow none past them)."""
  B, Hkv, T, hd = k_new_BxHkvxTxhd.shape
  Hg = q_BxTxHxhd.shape[2] // Hkv
  kv = {'k': kv['k'][:, :, :W], 'v': kv['v'][:, :, :W]}
  ctx_mask_BxTxS = ctx_mask_BxTxS[..., :W]
  S = W
  dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  neg = jnp.finfo(jnp.float32).min
  # Query rows per KV head, ordered (Hg, T): the dots are contiguous per (row, head).
  q_BxHkvxRxhd = (q_BxTxHxhd.reshape(B, T, Hkv, Hg, hd).transpose(0, 2, 3, 1, 4)
                  .reshape(B, Hkv, Hg * T, hd) * hd**-0.5)
  scores_ctx_BxHkvxRxS = dot('bkqh,bksh->bkqs', q_BxHkvxRxhd, kv['k'])
  # One softmax over [context ; new tokens] without concatenating them, normalised after the
  # value products ([.., hd] rows instead of [.., S + T] probabilities): each score tensor is
  # written once and read by the max, by exp + sum and by the value product, which XLA fuses
  # the exp into (on a TPU the concatenated and normalised form wrote and read the [R, S]
  # scores of every layer about twice as often: benchmarks/tpu_compile.py).
  if block_size:
    G = block_size
    nb = T // G
    if nb * G != T:
      raise ValueError(f'{T} new tokens are not a whole number of blocks of {G}')
    q_6 = q_BxHkvxRxhd.reshape(B, Hkv, Hg, nb, G, hd)
    k_5 = k_new_BxHkvxTxhd.reshape(B, Hkv, nb, G, hd)
    ctx_ok = jnp.broadcast_to(ctx_mask_BxTxS, (B, T, S)).reshape(B, 1, 1, nb, G, S)
    s_ctx = jnp.where(ctx_ok, scores_ctx_BxHkvxRxS.reshape(B, Hkv, Hg, nb, G, S), neg)
    s_new = dot('bkgnqh,bknth->bkgnqt', q_6, k_5)  # [B, Hkv, Hg, nb, G, G]
    top = jnp.maximum(jnp.max(s_ctx, axis=-1, keepdims=True),
                      jnp.max(s_new, axis=-1, keepdims=True))
    e_ctx, e_new = jnp.exp(s_ctx - top), jnp.exp(s_new - top)
    total = jnp.sum(e_ctx, axis=-1, keepdims=True) + jnp.sum(e_new, axis=-1, keepdims=True)
    attn_BxHkvxRxhd = ((
        dot('bkgnqs,bksh->bkgnqh', e_ctx, kv['v']) +
        dot('bkgnqt,bknth->bkgnqh', e_new, v_new_BxHkvxTxhd.reshape(B, Hkv, nb, G, hd))
    ) / total).reshape(B, Hkv, Hg * T, hd)
  else:
    scores_new_BxHkvxRxT = dot('bkqh,bkth->bkqt', q_BxHkvxRxhd, k_new_BxHkvxTxhd)
    mask_new_Bx1xRxT = jnp.broadcast_to(tree_mask_BxTxT[:, None, None],
                                        (B, 1, Hg, T, T)).reshape(B, 1, Hg * T, T)
    ctx_mask_Bx1xRxS = jnp.broadcast_to(ctx_mask_BxTxS[:, None, None],
                                        (B, 1, Hg, T, S)).reshape(B, 1, Hg * T, S)
    s_ctx = jnp.where(ctx_mask_Bx1xRxS, scores_ctx_BxHkvxRxS, neg)
    s_new = jnp.where(mask_new_Bx1xRxT, scores_new_BxHkvxRxT, neg)
    top = jnp.maximum(jnp.max(s_ctx, axis=-1, keepdims=True),
                      jnp.max(s_new, axis=-1, keepdims=True))
    e_ctx, e_new = jnp.exp(s_ctx - top), jnp.exp(s_new - top)
    total = jnp.sum(e_ctx, axis=-1, keepdims=True) + jnp.sum(e_new, axis=-1, keepdims=True)
    attn_BxHkvxRxhd = (dot('bkqs,bksh->bkqh', e_ctx, kv['v']) +
                       dot('bkqt,bkth->bkqh', e_new, v_new_BxHkvxTxhd)) / total
  return (attn_BxHkvxRxhd.reshape(B, Hkv, Hg, T, hd).transpose(0, 3, 1, 2, 4)
          .reshape(B, T, Hkv * Hg * hd))

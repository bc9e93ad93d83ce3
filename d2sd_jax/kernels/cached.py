"""Attention of new tokens over a cached prefix plus among themselves, as one Pallas TPU kernel.

Decoding's attention (`attention.attention` with a prefix length per row: the AR step, the tree
verification, the drafters' blocks) sees, for row b, the first len[b] cache slots and those new
tokens its mask allows (a token tree, or blocks). On a TPU the XLA form writes each layer's
[query rows, cache slots] float32 scores to HBM and reads them back for the max, the sum and the
value product, and its `lax.switch` over context windows is costed at the whole cache. This
kernel streams the cache through VMEM block by block with an online softmax (flash attention):

  grid (B, Hkv, cache blocks); for KV head h of row b, its R = Hg·T query rows (the Hg query
  heads of h times the T new tokens, scaled by 1/sqrt(hd)):
    blocks j with j·bk < len[b]: s = q k_j^T, slots >= len[b] masked, online softmax update;
    blocks past len[b]: their index map repeats the last needed block (no DMA) and nothing
      is computed, so a cache sized for a long generation costs only the slots in use;
    the last step: s = q k_new^T + bias (0 where the new-token mask allows, else -max), one
      more update, and the output acc / l.

Scores never leave VMEM; the cache is read once per (row, KV head). The steps (`flash_step`)
are shared with `fused.attention`, which computes the queries inside the same kernel (a
decoding layer that `fused.fits`); this kernel serves attention given its queries (the XLA
layer's TPU form). The compiler is told the kernel's cost (`pl.CostEstimate`) for a full
cache, the most it reads. `interpret=True` runs it on a CPU (tests/kernels/test_cached.py checks it
against the XLA form).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from d2sd_jax.kernels import partition

MAX_BLOCK = 512  # cache slots per block at most
NEG = float(jnp.finfo(jnp.float32).min)  # a masked score (as the XLA form's)


def block_for(slots: int) -> int:
  """Cache slots per block: the largest multiple of 16 (bfloat16's sublane tile) up to MAX_BLOCK
  that divides the cache, else the whole cache as one block."""
  for b in range(MAX_BLOCK, 15, -16):
    if slots % b == 0:
      return b
  return slots


def flash_step(q_Rxhd, j, length, k_ref, v_ref, new_kv, bias_ref, o_ref, m_sc, l_sc, acc_sc, *,
               bk: int, n_blocks: int, T: int):
  """Grid step j of one (row, KV head)'s attention (the module docstring's steps), for this
  kernel and for `fused.attention`'s: cache block j if it holds slots < length, and at the last
  step the new tokens (`new_kv()`: their keys and values [T, hd], under bias_ref [1, R, T]) and
  the output."""
  f32 = jnp.float32
  nt = (((1,), (1,)), ((), ()))  # q [R, hd] x k [n, hd] -> [R, n]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, f32)
    l_sc[...] = jnp.zeros(l_sc.shape, f32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, f32)

  def update(s_Rxn, v_nxhd):
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, jnp.max(s_Rxn, axis=1, keepdims=True))
    p = jnp.exp(s_Rxn - m_new)
    alpha = jnp.exp(m_prev - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_sc[...] = alpha * acc_sc[...] + jnp.dot(p, v_nxhd.astype(f32),
                                                preferred_element_type=f32)
    m_sc[...] = m_new

  @pl.when(j * bk < length)
  def _context():
    s = jax.lax.dot_general(q_Rxhd, k_ref[0, 0].astype(f32), nt, preferred_element_type=f32)
    slot = j * bk + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    update(jnp.where(slot < length, s, NEG), v_ref[0, 0])

  @pl.when(j == n_blocks - 1)
  def _new_tokens():
    k_new, v_new = new_kv()
    s = new_token_scores(q_Rxhd, k_new.astype(f32))
    update(s + bias_ref[0], v_new)
    out_Rxhd = acc_sc[...] / l_sc[...]
    hd = out_Rxhd.shape[-1]
    for g in range(out_Rxhd.shape[0] // T):  # query head g of the group: lanes g·hd.. of [T, Hg·hd]
      o_ref[0, :, g * hd:(g + 1) * hd] = out_Rxhd[g * T:(g + 1) * T].astype(o_ref.dtype)


def new_token_scores(q_Rxhd, k_Txhd):
  """q k^T [R, T] in float32. One new token (an AR step) takes the lanes' sum of q * k: Mosaic
  (libtpu 0.0.42, jax 0.10's) does not lower a product against a single key row ("Not
  implemented: Lane broadcast"). The same sum of products either way."""
  if k_Txhd.shape[0] == 1:
    return jnp.sum(q_Rxhd * k_Txhd, axis=1, keepdims=True)
  return jax.lax.dot_general(q_Rxhd, k_Txhd, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, bias_ref, o_ref, m_sc, l_sc, acc_sc,
            *, bk: int, n_blocks: int, T: int):
  flash_step(q_ref[0, 0], pl.program_id(2), len_ref[pl.program_id(0)], k_ref, v_ref,
             lambda: (kn_ref[0, 0], vn_ref[0, 0]), bias_ref, o_ref, m_sc, l_sc, acc_sc, bk=bk,
             n_blocks=n_blocks, T=T)


def cache_block_map(bk: int):
  """The index map of a cache block at grid step (b, h, j): block j while it holds slots below
  the row's length, else the last such block again (no new DMA)."""
  def cache_block(b, h, j, len_ref):
    last = jnp.maximum(pl.cdiv(len_ref[b], bk) - 1, 0)
    return b, h, jnp.minimum(j, last), 0
  return cache_block


def _attend_local(q, k_cache, v_cache, len_B, k_new, v_new, bias, interpret: bool, out_dtype):
  B, Hkv, R, hd = q.shape
  S, T = k_cache.shape[2], k_new.shape[2]
  bk = block_for(S)
  n_blocks = S // bk

  cache_block = cache_block_map(bk)
  whole = lambda b, h, j, len_ref: (b, h, 0, 0)
  itemsize = k_cache.dtype.itemsize
  cost = pl.CostEstimate(
      flops=4 * B * Hkv * R * (S + T) * hd, transcendentals=B * Hkv * R * (S + T),
      # q in, the output, the cache (at most all of it) and the new K/V, the bias once per row
      # and core (its block repeats along the KV heads)
      bytes_accessed=(q.size * (4 + jnp.dtype(out_dtype).itemsize)
                      + 2 * (k_cache.size + k_new.size) * itemsize
                      + B * min(Hkv, partition.tensor_cores()) * bias[0].size * 4))
  return pl.pallas_call(
      functools.partial(_kernel, bk=bk, n_blocks=n_blocks, T=T),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(B, Hkv, n_blocks),
          in_specs=[pl.BlockSpec((1, 1, R, hd), whole),
                    pl.BlockSpec((1, 1, bk, hd), cache_block),
                    pl.BlockSpec((1, 1, bk, hd), cache_block),
                    pl.BlockSpec((1, 1, T, hd), whole),
                    pl.BlockSpec((1, 1, T, hd), whole),
                    pl.BlockSpec((1, R, T), lambda b, h, j, len_ref: (b, 0, 0))],
          out_specs=pl.BlockSpec((1, T, R // T * hd), lambda b, h, j, len_ref: (b, 0, h)),
          scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                          pltpu.VMEM((R, hd), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((B, T, Hkv * R // T * hd), out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'arbitrary')),
      cost_estimate=cost,
      interpret=interpret,
  )(len_B.astype(jnp.int32), q, k_cache, v_cache, k_new, v_new, bias)


def attend(q_BxHkvxRxhd, k_cache, v_cache, len_B, k_new, v_new, bias_BxRxT,
           interpret: bool = False, out_dtype=jnp.float32):
  """softmax over [the first len[b] cache slots ; the new tokens] of (q k^T + mask) v.

  q [B, Hkv, R, hd] float32, already scaled, rows ordered (query head in group, new token);
  k_cache, v_cache [B, Hkv, S, hd]; len_B [B] int; k_new, v_new [B, Hkv, T, hd]; bias [B, R, T]
  float32: 0 where row r may see new token t, NEG where not (every row must see one: its own
  token). Returns [B, T, Hkv·Hg·hd] in `out_dtype` (heads ordered as q's, each token's row as
  the output projection reads it; float32 unless the projection's weights are narrower, whose
  default-precision TPU matmul rounds its input to them anyway).

  Over a mesh (the program traced under it: `models.sharding.tracing_under`) the kernel runs per device
  on its rows and KV heads (`shard_map`), as splash attention does."""
  local = functools.partial(_attend_local, interpret=interpret, out_dtype=out_dtype)
  split = partition.kernel_axes(*q_BxHkvxRxhd.shape[:2])
  if split:
    mesh, rows, heads = split
    P = jax.sharding.PartitionSpec
    four = P(rows, heads, None, None)
    local = jax.shard_map(local, mesh=mesh,
                          in_specs=(four, four, four, P(rows), four, four, P(rows, None, None)),
                          out_specs=P(rows, None, heads), check_vma=False)
  return local(q_BxHkvxRxhd.astype(jnp.float32), k_cache, v_cache, len_B, k_new, v_new,
               bias_BxRxT.astype(jnp.float32))


def attention(q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv, ctx_len_B, tree_mask_BxTxT,
              block_size: int | None = None, interpret: bool = False):
  """`attention.attention`'s general and block forms over a cache prefix through `attend`: the
  TPU form, same arguments and result ([B, T, H·hd] float32)."""
  B, T, H, hd = q_BxTxHxhd.shape
  Hkv = k_new_BxHkvxTxhd.shape[1]
  Hg = H // Hkv
  # query rows per KV head ordered (Hg, T), as attention._attend_window orders them
  q_BxHkvxRxhd = (q_BxTxHxhd.reshape(B, T, Hkv, Hg, hd).transpose(0, 2, 3, 1, 4)
                  .reshape(B, Hkv, Hg * T, hd).astype(jnp.float32) * hd**-0.5)
  bias_BxRxT = new_token_bias(tree_mask_BxTxT, B, T, Hg, block_size)
  return attend(q_BxHkvxRxhd, kv['k'], kv['v'], ctx_len_B, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd,
                bias_BxRxT, interpret=interpret)


def new_token_bias(tree_mask_BxTxT, B: int, T: int, Hg: int, block_size: int | None = None):
  """[B, Hg·T, T] float32: 0 where query row (head g, token t) may see new token t', NEG where
  not; from the tree mask, or blocks of `block_size` tokens seeing each other (drafter blocks)."""
  if block_size:
    if T % block_size:
      raise ValueError(f'{T} new tokens are not a whole number of blocks of {block_size}')
    block_T = jnp.arange(T) // block_size
    tree_mask_BxTxT = jnp.broadcast_to(block_T[:, None] == block_T[None, :], (B, T, T))
  return jnp.where(jnp.tile(tree_mask_BxTxT, (1, Hg, 1)), 0.0, NEG)

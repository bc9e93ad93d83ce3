"""Causal self-attention through Pallas splash attention, for programs compiled for a TPU.

`attention.attention`'s fresh form (nothing cached yet: the prefill of a prompt block, the
teacher's feature pass in training) is causal attention among T new tokens. On a TPU it goes
through splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), a flash kernel
that keeps each [block_q, block_kv] tile of scores in VMEM and skips the tiles above the
diagonal, instead of XLA's einsum writing [H, T, T] float32 scores of every layer to HBM.
Elsewhere (CPU, GPU) `attention.attention` keeps `jax.nn.dot_product_attention`. The choice follows
the platform the program is compiled for (`jax.lax.platform_dependent`), so a TPU program
compiled on a CPU host (benchmarks/tpu_compile.py) takes the kernel.

Shapes the kernel needs: T is padded at the end to a multiple of `BLOCK` (the padded keys come
after every real query, so the causal mask already hides them; the padded queries' rows are
dropped), and grouped-query attention maps each group of query heads onto its KV head inside
the kernel. Batch rows go through `jax.vmap`. With `interpret=True` the same kernel runs on a
CPU through Pallas' interpreter (tests/kernels/test_splash.py checks it against the einsum).

Over a mesh the kernel, a custom call XLA cannot partition, runs per device on its own rows and
heads (`shard_map`: rows over 'data', KV heads over 'model', as `models.sharding.RULES` split
them; a dimension the axis does not divide stays whole), so programs over a mesh are traced
under it (`models.sharding.tracing_under`: its abstract mesh).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from d2sd_jax.kernels import partition

BLOCK = 128  # the sequence tile's unit: splash needs block sizes that are multiples of 128
MAX_BLOCK = 512  # the largest tile tried (VMEM: a [512, 512] float32 tile is 1 MiB)


def block_for(length: int) -> int:
  """The tile size for a (padded) sequence of `length` tokens: the largest multiple of BLOCK up
  to MAX_BLOCK that divides it."""
  return next(b for b in range(MAX_BLOCK, BLOCK - 1, -BLOCK) if length % b == 0)


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, length: int, interpret: bool):
  b = block_for(length)
  sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                        block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  mask = sm.MultiHeadMask([sm.CausalMask((length, length))] * heads)
  return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                            interpret=interpret)


def _causal_local(q_BxHxTxhd, k_BxHkvxTxhd, v_BxHkvxTxhd, interpret: bool):
  kernel = _kernel(q_BxHxTxhd.shape[1], q_BxHxTxhd.shape[2], interpret)
  return jax.vmap(kernel)(q_BxHxTxhd, k_BxHkvxTxhd, v_BxHkvxTxhd)


def causal(q_BxTxHxhd, k_BxHkvxTxhd, v_BxHkvxTxhd, interpret: bool = False):
  """Causal softmax(q k^T / sqrt(hd)) v among T tokens: q [B, T, H, hd], k and v
  [B, Hkv, T, hd] (H a multiple of Hkv). Returns [B, T, H, hd] in v's dtype, as
  `jax.nn.dot_product_attention` does."""
  B, T, H, hd = q_BxTxHxhd.shape
  Hkv = k_BxHkvxTxhd.shape[1]
  if H % Hkv:
    raise ValueError(f'{H} query heads are not a whole number of groups of {Hkv} KV heads')
  dtype = v_BxHkvxTxhd.dtype
  Tp = -(-T // BLOCK) * BLOCK
  pad = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
  q = jnp.pad((q_BxTxHxhd.astype(jnp.float32) * hd**-0.5).astype(dtype).transpose(0, 2, 1, 3),
              pad)
  k, v = jnp.pad(k_BxHkvxTxhd, pad), jnp.pad(v_BxHkvxTxhd.astype(dtype), pad)
  local = functools.partial(_causal_local, interpret=interpret)
  split = partition.kernel_axes(B, Hkv)
  if split:
    # (every axis manual: a Mosaic call cannot be left to XLA on any axis, even one of size 1)
    mesh, rows, heads = split
    spec = jax.sharding.PartitionSpec(rows, heads, None, None)
    local = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                          check_vma=False)
  out_BxHxTpxhd = local(q, k, v)
  return out_BxHxTpxhd[:, :, :T].transpose(0, 2, 1, 3).astype(dtype)

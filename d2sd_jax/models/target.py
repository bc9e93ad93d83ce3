"""A Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM2) written as pure functions.

Parameters and the KV cache are plain pytrees passed in and returned. One `forward` serves
prefill, one-token decoding and token-tree verification: it writes the K/V of the T new tokens
into cache slots `cache_len .. cache_len+T-1` of each row and lets every new token attend to the
row's committed context (slots `< cache_len`) plus the new tokens its `tree_mask` row allows.
The caller decides what to commit (it advances `cache_len`, or compacts tree entries).

Parameter layout (`layers` is a list with one dict per layer):
  embed        [V, D]
  lm_head      [V, D]              (only when embeddings are untied)
  final_norm   [D]
  attn_norm [D], mlp_norm [D]
  wqkv         [Hkv, Hg+2, hd, D]   per KV head: its Hg query heads, then its key, then its value
  bqkv         [Hkv, Hg+2, hd]      (Qwen2 biases)
  q_norm, k_norm [hd]              (Qwen3 per-head RMSNorm)
  wo           [D, H*hd]
  w_gate_up    [2, F, D]           gate then up
  w_down       [D, F]
Shape letters as in speculative.py; here also H query heads, Hkv KV heads, Hg = H / Hkv query
heads per KV head, R = Hg·T query rows per KV head, Nh any number of heads.
Matrices are stored [out, in] (torch's Linear layout): XLA:CPU's matrix-vector products (one
row, an AR step) stream them faster than [in, out]. In programs compiled for a CPU, inputs of a
few rows (2-64: a verified tree, the drafters' blocks, a small batch's AR step) are multiplied
as columns, (w @ x.T).T (`linear`): 1.5-1.9x faster there than x @ w.T from either layout
(benchmarks/matmul_layout.py), from the same weights.
Fusing q/k/v and gate/up gives fewer, larger matmuls (what a CPU or TPU wants), and grouping by
KV head keeps tensor-parallel sharding over heads a plain split of one axis.

Precision. `dtype` is the storage dtype of the weights (bfloat16 halves them); activations, the
residual stream, every accumulation and the logits are float32, and so is the KV cache unless
`cache_dtype='bfloat16'`. A token's hidden state then differs between a verified tree and one-token
AR steps only by float32 accumulation order, as in float32, so bfloat16 speculative decoding
reproduces bfloat16 AR (tests/spec_decode/test_bf16.py). With bfloat16 activations the two drifted
0.25 apart in the final hidden state and greedy D²SD left bfloat16 AR within 64 tokens on 2 of 3
prompts; a bfloat16 cache (new keys and values rounded to it before any token attends to them, as a
later step reads them) still drifts 1e-2 apart, enough to flip a near-tie now and then: choose it
for memory (long contexts, big batches), not for exact agreement with AR.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from d2sd_jax.kernels import fused
from d2sd_jax.kernels import partition
from d2sd_jax.models import attention as attention_lib

Params = dict[str, Any]
Cache = list[dict[str, jax.Array]]  # per layer: {'k', 'v'}: [B, Hkv, S, hd]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False  # Qwen2
  qk_norm: bool = False  # Qwen3
  max_position: int = 8192  # context length the model was trained for
  dtype: str = 'float32'  # weight dtype ('float32' or 'bfloat16'); activations are float32
  cache_dtype: str = 'float32'  # KV cache dtype ('bfloat16' halves it; see Precision above)
  # Per-frequency divisors of RoPE's inverse frequencies, head_dim/2 of them (Llama-3.1 'llama3'
  # and 'linear' scaling, a GGUF's rope_freqs tensor); None = plain RoPE. A tuple, not an
  # array, so the config stays hashable as a static jit argument.
  rope_freq_factors: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.rope_freq_factors is not None:  # a list read back from JSON becomes a tuple
      object.__setattr__(self, 'rope_freq_factors',
                         tuple(float(f) for f in self.rope_freq_factors))
      if len(self.rope_freq_factors) != self.head_dim // 2:
        raise ValueError(f'{len(self.rope_freq_factors)} rope_freq_factors for head_dim='
                         f'{self.head_dim}: give one per rotated pair ({self.head_dim // 2})')
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f'n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even for RoPE')
    for name in ('dtype', 'cache_dtype'):
      if getattr(self, name) not in ('float32', 'bfloat16'):
        raise ValueError(f"{name}={getattr(self, name)!r}: use 'float32' or 'bfloat16'")

  @property
  def group(self) -> int:
    return self.n_heads // self.n_kv_heads

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def cache_jnp_dtype(self):
    return jnp.dtype(self.cache_dtype)


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.2) -> Params:
  """Random parameters (tests and benchmarks); real ones come from `d2sd_jax.formats.loaders`."""
  L, D, H, Hkv, hd, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.d_ff, cfg.vocab_size)
  ks = iter(jax.random.split(key, 8 * L + 8))
  normal = lambda shape, s=scale: (s * jax.random.normal(next(ks), shape)).astype(cfg.jnp_dtype)
  near_one = lambda shape: (1.0 + 0.1 * jax.random.normal(next(ks), shape)).astype(cfg.jnp_dtype)
  def one_layer():
    lp = {
        'attn_norm': near_one((D,)),
        'mlp_norm': near_one((D,)),
        'wqkv': normal((Hkv, cfg.group + 2, hd, D), scale / D**0.5 * 4),
        'wo': normal((D, H * hd), scale / (H * hd)**0.5 * 4),
        'w_gate_up': normal((2, F, D), scale / D**0.5 * 4),
        'w_down': normal((D, F), scale / F**0.5 * 4),
    }
    if cfg.qkv_bias:
      lp['bqkv'] = normal((Hkv, cfg.group + 2, hd), 0.1)
    if cfg.qk_norm:
      lp['q_norm'] = near_one((hd,))
      lp['k_norm'] = near_one((hd,))
    return lp

  layers = [one_layer() for _ in range(L)]
  params = {'embed': normal((V, D), 1.0), 'final_norm': near_one((D,)), 'layers': layers}
  if not cfg.tie_embeddings:
    params['lm_head'] = normal((V, D), scale / D**0.5 * 4)
  return params


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
  """One {'k', 'v'} buffer pair per layer, [B, Hkv, S, hd].

  Separate per-layer buffers let XLA update each in place inside a while loop (writing a slice
  of one stacked [L, ...] array copied the whole cache once per layer), and heads-before-slots
  makes the attention dots contiguous per (row, head).
  """
  shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
  return [{'k': jnp.zeros(shape, cfg.cache_jnp_dtype), 'v': jnp.zeros(shape, cfg.cache_jnp_dtype)}
          for _ in range(cfg.n_layers)]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x_BxTxNhxhd: jax.Array, positions_BxT: jax.Array, base: float,
         freq_factors: tuple[float, ...] | None = None) -> jax.Array:
  """Rotary embedding, 'rotate half' convention (Hugging Face layout).

  freq_factors: divide the inverse frequencies (ModelConfig.rope_freq_factors): a constant
  folded in at trace time, so plain RoPE (None) runs exactly as before.
  """
  hd = x_BxTxNhxhd.shape[-1]
  inv_freq = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
  angle_BxTxh = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(angle_BxTxh)[:, :, None, :]
  sin = jnp.sin(angle_BxTxh)[:, :, None, :]
  x = x_BxTxNhxhd.astype(jnp.float32)
  x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNhxhd.dtype)


def causal_mask(batch: int, length: int) -> jax.Array:
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


COLUMN_ROWS = (2, 64)  # on a CPU, products with this many input rows are taken as columns


def columns_for(rows: int) -> bool:
  """Whether `linear` multiplies an input of `rows` rows as columns where the program runs on a
  CPU: within COLUMN_ROWS. (Elsewhere it never does; see `linear`.)"""
  return COLUMN_ROWS[0] <= rows <= COLUMN_ROWS[1]


def _rows(x_BxTxI, w_OxI):
  return jnp.einsum('bti,oi->bto', x_BxTxI, w_OxI, preferred_element_type=jnp.float32)


def _columns(x_BxTxI, w_OxI):
  B, T, I = x_BxTxI.shape
  y_OxN = jax.lax.optimization_barrier(
      jnp.einsum('ni,oi->on', x_BxTxI.reshape(B * T, I), w_OxI,
                 preferred_element_type=jnp.float32))
  return y_OxN.T.reshape(B, T, -1)


def linear(x_BxTxI, w_OxI):
  """x @ w.T, float32 out (see Precision in the module docstring).

  With a few rows (`columns_for`) in a program compiled for a CPU, the product is taken as
  columns, w @ x.T, and materialised before it is transposed back: XLA:CPU then streams w once
  through a kernel for a tall matrix times a thin one, 1.5-1.9x faster at 4-32 rows than the row
  form x @ w.T from either weight layout, and level with it at 64 rows and more
  (benchmarks/matmul_layout.py). Without the optimization barrier XLA folds the transpose into
  the product's output layout, which is the row form again. One row (an AR step) stays a
  matrix-vector product. Both forms give the same values up to float32 summation order.

  The platform is the one the program is compiled for, not the host's default backend
  (`jax.lax.platform_dependent`, resolved when the program is lowered): a program compiled on a
  CPU host for a TPU (benchmarks/tpu_compile.py) takes the row form, as it would on the TPU."""
  if not columns_for(x_BxTxI.shape[0] * x_BxTxI.shape[1]):
    return _rows(x_BxTxI, w_OxI)
  return jax.lax.platform_dependent(x_BxTxI, w_OxI, cpu=_columns, default=_rows)


def as_matrix(lp, name: str):
  """A layer's projection as the 2-D [out, in] matrix the matmul reads (a free reshape)."""
  w = lp[name]
  return w.reshape(-1, w.shape[-1])


UNROLL_ROWS = 8  # batches up to this size update caches row by row (see write_rows)


def write_rows(cache_BxHkvxSxhd, new_BxHkvxTxhd, start_B):
  """cache[b, :, start_b:start_b+T] = new[b].

  Small batches: one in-place dynamic-update-slice per row (a scatter made XLA:CPU copy the
  layer's whole cache every step). Large batches: one batched update (a scatter), which keeps
  the program small. Callers keep start_b + T <= S (a start past that is clamped).
  """
  new_BxHkvxTxhd = new_BxHkvxTxhd.astype(cache_BxHkvxSxhd.dtype)
  B = cache_BxHkvxSxhd.shape[0]
  if B > UNROLL_ROWS:
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(
        cache_BxHkvxSxhd, new_BxHkvxTxhd, start_B)
  for b in range(B):
    cache_BxHkvxSxhd = jax.lax.dynamic_update_slice(cache_BxHkvxSxhd, new_BxHkvxTxhd[b:b + 1],
                                                  (b, 0, start_B[b], 0))
  return cache_BxHkvxSxhd


def qkv_projection(cfg: ModelConfig, lp, h_BxTxD, positions_BxT, keys_values_only=False):
  """Queries [B, T, H, hd] and keys, values [B, T, Hkv, hd] (RoPE applied) of normed inputs.
  keys_values_only: (None, keys, values), projected through `wkv` (the key and value rows of
  wqkv, gathered [out, in]) where the layer has it (drafter.for_decoding: the drafters'
  context)."""
  B, T, _ = h_BxTxD.shape
  Hkv, Hg, hd = cfg.n_kv_heads, cfg.group, cfg.head_dim
  if keys_values_only and 'wkv' in lp:
    kv = linear(h_BxTxD, lp['wkv']).reshape(B, T, Hkv, 2, hd)
    if cfg.qkv_bias:
      kv = kv + lp['bqkv'][:, Hg:]
    k_BxTxHkvxhd = kv[:, :, :, 0]
    if cfg.qk_norm:
      k_BxTxHkvxhd = rms_norm(k_BxTxHkvxhd, lp['k_norm'], cfg.norm_eps)
    return None, rope(k_BxTxHkvxhd, positions_BxT, cfg.rope_base,
                      cfg.rope_freq_factors), kv[:, :, :, 1]
  # Weights as 2-D [out, in] for the matmul (a free reshape); contracting a 4-D weight made XLA
  # transpose it every step.
  qkv = linear(h_BxTxD, as_matrix(lp, 'wqkv')).reshape(B, T, Hkv, Hg + 2, hd)
  if cfg.qkv_bias:
    qkv = qkv + lp['bqkv']
  q_BxTxHkvxHgxhd = qkv[:, :, :, :Hg]
  k_BxTxHkvxhd, v_BxTxHkvxhd = qkv[:, :, :, Hg], qkv[:, :, :, Hg + 1]
  if cfg.qk_norm:
    q_BxTxHkvxHgxhd = rms_norm(q_BxTxHkvxHgxhd, lp['q_norm'], cfg.norm_eps)
    k_BxTxHkvxhd = rms_norm(k_BxTxHkvxhd, lp['k_norm'], cfg.norm_eps)
  rope_of = lambda x: rope(x, positions_BxT, cfg.rope_base, cfg.rope_freq_factors)
  q_BxTxHxhd = rope_of(q_BxTxHkvxHgxhd.reshape(B, T, Hkv * Hg, hd))
  return q_BxTxHxhd, rope_of(k_BxTxHkvxhd), v_BxTxHkvxhd


def layer(cfg: ModelConfig, x_BxTxD, lp, kv, positions_BxT, ctx_mask, tree_mask_BxTxT,
          write_start_B=None, block_size: int | None = None, fresh: bool = False,
          new_kv_only: bool = False):
  """One transformer layer over T new tokens attending to [cached context ; each other].

  ctx_mask: [B] lengths (row b's new tokens see its first ctx_mask[b] slots), [B, S] (every
  new token sees the same context slots) or [B, T, S] (`attention`).
  write_start_B: where the new tokens' K/V go in the cache (None: the cache is read-only, as in
  the drafters, whose block tokens are never cached).
  block_size, fresh: the structured forms of `attention` (tree_mask_BxTxT None).
  new_kv_only: return the new tokens' K/V ({'k', 'v'} in the cache's dtype, token by token:
  [B, T, Hkv, hd], or [B, T, Hkv·hd] where a TPU program may take the kernels) in place of
  the cache, which is only read (a verified tree: the accepted path's K/V are written once
  acceptance is known, `speculative.path_rows`, `write_path`).

  Decoding (prefix lengths, a few rows: `fused.fits`) in a program compiled for a TPU takes
  the layer's Pallas form, `_layer_kernels`, the same law; everything else the XLA form.
  """
  B, T, _ = x_BxTxD.shape
  args = (x_BxTxD, lp, kv, positions_BxT, ctx_mask, tree_mask_BxTxT, write_start_B)
  xla = functools.partial(_layer_xla, cfg, block_size=block_size, fresh=fresh,
                          new_kv_only=new_kv_only)
  if fresh or ctx_mask.ndim != 1 or not fused.fits(B * T, cfg.head_dim, cfg.d_ff, cfg.d_model):
    return xla(*args)

  def xla_as_kernels(*a):  # the kernels' layout of new K/V: both branches must match
    x, new_kv = xla(*a)
    if new_kv_only:
      new_kv = jax.tree.map(lambda t: t.reshape(B, T, -1), new_kv)
    return x, new_kv
  return jax.lax.platform_dependent(
      *args, tpu=functools.partial(_layer_kernels, cfg, block_size=block_size,
                                   new_kv_only=new_kv_only), default=xla_as_kernels)


def _layer_xla(cfg: ModelConfig, x_BxTxD, lp, kv, positions_BxT, ctx_mask, tree_mask_BxTxT,
               write_start_B=None, block_size: int | None = None, fresh: bool = False,
               new_kv_only: bool = False):
  """`layer` through XLA."""
  h = rms_norm(x_BxTxD, lp['attn_norm'], cfg.norm_eps)
  q_BxTxHxhd, k_BxTxHkvxhd, v_BxTxHkvxhd = qkv_projection(cfg, lp, h, positions_BxT)
  # The new tokens' K/V in the cache's dtype before anything reads them: a token verified in a
  # tree sees its ancestors' keys exactly as it would read them from the cache one step later.
  cdt = kv['k'].dtype
  k_new_BxHkvxTxhd = k_BxTxHkvxhd.transpose(0, 2, 1, 3).astype(cdt)
  v_new_BxHkvxTxhd = v_BxTxHkvxhd.transpose(0, 2, 1, 3).astype(cdt)
  # Attention over [committed context in the cache ; the T new tokens], one softmax: the
  # context part reads the cache as it was, so the write below is the cache's only update and
  # XLA does it in place (attending through the freshly written cache made it copy the whole
  # layer cache several times per step).
  attn_BxTxE = attention_lib.attention(q_BxTxHxhd, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, kv,
                                       ctx_mask, tree_mask_BxTxT, block_size, fresh)
  if new_kv_only:  # token by token, as the accepted path is gathered from them
    new_kv = {'k': k_BxTxHkvxhd.astype(cdt), 'v': v_BxTxHkvxhd.astype(cdt)}
  else:
    new_kv = _write_after(kv, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, attn_BxTxE, write_start_B)
  x_BxTxD = x_BxTxD + linear(attn_BxTxE, lp['wo'])

  h = rms_norm(x_BxTxD, lp['mlp_norm'], cfg.norm_eps)
  gate_up_BxTx2xF = linear(h, as_matrix(lp, 'w_gate_up')).reshape(*x_BxTxD.shape[:2], 2, -1)
  act = jax.nn.silu(gate_up_BxTx2xF[:, :, 0]) * gate_up_BxTx2xF[:, :, 1]
  x_BxTxD = x_BxTxD + linear(act, lp['w_down'])
  return x_BxTxD, new_kv


def _layer_kernels(cfg: ModelConfig, x_BxTxD, lp, kv, positions_BxT, ctx_len_B, tree_mask_BxTxT,
                   write_start_B=None, block_size: int | None = None, interpret: bool = False,
                   new_kv_only: bool = False):
  """`layer` through the TPU kernels: the attention half up to the output projection
  (`fused.attention`: norm, q/k/v, q/k norms, RoPE and attention over the cache in one kernel),
  the output projection with the residual (`fused.out_projection`), the MLP (`fused.mlp`); the
  cache write as in the XLA form.

  Over a mesh whose 'model' axis splits the layer (`fused.residual_split`) the residual stream
  stays split over its width on 'model' (float32): the partial sums of the output projection
  and the MLP are reduce-scattered in float32, each device adds the residual and norms its
  columns, and the normed rows are all-gathered in the weights' dtype before the kernels,
  which round them to it anyway. The values are the all-reduced form's up to float32
  summation order; a device reads every token's rows only in the weights' dtype."""
  residual = fused.residual_split(x_BxTxD.shape[0], lp)
  # (in the output projection's dtype: what its default-precision TPU matmul takes)
  attn_BxTxE, k_new_BxTxE, v_new_BxTxE = fused.attention(
      x_BxTxD, lp, positions_BxT, kv, ctx_len_B, tree_mask_BxTxT, block_size, eps=cfg.norm_eps,
      rope_base=cfg.rope_base, rope_freq_factors=cfg.rope_freq_factors, interpret=interpret,
      out_dtype=lp['wo'].dtype, residual=residual)
  if new_kv_only:
    new_kv = {'k': k_new_BxTxE, 'v': v_new_BxTxE}
  else:
    heads = lambda a: a.reshape(*a.shape[:2], -1, cfg.head_dim).transpose(0, 2, 1, 3)
    new_kv = _write_after(kv, heads(k_new_BxTxE), heads(v_new_BxTxE), attn_BxTxE, write_start_B)
  x_BxTxD = fused.out_projection(x_BxTxD, attn_BxTxE, lp['wo'], residual=residual)
  return fused.mlp(x_BxTxD, lp, eps=cfg.norm_eps, interpret=interpret,
                   residual=residual), new_kv


def _write_after(kv, k_new_BxHkvxTxhd, v_new_BxHkvxTxhd, attn_BxTxE, write_start_B):
  """The cache with the new tokens' K/V at write_start_B (unchanged for None), written after
  attention has read it: XLA only updates the cache in place when the written value depends on
  what read the old cache (an optimization barrier is not enough); otherwise it copies the
  whole layer cache every step. `0 *` keeps the values; one column of the output is enough."""
  if write_start_B is None:
    return kv
  after_reads_Bx1xTx1 = 0.0 * attn_BxTxE[:, None, :, :1].astype(kv['k'].dtype)
  return {'k': write_rows(kv['k'], k_new_BxHkvxTxhd + after_reads_Bx1xTx1, write_start_B),
          'v': write_rows(kv['v'], v_new_BxHkvxTxhd + after_reads_Bx1xTx1, write_start_B)}


def forward(params: Params, cfg: ModelConfig, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            cache: Cache, cache_len_B: jax.Array, tree_mask_BxTxT: jax.Array | None = None,
            feature_layers: tuple[int, ...] = (), fresh: bool = False, write_cache: bool = True):
  """Runs T new tokens per row after each row's cached context.

  Args:
    tokens_BxT, positions_BxT: the new tokens and their RoPE positions (a tree node's position is
      its depth after the context).
    cache: per layer {'k', 'v'}: [B, Hkv, S, hd]; the new tokens' K/V are written to slots
      `cache_len_B + arange(T)`; callers keep cache_len + T <= S (a write past the end would be
      clamped onto earlier slots). Attention reads only slots < cache_len from the cache.
    tree_mask_BxTxT: which new tokens each new token attends to (itself and its ancestors);
      default causal. Rows must allow the diagonal.
    feature_layers: hidden states to return, Hugging Face numbering (0 = embeddings, l = output
      of layer l).
    fresh: the cache holds nothing yet (prefill from cache_len 0, teacher features): causal
      attention among the new tokens only (`attention`), not against every empty slot.
    write_cache: False leaves the cache as it is and returns, in its place, the new tokens' K/V
      per layer ({'k', 'v'} in the cache's dtype, token by token: `layer`'s new_kv_only):
      a verified tree, whose accepted path alone is written once acceptance is known.

  Returns:
    (hidden_BxTxD after the final norm, updated cache (or the new K/V), features_BxTxLfxD or
    None)
  """
  B, T = tokens_BxT.shape
  if tree_mask_BxTxT is None and not fresh:
    tree_mask_BxTxT = causal_mask(B, T)
  x_BxTxD = params['embed'][tokens_BxT].astype(jnp.float32)

  # Layers are unrolled over lists of per-layer weights and caches: a `lax.scan` over stacked
  # weights makes XLA:CPU copy each layer's slice before its matmul.
  states, new_cache = [x_BxTxD], []
  for lp, kv in zip(params['layers'], cache):
    x_BxTxD, kv = layer(cfg, x_BxTxD, lp, kv, positions_BxT, cache_len_B, tree_mask_BxTxT,
                        write_start_B=cache_len_B, fresh=fresh, new_kv_only=not write_cache)
    new_cache.append(kv)
    states.append(x_BxTxD)
  features = jnp.stack([states[i] for i in feature_layers], axis=2) if feature_layers else None
  if not fresh:  # decoding's layers may have kept it split over its width on a mesh
    x_BxTxD = partition.whole_width(x_BxTxD)  # (`fused.residual_split`)
  hidden_BxTxD = rms_norm(x_BxTxD, params['final_norm'], cfg.norm_eps)
  return hidden_BxTxD, new_cache, features


def logits(params: Params, cfg: ModelConfig, hidden_BxTxD: jax.Array) -> jax.Array:
  """Float32 logits from final hidden states (tied or separate LM head)."""
  head_VxD = params['embed'] if cfg.tie_embeddings else params['lm_head']
  return linear(hidden_BxTxD, head_VxD)


def param_bytes(params: Params) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

"""A decoding layer as two Pallas TPU kernels: its attention half (norm, q/k/v, q/k norms, RoPE
and attention over the cache) and its MLP, each reading its weights once and its activations
once (per TensorCore).

In a decoding program (an AR step, a verified tree, a drafter's block: a few rows of new tokens)
a layer is memory-bound on its weights, and XLA splits what surrounds each matmul into passes
over float32 activations of the rows: on a v5p, for the d2sd cycle's 76 rows of Qwen3-8B, the
q/k norms, RoPE and the query layout read 28 MB per layer beyond the projection's 50 MB, and the
MLP's gate/up output written and read back 26 MB beyond its 302 MB
(benchmarks/tpu_layer_bytes.py). Here those passes happen in VMEM:

  attention  grid (KV head, row, cache blocks). At a row's first block: the attention norm of
       its tokens, their projection onto the KV head's Hg query heads, key and value
       ([Hg+2, hd, D] of `wqkv`, which stays in VMEM while every row uses it), the q/k norms,
       RoPE ('rotate half' as a lane roll), the queries scaled by 1/sqrt(hd) into VMEM, keys
       and values written out in the cache's dtype, token by token ([B, T, Hkv·hd]: a verified
       tree's accepted path is a row gather of them). Then `cached.flash_step`: the cache
       blocks in use, the new tokens under their mask, the output in the output projection's
       layout. The rows, their RoPE tables and masks are one block each, read once; the
       queries (float32, as many bytes as the rows) never leave VMEM. (With the rows outermost
       a batch of B rows read every KV head's weights B times.)
  mlp  grid (core, F tiles): the MLP norm once into VMEM, then per tile of F the gate and up
       products, SiLU(gate) · up, and its product with the tile's `w_down` columns summed in
       the output block, which stays in VMEM, the residual with the first. On a chip of two
       TensorCores (v4, v5p) the F tiles are split in two halves on a 'parallel' axis and the
       halves' sums are added after; on a one-core chip (v5e, v6e) F is one sum
       (`partition.tensor_cores`, from the devices compiled for).

The values are the XLA forms' on a TPU: the matmuls take their inputs in the weights' dtype
(what XLA does with float32 inputs at default precision) and accumulate in float32, every norm,
RoPE, softmax and SiLU is float32 (tests/kernels/test_fused.py checks both kernels against
`target.layer`'s XLA form through Pallas' interpreter). `target.layer` takes them in programs
compiled for a TPU (`jax.lax.platform_dependent`) when `fits`: heads a multiple of 128 lanes and
rows whose float32 activations fit VMEM beside the weights' tiles (MAX_ROW_BYTES). Over a mesh
they run per device (`shard_map`): rows over 'data', KV heads (attention) or F (mlp) over
'model'. The MLP's partial sums, and the output projection's (`out_projection`), are reduced
over 'model' with the residual inside the first shard's, so no pass over the rows adds it after;
or, where the 'model' axis splits the layer (`residual_split`), the residual stream stays split
over its width: the partial sums are reduce-scattered in float32 and the normed rows are
all-gathered in the weights' dtype, which the kernels then read (`prenormed`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from d2sd_jax.kernels import cached, partition

MAX_ROWS = 1024  # new tokens per program (batch x T) the kernels hold in VMEM at once
MAX_ROW_BYTES = 12 << 20  # ... and their float32 rows [batch x T, D] at most
VMEM_BUDGET = 56 << 20  # what a kernel's blocks may take of a core's VMEM (a v5p core: 64 MiB)
F_TILES = (512, 256, 128)  # columns of F per MLP step, the largest that divides F / cores
MLP_CORES = 2  # the MLP's parallel halves (a v5p or v4 chip's TensorCores; one core runs both)
_NT = (((1,), (1,)), ((), ()))  # x [R, I] . w [O, I] -> [R, O]


def fits(rows: int, head_dim: int, d_ff: int, d_model: int = 0) -> bool:
  """Whether a layer of width d_model over `rows` new tokens takes these kernels on a TPU."""
  return (rows <= MAX_ROWS and 4 * rows * d_model <= MAX_ROW_BYTES and head_dim % 128 == 0
          and any(d_ff % (MLP_CORES * t) == 0 for t in F_TILES))


def _vmem_limit(nbytes: int) -> int:
  """The scoped VMEM to ask for: what the blocks need with headroom, within a v5p core's."""
  return int(min(max(2 * nbytes, 32 << 20), VMEM_BUDGET + (4 << 20)))


def _rms(x, w, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(positions_BxT, hd: int, base: float, freq_factors=None):
  """cos and signed sin [B, T, hd] for `rope` as out = x cos + roll(x, hd/2) sin: the angles of
  `target.rope`, cos twice and sin as [-sin, sin]."""
  inv_freq = base ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  if freq_factors is not None:
    inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
  angle = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  return jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1)


def _project(h, w_ref, b_ref, qn_ref, kn_ref, cos, sin, *, Hg: int, eps: float, qk_norm: bool):
  """One KV head's group from the normed rows h [T, D] (in the weights' dtype): its Hg queries
  (q norm, RoPE, 1/sqrt(hd)) as [Hg·T, hd] rows ordered (head, token), and its key (k norm,
  RoPE) and value [T, hd], all float32."""
  f32 = jnp.float32
  hd = cos.shape[-1]

  def project(i):
    y = jax.lax.dot_general(h, w_ref[0, i], _NT, preferred_element_type=f32)  # [T, hd]
    return y if b_ref is None else y + b_ref[0, i:i + 1, :]

  def norm_rope(y, norm_ref):
    if qk_norm:
      y = _rms(y, norm_ref[...], eps)
    return y * cos + pltpu.roll(y, hd // 2, 1) * sin

  q = jnp.concatenate([norm_rope(project(i), qn_ref) for i in range(Hg)], 0) * hd**-0.5
  return q, norm_rope(project(Hg), kn_ref), project(Hg + 1)


def _attention_kernel(*refs, Hg: int, T: int, eps: float, qk_norm: bool, has_bias: bool,
                      bk: int, n_blocks: int, prenormed: bool = False):
  if prenormed:  # no norm weight
    refs = refs[:2] + (None,) + refs[2:]
  if not has_bias:
    refs = refs[:4] + (None,) + refs[4:]
  (len_ref, x_ref, nw_ref, w_ref, b_ref, qn_ref, kn_ref, cos_ref, sin_ref, kc_ref, vc_ref,
   bias_ref, o_ref, k_ref, v_ref, q_sc, m_sc, l_sc, acc_sc) = refs
  b, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _qkv():  # this KV head's queries into VMEM, its key and value out (the attention reads them)
    h = x_ref[b] if prenormed else _rms(x_ref[b], nw_ref[...], eps).astype(w_ref.dtype)
    q, k, v = _project(h, w_ref, b_ref, qn_ref, kn_ref, cos_ref[b], sin_ref[b], Hg=Hg, eps=eps,
                       qk_norm=qk_norm)
    q_sc[...] = q
    k_ref[0] = k.astype(k_ref.dtype)
    v_ref[0] = v.astype(v_ref.dtype)

  cached.flash_step(q_sc[...], j, len_ref[b], kc_ref, vc_ref, lambda: (k_ref[0], v_ref[0]),
                    bias_ref.at[pl.ds(b, 1)], o_ref, m_sc, l_sc, acc_sc, bk=bk,
                    n_blocks=n_blocks, T=T)


def _attention_local(len_B, x, nw, w, bias, qn, kn, cos, sin, k_cache, v_cache, tbias, *, eps,
                     qk_norm, interpret, out_dtype, prenormed=False):
  """prenormed: x is the attention norm's output in the weights' dtype (`residual_split`
  gathers it so), not the residual stream, and nw is not used."""
  B, T, D = x.shape
  Hkv, G2, hd, _ = w.shape
  Hg, S = G2 - 2, k_cache.shape[2]
  R = Hg * T
  bk = cached.block_for(S)
  n_blocks = S // bk
  f32 = jnp.float32
  # Grid (KV head, row, cache block): a KV head's weights stay in VMEM while every row uses
  # them (read once, not once per row), and the rows, their RoPE tables and new-token masks
  # are one block each, read once (per core).
  whole = lambda h, b, j, n: (0, 0, 0)
  const2 = lambda h, b, j, n: (0, 0)
  head = lambda h, b, j, n: (b, 0, h)  # KV head h's lanes of row b's tokens
  specs = [pl.BlockSpec((B, T, D), whole), pl.BlockSpec((1, D), const2),
           pl.BlockSpec((1, G2, hd, D), lambda h, b, j, n: (h, 0, 0, 0))]
  args = [x, nw, w]
  if prenormed:
    del specs[1], args[1]
  if bias is not None:
    specs.append(pl.BlockSpec((1, G2, hd), lambda h, b, j, n: (h, 0, 0)))
    args.append(bias.astype(f32))
  in_row = cached.cache_block_map(bk)
  cache_block = lambda h, b, j, n: in_row(b, h, j, n)
  specs += ([pl.BlockSpec((1, hd), const2)] * 2 + [pl.BlockSpec((B, T, hd), whole)] * 2
            + [pl.BlockSpec((1, 1, bk, hd), cache_block)] * 2 + [pl.BlockSpec((B, R, T), whole)])
  args += [qn, kn, cos, sin, k_cache, v_cache, tbias]
  cdtype = k_cache.dtype
  cbytes, wbytes = cdtype.itemsize, w.dtype.itemsize
  # the KV heads split over the chip's TensorCores: each reads the rows once
  cores = min(Hkv, partition.tensor_cores())
  kernel = functools.partial(_attention_kernel, Hg=Hg, T=T, eps=eps, qk_norm=qk_norm,
                             has_bias=bias is not None, bk=bk, n_blocks=n_blocks,
                             prenormed=prenormed)
  xbytes = x.dtype.itemsize
  need = (B * (xbytes * T * D + 4 * (2 * T * hd + R * T)) + w[0].size * wbytes
          + 4 * bk * hd * cbytes + 4 * 2 * R * hd)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(Hkv, B, n_blocks), in_specs=specs,
          out_specs=[pl.BlockSpec((1, T, Hg * hd), head), pl.BlockSpec((1, T, hd), head),
                     pl.BlockSpec((1, T, hd), head)],
          scratch_shapes=[pltpu.VMEM((R, hd), f32), pltpu.VMEM((R, 1), f32),
                          pltpu.VMEM((R, 1), f32), pltpu.VMEM((R, hd), f32)]),
      out_shape=[jax.ShapeDtypeStruct((B, T, Hkv * Hg * hd), out_dtype),
                 jax.ShapeDtypeStruct((B, T, Hkv * hd), cdtype),
                 jax.ShapeDtypeStruct((B, T, Hkv * hd), cdtype)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'arbitrary', 'arbitrary'),
          vmem_limit_bytes=_vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=2 * B * T * D * Hkv * G2 * hd + 4 * B * Hkv * R * (S + T) * hd,
          transcendentals=B * Hkv * (T + R * (S + T)),
          # the weights once; per core the rows, RoPE tables and new-token masks; the cache
          # (at most all of it); the new K/V and the output written once
          bytes_accessed=(w.size * wbytes
                          + cores * B * (xbytes * T * D + 4 * (2 * T * hd + R * T))
                          + 2 * k_cache.size * cbytes + 2 * B * Hkv * T * hd * cbytes
                          + B * T * Hkv * Hg * hd * jnp.dtype(out_dtype).itemsize)),
      interpret=interpret,
  )(len_B.astype(jnp.int32), *args)


def residual_split(B: int, lp):
  """Whether a decoding layer (`lp`) over B rows keeps its residual stream split over its
  width on the traced mesh's 'model' axis (`partition.residual_axes`: it divides the width in
  128-lane slices, the KV heads, the attention output's columns and F): the split to pass to
  `attention`, `out_projection` and `mlp` as `residual`, or None.

  Sequence parallelism's collectives with the stream split over its width rather than its
  tokens: each device holds every token's D/M columns (float32), the layer's partial sums are
  reduce-scattered over the width, each device adds the residual and computes the norm of its
  columns (the rows' sums of squares, a float32 all-reduce of one value per token), and the
  normed rows are all-gathered in the weights' dtype, which the projections' matmuls round
  them to anyway. The TPU compiler decomposes a reduce-scatter over tokens into an all-reduce
  and a slice unless every device's tokens fill whole (8, 128) tiles (D²SD's 80 nodes on 8
  devices are 10 each); over the width, whole 128-lane slices, it keeps it."""
  return partition.residual_axes(B, lp['wqkv'].shape[-1], lp['wqkv'].shape[0],
                                 lp['wo'].shape[1], lp['w_gate_up'].shape[1])


def _normed_columns(x, nw, dtype, eps, axis):
  """`residual_split`: the norm of the residual stream's columns on this device (x [B, T, D/M],
  float32; nw, the norm's weight, [1, D/M]) in the weights' dtype, all-gathered over the
  width: [B, T, D]. The mean square sums every device's columns (`_rms`'s law)."""
  x = x.astype(jnp.float32)
  width = x.shape[-1] * jax.lax.axis_size(axis)
  sq = jax.lax.psum(jnp.sum(x * x, axis=-1, keepdims=True), axis)
  h = (x * jax.lax.rsqrt(sq / width + eps) * nw).astype(dtype)
  return jax.lax.all_gather(h, axis, axis=2, tiled=True)


def attention(x_BxTxD, lp, positions_BxT, kv, ctx_len_B, tree_mask_BxTxT,
              block_size: int | None = None, *, eps: float, rope_base: float,
              rope_freq_factors=None, interpret: bool = False, out_dtype=jnp.float32,
              residual=None):
  """A decoding layer's attention half up to the output projection, from the residual stream
  x (float32 [B, T, D]): the attention norm, q/k/v (`lp`: attn_norm, wqkv, and where present
  bqkv, q_norm, k_norm, as target.py lays them out), q/k norms and RoPE, and attention over the
  first ctx_len_B cache slots of `kv` plus the new tokens under tree_mask_BxTxT (or blocks of
  `block_size`), as `cached.attend` computes it. The queries stay in VMEM.

  residual: `residual_split`'s split: x is split over its width on 'model'; each device norms
  its columns and the normed rows are all-gathered in the weights' dtype before the kernel,
  which reads them (half a float32 pass) instead of norming the float32 rows itself.

  Returns (the attention output [B, T, H·hd] in `out_dtype`, heads in the output projection's
  order; the new keys and values [B, T, Hkv·hd] in the cache's dtype, RoPE on the keys, token
  by token as a verified tree's accepted path is gathered from them)."""
  w = lp['wqkv']
  B, T = positions_BxT.shape
  hd, Hg = w.shape[2], w.shape[1] - 2
  f32 = jnp.float32
  ones = jnp.ones((hd,), f32)
  cos, sin = rope_tables(positions_BxT, hd, rope_base, rope_freq_factors)
  tbias = cached.new_token_bias(tree_mask_BxTxT, B, T, Hg, block_size)
  args = (ctx_len_B, x_BxTxD.astype(f32), lp['attn_norm'].astype(f32)[None], w, lp.get('bqkv'),
          lp.get('q_norm', ones).astype(f32)[None], lp.get('k_norm', ones).astype(f32)[None],
          cos, sin, kv['k'], kv['v'], tbias)
  local = functools.partial(_attention_local, eps=eps, qk_norm='q_norm' in lp,
                            interpret=interpret, out_dtype=out_dtype)
  split = residual or partition.kernel_axes(B, w.shape[0])
  if split:
    mesh, rows, heads = split
    P = jax.sharding.PartitionSpec
    heads4, row3 = P(rows, heads, None, None), P(rows, None, None)
    if residual:
      kernel_local = functools.partial(local, prenormed=True)
      local = lambda n, x_, nw, w_, *a: kernel_local(
          n, _normed_columns(x_, nw, w_.dtype, eps, heads), None, w_, *a)
    in_specs = (P(rows), P(rows, None, heads) if residual else row3,
                P(None, heads) if residual else P(), P(heads, None, None, None),
                None if args[4] is None else P(heads, None, None), P(), P(), row3, row3,
                heads4, heads4, row3)
    local = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                          out_specs=(P(rows, None, heads),) * 3, check_vma=False)
  return local(*args)


def _mlp_kernel(*refs, eps: float, steps: int, prenormed: bool = False):
  if prenormed:  # no norm weight
    refs = refs[:2] + (None,) + refs[2:]
  keep_ref, x_ref, nw_ref, g_ref, u_ref, d_ref, o_ref, h_sc = refs
  c, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _norm():  # (the output block stays in VMEM over the F tiles: it is the sum)
    x = x_ref[...]
    if prenormed:  # the rows are the norm's output (`residual_split`), no residual
      h_sc[...] = x.astype(h_sc.dtype)
      o_ref[0] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)
      return
    h_sc[...] = _rms(x, nw_ref[...], eps).astype(h_sc.dtype)
    # the residual, in the first sum (where keep_ref says: one shard of a split F)
    o_ref[0] = jnp.where((c == 0) & (keep_ref[0] > 0), x, 0.0)

  f32 = jnp.float32
  h = h_sc[...]
  gate = jax.lax.dot_general(h, g_ref[0], _NT, preferred_element_type=f32)  # [R, tile]
  up = jax.lax.dot_general(h, u_ref[0], _NT, preferred_element_type=f32)
  act = (gate * jax.nn.sigmoid(gate) * up).astype(d_ref.dtype)
  o_ref[0] += jax.lax.dot_general(act, d_ref[...], _NT, preferred_element_type=f32)


def _mlp_local(x, nw, w_gate_up, w_down, keep=None, *, eps, interpret, cores=MLP_CORES,
               prenormed=False):
  """keep: int32 [1], whether the residual goes into the sum (None: it does). prenormed: x is
  the MLP norm's output in the weights' dtype, nw is not used, and the sum is the MLP's alone."""
  B, T, D = x.shape
  R, F = B * T, w_gate_up.shape[1]
  cores = cores if F % cores == 0 else 1
  keep = jnp.ones((1,), jnp.int32) if keep is None else keep
  wbytes = w_gate_up.dtype.itemsize
  # the largest F tile whose three weight tiles (double-buffered) fit beside the rows
  tiles = [t for t in F_TILES if (F // cores) % t == 0]
  xbytes = x.dtype.itemsize
  rows_bytes = 2 * xbytes * R * D + 2 * 4 * R * D + R * D * wbytes  # x and the sum (2 bufs), h
  tile = next((t for t in tiles if rows_bytes + 6 * t * D * wbytes <= VMEM_BUDGET), tiles[-1])
  steps = F // cores // tile
  f32 = jnp.float32
  col = lambda c, j: c * steps + j
  need = rows_bytes + 6 * tile * D * wbytes
  specs = [pl.BlockSpec((R, D), lambda c, j, k: (0, 0)),
           pl.BlockSpec((1, D), lambda c, j, k: (0, 0)),
           pl.BlockSpec((1, tile, D), lambda c, j, k: (0, col(c, j), 0)),
           pl.BlockSpec((1, tile, D), lambda c, j, k: (1, col(c, j), 0)),
           pl.BlockSpec((D, tile), lambda c, j, k: (0, col(c, j)))]
  args = [x.reshape(R, D), nw, w_gate_up, w_gate_up, w_down]
  if prenormed:
    del specs[1], args[1]
  partial_CxRxD = pl.pallas_call(
      functools.partial(_mlp_kernel, eps=eps, steps=steps, prenormed=prenormed),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(cores, steps), in_specs=specs,
          out_specs=pl.BlockSpec((1, R, D), lambda c, j, k: (c, 0, 0)),
          scratch_shapes=[pltpu.VMEM((R, D), w_gate_up.dtype)]),
      out_shape=jax.ShapeDtypeStruct((cores, R, D), f32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary'),
                                           vmem_limit_bytes=_vmem_limit(need)),
      cost_estimate=pl.CostEstimate(
          flops=6 * R * D * F, transcendentals=R * F,
          bytes_accessed=3 * F * D * wbytes + cores * (xbytes + 4) * R * D),
      interpret=interpret,
  )(keep.astype(jnp.int32), *args)
  out_RxD = partial_CxRxD[0]
  for c in range(1, cores):
    out_RxD = out_RxD + partial_CxRxD[c]
  return out_RxD.reshape(B, T, D)


def mlp(x_BxTxD, lp, *, eps: float, interpret: bool = False, residual=None):
  """x + MLP(x) for the residual stream x (float32 [B, T, D]): RMSNorm (`mlp_norm`), then
  w_down (SiLU(gate) * up) with gate/up from `w_gate_up` [2, F, D], `w_down` [D, F]. F is
  split over the chip's TensorCores (`partition.tensor_cores`: a one-core chip takes it whole,
  without partial sums to add), and over a mesh's 'model' axis, whose partial sums are reduced
  with the residual inside the first shard's (no pass of its own over the rows).

  residual: `residual_split`'s split: x is split over its width on 'model'; each device norms
  its columns, the normed rows are all-gathered in the weights' dtype, the kernel sums its
  part of F, and the sums are reduce-scattered over the width (float32) and added to the
  device's columns of x: the output stays split over its width."""
  f32 = jnp.float32
  x = x_BxTxD.astype(f32)
  cores = partition.tensor_cores()
  local = part = functools.partial(_mlp_local, eps=eps, interpret=interpret, cores=cores)
  split = residual or partition.kernel_axes(x.shape[0], lp['w_gate_up'].shape[1])
  if split:
    mesh, rows, cols = split
    P = jax.sharding.PartitionSpec
    body = part
    if residual:
      def body(x_, nw, wgu, wd):
        h = _normed_columns(x_, nw, wgu.dtype, eps, cols)
        sums = part(h, None, wgu, wd, keep=jnp.zeros((1,), jnp.int32), prenormed=True)
        return jax.lax.psum_scatter(sums, cols, scatter_dimension=2, tiled=True) + x_
      xs = P(rows, None, cols)
      local = jax.shard_map(body, mesh=mesh,
                            in_specs=(xs, P(None, cols), P(None, cols, None), P(None, cols)),
                            out_specs=xs, check_vma=False)
      return local(x, lp['mlp_norm'].astype(f32)[None], lp['w_gate_up'], lp['w_down'])
    if cols:  # each device sums its part of F, the first with the residual; then reduce
      body = lambda x_, *a: jax.lax.psum(part(x_, *a, keep=(
          jax.lax.axis_index(cols) == 0).astype(jnp.int32)[None]), cols)
    local = jax.shard_map(body, mesh=mesh,
                          in_specs=(P(rows, None, None), P(), P(None, cols, None), P(None, cols)),
                          out_specs=P(rows, None, None), check_vma=False)
  return local(x, lp['mlp_norm'].astype(f32)[None], lp['w_gate_up'], lp['w_down'])


def out_projection(x_BxTxD, attn_BxTxE, wo_DxE, residual=None):
  """x + attn wo^T (float32), the attention half's residual add. Over a mesh whose 'model'
  axis splits E (the heads), each device's partial product takes the residual on the first
  shard and the sum is one reduction: XLA's own partitioning reduced the product, then added x
  in a pass of its own over the rows. residual (`residual_split`): x is split over its width
  on 'model'; the partial products are reduce-scattered over the width (float32) and added
  to the device's columns of x, and the output stays split so."""
  split = residual or partition.kernel_axes(x_BxTxD.shape[0], wo_DxE.shape[1])
  linear = lambda a, w: jnp.einsum('bte,de->btd', a, w, preferred_element_type=jnp.float32)
  if not split or not split[2]:
    return x_BxTxD + linear(attn_BxTxE, wo_DxE)
  mesh, rows, cols = split
  P = jax.sharding.PartitionSpec
  if residual:
    scatter = lambda x, a, w: jax.lax.psum_scatter(linear(a, w), cols, scatter_dimension=2,
                                                    tiled=True) + x
    return jax.shard_map(scatter, mesh=mesh,
                         in_specs=(P(rows, None, cols), P(rows, None, cols), P(None, cols)),
                         out_specs=P(rows, None, cols), check_vma=False)(
                             x_BxTxD.astype(jnp.float32), attn_BxTxE, wo_DxE)

  def body(x, a, w):
    first = jax.lax.axis_index(cols) == 0
    return jax.lax.psum(linear(a, w) + jnp.where(first, x, 0.0), cols)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(rows, None, None), P(rows, None, cols),
                                                  P(None, cols)),
                       out_specs=P(rows, None, None), check_vma=False)(
                           x_BxTxD.astype(jnp.float32), attn_BxTxE, wo_DxE)

"""Sampling transforms shared by autoregressive decoding and speculative verification.

The target's distribution p is always `probs(logits, settings)`: temperature, then top-k, then
top-p, all through `candidates`, in AR and in verification alike, so a speculative sampler can be
exactly as lossless as the AR one it replaces.

Every draw is cheap on a CPU, where a vocabulary-wide categorical (49,152 Gumbel variates per
row), sort or variadic argmax costs more than the target's own decode step at batch 100:
  greedy   `argmax`: block maxima, then one block (XLA:CPU's (value, index) reduction is slow;
           programs compiled for other platforms take that reduction);
  top_k    only the k survivors of `lax.top_k` are processed and drawn from;
  top_p    without top_k, the nucleus cut is found by bisection over logit values (one masked
           sum over the vocabulary per halving) instead of a sort;
  a draw   one uniform per row, inverted through the CDF of the processed distribution (over
           blocks of the vocabulary, then inside one block), never a full-vocabulary noise.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
BLOCK = 256  # inverse-CDF block: a long row is searched block by block, then inside one block


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f'temperature={self.temperature} must be >= 0 (0 = greedy)')
    if self.top_k < 0:
      raise ValueError(f'top_k={self.top_k} must be >= 0 (0 = no top-k filter)')
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f'top_p={self.top_p} must be in (0, 1] (1 = no nucleus filter)')

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def _blocks(x_NxV: jax.Array) -> jax.Array:
  """[..., nb, BLOCK]: the last axis in blocks, padded with -inf."""
  V = x_NxV.shape[-1]
  nb = -(-V // BLOCK)
  pad = [(0, 0)] * (x_NxV.ndim - 1) + [(0, nb * BLOCK - V)]
  return jnp.pad(x_NxV, pad, constant_values=NEG_INF).reshape(x_NxV.shape[:-1] + (nb, BLOCK))


def _first(hit_NxC: jax.Array) -> jax.Array:
  """Index of the first True along the last axis (C when none)."""
  C = hit_NxC.shape[-1]
  return jnp.min(jnp.where(hit_NxC, jnp.arange(C, dtype=jnp.int32), C), axis=-1)


def argmax(x_NxV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis (the first maximum), int32. NaN counts as +inf (a row
  holding NaN gives its first NaN or +inf; jnp.argmax: its first NaN).

  In a program compiled for a CPU: the max of each block of the row, then the first block
  holding the row's max, then its first maximum. On XLA:CPU, rows of 49,152: 2x faster than
  jnp.argmax's (value, index) reduction at 1 row, 7x at 8, 9x at 100. Elsewhere (the platform
  the program is compiled for: `jax.lax.platform_dependent`) the one (value, index) reduction:
  on a TPU the blocks' reshape of a [T, 151936] row of logits was a relayout copy of all of
  them (benchmarks/tpu_compile.py)."""
  return jax.lax.platform_dependent(x_NxV, cpu=_argmax_by_blocks, default=_argmax_reduction)


def _no_nan(x):
  return jnp.where(jnp.isnan(x), jnp.inf, x)


def _argmax_reduction(x_NxV: jax.Array) -> jax.Array:
  """One (value, index) reduction, NaN read as +inf inside its combiner: a NaN test of the
  input outside the reduction is a pass of its own over it (on a TPU, at 8 rows of [76,
  151,936] logits, a bit mask of every element written and read beside the logits, which then
  reach memory instead of being reduced in the head's matmul: 1.2 GB)."""
  x = x_NxV.astype(jnp.float32)
  idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)

  def combine(a, b):
    (ma, ia), (mb, ib) = a, b
    ma, mb = _no_nan(ma), _no_nan(mb)
    return jnp.maximum(ma, mb), jnp.where((ma > mb) | ((ma == mb) & (ia < ib)), ia, ib)

  return jax.lax.reduce((x, idx), (jnp.float32(NEG_INF), jnp.int32(0)), combine,
                        (x.ndim - 1,))[1]


def confidence_and_argmax(x_NxV: jax.Array, temperature: float = 1.0):
  """(max softmax(x / temperature) = 1 / sum exp((x - max) / temperature), `argmax(x)`) over
  the last axis, for finite maxima.

  In a program compiled for a CPU: the max, the sum and `argmax`'s blocks, each its own pass.
  Elsewhere one (max, index, scaled sum) reduction with an online rescaling of the sum, which
  XLA fuses into the matmul making x: on a TPU a drafter block's [16, 151,936] logits then
  never reach memory (they were written once and read twice)."""
  return jax.lax.platform_dependent(
      x_NxV, cpu=lambda x: _confidence_and_argmax_passes(x, temperature),
      default=lambda x: _confidence_and_argmax_reduction(x, temperature))


def _confidence_and_argmax_passes(x_NxV, temperature):
  top = jnp.max(x_NxV, axis=-1, keepdims=True)
  conf = 1.0 / jnp.sum(jnp.exp((x_NxV - top) / temperature), axis=-1)
  return conf, argmax(x_NxV)


def _confidence_and_argmax_reduction(x_NxV, temperature):
  x = x_NxV.astype(jnp.float32)
  idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)

  def combine(a, b):  # NaN as +inf, inside the reduction (`_argmax_reduction`)
    (ma, ia, sa), (mb, ib, sb) = a, b
    ma, mb = _no_nan(ma), _no_nan(mb)
    m = jnp.maximum(ma, mb)
    i = jnp.where((ma > mb) | ((ma == mb) & (ia < ib)), ia, ib)  # the first maximum
    scaled = lambda s_, m_: jnp.where(s_ > 0, s_ * jnp.exp((m_ - m) / temperature), 0.0)
    return m, i, scaled(sa, ma) + scaled(sb, mb)

  _, pred, total = jax.lax.reduce((x, idx, jnp.ones_like(x)),
                                  (jnp.float32(NEG_INF), jnp.int32(0), jnp.float32(0.0)),
                                  combine, (x.ndim - 1,))
  return 1.0 / total, pred


def _argmax_by_blocks(x_NxV: jax.Array) -> jax.Array:
  no_nan = lambda x: jnp.where(jnp.isnan(x), jnp.inf, x)
  if x_NxV.shape[-1] <= 2 * BLOCK:
    x_NxV = no_nan(x_NxV)
    return _first(x_NxV == jnp.max(x_NxV, axis=-1, keepdims=True))
  x_NxBxK = _blocks(x_NxV)
  # NaN -> +inf inside the block reduction and again in the chosen block only: a cleaned copy
  # of the whole row, read twice, made XLA:CPU write it out (as long as the maxima took).
  block_max_NxB = jnp.max(no_nan(x_NxBxK), axis=-1)
  top_Nx1 = jnp.max(block_max_NxB, axis=-1, keepdims=True)
  b_N = _first(block_max_NxB == top_Nx1)
  in_block_NxK = no_nan(jnp.take_along_axis(x_NxBxK, b_N[..., None, None], axis=-2)[..., 0, :])
  return b_N * BLOCK + _first(in_block_NxK == top_Nx1)


def _ordered(x):
  """float32 -> uint32 keys with the same order (finite values)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _from_ordered(key):
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _nucleus_cut(z_NxV: jax.Array, top_p: float) -> jax.Array:
  """[N, 1] the largest value t with mass(z >= t) >= top_p: top-p keeps exactly z >= t (the
  smallest set of top tokens reaching top_p; tokens tied with the last one kept stay too).
  Bisection over the float32 order, 32 halvings: no vocabulary-wide sort."""
  p_NxV = jax.nn.softmax(z_NxV, axis=-1)
  finite = z_NxV > NEG_INF
  lo = _ordered(jnp.min(jnp.where(finite, z_NxV, jnp.inf), -1, keepdims=True))  # mass 1
  hi = _ordered(jnp.max(z_NxV, -1, keepdims=True))

  def halve(_, bounds):
    lo, hi = bounds  # the answer is in [lo, hi]; mass(z >= lo) >= top_p
    mid = lo + (hi - lo + 1) // 2
    ok = jnp.sum(jnp.where(z_NxV >= _from_ordered(mid), p_NxV, 0.0), -1, keepdims=True) >= top_p
    ok |= mid == lo  # (rounding could leave sum(p) just under a top_p near 1)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
  return _from_ordered(lo)


def candidates(logits_NxV: jax.Array, settings: SamplingSettings):
  """(z_NxC, ids_NxC): the tokens a draw can return and their processed logits (temperature
  applied; -inf where top-p removes them). With top_k, C = k: the k largest logits (ties: the
  lower id first), largest first; without, C = V and ids is None (z's index is the token)."""
  logits_NxV = logits_NxV.astype(jnp.float32)
  V = logits_NxV.shape[-1]
  if 0 < settings.top_k < V:
    top_NxC, ids_NxC = jax.lax.top_k(logits_NxV, settings.top_k)
    z_NxC = top_NxC / settings.temperature
    if settings.top_p < 1.0:  # already sorted: the mass before each survivor is a cumsum
      p = jax.nn.softmax(z_NxC, axis=-1)
      kept = jnp.cumsum(p, axis=-1) - p < settings.top_p
      cut = jnp.min(jnp.where(kept, z_NxC, jnp.inf), axis=-1, keepdims=True)
      z_NxC = jnp.where(z_NxC < cut, NEG_INF, z_NxC)
    return z_NxC, ids_NxC
  z_NxV = logits_NxV / settings.temperature
  if settings.top_p < 1.0:
    z_NxV = jnp.where(z_NxV < _nucleus_cut(z_NxV, settings.top_p), NEG_INF, z_NxV)
  return z_NxV, None


def process_logits(logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """Temperature, then top-k, then top-p; removed tokens get -inf. Works on [..., V]."""
  logits_Nx = logits_Nx.astype(jnp.float32)
  if settings.greedy:
    return logits_Nx
  z, ids = candidates(logits_Nx, settings)
  if ids is None:
    return z
  return _scatter_last(jnp.full(logits_Nx.shape, NEG_INF), ids, z)


def _scatter_last(base_NxV, ids_NxC, values_NxC):
  """base[..., ids] = values along the last axis, for any leading shape (ids >= V: dropped)."""
  V, C = base_NxV.shape[-1], ids_NxC.shape[-1]
  flat = base_NxV.reshape(-1, V)
  rows = jnp.arange(flat.shape[0])[:, None]
  flat = flat.at[rows, ids_NxC.reshape(-1, C)].set(values_NxC.reshape(-1, C), mode='drop')
  return flat.reshape(base_NxV.shape)


def probs(logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """The distribution a sampler with these settings draws from (one-hot argmax when greedy)."""
  if settings.greedy:
    return jax.nn.one_hot(argmax(logits_Nx), logits_Nx.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(process_logits(logits_Nx, settings), axis=-1)


def token_probs(logits_NxV: jax.Array, tokens_NxM: jax.Array,
                settings: SamplingSettings) -> jax.Array:
  """[N, M] = probs(logits)[n, tokens[n, m]], without building the [N, V] distribution."""
  if settings.greedy:
    return (tokens_NxM == argmax(logits_NxV)[..., None]).astype(jnp.float32)
  z_NxC, ids_NxC = candidates(logits_NxV, settings)
  log_norm_Nx1 = jax.nn.logsumexp(z_NxC, axis=-1, keepdims=True)
  if ids_NxC is None:
    return jnp.exp(jnp.take_along_axis(z_NxC, tokens_NxM, axis=-1) - log_norm_Nx1)
  p_NxC = jnp.exp(z_NxC - log_norm_Nx1)
  same_NxMxC = tokens_NxM[..., :, None] == ids_NxC[..., None, :]
  return jnp.sum(jnp.where(same_NxMxC, p_NxC[..., None, :], 0.0), axis=-1)


def _first_above(cdf_NxC, weight_NxC, target_Nx1):
  """The first index whose CDF exceeds target among positive weights (the last positive one
  when rounding leaves none): a token of zero weight is never returned."""
  C = cdf_NxC.shape[-1]
  idx = jnp.arange(C, dtype=jnp.int32)
  positive = weight_NxC > 0
  first = jnp.min(jnp.where((cdf_NxC > target_Nx1) & positive, idx, C), axis=-1)
  last = jnp.max(jnp.where(positive, idx, -1), axis=-1)
  return jnp.minimum(first, last)


def draw(u_N: jax.Array, z_NxC: jax.Array) -> jax.Array:
  """Index of a draw from softmax(z) along the last axis, given one uniform in [0, 1) per row:
  the inverse CDF. A long row is searched by blocks of BLOCK, then inside the chosen block, so
  no vocabulary-wide cumsum is built. Rows need one finite entry."""
  C = z_NxC.shape[-1]
  top = jnp.max(z_NxC, axis=-1, keepdims=True)
  u_Nx1 = u_N[..., None].astype(jnp.float32)
  if C <= 2 * BLOCK:
    w_NxC = jnp.exp(z_NxC - top)
    cdf = jnp.cumsum(w_NxC, axis=-1)
    return _first_above(cdf, w_NxC, u_Nx1 * cdf[..., -1:])
  z_NxBxK = _blocks(z_NxC)
  mass_NxB = jnp.sum(jnp.exp(z_NxBxK - top[..., None]), axis=-1)
  block_cdf = jnp.cumsum(mass_NxB, axis=-1)
  target_Nx1 = u_Nx1 * block_cdf[..., -1:]
  b_N = _first_above(block_cdf, mass_NxB, target_Nx1)
  before_Nx1 = jnp.take_along_axis(block_cdf - mass_NxB, b_N[..., None], axis=-1)
  w_NxK = jnp.exp(jnp.take_along_axis(z_NxBxK, b_N[..., None, None], axis=-2)[..., 0, :] - top)
  i_N = _first_above(jnp.cumsum(w_NxK, axis=-1), w_NxK, target_Nx1 - before_Nx1)
  return b_N * BLOCK + i_N


def sample_uniform(u_N: jax.Array, logits_NxV: jax.Array, settings: SamplingSettings,
                   exclude_NxE: jax.Array | None = None) -> jax.Array:
  """The token drawn from `probs` by the uniform u (argmax when greedy). exclude: tokens whose
  probability is removed first, the rest renormalised (-1: none); a residual of rejected
  point-mass drafts. Rows must keep some mass."""
  if settings.greedy:
    return argmax(logits_NxV)
  z_NxC, ids_NxC = candidates(logits_NxV, settings)
  if exclude_NxE is not None:
    if ids_NxC is None:  # only the rows' few excluded tokens are written
      V = z_NxC.shape[-1]
      z_NxC = _scatter_last(z_NxC, jnp.where(exclude_NxE >= 0, exclude_NxE, V),
                            jnp.full(exclude_NxE.shape, NEG_INF))
    else:
      gone_NxC = jnp.any(ids_NxC[..., :, None] == exclude_NxE[..., None, :], axis=-1)
      z_NxC = jnp.where(gone_NxC, NEG_INF, z_NxC)
  i_N = draw(u_N, z_NxC)
  if ids_NxC is None:
    return i_N
  return jnp.take_along_axis(ids_NxC, i_N[..., None], axis=-1)[..., 0]


def sample(rng: jax.Array, logits_Nx: jax.Array, settings: SamplingSettings) -> jax.Array:
  """One token per row: argmax when greedy, else a draw from `probs` with one uniform per row."""
  if settings.greedy:
    return argmax(logits_Nx)
  return sample_uniform(jax.random.uniform(rng, logits_Nx.shape[:-1]), logits_Nx, settings)

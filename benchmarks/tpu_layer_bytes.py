"""Where a decoding program's bytes go beyond its floor, one target layer at a time: the layer
and its parts compiled for a TPU chip from this host, each part's bytes accessed (the
compiler's cost analysis) against the weights it must read.

  python benchmarks/tpu_layer_bytes.py [--topology v5p:1x1x1] [--target qwen3-8b] \\
      [--tokens 1,16,76] [--context 1024] [--cache 1296]

T new tokens (1: an AR step; 76: the d2sd cycle's verified tree with the paper's gamma 16 and
K = 4; 16 / 64: the drafters' blocks) over a cache of --cache slots holding --context tokens,
with the decode programs' compiler options (models/xla_options.py). Parts, each in the form a
TPU program takes (`target.layer`: the Pallas kernels where `fused.fits`):
  layer      target.layer: everything below, the output projection and the residual stream
             (an AR step writes its token's K/V; a verified tree or a drafter block only reads
             the cache: the cycle's commit writes the accepted path's K/V)
  attention  the attention half up to the output projection: the attention norm, q/k/v, q/k
             norms, RoPE and attention over the cache prefix (fused.attention: one kernel)
  cache      T rows of K/V written into the cache (target.write_rows, in place): an AR step's
             token, or a cycle's commit of the accepted path
  mlp        the MLP norm, gate/up, SiLU x up, down and the residual add (fused.mlp)
For each: bytes accessed, the weights (and, for attention, the KV of the context) it must read,
and the excess: float32 activations of the T rows, read and written between the parts, and the
attention kernel costed at the whole cache (docs/scale-out.md).
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the host's work runs on its CPU; TPU: compile only

from absl import app, flags  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

from d2sd_jax.kernels import fused  # pylint: disable=wrong-import-position
from d2sd_jax.models import attention as attention_lib  # pylint: disable=wrong-import-position
from d2sd_jax.models import target as M  # pylint: disable=wrong-import-position
from d2sd_jax.perf import compiled as C  # pylint: disable=wrong-import-position
from d2sd_jax.perf import hlo  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string('topology', 'v5p:1x1x1', 'one TPU chip, e.g. v5p:1x1x1, v5e:1x1')
flags.DEFINE_string('target', 'qwen3-8b', 'costmodel.TARGETS name, smollm2, or a HF folder')
flags.DEFINE_string('dtype', 'bfloat16', "the target's weight dtype")
flags.DEFINE_string('tokens', '1,16,76', 'new tokens per program (comma-separated)')
flags.DEFINE_integer('context', 1024, 'cached tokens attended to')
flags.DEFINE_integer('cache', 1296, 'cache slots (the d2sd cycle\'s at context 1024)')


def parts(cfg, T: int, context: int):
  """{part: (fn, args, bytes it must read)} for one layer over T new tokens."""
  f32 = jnp.float32
  lp = jax.eval_shape(lambda: M.init_params(dataclasses.replace(cfg, n_layers=1),
                                            jax.random.PRNGKey(0)))['layers'][0]
  kv = jax.eval_shape(lambda: M.init_cache(dataclasses.replace(cfg, n_layers=1), 1,
                                           FLAGS.cache))[0]
  S = lambda shape, dtype=f32: jax.ShapeDtypeStruct(shape, dtype)
  D, Hkv, hd = cfg.d_model, cfg.n_kv_heads, cfg.head_dim
  x, pos, clen = S((1, T, D)), S((1, T), jnp.int32), S((1,), jnp.int32)
  tree = jnp.tril(jnp.ones((1, T, T), bool))
  nbytes = lambda tree_: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree_))
  kv_read = 2 * Hkv * context * hd * jnp.dtype(cfg.cache_dtype).itemsize
  new_kv = S((1, Hkv, T, hd), kv['k'].dtype)
  pick = lambda *names: {n: lp[n] for n in names if n in lp}

  def layer(lp_, kv_, x_, pos_, clen_):
    return M.layer(cfg, x_, lp_, kv_, pos_, clen_, tree, write_start_B=clen_,
                   new_kv_only=T > 1)

  def attention(w, x_, pos_, kv_, clen_):
    if fused.fits(T, hd, cfg.d_ff, cfg.d_model):
      return fused.attention(x_, w, pos_, kv_, clen_, tree, eps=cfg.norm_eps,
                             rope_base=cfg.rope_base, rope_freq_factors=cfg.rope_freq_factors,
                             out_dtype=lp['wo'].dtype)
    h = M.rms_norm(x_, w['attn_norm'], cfg.norm_eps)
    q, k, v = M.qkv_projection(cfg, w, h, pos_)
    k, v = (a.transpose(0, 2, 1, 3).astype(kv_['k'].dtype) for a in (k, v))
    return attention_lib.attention(q, k, v, kv_, clen_, tree), k, v

  def cache(kv_, k_new, clen_):
    return M.write_rows(kv_['k'], k_new, clen_)

  def mlp(w, x_):
    if fused.fits(T, hd, cfg.d_ff, cfg.d_model):
      return fused.mlp(x_, w, eps=cfg.norm_eps)
    h = M.rms_norm(x_, w['mlp_norm'], cfg.norm_eps)
    gu = M.linear(h, M.as_matrix(w, 'w_gate_up')).reshape(1, T, 2, -1)
    return x_ + M.linear(jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1], w['w_down'])

  attn_w = pick('attn_norm', 'wqkv', 'bqkv', 'q_norm', 'k_norm')
  mlp_w = pick('mlp_norm', 'w_gate_up', 'w_down')
  return {
      'layer': (layer, (lp, kv, x, pos, clen), (1,) if T == 1 else (), nbytes(lp) + kv_read),
      'attention': (attention, (attn_w, x, pos, kv, clen), (), nbytes(attn_w) + kv_read),
      'cache': (cache, (kv, new_kv, clen), (0,), 0),
      'mlp': (mlp, (mlp_w, x), (), nbytes(mlp_w)),
  }


def main(argv):
  del argv
  devices = C.tpu_devices(FLAGS.topology)
  cfg = C.target_config(FLAGS.target, FLAGS.dtype)
  on = jax.sharding.SingleDeviceSharding(devices[0])
  placed = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), tree)
  options = C.xla_options.for_platform('tpu')
  print(f'{FLAGS.target} on {FLAGS.topology}: one layer, {FLAGS.context} cached tokens in '
        f'{FLAGS.cache} slots; MB per program')
  print(f"{'T':>4} {'part':10} {'bytes':>9} {'must read':>10} {'excess':>9}")
  for T in (int(t) for t in FLAGS.tokens.split(',')):
    for name, (fn, args, donate, must) in parts(cfg, T, FLAGS.context).items():
      lowered = jax.jit(fn, donate_argnums=donate).lower(*placed(args))
      cost = hlo.cost_analysis(lowered.compile(options))
      got = float(cost.get('bytes accessed', 0.0))
      print(f'{T:>4} {name:10} {got / 1e6:9.1f} {must / 1e6:10.1f} {(got - must) / 1e6:9.1f}',
            flush=True)


if __name__ == '__main__':
  sys.exit(app.run(main))

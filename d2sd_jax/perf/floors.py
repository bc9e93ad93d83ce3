"""What a decode program must read from memory per device at the least: the yardstick that
benchmarks/tpu_compile.py holds the TPU compiler's bytes accessed against.

The floor of a program (`floors`; perf/compiled.py reports it as `ideal_bytes_per_device`, and
the compiler's bytes accessed over it as `bytes_over_ideal`) is what a memory-bound program must
read per device at the least: the weights it uses, the KV it attends to and the LM-head rows it
projects, each divided by the mesh axes that split it (the sharding rules; a dimension an axis
does not divide is counted whole, as it is stored):
  AR step   target layers + final norm + LM head (V·D: its one row is a matrix-vector product
            over every row of the head) + B embedding rows + the target KV over `context`
            tokens (2 · L · B · Hkv · context · hd · cache itemsize);
  cycle     the AR step's floor with T embedding rows per row instead of 1 (verification), plus,
            per drafter pass of the method (drafting.drafter_passes: dflash one, d2sd two,
            dflash_dflash drafter 1 twice): the drafter's layers, final norm and mask
            embedding, its head (head_rows [n, D], or the target's whole head) and its context KV
            over `context` tokens; plus, per drafter, what the commit reads to write the
            accepted tokens' context: fc, fc_norm and each layer's key/value rows (wkv, k_norm);
  prefill   the target as in the AR step with B·P embedding rows, the whole target cache it
            creates (every slot is written), and per drafter its context weights (fc, fc_norm,
            wkv, k_norm) and its whole context cache;
  loop      one iteration: the step's floor (the compiler costs a while loop's body once);
  train_step  none: training is compute-bound, bytes are not what bounds it.
Activations (a few rows of D per token) are left out: at these shapes they are < 0.1 % of it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import sharding
from d2sd_jax.models import target as model_lib
from d2sd_jax.spec_decode import drafting


def leaf_bytes(x, axes, mesh) -> int:
  """Bytes of one array per device, split as the sharding rules split it."""
  spec = sharding.spec_for(x.shape, axes, mesh)
  split = math.prod(mesh.shape[a] for a in spec if a)
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // split


def tree_bytes(tree, axes_by_name, mesh, keep=lambda name: True) -> int:
  """Bytes per device of the leaves of a parameter tree whose name `keep` accepts."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = [e.key for e in path if isinstance(e, jax.tree_util.DictKey)][-1]
    if keep(name):
      total += leaf_bytes(x, axes_by_name[name], mesh)
  return total


def kv_bytes(layers, batch, kv_heads, tokens, head_dim, dtype, mesh) -> int:
  """K and V of `tokens` slots per device, split as a cache [B, Hkv, S, hd] is best split:
  rows over 'data', KV heads over 'model' (where they divide)."""
  rows = batch // mesh.shape['data'] if batch % mesh.shape['data'] == 0 else batch
  heads = kv_heads // mesh.shape['model'] if kv_heads % mesh.shape['model'] == 0 else kv_heads
  return 2 * layers * rows * heads * tokens * head_dim * jnp.dtype(dtype).itemsize


def floors(program: str, tcfg, dcfgs: dict, spec, mesh, batch: int, context: int,
           cache_size: int | None = None) -> dict:
  """{part: bytes per device} of a program's floor (the module docstring has the rules)."""
  tparams = jax.eval_shape(lambda: model_lib.init_params(tcfg, jax.random.PRNGKey(0)))
  TA = sharding.TARGET_AXES
  head = 'embed' if tcfg.tie_embeddings else 'lm_head'
  itemsize = tcfg.jnp_dtype.itemsize
  rows = {'prefill': context, 'step': spec.tree_size if spec else 1}[program]
  parts = {
      'target weights': tree_bytes(tparams, TA, mesh, lambda n: n not in ('embed', 'lm_head')),
      'target head': tree_bytes({head: tparams[head]}, TA, mesh),
      'embedding rows': batch * rows * tcfg.d_model * itemsize,
  }
  if program == 'prefill':
    parts['target cache'] = kv_bytes(tcfg.n_layers, batch, tcfg.n_kv_heads, cache_size,
                                      tcfg.head_dim, tcfg.cache_dtype, mesh)
  else:
    parts['target KV'] = kv_bytes(tcfg.n_layers, batch, tcfg.n_kv_heads, context,
                                   tcfg.head_dim, tcfg.cache_dtype, mesh)
  if spec is None:
    return parts
  DA = sharding.DRAFTER_AXES
  context_weights = ('fc', 'fc_norm', 'wkv', 'k_norm')  # what writes the drafter's context
  for name in spec.drafters:
    dcfg = getattr(spec, name)
    prepared = jax.eval_shape(
        lambda t, dc=dcfg: drafter_lib.for_decoding(
            drafter_lib.init_params(dc, tcfg, jax.random.PRNGKey(0)), t, tcfg), tparams)
    prepared = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, jnp.dtype(dcfg.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
        prepared)
    lcfg = dcfg.layer_config(1)
    ctx_weights = tree_bytes(prepared, DA, mesh, lambda n: n in context_weights)
    if program == 'prefill':
      parts[f'{name} context weights'] = ctx_weights
      parts[f'{name} context cache'] = kv_bytes(dcfg.n_layers, batch, dcfg.n_kv_heads,
                                                 cache_size, dcfg.head_dim, lcfg.cache_dtype,
                                                 mesh)
      continue
    passes = drafting.drafter_passes(spec).count(name)
    layer_weights = tree_bytes(prepared, DA, mesh, lambda n: n not in context_weights + (
        'head_rows', 'head_ids'))
    head_bytes = (tree_bytes({'head_rows': prepared['head_rows']}, DA, mesh)
                  if 'head_rows' in prepared else parts['target head'])
    kv = kv_bytes(dcfg.n_layers, batch, dcfg.n_kv_heads, context, dcfg.head_dim,
                   lcfg.cache_dtype, mesh)
    parts[f'{name} passes x{passes}: layers'] = passes * layer_weights
    parts[f'{name} passes x{passes}: head'] = passes * head_bytes
    parts[f'{name} passes x{passes}: context KV'] = passes * kv
    parts[f'{name} context write'] = ctx_weights
  return parts

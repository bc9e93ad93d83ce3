"""The decode and training programs compiled for TPU topologies from any host, with what the TPU
compiler says of them: the pod user's pre-flight check (benchmarks/tpu_compile.py).

libtpu (the `aot` extra) hands out compile-only devices for a topology (`tpu_devices`): no TPU
is needed. Every argument is abstract (jax.ShapeDtypeStruct) and carries the sharding that
`d2sd_jax.models.sharding`'s rules give it on a ('data', 'model') mesh over those devices, so
the compiled programs are the ones a pod runs, partitioned as it partitions them, without a
single weight. What runs is compiled as the decode runners compile it:
  prefill  ar.prefill (AR) or speculative.init_state: the prompt block into fresh caches;
  step     one AR step (ar.decode_step) or one speculative cycle (speculative.spec_step), its
           state donated as inside the decode loop, on the state the prefill hands over
           (the shardings the compiler chose for the prefill's outputs);
  loop     the whole decode `lax.while_loop` (ar.decode_loop, speculative.spec_loop), donated;
  train_step  train.py's jitted step (training.make_train_step) on a drafter config.
The speculative programs take the bundle as speculative.prepare makes it (drafter.for_decoding).

Each compiled program reports (`figures`), per device: the compiler's flops and bytes accessed
(cost_analysis; on TPU they count every memory space, VMEM prefetches included), its memory
(memory_analysis: arguments, temporaries, outputs), the collectives in its HLO (count, bytes,
and whether any gathers a weight), and a time estimate: the compiler's own `optimal_seconds`
on one chip; on several it comes back negative, so there the roofline
max(flops / peak, bytes / HBM bandwidth) + collective bytes / ICI bandwidth from the chip's
vendor figures (`TPU_CHIPS`).

The floor (`floors`, `ideal_bytes_per_device`) is what a memory-bound program must read per
device at the least: the weights it uses, the KV it attends to and the LM-head rows it
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

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax import files
from d2sd_jax.formats import loaders
from d2sd_jax.formats import drafters as drafter_formats
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import sharding
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import xla_options
from d2sd_jax.perf import costmodel
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class TpuChip:
  """Vendor figures of one TPU chip (Google Cloud's TPU pages)."""
  name: str
  hbm_bytes: int
  peak_flops: float  # dense bf16 FLOP/s
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float  # bytes/s per chip, all links together
  costmodel_chip: str | None = None  # its entry in costmodel.CHIPS


TPU_CHIPS = {  # by jax's device_kind
    'TPU v4': TpuChip('TPU v4', 32 * GiB, 275e12, 1.2e12, 2400e9 / 8),
    'TPU v5 lite': TpuChip('TPU v5e', 16 * GiB, 197e12, 819e9, 1600e9 / 8, 'tpu-v5e'),
    'TPU v5': TpuChip('TPU v5p', 95 * GiB, 459e12, 2.765e12, 4800e9 / 8, 'tpu-v5p'),
    'TPU v6 lite': TpuChip('TPU v6e', 32 * GiB, 918e12, 1.64e12, 3584e9 / 8),
}

PAPER_TAU = {'dflash': 5.31, 'd2sd': 7.05}  # D2SD paper, Qwen3-8B, mean of 8 benchmarks, T = 0
PAPER_GAMMA = 16  # the block of the drafters PAPER_TAU was measured with
PAPER_SPEEDUP_H200 = {'dflash': 4.16, 'd2sd': 4.98}  # the same runs' speed-ups on an H200


def tpu_devices(topology: str):
  """Compile-only devices of a TPU topology ('v5e:2x4', 'v5p:1x1x1', ...). A topology smaller
  than libtpu's default host (2x2x1 chips in the builds jax 0.10 declares) is laid out as one
  host of that size (`chips_per_host_bounds`), as a single-chip VM is."""
  if importlib.util.find_spec('libtpu') is None:
    raise RuntimeError("compiling for a TPU topology needs libtpu: pip install -e '.[aot]' "
                       "(the libtpu that the installed jax's `tpu` extra declares)")
  # libtpu takes a lock (/tmp/libtpu_lockfile) so that one process owns a host's TPU; these
  # devices are compile-only, and several processes (test workers) may compile at once.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    return topologies.get_topology_desc(platform='tpu', topology_name=topology).devices
  except Exception as e:  # libtpu's own message
    error = e
  bounds = _host_bounds(topology)
  if bounds is not None and 'chips_per_host_bounds' in str(error):
    try:
      return topologies.get_topology_desc(platform='tpu', topology_name=topology,
                                          chips_per_host_bounds=bounds).devices
    except Exception as e:  # pylint: disable=broad-except
      error = e
  raise ValueError(f'topology {topology!r}: {error}. Give one such as v5e:2x4, v5p:1x1x1, '
                   'v4:2x2x1 or v6e:2x2') from error


def _host_bounds(topology: str):
  """(x, y, z) chips of a topology name 'kind:XxY[xZ]' (one host holding all of it), or None
  when the name has no such shape."""
  match = re.fullmatch(r'[\w.]+:(\d+)x(\d+)(?:x(\d+))?', topology)
  if match is None:
    return None
  return tuple(int(d) if d else 1 for d in match.groups())


def toolchain() -> dict:
  """The versions a compiled figure depends on: {'jax', 'jaxlib', 'libtpu'} (None where not
  installed). Two libtpu builds compile the same HLO differently; every kept figure names its."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  out = {}
  for name in ('jax', 'jaxlib', 'libtpu'):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def chip_of(devices) -> TpuChip:
  kind = devices[0].device_kind
  if kind not in TPU_CHIPS:
    raise ValueError(f'no figures for device kind {kind!r}: add it to compiled.TPU_CHIPS')
  return TPU_CHIPS[kind]


def target_config(source: str, dtype: str = 'bfloat16') -> model_lib.ModelConfig:
  """A costmodel.TARGETS name, 'smollm2' (its GGUF's metadata) or a Hugging Face folder (its
  config.json): the target's shapes, no weights."""
  if source in costmodel.TARGETS:
    return dataclasses.replace(costmodel.TARGETS[source], dtype=dtype)
  if source == 'smollm2':
    return loaders.gguf_config(loaders.smollm2_gguf_path(), dtype)
  config_file = os.path.join(source, 'config.json')
  if not os.path.exists(config_file):
    raise FileNotFoundError(f'target {source!r}: give one of {sorted(costmodel.TARGETS)}, '
                            'smollm2 or a Hugging Face folder with config.json')
  with open(config_file) as f:
    return loaders.hf_model_config(json.load(f), dtype)


def drafter_configs(spec: str, tcfg: model_lib.ModelConfig) -> dict:
  """{'drafter1': DrafterConfig, 'drafter2': ...}: 'paper' (costmodel.paper_drafter for both,
  in the target's dtype) or 'FOLDER1[,FOLDER2]' (drafter folders, their configs only)."""
  if spec == 'paper':
    d = costmodel.paper_drafter(tcfg)
    return {'drafter1': d, 'drafter2': d}
  out = {}
  for name, path in zip(('drafter1', 'drafter2'), spec.split(',')):
    dcfg = drafter_formats.drafter_config(path)
    dcfg.check_target(tcfg)
    out[name] = dataclasses.replace(dcfg, dtype=tcfg.dtype)
  return out


# ----------------------------------------------------------------------------------------------
# Abstract arguments on a mesh


def _placed(abstract, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def target_params(tcfg: model_lib.ModelConfig, mesh):
  abstract = jax.eval_shape(lambda: model_lib.init_params(tcfg, jax.random.PRNGKey(0)))
  return _placed(abstract, sharding.target_shardings(mesh, abstract))


def drafter_params(dcfg: drafter_lib.DrafterConfig, tcfg: model_lib.ModelConfig, mesh,
                   dtype: str | None = None):
  """Abstract drafter parameters, floats in `dtype` (default: dcfg's)."""
  dt = jnp.dtype(dtype or dcfg.dtype)
  abstract = jax.eval_shape(lambda: drafter_lib.init_params(dcfg, tcfg, jax.random.PRNGKey(0)))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, dt if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), abstract)
  return _placed(abstract, sharding.drafter_shardings(mesh, abstract))


def decoding_bundle(tcfg, dcfgs: dict, names, mesh) -> dict:
  """{'target', and the drafters `names`} as speculative.prepare makes it, on the rules'
  shardings (drafter.for_decoding's wkv and head_rows included)."""
  bundle = {'target': target_params(tcfg, mesh)}
  for name in names:
    bundle[name] = drafter_params(dcfgs[name], tcfg, mesh)
  prepared = jax.eval_shape(lambda b: SP.prepare(b, tcfg), bundle)
  out = {'target': bundle['target']}
  for name in names:
    out[name] = _placed(prepared[name], sharding.drafter_shardings(mesh, prepared[name]))
  return out


def _batch_args(mesh, batch: int, prompt_len: int):
  rows = sharding.batch_sharding(mesh, 2) if batch % mesh.shape['data'] == 0 else None
  rows1 = sharding.batch_sharding(mesh, 1) if rows is not None else None
  rep = sharding.replicated(mesh)
  return (jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=rows or rep),
          jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows1 or rep),
          jax.ShapeDtypeStruct((batch, 2), jnp.uint32, sharding=rows or rep))


# ----------------------------------------------------------------------------------------------
# Programs


@dataclasses.dataclass
class Program:
  """One program to compile: jax.jit(fn, static_argnums, donate_argnums).lower(*args)."""
  name: str  # prefill, step, loop, train_step
  method: str  # ar, pld, dflash, d2sd, ... (train_step: the drafter kind)
  fn: Callable | None
  args: tuple  # every argument, in order (static ones as values, the rest abstract)
  static: tuple = ()  # positions of the static arguments
  donate: tuple = ()  # positions of the donated arguments
  floor: dict | None = None  # {part: bytes per device} (`floors`)
  jitted: Any = None  # an already jitted function (train.py's step), lowered as it is

  def mesh(self):
    """The mesh the arguments are placed on (None: unplaced)."""
    for leaf in jax.tree.leaves(self.args):
      placed = getattr(leaf, 'sharding', None)
      if isinstance(placed, jax.sharding.NamedSharding):
        return placed.mesh
    return None

  def lower(self):
    with sharding.tracing_under(self.mesh()):
      if self.jitted is not None:
        return self.jitted.lower(*self.args)
      return jax.jit(self.fn, static_argnums=self.static, donate_argnums=self.donate).lower(
          *self.args)

  def abstract_output(self):
    static = {i: a for i, a in enumerate(self.args) if i in self.static}
    dynamic = [a for i, a in enumerate(self.args) if i not in self.static]

    def call(*dyn):
      it = iter(dyn)
      return self.fn(*(static[i] if i in static else next(it) for i in range(len(self.args))))
    return jax.eval_shape(call, *dynamic)


def generation_settings(max_new_tokens: int) -> ar.GenerationSettings:
  # (an EOS id, so the loop's exit test is the real one; greedy, as the paper's T = 0)
  return ar.GenerationSettings(max_new_tokens=max_new_tokens, eos_ids=(2,), pad_id=0)


TREE_BUDGET = 16  # nodes per cycle of the budgeted trees (ddtree, d2sd_tree), as reproduce.py


def method_of(label: str) -> tuple[str, int]:
  """A program's method label: 'd2sd_tree' (its budget TREE_BUDGET) or 'd2sd_tree:32' (a
  budgeted tree at 32 nodes) -> (method, tree budget). A ValueError names what is wrong."""
  method, _, budget = label.partition(':')
  if method not in drafting.REGISTRY and method != 'ar':
    raise ValueError(f'method {method!r}: choose ar or one of {sorted(drafting.REGISTRY)}')
  if not budget:
    return method, TREE_BUDGET
  if not drafting.get(method).budgeted or not budget.isdigit() or int(budget) < 2:
    raise ValueError(f'{label!r}: only a budgeted tree ({", ".join(budgeted_methods())}) takes '
                     'a node budget, written METHOD:NODES (e.g. d2sd_tree:32)')
  return method, int(budget)


def budgeted_methods() -> list[str]:
  return sorted(m for m, meth in drafting.REGISTRY.items() if meth.budgeted)


def spec_settings(method: str, gen, dcfgs: dict, gamma: int = 16, n_branches: int = 4,
                  tree_budget: int = TREE_BUDGET):
  """The method's settings: the drafters' gamma (prompt lookup too, when there are drafters),
  K = n_branches, and for the budgeted trees `tree_budget` nodes (at least gamma)."""
  fields = {name: dcfgs[name] for name in drafting.get(method).drafters}
  gamma = next(iter(dcfgs.values())).gamma if dcfgs else gamma
  budget = max(tree_budget, gamma) if drafting.get(method).budgeted else 0
  return SP.SpecSettings(gen, method=method, gamma=gamma,
                         n_branches=min(n_branches, gamma - 1), tree_budget=budget, **fields)


def decode_programs(tcfg, dcfgs: dict, methods, mesh, batch: int = 1, context: int = 1024,
                    max_new_tokens: int = 256, loops: bool = True, log=print):
  """[Program] for each method: its prefill, step and (with `loops`) loop. The step and loop
  get their state from the prefill when `compile_all` compiles them, in this order."""
  gen = generation_settings(max_new_tokens)
  out = []
  for label in methods:
    method, budget = method_of(label)
    block, lens, keys = _batch_args(mesh, batch, context)
    if method == 'ar':
      params, settings, spec = target_params(tcfg, mesh), gen, None
      prefill, step, loop = ar.prefill, ar.decode_step, ar.decode_loop
      cache_size = -(-(context + max_new_tokens) // 64) * 64  # as decode.runner sizes it
    else:
      spec = spec_settings(method, gen, dcfgs, tree_budget=budget)
      params, settings = decoding_bundle(tcfg, dcfgs, spec.drafters, mesh), spec
      prefill, step, loop = SP.init_state, SP.spec_step, SP.spec_loop
      cache_size = SP.cache_size_needed(context, spec)
    out.append(Program('prefill', label, prefill,
                       (params, tcfg, settings, block, lens, keys, cache_size), (1, 2, 6),
                       floor=floors('prefill', tcfg, dcfgs, spec, mesh, batch, context,
                                    cache_size)))
    step_floor = floors('step', tcfg, dcfgs, spec, mesh, batch, context)
    for name, fn in (('step', step), ('loop', loop))[:2 if loops else 1]:
      # (the state, argument 3, comes from the prefill: `compile_all`)
      out.append(Program(name, label, fn, (params, tcfg, settings, None), (1, 2), (3,),
                         floor=step_floor))
  return out


def train_program(config, tcfg, mesh, train_lib) -> Program:
  """train.py's step for `config` (its drafter, batch, sequence length and memory levers) with
  the target in config.dtype, the float32 drafter and its Adam state on the rules' shardings,
  the batch split over 'data'. `train_lib`: d2sd_jax.train.training (passed in: perf/ does not
  import train/)."""
  dcfg = train_lib.drafter_config(config, tcfg)
  dcfg.check_target(tcfg)
  opt = train_lib.optimizer(config)
  step, _ = train_lib.make_train_step(config, tcfg, dcfg, opt)
  tparams = target_params(tcfg, mesh)
  dparams = drafter_params(dcfg, tcfg, mesh, 'float32')
  trainable, _ = drafter_lib.split_fixed(dparams)
  opt_abstract = jax.eval_shape(opt.init, trainable)
  opt_state = _placed(opt_abstract, _like_params(opt_abstract, trainable, mesh))
  B, L = config.train.batch_size, config.data.seq_len
  sharding.check_batch(mesh, B)
  rows = sharding.batch_sharding(mesh, 2)
  tokens = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=rows)
  labels = jax.ShapeDtypeStruct((B, L), jnp.bool_, sharding=rows)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
  feats = None
  if config.train.get('precompute_features'):
    F = len(dcfg.feature_layers) * tcfg.d_model
    feats = jax.ShapeDtypeStruct((B, L, F), jnp.float16, sharding=sharding.batch_sharding(mesh, 3))
  return Program('train_step', config.kind, None, (dparams, opt_state, tparams, tokens, labels,
                                                   key, feats), jitted=step)


def _like_params(opt_state, params, mesh):
  """Shardings for an optax state: each moment on its parameter's sharding (the parameter
  whose key path ends the leaf's), counts and other scalars replicated. (Adam's init reads no
  parameter value, so compiling it tells nothing of where its outputs go.)"""
  by_path = {tuple(path): x.sharding
             for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  rep = sharding.replicated(mesh)

  def leaf(path, x):
    path = tuple(path)
    for n in range(len(path)):
      if path[n:] in by_path and x.ndim:
        return by_path[path[n:]]
    return rep
  return jax.tree_util.tree_map_with_path(leaf, opt_state)


# ----------------------------------------------------------------------------------------------
# Floors


def _leaf_bytes(x, axes, mesh) -> int:
  spec = sharding.spec_for(x.shape, axes, mesh)
  split = math.prod(mesh.shape[a] for a in spec if a)
  return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize // split


def _tree_bytes(tree, axes_by_name, mesh, keep=lambda name: True) -> int:
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = [e.key for e in path if isinstance(e, jax.tree_util.DictKey)][-1]
    if keep(name):
      total += _leaf_bytes(x, axes_by_name[name], mesh)
  return total


def _kv_bytes(layers, batch, kv_heads, tokens, head_dim, dtype, mesh) -> int:
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
      'target weights': _tree_bytes(tparams, TA, mesh, lambda n: n not in ('embed', 'lm_head')),
      'target head': _tree_bytes({head: tparams[head]}, TA, mesh),
      'embedding rows': batch * rows * tcfg.d_model * itemsize,
  }
  if program == 'prefill':
    parts['target cache'] = _kv_bytes(tcfg.n_layers, batch, tcfg.n_kv_heads, cache_size,
                                      tcfg.head_dim, tcfg.cache_dtype, mesh)
  else:
    parts['target KV'] = _kv_bytes(tcfg.n_layers, batch, tcfg.n_kv_heads, context,
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
    ctx_weights = _tree_bytes(prepared, DA, mesh, lambda n: n in context_weights)
    if program == 'prefill':
      parts[f'{name} context weights'] = ctx_weights
      parts[f'{name} context cache'] = _kv_bytes(dcfg.n_layers, batch, dcfg.n_kv_heads,
                                                 cache_size, dcfg.head_dim, lcfg.cache_dtype,
                                                 mesh)
      continue
    passes = drafting.drafter_passes(spec).count(name)
    layer_weights = _tree_bytes(prepared, DA, mesh, lambda n: n not in context_weights + (
        'head_rows', 'head_ids'))
    head_bytes = (_tree_bytes({'head_rows': prepared['head_rows']}, DA, mesh)
                  if 'head_rows' in prepared else parts['target head'])
    kv = _kv_bytes(dcfg.n_layers, batch, dcfg.n_kv_heads, context, dcfg.head_dim,
                   lcfg.cache_dtype, mesh)
    parts[f'{name} passes x{passes}: layers'] = passes * layer_weights
    parts[f'{name} passes x{passes}: head'] = passes * head_bytes
    parts[f'{name} passes x{passes}: context KV'] = passes * kv
    parts[f'{name} context write'] = ctx_weights
  return parts


# ----------------------------------------------------------------------------------------------
# What the compiler says


_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2, 'u16': 2, 'f32': 4,
                's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$')


def _type_bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(',') if d) * _DTYPE_BYTES[dt]
             for dt, dims in _SHAPE.findall(text))


_LAYOUT_OPS = ('bitcast', 'copy', 'convert', 'reshape', 'transpose', 'copy-start', 'copy-done',
               'slice', 'dynamic-slice', 'get-tuple-element', 'parameter', 'constant', 'tuple')


def collectives(hlo: str) -> dict:
  """The collectives of a compiled (partitioned) HLO module: {'count', 'bytes', 'by_kind':
  {kind: {'count', 'bytes'}}, 'weight_gathers': [all-gathers / all-to-alls whose operand is a
  weight parameter, through layout ops and fusions of layout ops only: a weight moved, not an
  activation computed from it]}. Bytes are each collective's result (an async '-start' counted
  once)."""
  defs = {}  # instruction name -> (opcode, operand names, fused computation)
  params = {}
  fused_ops = {}  # computation name -> opcodes in it
  ops = []
  computation = None
  for line in hlo.split('\n'):
    head = re.match(r'^(?:ENTRY )?%([\w.\-]+) \(.*\{$', line)
    if head:
      computation = head.group(1)
      fused_ops[computation] = set()
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, type_text, opcode, rest = m.groups()
    if computation is not None:
      fused_ops[computation].add(opcode)
    operands = re.findall(r'%([\w.\-]+)', rest.split('),')[0])
    calls = re.search(r'calls=%([\w.\-]+)', rest)
    defs[name] = (opcode, operands, calls.group(1) if calls else None)
    if opcode == 'parameter':
      params[name] = line
    kind = opcode[:-len('-start')] if opcode.endswith('-start') else opcode
    if kind in COLLECTIVES:
      # an async start's type is (operands..., results...): count the results' half
      nbytes = _type_bytes(type_text)
      if opcode.endswith('-start') and type_text.startswith('('):
        nbytes //= 2
      ops.append((kind, name, nbytes))

  def reaches_weight(name, depth=0):
    if name in params:
      return re.search(r'op_name="params', params[name]) is not None
    opcode, operands, called = defs.get(name, ('', [], None))
    if depth > 8:
      return False
    if opcode == 'fusion':
      if not fused_ops.get(called, {'?'}) <= set(_LAYOUT_OPS):
        return False
    elif opcode not in _LAYOUT_OPS:
      return False
    return any(reaches_weight(o, depth + 1) for o in operands)

  by_kind = {}
  gathers = []
  for kind, name, nbytes in ops:
    entry = by_kind.setdefault(kind, {'count': 0, 'bytes': 0})
    entry['count'] += 1
    entry['bytes'] += nbytes
    if kind in ('all-gather', 'all-to-all') and any(reaches_weight(o) for o in defs[name][1]):
      gathers.append(name)
  return {'count': len(ops), 'bytes': sum(b for _, _, b in ops), 'by_kind': by_kind,
          'weight_gathers': gathers}


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return dict(cost or {})


def figures(compiled, chip: TpuChip, n_devices: int) -> dict:
  """Per-device figures of a compiled program (module docstring)."""
  cost = _cost(compiled)
  mem = compiled.memory_analysis()
  coll = collectives(compiled.as_text())
  flops = float(cost.get('flops', 0.0))
  nbytes = float(cost.get('bytes accessed', 0.0))
  optimal = float(cost.get('optimal_seconds', -1.0))
  roofline = max(flops / chip.peak_flops, nbytes / chip.hbm_bandwidth) + (
      coll['bytes'] / chip.ici_bandwidth)
  use_compiler = n_devices == 1 and optimal > 0
  memory = {'arguments': int(mem.argument_size_in_bytes),
            'temporaries': int(mem.temp_size_in_bytes),
            'outputs': int(mem.output_size_in_bytes),
            'aliased': int(mem.alias_size_in_bytes)}
  total = memory['arguments'] + memory['temporaries'] + memory['outputs']
  return {
      'flops_per_device': flops, 'bytes_per_device': nbytes,
      'memory': memory, 'memory_bytes_per_device': total,
      'fits': total <= chip.hbm_bytes, 'hbm_bytes': chip.hbm_bytes,
      'collectives': coll,
      'optimal_seconds': optimal if optimal > 0 else None,
      'roofline_s': roofline,
      'estimate_s': optimal if use_compiler else roofline,
      'estimate_source': 'compiler' if use_compiler else 'roofline',
  }


def compile_program(p: Program, chip: TpuChip, n_devices: int, xla: dict | None = None):
  """(JSON-ready figures, the compiled object) of one program, compiled with the compiler
  options of its devices' platform (models/xla_options.py) updated by `xla`."""
  options = {**xla_options.for_arrays(p.args), **(xla or {})}
  t = time.perf_counter()
  lowered = p.lower()
  compiled = lowered.compile(options)
  row = {'name': p.name, 'method': p.method, 'compiled': True,
         'compile_s': round(time.perf_counter() - t, 2), 'xla_options': options,
         # model.linear's CPU-only column form is these programs' only optimization barrier
         # (counted before compiling: the TPU compiler removes barriers from its output)
         'cpu_only_forms': lowered.as_text().count('optimization_barrier'),
         **figures(compiled, chip, n_devices)}
  if p.floor is not None:
    row['ideal_bytes_per_device'] = sum(p.floor.values())
    row['ideal_parts'] = p.floor
    row['bytes_over_ideal'] = row['bytes_per_device'] / row['ideal_bytes_per_device']
  return row, compiled


def compile_all(programs: list[Program], chip: TpuChip, n_devices: int, log=print,
                xla: dict | None = None) -> list[dict]:
  """Compiles each program in order (`compile_program`); a step or loop takes the state its
  method's prefill hands over (the prefill's output shardings). Returns one JSON-ready dict
  per program."""
  out = []
  state = {}
  for p in programs:
    if p.name in ('step', 'loop'):
      if p.method not in state:
        out.append({'name': p.name, 'method': p.method, 'compiled': False,
                    'error': 'its prefill did not compile'})
        continue
      p.args = p.args[:3] + (state[p.method],)
    try:
      row, compiled = compile_program(p, chip, n_devices, xla)
    except Exception as e:  # pylint: disable=broad-except
      msg = str(e).split('\n')[0][:400]
      log(f'  {p.method} {p.name}: did not compile: {msg}')
      out.append({'name': p.name, 'method': p.method, 'compiled': False, 'error': msg})
      continue
    if p.name == 'prefill':
      state[p.method] = _placed(p.abstract_output(), compiled.output_shardings)
    out.append(row)
    log(f"  {p.method} {p.name}: compiled in {row['compile_s']:.1f} s")
  return out


def weights_bytes_per_device(tcfg, dcfgs: dict, methods, mesh) -> int:
  """The target and every drafter the methods use, as decoding holds them (prepared)."""
  names = sorted({n for m in methods if m != 'ar' for n in drafting.get(method_of(m)[0]).drafters})
  bundle = decoding_bundle(tcfg, dcfgs, names, mesh)
  total = _tree_bytes(bundle['target'], sharding.TARGET_AXES, mesh)
  for name in names:
    total += _tree_bytes(bundle[name], sharding.DRAFTER_AXES, mesh)
  return total


def speedups(programs: list[dict], tau: dict) -> dict:
  """{method: predicted speed-up over AR} = tau x AR step / cycle, from the estimates."""
  est = {(p['method'], p['name']): p.get('estimate_s') for p in programs if p.get('compiled')}
  ar_s = est.get(('ar', 'step'))
  out = {}
  for method, t in tau.items():
    cycle = est.get((method, 'step'))
    if ar_s and cycle:
      out[method] = {'tau': t, 'cycle_over_ar': cycle / ar_s, 'speedup': t * ar_s / cycle,
                     'paper_h200': PAPER_SPEEDUP_H200.get(method)}
  return out


def paper_speedups(programs: list[dict], dcfgs: dict) -> tuple[dict, str]:
  """(`speedups` at the paper's tau, '') for drafters of the paper's gamma; ({}, why not) for
  others: the paper's tau says nothing of a drafter with another block."""
  gammas = sorted({d.gamma for d in dcfgs.values()})
  if gammas in ([], [PAPER_GAMMA]):
    return speedups(programs, PAPER_TAU), ''
  return {}, (f"no speed-up quoted: the paper's tau is for gamma={PAPER_GAMMA} drafters, these "
              f"have gamma={','.join(map(str, gammas))}")


def mesh_of(devices, spec: str):
  """'data=D,model=M' (either may be left out: 1, or -1 to take the remaining devices)."""
  sizes = {'data': -1, 'model': 1}
  for part in filter(None, spec.split(',')):
    key, _, value = part.partition('=')
    if key not in sizes or not value.lstrip('-').isdigit():
      raise ValueError(f'--mesh {spec!r}: write data=D,model=M (e.g. data=1,model=8)')
    sizes[key] = int(value)
  return sharding.make_mesh(sizes['data'], sizes['model'], devices)


def record_key(result: dict) -> str:
  """What a kept result is looked up by: chip, target, drafters, mesh, batch and context."""
  mesh = 'x'.join(str(result['mesh'][a]) for a in ('data', 'model'))
  return (f"{result['chip']}|{result['target']}|{result['drafters']}|mesh={mesh}|"
          f"batch={result['batch']}|context={result['context']}")


def record(path: str, result: dict) -> None:
  """Keeps `result` in the JSON file at `path` under `record_key` (other entries stay)."""
  kept = {}
  if os.path.exists(path):
    with open(path) as f:
      kept = json.load(f)
  kept[record_key(result)] = result
  files.write_json(path, kept)


def recorded(path: str, chip: str, target: str, drafters: str = 'paper', batch: int = 1,
             context: int = 1024) -> dict | None:
  """The kept result (`record`) for `chip` (a TpuChip name, e.g. 'TPU v5p'), target, drafters,
  batch and context on the fewest devices, or None. `costmodel predict` takes TPU cycle costs
  from it."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    kept = json.load(f)
  fits = [r for r in kept.values() if (r['chip'], r['target'], r['drafters'], r['batch'],
                                       r['context']) == (chip, target, drafters, batch, context)]
  return min(fits, key=lambda r: r['mesh']['data'] * r['mesh']['model'], default=None)


def step_estimates(result: dict) -> dict:
  """{method: estimated seconds of its step (AR step or cycle)} of a result."""
  return {p['method']: p['estimate_s'] for p in result['programs']
          if p.get('compiled') and p['name'] == 'step'}


def breakeven(kept: dict, chip: str, target: str, drafters: str = 'paper', mesh: str = '1x1',
              context: int = 1024) -> dict:
  """{batch: {method: its cycle in AR steps}} of every kept result (`record`) for this chip,
  target, drafters, mesh ('DATAxMODEL') and context. A cycle of c AR steps commits τ tokens per
  row where AR commits c: the method beats AR exactly where its τ exceeds c, at that batch.
  As the batch grows, the AR step stays bound by the weights while a cycle's verification
  reads more per row, so c rises and speculation stops paying where τ falls below it."""
  out = {}
  for result in kept.values():
    shape = f"{result['mesh']['data']}x{result['mesh']['model']}"
    if (result['chip'], result['target'], result['drafters'], shape, result['context']) != (
        chip, target, drafters, mesh, context):
      continue
    est = step_estimates(result)
    if 'ar' in est:
      out[result['batch']] = {m: s / est['ar'] for m, s in est.items() if m != 'ar'}
  return dict(sorted(out.items()))

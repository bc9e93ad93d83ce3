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

Each compiled program reports, per device, what the compiler says of it (`perf/hlo.py`'s
`figures`: flops, bytes accessed, memory, collectives and a time estimate) beside its floor,
what a memory-bound program must read per device at the least (`perf/floors.py`). Results are
kept by `perf/tpu_records.py`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from d2sd_jax.formats import loaders
from d2sd_jax.formats import drafters as drafter_formats
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import sharding
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import xla_options
from d2sd_jax.perf import costmodel
from d2sd_jax.perf import floors as floors_lib
from d2sd_jax.perf import hlo
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
                       floor=floors_lib.floors('prefill', tcfg, dcfgs, spec, mesh, batch,
                                               context, cache_size)))
    step_floor = floors_lib.floors('step', tcfg, dcfgs, spec, mesh, batch, context)
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
         **hlo.figures(compiled, chip, n_devices)}
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
  total = floors_lib.tree_bytes(bundle['target'], sharding.TARGET_AXES, mesh)
  for name in names:
    total += floors_lib.tree_bytes(bundle[name], sharding.DRAFTER_AXES, mesh)
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

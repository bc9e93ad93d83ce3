"""Orbax checkpoints of drafters, tied to the target they were trained for.

A checkpoint step holds items `params` (and, during training, `opt_state`) plus JSON `meta`:
the drafter config, the target's architecture and a fingerprint of its weights. Loading a
drafter for another target is refused with a message naming both. `export_drafter` writes the
drafter-only form that ships (parameters in bfloat16, no optimizer state).
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from d2sd_jax import files
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sharding as sharding_lib


def target_fingerprint(target: loaders.Target) -> str:
  """Architecture + a hash of some weights (`loaders.fingerprint`): a checkpoint for another
  target is refused. Loaded targets carry the one of their stored weights (the same in float32
  and bfloat16); a target built in memory gets the one of its parameters."""
  if target.fingerprint is not None:
    return target.fingerprint
  return params_fingerprint(target.cfg, target.params)


def params_fingerprint(cfg: model_lib.ModelConfig, params) -> str:
  """`loaders.fingerprint` of parameters as they are (in their dtype)."""
  return loaders.fingerprint(cfg, params['embed'], params['final_norm'],
                             params['layers'][-1]['w_down'])


def checkpoint_metadata(kind: str, target_name: str, target, dcfg) -> dict:
  return {'kind': kind, 'drafter': dataclasses.asdict(dcfg), 'target': target_name,
          'target_arch': loaders.architecture(target.cfg), 'target_fingerprint': target_fingerprint(target)}


def check_metadata(meta: dict, target, path: str) -> None:
  if meta.get('target_fingerprint') != target_fingerprint(target):
    raise ValueError(
        f'checkpoint {path} was trained for target {meta.get("target")!r} '
        f'(fingerprint {meta.get("target_fingerprint")}, architecture {meta.get("target_arch")}), '
        f'not for this one (fingerprint {target_fingerprint(target)}): use a drafter trained for '
        'this target, or train one with train.py')


def restore(mngr, step: int, target, abstract: dict) -> dict:
  """Items of checkpoint `step` (e.g. {'params': ..., 'opt_state': ...} as abstract trees),
  after checking from its metadata that it was made for this target."""
  path = os.path.join(mngr.directory, str(step))
  try:
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  except Exception as e:
    raise ValueError(f'checkpoint {path} is unreadable ({type(e).__name__}: {e}); move it away '
                     'to use the previous checkpoint, or start a new workdir') from e
  check_metadata(meta, target, path)
  try:
    items = mngr.restore(step, args=ocp.args.Composite(
        **{name: ocp.args.StandardRestore(tree) for name, tree in abstract.items()}))
  except Exception as e:
    raise ValueError(f'checkpoint {path} is corrupt or incomplete ({type(e).__name__}: {e}); '
                     'move it away to use the previous checkpoint') from e
  return {name: items[name] for name in abstract}


def manager(directory: str, keep: int | None = None, create: bool = True):
  directory = os.path.abspath(directory)  # Orbax wants absolute paths
  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=create))


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve_path(path: str) -> str:
  """A relative path that is not found from the working directory is looked up from the
  repository root (so the shipped drafters/ load from anywhere, notebooks included)."""
  if os.path.isabs(path) or os.path.exists(path):
    return path
  candidate = os.path.join(REPO_ROOT, path)
  return candidate if os.path.exists(candidate) else path


def _latest(path: str):
  """(manager, latest step, metadata, DrafterConfig) of a drafter folder; no weights read."""
  path = os.path.abspath(resolve_path(path))  # Orbax wants absolute paths
  directory = os.path.join(path, 'checkpoints') if os.path.isdir(
      os.path.join(path, 'checkpoints')) else path
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'drafter checkpoint {path!r} not found: give a train.py workdir or '
                            'an exported drafter folder')
  mngr = manager(directory, create=False)
  step = mngr.latest_step()
  if step is None:
    raise FileNotFoundError(f'no checkpoint in {directory}: train one with train.py')
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
  d = dict(meta['drafter'])
  d['feature_layers'] = tuple(d['feature_layers'])
  d['confidence_temperature'] = meta.get('confidence_temperature', d.get('confidence_temperature',
                                                                          1.0))
  d['node_calibration'] = read_node_calibration(path) or as_curves(d.get('node_calibration', ()))
  return mngr, step, meta, drafter_lib.DrafterConfig(**d)


# The best-first trees' reliability curves of a drafter folder (DrafterConfig.node_calibration),
# beside its checkpoints: written by scripts/calibrate_nodes.py, read with the drafter.
CALIBRATION_FILE = 'node_calibration.json'


def as_curves(table) -> tuple:
  """DrafterConfig.node_calibration from JSON's lists ({proposer: [[estimates, rates], ...]} or
  [[proposer, curves], ...]), checked: estimates increasing in (0, 1], rates in [0, 1]."""
  items = table.items() if isinstance(table, dict) else table
  out = []
  for source, curves in items:
    groups = []
    for xs, ys in curves:
      xs, ys = tuple(float(x) for x in xs), tuple(float(y) for y in ys)
      if (len(xs) != len(ys) or not xs or any(b <= a for a, b in zip(xs, xs[1:])) or
          not 0 < xs[0] <= xs[-1] <= 1 or any(not 0 <= y <= 1 for y in ys)):
        raise ValueError(f'node calibration of {source!r}: a curve needs increasing estimates in '
                         f'(0, 1] and rates in [0, 1] of the same length, not {xs} / {ys}: '
                         'refit it with scripts/calibrate_nodes.py')
      groups.append((xs, ys))
    out.append((str(source), tuple(groups)))
  return tuple(out)


def read_node_calibration(path: str) -> tuple:
  """The curves in a drafter folder's CALIBRATION_FILE (() when it has none)."""
  file = os.path.join(path, CALIBRATION_FILE)
  if not os.path.exists(file):
    return ()
  try:
    with open(file) as f:
      return as_curves(json.load(f)['curves'])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{file} is damaged ({e}): delete it to decode with raw scores, or refit it '
                     'with scripts/calibrate_nodes.py') from e


def write_node_calibration(path: str, curves: dict, about: dict) -> str:
  """Writes {proposer: curves} (as_curves checks them) with `about` (command, date, prompts)
  into the drafter folder, atomically; returns the file."""
  as_curves(curves)
  file = os.path.join(resolve_path(path), CALIBRATION_FILE)
  files.write_json(file, {**about, 'curves': curves})
  return file


def read_drafter_config(path: str) -> tuple[drafter_lib.DrafterConfig, dict]:
  """(DrafterConfig, metadata) of a drafter folder from its metadata alone (no weights, no
  target check): what benchmarks/tpu_compile.py compiles programs for."""
  _, _, meta, dcfg = _latest(path)
  return dcfg, meta


def load_checkpoint(path: str, target: loaders.Target, dtype: str = 'float32', mesh=None):
  """(DrafterConfig, params, metadata) from a training workdir, its checkpoints/ folder, or an
  exported drafter folder; the latest step. Refuses a drafter made for another target.
  (`drafters.load_drafter` also takes DFlash's folders.)

  The parameters come back in `dtype` (decoding passes the target's: a bfloat16 target drafts
  in bfloat16; training keeps float32 master weights), and DrafterConfig.dtype says so. With
  `mesh` each tensor is restored straight onto its sharding (`sharding.drafter_shardings`)."""
  mngr, step, meta, dcfg = _latest(path)
  check_metadata(meta, target, os.path.join(mngr.directory, str(step)))
  abstract = jax.eval_shape(lambda: drafter_lib.init_params(dcfg, target.cfg,
                                                            jax.random.PRNGKey(0)))
  stored = meta.get('param_dtype', 'float32')
  shardings = (jax.tree.map(lambda _: None, abstract) if mesh is None else
               sharding_lib.drafter_shardings(mesh, abstract))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
      x.shape, x.dtype if _is_int(x) else stored, sharding=s), abstract, shardings)
  params = restore(mngr, step, target, {'params': abstract})['params']
  params = jax.tree.map(lambda x: x if _is_int(x) else x.astype(dtype), params)
  return dataclasses.replace(dcfg, dtype=dtype), params, meta


def _is_int(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.integer)


def export_drafter(workdir: str, out: str, target: loaders.Target, dtype: str = 'bfloat16'):
  """A drafter-only checkpoint (parameters in `dtype` + metadata, no optimizer state): what
  ships, and what decode.py and notebooks load."""
  dcfg, params, meta = load_checkpoint(workdir, target)
  out_mngr = manager(out, keep=1)
  step = manager(os.path.join(workdir, 'checkpoints'), create=False).latest_step()
  params = jax.tree.map(lambda x: x if _is_int(x) else x.astype(dtype), params)
  out_mngr.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      meta=ocp.args.JsonSave({**meta, 'param_dtype': dtype})), force=True)
  out_mngr.wait_until_finished()
  return dcfg

"""Meshes and sharding rules: data parallel over 'data', tensor parallel over 'model'.

Every parameter dimension has a logical name; RULES map logical names to mesh axes, the way
flax's logical partitioning does, but for our plain pytrees:

  embed / lm_head   [V, D]               ('vocab', 'embed')       vocab-parallel head
  wqkv              [KVH, G+2, hd, D]    ('kv_heads', ., ., 'embed')
  bqkv              [KVH, G+2, hd]       ('kv_heads', ., .)
  wo                [D, H*hd]            ('embed', 'heads')
  w_gate_up         [2, F, D]            (., 'mlp', 'embed')
  w_down            [D, F]               ('embed', 'mlp')
  drafter fc        [W, n*D]             (., 'features')
  drafter wkv       [Hkv*2*hd, D]        ('kv_heads', 'embed')    (drafter.for_decoding)
  drafter head_rows [n, D]               ('vocab', 'embed')       (drafter.for_decoding)
  norms, mask_embed, head_ids            replicated
  batches [B, ...], KV caches [B, ...]   ('batch', ...)

RULES: kv_heads, heads, mlp, vocab, features -> 'model'; batch -> 'data'; embed -> replicated.
A dimension that the mesh axis does not divide is replicated instead (e.g. 3 KV heads on a
model axis of 2); `describe` lists what each parameter got. Sharding never changes results:
jit partitions the same program (the tests check sharded = unsharded).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from d2sd_jax.kernels import partition

RULES = {'vocab': 'model', 'kv_heads': 'model', 'heads': 'model', 'mlp': 'model',
         'features': 'model', 'batch': 'data', 'embed': None}

TARGET_AXES = {
    'embed': ('vocab', 'embed'), 'lm_head': ('vocab', 'embed'), 'final_norm': (None,),
    'attn_norm': (None,), 'mlp_norm': (None,), 'q_norm': (None,), 'k_norm': (None,),
    'wqkv': ('kv_heads', None, None, 'embed'), 'bqkv': ('kv_heads', None, None),
    'wo': ('embed', 'heads'), 'w_gate_up': (None, 'mlp', 'embed'), 'w_down': ('embed', 'mlp'),
}
DRAFTER_AXES = {**TARGET_AXES, 'fc': (None, 'features'), 'fc_norm': (None,),
                'mask_embed': (None,), 'head_ids': (None,), 'in_proj': (None, 'embed'),
                'out_proj': ('embed', None),
                # what drafter.for_decoding derives for decoding: each layer's key and value rows
                # of wqkv [Hkv·2·hd, D] (KV-head major, split as wqkv is) and the head's rows of
                # the target's output matrix [n, D] (split as the head is)
                'wkv': ('kv_heads', 'embed'), 'head_rows': ('vocab', 'embed')}


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
  """A ('data', 'model') mesh over `devices` (all by default); -1 = what the other leaves.
  Two explicit sizes may use fewer devices than there are (the first data x model)."""
  devices = np.asarray(jax.devices() if devices is None else devices).reshape(-1)
  n = devices.size
  if data == -1 and model == -1:
    raise ValueError('mesh.data and mesh.model cannot both be -1: fix one of them')
  for name, size in (('mesh.data', data), ('mesh.model', model)):
    if size == 0 or size < -1:
      raise ValueError(f'{name}={size}: use a positive size or -1 (infer)')
  if data == -1:
    data = n // model if n % model == 0 else 0
  if model == -1:
    model = n // data if n % data == 0 else 0
  if data * model == 0 or data * model > n:
    raise ValueError(f'mesh.data={data} x mesh.model={model} does not fit the {n} devices: '
                     f'make the product at most {n}, or set one of them to -1 (infer)')
  return Mesh(devices[:data * model].reshape(data, model), ('data', 'model'))


@contextlib.contextmanager
def tracing_under(mesh: Mesh | None):
  """The context to trace and run programs over `mesh` in: its abstract mesh
  (`jax.sharding.use_abstract_mesh`), so a kernel XLA cannot partition (the TPU attention
  kernels, `d2sd_jax.kernels.partition.kernel_axes`) splits itself over the mesh's axes
  instead of failing to compile, and its devices' kind, from which the kernels take the chip's
  TensorCores (`partition.tensor_cores`); a no-op without a mesh. (`jax.set_mesh` would also
  make programs compiled ahead of time from unplaced shapes expect replicated arguments:
  scripts/distill.py's generator then refused its head-split caches.)"""
  if mesh is None:
    yield
    return
  with partition.compiling_for(mesh.devices.flat[0].device_kind), \
      jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    yield


def spec_for(shape, logical_axes, mesh: Mesh) -> P:
  """PartitionSpec from logical axes; a dimension the mesh axis does not divide is replicated."""
  out = []
  for size, name in zip(shape, tuple(logical_axes) + (None,) * (len(shape) - len(logical_axes))):
    axis = RULES.get(name) if name else None
    out.append(axis if axis and size % mesh.shape[axis] == 0 else None)
  return P(*out)


def _shardings(mesh: Mesh, tree, axes_by_name: dict):
  def leaf(path, x):
    name = None
    for entry in reversed(path):
      if isinstance(entry, jax.tree_util.DictKey):
        name = entry.key
        break
    if name not in axes_by_name:
      raise KeyError(f'no sharding rule for parameter {jax.tree_util.keystr(path)}: add its '
                     'logical axes to d2sd_jax.models.sharding')
    return NamedSharding(mesh, spec_for(x.shape, axes_by_name[name], mesh))
  return jax.tree_util.tree_map_with_path(leaf, tree)


def target_shardings(mesh: Mesh, params):
  return _shardings(mesh, params, TARGET_AXES)


def drafter_shardings(mesh: Mesh, params):
  return _shardings(mesh, params, DRAFTER_AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) dimension over 'data', the rest replicated."""
  return NamedSharding(mesh, P('data', *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(mesh: Mesh, local: np.ndarray) -> jax.Array:
  """This process's rows of a data-parallel batch as one global array (multi-host: every
  process passes its own slice; one process: the whole batch)."""
  return jax.make_array_from_process_local_data(batch_sharding(mesh, local.ndim), local)


def describe(tree, shardings) -> dict:
  """{parameter path: PartitionSpec string}: what the rules gave each parameter."""
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  return {jax.tree_util.keystr(path): str(s.spec) for path, s in flat}


def check_batch(mesh: Mesh, batch_size: int, field: str = 'train.batch_size') -> None:
  data = mesh.shape['data']
  if batch_size % data:
    raise ValueError(f'{field}={batch_size} is not divisible by mesh.data={data}: use a '
                     f'multiple of {data} or a smaller mesh.data')


def process_rows(batch_size: int) -> slice:
  """The rows of a global batch this process loads (per-host data shards)."""
  n, i = jax.process_count(), jax.process_index()
  if batch_size % n:
    raise ValueError(f'batch size {batch_size} is not divisible by the {n} processes')
  per = batch_size // n
  return slice(i * per, (i + 1) * per)


def maybe_initialize_distributed(enabled: bool) -> None:
  """jax.distributed.initialize() for multi-host pod slices (coordinator from the
  environment: TPU metadata, SLURM, or JAX_COORDINATOR_ADDRESS etc.)."""
  if enabled and not getattr(maybe_initialize_distributed, 'done', False):
    jax.distributed.initialize()
    maybe_initialize_distributed.done = True

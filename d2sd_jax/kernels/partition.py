"""How a Pallas kernel, which XLA cannot partition, splits itself over the traced mesh, and
over the TensorCores of the chip it is compiled for."""
import contextlib
import contextvars

import jax

# TensorCores per chip by jax's device_kind: a 'parallel' grid axis is split over them (v4 and
# v5p: two, one per half of the chip; v5e and v6e: one).
TENSOR_CORES = {'TPU v4': 2, 'TPU v5': 2, 'TPU v5p': 2, 'TPU v5 lite': 1, 'TPU v5e': 1,
                'TPU v6 lite': 1, 'TPU v6e': 1}
_DEVICE_KIND = contextvars.ContextVar('d2sd_device_kind', default=None)


@contextlib.contextmanager
def compiling_for(device_kind: str | None):
  """Programs traced inside are for chips of this kind (`tensor_cores`)."""
  token = _DEVICE_KIND.set(device_kind)
  try:
    yield
  finally:
    _DEVICE_KIND.reset(token)


def tensor_cores(default: int = 2) -> int:
  """TensorCores of the chip being compiled for: the kind `compiling_for` names (set by
  `models.sharding.tracing_under` from the mesh's devices), else this host's TPU, else
  `default` (two: what a v4 or v5p has, and a one-core chip runs a two-way split in turn)."""
  kind = _DEVICE_KIND.get()
  if kind is None and jax.default_backend() == 'tpu':
    kind = jax.devices()[0].device_kind
  return TENSOR_CORES.get(kind, default)


def kernel_axes(batch: int, kv_heads: int):
  """For a kernel XLA cannot partition (the TPU attention kernels), the traced mesh and the axes
  its rows and KV heads split over ('data', 'model'; None where the axis does not divide the
  dimension), for a `shard_map`; None when no mesh of several devices is traced
  (`tracing_under`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  rows = 'data' if batch % mesh.shape.get('data', batch + 1) == 0 else None
  heads = 'model' if kv_heads % mesh.shape.get('model', kv_heads + 1) == 0 else None
  return mesh, rows, heads


def residual_axes(batch: int, width: int, *model_dims: int):
  """A decoding layer's split residual stream (`fused.residual_split`): (mesh, rows axis or
  None, 'model') when the traced mesh has a 'model' axis of several devices that divides the
  residual stream's width into whole 128-lane slices and divides every one of `model_dims`
  (what the layer splits over it: KV heads, attention output columns, MLP hidden units); else
  None."""
  split = kernel_axes(batch, 1)
  if split is None:
    return None
  m = split[0].shape.get('model', 1)
  if m == 1 or width % (128 * m) or any(d % m for d in model_dims):
    return None
  return split[0], split[1], 'model'


def whole_width(x):
  """x [B, ...] whole on every device of the traced mesh's 'model' axis (its rows over 'data'
  where that divides them): the residual stream after a stack of layers that kept it split
  over its width (`residual_axes`), before the final norm and the head, whose products the
  compiler otherwise runs as a loop over the width's shards (a windowed einsum that wrote the
  logits once per shard). One all-gather there; nothing where x is already whole."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get('model', 1) == 1:
    return x  # (no model axis: nothing was split over the width)
  rows = kernel_axes(x.shape[0], 1)[1]
  spec = jax.sharding.PartitionSpec(rows, *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

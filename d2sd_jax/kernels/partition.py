"""How a Pallas kernel, which XLA cannot partition, splits itself over the traced mesh."""
import jax


def kernel_axes(batch: int, kv_heads: int):
  """For a kernel XLA cannot partition (the TPU attention kernels), the traced mesh and the axes
  its rows and KV heads split over ('data', 'model'; None where the axis does not divide the
  dimension), for a `shard_map`; None when no mesh of several devices is traced
  (`tracing_under`)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  size = dict(zip(mesh.axis_names, mesh.axis_sizes))
  rows = 'data' if batch % size.get('data', batch + 1) == 0 else None
  heads = 'model' if kv_heads % size.get('model', kv_heads + 1) == 0 else None
  return mesh, rows, heads

"""XLA compiler options by the platform a program is compiled for: the decode runners, training,
the cost model's timed loops and benchmarks/tpu_compile.py compile with `for_platform` /
`for_arrays(arguments)`.

TPU: memory-space assignment (MSA) off. MSA prefetches buffers from HBM into the core's VMEM
ahead of their use. A decode step reads nearly every buffer once (each weight, each KV cache's
context window), so a prefetch only moves the same bytes through VMEM, and the TPU compiler
then costs the program at more bytes and more time than without it: it prefetched every layer's
wo and both caches of Qwen3-8B's AR step, and every weight of SmolLM2's, which fit in VMEM.
docs/scale-out.md ("What the TPU compiler says") has each program's figures with and without
it, from benchmarks/tpu_compile.py --xla. These are the compiler's own estimates: no TPU has run
them here. Edit TPU (or pass --xla to tpu_compile.py) to compare other settings.
"""
from __future__ import annotations

import jax

TPU = {'xla_msa_enable': 'false'}
BY_PLATFORM = {'tpu': TPU}


def for_platform(platform: str) -> dict:
  """The options for programs compiled for `platform` ('cpu', 'gpu', 'tpu'), a fresh dict."""
  return dict(BY_PLATFORM.get(platform, {}))


def platform_of(tree) -> str | None:
  """The platform of the first array (or sharded ShapeDtypeStruct) in `tree` that has a
  sharding; None when none has."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, 'sharding', None)
    if sharding is not None:
      return next(iter(sharding.device_set)).platform
  return None


def for_arrays(tree) -> dict:
  """The options for a program whose arguments are `tree`, compiled for the devices they are on
  (the default backend's when no argument says)."""
  return for_platform(platform_of(tree) or jax.default_backend())

"""d2sd_jax: speculative decoding with dual diffusion drafters, in JAX.

The subpackages, from the core up (each imports only those above it in this list):
  kernels/  Pallas TPU kernels: the fused decoding layer, splash attention for prefills
  models/   the target LM, the diffusion drafter, sampling transforms, sharding rules (pure JAX)
  spec_decode/ AR decoding, candidate trees and acceptance, drafting methods, the speculative cycle
  formats/  target loaders (GGUF, safetensors), tokenizer, drafter checkpoints, DFlash folders
  perf/     cost model and throughput model
  decode/   options, runners, `generate`, method='auto', the notebook API
  train/    data sources and pipeline, distillation, corpus, losses, the training loop

The public names below load lazily: `import d2sd_jax.models.target` needs no Orbax or TFDS.

  dec = d2sd_jax.load('smollm2', drafter1=..., drafter2=...)   # a Decoder (decode/api.py)
  completions, stats = d2sd_jax.generate(target, drafters, prompts, d2sd_jax.Options('d2sd'))
  d2sd_jax.register('my_method', d2sd_jax.Method(...))         # a new drafting method
"""
import importlib

from d2sd_jax import platforms as _platforms

_platforms.skip_absent_tpu()  # no libtpu errors on a CPU host (d2sd_jax/platforms.py)

_PUBLIC = {
    'load': 'd2sd_jax.decode.api',
    'Decoder': 'd2sd_jax.decode.api',
    'Generation': 'd2sd_jax.decode.api',
    'acceptance_plot': 'd2sd_jax.decode.api',
    'generate': 'd2sd_jax.decode.generate',
    'Options': 'd2sd_jax.decode.options',
    'SpecSettings': 'd2sd_jax.spec_decode.speculative',
    'Method': 'd2sd_jax.spec_decode.drafting',
    'register': 'd2sd_jax.spec_decode.drafting',
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + __all__)

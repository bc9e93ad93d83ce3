"""d2sd_jax: speculative decoding with dual diffusion drafters, in JAX.

Notebook use: `d2sd_jax.load(...)` returns a ready `Decoder` (see d2sd_jax/api.py).
"""
from d2sd_jax.api import Decoder, Generation, acceptance_plot, load

__all__ = ['Decoder', 'Generation', 'acceptance_plot', 'load']

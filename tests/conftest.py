import functools

import jax
import pytest

from d2sd_jax import loaders
from d2sd_jax import model as model_lib

jax.config.update('jax_enable_x64', False)

TINY = model_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=8, d_ff=48, rope_base=10000.0, norm_eps=1e-6)


@pytest.fixture(scope='session')
def tiny():
  """A tiny random Llama-family model: (cfg, params)."""
  return TINY, model_lib.init_params(TINY, jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=1)
def _smollm2():
  return loaders.load_target('smollm2')


@pytest.fixture(scope='session')
def smollm2():
  """The real SmolLM2-135M-Instruct target (float32), loaded once per session."""
  return _smollm2()

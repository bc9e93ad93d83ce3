"""The jitted programs the speculative-decoding tests share: the reference forwards (a plain
causal forward with no cache reuse, and a fresh prefill's caches and features) and the AR and
speculative loop programs (`jitted`), compiled once per process for the tiny drafters' training
(tests/helpers/tiny_drafters.py) and the loop's checks (tests/helpers/loop_checks.py)."""
import functools

import jax
import jax.numpy as jnp

from d2sd_jax.models import target as M
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.spec_decode import speculative as SP


@functools.partial(jax.jit, static_argnums=(0,))
def _full_logits(cfg, params, tokens_1xW):
  W = tokens_1xW.shape[1]
  h, _, _ = M.forward(params, cfg, tokens_1xW, jnp.arange(W)[None], M.init_cache(cfg, 1, W),
                      jnp.zeros((1,), jnp.int32))
  return M.logits(params, cfg, h)[0]


def full_last_logits(cfg, params, tokens_1xT, bucket: int = 32):
  """Logits after the last token of a plain causal forward (no cache reuse): the reference.
  The sequence is padded to a multiple of `bucket` (one program for many lengths): causal
  attention keeps the padding out of every earlier position."""
  T = tokens_1xT.shape[1]
  padded = jnp.pad(jnp.asarray(tokens_1xT), ((0, 0), (0, -T % bucket)))
  return _full_logits(cfg, params, padded)[T - 1]


@functools.partial(jax.jit, static_argnums=(0, 3))
def fresh_prefill(cfg, params, tokens_1xL, feature_layers):
  """Cache and features of a plain causal prefill (compare only the first n slots)."""
  L = tokens_1xL.shape[1]
  _, cache, feats = M.forward(params, cfg, tokens_1xL, jnp.arange(L)[None],
                              M.init_cache(cfg, 1, L), jnp.zeros((1,), jnp.int32),
                              feature_layers=feature_layers)
  return cache, feats


@functools.lru_cache(maxsize=None)
def jitted():
  return (jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size')),
          jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size')),
          jax.jit(SP.spec_loop, static_argnames=('cfg', 'settings')),
          jax.jit(SP.spec_step, static_argnames=('cfg', 'settings')))

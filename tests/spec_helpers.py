"""Shared pieces of the speculative-decoding tests."""
import functools

import jax
import jax.numpy as jnp

from d2sd_jax import drafter as D
from d2sd_jax import generate as G
from d2sd_jax import model as M
from d2sd_jax import speculative as SP

PROMPTS = [[5, 9, 2, 33, 7, 1, 60, 5, 9, 2], [12], [40, 41, 42, 43, 40, 41]]
DCFG = D.DrafterConfig(gamma=5, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8,
                       d_ff=48, feature_layers=(0, 2), rope_base=10000.0, norm_eps=1e-6)
DCFG2 = D.DrafterConfig(**{**DCFG.__dict__, 'feature_layers': (1, 2)})


@functools.partial(jax.jit, static_argnums=(0,))
def full_last_logits(cfg, params, tokens_1xT):
  """Logits after the last token of a plain causal forward (no cache reuse): the reference."""
  T = tokens_1xT.shape[1]
  h, _, _ = M.forward(params, cfg, tokens_1xT, jnp.arange(T)[None], M.init_cache(cfg, 1, T),
                      jnp.zeros((1,), jnp.int32))
  return M.logits(params, cfg, h)[0, -1]


def bundle_for(tiny):
  cfg, params = tiny
  return {'target': params, 'drafter1': D.init_params(DCFG, cfg, jax.random.PRNGKey(5)),
          'drafter2': D.init_params(DCFG2, cfg, jax.random.PRNGKey(6))}


@functools.lru_cache(maxsize=None)
def jitted():
  return (jax.jit(G.generate, static_argnums=(1, 2, 6)),
          jax.jit(SP.init_state, static_argnums=(1, 2, 6)),
          jax.jit(SP.spec_loop, static_argnums=(1, 2)),
          jax.jit(SP.spec_step, static_argnums=(1, 2)))


def run_both(cfg, params, prompts, spec, seed=0):
  """AR tokens and speculative tokens for the same prompts and row keys."""
  gen_ar, init, loop, _ = jitted()
  block, lens = G.pad_prompts(prompts, spec.generation.pad_id, bucket=8)
  keys = G.row_keys(seed, range(len(prompts)))
  target_params = params['target'] if 'target' in params else params
  ar = gen_ar(target_params, cfg, spec.generation, block, lens, keys,
              block.shape[1] + spec.generation.max_new_tokens)
  bundle = params if isinstance(params, dict) and 'target' in params else {'target': params}
  state = init(bundle, cfg, spec, block, lens, keys, SP.cache_size_needed(block.shape[1], spec))
  state = loop(bundle, cfg, spec, state)
  n = spec.generation.max_new_tokens
  ar_out = [ar.out_BxN[b, :ar.num_out_B[b]].tolist() for b in range(len(prompts))]
  sp_out = [SP.generated(state, n)[b, :state.num_out_B[b]].tolist() for b in range(len(prompts))]
  return ar_out, sp_out, state

"""Autoregressive generation: a jitted prefill, then the whole decode in one `lax.while_loop`.

Prompts are right-padded into a [B, P] block; each row keeps its own committed length, so rows of
different lengths share one program. Row b's token n is drawn with `fold_in(row_key_b, n)`: the
same prompt and key give the same tokens whatever batch the row sits in.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sampling as sampling_lib


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
  """Static settings of one compiled generation program.

  max_new_tokens bounds the new tokens of a run (the width of its output buffer and of the
  caches' room for them). A run may stop sooner: the prefill's `max_new` argument is traced, so
  every limit up to the bound runs the same compiled programs."""
  max_new_tokens: int
  eos_ids: tuple[int, ...]
  pad_id: int
  sampling: sampling_lib.SamplingSettings = sampling_lib.SamplingSettings()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f'max_new_tokens={self.max_new_tokens} must be >= 1')


@flax.struct.dataclass
class DecodeState:
  cache: model_lib.Cache  # one {k, v} per layer, each [B, Hkv, S, hd]
  cache_len_B: jax.Array  # tokens of each row held in the cache (prompt + committed - 1)
  last_token_B: jax.Array  # newest committed token, not yet in the cache
  out_BxN: jax.Array  # generated tokens, pad after each row's end
  num_out_B: jax.Array  # tokens generated per row (EOS included)
  done_B: jax.Array  # row finished (EOS or its limit of new tokens)
  max_new_B: jax.Array  # each row's limit of new tokens (new_token_limits)
  row_key_B: jax.Array  # per-row PRNG keys (raw uint32 [B, 2])
  steps: jax.Array  # forward passes run by the decode loop


def row_keys(seed: int, row_ids) -> jax.Array:
  """Per-row keys from a seed and each row's global prompt index."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(row_ids, jnp.uint32))


def sample_rows(logits_BxV, row_key_B, token_index_B, sampling):
  """Token n of row b is drawn with key fold_in(row_key_b, n)."""
  keys = jax.vmap(jax.random.fold_in)(row_key_B, token_index_B)
  return jax.vmap(lambda k, lg: sampling_lib.sample(k, lg[None], sampling)[0])(keys, logits_BxV)


def new_token_limits(settings: GenerationSettings, max_new, batch: int) -> jax.Array:
  """Each row's limit of new tokens, int32 [B]: `max_new` (a traced scalar, or None for the
  bound), capped by the settings' bound."""
  bound = settings.max_new_tokens
  limit = bound if max_new is None else jnp.clip(jnp.asarray(max_new, jnp.int32), 1, bound)
  return jnp.broadcast_to(jnp.asarray(limit, jnp.int32), (batch,))


def is_eos(tokens, eos_ids):
  return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def prefill_prompts(params, cfg: model_lib.ModelConfig, settings: GenerationSettings,
                    prompt_BxP, prompt_len_B, row_key_B, cache_size: int,
                    feature_layers: tuple[int, ...] = ()):
  """The prompts through the target into a fresh cache, and each row's first new token.

  Returns (first token [B], cache, features of the prompt tokens or None)."""
  B, P = prompt_BxP.shape
  positions_BxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  hidden_BxPxD, cache, feats = model_lib.forward(
      params, cfg, prompt_BxP, positions_BxP, model_lib.init_cache(cfg, B, cache_size),
      jnp.zeros((B,), jnp.int32), feature_layers=feature_layers, fresh=True)
  last_BxD = jnp.take_along_axis(hidden_BxPxD, (prompt_len_B - 1)[:, None, None], axis=1)
  logits_BxV = model_lib.logits(params, cfg, last_BxD)[:, 0]
  token_B = sample_rows(logits_BxV, row_key_B, jnp.zeros((B,), jnp.int32), settings.sampling)
  return token_B, cache, feats


def prefill(params, cfg: model_lib.ModelConfig, settings: GenerationSettings, prompt_BxP,
            prompt_len_B, row_key_B, cache_size: int, max_new=None) -> DecodeState:
  """Fills the cache with the prompts and samples each row's first new token. max_new: this
  run's limit of new tokens (traced; None: settings.max_new_tokens)."""
  B = prompt_BxP.shape[0]
  max_new_B = new_token_limits(settings, max_new, B)
  token_B, cache, _ = prefill_prompts(params, cfg, settings, prompt_BxP, prompt_len_B, row_key_B,
                                      cache_size)
  out_BxN = jnp.full((B, settings.max_new_tokens), settings.pad_id, jnp.int32).at[:, 0].set(token_B)
  done_B = is_eos(token_B, settings.eos_ids) | (max_new_B <= 1)
  return DecodeState(cache=cache, cache_len_B=prompt_len_B.astype(jnp.int32), last_token_B=token_B,
                     out_BxN=out_BxN, num_out_B=jnp.ones((B,), jnp.int32), done_B=done_B,
                     max_new_B=max_new_B, row_key_B=row_key_B, steps=jnp.zeros((), jnp.int32))


def decode_step(params, cfg: model_lib.ModelConfig, settings: GenerationSettings,
                state: DecodeState) -> DecodeState:
  """Feeds each row's last token and samples the next; finished rows stay as they are."""
  B = state.last_token_B.shape[0]
  hidden_Bx1xD, cache, _ = model_lib.forward(params, cfg, state.last_token_B[:, None],
                                             state.cache_len_B[:, None], state.cache,
                                             state.cache_len_B)
  logits_BxV = model_lib.logits(params, cfg, hidden_Bx1xD)[:, 0]
  token_B = sample_rows(logits_BxV, state.row_key_B, state.num_out_B, settings.sampling)
  live_B = ~state.done_B
  out_BxN = state.out_BxN.at[jnp.arange(B), state.num_out_B].set(
      jnp.where(live_B, token_B, settings.pad_id), mode='drop')
  num_out_B = state.num_out_B + live_B
  done_B = state.done_B | (live_B & (is_eos(token_B, settings.eos_ids) |
                                     (num_out_B >= state.max_new_B)))
  return state.replace(cache=cache, cache_len_B=state.cache_len_B + live_B,
                       last_token_B=jnp.where(live_B, token_B, state.last_token_B),
                       out_BxN=out_BxN, num_out_B=num_out_B, done_B=done_B,
                       steps=state.steps + 1)


def decode_loop(params, cfg: model_lib.ModelConfig, settings: GenerationSettings,
                state: DecodeState) -> DecodeState:
  """Runs until every row is done, in one `lax.while_loop`."""
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                            lambda s: decode_step(params, cfg, settings, s), state)


def decode(params, cfg, settings, prompt_BxP, prompt_len_B, row_key_B, cache_size: int,
           max_new=None):
  """Prefill + decode as one function (jit it with cfg, settings and cache_size static)."""
  state = prefill(params, cfg, settings, prompt_BxP, prompt_len_B, row_key_B, cache_size,
                  max_new)
  return decode_loop(params, cfg, settings, state)


def pad_prompts(prompts: list[list[int]], pad_id: int, bucket: int = 64, width: int = 0):
  """Right-pads token lists into a [B, P] int32 block (P rounded up to `bucket`, and at least
  `width`) + lengths."""
  if any(len(p) == 0 for p in prompts):
    raise ValueError('empty prompt: every prompt needs at least one token')
  P = max(-(-max(len(p) for p in prompts) // bucket) * bucket, width)
  block = np.full((len(prompts), P), pad_id, np.int32)
  for b, p in enumerate(prompts):
    block[b, :len(p)] = p
  return jnp.asarray(block), jnp.asarray([len(p) for p in prompts], jnp.int32)

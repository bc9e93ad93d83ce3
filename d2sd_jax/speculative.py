"""Speculative decoding as one XLA program: draft -> verify (one tree-masked target pass) ->
accept -> commit (cache compaction), repeated inside one `lax.while_loop`.

The state keeps, per row, the committed sequence (prompt + generated), the target KV cache
holding all committed tokens but the newest (the anchor of the next cycle), and counters.
Drafters are functions `state -> Tree`; this file has the training-free prompt-lookup drafter
(`pld`). The invariant checked by the tests: after every cycle the cache equals a fresh
prefill of the committed tokens, and the output equals AR decoding.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from d2sd_jax import generate as generate_lib
from d2sd_jax import model as model_lib
from d2sd_jax import sampling as sampling_lib
from d2sd_jax import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class SpecSettings:
  """Static settings of a speculative generation program."""
  generation: generate_lib.GenerationSettings
  method: str = 'pld'
  gamma: int = 8  # block length: the anchor + gamma-1 draft tokens per chain
  ngram_max: int = 3  # prompt lookup: longest n-gram matched (falls back to shorter ones)

  def __post_init__(self):
    if self.method not in DRAFTERS:
      raise ValueError(f'speculative method {self.method!r} is not one of {tuple(DRAFTERS)}')
    if self.gamma < 2:
      raise ValueError(f'gamma={self.gamma} must be >= 2 (the anchor plus at least one draft)')
    if self.ngram_max < 1:
      raise ValueError(f'ngram_max={self.ngram_max} must be >= 1')

  @property
  def tree_size(self) -> int:
    return self.gamma  # anchor + gamma-1 chain nodes

  @property
  def max_commit(self) -> int:
    return self.tree_size  # accepted draft tokens + the bonus token


@flax.struct.dataclass
class SpecState:
  cache: model_lib.Cache
  cache_len_B: jax.Array  # committed tokens in the cache (= seq_len - 1)
  seq_BxL: jax.Array  # committed tokens: prompt, then generated; pad after seq_len
  seq_len_B: jax.Array
  prompt_len_B: jax.Array
  num_out_B: jax.Array  # generated tokens (EOS included)
  done_B: jax.Array
  row_key_B: jax.Array
  cycles_B: jax.Array  # verification cycles run while the row was live
  accepted_hist_BxK: jax.Array  # per row: how many cycles accepted k draft tokens
  steps: jax.Array  # loop iterations

  @property
  def anchor_B(self):
    return jnp.take_along_axis(self.seq_BxL, (self.seq_len_B - 1)[:, None], 1)[:, 0]


def seq_buffer_len(prompt_len: int, settings: SpecSettings) -> int:
  return prompt_len + settings.generation.max_new_tokens + settings.max_commit


def cache_size_needed(prompt_len: int, settings: SpecSettings) -> int:
  """Cache slots: every committed token + one verification tree written after them."""
  return prompt_len + settings.generation.max_new_tokens + settings.tree_size


def init_state(params, cfg: model_lib.ModelConfig, settings: SpecSettings, prompt_BxP,
               prompt_len_B, row_key_B, cache_size: int) -> SpecState:
  """Prefill the prompts and commit each row's first token (sampled from the prefill logits)."""
  ar = generate_lib.prefill(params, cfg, settings.generation, prompt_BxP, prompt_len_B, row_key_B,
                            cache_size)
  B, P = prompt_BxP.shape
  L = seq_buffer_len(P, settings)
  rows = jnp.arange(B)
  seq = jnp.full((B, L), settings.generation.pad_id, jnp.int32).at[:, :P].set(prompt_BxP)
  seq = jnp.where(jnp.arange(L)[None] < prompt_len_B[:, None], seq, settings.generation.pad_id)
  seq = seq.at[rows, prompt_len_B].set(ar.last_token_B)
  return SpecState(cache=ar.cache, cache_len_B=prompt_len_B, seq_BxL=seq,
                   seq_len_B=prompt_len_B + 1, prompt_len_B=prompt_len_B, num_out_B=ar.num_out_B,
                   done_B=ar.done_B, row_key_B=row_key_B, cycles_B=jnp.zeros((B,), jnp.int32),
                   accepted_hist_BxK=jnp.zeros((B, settings.max_commit), jnp.int32),
                   steps=jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------------------------
# Drafters


def pld_draft(state: SpecState, settings: SpecSettings) -> tree_lib.Tree:
  """Prompt lookup: find an earlier occurrence of the last n committed tokens (the longest n up to
  ngram_max that occurs) and propose the gamma-1 tokens that followed it."""
  B, L = state.seq_BxL.shape
  N = settings.gamma - 1
  seq, seq_len = state.seq_BxL, state.seq_len_B
  pos = jnp.arange(L)
  best_start = jnp.full((B,), -1, jnp.int32)  # where the proposal starts in seq
  for n in range(1, settings.ngram_max + 1):  # longer n overrides shorter ones
    tail = jnp.stack([jnp.take_along_axis(seq, (seq_len - n + k)[:, None], 1)[:, 0]
                      for k in range(n)], 1)  # [B, n]
    ok = jnp.ones((B, L), bool)
    for k in range(n):
      shifted = jnp.roll(seq, -k, axis=1)  # shifted[j] = seq[j + k]
      ok &= shifted == tail[:, k:k + 1]
    # The match must end before the tail itself starts: j + n <= seq_len - 1, i.e. a following
    # token exists and the match is not the tail.
    ok &= (pos[None] + n <= (seq_len - 1)[:, None]) & (seq_len[:, None] > n)
    # Among matches, the latest one whose continuation is longest (up to gamma-1 tokens): the
    # very latest match of a repetition often has almost nothing after it yet.
    follow = jnp.clip(seq_len[:, None] - (pos[None] + n), 0, N)
    score = jnp.where(ok, follow * L + pos[None], -1)
    found = jnp.max(score, axis=1) >= 0
    best_start = jnp.where(found, jnp.argmax(score, axis=1) + n, best_start)
  idx = best_start[:, None] + jnp.arange(N)[None]
  draft = jnp.take_along_axis(seq, jnp.clip(idx, 0, L - 1), 1)
  valid = (best_start[:, None] >= 0) & (idx < seq_len[:, None])
  return tree_lib.chain(state.anchor_B, draft, valid)


DRAFTERS = {'pld': pld_draft}


# ----------------------------------------------------------------------------------------------
# Verification, acceptance, commit


def compact_cache(cache: model_lib.Cache, cache_len_B, path_BxD) -> model_lib.Cache:
  """Moves the K/V of the accepted path's nodes (written at cache_len + node index by the
  verification pass) to consecutive slots cache_len + depth."""
  D = path_BxD.shape[1]

  def layer(buf_BxKxSxhd):
    B, K, _, hd = buf_BxKxSxhd.shape
    for b in range(B):  # one small gather + in-place write per row
      window = jax.lax.dynamic_slice(buf_BxKxSxhd[b], (0, cache_len_B[b], 0), (K, D, hd))
      moved = jnp.take(window, path_BxD[b], axis=1)
      buf_BxKxSxhd = jax.lax.dynamic_update_slice(buf_BxKxSxhd, moved[None],
                                                  (b, 0, cache_len_B[b], 0))
    return buf_BxKxSxhd

  return [{'k': layer(kv['k']), 'v': layer(kv['v'])} for kv in cache]


def spec_step(params, cfg: model_lib.ModelConfig, settings: SpecSettings,
              state: SpecState) -> SpecState:
  gen = settings.generation
  B = state.seq_BxL.shape[0]
  rows = jnp.arange(B)
  live_B = ~state.done_B

  # 1. Draft.
  tree = DRAFTERS[settings.method](state, settings)
  anc_BxTxT, depth_BxT = tree_lib.structure(tree)

  # 2. Verify every node in one target pass after the committed context.
  positions = state.cache_len_B[:, None] + depth_BxT
  hidden, cache, _ = model_lib.forward(params, cfg, tree.tokens_BxT, positions, state.cache,
                                       state.cache_len_B, anc_BxTxT)
  logits_BxTxV = model_lib.logits(params, cfg, hidden)

  # 3. Accept the longest path (+ the target's own token after it).
  cycle_keys = jax.vmap(jax.random.fold_in)(state.row_key_B, state.seq_len_B)
  best, n_acc_B, bonus_B, path_BxT = tree_lib.accept_point_mass(
      tree, anc_BxTxT, depth_BxT, logits_BxTxV, gen.sampling, cycle_keys)

  # 4. Commit: the accepted draft tokens and the bonus, truncated at EOS and max_new_tokens
  # exactly where AR decoding would stop.
  C = settings.max_commit
  path_tokens = jnp.take_along_axis(tree.tokens_BxT, path_BxT, 1)  # path[0] = anchor
  drafted_BxC = jnp.pad(path_tokens[:, 1:], ((0, 0), (0, C - tree.size + 1)))
  j = jnp.arange(C)[None]
  new_BxC = jnp.where(j < n_acc_B[:, None], drafted_BxC,
                      jnp.where(j == n_acc_B[:, None], bonus_B[:, None], gen.pad_id))
  is_eos = generate_lib.is_eos(new_BxC, gen.eos_ids) & (j <= n_acc_B[:, None])
  first_eos = jnp.min(jnp.where(is_eos, j, C), axis=1)
  room = gen.max_new_tokens - state.num_out_B
  n_commit = jnp.minimum(jnp.minimum(n_acc_B + 1, first_eos + 1), room)
  n_commit = jnp.where(live_B, n_commit, 0)
  keep = j < n_commit[:, None]
  seq = state.seq_BxL.at[rows[:, None], state.seq_len_B[:, None] + j].set(
      jnp.where(keep, new_BxC, gen.pad_id), mode='drop')

  cache = compact_cache(cache, state.cache_len_B, path_BxT)
  num_out = state.num_out_B + n_commit
  done = state.done_B | (live_B & ((first_eos < n_commit) | (num_out >= gen.max_new_tokens)))
  hist = state.accepted_hist_BxK.at[rows, n_acc_B].add(live_B)
  return state.replace(cache=cache, cache_len_B=state.cache_len_B + n_commit,
                       seq_BxL=seq, seq_len_B=state.seq_len_B + n_commit, num_out_B=num_out,
                       done_B=done, cycles_B=state.cycles_B + live_B,
                       accepted_hist_BxK=hist, steps=state.steps + 1)


def spec_loop(params, cfg: model_lib.ModelConfig, settings: SpecSettings,
              state: SpecState) -> SpecState:
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                            lambda s: spec_step(params, cfg, settings, s), state)


def generated(state: SpecState, max_new_tokens: int):
  """[B, max_new_tokens] generated tokens (pad after each row's end)."""
  idx = state.prompt_len_B[:, None] + jnp.arange(max_new_tokens)[None]
  return jnp.take_along_axis(state.seq_BxL, idx, 1)

"""Continuous batching for offline generation (distillation data): no row waits for another.

`generate.decode_loop` runs a batch until its longest row ends, so rows that end early idle; for
distillation (a third of the responses run to max_new_tokens, the rest end after ~100 tokens)
that wastes about half of every step. Here a row that ends is refilled with the next prompt:

  * `run_until_finish`: one jitted `lax.while_loop` of `generate.decode_step` that stops as soon
    as any row newly ends (the decode itself never leaves the device);
  * the host reads which rows ended and their tokens, and `refill` prefills each new prompt
    alone ([1, P], P its own length rounded up to `prompt_bucket`) and writes its K/V, first
    token, length and key into that row of the decode state, which stays on device (donated);
  * once no prompt is left, the live rows move to a batch half as large (`select_rows`) each
    time they fit: a step costs every row, finished or not, so the tail runs at its own size.

Row b is an independent greedy (or sampled) decode of its prompt: token n of prompt i is drawn
with fold_in(row_keys(seed, i), n), as in `generate`, so the outputs are those of `generate` on
each prompt alone, whatever row it lands in and whoever shares the batch.

Prompts are grouped into cache classes by length (`cache_classes`): the decode step attends over
all S cache slots of every row, so short prompts get a short cache.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.spec_decode import ar
from d2sd_jax.models import target as model_lib


@dataclasses.dataclass(frozen=True)
class BatchSettings:
  """Static settings of one engine's compiled programs."""
  generation: ar.GenerationSettings
  batch_size: int
  cache_size: int  # per row: the longest prompt + max_new_tokens must fit
  prompt_bucket: int = 32  # prefill widths are multiples of this (fewer programs to compile)
  # The tail shrinks the batch down to this many rows, no further: a step of a few rows costs
  # about one weight read whatever their number, and each batch size compiles its own loop.
  min_tail_batch: int = 4

  def __post_init__(self):
    if self.batch_size < 1:
      raise ValueError(f'batch_size={self.batch_size} must be >= 1')
    if self.cache_size <= self.generation.max_new_tokens:
      raise ValueError(f'cache_size={self.cache_size} must exceed max_new_tokens='
                       f'{self.generation.max_new_tokens}')


def empty_state(cfg: model_lib.ModelConfig, st: BatchSettings) -> ar.DecodeState:
  """A decode state whose rows are all free (done, nothing in the cache)."""
  B, gen = st.batch_size, st.generation
  zeros = lambda: jnp.zeros((B,), jnp.int32)  # distinct buffers: the state is donated
  return ar.DecodeState(
      cache=model_lib.init_cache(cfg, B, st.cache_size), cache_len_B=zeros(),
      last_token_B=zeros(), out_BxN=jnp.full((B, gen.max_new_tokens), gen.pad_id, jnp.int32),
      num_out_B=zeros(), done_B=jnp.ones((B,), bool),
      max_new_B=jnp.full((B,), gen.max_new_tokens, jnp.int32), row_key_B=jnp.zeros((B, 2), jnp.uint32),
      steps=jnp.zeros((), jnp.int32))


def run_until_finish(params, cfg: model_lib.ModelConfig, settings: BatchSettings,
                     state: ar.DecodeState) -> ar.DecodeState:
  """Decodes every live row until at least one of them ends (all in one `lax.while_loop`)."""
  done_before = jnp.sum(state.done_B)
  return jax.lax.while_loop(
      lambda s: (jnp.sum(s.done_B) == done_before) & ~jnp.all(s.done_B),
      lambda s: ar.decode_step(params, cfg, settings.generation, s), state)


def refill(params, cfg: model_lib.ModelConfig, settings: BatchSettings, state: ar.DecodeState,
           prompt_1xP, prompt_len_1, row_key_1, row) -> ar.DecodeState:
  """Prefills one prompt alone and puts it in row `row` (a traced index) of the decode state.

  Only cache slots < P of the row are written; the slots behind them hold the previous prompt's
  K/V, which attention never reads (a row reads slots < its cache_len)."""
  gen = settings.generation
  P = prompt_1xP.shape[1]
  token_1, small, _ = ar.prefill_prompts(params, cfg, gen, prompt_1xP, prompt_len_1, row_key_1, P)
  at = (row, 0, 0, 0)
  cache = [{'k': jax.lax.dynamic_update_slice(big['k'], new['k'], at),
            'v': jax.lax.dynamic_update_slice(big['v'], new['v'], at)}
           for big, new in zip(state.cache, small)]
  out_N = jnp.full((gen.max_new_tokens,), gen.pad_id, jnp.int32).at[0].set(token_1[0])
  done = ar.is_eos(token_1[0], gen.eos_ids) | (gen.max_new_tokens <= 1)
  return state.replace(
      cache=cache, cache_len_B=state.cache_len_B.at[row].set(prompt_len_1[0]),
      last_token_B=state.last_token_B.at[row].set(token_1[0]),
      out_BxN=state.out_BxN.at[row].set(out_N), num_out_B=state.num_out_B.at[row].set(1),
      done_B=state.done_B.at[row].set(done), row_key_B=state.row_key_B.at[row].set(row_key_1[0]))


def select_rows(params, cfg: model_lib.ModelConfig, settings: BatchSettings,
                state: ar.DecodeState, rows_R) -> ar.DecodeState:
  """The decode state of rows `rows_R` alone: the tail of a run continues in a smaller batch
  (a step costs every row, live or not)."""
  del params, cfg, settings  # (the engine's program signature)
  return jax.tree.map(lambda x: x[rows_R] if x.ndim else x, state)


class Engine:
  """Compiled programs of one cache size, reused across calls of `generate`."""

  def __init__(self, params, cfg: model_lib.ModelConfig, st: BatchSettings):
    self.params, self.cfg, self.st = params, cfg, st
    self.compile_s = 0.0
    self._programs = {}
    # busy_s / busy_tokens: time and tokens until the last prompt took a row (every row busy).
    self.stats = {'prefill_s': 0.0, 'decode_s': 0.0, 'decode_steps': 0, 'loop_calls': 0,
                  'tail_shrinks': 0, 'busy_s': 0.0, 'busy_tokens': 0}

  def _program(self, fn, state, *args, donate: bool = True):
    """fn(params, cfg, settings, state, *args) compiled for these shapes (the state donated
    where the output can reuse its buffers)."""
    key = (fn.__name__, state.done_B.shape[0]) + tuple(np.shape(a) for a in args)
    if key not in self._programs:
      t = time.perf_counter()
      compiled = jax.jit(fn, static_argnames=('cfg', 'settings'),
                         donate_argnames=('state',) if donate else ())
      self._programs[key] = compiled.lower(self.params, self.cfg, self.st, state, *args).compile()
      self.compile_s += time.perf_counter() - t
    return self._programs[key]

  def prompt_width(self, n: int) -> int:
    return min(-(-n // self.st.prompt_bucket) * self.st.prompt_bucket, self.st.cache_size)

  def complete(self, prompts: Sequence[Sequence[int]], row_ids: Sequence[int] | None = None,
               seed: int = 0, on_done: Callable[[int, list[int]], None] | None = None,
               batch_size: int | None = None):
    """Completes every prompt; returns one token list per prompt (EOS included when reached).

    row_ids: each prompt's global index (its sampling key is row_keys(seed, row_id)); default
    0..n-1. on_done(i, tokens) is called as soon as prompt i is complete. batch_size: rows
    (default the settings')."""
    gen = self.st.generation
    batch_size = batch_size or self.st.batch_size
    row_ids = list(range(len(prompts))) if row_ids is None else list(row_ids)
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f'prompt {i} is empty: every prompt needs at least one token')
      if len(p) + gen.max_new_tokens > self.st.cache_size:
        raise ValueError(f'prompt {i} has {len(p)} tokens: with max_new_tokens='
                         f'{gen.max_new_tokens} it needs a cache of {len(p) + gen.max_new_tokens}'
                         f' > cache_size={self.st.cache_size}')
    keys = np.asarray(ar.row_keys(seed, row_ids)) if prompts else None
    results: list[list[int] | None] = [None] * len(prompts)
    prompt_of_row = [-1] * batch_size  # the prompt each row holds (-1: free)
    queued = 0  # prompts 0..queued-1 have been given a row
    state = empty_state(self.cfg, dataclasses.replace(self.st, batch_size=batch_size))
    t0, compile0, busy = time.perf_counter(), self.compile_s, True
    while queued < len(prompts) or max(prompt_of_row) >= 0:
      for row, held in enumerate(prompt_of_row):  # every free row takes the next prompt
        if held < 0 and queued < len(prompts):
          state = self._prefill_into(state, row, prompts[queued], keys[queued])
          prompt_of_row[row], queued = queued, queued + 1
      live = [r for r, i in enumerate(prompt_of_row) if i >= 0]
      if (queued == len(prompts) and len(live) <= len(prompt_of_row) // 2 and
          len(prompt_of_row) // 2 >= self.st.min_tail_batch):
        # The tail: no prompt left to refill with, so halve the batch while the rows fit.
        B = len(prompt_of_row)
        while B // 2 >= self.st.min_tail_batch and len(live) <= B // 2:
          B //= 2
        rows = np.asarray(live + [r for r, i in enumerate(prompt_of_row) if i < 0][:B - len(live)],
                          np.int32)
        state = self._program(select_rows, state, rows, donate=False)(self.params, state, rows)
        prompt_of_row = [prompt_of_row[r] for r in rows]
        self.stats['tail_shrinks'] += 1
      done_B = np.asarray(state.done_B)
      if not any(done_B[r] for r, i in enumerate(prompt_of_row) if i >= 0):
        program = self._program(run_until_finish, state)
        t, steps = time.perf_counter(), int(state.steps)
        state = jax.block_until_ready(program(self.params, state))
        self.stats['decode_s'] += time.perf_counter() - t
        self.stats['decode_steps'] += int(state.steps) - steps
        self.stats['loop_calls'] += 1
        done_B = np.asarray(state.done_B)
      out_BxN, num_out_B = jax.device_get((state.out_BxN, state.num_out_B))
      if busy and queued == len(prompts):  # every row was busy until now: a long run's rate
        busy = False
        self.stats['busy_s'] += time.perf_counter() - t0 - (self.compile_s - compile0)
        self.stats['busy_tokens'] += (sum(len(r) for r in results if r is not None) +
                                      int(sum(num_out_B[r] for r, i in enumerate(prompt_of_row)
                                              if i >= 0)))
      for row, i in enumerate(prompt_of_row):
        if i >= 0 and done_B[row]:
          results[i] = out_BxN[row, :num_out_B[row]].tolist()
          prompt_of_row[row] = -1
          if on_done is not None:
            on_done(i, results[i])
    return results

  def _prefill_into(self, state, row: int, prompt, key):
    """Prefills one prompt into a free row (one program per prompt width)."""
    width = self.prompt_width(len(prompt))
    block = np.full((1, width), self.st.generation.pad_id, np.int32)
    block[0, :len(prompt)] = prompt
    args = (block, np.asarray([len(prompt)], np.int32), key[None], np.int32(row))
    program = self._program(refill, state, *args)
    t = time.perf_counter()
    state = jax.block_until_ready(program(self.params, state, *args))
    self.stats['prefill_s'] += time.perf_counter() - t
    return state


def cache_classes(prompt_lens: Sequence[int], max_new_tokens: int, bounds: Sequence[int],
                  multiple: int = 64) -> list[tuple[int, list[int]]]:
  """Groups prompt indices by length: [(cache_size, indices in input order)], a prompt in the
  class of the first bound >= its length.

  A class's cache is its bound + max_new_tokens rounded up to `multiple`, the same whatever
  prompts it holds: one compiled decode program per class for a whole run."""
  bounds = sorted(bounds)
  classes = {}
  for i, n in enumerate(prompt_lens):
    bound = next((b for b in bounds if n <= b), None)
    if bound is None:
      raise ValueError(f'prompt {i} has {n} tokens, more than the largest length bound '
                       f'{bounds[-1]}')
    classes.setdefault(-(-(bound + max_new_tokens) // multiple) * multiple, []).append(i)
  return sorted(classes.items())


class Generator:
  """Continuous batching over prompts of any length: one `Engine` per cache class (and batch
  size), kept across calls so a long run compiles each program once."""

  def __init__(self, params, cfg: model_lib.ModelConfig, settings: ar.GenerationSettings,
               batch_size: int, length_bounds: Sequence[int], prompt_bucket: int = 32):
    self.params, self.cfg, self.settings = params, cfg, settings
    self.batch_size, self.length_bounds = batch_size, tuple(length_bounds)
    self.prompt_bucket = prompt_bucket
    self.engines: dict[int, Engine] = {}  # by cache size

  @property
  def compile_s(self) -> float:
    return sum(e.compile_s for e in self.engines.values())

  def stats(self) -> dict:
    """Summed over engines (Engine.stats)."""
    keys = ('prefill_s', 'decode_s', 'decode_steps', 'loop_calls', 'tail_shrinks', 'busy_s',
            'busy_tokens')
    out = {k: sum(e.stats[k] for e in self.engines.values()) for k in keys}
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}

  def complete(self, prompts: Sequence[Sequence[int]], row_ids: Sequence[int] | None = None,
               seed: int = 0, on_done: Callable[[int, list[int]], None] | None = None):
    """As `Engine.complete`; the longest class runs first (it is the smallest: the short
    prompts, run last in input order, then complete in that order)."""
    row_ids = list(range(len(prompts))) if row_ids is None else list(row_ids)
    results: list[list[int] | None] = [None] * len(prompts)
    classes = cache_classes([len(p) for p in prompts], self.settings.max_new_tokens,
                            self.length_bounds)
    for cache_size, members in reversed(classes):
      # Every row of a batch costs a step, live or not: a small class gets fewer rows (a power
      # of two, so that few programs compile).
      batch = min(self.batch_size, 1 << (len(members) - 1).bit_length())
      if cache_size not in self.engines:
        self.engines[cache_size] = Engine(self.params, self.cfg, BatchSettings(
            self.settings, self.batch_size, cache_size, self.prompt_bucket))

      def done(j, tokens, members=members):
        results[members[j]] = tokens
        if on_done is not None:
          on_done(members[j], tokens)

      self.engines[cache_size].complete(
          [prompts[i] for i in members], [row_ids[i] for i in members], seed, done, batch)
    return results

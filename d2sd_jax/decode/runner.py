"""Runners: a method's prefill and decode loop, compiled once per shape and timed apart, and
the batching of a request's prompts through them."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.decode import options as options_lib
from d2sd_jax.models import xla_options
from d2sd_jax.perf import costmodel
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this, so few prefill programs compile

CACHE_BUCKET = 64

# The programs are compiled for a bound on new tokens, a multiple of this; each run's own limit
# is an argument, so runs of other lengths up to the bound reuse them.
NEW_TOKENS_BUCKET = 128


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class Runner:
  """Compiles a method's prefill and decode loop once per shape and times them apart, with the
  compiler options of the platform the parameters are on (models/xla_options.py).

  `prefill(params, prompts, lens, keys, max_new) -> state` and `loop(params, state) -> state`
  are the method's two programs (the loop is one `lax.while_loop`); `outputs(state)` reads the
  results. They are compiled for the settings' bound on new tokens (`max_new_tokens`); the
  limit of each run, `max_new`, is a traced argument: any limit up to the bound compiles
  nothing new.
  """

  def __init__(self, params, cfg, prefill_fn, loop_fn, static, cache_size: int):
    self.params, self.cfg, self.cache_size = params, cfg, cache_size
    self._prefill_fn, self._loop_fn, self._static = prefill_fn, loop_fn, static
    self.compile_s = 0.0
    self._prefill, self._loop = {}, {}  # compiled programs by prompt block shape

  @property
  def max_new_tokens(self) -> int:
    """The bound on new tokens the programs are compiled for."""
    settings = self._static
    return getattr(settings, 'generation', settings).max_new_tokens

  def _compiled_prefill(self, prompts, lens, keys, max_new):
    if prompts.shape not in self._prefill:
      t = time.perf_counter()
      fn = jax.jit(self._prefill_fn, static_argnames=('cfg', 'settings', 'cache_size'))
      self._prefill[prompts.shape] = fn.lower(self.params, self.cfg, self._static, prompts, lens,
                                              keys, self.cache_size, max_new).compile(
                                                  xla_options.for_arrays(self.params))
      self.compile_s += time.perf_counter() - t
    return self._prefill[prompts.shape]

  def _compiled_loop(self, state, shape):
    if shape not in self._loop:
      t = time.perf_counter()
      fn = jax.jit(self._loop_fn, static_argnames=('cfg', 'settings'), donate_argnames=('state',))
      self._loop[shape] = fn.lower(self.params, self.cfg, self._static, state).compile(
          xla_options.for_arrays(self.params))
      self.compile_s += time.perf_counter() - t
    return self._loop[shape]

  def new_token_limit(self, max_new: int | None):
    """`max_new` (None: the bound) as the prefill's argument, checked against the bound."""
    max_new = self.max_new_tokens if max_new is None else max_new
    if not 1 <= max_new <= self.max_new_tokens:
      raise ValueError(f'max_new_tokens={max_new} is outside 1..{self.max_new_tokens}, the '
                       'bound these programs were compiled for')
    return jnp.asarray(max_new, jnp.int32)

  def __call__(self, prompts_BxP, lens_B, keys_B, max_new: int | None = None):
    limit = self.new_token_limit(max_new)
    prefill = self._compiled_prefill(prompts_BxP, lens_B, keys_B, limit)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(self.params, prompts_BxP, lens_B, keys_B, limit))
    t1 = time.perf_counter()
    loop = self._compiled_loop(state, prompts_BxP.shape)
    t1b = time.perf_counter()  # compilation is not decode time
    state = jax.block_until_ready(loop(self.params, state))
    return state, t1 - t0, time.perf_counter() - t1b


class ARRunner(Runner):

  def __init__(self, target, settings: ar.GenerationSettings, cache_size: int):
    super().__init__(target.params, target.cfg, ar.prefill, ar.decode_loop, settings, cache_size)

  @staticmethod
  def outputs(state):
    """(tokens [B, N], counts [B], forward passes in the loop, cycles [B] or None, hist or None,
    expected draft tokens [B] or None, verified tree nodes [B] or None)"""
    out, counts, steps = jax.device_get((state.out_BxN, state.num_out_B, state.steps))
    return out, counts, int(steps), None, None, None, None


class SpecRunner(Runner):

  def __init__(self, params: dict, cfg, settings: SP.SpecSettings, prompt_len: int):
    super().__init__(SP.prepare(params, cfg), cfg, SP.init_state, SP.spec_loop, settings,
                     SP.cache_size_needed(prompt_len, settings))
    self.settings = settings

  def stage_times(self, prompts_BxP, lens_B, keys_B, max_new=None, repeats: int = 5) -> dict:
    """Median ms of each stage of one cycle, each compiled and run alone on the state after
    the prefill (inside the real loop they are one program: this is the breakdown)."""
    params, cfg, st = self.params, self.cfg, self.settings
    limit = self.new_token_limit(max_new)
    state = self._compiled_prefill(prompts_BxP, lens_B, keys_B, limit)(
        params, prompts_BxP, lens_B, keys_B, limit)
    draft = jax.jit(SP.draft, static_argnames=('cfg', 'settings'))
    verify = jax.jit(SP.verify, static_argnames=('cfg', 'settings'))
    accept = jax.jit(SP.accept_and_commit, static_argnames=('settings',))
    tree = draft(params, cfg, st, state)
    verified = verify(params, cfg, st, state, tree)
    stages = {'draft': lambda: draft(params, cfg, st, state),
              'verify': lambda: verify(params, cfg, st, state, tree),
              'accept': lambda: accept(params, st, state, tree, verified)}
    out = {}
    for name, fn in stages.items():
      jax.block_until_ready(fn())
      times = []
      for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
      out[name] = round(1e3 * sorted(times)[len(times) // 2], 3)
    return out

  def outputs(self, state):
    out = SP.generated(state, self.settings.generation.max_new_tokens)
    out, counts, steps, cycles, hist, expected, nodes = jax.device_get(
        (out, state.num_out_B, state.steps, state.cycles_B, state.accepted_hist_BxC,
         state.expected_B, state.verified_nodes_B))
    return out, counts, int(steps), cycles, hist, expected, nodes


def cache_limit(target, longest: int, max_new_tokens: int, cache_len: int,
                prompt_width: int = 0) -> int:
  """The usable cache length; a clear error when the prompt (padded to prompt_width, where that
  is longer) and new tokens do not fit."""
  limit = min(cache_len, target.cfg.max_position)
  if longest + max_new_tokens > limit:
    what, fix = ((f'prompt_width={prompt_width}', 'lower prompt_width')
                 if prompt_width >= longest else
                 (f'prompt of {longest} tokens', 'shorten the prompt'))
    raise ValueError(
        f'{what} + max_new_tokens={max_new_tokens} exceeds the cache length {limit} '
        f'(cache_len={cache_len}, model context {target.cfg.max_position}): {fix} or lower '
        'max_new_tokens' + (', or raise cache_len' if cache_len < target.cfg.max_position else ''))
  return limit


def new_tokens_bound(max_new_tokens: int, prompt_block: int, limit: int) -> int:
  """The bound on new tokens to compile for: max_new_tokens rounded up to NEW_TOKENS_BUCKET,
  where the usable cache (`limit`) has room for it after the prompt block."""
  return max(max_new_tokens, min(round_up(max_new_tokens, NEW_TOKENS_BUCKET),
                                 limit - prompt_block))


def make_runner(target, settings: ar.GenerationSettings, method: str, longest: int, limit: int,
                drafters: dict, **spec_fields) -> Runner:
  """The AR or speculative runner for prompts of up to `longest` tokens, compiled for up to
  settings.max_new_tokens new tokens (new_tokens_bound).

  drafters: {'drafter1': (DrafterConfig, params), ...} as the method needs (drafting.Method.drafters);
  spec_fields: the other SpecSettings fields (gamma, n_branches, steps, ...)."""
  prompt_block = round_up(longest, PROMPT_BUCKET)
  if method == 'ar':
    # One cache size for the whole run (one decode program), just large enough for it.
    cache_size = min(round_up(prompt_block + settings.max_new_tokens, CACHE_BUCKET),
                     max(limit, longest + settings.max_new_tokens))
    return ARRunner(target, settings, cache_size)
  params = {'target': target.params}
  cfgs = {}
  for name in options_lib.drafters_needed(method):
    if name in drafters:  # (a missing one: check() names it, SpecSettings refuses it)
      cfgs[name], params[name] = drafters[name]
  spec = SP.SpecSettings(generation=settings, method=method, **spec_fields, **cfgs)
  return SpecRunner(params, target.cfg, spec, prompt_block)


# The verification shapes an adaptive best-first tree chooses among (with its budget itself).
ADAPTIVE_SHAPES = (4, 8, 16, 32, 64)


def with_adaptive_costs(target, drafters: dict, method: str, spec_fields: dict, batch: int,
                        context: int, log=print) -> dict:
  """spec_fields with the costs an adaptive tree chooses by filled in where they are missing
  (measured_adaptive_costs); unchanged for a tree that is not adaptive or has them all."""
  if not spec_fields.get('adaptive'):
    return spec_fields
  # (SpecSettings.takes_lookup_cycles, before its settings can be made: they need these costs)
  lookup = spec_fields.get('lookup_cycles', True) and drafting.get(method).lookup
  if spec_fields.get('node_costs') and (not lookup or spec_fields.get('lookup_cost')):
    return spec_fields
  measured = measured_adaptive_costs(target, drafters, method, spec_fields, batch, context,
                                     lookup, log)
  return {**spec_fields, **{k: v for k, v in measured.items() if not spec_fields.get(k)}}


def measured_adaptive_costs(target, drafters: dict, method: str, spec_fields: dict, batch: int,
                            context: int, lookup: bool, log=print) -> dict:
  """The SpecSettings costs an adaptive tree chooses by, as measured on this machine
  (perf.costmodel.measure, cached in its cost cache); `lookup`: the tree takes lookup-only
  cycles:
    node_costs   for each shape of ADAPTIVE_SHAPES below its budget, and the budget, the seconds
                 of one cycle: the draft, then verifying and accepting that many nodes;
    lookup_cost  with `lookup`: a cycle that verifies prompt lookup's gamma nodes alone (its
                 draft, verification and acceptance)."""
  cfgs = {n: drafters[n][0] for n in options_lib.drafters_needed(method)}
  gen = ar.GenerationSettings(max_new_tokens=1, eos_ids=(), pad_id=0)
  fixed = SP.SpecSettings(gen, method=method, **{
      **spec_fields, 'adaptive': False, 'node_costs': (), 'lookup_cycles': False,
      'lookup_cost': 0.0}, **cfgs)
  pld = SP.SpecSettings(gen, method='pld', gamma=fixed.gamma, ngram_max=fixed.ngram_max)
  sizes = sorted({n for n in ADAPTIVE_SHAPES if n < fixed.tree_size} | {fixed.tree_size})
  params = {'target': target.params, **{n: drafters[n][1] for n in cfgs}}
  costs = costmodel.measure(params, target.cfg, [fixed] + [pld] * lookup, batch=batch,
                            context=context, sizes=tuple(sorted({2, fixed.gamma, *sizes})),
                            log=log)
  part = lambda spec, n: costs.draft[costmodel.draft_key(spec)] + costs.at(
      'verify', n) + costs.at('accept', n)
  out = {'node_costs': tuple((n, round(part(fixed, n), 7)) for n in sizes)}
  if lookup:
    out['lookup_cost'] = round(part(pld, fixed.gamma), 7)
  return out


def decode_prompts(runner: Runner, tok, prompt_ids: list[list[int]], batch_size: int, seed: int,
                   width: int | None = None, first_row: int = 0, max_new: int | None = None):
  """Generates up to `max_new` tokens (None: the runner's bound) for every prompt in batches of
  `batch_size`. Returns (completion ids per prompt,
  stats dict: prefill_s, decode_s, decode_steps, cycles, hist, expected, first_batch, and
  node_tally [sources, depths, bins, 3] where the settings tally nodes).

  Every batch gets the same prompt width, `width` or else the longest prompt's, bucketed: one
  prefill and one decode-loop program for the run, whatever the prompt lengths of each batch
  (a caller decoding a request in parts passes the whole request's width, and the index of the
  part's first prompt in the request, `first_row`, which seeds each row's sampling key)."""
  completions = []
  stats = {'prefill_s': 0.0, 'decode_s': 0.0, 'decode_steps': 0, 'cycles': 0, 'hist': None,
           'expected': 0.0, 'nodes': 0}
  B = batch_size
  width = round_up(width or max(len(p) for p in prompt_ids), PROMPT_BUCKET)
  for start in range(0, len(prompt_ids), B):
    rows = list(range(start, min(start + B, len(prompt_ids))))
    # A short last batch is filled with copies of its first row (same program, outputs dropped).
    batch = [prompt_ids[r] for r in rows] + [prompt_ids[rows[0]]] * (B - len(rows))
    block, lens = ar.pad_prompts(batch, tok.pad_id, PROMPT_BUCKET, width)
    block = block[:, :runner.cache_size]  # only padding is cut: cache >= longest + new tokens
    keys = ar.row_keys(seed, [first_row + r for r in rows + [rows[0]] * (B - len(rows))])
    if start == 0:
      stats['first_batch'] = (block, lens, keys, max_new)
    state, t_prefill, t_decode = runner(block, lens, keys, max_new)
    stats['prefill_s'] += t_prefill
    stats['decode_s'] += t_decode
    out_ids, counts, steps, row_cycles, row_hist, row_expected, row_nodes = runner.outputs(state)
    stats['decode_steps'] += steps
    for i, _ in enumerate(rows):
      completions.append([int(t) for t in out_ids[i, :counts[i]]])
      if row_cycles is not None:
        stats['cycles'] += int(row_cycles[i])
        stats['hist'] = row_hist[i] if stats['hist'] is None else stats['hist'] + row_hist[i]
        stats['expected'] += float(row_expected[i])
        stats['nodes'] += int(row_nodes[i])
    alone = getattr(state, 'lookup_only_B', None)  # SpecSettings.lookup_cycles: the real rows'
    if alone is not None:
      stats['lookup_only'] = stats.get('lookup_only', 0) + int(
          np.asarray(jax.device_get(alone))[:len(rows)].sum())
    tally = getattr(state, 'node_tally', None)  # SpecSettings.tally_nodes: the real rows'
    if tally is not None:
      tally = np.asarray(jax.device_get(tally))[:len(rows)].sum(0)
      stats['node_tally'] = tally if 'node_tally' not in stats else stats['node_tally'] + tally
  return completions, stats


def add_stats(a: dict, b: dict) -> dict:
  """decode_prompts' stats of two parts of one request, as one (the first part's first batch;
  the parts' methods share gamma, so their acceptance histograms add)."""
  out = dict(a)
  for k in ('prefill_s', 'decode_s', 'decode_steps', 'cycles', 'expected', 'nodes'):
    out[k] = a[k] + b[k]
  out['hist'] = b['hist'] if a['hist'] is None else a['hist'] if b['hist'] is None else (
      a['hist'] + b['hist'])
  if 'node_tally' in b:
    out['node_tally'] = b['node_tally'] + a.get('node_tally', 0)
  if 'lookup_only' in a or 'lookup_only' in b:
    out['lookup_only'] = a.get('lookup_only', 0) + b.get('lookup_only', 0)
  return out

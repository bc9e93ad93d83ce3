"""What `decode.py` runs: load the target, read prompts, generate in batches, report stats.

The last stdout line is one JSON object of stats (timings exclude compilation):
  method, prompts, new_tokens, compile_s, prefill_s, decode_s, decode_tokens_per_s, ...
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax
import ml_collections

from d2sd_jax import checkpoints as ckpt
from d2sd_jax import config_check
from d2sd_jax import drafting
from d2sd_jax import generate as G
from d2sd_jax import loaders
from d2sd_jax import sampling as sampling_lib
from d2sd_jax import sharding
from d2sd_jax import speculative as SP

METHODS = ('ar',) + tuple(drafting.REGISTRY)
PROMPT_BUCKET = 64  # prompts are padded to a multiple of this, so few prefill programs compile
CACHE_BUCKET = 64


def validate(config: ml_collections.ConfigDict) -> None:
  """Start-up checks that name the field and the fix."""
  config_check.check_fields(config, config_check.DECODE_FIELDS, 'decode')
  if config.method not in METHODS:
    raise ValueError(f'method={config.method!r} is not one of {METHODS}')
  if config.max_new_tokens < 1:
    raise ValueError(f'max_new_tokens={config.max_new_tokens} must be >= 1')
  if config.batch_size < 1:
    raise ValueError(f'batch_size={config.batch_size} must be >= 1')
  if config.method != 'ar' and config.gamma < 2:
    raise ValueError(f'gamma={config.gamma} must be >= 2 (the anchor plus at least one draft)')
  if config.cache_len < 2:
    raise ValueError(f'cache_len={config.cache_len} must be >= 2 (prompt + new tokens per row)')
  if bool(config.prompt) == bool(config.prompts_file):
    raise ValueError('give exactly one of prompt (a string) and prompts_file (a JSONL path with '
                     'a "prompt" field per line)')
  sampling_settings(config)  # raises on invalid temperature / top_k / top_p


def sampling_settings(config) -> sampling_lib.SamplingSettings:
  return sampling_lib.SamplingSettings(temperature=float(config.temperature),
                                       top_k=int(config.top_k), top_p=float(config.top_p))


def read_prompts(config) -> list[str]:
  if config.prompt:
    return [config.prompt]
  prompts = []
  try:
    with open(config.prompts_file) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          prompts.append(json.loads(line)['prompt'])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
          raise ValueError(f'{config.prompts_file}:{n}: each line must be a JSON object with a '
                           f'"prompt" field ({e})') from e
  except FileNotFoundError as e:
    raise FileNotFoundError(f'prompts_file {config.prompts_file!r} not found') from e
  if not prompts:
    raise ValueError(f'prompts_file {config.prompts_file!r} has no prompts')
  return prompts


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class Runner:
  """Compiles a method's prefill and decode loop once per shape and times them apart.

  `prefill(params, prompts, lens, keys) -> state` and `loop(params, state) -> state` are the
  method's two programs (the loop is one `lax.while_loop`); `outputs(state)` reads the results.
  """

  def __init__(self, params, cfg, prefill_fn, loop_fn, static, cache_size: int):
    self.params, self.cfg, self.cache_size = params, cfg, cache_size
    self._prefill_fn, self._loop_fn, self._static = prefill_fn, loop_fn, static
    self.compile_s = 0.0
    self._prefill, self._loop = {}, None

  def _compiled_prefill(self, prompts, lens, keys):
    if prompts.shape not in self._prefill:
      t = time.perf_counter()
      fn = jax.jit(self._prefill_fn, static_argnums=(1, 2, 6))
      self._prefill[prompts.shape] = fn.lower(self.params, self.cfg, self._static, prompts, lens,
                                              keys, self.cache_size).compile()
      self.compile_s += time.perf_counter() - t
    return self._prefill[prompts.shape]

  def _compiled_loop(self, state):
    if self._loop is None:
      t = time.perf_counter()
      fn = jax.jit(self._loop_fn, static_argnums=(1, 2), donate_argnums=(3,))
      self._loop = fn.lower(self.params, self.cfg, self._static, state).compile()
      self.compile_s += time.perf_counter() - t
    return self._loop

  def __call__(self, prompts_BxP, lens_B, keys_B):
    prefill = self._compiled_prefill(prompts_BxP, lens_B, keys_B)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(self.params, prompts_BxP, lens_B, keys_B))
    t1 = time.perf_counter()
    loop = self._compiled_loop(state)
    t1b = time.perf_counter()  # compilation is not decode time
    state = jax.block_until_ready(loop(self.params, state))
    return state, t1 - t0, time.perf_counter() - t1b


class ARRunner(Runner):

  def __init__(self, target, settings: G.GenerationSettings, cache_size: int):
    super().__init__(target.params, target.cfg, G.prefill, G.decode_loop, settings, cache_size)

  @staticmethod
  def outputs(state):
    """(tokens [B, N], counts [B], forward passes in the loop, cycles [B] or None, hist or None)"""
    out, counts, steps = jax.device_get((state.out_BxN, state.num_out_B, state.steps))
    return out, counts, int(steps), None, None


class SpecRunner(Runner):

  def __init__(self, params: dict, cfg, settings: SP.SpecSettings, prompt_len: int):
    super().__init__(params, cfg, SP.init_state, SP.spec_loop, settings,
                     SP.cache_size_needed(prompt_len, settings))
    self.settings = settings

  def stage_times(self, prompts_BxP, lens_B, keys_B, repeats: int = 5) -> dict:
    """Median ms of each stage of one cycle, each compiled and run alone on the state after
    the prefill (inside the real loop they are one program: this is the breakdown)."""
    params, cfg, st = self.params, self.cfg, self.settings
    state = self._compiled_prefill(prompts_BxP, lens_B, keys_B)(params, prompts_BxP, lens_B,
                                                                 keys_B)
    draft = jax.jit(SP.draft, static_argnums=(1, 2))
    verify = jax.jit(SP.verify, static_argnums=(1, 2))
    accept = jax.jit(SP.accept_and_commit, static_argnums=(1,))
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
    out, counts, steps, cycles, hist = jax.device_get(
        (out, state.num_out_B, state.steps, state.cycles_B, state.accepted_hist_BxK))
    return out, counts, int(steps), cycles, hist


def cache_limit(target, longest: int, max_new_tokens: int, cache_len: int) -> int:
  """The usable cache length; a clear error when the prompt and new tokens do not fit."""
  limit = min(cache_len, target.cfg.max_position)
  if longest + max_new_tokens > limit:
    raise ValueError(
        f'prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the cache '
        f'length {limit} (cache_len={cache_len}, model context {target.cfg.max_position}): '
        'shorten the prompt or lower max_new_tokens' +
        (', or raise cache_len' if cache_len < target.cfg.max_position else ''))
  return limit


def make_runner(target, settings: G.GenerationSettings, method: str, longest: int, limit: int,
                drafters: dict, **spec_fields) -> Runner:
  """The AR or speculative runner for prompts of up to `longest` tokens.

  drafters: {'drafter1': (DrafterConfig, params), ...} as the method needs (drafting.Method.drafters);
  spec_fields: the other SpecSettings fields (gamma, n_branches, steps, ...)."""
  prompt_block = _round_up(longest, PROMPT_BUCKET)
  if method == 'ar':
    # One cache size for the whole run (one decode program), just large enough for it.
    cache_size = min(_round_up(prompt_block + settings.max_new_tokens, CACHE_BUCKET),
                     max(limit, longest + settings.max_new_tokens))
    return ARRunner(target, settings, cache_size)
  params = {'target': target.params}
  cfgs = {}
  for name in drafting.get(method).drafters:
    if name not in drafters:
      raise ValueError(f'method={method!r} needs {name}: set --config.{name}=PATH (a train.py '
                       'workdir or an exported drafter)')
    cfgs[name], params[name] = drafters[name]
  spec = SP.SpecSettings(generation=settings, method=method, **spec_fields, **cfgs)
  return SpecRunner(params, target.cfg, spec, prompt_block)


def decode_prompts(runner: Runner, tok, prompt_ids: list[list[int]], batch_size: int, seed: int):
  """Generates for every prompt in batches of `batch_size`. Returns (completion ids per prompt,
  stats dict: prefill_s, decode_s, decode_steps, cycles, hist, first_batch)."""
  completions = []
  stats = {'prefill_s': 0.0, 'decode_s': 0.0, 'decode_steps': 0, 'cycles': 0, 'hist': None}
  B = batch_size
  # Every batch gets the same prompt width (the longest prompt's, bucketed): one prefill and one
  # decode-loop program for the run, whatever the prompt lengths of each batch.
  width = _round_up(max(len(p) for p in prompt_ids), PROMPT_BUCKET)
  for start in range(0, len(prompt_ids), B):
    rows = list(range(start, min(start + B, len(prompt_ids))))
    # A short last batch is filled with copies of its first row (same program, outputs dropped).
    batch = [prompt_ids[r] for r in rows] + [prompt_ids[rows[0]]] * (B - len(rows))
    block, lens = G.pad_prompts(batch, tok.pad_id, PROMPT_BUCKET, width)
    block = block[:, :runner.cache_size]  # only padding is cut: cache >= longest + new tokens
    keys = G.row_keys(seed, rows + [rows[0]] * (B - len(rows)))
    if start == 0:
      stats['first_batch'] = (block, lens, keys)
    state, t_prefill, t_decode = runner(block, lens, keys)
    stats['prefill_s'] += t_prefill
    stats['decode_s'] += t_decode
    out_ids, counts, steps, row_cycles, row_hist = runner.outputs(state)
    stats['decode_steps'] += steps
    for i, _ in enumerate(rows):
      completions.append([int(t) for t in out_ids[i, :counts[i]]])
      if row_cycles is not None:
        stats['cycles'] += int(row_cycles[i])
        stats['hist'] = row_hist[i] if stats['hist'] is None else stats['hist'] + row_hist[i]
  return completions, stats


def run(config: ml_collections.ConfigDict, out=sys.stdout) -> dict:
  validate(config)
  prompts = read_prompts(config)
  sharding.maybe_initialize_distributed(config.get('distributed', False))
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.model) if 'mesh' in config else None
  target = loaders.load_target(config.target, config.dtype)
  if mesh is not None and mesh.size > 1:  # tensor parallel: weights split over 'model'
    target = dataclasses.replace(target, params=jax.device_put(
        target.params, sharding.target_shardings(mesh, target.params)))
  tok = target.tokenizer
  if tok is None:
    raise FileNotFoundError(f'target {config.target!r} has no tokenizer (tokenizer.json)')
  prompt_ids = [tok.encode_prompt(p, config.chat) for p in prompts]
  longest = max(len(p) for p in prompt_ids)
  limit = cache_limit(target, longest, config.max_new_tokens, config.cache_len)
  settings = G.GenerationSettings(max_new_tokens=config.max_new_tokens, eos_ids=tok.eos_ids,
                                  pad_id=tok.pad_id, sampling=sampling_settings(config))
  drafters = {}
  if config.method != 'ar':
    for name in drafting.get(config.method).drafters:
      if config[name]:
        dcfg, dparams, _ = ckpt.load_drafter(config[name], target)
        if mesh is not None and mesh.size > 1:
          dparams = jax.device_put(dparams, sharding.drafter_shardings(mesh, dparams))
        drafters[name] = (dcfg, dparams)
  runner = make_runner(target, settings, config.method, longest, limit, drafters,
                       gamma=config.gamma, ngram_max=config.ngram_max,
                       n_branches=config.n_branches, steps=config.steps, order=config.order,
                       tree_budget=config.tree_budget, leniency=config.leniency)
  completions, st = decode_prompts(runner, tok, prompt_ids, config.batch_size, config.seed)
  results, new_tokens = [], 0
  for prompt, ids in zip(prompts, completions):
    new_tokens += len(ids)
    text = tok.decode([t for t in ids if t not in tok.eos_ids])
    results.append({'prompt': prompt, 'completion': text, 'completion_ids': ids})
    print(f'=== [{len(results) - 1}] {prompt!r}\n{text}', file=out)

  if config.output:
    with open(config.output, 'w') as f:
      for row in results:
        f.write(json.dumps(row) + '\n')
  decode_tokens = new_tokens - len(prompts)  # each row's first token comes from the prefill
  decode_s, decode_steps = st['decode_s'], st['decode_steps']
  stats = {
      'method': config.method, 'target': config.target, 'prompts': len(prompts),
      'batch_size': config.batch_size, 'new_tokens': new_tokens,
      'compile_s': round(runner.compile_s, 3), 'prefill_s': round(st['prefill_s'], 4),
      'decode_s': round(decode_s, 4),
      'decode_tokens_per_s': round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
      'decode_steps': decode_steps,
      'ms_per_decode_step': round(1e3 * decode_s / decode_steps, 3) if decode_steps else None,
  }
  if config.method != 'ar':
    # tau: tokens committed per verification cycle, bonus included (AR would be 1).
    cycles = st['cycles']
    stats.update(gamma=config.gamma, tree_size=runner.settings.tree_size, cycles=cycles,
                 tau=round(decode_tokens / cycles, 3) if cycles else None,
                 accepted_histogram=[int(h) for h in st['hist']],
                 stage_ms=runner.stage_times(*st['first_batch']))
  print(json.dumps(stats), file=out)
  return stats

"""The one generation path: `generate(target, drafters, prompts, options)`.

decode.py's config (`run`) and the notebook API's keywords (`Decoder.generate`) both become an
`Options` and go through `generate`, so they share the defaults, the checks, the compiled
programs and the stats. decode.py prints the completions, then, as its last stdout line, one
JSON object of stats (timings exclude compilation):
  method, target, prompts, new_tokens, compile_s, prefill_s, decode_s, decode_tokens_per_s, ...
"""
from __future__ import annotations

import dataclasses
import json
import os
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

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this, so few prefill programs compile
CACHE_BUCKET = 64
DRAFTERS = ('drafter1', 'drafter2')  # config fields / Decoder.drafters keys of drafter paths
AUTO_BATCH = 8  # batch_size=0: the prompts decoded together, this many at most
# decode.py with neither prompt nor prompts_file: a demo prompt (so an explicit prompts_file
# never collides with a default prompt).
DEMO_PROMPT = 'Write a Python function that returns the n-th Fibonacci number.'


@dataclasses.dataclass(frozen=True)
class Options:
  """One generation request besides the models and prompts. decode.py's config
  (`options_from_config`) and Decoder.generate's keywords both become this: the defaults live
  here (configs/smollm2.py repeats them, a test keeps the two equal)."""
  method: str  # 'ar' or a drafting method (drafting.REGISTRY, read at call time)
  max_new_tokens: int = 128  # per prompt; generation also stops at EOS
  chat: bool = True  # wrap each prompt in the target's chat template
  # Extra chat-template variables, as transformers' apply_chat_template(**kwargs) takes them:
  # e.g. {'enable_thinking': False} (Qwen3), {'tools': [...]}. decode.py: a JSON string.
  chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  seed: int = 0  # row r of the prompt list samples with fold_in(seed, r)
  batch_size: int = 0  # prompts decoded together (0 = all of them, AUTO_BATCH at most)
  cache_len: int = 2048  # KV cache capacity per row: prompt + max_new_tokens must fit
  # SpecSettings knobs (gamma, n_branches, steps, ...); a missing one takes `spec_fields`' default.
  spec: dict = dataclasses.field(default_factory=dict)
  stage_times: bool = False  # also time draft / verify / accept alone (3 more programs compile)
  # method='auto': probe again even where this machine remembers a choice for the same key
  # (autoconfig.remembered_key), and remember the new one
  auto_refresh: bool = False


def methods() -> tuple[str, ...]:
  """'ar', 'auto' (d2sd_jax/autoconfig.py) and every drafting method registered now
  (drafting.register may add one any time)."""
  return ('ar', 'auto') + tuple(drafting.REGISTRY)


def drafters_needed(method: str) -> tuple[str, ...]:
  """Drafters a method cannot run without ('auto' weighs whichever are at hand)."""
  return () if method in ('ar', 'auto') else drafting.get(method).drafters


def generation_settings(options: Options, eos_ids=(), pad_id: int = 0) -> G.GenerationSettings:
  """The settings dataclasses own their checks (max_new_tokens, temperature, top_k, top_p)."""
  sampling = sampling_lib.SamplingSettings(temperature=float(options.temperature),
                                           top_k=int(options.top_k), top_p=float(options.top_p))
  return G.GenerationSettings(max_new_tokens=options.max_new_tokens, eos_ids=tuple(eos_ids),
                              pad_id=pad_id, sampling=sampling)


def check(options: Options, drafters) -> None:
  """Every check that needs no model, before anything loads. `drafters`: the drafter names at
  hand (loaded, or given as paths). The speculative knobs' values are checked by SpecSettings."""
  if options.method not in methods():
    raise ValueError(f'method={options.method!r} is not one of {methods()}')
  missing = [n for n in drafters_needed(options.method) if n not in drafters]
  if missing:
    raise ValueError(
        f'method={options.method!r} needs {" and ".join(missing)} (a train.py workdir or an '
        'exported drafter): ' + ', '.join(f'--config.{n}=PATH' for n in missing) +
        ' in decode.py, d2sd_jax.load(..., ' + ', '.join(f'{n}=PATH' for n in missing) +
        ') in a notebook')
  generation_settings(options)
  if options.batch_size < 0:
    raise ValueError(f'batch_size={options.batch_size} must be >= 1, or 0 (all prompts together, '
                     f'{AUTO_BATCH} at most)')
  if options.cache_len < 2:
    raise ValueError(f'cache_len={options.cache_len} must be >= 2 (prompt + new tokens per row)')
  if not isinstance(options.chat_template_kwargs, dict):
    raise ValueError(f'chat_template_kwargs={options.chat_template_kwargs!r} must be a dict of '
                     "template variables, such as {'enable_thinking': False}")
  config_check.check_fields(options.spec, dict.fromkeys(config_check.SPEC_KNOBS), 'speculative')


def _spec_default(name: str):
  return {f.name: f.default for f in dataclasses.fields(SP.SpecSettings)}[name]


def spec_fields(options: Options, drafters: dict) -> dict:
  """The request's SpecSettings knobs; of those it leaves out (or None), gamma is drafter 1's
  block length when drafter 1 is at hand and n_branches is capped at gamma-1; the others take
  SpecSettings' defaults."""
  if options.method == 'ar':
    return {}
  spec = {k: v for k, v in options.spec.items() if v is not None}
  if 'gamma' not in spec and 'drafter1' in drafters:
    spec['gamma'] = drafters['drafter1'][0].gamma
  if 'n_branches' not in spec:
    spec['n_branches'] = min(_spec_default('n_branches'),
                             spec.get('gamma', _spec_default('gamma')) - 1)
  return spec


def options_from_config(config: ml_collections.ConfigDict) -> Options:
  """Options from a decode config: the top-level fields of the same names and the `spec` group
  (a field the config leaves out takes Options' default)."""
  given = {f.name: config[f.name] for f in dataclasses.fields(Options)
           if f.name != 'spec' and f.name in config}
  if 'chat_template_kwargs' in given:
    given['chat_template_kwargs'] = parse_chat_template_kwargs(given['chat_template_kwargs'])
  spec = config.get('spec') or {}
  return Options(**given, spec=spec.to_dict() if hasattr(spec, 'to_dict') else dict(spec))


def parse_chat_template_kwargs(value) -> dict:
  """decode.py's chat_template_kwargs: a JSON object as a string, because a flag can only set a
  field the config file already has (`--config.chat_template_kwargs='{"enable_thinking":
  false}'` works whatever the keys); '' means none. A dict (or ConfigDict) is taken as it is."""
  if hasattr(value, 'to_dict'):
    value = value.to_dict()
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f'chat_template_kwargs={value!r} is not valid JSON ({e}): give an object '
                       'such as \'{"enable_thinking": false}\'') from e
  if not isinstance(value, dict):
    raise ValueError(f'chat_template_kwargs={value!r} must be a JSON object (template variable '
                     'names to values), such as \'{"enable_thinking": false}\'')
  return value


def validate(config: ml_collections.ConfigDict) -> Options:
  """decode.py's start-up checks, before anything loads: they name the field and the fix."""
  config_check.check_fields(config, config_check.DECODE_FIELDS, 'decode')
  if config.prompt and config.prompts_file:
    raise ValueError('give prompt (a string) or prompts_file (a JSONL path with a "prompt" field '
                     'per line), not both')
  options = options_from_config(config)
  check(options, [n for n in DRAFTERS if config.get(n)])
  return options


def read_prompts(config) -> list[str | list[dict]]:
  """The prompt, or every line of prompts_file: a {"prompt": ...} line gives its text; a
  conversation (ShareGPT `conversations`, OpenAI `messages`, DFlash `{"turns": [...]}`, read by
  `conversations.read`) gives its system message and FIRST user turn as chat messages (a
  benchmark of first turns; later turns would answer replies the target did not write)."""
  if config.prompt:
    return [config.prompt]
  if not config.prompts_file:
    return [DEMO_PROMPT]
  if not os.path.exists(config.prompts_file):
    raise FileNotFoundError(f'prompts_file {config.prompts_file!r} not found')
  from d2sd_jax import conversations  # pylint: disable=import-outside-toplevel
  try:
    convs = conversations.read(config.prompts_file)
  except ValueError as e:
    if 'no prompts' in str(e):
      raise ValueError(f'prompts_file {config.prompts_file!r} has no prompts') from e
    raise
  return [c.user_turns[0] if c.style == 'prompt' else c.messages([]) for c in convs]


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
    self._prefill, self._loop = {}, {}  # compiled programs by prompt block shape

  def _compiled_prefill(self, prompts, lens, keys):
    if prompts.shape not in self._prefill:
      t = time.perf_counter()
      fn = jax.jit(self._prefill_fn, static_argnums=(1, 2, 6))
      self._prefill[prompts.shape] = fn.lower(self.params, self.cfg, self._static, prompts, lens,
                                              keys, self.cache_size).compile()
      self.compile_s += time.perf_counter() - t
    return self._prefill[prompts.shape]

  def _compiled_loop(self, state, shape):
    if shape not in self._loop:
      t = time.perf_counter()
      fn = jax.jit(self._loop_fn, static_argnums=(1, 2), donate_argnums=(3,))
      self._loop[shape] = fn.lower(self.params, self.cfg, self._static, state).compile()
      self.compile_s += time.perf_counter() - t
    return self._loop[shape]

  def __call__(self, prompts_BxP, lens_B, keys_B):
    prefill = self._compiled_prefill(prompts_BxP, lens_B, keys_B)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill(self.params, prompts_BxP, lens_B, keys_B))
    t1 = time.perf_counter()
    loop = self._compiled_loop(state, prompts_BxP.shape)
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
    super().__init__(SP.prepare(params, cfg), cfg, SP.init_state, SP.spec_loop, settings,
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
        (out, state.num_out_B, state.steps, state.cycles_B, state.accepted_hist_BxC))
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
  for name in drafters_needed(method):
    if name in drafters:  # (a missing one: check() names it, SpecSettings refuses it)
      cfgs[name], params[name] = drafters[name]
  spec = SP.SpecSettings(generation=settings, method=method, **spec_fields, **cfgs)
  return SpecRunner(params, target.cfg, spec, prompt_block)


def decode_prompts(runner: Runner, tok, prompt_ids: list[list[int]], batch_size: int, seed: int,
                   width: int | None = None):
  """Generates for every prompt in batches of `batch_size`. Returns (completion ids per prompt,
  stats dict: prefill_s, decode_s, decode_steps, cycles, hist, first_batch).

  Every batch gets the same prompt width, `width` or else the longest prompt's, bucketed: one
  prefill and one decode-loop program for the run, whatever the prompt lengths of each batch
  (a caller decoding a request in parts passes the whole request's width)."""
  completions = []
  stats = {'prefill_s': 0.0, 'decode_s': 0.0, 'decode_steps': 0, 'cycles': 0, 'hist': None}
  B = batch_size
  width = _round_up(width or max(len(p) for p in prompt_ids), PROMPT_BUCKET)
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


def tokenizer_of(target: loaders.Target):
  if target.tokenizer is None:
    raise ValueError(f'target {target.source!r} has no tokenizer (tokenizer.json): a decoder '
                     'needs one')
  return target.tokenizer


def generate(target: loaders.Target, drafters: dict, prompts: str | list[str], options: Options,
             runners: dict | None = None) -> tuple[list[dict], dict]:
  """Completes each prompt: the one path of decode.py and Decoder.generate.

  drafters: {'drafter1': (DrafterConfig, params), ...} (those the method needs, at least);
  runners: a dict keeping compiled programs across calls (a Decoder's), or None.
  Returns (one {'prompt', 'completion', 'completion_ids'} per prompt, stats)."""
  check(options, drafters)
  prompts = [prompts] if isinstance(prompts, str) else list(prompts)
  if not prompts:
    raise ValueError('no prompts: give a string or a non-empty list of strings')
  tok = tokenizer_of(target)
  prompt_ids = [tok.encode_prompt(p, options.chat, options.chat_template_kwargs)
                for p in prompts]
  longest = max(len(p) for p in prompt_ids)
  limit = cache_limit(target, longest, options.max_new_tokens, options.cache_len)
  batch = options.batch_size or min(len(prompts), AUTO_BATCH)
  auto_stats = {}
  if options.method == 'auto':
    from d2sd_jax import autoconfig  # pylint: disable=import-outside-toplevel
    # (its progress lines go to stderr: stdout carries the completions and the stats line)
    options, auto_stats = autoconfig.choose(target, drafters, prompt_ids, options, batch, tok,
                                            log=lambda line: print(line, file=sys.stderr))
  settings = generation_settings(options, tok.eos_ids, tok.pad_id)
  spec = spec_fields(options, drafters)
  # A runner's decode loop compiles for one batch shape: the batch is part of the key.
  key = (options.method, settings, _round_up(longest, PROMPT_BUCKET), limit, batch,
         tuple(sorted(spec.items())))
  runners = {} if runners is None else runners
  if key not in runners:
    runners[key] = make_runner(target, settings, options.method, longest, limit, drafters,
                               **spec)
  runner = runners[key]
  compiled_before = runner.compile_s
  ids, st = decode_prompts(runner, tok, prompt_ids, batch, options.seed)
  completions = [{'prompt': p, 'completion': tok.decode([t for t in row if t not in tok.eos_ids]),
                  'completion_ids': row} for p, row in zip(prompts, ids)]
  new_tokens = sum(len(row) for row in ids)
  decode_tokens = new_tokens - len(prompts)  # each row's first token comes from the prefill
  decode_s, decode_steps = st['decode_s'], st['decode_steps']
  stats = {
      'method': options.method, 'prompts': len(prompts), 'batch_size': batch,
      'new_tokens': new_tokens, 'compile_s': round(runner.compile_s - compiled_before, 3),
      'prefill_s': round(st['prefill_s'], 4), 'decode_s': round(decode_s, 4),
      'decode_tokens_per_s': round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
      'decode_steps': decode_steps,
      'ms_per_decode_step': round(1e3 * decode_s / decode_steps, 3) if decode_steps else None,
  }
  if options.method != 'ar':
    # tau: tokens committed per verification cycle, bonus included (AR would be 1).
    cycles = st['cycles']
    stats.update(gamma=runner.settings.gamma, tree_size=runner.settings.tree_size, cycles=cycles,
                 tau=round(decode_tokens / cycles, 3) if cycles else None,
                 accepted_histogram=[int(h) for h in st['hist']])
    if options.stage_times:  # three more programs to compile: only on request
      stats['stage_ms'] = runner.stage_times(*st['first_batch'])
  stats.update(auto_stats)
  return completions, stats


def run(config: ml_collections.ConfigDict, out=sys.stdout) -> dict:
  """decode.py: checks, loads the target and the method's drafters, generates, reports."""
  options = validate(config)
  prompts = read_prompts(config)
  sharding.maybe_initialize_distributed(config.get('distributed', False))
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.model) if 'mesh' in config else None
  split = mesh is not None and mesh.size > 1  # tensor parallel: weights split over 'model'
  target = loaders.load_target(config.target, config.dtype, mesh if split else None)
  tokenizer_of(target)
  drafters = {}
  wanted = ([n for n in DRAFTERS if config.get(n)] if options.method == 'auto' else
            drafters_needed(options.method))
  for name in wanted:
    dcfg, dparams, _ = ckpt.load_drafter(config[name], target, config.dtype,
                                         mesh if split else None)
    drafters[name] = (dcfg, dparams)
  completions, stats = generate(target, drafters, prompts, options)
  for i, row in enumerate(completions):
    print(f'=== [{i}] {row["prompt"]!r}\n{row["completion"]}', file=out)
  if config.output:
    with open(config.output, 'w') as f:
      for row in completions:
        f.write(json.dumps(row) + '\n')
  stats = {'method': stats['method'], 'target': config.target, **stats}
  print(json.dumps(stats), file=out)
  return stats

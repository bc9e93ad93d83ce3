"""One generation request besides the models and prompts: `Options`, its checks, and how a
decode config or a notebook's keywords become one."""
from __future__ import annotations

import dataclasses
import json
import os

import ml_collections
from ml_collections.config_dict import placeholder

from d2sd_jax import config_check
from d2sd_jax.decode import quality_route
from d2sd_jax.formats import conversations
from d2sd_jax.models import sampling as sampling_lib
from d2sd_jax.spec_decode import ar
from d2sd_jax.spec_decode import drafting
from d2sd_jax.spec_decode import speculative as SP

DRAFTERS = ('drafter1', 'drafter2')  # config fields / Decoder.drafters keys of drafter paths

AUTO_BATCH = 8  # batch_size=0: the prompts decoded together, this many at most

# decode.py with neither prompt nor prompts_file: a demo prompt (so an explicit prompts_file
# never collides with a default prompt).
DEMO_PROMPT = 'Write a Python function that returns the n-th Fibonacci number.'


@dataclasses.dataclass(frozen=True)
class Options:
  """One generation request besides the models and prompts. decode.py's config
  (`options_from_config`) and Decoder.generate's keywords both become this: the defaults live
  here, and decode.py's config is built from them (`decode_config`)."""
  # 'ar' (plain autoregressive), 'pld' (prompt lookup), 'dflash' (drafter 1),
  # 'dflash_resample' / 'dflash_dflash' (paper ablations), 'd2sd' (drafter 1 + drafter 2),
  # 'd2sd_pld', the best-first trees 'ddtree' and 'd2sd_tree', 'auto' (the highest predicted
  # tokens/s on this machine: decode/autoconfig.py), or any method added with d2sd_jax.register
  # (drafting.REGISTRY, read at call time)
  method: str
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
  # Prompts are padded to at least this many tokens (0: the longest prompt's): calls whose
  # prompts differ in length then run one compiled program, with the same costs
  prompt_width: int = 0
  # SpecSettings knobs (gamma, n_branches, steps, ...); a missing one takes `spec_fields`' default.
  spec: dict = dataclasses.field(default_factory=dict)
  stage_times: bool = False  # also time draft / verify / accept alone (3 more programs compile)
  # method='auto': choose again even where this machine remembers a choice for the same key
  # (autoconfig.remembered_key), and remember the new one
  auto_refresh: bool = False
  # method='auto': decode every candidate on the request's first prompts and time it (minutes),
  # instead of predicting from the drafters' recorded acceptance (autoconfig.PRIORS)
  auto_probe: bool = False
  # method='auto': the NLL per token (under the target) the request may add over lossless
  # decoding, for speed. 0 = lossless; above 0, (steps, leniency) from the measured frontier
  # (decode/quality_route.py; temperature 1 only)
  quality_budget: float = 0.0


@dataclasses.dataclass(frozen=True)
class Run:
  """decode.py's fields besides the request's (Options): the models, the prompts, the output
  and the devices."""
  # 'smollm2', a .gguf file, or a Hugging Face folder (config.json + *.safetensors)
  target: str = 'smollm2'
  dtype: str = 'float32'  # 'float32' (CPU) or 'bfloat16' (accelerators)
  drafter1: str = ''  # drafter 1: a train.py workdir or an exported drafter ('' = none)
  drafter2: str = ''  # drafter 2 (variable prefix), for method='d2sd' and its kin
  prompt: str = ''  # one prompt (neither prompt nor prompts_file: a demo prompt)...
  prompts_file: str = ''  # ...or a JSONL file with a "prompt" field (or a conversation) a line
  output: str = ''  # optional JSONL path: prompt, completion, completion_ids per line
  mesh: config_check.Mesh = config_check.Mesh()
  distributed: bool = False  # True on multi-host pod slices: jax.distributed.initialize()


# Every field decode.py reads: the request's (Options, its `spec` group the SpecSettings knobs)
# and the run's (Run).
DECODE_FIELDS = {**{f.name: None for f in dataclasses.fields(Options) if f.name != 'spec'},
                 'spec': set(config_check.SPEC_KNOBS), **config_check.schema_fields(Run)}

# Knobs whose default follows the drafters: gamma is drafter 1's block, n_branches
# min(4, gamma-1) (`spec_fields`); a config leaves them None.
FOLLOW_DRAFTERS = ('gamma', 'n_branches')


def decode_config(method: str = 'auto', **run) -> ml_collections.ConfigDict:
  """decode.py's config with the library's defaults: the request's fields (Options, with
  `method`), its `spec` group (SpecSettings' knobs and defaults, FOLLOW_DRAFTERS None) and the
  run's fields (Run, with `run` applied). A config file is this with its own values."""
  c = config_check.as_config(dataclasses.replace(Run(), **run))
  for f in dataclasses.fields(Options):
    if f.name not in ('spec', 'chat_template_kwargs'):
      c[f.name] = getattr(Options(method=method), f.name)
  # Extra chat-template variables as a JSON object ('' = none), e.g. for Qwen3:
  # --config.chat_template_kwargs='{"enable_thinking": false}'
  c.chat_template_kwargs = ''
  c.spec = ml_collections.ConfigDict({k: _spec_default(k) for k in config_check.SPEC_KNOBS})
  for name in FOLLOW_DRAFTERS:
    c.spec[name] = placeholder(int)
  c.spec.calibration_kind = placeholder(str)  # (None: from the request's chat, for the trees)
  return c


def methods() -> tuple[str, ...]:
  """'ar', 'auto' (d2sd_jax/decode/autoconfig.py) and every drafting method registered now
  (drafting.register may add one any time)."""
  return ('ar', 'auto') + tuple(drafting.REGISTRY)


def drafters_needed(method: str) -> tuple[str, ...]:
  """Drafters a method cannot run without ('auto' weighs whichever are at hand)."""
  return () if method in ('ar', 'auto') else drafting.get(method).drafters


def generation_settings(options: Options, eos_ids=(), pad_id: int = 0) -> ar.GenerationSettings:
  """The settings dataclasses own their checks (max_new_tokens, temperature, top_k, top_p)."""
  sampling = sampling_lib.SamplingSettings(temperature=float(options.temperature),
                                           top_k=int(options.top_k), top_p=float(options.top_p))
  return ar.GenerationSettings(max_new_tokens=options.max_new_tokens, eos_ids=tuple(eos_ids),
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
  if options.prompt_width < 0:
    raise ValueError(f'prompt_width={options.prompt_width} must be >= 0 (0: the longest '
                     'prompt sets the width)')
  if not isinstance(options.chat_template_kwargs, dict):
    raise ValueError(f'chat_template_kwargs={options.chat_template_kwargs!r} must be a dict of '
                     "template variables, such as {'enable_thinking': False}")
  config_check.check_fields(options.spec, dict.fromkeys(config_check.SPEC_KNOBS), 'speculative')
  quality_route.check(options)


def width(prompt_ids: list[list[int]], options: Options) -> int:
  """The prompt width a request's programs are made for: its longest prompt, or
  options.prompt_width where that is wider."""
  return max(max(len(p) for p in prompt_ids), options.prompt_width)


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
  return {**request_kind(options, options.method), **spec}


def request_kind(options: Options, method: str) -> dict:
  """{'calibration_kind': ...} for a tree method: the trees read the reliability curves fitted
  on this kind of request (chat or plain completions); {} for the other methods."""
  if method == 'ar' or not drafting.get(method).budgeted:
    return {}
  return {'calibration_kind': 'chat' if options.chat else 'plain'}


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
  config_check.check_fields(config, DECODE_FIELDS, 'decode')
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
  try:
    convs = conversations.read(config.prompts_file)
  except ValueError as e:
    if 'no prompts' in str(e):
      raise ValueError(f'prompts_file {config.prompts_file!r} has no prompts') from e
    raise
  return [c.user_turns[0] if c.style == 'prompt' else c.messages([]) for c in convs]

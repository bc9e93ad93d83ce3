"""Tokenizer: a `tokenizers` BPE plus the model's chat template (rendered with jinja2)."""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def _raise(message):
  raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """transformers' `tojson`: plain json.dumps (jinja's own escapes HTML characters, which would
  change what the model sees), with its keyword options."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  """Today's date for templates that write it (Llama 3.x system prompts)."""
  return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` renders its body: transformers uses the tag to mark
  assistant tokens for training masks; templates that carry it must still render here."""
  tags = {'generation'}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
  """The chat template in an environment that matches transformers' `apply_chat_template`
  (sandboxed; trim_blocks and lstrip_blocks; break/continue; raise_exception, strftime_now and
  its tojson), so the prompt a model sees is the one it was trained on. Compiled once."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols, _GenerationTag])
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise
  env.globals['strftime_now'] = _strftime_now
  return env.from_string(template)


@dataclasses.dataclass
class Tokenizer:
  bpe: tokenizers.Tokenizer
  eos_ids: tuple[int, ...]
  pad_id: int
  bos_id: int | None = None
  add_bos: bool = False  # prepend BOS to plain (non-chat) prompts
  chat_template: str | None = None

  @property
  def vocab_size(self) -> int:
    return self.bpe.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    ids = self.bpe.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.bpe.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: str | list[dict], **template_kwargs) -> str:
    """The chat template applied to a user message (or a list of messages), ready to generate.

    template_kwargs: variables for the template, as transformers' `apply_chat_template(...,
    **kwargs)` passes them: e.g. Qwen3's `enable_thinking=False`, `tools=[...]` (JSON schemas),
    or `add_generation_prompt=False`. They override the defaults (tools=None, documents=None,
    add_generation_prompt=True, bos_token, eos_token).
    """
    if not self.chat_template:
      raise ValueError('this tokenizer has no chat template: set chat=False (plain-text prompts)')
    if isinstance(messages, str):
      messages = [{'role': 'user', 'content': messages}]
    token = lambda i: self.bpe.id_to_token(i) if i is not None else ''
    variables = {'tools': None, 'documents': None, 'add_generation_prompt': True,
                 'bos_token': token(self.bos_id), 'eos_token': token(self.eos_ids[0]),
                 **template_kwargs}
    return _compile_template(self.chat_template).render(messages=messages, **variables)

  def encode_prompt(self, prompt: str | list[dict], chat: bool,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt: plain text, or (chat) wrapped in the chat template, rendered with
    `chat_template_kwargs` (see render_chat). A list of chat messages ({'role', 'content'}, e.g.
    a system message and a user turn) is rendered as it is (chat only)."""
    if not prompt:
      raise ValueError('empty prompt: give at least one character of text')
    if not isinstance(prompt, str) and not chat:
      raise ValueError('a prompt given as chat messages needs chat=True (the chat template)')
    if chat:  # the template writes any BOS itself
      return self.encode(self.render_chat(prompt, **(chat_template_kwargs or {})), add_bos=False)
    return self.encode(prompt)


def from_gguf_metadata(meta: dict) -> Tokenizer:
  """Byte-level BPE from a GGUF's `tokenizer.ggml.*` fields (llama.cpp's 'gpt2' model)."""
  model = meta.get('tokenizer.ggml.model')
  if model != 'gpt2':
    raise ValueError(f'GGUF tokenizer model {model!r} is not supported (only byte-level BPE, '
                     "'gpt2'); load the model from a Hugging Face folder with tokenizer.json")
  tokens = meta['tokenizer.ggml.tokens']
  types = meta.get('tokenizer.ggml.token_type', [1] * len(tokens))
  merges = [tuple(m.split(' ', 1)) for m in meta['tokenizer.ggml.merges']]
  bpe = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                        fuse_unk=False, byte_fallback=False))
  pre = meta.get('tokenizer.ggml.pre', 'default')
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == 'smollm':  # llama.cpp's 'smollm': GPT-2 split with every digit on its own
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in ('gpt2', 'default'):
    bpe.pre_tokenizer = byte_level
  else:
    raise ValueError(f'GGUF pre-tokenizer {pre!r} is not supported; use a Hugging Face folder')
  bpe.decoder = decoders.ByteLevel()
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
  bpe.add_special_tokens(special)
  eos = meta.get('tokenizer.ggml.eos_token_id')
  if eos is None:
    raise ValueError('GGUF has no tokenizer.ggml.eos_token_id: cannot tell where generation stops')
  return Tokenizer(
      bpe=bpe, eos_ids=(int(eos),), pad_id=int(meta.get('tokenizer.ggml.padding_token_id', eos)),
      bos_id=meta.get('tokenizer.ggml.bos_token_id'),
      add_bos=bool(meta.get('tokenizer.ggml.add_bos_token', False)),
      chat_template=meta.get('tokenizer.chat_template'))


def from_hf_dir(path: str, config: dict) -> Tokenizer:
  """`tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) of a HF folder."""
  tok_file = os.path.join(path, 'tokenizer.json')
  if not os.path.exists(tok_file):
    raise FileNotFoundError(f'{tok_file} not found: the checkpoint folder needs a tokenizer.json '
                            '(save it with tokenizer.save_pretrained)')
  bpe = tokenizers.Tokenizer.from_file(tok_file)
  tok_cfg = _read_json(os.path.join(path, 'tokenizer_config.json'))
  gen_cfg = _read_json(os.path.join(path, 'generation_config.json'))

  def token_id(value):
    if isinstance(value, dict):
      value = value.get('content')
    return bpe.token_to_id(value) if isinstance(value, str) else value

  eos = gen_cfg.get('eos_token_id', config.get('eos_token_id'))
  if eos is None:
    eos = token_id(tok_cfg.get('eos_token'))
  if eos is None:
    raise ValueError(f'no eos_token_id in {path} (config.json, generation_config.json or '
                     'tokenizer_config.json): cannot tell where generation stops')
  eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
  bos = config.get('bos_token_id', token_id(tok_cfg.get('bos_token')))
  pad = token_id(tok_cfg.get('pad_token'))
  add_bos = tok_cfg.get('add_bos_token')
  if add_bos is None:  # no flag: does the folder's post-processor put BOS first?
    add_bos = bos is not None and bpe.encode('a', add_special_tokens=True).ids[:1] == [bos]
  template = tok_cfg.get('chat_template')
  if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
    template = next((t['template'] for t in template if t.get('name') == 'default'), None)
  return Tokenizer(bpe=bpe, eos_ids=eos_ids, pad_id=eos_ids[0] if pad is None else int(pad),
                   bos_id=bos, add_bos=bool(add_bos),
                   chat_template=template)


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)

"""Random-access sources of training records (prompt_ids, response_ids): the distillation
shards (`ShardsSource`), records in memory (`ListSource`) and a file of conversations
(`ConversationsSource`). `tfds_data.TfdsSource` is the fourth, for TFDS datasets. Each is
(len, [i]) and validates every record in one pass at start-up (`index`), so a malformed one
stops a run before training, named by file and line."""
from __future__ import annotations

import functools
import glob
import gzip
import json
import os

import numpy as np

from d2sd_jax.formats import conversations


def check_ids(value, what: str, vocab_size: int | None) -> list[int]:
  """A list of token ids (ValueError saying what is wrong)."""
  if not isinstance(value, list) or not all(type(t) is int for t in value):
    raise ValueError(f'"{what}" must be a list of integer token ids')
  if value and (min(value) < 0 or (vocab_size is not None and max(value) >= vocab_size)):
    bad = min(value) if min(value) < 0 else max(value)
    raise ValueError(f'"{what}" has token id {bad}, outside the target\'s vocabulary of '
                     f'{vocab_size} (made for another target?)')
  return value


def shard_files(path: str) -> list[str]:
  """The distillation shards under `path`, sorted (the record order); `path` may name several
  folders, comma-separated (e.g. 'data/distill,data/distill-questions'): their shards in that
  order."""
  files = []
  for folder in [p.strip() for p in path.split(',') if p.strip()] or [path]:
    found = sorted(glob.glob(os.path.join(folder, 'shard-*.jsonl.gz')))
    if not found:
      raise FileNotFoundError(f'no distillation shards (shard-*.jsonl.gz) in {folder!r}: '
                              'generate them with python scripts/distill.py --out ' + folder)
    files += found
  return files


class ShardsSource:
  """The records of the distillation shards under `path`, by index (file order, line order).

  gzip cannot seek, so a record is read by decompressing its shard (a few recently used shards
  are kept): shards are small (`distill.py --shard_size`, 64 records), and on a pod the TFDS
  copy (`tfds_data`, array_record) reads single records."""

  def __init__(self, path: str, vocab_size: int | None = None):
    self.path, self.vocab_size = path, vocab_size
    self.files = shard_files(path)
    self._lines = functools.lru_cache(maxsize=8)(self._read_lines)
    self._where = np.zeros((0, 2), np.int64)  # per record: (file, line number); set by index()
    self.sources: list[str] = []  # per record: what its prompt came from; set by index()

  def _read_lines(self, f: int) -> list[bytes]:
    try:
      with gzip.open(self.files[f], 'rb') as fh:
        return fh.read().split(b'\n')
    except (OSError, EOFError) as e:
      raise ValueError(f'corrupt distillation shard {self.files[f]}: {e}; delete it and rerun '
                       'scripts/distill.py to regenerate it') from e

  def _record(self, f: int, n: int) -> dict:
    """Line n (1-based) of file f, parsed and checked (ValueError naming file and line)."""
    try:
      r = json.loads(self._lines(f)[n - 1])
      if not isinstance(r, dict):
        raise ValueError(f'expected a JSON object, got {type(r).__name__}')
      missing = [k for k in ('id', 'prompt_ids', 'response_ids') if k not in r]
      if missing:
        raise ValueError(f'no {", ".join(missing)} field (a distillation record has id, '
                         'prompt_ids, response_ids)')
      for k in ('prompt_ids', 'response_ids'):
        check_ids(r[k], k, self.vocab_size)
    except ValueError as e:
      raise ValueError(f'{self.files[f]}:{n}: {e}; delete the shard and rerun scripts/distill.py '
                       'to regenerate it') from e
    return r

  def index(self):
    ids, has_response, where, sources = [], [], [], []
    for f in range(len(self.files)):
      for n, line in enumerate(self._lines(f), 1):
        if line.strip():
          r = self._record(f, n)
          ids.append(str(r['id']))
          has_response.append(bool(r['response_ids']))
          where.append((f, n))
          sources.append(str(r.get('source', '')))
    self._where = np.asarray(where, np.int64).reshape(-1, 2)
    self.sources = sources
    return ids, np.asarray(has_response, bool)

  def __len__(self):
    return len(self._where)

  def __getitem__(self, i: int):
    r = self._record(*map(int, self._where[i]))
    return r['prompt_ids'], r['response_ids']


class ListSource:
  """Records already in memory (dicts with id, prompt_ids, response_ids): tests, notebooks."""

  def __init__(self, records: list[dict]):
    self.records = records
    self.sources = [str(r.get('source', '')) for r in records]

  def index(self):
    return ([str(r['id']) for r in self.records],
            np.asarray([bool(r['response_ids']) for r in self.records], bool))

  def __len__(self):
    return len(self.records)

  def __getitem__(self, i: int):
    return self.records[i]['prompt_ids'], self.records[i]['response_ids']


class ConversationsSource:
  """The assistant turns of a JSONL conversation file (ShareGPT `conversations`, OpenAI
  `messages`), one record per turn: the prompt is the conversation before it in the target's
  chat template, the response its text + the target's EOS. Records keep their line's place in
  the file (os.pread), not its text."""

  def __init__(self, path: str, tokenizer):
    self.path, self.tok = path, tokenizer
    if not tokenizer.chat_template:
      raise ValueError(f'data.source=conversations: the target\'s tokenizer has no chat '
                       f'template to render {path} with')
    self._where = np.zeros((0, 3), np.int64)  # per record: (offset, length, turn); by index()

  def index(self):
    ids, where = [], []
    for n, offset, length, conv in conversations.scan(self.path):
      replies = conv.reply_prompts()
      if not replies:
        raise ValueError(
            f'{self.path}:{n}: a "{conv.style}" line has no assistant reply to train on. '
            f'Distill the file first (the target writes the replies): python '
            f'scripts/distill.py --prompts {self.path} --out DIR, then train with '
            f'data.source=shards and data.path=DIR')
      for k in range(len(replies)):
        ids.append(f'{conv.id}:{k}')  # as distill.py names turns
        where.append((offset, length, k))
    if not ids:
      raise ValueError(f'{self.path}: no conversations')
    self._where = np.asarray(where, np.int64)
    return ids, None

  def __len__(self):
    return len(self._where)

  def __getitem__(self, i: int):
    offset, length, k = map(int, self._where[i])
    fd = os.open(self.path, os.O_RDONLY)
    try:
      line = os.pread(fd, length, offset)
    finally:
      os.close(fd)
    messages, reply = conversations.parse_line(line, self.path).reply_prompts()[k]
    prompt = self.tok.encode(self.tok.render_chat(messages), add_bos=False)
    return prompt, self.tok.encode(reply, add_bos=False) + [self.tok.eos_ids[0]]


def read_records(path: str) -> list[dict]:
  """All records of the distillation shards under `path` (sorted, deterministic), in memory:
  for notebooks and tests; training reads through `ShardsSource`."""
  source = ShardsSource(path)
  source.index()
  return [source._record(*map(int, w)) for w in source._where]  # pylint: disable=protected-access

"""Training windows for the drafters, read on demand from a random-access source of records.

A record (prompt_ids, response_ids) becomes one fixed-length window of prompt tail + response
with a label mask over the response tokens: the positions whose labels are what verification
will compare against. The best labels are the target's own outputs (`distill.py`): a drafter
learns the behaviour it will be verified against (DESIGN §3). Sources (`data.source`):

  'shards'         `records.ShardsSource`: the gzip JSONL shards of `python scripts/distill.py`
  'tfds'           `tfds_data.TfdsSource`: any TFDS dataset prepared as array_record, either
                   token records (prompt_ids/response_ids, e.g. `tfds_data`'s d2sd_distill
                   copy of the shards) or text (every token a label: teacher-forced text, to
                   bootstrap a drafter where no distilled responses exist yet)
  'conversations'  `records.ConversationsSource`: a JSONL of ShareGPT / OpenAI conversations; the file's
                   assistant turns are the labels (someone else's replies, not the target's:
                   distilling the file first, `python scripts/distill.py --prompts FILE`,
                   trains better drafters)

Every source is random access (len, [i]), so a host reads only the records of its own rows of
each batch (`grain_data`). At start-up each host makes one pass over the records' ids to fix
the held-out split (a hash of the id, so it is the same on every host and for every format of
the same records); that pass also validates every record, so a malformed one stops the run
before training with the file and line. Only indices are kept, never tokens.

The windows of a split are numbered in record order; the batch of step t is a pure function of
(seed, t) (`SequenceData.indices`): epoch e = t*B // N uses permutation(seed, e).
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np

from d2sd_jax.train import corpus
from d2sd_jax.train import records as records_lib

# head_vocab counts token frequencies over at most this many training windows (a fixed random
# sample beyond it, the same on every host so that all hosts choose the same head).
COUNT_WINDOWS = 50_000


def window(prompt_ids, response_ids, seq_len: int, pad_id: int, min_context: int = 32):
  """(tokens [seq_len], label_mask [seq_len]): as much response as fits after >= min_context
  prompt tokens (fewer if the prompt is shorter; at most half the window, so that a long prompt
  still leaves room for labels)."""
  min_context = min(min_context, seq_len // 2)
  total = list(prompt_ids) + list(response_ids)
  start = max(0, min(len(prompt_ids) - min_context, len(total) - seq_len))
  tokens = np.full(seq_len, pad_id, np.int32)
  piece = total[start:start + seq_len]
  tokens[:len(piece)] = piece
  label = np.zeros(seq_len, bool)
  label[max(0, len(prompt_ids) - start):len(piece)] = True
  return tokens, label


def held_out_ids(ids: list[str], fraction: float) -> np.ndarray:
  return np.asarray([int(hashlib.sha256(i.encode()).hexdigest()[:8], 16) / 2**32 < fraction
                     for i in ids], bool)


HOLDOUTS = ('record', 'source')


def source_group(source: str) -> str:
  """What a held-out split by source holds out whole: the top-level package or standard-library
  module of a function's record ('jedi/inference/x.py:f' -> 'jedi', 'json/decoder.py:f' ->
  'json'), and a question's subject ('wordnet:noun.act:research', every question about it)."""
  if source.startswith('wordnet:'):
    return source
  return source.split('/')[0].split(':')[0].removesuffix('.py')


def split_keys(ids: list[str], sources: list[str] | None, holdout: str) -> list[str]:
  """The key each record's split is drawn from: its id, or its source's group."""
  if holdout == 'record':
    return ids
  if sources is None or not any(sources):
    raise ValueError("data.holdout='source' needs distillation shards whose records name their "
                     "source (scripts/distill.py writes it): use data.holdout='record' here")
  return [source_group(s) if s else i for i, s in zip(ids, sources)]


def held_out_records(path: str, fraction: float, holdout: str = 'record') -> list[dict]:
  """The records of the distillation shards under `path` that training holds out (by id, or
  by source group: data.holdout; at data.eval_fraction = `fraction`), in order: what
  evaluations read."""
  rows = records_lib.read_records(path)
  keys = split_keys([r['id'] for r in rows], [str(r.get('source', '')) for r in rows], holdout)
  return [r for r, h in zip(rows, held_out_ids(keys, fraction)) if h]


def _held_out_indices(n: int, fraction: float) -> np.ndarray:
  """For records without ids (text): a hash of the index (splitmix64), vectorised for
  datasets of millions of examples."""
  with np.errstate(over='ignore'):
    z = np.arange(n, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(32)).astype(np.float64) / 2**32 < fraction


@functools.lru_cache(maxsize=4)
def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  """The order of epoch `epoch` (cached: every batch of an epoch reads it)."""
  perm = np.random.default_rng([seed, epoch]).permutation(n)
  perm.flags.writeable = False
  return perm


class SequenceData:
  """Fixed-length training/eval windows over a record source, split by record id
  (eval_fraction of ids held out); windows are read and cut on demand (`example`)."""

  def __init__(self, source, seq_len: int, pad_id: int, eval_fraction: float,
               holdout: str = 'record'):
    self.source = records_lib.ListSource(source) if isinstance(source, list) else source
    self.seq_len, self.pad_id = seq_len, pad_id
    ids, has_response = self.source.index()
    n = len(self.source)
    if ids is None and holdout != 'record':
      raise ValueError(f"data.holdout={holdout!r} needs records that name their source; this "
                       "source has none: use data.holdout='record'")
    held = (_held_out_indices(n, eval_fraction) if ids is None else held_out_ids(
        split_keys(ids, getattr(self.source, 'sources', None), holdout), eval_fraction))
    ok = np.ones(n, bool) if has_response is None else has_response
    self.records = {'train': np.flatnonzero(ok & ~held), 'eval': np.flatnonzero(ok & held)}
    if not self.size('train'):
      raise ValueError('no training sequences: generate more distillation data')

  def size(self, split: str = 'train') -> int:
    return len(self.records[split])

  def window(self, split: str, i: int):
    """(tokens [L], labels [L]) of window i of `split`."""
    prompt_ids, response_ids = self.source[int(self.records[split][i])]
    return window(prompt_ids, response_ids, self.seq_len, self.pad_id)

  def example(self, split: str, i: int) -> dict:
    """Window i as grain batches it; `index` finds its precomputed features. The labels are
    the tokens themselves: the target wrote them."""
    tokens, labels = self.window(split, i)
    return {'tokens': tokens, 'labels': labels, 'index': np.int64(i)}

  def token_arrays(self, split: str) -> list[np.ndarray]:
    """The windows' tokens, one [N, L] array per part (features are computed per part)."""
    return [self.arrays(split)[0]]

  def arrays(self, split: str):
    """(tokens [N, L], labels [N, L]) of every window of `split`: the whole split in memory,
    for the precomputed-features recipe (one host, a small set)."""
    pairs = [self.window(split, i) for i in range(self.size(split))]
    L = self.seq_len
    return (np.stack([t for t, _ in pairs]) if pairs else np.zeros((0, L), np.int32),
            np.stack([m for _, m in pairs]) if pairs else np.zeros((0, L), bool))

  def indices(self, step: int, batch_size: int, seed: int, split: str = 'train') -> np.ndarray:
    """Which windows make the global batch of `step`: epoch e = step*B // N uses
    permutation(seed, e)."""
    n = self.size(split)
    return np.asarray([permutation(n, seed, i // n)[i % n]
                       for i in range(step * batch_size, (step + 1) * batch_size)])

  def token_counts(self, vocab_size: int, pad_id: int,
                   max_windows: int = COUNT_WINDOWS) -> tuple[np.ndarray, np.ndarray]:
    """(response, prompt) token counts [V] over the training windows (head_vocab choice): all
    of them up to max_windows, else a fixed sample of max_windows (the same on every host)."""
    n = self.size('train')
    picked = (range(n) if n <= max_windows else
              np.sort(np.random.default_rng(0).choice(n, max_windows, replace=False)))
    response = np.zeros(vocab_size, np.int64)
    prompt = np.zeros(vocab_size, np.int64)
    for i in picked:  # in order: a shard is decompressed once for all its records
      tokens, labels = self.window('train', i)
      response += np.bincount(tokens[labels], minlength=vocab_size)
      prompt += np.bincount(tokens[~labels & (tokens != pad_id)], minlength=vocab_size)
    return response, prompt


class CorpusWindows:
  """The windows of a teacher-forced corpus (`python scripts/corpus.py`): text, and at every
  position the target's own prediction of the next token (its argmax, and with --top_k its K
  likeliest tokens and their probabilities). The text is what the drafter and the target's
  features see; the target's predictions are the labels: label_ids[t] = next_ids[t - 1], so a
  block anchored at a learns what the target would write at a+1, a+2, ... after the text up to
  there. Every position but the first carries a label. The corpus is all training data (the
  held-out windows come from the main source)."""

  def __init__(self, path: str, seq_len: int, max_windows: int = 0, vocab_size: int | None = None):
    arrays = corpus.read(path, max_windows)
    tokens = arrays['tokens']
    if tokens.shape[1] != seq_len:
      raise ValueError(f'the corpus in {path} has windows of {tokens.shape[1]} tokens but '
                       f'data.seq_len={seq_len}: rebuild it with python scripts/corpus.py '
                       f'--seq_len {seq_len} --out NEW_DIR, or set data.seq_len={tokens.shape[1]}')
    if vocab_size is not None and int(tokens.max(initial=0)) >= vocab_size:
      raise ValueError(f'the corpus in {path} has token id {int(tokens.max())}, outside the '
                       f'target\'s vocabulary of {vocab_size} (built for another target?)')
    self.path, self.seq_len = path, seq_len
    self.tokens = tokens
    shift = lambda x: np.concatenate([x[:, :1], x[:, :-1]], axis=1)  # label of t: pred. at t-1
    self.label_ids = shift(arrays['next_ids'])
    self.top_k = arrays['topk_ids'].shape[-1] if 'topk_ids' in arrays else 0
    if self.top_k:
      self.topk_ids = shift(arrays['topk_ids'])
      self.topk_probs = shift(arrays['topk_probs_q16'])

  def size(self, split: str = 'train') -> int:
    return len(self.tokens) if split == 'train' else 0

  def example(self, split: str, i: int, top_k: int = 0) -> dict:
    del split
    labels = np.ones(self.seq_len, bool)
    labels[0] = False
    out = {'tokens': self.tokens[i], 'labels': labels, 'label_ids': self.label_ids[i]}
    if top_k:
      if top_k > self.top_k:
        raise ValueError(f'loss.soft needs the target\'s top-{top_k} but the corpus in '
                         f'{self.path} stores {self.top_k}: rebuild it with --top_k {top_k}')
      out['topk_ids'] = self.topk_ids[i, :, :top_k]
      out['topk_probs'] = self.topk_probs[i, :, :top_k].astype(np.float32) / 65535
    return out

  def token_counts(self, vocab_size: int) -> np.ndarray:
    """How often each token is a label (the head_vocab choice counts them as responses)."""
    return np.bincount(self.label_ids[:, 1:].reshape(-1), minlength=vocab_size)


class MixedData:
  """The main source's windows (`SequenceData`) followed by a teacher-forced corpus's, as one
  training split (the mix is the corpus's share of the windows: data.corpus_windows). Held-out
  windows are the main source's only, so runs with and without a corpus are evaluated on the
  same windows. With top_k (the soft-label loss), the main source's windows carry their token
  as a one-hot top-k (the target wrote it; its distribution there was not stored)."""

  def __init__(self, main: SequenceData, corpus: CorpusWindows, top_k: int = 0):
    self.main, self.corpus, self.top_k = main, corpus, top_k
    self.seq_len, self.pad_id = main.seq_len, main.pad_id

  def size(self, split: str = 'train') -> int:
    return self.main.size(split) + self.corpus.size(split)

  def example(self, split: str, i: int) -> dict:
    n = self.main.size(split)
    if i >= n:
      return {**self.corpus.example(split, i - n, self.top_k), 'index': np.int64(i)}
    out = self.main.example(split, i)
    out['label_ids'] = out['tokens']  # (every window of a batch carries the same fields)
    if self.top_k:
      out['topk_ids'] = np.zeros((self.seq_len, self.top_k), np.int32)
      out['topk_ids'][:, 0] = out['tokens']
      out['topk_probs'] = np.zeros((self.seq_len, self.top_k), np.float32)
      out['topk_probs'][:, 0] = 1.0
    return out

  def token_arrays(self, split: str) -> list[np.ndarray]:
    parts = self.main.token_arrays(split)
    return parts + [self.corpus.tokens] if self.corpus.size(split) else parts

  indices = SequenceData.indices

  def token_counts(self, vocab_size: int, pad_id: int,
                   max_windows: int = COUNT_WINDOWS) -> tuple[np.ndarray, np.ndarray]:
    response, prompt = self.main.token_counts(vocab_size, pad_id, max_windows)
    return response + self.corpus.token_counts(vocab_size), prompt


SOURCES = ('shards', 'tfds', 'conversations')


def from_config(data_config, tokenizer, vocab_size: int, top_k: int = 0):
  """The windows of a training config's `data` group, read with the target's tokenizer, with
  the teacher-forced corpus data.corpus_path (if set) mixed in; top_k: the soft labels the
  loss needs (0: none)."""
  source = data_config.source
  if source == 'shards':
    records = records_lib.ShardsSource(data_config.path, vocab_size)
  elif source == 'conversations':
    records = records_lib.ConversationsSource(data_config.path, tokenizer)
  elif source == 'tfds':
    # Imported here: TFDS (and its TensorFlow-free reader) loads only for the runs that use it.
    from d2sd_jax.train import tfds_data  # pylint: disable=import-outside-toplevel
    records = tfds_data.TfdsSource(
        data_config.tfds_dir, data_config.get('tfds_name', tfds_data.NAME),
        data_config.get('tfds_split', 'train'), data_config.get('text_field', 'text'),
        tokenizer, data_config.seq_len, vocab_size)
  else:
    raise ValueError(f'data.source={source!r}: use one of {SOURCES}')
  main = SequenceData(records, data_config.seq_len, tokenizer.pad_id, data_config.eval_fraction,
                      data_config.get('holdout', 'record'))
  if not data_config.get('corpus_path'):
    return main
  corpus = CorpusWindows(data_config.corpus_path, data_config.seq_len,
                         data_config.get('corpus_windows', 0), vocab_size)
  return MixedData(main, corpus, top_k)

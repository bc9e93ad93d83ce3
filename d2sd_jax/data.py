"""Training sequences for the drafters: the target's own responses (see `distill.py`).

A record (prompt_ids, response_ids) becomes one fixed-length window of prompt + response with a
label mask over the response tokens (the target's outputs: the only positions whose labels are
what verification will compare against). Batches are a pure function of (seed, step), so a run
resumed at step t sees exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os

import numpy as np


def read_records(path: str) -> list[dict]:
  """All records of the distillation shards under `path` (sorted, deterministic)."""
  files = sorted(glob.glob(os.path.join(path, 'shard-*.jsonl.gz')))
  if not files:
    raise FileNotFoundError(f'no distillation shards (shard-*.jsonl.gz) in {path!r}: generate '
                            'them with python -m d2sd_jax.distill --out ' + path)
  records = []
  for file in files:
    try:
      with gzip.open(file, 'rt') as f:
        records.extend(json.loads(line) for line in f if line.strip())
    except (OSError, json.JSONDecodeError, EOFError) as e:
      raise ValueError(f'corrupt distillation shard {file}: {e}; delete it and rerun '
                       'd2sd_jax.distill to regenerate it') from e
  return records


def window(prompt_ids, response_ids, seq_len: int, pad_id: int, min_context: int = 32):
  """(tokens [seq_len], label_mask [seq_len]): as much response as fits after >= min_context
  prompt tokens (fewer if the prompt is shorter)."""
  total = list(prompt_ids) + list(response_ids)
  start = max(0, min(len(prompt_ids) - min_context, len(total) - seq_len))
  tokens = np.full(seq_len, pad_id, np.int32)
  piece = total[start:start + seq_len]
  tokens[:len(piece)] = piece
  label = np.zeros(seq_len, bool)
  label[max(0, len(prompt_ids) - start):len(piece)] = True
  return tokens, label


class SequenceData:
  """Fixed-length training/eval windows, split by record id (eval_fraction of ids held out)."""

  def __init__(self, records: list[dict], seq_len: int, pad_id: int, eval_fraction: float):
    def held_out(r):
      return int(hashlib.sha256(str(r['id']).encode()).hexdigest()[:8], 16) / 2**32 < eval_fraction

    split = {'train': [], 'eval': []}
    for r in records:
      if r['response_ids']:
        split['eval' if held_out(r) else 'train'].append(window(r['prompt_ids'], r['response_ids'],
                                                                seq_len, pad_id))
    if not split['train']:
      raise ValueError('no training sequences: generate more distillation data')
    self.tokens = {k: np.stack([t for t, _ in v]) if v else np.zeros((0, seq_len), np.int32)
                   for k, v in split.items()}
    self.labels = {k: np.stack([m for _, m in v]) if v else np.zeros((0, seq_len), bool)
                   for k, v in split.items()}

  def size(self, split: str = 'train') -> int:
    return len(self.tokens[split])

  def indices(self, step: int, batch_size: int, seed: int, split: str = 'train') -> np.ndarray:
    """Which sequences make the batch of `step`: epoch e = step*B // N uses
    permutation(seed, e)."""
    n = self.size(split)
    idx = []
    for i in range(step * batch_size, (step + 1) * batch_size):
      epoch, pos = divmod(i, n)
      perm = np.random.default_rng([seed, epoch]).permutation(n)
      idx.append(perm[pos])
    return np.asarray(idx)

  def batch(self, step: int, batch_size: int, seed: int, split: str = 'train'):
    idx = self.indices(step, batch_size, seed, split)
    return self.tokens[split][idx], self.labels[split][idx]

  def token_counts(self, vocab_size: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(response, prompt) token counts [V] over the training windows (head_vocab choice)."""
    tokens, labels = self.tokens['train'], self.labels['train']
    response = np.bincount(tokens[labels], minlength=vocab_size)
    prompt = np.bincount(tokens[~labels & (tokens != pad_id)], minlength=vocab_size)
    return response, prompt

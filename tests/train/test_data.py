"""Held-out splits by source (train/data.py, data.holdout='source'): whole packages, standard
library modules and question subjects land on one side, so held-out figures measure
generalisation rather than memory."""
import gzip
import json
import os

import numpy as np
import pytest

from d2sd_jax.train import data


def test_a_source_groups_by_package_module_or_question_subject():
  assert data.source_group('jedi/inference/dynamic_params.py:dynamic_param_lookup') == 'jedi'
  assert data.source_group('unittest/loader.py:getTestCaseNames') == 'unittest'
  assert data.source_group('six.py:with_metaclass') == 'six'
  assert data.source_group('wordnet:noun.act:research') == 'wordnet:noun.act:research'


def records(n_packages=40, per_package=6):
  rng = np.random.default_rng(0)
  out = []
  for p in range(n_packages):
    for f in range(per_package):
      out.append({'id': f'{p}-{f}', 'source': f'pkg{p}/mod.py:f{f}',
                  'prompt_ids': rng.integers(0, 50, 5).tolist(),
                  'response_ids': rng.integers(0, 50, 12).tolist()})
  return out


def test_holding_out_by_source_keeps_every_package_on_one_side():
  rows = records()
  by_source = data.SequenceData(rows, 16, 0, 0.25, holdout='source')
  side = {}
  for split in ('train', 'eval'):
    for i in by_source.records[split]:
      side.setdefault(data.source_group(rows[i]['source']), set()).add(split)
  assert all(len(s) == 1 for s in side.values())
  held = sum(s == {'eval'} for s in side.values())
  assert 0 < held < len(side)
  # split by record, the same packages straddle both sides (what the held-out split measured)
  by_record = data.SequenceData(rows, 16, 0, 0.25)
  straddle = {}
  for split in ('train', 'eval'):
    for i in by_record.records[split]:
      straddle.setdefault(rows[i]['source'].split('/')[0], set()).add(split)
  assert any(len(s) == 2 for s in straddle.values())


def test_held_out_records_follow_the_same_split(tmp_path):
  rows = records()
  os.makedirs(tmp_path / 'd')
  with gzip.open(tmp_path / 'd' / 'shard-00000.jsonl.gz', 'wt') as f:
    f.write('\n'.join(json.dumps(r) for r in rows) + '\n')
  split = data.SequenceData(rows, 16, 0, 0.25, holdout='source')
  held = data.held_out_records(str(tmp_path / 'd'), 0.25, 'source')
  assert [r['id'] for r in held] == [rows[i]['id'] for i in split.records['eval']]


def test_holding_out_by_source_needs_records_that_name_one():
  rows = [{k: v for k, v in r.items() if k != 'source'} for r in records()]
  with pytest.raises(ValueError, match="needs distillation shards whose records name their source"):
    data.SequenceData(rows, 16, 0, 0.25, holdout='source')

"""The distillation set as a TFDS array_record dataset: prepare from shards, read back exactly."""
import gzip
import json
import os
import subprocess
import sys

import pytest

from d2sd_jax.train import records as records_lib
from d2sd_jax.train import tfds_data


def _record(shard, i):
  return {
      # Two records share an id (as per-platform variants do in real shards).
      'id': 'dup0000000000000' if i in (1, 2) and shard == 0 else f'{shard:08x}{i:08x}',
      'style': ('complete_chat', 'instruct_chat', 'complete_plain')[i % 3],
      'prompt': f'def f{shard}_{i}(x):\n    """Doc with unicode: é ✓ {i}."""\n',
      'chat': i % 3 != 2,
      'source': f'mod{shard}.py:f{i}',
      'prompt_ids': [1, 2, 3 + i, 49151][:2 + i % 3],
      'response_ids': [] if i % 2 == 0 else [7] * i + [2],  # some empty
  }


@pytest.fixture
def shards(tmp_path):
  """Two gzip JSONL shards, in distill.py's format; returns (folder, records in shard order)."""
  folder = tmp_path / 'distill'
  folder.mkdir()
  records = []
  for shard in range(2):
    rows = [_record(shard, i) for i in range(5)]
    with gzip.open(folder / f'shard-{shard:05d}.jsonl.gz', 'wt') as f:
      f.write(''.join(json.dumps(r) + '\n' for r in rows))
    records.extend(rows)
  return str(folder), records


def test_prepare_and_read_back(shards, tmp_path):
  folder, records = shards
  data_dir = str(tmp_path / 'tfds')
  path = tfds_data.prepare(folder, data_dir)
  assert path == os.path.join(data_dir, 'd2sd_distill', '1.0.0')
  files = sorted(os.listdir(path))
  assert any('.array_record-' in f for f in files), files
  assert not any('tfrecord' in f for f in files), files

  got = tfds_data.read_records(data_dir)
  key = lambda r: (r['id'], r['prompt'])  # ids repeat, so the prompt breaks ties
  assert sorted(got, key=key) == sorted(records, key=key)
  assert all(type(r['chat']) is bool and type(r['id']) is str for r in got)
  assert all(all(type(t) is int for t in r['response_ids']) for r in got)
  # Shard order is kept, so it matches the JSONL reader exactly (same windows, same split).
  assert got == records == records_lib.read_records(folder)


def test_prepare_regenerates(shards, tmp_path):
  """distill.py grows the shards in place: preparing again must not serve the old set."""
  folder, records = shards
  data_dir = str(tmp_path / 'tfds')
  tfds_data.prepare(folder, data_dir)
  extra = [_record(2, i) for i in range(3)]
  with gzip.open(os.path.join(folder, 'shard-00002.jsonl.gz'), 'wt') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in extra))
  tfds_data.prepare(folder, data_dir)
  assert tfds_data.read_records(data_dir) == records + extra


def test_empty_shards_folder(tmp_path):
  empty = tmp_path / 'nothing'
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match='python scripts/distill.py') as e:
    tfds_data.prepare(str(empty), str(tmp_path / 'tfds'))
  assert str(empty) in str(e.value)
  assert not (tmp_path / 'tfds').exists()  # failed before creating anything


def test_read_unprepared(tmp_path):
  with pytest.raises(FileNotFoundError, match='python scripts/prepare_tfds.py'):
    tfds_data.read_records(str(tmp_path / 'tfds'))


def test_no_tensorflow(shards, tmp_path):
  """Preparing and reading must not need TensorFlow (a fresh process: other tests may load it)."""
  folder, _ = shards
  code = ('import sys; from d2sd_jax.train import tfds_data as t; '
          f't.prepare({folder!r}, {str(tmp_path / "tfds")!r}); '
          f'assert len(t.read_records({str(tmp_path / "tfds")!r})) == 10; '
          'print("tensorflow" in sys.modules)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == 'False'

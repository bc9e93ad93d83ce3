"""Whole-or-nothing writes (d2sd_jax/files.py): a reader sees the old file or the new one."""
import json
import os

import pytest

from d2sd_jax import files


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
  path = tmp_path / 'a.json'
  files.write_json(str(path), {'v': 1})
  with pytest.raises(RuntimeError, match='half-way'):
    with files.replaced(str(path)) as tmp:
      with open(tmp, 'w') as f:
        f.write('{"v": 2, "trunc')
      assert json.loads(path.read_text()) == {'v': 1}  # not yet replaced
      raise RuntimeError('half-way')
  assert json.loads(path.read_text()) == {'v': 1} and os.listdir(tmp_path) == ['a.json']
  files.write_json(str(path), {'v': 3})
  assert json.loads(path.read_text()) == {'v': 3} and os.listdir(tmp_path) == ['a.json']


def test_the_temporary_name_keeps_a_writers_suffix(tmp_path):
  """numpy adds .npz / .npy to a name without it: the temporary one ends in the suffix."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  path = tmp_path / 'shard.npz'
  with files.replaced(str(path), '.npz') as tmp:
    assert tmp.endswith('.npz') and os.path.dirname(tmp) == str(tmp_path)
    np.savez(tmp, x=np.arange(3))
  with np.load(path) as f:
    assert f['x'].tolist() == [0, 1, 2]
  assert os.listdir(tmp_path) == ['shard.npz']
  files.write_json(str(tmp_path / 'new' / 'b.json'), [1])  # the folder is made
  assert json.loads((tmp_path / 'new' / 'b.json').read_text()) == [1]

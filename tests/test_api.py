"""d2sd_jax.load / Decoder: generation equals decode.py's, save -> load round trip, bad input."""
import os
import shutil

import jax
import numpy as np
import pytest

import d2sd_jax
from d2sd_jax import api

import test_training  # pylint: disable=wrong-import-order


@pytest.fixture(scope='module')
def tiny_drafters(tiny_folder, distill_dir, tmp_path_factory):
  from d2sd_jax import training  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp('drafters')
  paths = {}
  for kind in ('drafter1', 'drafter2'):
    paths[kind] = str(root / kind)
    training.run(test_training.tiny_config(tiny_folder, distill_dir, paths[kind], kind, steps=3))
  return paths


def test_decoder_generates_losslessly_and_round_trips(tiny_folder, tiny_drafters, tmp_path):
  dec = d2sd_jax.load(tiny_folder, **tiny_drafters)
  assert dec.method == 'd2sd'
  prompts = ['abcabcab', 'hello hello', 'xyz']
  ar = dec.generate(prompts, 12, chat=False, method='ar')
  for method in ('pld', 'dflash', 'd2sd'):
    out = dec.generate(prompts, 12, chat=False, method=method)
    assert out.ids == ar.ids, method
    assert out.stats['cycles'] > 0 and out.stats['tau'] >= 1
  saved = dec.save(str(tmp_path / 'decoder'))
  again = d2sd_jax.load(saved)
  assert again.method == 'd2sd' and sorted(again.drafters) == ['drafter1', 'drafter2']
  for x, y in zip(jax.tree.leaves(dec.target.params), jax.tree.leaves(again.target.params)):
    np.testing.assert_array_equal(x, y)
  for name in ('drafter1', 'drafter2'):
    assert again.drafters[name][0] == dec.drafters[name][0]  # config incl. fitted temperature
    for x, y in zip(jax.tree.leaves(dec.drafters[name][1]),
                    jax.tree.leaves(again.drafters[name][1])):
      np.testing.assert_array_equal(x, y)
  assert again.target.tokenizer.encode('hello') == dec.target.tokenizer.encode('hello')
  assert again.generate(prompts, 12, chat=False).ids == ar.ids
  assert again.generate(prompts, 12, chat=True).ids == dec.generate(prompts, 12, chat=True).ids


def test_decoder_bad_input(tiny_folder, tiny_drafters, tmp_path):
  dec = d2sd_jax.load(tiny_folder, drafter1=tiny_drafters['drafter1'])
  assert dec.method == 'dflash'
  with pytest.raises(ValueError, match=r"method='d2sd' needs drafter2 .*drafter2=PATH"):
    dec.generate('abc', 4, method='d2sd')
  with pytest.raises(ValueError, match=r"method='medusa' is not one of \('ar', 'pld'"):
    dec.generate('abc', 4, method='medusa')
  with pytest.raises(ValueError, match=r'gama \(did you mean gamma\?\)'):
    dec.generate('abc', 4, gama=4)
  with pytest.raises(ValueError, match='steps=0 must be >= 1'):  # SpecSettings' own check
    dec.generate('abc', 4, steps=0)
  with pytest.raises(ValueError, match='empty prompt'):
    dec.generate([''], 4)
  with pytest.raises(ValueError, match='no prompts'):
    dec.generate([], 4)
  with pytest.raises(ValueError, match='exceeds the cache'):
    dec.generate('abc' * 20, 8, cache_len=32, chat=False)
  saved = dec.save(str(tmp_path / 'decoder'))
  damaged = str(tmp_path / 'damaged')
  shutil.copytree(saved, damaged)
  for root, _, files in os.walk(os.path.join(damaged, 'target')):
    for name in files:
      if not name.endswith('.json'):
        path = os.path.join(root, name)
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 3)
  with pytest.raises(ValueError, match='corrupt or incomplete|does not match'):
    d2sd_jax.load(damaged)
  os.remove(os.path.join(saved, 'target', api.TARGET_FILE))
  with pytest.raises(ValueError, match='missing or unreadable'):
    d2sd_jax.load(saved)


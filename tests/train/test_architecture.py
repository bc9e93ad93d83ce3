"""A drafter's architecture in train.py (d2sd_jax/train/architecture.py): set, inherited from
init_from, or following the target; SmolLM2's defaults are the shipped drafters'; a DFlash
folder fine-tunes and exports again; a workdir of another shape names the change."""
import dataclasses
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from d2sd_jax.formats import checkpoints
from d2sd_jax.formats import dflash_format
from d2sd_jax.formats import loaders
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.perf import costmodel
from d2sd_jax.train import architecture
from d2sd_jax.train import training

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import drafter1 as drafter1_config  # pylint: disable=wrong-import-position
from tests.train import test_training  # pylint: disable=wrong-import-position
from tests.conftest import write_fake_distill  # pylint: disable=wrong-import-position

DFLASH = os.path.join(ROOT, 'tests', 'fixtures', 'dflash_tiny')


def test_smollm2_defaults_are_the_shipped_drafters_architecture():
  """configs/drafter1.py with nothing set resolves, for the SmolLM2 target, to exactly the
  architecture the shipped drafter 1 was trained with (its metadata)."""
  tcfg = loaders.gguf_config(loaders.smollm2_gguf_path())
  dcfg = architecture.resolve(drafter1_config.get_config().drafter, tcfg, 'smollm2')
  shipped, _ = checkpoints.read_drafter_config('drafters/smollm2-drafter1')
  for field in architecture.FIELDS:
    assert getattr(dcfg, field) == getattr(shipped, field), field
  assert dcfg.norm_eps == 1e-5  # not the GGUF's float32 9.9999997e-6


def test_a_drafter_follows_its_target_as_dflash_builds_them():
  """For Qwen3-8B a 5-layer drafter is z-lab's Qwen3-8B-DFlash-b16 shape: the target's width,
  heads, FFN, RoPE base, norm eps, q/k norms, and target_layer_ids [1, 9, 17, 25, 33]."""
  group = drafter1_config.get_config().drafter
  group.update(n_layers=5, gamma=16)
  dcfg = architecture.resolve(group, costmodel.TARGETS['qwen3-8b'], 'qwen3-8b')
  assert (dcfg.d_model, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, dcfg.d_ff) == (
      4096, 32, 8, 128, 12288)
  assert (dcfg.rope_base, dcfg.norm_eps, dcfg.qk_norm) == (1e6, 1e-6, True)
  assert [i - dflash_format.OFFSET for i in dcfg.feature_layers] == [1, 9, 17, 25, 33]
  assert dcfg.head_vocab == 8192  # a 151,936-token vocabulary: the cheaper head
  group.update(d_model=1024, qk_norm=False)  # what is set wins
  dcfg = architecture.resolve(group, costmodel.TARGETS['qwen3-8b'], 'qwen3-8b')
  assert dcfg.d_model == 1024 and not dcfg.qk_norm and dcfg.n_heads == 32


def test_init_from_sets_the_whole_architecture_and_a_contradiction_names_both():
  source = drafter_lib.DrafterConfig(gamma=16, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
                                     head_dim=16, d_ff=48, feature_layers=(1, 3),
                                     rope_base=5e4, norm_eps=1e-5, qk_norm=True,
                                     confidence_temperature=1.3, dtype='bfloat16')
  tcfg = costmodel.TARGETS['qwen3-8b']  # another shape altogether: not what init_from follows
  group = drafter1_config.get_config().drafter
  dcfg = architecture.resolve(group, tcfg, 'x', source, 'DF')
  assert dcfg == dataclasses.replace(source, confidence_temperature=1.0, dtype='float32')
  group.gamma = 16  # agreeing with the source: fine
  assert architecture.resolve(group, tcfg, 'x', source, 'DF') == dcfg
  group.update(gamma=8, qk_norm=False)
  with pytest.raises(ValueError, match=r"drafter.gamma=8 but init_from='DF' has 16; "
                                       r"drafter.qk_norm=False but init_from='DF' has True"):
    architecture.resolve(group, tcfg, 'x', source, 'DF')


def _char_target(tmp_path) -> str:
  """The DFlash fixture's target with a character-level tokenizer (ids 0..62, EOS 63)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models  # pylint: disable=import-outside-toplevel
  folder = tmp_path / 'target'
  shutil.copytree(os.path.join(DFLASH, 'target'), folder)
  bpe = tokenizers.Tokenizer(models.BPE(vocab={chr(32 + i): i for i in range(63)}, merges=[]))
  bpe.add_special_tokens(['<eos>'])
  bpe.decoder = decoders.Fuse()
  bpe.save(str(folder / 'tokenizer.json'))
  (folder / 'generation_config.json').write_text(json.dumps({'eos_token_id': 63}))
  return str(folder)


def test_a_dflash_folder_fine_tunes_and_exports_to_dflash_format(tmp_path):
  """train.py from a DFlash folder (init_from, no drafter.* field set): its architecture, q/k
  norms included, and its mask token are kept, so the result exports as a DFlash folder of the
  same shape; the layers did train."""
  target_dir = _char_target(tmp_path)
  data = tmp_path / 'distill'
  write_fake_distill(data, vocab=62)
  c = drafter1_config.get_config()
  c.update(target=target_dir, workdir=str(tmp_path / 'run'),
           init_from=os.path.join(DFLASH, 'drafter'), log_every=1, eval_every=0,
           progress_bar=False)
  c.data.update(path=str(data), seq_len=24, eval_fraction=0.0)
  c.train.update(batch_size=2, anchors_per_seq=4, steps=2, lr=1e-2, warmup=1)
  out = training.run(c)
  target = loaders.load_target(target_dir)
  src_cfg, src, _ = dflash_format.load_folder(os.path.join(DFLASH, 'drafter'), target)
  np.testing.assert_array_equal(out['params']['mask_embed'], target.params['embed'][63])
  assert not np.array_equal(out['params']['layers'][0]['q_norm'], src['layers'][0]['q_norm'])
  info = dflash_format.export_drafter(str(tmp_path / 'run'), str(tmp_path / 'tuned'), target)
  assert info['mask_token_id'] == 63
  dcfg, params, _ = dflash_format.load_folder(str(tmp_path / 'tuned'), target)
  for field in architecture.FIELDS:
    assert getattr(dcfg, field) == getattr(src_cfg, field), field
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(out['params'])):
    np.testing.assert_array_equal(a, b)
  # a mask token init_from contradicts is refused
  c.drafter.mask_token_id = 62
  c.update(workdir=str(tmp_path / 'clash'))
  with pytest.raises(ValueError, match=r"drafter.mask_token_id=62 but init_from=.* has "
                                       r'mask_token_id 63: drop the flag'):
    training.run(c)


@pytest.mark.slow
def test_a_drafter_from_scratch_with_a_mask_token_exports_to_dflash_format(tmp_path):
  """From scratch with drafter.mask_token_id: the Qwen3 target's shape (q/k norms included) and
  a frozen mask token, so it exports as a DFlash folder too."""
  target_dir = _char_target(tmp_path)
  data = tmp_path / 'distill'
  write_fake_distill(data, vocab=62)
  c = drafter1_config.get_config()
  c.update(target=target_dir, workdir=str(tmp_path / 'scratch'), log_every=1, eval_every=0,
           progress_bar=False)
  c.data.update(path=str(data), seq_len=24, eval_fraction=0.0)
  c.train.update(batch_size=2, anchors_per_seq=4, steps=2, lr=1e-2, warmup=1)
  c.drafter.mask_token_id = 62
  out = training.run(c)
  target = loaders.load_target(target_dir)
  np.testing.assert_array_equal(out['params']['mask_embed'], target.params['embed'][62])
  info = dflash_format.export_drafter(str(tmp_path / 'scratch'), str(tmp_path / 'new'), target)
  dcfg, _, _ = dflash_format.load_folder(str(tmp_path / 'new'), target)
  assert info['mask_token_id'] == 62 and dcfg.qk_norm and dcfg.d_model == target.cfg.d_model


def test_a_run_says_what_it_does_and_a_changed_shape_is_named(tiny_folder, distill_dir,
                                                              tmp_path, capsys):
  """A warmup past the last step is warned of with the numbers; without a progress bar a
  metrics line comes every log_every steps; the end names the checkpoint and what to run next.
  Resuming a workdir whose drafter has another shape than the config says is a changed
  config, named field by field, not a damaged checkpoint; the workdir is left as it was."""
  workdir = str(tmp_path / 'run')
  c = test_training.tiny_config(tiny_folder, distill_dir, workdir, steps=3)
  c.train.warmup = 5
  training.run(c)
  out, err = capsys.readouterr()
  assert ('train.warmup=5 >= train.steps=3: the learning rate never reaches train.lr=0.01; set '
          '--config.train.warmup=1') in err
  assert [l.split(':')[0] for l in out.splitlines() if l.startswith('step ')] == [
      'step 1/3', 'step 2/3', 'step 3/3']
  assert f'checkpoint: {os.path.join(workdir, "checkpoints", "3")}' in out
  assert (f'python train.py --config configs/drafter2.py --config.target={tiny_folder} '
          f'--config.data.path={distill_dir} --config.init_from={workdir}') in out
  assert f'python scripts/export_drafter.py {workdir} OUT' in out
  before = sorted(os.listdir(os.path.join(workdir, 'checkpoints')))
  c = test_training.tiny_config(tiny_folder, distill_dir, workdir, steps=6)
  c.drafter.d_ff = 64
  with pytest.raises(ValueError, match=r'the config changed \(d_ff: 48 -> 64\): use another '
                                       r'workdir, or the old values'):
    training.run(c)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == before


def test_exports_find_the_target_a_checkpoint_records(tiny_folder, tiny_drafters, tmp_path):
  """scripts/export_drafter.py and scripts/dflash.py export without --target use the target the
  checkpoint records; a --target it was not made for, or a folder that records none, is refused
  naming the fix."""
  from d2sd_jax.formats import drafters  # pylint: disable=import-outside-toplevel
  source, target = drafters.recorded_target(tiny_drafters['drafter1'])
  assert source == os.path.abspath(tiny_folder) and target.cfg.n_layers == 2
  other = test_training.another_target(tiny_folder, tmp_path)
  with pytest.raises(ValueError, match=rf"was trained for target .* \(--target {other}\): leave "
                                       rf"--target out to use the recorded '{source}'"):
    drafters.recorded_target(tiny_drafters['drafter1'], other)
  with pytest.raises(ValueError, match=r'records no target: pass --target'):
    drafters.recorded_target(os.path.join(DFLASH, 'drafter'))


def test_init_from_a_drafter_of_another_target_names_the_flag(tiny_folder, distill_dir,
                                                              tmp_path):
  """configs/drafter2.py starts from the shipped SmolLM2 drafter 1: with another target that is
  refused before its architecture is taken (its feature layers would not fit), naming the flag."""
  sys.path.insert(0, os.path.join(ROOT, 'configs'))
  import drafter2 as drafter2_config  # pylint: disable=import-outside-toplevel
  c = drafter2_config.get_config()
  c.update(target=tiny_folder, workdir=str(tmp_path / 'run'))
  c.data.update(path=distill_dir, seq_len=24)
  with pytest.raises(ValueError, match=r"init_from='drafters/smollm2-drafter1': checkpoint .* was "
                                       r"trained for target 'smollm2'.*Set --config.init_from to "
                                       r"a drafter for this target"):
    training.run(c)
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints') or not os.listdir(
      tmp_path / 'run' / 'checkpoints')

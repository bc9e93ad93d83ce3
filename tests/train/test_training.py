"""train.py on tiny configs: loss goes down, exact resume, target mismatch and damaged checkpoints."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from d2sd_jax.train import features
from d2sd_jax.train import blocks
from d2sd_jax.train import training
from d2sd_jax.formats import loaders
from d2sd_jax.formats.drafters import load_drafter

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import drafter1 as drafter1_config  # pylint: disable=wrong-import-position


def another_target(tiny_folder, tmp_path):
  """The tiny checkpoint with another RoPE base: same shapes, a different model."""
  other = tmp_path / 'other'
  shutil.copytree(tiny_folder, other)
  cfg = json.loads((other / 'config.json').read_text())
  (other / 'config.json').write_text(json.dumps({**cfg, 'rope_theta': 1234.0,
                                                 'rope_parameters': None}))
  return str(other)


def tiny_config(target, data, workdir, kind='drafter1', steps=6):
  c = drafter1_config.get_config()
  c.kind, c.target, c.workdir = kind, target, workdir
  c.drafter.update(gamma=4, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
                   feature_layers=(0, 1, 2), rope_base=10000.0, norm_eps=1e-6, head_vocab=48,
                   qk_norm=False)
  c.data.update(path=data, seq_len=24, eval_fraction=0.2)
  c.train.update(batch_size=3, anchors_per_seq=6, steps=steps, lr=1e-2, warmup=2)
  c.update(log_every=1, eval_every=3, save_every=3, keep=5, progress_bar=False)
  return c


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['drafter1', 'drafter2'])
def test_training_lowers_the_loss(tiny_folder, distill_dir, tmp_path, kind):
  out = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / kind), kind, steps=30))
  lines = [json.loads(l) for l in open(tmp_path / kind / 'metrics.jsonl')]
  losses = [l['loss'] for l in lines if 'loss' in l]
  assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5])
  assert out['eval']['tau_estimate'] >= 1.0
  assert 0.0 <= out['eval']['ece'] <= 1.0 and out['eval']['confidence_temperature'] > 0
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(tmp_path / kind / 'tb'))
  assert out['tokens_per_s'] > 0


def test_interrupted_run_resumes_exactly(tiny_folder, distill_dir, tmp_path, capsys):
  """Resuming continues from the checkpoint: only the remaining steps run and are logged, with
  the losses the uninterrupted run had at those steps, and the parameters end bit-identical.
  (Equal final parameters alone cannot tell a resume from a rerun of every step from scratch.)"""
  whole = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'a'), steps=6))
  training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'b'), steps=3))
  capsys.readouterr()
  ran = []
  resumed = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'b'), steps=6),
                         on_step=ran.append)
  assert ran == [4, 5, 6]  # steps executed after the resume
  assert 'resumed from step 3' in capsys.readouterr().out
  logged = lambda run: [l for l in map(json.loads, open(tmp_path / run / 'metrics.jsonl'))
                        if 'loss' in l]
  assert [l['step'] for l in logged('b')] == [1, 2, 3, 4, 5, 6]  # 1-3 before, 4-6 resumed
  assert [l['loss'] for l in logged('b')] == [l['loss'] for l in logged('a')]
  for x, y in zip(jax.tree.leaves(whole['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)


def test_train_py_user_error_is_one_line(tmp_path):
  """train.py refuses a bad config value in one line on stderr, exit status 2, before loading."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), '--config',
                         os.path.join(ROOT, 'configs', 'drafter1.py'),
                         '--config.train.batch_size=0', f'--config.workdir={tmp_path}'],
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == 'error: train.batch_size=0 must be >= 1'


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_the_resumed_run_is_exact(tiny_folder, distill_dir,
                                                                 tmp_path, sig):
  """A real signal (a preempted pod job, Ctrl-C) mid-run: the step finishes, a checkpoint is
  written at that step (not a multiple of save_every), and resuming ends bit-identical."""
  whole = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'a'), steps=8))
  before = signal.getsignal(sig)

  def send(step):
    if step == 4:
      os.kill(os.getpid(), sig)

  stopped = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'b'), steps=8),
                         on_step=send)
  assert stopped['stopped_by'] == signal.Signals(sig).name
  assert sorted(os.listdir(tmp_path / 'b' / 'checkpoints')) == ['3', '4']
  assert signal.getsignal(sig) == before  # the handler is put back
  resumed = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'b'), steps=8))
  assert resumed['step'] == 8 and 'stopped_by' not in resumed
  for x, y in zip(jax.tree.leaves(whole['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_precomputed_features_train_like_in_step_features(tiny_folder, distill_dir, tmp_path):
  """The float16 feature file is a cache, not a different recipe: same losses to float16
  precision; a second run reuses the file."""
  runs = {}
  for pre in (True, False):
    c = tiny_config(tiny_folder, distill_dir, str(tmp_path / str(pre)), steps=4)
    c.train.precompute_features = pre
    runs[pre] = training.run(c)
  np.testing.assert_allclose(runs[True]['loss'], runs[False]['loss'], rtol=2e-3)
  files = os.listdir(tmp_path / 'True' / 'features' / 'train')  # (its lock removed)
  assert len(files) == 1 and files[0].startswith('features-') and files[0].endswith('.npy')
  assert not os.path.exists(tmp_path / 'False' / 'features')


def test_an_interrupted_features_pass_resumes_where_it_stopped(tiny_folder, tmp_path,
                                                               monkeypatch):
  """precompute_features killed part-way keeps the windows it finished; the next run computes
  only the rest, and the file equals one computed in one go. Another run's partial file (other
  windows: another hash) is never read."""
  target = loaders.load_target(tiny_folder)
  dcfg = training.drafter_config(tiny_config(tiny_folder, '', ''))
  tokens = np.random.default_rng(0).integers(0, 90, (11, 12)).astype(np.int32)
  whole = np.array(features.precompute_features(target, dcfg, tokens, str(tmp_path / 'whole'),
                                                batch=2, progress=False))
  monkeypatch.setattr(features, 'FEATURES_SAVE_EVERY', 4)
  seen = []

  def stops_after(n):
    def iterate(it, **_):
      for k, i in enumerate(it):
        if k == n:
          raise KeyboardInterrupt
        seen.append(i)
        yield i
    return iterate

  monkeypatch.setattr(features, 'tqdm', stops_after(5))  # killed in its 6th batch (window 10)
  with pytest.raises(KeyboardInterrupt):
    features.precompute_features(target, dcfg, tokens, str(tmp_path / 'cut'), batch=2)
  names = sorted(os.listdir(tmp_path / 'cut'))
  assert [n.split('.npy')[1] for n in names] == ['.lock', '.partial', '.rows']
  assert (tmp_path / 'cut' / names[2]).read_text() == '8'  # the last save: windows 0..7
  seen.clear()
  monkeypatch.setattr(features, 'tqdm', stops_after(99))
  # other windows in the same folder: another file, computed from the start
  features.precompute_features(target, dcfg, tokens[::-1].copy(), str(tmp_path / 'cut'), batch=2)
  assert seen == [0, 2, 4, 6, 8, 10]
  seen.clear()
  resumed = features.precompute_features(target, dcfg, tokens, str(tmp_path / 'cut'), batch=2)
  assert seen == [8, 10]  # only the windows not saved before
  np.testing.assert_allclose(np.asarray(resumed), whole, rtol=1e-3, atol=1e-3)
  assert [n for n in os.listdir(tmp_path / 'cut') if not n.endswith('.npy')] == []


def test_a_features_pass_waits_for_another_computing_the_same_file(tiny_folder, tmp_path,
                                                                   monkeypatch):
  """Two runs sharing a features folder (drafter 2 reusing drafter 1's): while one holds the
  file's lock, the other waits, then reads the finished file instead of computing it again."""
  target = loaders.load_target(tiny_folder)
  dcfg = training.drafter_config(tiny_config(tiny_folder, '', ''))
  tokens = np.random.default_rng(1).integers(0, 90, (3, 12)).astype(np.int32)
  first = features.precompute_features(target, dcfg, tokens, str(tmp_path), progress=False)
  path = next(p for p in tmp_path.iterdir() if p.suffix == '.npy')
  (tmp_path / 'kept.npy').write_bytes(path.read_bytes())
  path.unlink()  # as if a first run were still computing it, holding the lock
  computed = []
  compute = features._compute_features  # pylint: disable=protected-access
  monkeypatch.setattr(features, '_compute_features', lambda *a: computed.append(a) or compute(*a))
  result = {}
  with open(str(path) + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    waiting = threading.Thread(target=lambda: result.update(feats=features.precompute_features(
        target, dcfg, tokens, str(tmp_path), progress=False)))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and not path.exists()  # it waits, computing nothing
    (tmp_path / 'kept.npy').rename(path)  # the first run's file, finished
  waiting.join(30)
  assert not waiting.is_alive()
  np.testing.assert_array_equal(np.asarray(result['feats']), np.asarray(first))
  assert not computed  # read, not computed again


@pytest.mark.slow
def test_gradient_accumulation_and_remat_give_the_same_update(tiny_folder, distill_dir,
                                                             tmp_path):
  """grad_accum=3 (three micro-batches of one sequence, whose loss weights differ) and remat
  change memory, not the update: the parameters after 3 steps equal the plain run's."""
  runs = {}
  for name, accum, remat in (('plain', 1, False), ('accum', 3, False), ('remat', 1, True)):
    c = tiny_config(tiny_folder, distill_dir, str(tmp_path / name), steps=3)
    c.train.update(grad_accum=accum, remat=remat)
    runs[name] = training.run(c)
  for name in ('accum', 'remat'):
    # the held-out loss (accuracy is still 0 after 3 steps: it could not tell them apart)
    assert runs[name]['eval']['loss'] == pytest.approx(runs['plain']['eval']['loss'], rel=1e-5)
    for x, y in zip(jax.tree.leaves(runs['plain']['params']),
                    jax.tree.leaves(runs[name]['params'])):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_bfloat16_target_and_compute_keep_float32_master_weights(tiny_folder, distill_dir,
                                                                 tmp_path):
  """The pod recipe: a bfloat16 target and bfloat16 drafter arithmetic train the float32
  master weights to nearly the float32 run's losses (but not bit-identically: bfloat16 was
  really used); the checkpoint loads for the float32 target too (dtype-free fingerprint)."""
  runs = {}
  for name, dtype in (('f32', 'float32'), ('bf16', 'bfloat16')):
    c = tiny_config(tiny_folder, distill_dir, str(tmp_path / name), steps=4)
    c.dtype = dtype
    c.train.compute_dtype = dtype
    runs[name] = training.run(c)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(runs['bf16']['params'])
             if np.issubdtype(x.dtype, np.floating))
  assert runs['bf16']['loss'] == pytest.approx(runs['f32']['loss'], rel=0.05)
  assert runs['bf16']['loss'] != runs['f32']['loss']
  from d2sd_jax.formats import loaders
  for dtype in ('float32', 'bfloat16'):
    dcfg, params, _ = load_drafter(str(tmp_path / 'bf16'),
                                               loaders.load_target(tiny_folder, dtype), dtype)
    assert dcfg.dtype == dtype and params['fc'].dtype == dtype


@pytest.mark.slow
def test_head_vocab_and_init_from(tiny_folder, distill_dir, tmp_path):
  """The drafter head keeps the data's most frequent tokens; drafter 2 can start from drafter 1
  (same architecture required)."""
  from d2sd_jax.train import data as data_lib
  from d2sd_jax.train import records
  from d2sd_jax.formats import loaders
  d1 = str(tmp_path / 'd1')
  out1 = training.run(tiny_config(tiny_folder, distill_dir, d1, steps=3))
  target = loaders.load_target(tiny_folder)
  data = data_lib.SequenceData(records.read_records(distill_dir), 24, target.tokenizer.pad_id, 0.2)
  response, _ = data.token_counts(target.cfg.vocab_size, target.tokenizer.pad_id)
  ids = set(np.asarray(out1['params']['head_ids']).tolist())
  assert len(ids) == 48
  seen = np.flatnonzero(response)
  if len(seen) <= 48:  # every token a response uses is in the head
    assert set(seen.tolist()) <= ids
  c = tiny_config(tiny_folder, distill_dir, str(tmp_path / 'd2'), 'drafter2', steps=1)
  c.init_from = d1
  c.train.lr = 1e-30  # one step at lr ~0: the start is drafter 1 exactly
  out2 = training.run(c)
  _, p1, _ = load_drafter(d1, target)
  for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(out2['params'])):
    np.testing.assert_array_equal(x, y)
  c = tiny_config(tiny_folder, distill_dir, str(tmp_path / 'd3'), 'drafter2', steps=1)
  c.init_from, c.drafter.d_ff = d1, 64
  with pytest.raises(ValueError, match=r"drafter.d_ff=64 but init_from=.* has 48: init_from sets "
                                       r"the whole drafter architecture"):
    training.run(c)


@pytest.mark.slow
def test_checkpoint_of_another_target_is_refused(tiny_folder, distill_dir, tmp_path):
  workdir = str(tmp_path / 'run')
  training.run(tiny_config(tiny_folder, distill_dir, workdir, steps=3))
  with pytest.raises(ValueError, match='was trained for target'):
    training.run(tiny_config(another_target(tiny_folder, tmp_path), distill_dir, workdir, steps=6))


@pytest.mark.slow
def test_damaged_checkpoint_is_explained_and_others_survive(tiny_folder, distill_dir, tmp_path):
  workdir = tmp_path / 'run'
  training.run(tiny_config(tiny_folder, distill_dir, str(workdir), steps=6))
  ckpts = workdir / 'checkpoints'
  assert sorted(os.listdir(ckpts)) == ['3', '6']
  # Damage step 6: truncate every file of its parameters.
  for root, _, files in os.walk(ckpts / '6' / 'params'):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'r+b') as f:
        f.truncate(max(0, os.path.getsize(path) // 3))
  with pytest.raises(ValueError, match='corrupt or incomplete|unreadable'):
    training.run(tiny_config(tiny_folder, distill_dir, str(workdir), steps=9))
  assert sorted(os.listdir(ckpts)) == ['3', '6']  # nothing deleted or overwritten
  # Moving the damaged one away resumes from step 3.
  shutil.move(str(ckpts / '6'), str(tmp_path / 'damaged-6'))
  out = training.run(tiny_config(tiny_folder, distill_dir, str(workdir), steps=9))
  assert out['step'] == 9


@pytest.mark.slow
def test_crash_mid_save_is_never_loaded(tiny_folder, distill_dir, tmp_path):
  """A save cut short (a killed process) leaves Orbax's temporary folder: resuming ignores it,
  continues from the last finished checkpoint and ends exactly like an uninterrupted run."""
  whole = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'a'), steps=9))
  workdir = tmp_path / 'b'
  training.run(tiny_config(tiny_folder, distill_dir, str(workdir), steps=6))
  ckpts = workdir / 'checkpoints'
  partial = ckpts / '6.orbax-checkpoint-tmp-1764500000000000'  # what an interrupted save leaves
  os.rename(ckpts / '6', partial)
  for root, _, files in os.walk(partial):  # and half-written files in it
    for name in files:
      with open(os.path.join(root, name), 'r+b') as f:
        f.truncate(os.path.getsize(os.path.join(root, name)) // 2)
  resumed = training.run(tiny_config(tiny_folder, distill_dir, str(workdir), steps=9))
  assert resumed['step'] == 9
  for x, y in zip(jax.tree.leaves(whole['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_training_reads_the_tfds_copy(tiny_folder, distill_dir, tmp_path):
  from d2sd_jax.train import tfds_data  # pylint: disable=import-outside-toplevel
  prepared = tfds_data.prepare(distill_dir, str(tmp_path / 'tfds'))
  c = tiny_config(tiny_folder, distill_dir, str(tmp_path / 'run'), steps=3)
  c.data.update(source='tfds', tfds_dir=str(tmp_path / 'tfds'), path='/nonexistent')
  from_tfds = training.run(c)
  from_shards = training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'run2'), steps=3))
  assert os.path.isdir(prepared)
  for x, y in zip(jax.tree.leaves(from_tfds['params']), jax.tree.leaves(from_shards['params'])):
    np.testing.assert_array_equal(x, y)  # same records, same order, same batches


def test_bad_training_configs(tiny_folder, distill_dir, tmp_path):
  with pytest.raises(ValueError, match='kind'):
    training.run(tiny_config(tiny_folder, distill_dir, str(tmp_path), kind='drafter3'))
  c = tiny_config(tiny_folder, distill_dir, str(tmp_path))
  c.data.seq_len = 4
  with pytest.raises(ValueError, match='seq_len'):
    training.run(c)
  c = tiny_config(tiny_folder, str(tmp_path / 'nothing-here'), str(tmp_path))
  with pytest.raises(FileNotFoundError, match='scripts/distill.py'):
    training.run(c)


def _with(c, field, value):
  """A copy of config c with a dotted field set (or added, for unknown fields)."""
  c = c.copy_and_resolve_references()
  c.unlock()
  *path, last = field.split('.')
  node = c
  for p in path:
    node = node[p]
  node[last] = value
  return c


@pytest.mark.parametrize('field,value,match', [
    ('train.step', 10, r'unknown training config field\(s\): train.step \(did you mean '
                       r'train.steps\?\)'),
    ('learning_rate', 1e-3, r'unknown training config field\(s\): learning_rate'),
    ('drafter.n_kv_heads', 3, r'drafter.n_heads=4 must be a multiple of drafter.n_kv_heads=3'),
    ('drafter.d_model', 0, r'drafter.d_model=0 must be >= 1'),
    ('drafter.head_vocab', 10_000, r'head_vocab=10000 exceeds the target\'s vocabulary'),
    ('drafter.feature_layers', (0, 9), r'feature_layers \[9\] outside the target'),
    ('train.batch_size', 0, r'train.batch_size=0 must be >= 1'),
    ('data.eval_fraction', 1.0, r'data.eval_fraction=1.0 must be in \[0, 1\)'),
    ('loss.beta', 1.0, r'loss.beta=1.0 must be in \(0, 1\)'),
    ('mesh.data', 2, r'mesh.data=2 x mesh.model=1 does not fit the 1 devices'),
    ('mesh.model', 0, r'mesh.model=0: use a positive size or -1'),
    ('train.grad_accum', 2, r'train.grad_accum=2 must be >= 1 and divide train.batch_size=3'),
    ('train.compute_dtype', 'float16', r"train.compute_dtype='float16': use 'float32' or "
                                       r"'bfloat16'"),
    ('dtype', 'int8', r"dtype='int8': use 'float32' or 'bfloat16'"),
    ('loss.soft', 0.5, r"loss.soft needs the target's distributions, which only a teacher-forced "
                       r"corpus stores: set data.corpus_path"),
    ('loss.soft', 1.5, r'loss.soft=1.5 must be in \[0, 1\]'),
])
def test_training_config_errors_name_the_field(tiny_folder, distill_dir, tmp_path, field, value,
                                               match):
  c = _with(tiny_config(tiny_folder, distill_dir, str(tmp_path / 'run')), field, value)
  with pytest.raises(ValueError, match=match):
    training.run(c)
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints') or not os.listdir(
      tmp_path / 'run' / 'checkpoints')  # refused before anything is written


@pytest.mark.slow
def test_trained_drafters_decode_losslessly(tiny_folder, distill_dir, tmp_path):
  """train.py checkpoints (one exported to the shipped bfloat16 form) drive every drafter
  method of decode.py; the completions equal AR's; a drafter for another target is refused."""
  import io
  from d2sd_jax.decode import generate as generate_lib
  from d2sd_jax.formats import checkpoints
  from d2sd_jax.formats import loaders
  import smollm2 as smollm2_config  # pylint: disable=import-outside-toplevel
  d1, d2 = str(tmp_path / 'd1'), str(tmp_path / 'd2')
  training.run(tiny_config(tiny_folder, distill_dir, d1, 'drafter1', steps=3))
  training.run(tiny_config(tiny_folder, distill_dir, d2, 'drafter2', steps=3))
  target = loaders.load_target(tiny_folder)
  checkpoints.export_drafter(d2, str(tmp_path / 'd2-export'), target)
  dcfg, params, meta = load_drafter(str(tmp_path / 'd2-export'), target)
  assert meta['kind'] == 'drafter2' and dcfg.gamma == 4
  assert dcfg.confidence_temperature == meta['confidence_temperature']  # fitted at step 3
  assert dcfg.head_vocab == 48 and params['head_ids'].dtype == np.int32
  _, trained, _ = load_drafter(d2, target)
  np.testing.assert_array_equal(params['head_ids'], trained['head_ids'])  # kept exactly
  weights = {k: v for k, v in params.items() if k != 'head_ids'}
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(weights))

  def decode(**overrides):
    c = smollm2_config.get_config()
    settings = dict(target=tiny_folder, prompt='abcabcab', chat=False, max_new_tokens=10,
                    spec={'gamma': 4, 'n_branches': 2}, drafter1=d1,
                    drafter2=str(tmp_path / 'd2-export'), output=str(tmp_path / 'out.jsonl'))
    c.update({**settings, **overrides})
    stats = generate_lib.run(c, out=io.StringIO())
    return stats, json.loads((tmp_path / 'out.jsonl').read_text())['completion_ids']

  _, ar = decode(method='ar')
  for method in ('dflash', 'dflash_resample', 'dflash_dflash', 'd2sd'):
    stats, ids = decode(method=method)
    assert ids == ar, method
    assert stats['cycles'] >= 1 and stats['tau'] >= 1.0
  with pytest.raises(ValueError, match='needs drafter2'):
    decode(method='d2sd', drafter2='')

  with pytest.raises(ValueError, match='was trained for target'):
    decode(method='dflash', target=another_target(tiny_folder, tmp_path))


def test_memory_arithmetic_counts_parameters_exactly(tiny_folder, distill_dir, tmp_path):
  """d2sd_jax.train.memory: on a 1x1 mesh the parameter and optimizer bytes are the real ones; the
  model axis divides what the sharding rules split; micro-batches shrink the activations."""
  from d2sd_jax.models import drafter as drafter_lib  # pylint: disable=import-outside-toplevel
  from d2sd_jax.formats import loaders  # pylint: disable=import-outside-toplevel
  from d2sd_jax.train import memory
  c = tiny_config(tiny_folder, distill_dir, str(tmp_path / 'run'))
  target = loaders.load_target(tiny_folder)
  one = memory.training_memory(c, target.cfg, 1, 1)
  assert one['target weights'] == sum(x.nbytes for x in jax.tree.leaves(target.params))
  dparams = drafter_lib.init_params(training.drafter_config(c), target.cfg, jax.random.PRNGKey(0))
  trainable = drafter_lib.split_fixed(dparams)[0]
  assert one['drafter float32 master weights'] == sum(x.size * 4 for x in
                                                      jax.tree.leaves(trainable))
  assert one['Adam moments (2 x float32)'] == 2 * one['drafter float32 master weights']
  two = memory.training_memory(c, target.cfg, 1, 2)
  assert 0.5 * one['target weights'] < two['target weights'] < 0.75 * one['target weights']
  c.train.update(batch_size=4, grad_accum=2)
  c.train.remat = True
  small = memory.training_memory(c, target.cfg, 1, 1)
  assert small['target features kept'] < one['target features kept']
  assert small['drafter activations kept for backward'] < one[
      'drafter activations kept for backward']


def test_the_readme_pod_recipe_is_valid_and_fits_a_v5e_chip():
  """The pod recipe of docs/scale-out.md, flag for flag: a valid training config for Qwen3-8B's shapes whose
  per-chip memory (d2sd_jax.train.memory, 4x8 mesh) leaves half of a 16 GiB v5e chip free."""
  import ast  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  from d2sd_jax.perf import costmodel  # pylint: disable=import-outside-toplevel
  from d2sd_jax.train import memory
  with open(os.path.join(ROOT, 'docs', 'scale-out.md')) as f:
    page = f.read()
  recipe = page.split('## The pod recipe', 1)[1].split('```bash', 1)[1].split('```', 1)[0]
  c = drafter1_config.get_config()
  flags = re.findall(r"--config\.([\w.]+)=('[^']*'|\S+)", recipe)
  assert len(flags) >= 15
  for field, value in flags:
    value = value.strip("'")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass  # a string such as a path or a dtype
    node = c
    *path, last = field.split('.')
    for p in path:
      node = node[p]
    node[last] = value
  training.validate(c)
  tcfg = costmodel.TARGETS['qwen3-8b']
  training.drafter_config(c, tcfg).check_target(tcfg)
  assert c.train.batch_size % (4 * c.train.grad_accum) == 0
  total = sum(memory.training_memory(c, tcfg, 4, 8).values())
  assert total < 8 * memory.GiB, total / memory.GiB


def test_held_out_blocks_are_fully_masked_even_when_training_reveals(tiny_folder, distill_dir):
  """loss.reveal partly unmasks training blocks only: evaluation measures the fully masked
  blocks that one-step decoding drafts (revealed blocks would inflate the held-out τ)."""
  c = tiny_config(tiny_folder, distill_dir, '')
  c.loss.reveal = 1.0
  mask = np.ones((3, 24), bool)
  _, _, _, train_reveal, _ = blocks.sample_blocks(jax.random.PRNGKey(0), mask, c, 4)
  _, _, _, eval_reveal, _ = blocks.sample_blocks(jax.random.PRNGKey(0), mask, c, 4,
                                                  evaluate=True)
  assert np.asarray(train_reveal).any() and eval_reveal is None

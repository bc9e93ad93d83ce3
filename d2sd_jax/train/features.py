"""The frozen target's features that the drafters read, and the teacher pass that computes them
once for a whole training set.

`target_features` is one target pass over a batch of windows (what the jitted train step runs
when features are not precomputed). With `train.precompute_features` (the CPU recipe, where the
teacher pass costs about as much as the drafter's whole step), `precompute_features` writes
every window's features to a float16 file that resumed runs memory-map, and `Rows` looks rows
up across the main source's and a corpus's files.
"""
from __future__ import annotations

import fcntl
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from d2sd_jax import files
from d2sd_jax.formats import checkpoints as ckpt
from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import target as model_lib

# precompute_features: windows between the saves of an interrupted pass's progress
FEATURES_SAVE_EVERY = 64


def target_features(tparams, tcfg, dcfg, tokens_BxL):
  """The drafter's input features [B, L, F] of a batch of sequences, from one target pass."""
  B, L = tokens_BxL.shape
  _, _, feats = model_lib.forward(tparams, tcfg, tokens_BxL,
                                  jnp.broadcast_to(jnp.arange(L), (B, L)),
                                  model_lib.init_cache(tcfg, B, L), jnp.zeros((B,), jnp.int32),
                                  feature_layers=dcfg.feature_layers, fresh=True)
  return drafter_lib.features_of(feats)


def precompute_features(target, dcfg, tokens_NxL: np.ndarray, directory: str,
                        batch: int = 8, progress: bool = True) -> np.ndarray:
  """Target features of every training/eval window, computed once and kept as a float16 file
  (memory-mapped) that resumed runs reuse: on a CPU the teacher pass costs about as much as the
  drafter's whole training step, and every epoch would otherwise repeat it. The file name is a
  hash of the windows, the feature layers and the target's weights, so stale features are never
  read. An interrupted pass resumes: the rows written so far stay in `<file>.partial`, with their
  count in `<file>.rows` (written after the rows themselves are flushed), and the next run goes
  on from there; the file takes its final name only when every row is in."""
  key = hashlib.sha256(tokens_NxL.tobytes() + repr(dcfg.feature_layers).encode() +
                       ckpt.target_fingerprint(target).encode()).hexdigest()[:16]
  path = os.path.join(directory, f'features-{key}.npy')
  N, L = tokens_NxL.shape
  shape = (N, L, len(dcfg.feature_layers) * target.cfg.d_model)
  feats = _complete_features(path, shape)
  if feats is not None:
    return feats
  os.makedirs(directory, exist_ok=True)
  with open(path + '.lock', 'w') as lock:
    # another run computing the same file (drafter 2 sharing drafter 1's features_dir) holds
    # the lock: wait for it, then read its file
    fcntl.flock(lock, fcntl.LOCK_EX)
    feats = _complete_features(path, shape)
    if feats is None:
      _compute_features(target, dcfg, tokens_NxL, path, shape, batch, progress)
      feats = _complete_features(path, shape)
      # (safe once the file is complete: a run still waiting on the old lock, or one taking a
      # new lock, checks for the file first and finds it)
      os.remove(path + '.lock')
  return feats


def _complete_features(path: str, shape):
  """The features file at `path`, memory-mapped, if it is complete and of this shape."""
  if os.path.exists(path):
    feats = np.load(path, mmap_mode='r')
    if feats.shape == shape:
      return feats
  return None


def _compute_features(target, dcfg, tokens_NxL, path: str, shape, batch: int, progress: bool):
  N = shape[0]
  partial, done_path = path + '.partial', path + '.rows'
  done = _rows_done(partial, done_path, shape)
  if done:
    out = np.load(partial, mmap_mode='r+')
    print(f'target features: resuming {path} at window {done} of {N}', flush=True)
  else:
    out = np.lib.format.open_memmap(partial, mode='w+', dtype=np.float16, shape=shape)
  fn = jax.jit(lambda p, t: target_features(p, target.cfg, dcfg, t).astype(jnp.float16))
  every = max(1, FEATURES_SAVE_EVERY // batch) * batch
  for i in tqdm(range(done, N, batch), desc='target features', mininterval=10,
                disable=not progress, initial=done // batch, total=-(-N // batch)):
    rows = tokens_NxL[i:i + batch]
    pad = batch - len(rows)
    rows = np.concatenate([rows, np.repeat(rows[-1:], pad, 0)]) if pad else rows
    out[i:i + batch] = np.asarray(fn(target.params, rows))[:batch - pad]
    if (i + batch) % every == 0 and i + batch < N:
      out.flush()
      with files.replaced(done_path) as tmp, open(tmp, 'w') as f:
        f.write(str(i + batch))
  out.flush()
  del out
  os.replace(partial, path)
  if os.path.exists(done_path):
    os.remove(done_path)


def _rows_done(partial: str, done_path: str, shape) -> int:
  """How many rows an interrupted features pass left complete in `partial` (0: start over)."""
  if not (os.path.exists(partial) and os.path.exists(done_path)):
    return 0
  try:
    with open(done_path) as f:
      done = int(f.read())
    ok = np.load(partial, mmap_mode='r').shape == shape
  except (OSError, ValueError):
    return 0
  return done if ok and 0 < done <= shape[0] else 0


class Rows:
  """Row lookup over arrays stacked along their first axis (precomputed features of a main
  source then a corpus), without copying them into one."""

  def __init__(self, parts):
    self.parts = parts
    self.starts = np.cumsum([0] + [len(p) for p in parts])

  def __len__(self):
    return int(self.starts[-1])

  def __getitem__(self, rows) -> np.ndarray:
    rows = np.asarray(rows)
    part = np.searchsorted(self.starts, rows, side='right') - 1
    out = np.empty((len(rows),) + self.parts[0].shape[1:], self.parts[0].dtype)
    for p in np.unique(part):
      pick = part == p
      out[pick] = self.parts[p][rows[pick] - self.starts[p]]
    return out

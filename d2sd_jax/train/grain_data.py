"""Training batches as a grain pipeline, read per host, with a checkpointable position.

  windows of a split (records read and cut on demand, `data.SequenceData.example`)
    -> EpochShuffle(seed): position p of an endless stream is window perm(seed, e)[p mod N],
       e = p div N (numpy's permutation: the global batches are those of
       `SequenceData.indices`, so runs made before this pipeline resume onto the same data)
    -> ProcessRows: this process's rows of every global batch (`sharding.process_rows`),
       so a host reads only the records it feeds to its devices
    -> batch: element t = this process's part of global batch t, {'tokens', 'labels', 'index'}

Every stage is a grain `MapDataset` (random access), so element t can be read without reading
elements 0..t-1; `iterator` reads ahead in grain threads. Its state (the next step) is saved
in the training checkpoint as the item `data` (`checkpoint_save` / `restore`: grain's Orbax
handler, one file per process); a checkpoint without it (written before this pipeline) or from
another process count resumes at the checkpoint's step, which gives the same batches: the
global batch of a step depends on neither.
"""
from __future__ import annotations

import os

import grain

from d2sd_jax.train import data as data_lib

ITEM = 'data'  # the checkpoint item of the iterator state


class EpochShuffle(grain.MapDataset):
  """Element p = parent[permutation(N, seed, p // N)[p % N]]: a new order every epoch."""

  def __init__(self, parent: grain.MapDataset, seed: int, epochs: int):
    super().__init__(parent)
    self._n, self._seed, self._epochs = len(parent), seed, epochs

  def __len__(self) -> int:
    return self._n * self._epochs

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, pos = divmod(index, self._n)
    return self._parent[int(data_lib.permutation(self._n, self._seed, epoch)[pos])]

  def __str__(self) -> str:
    return f'EpochShuffle(seed={self._seed})'


class ProcessRows(grain.MapDataset):
  """This process's rows of every global batch: element j = parent[(j // per) * B + first
  + j % per], for rows = slice(first, first + per) of a global batch of B."""

  def __init__(self, parent: grain.MapDataset, batch_size: int, rows: slice, steps: int):
    super().__init__(parent)
    self._batch_size, self._first = batch_size, rows.start
    self._per, self._steps = rows.stop - rows.start, steps

  def __len__(self) -> int:
    return self._per * self._steps

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    step, row = divmod(index, self._per)
    return self._parent[step * self._batch_size + self._first + row]

  def __str__(self) -> str:
    return f'ProcessRows(first={self._first}, per={self._per}, of={self._batch_size})'


def batches(data: data_lib.SequenceData, split: str, batch_size: int, seed: int, rows: slice,
            steps: int) -> grain.MapDataset:
  """Element t < steps: this process's `rows` of the global batch of step t (numpy arrays
  tokens [b, L] int32, labels [b, L] bool, index [b] int64: window indices in the split)."""
  n = data.size(split)
  windows = grain.MapDataset.range(n).map(lambda i: data.example(split, i))
  epochs = -(-steps * batch_size // n)  # enough epochs for `steps` global batches
  stream = EpochShuffle(windows, seed, max(1, epochs))
  return ProcessRows(stream, batch_size, rows, steps).batch(rows.stop - rows.start)


def iterator(dataset: grain.MapDataset, prefetch: int):
  """A checkpointable iterator over `dataset`, reading `prefetch` elements ahead in as many
  threads (0: each element is read when asked for)."""
  options = grain.ReadOptions(num_threads=prefetch, prefetch_buffer_size=prefetch)
  return iter(dataset.to_iter_dataset(options))


def checkpoint_save(it):
  """The Orbax args that save the iterator's position (an item of the training Composite)."""
  return grain.checkpoint.CheckpointSave(it)


def restore(manager, step: int, it) -> str:
  """Puts the iterator where checkpoint `step` left it; returns how ('checkpoint' or 'step').

  A checkpoint written before the data item existed, or by another number of processes (grain
  writes one file per process), resumes at `step` itself: element t is global batch t, so
  that is where the saved state would be too (a test checks they agree)."""
  import jax  # pylint: disable=import-outside-toplevel
  name = f'process_{jax.process_index()}-of-{jax.process_count()}.json'
  if os.path.exists(os.path.join(os.fspath(manager.directory), str(step), ITEM, name)):
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    manager.restore(step, args=ocp.args.Composite(
        **{ITEM: grain.checkpoint.CheckpointRestore(it)}))
    if it.get_state() != {'next_index': step}:
      raise ValueError(f'the data position saved in checkpoint {step} ({it.get_state()}) is not '
                       f'step {step}: the checkpoint is inconsistent; move it away to resume '
                       'from the previous one')
    return 'checkpoint'
  it.set_state({'next_index': step})
  return 'step'

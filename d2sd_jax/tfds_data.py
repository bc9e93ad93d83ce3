"""The distillation set (see `distill.py`) as a TFDS dataset, prepared as array_record.

`distill.py` writes gzip JSONL shards; training on a pod wants a dataset it can read by name,
randomly accessed, from any host. This module wraps the shards in a `GeneratorBasedBuilder`
('d2sd_distill') prepared with file_format='array_record' and read back through
`builder.as_data_source` (what `tfds.data_source` calls): that path needs only `array_record`,
not TensorFlow (not a dependency of this project; tfds imports it lazily, only if installed).

  python -m d2sd_jax.tfds_data --shards data/distill --data_dir data/tfds

`read_records(data_dir)` returns the same plain dicts, in the same order, as
`data.read_records(shards_dir)`, so `data.SequenceData` (and its held-out split by id) is unchanged.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import time

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

NAME = 'd2sd_distill'
FIELDS = ('id', 'style', 'prompt', 'chat', 'source', 'prompt_ids', 'response_ids')  # JSONL order
TEXT_FIELDS = ('id', 'style', 'prompt', 'source')
ID_FIELDS = ('prompt_ids', 'response_ids')


def shard_files(shards_dir: str) -> list[str]:
  """The distillation shards under `shards_dir`, sorted (the order `data.read_records` uses)."""
  files = sorted(glob.glob(os.path.join(shards_dir, 'shard-*.jsonl.gz')))
  if not files:
    raise FileNotFoundError(f'no distillation shards (shard-*.jsonl.gz) in {shards_dir!r}: '
                            f'generate them with python -m d2sd_jax.distill --out {shards_dir}')
  return files


class DistillDataset(tfds.core.GeneratorBasedBuilder):
  """The target's own responses to training prompts, one example per JSONL line."""

  name = NAME  # the registered name (tfds would derive 'distill_dataset' from the class)
  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Initial release.'}

  def __init__(self, *, shards_dir: str | None = None, **kwargs):
    # Only generation needs the shards; reading a prepared copy (tfds.data_source by name)
    # constructs the builder without them.
    self._shards_dir = shards_dir
    super().__init__(**kwargs)

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # Where tfds looks for a checksums.tsv (there is none: nothing is downloaded). Its default
    # resolves builders inside a package through the `importlib_resources` backport, which
    # tfds 4.9.10 only requires on Python < 3.9, so it fails on a plain install; this file is
    # the answer it would compute.
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly, not dataset_info_from_configs: that one reads README/CITATIONS files
    # from a TFDS-style package folder, which this module is not.
    return tfds.core.DatasetInfo(
        builder=self,
        description='The target model\'s greedy responses to training prompts (d2sd_jax.distill).',
        features=tfds.features.FeaturesDict({
            'id': tfds.features.Text(),
            'style': tfds.features.Text(),
            'prompt': tfds.features.Text(),
            'chat': tfds.features.Scalar(np.bool_),
            'source': tfds.features.Text(),
            # Token ids fit int32 (the model's own dtype); response_ids may be empty.
            'prompt_ids': tfds.features.Sequence(np.int32),
            'response_ids': tfds.features.Sequence(np.int32),
        }),
        # One split: the trainer holds out its eval set itself, by a hash of the id.
        # Shard order is kept (no shuffling) so reads match data.read_records exactly.
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download: the shards are local
    if self._shards_dir is None:
      raise ValueError(f'{NAME} is generated from distillation shards: construct it with '
                       'shards_dir=... (see d2sd_jax.tfds_data.prepare)')
    return {'train': self._generate_examples(shard_files(self._shards_dir))}

  def _generate_examples(self, files):
    # Keys are file:line, not the record id: ids repeat (distill.py hashes a function's
    # signature, and per-platform variants of a function share it but differ in docstring),
    # and tfds rejects duplicate keys.
    for file in files:
      name = os.path.basename(file)
      try:
        with gzip.open(file, 'rt') as f:
          lines = [(n, json.loads(line)) for n, line in enumerate(f) if line.strip()]
      except (OSError, json.JSONDecodeError, EOFError) as e:
        raise ValueError(f'corrupt distillation shard {file}: {e}; delete it and rerun '
                         'd2sd_jax.distill to regenerate it') from e
      for n, r in lines:
        yield f'{name}:{n}', {k: r[k] for k in FIELDS}


def prepare(shards_dir: str, data_dir: str) -> str:
  """Prepares the shards under `shards_dir` as array_record into `data_dir`; returns the
  prepared directory (data_dir/d2sd_distill/1.0.0).

  Always regenerates: `distill.py` grows the shards in place (it resumes), so reusing an earlier
  preparation could silently serve a stale subset. Generation is cheap next to distillation.
  """
  shard_files(shards_dir)  # fail early, before tfds creates any folder
  builder = DistillDataset(shards_dir=shards_dir, data_dir=data_dir,
                           file_format=tfds.core.FileFormat.ARRAY_RECORD)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
      download_mode=tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS,  # fresh dataset
      try_download_gcs=False,  # never look for a hosted copy: this dataset only exists here
  ))
  return os.fspath(builder.data_dir)


def _plain(example: dict) -> dict:
  """A decoded example (bytes, numpy) as the JSON line it came from (str, bool, lists of int)."""
  def plain(k):
    if k in TEXT_FIELDS:
      return example[k].decode('utf-8')  # Text decodes to bytes outside TensorFlow
    if k in ID_FIELDS:
      return np.asarray(example[k]).tolist()  # int32 array -> python ints
    return bool(example[k])
  return {k: plain(k) for k in FIELDS}


def data_source(data_dir: str):
  """The random-access 'train' split of the dataset prepared under `data_dir` (the folder given
  to `prepare`): len() and integer indexing, examples decoded to numpy/bytes."""
  builder = tfds.builder(NAME, data_dir=data_dir)  # registered by importing this module
  if not builder.is_prepared():
    # Checked here: otherwise tfds falls back to a TFRECORD default and blames the file format.
    raise FileNotFoundError(f'{NAME} is not prepared in {data_dir!r}: prepare it with '
                            f'python -m d2sd_jax.tfds_data --shards <distill folder> '
                            f'--data_dir {data_dir}')
  return builder.as_data_source(split='train')


def read_records(data_dir: str) -> list[dict]:
  """All examples of the dataset prepared under `data_dir`, in shard order, as plain dicts with
  the keys of the JSONL records (what `data.read_records` returns for the shards)."""
  source = data_source(data_dir)
  return [_plain(source[i]) for i in range(len(source))]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--shards', default='data/distill', help='folder of shard-*.jsonl.gz')
  parser.add_argument('--data_dir', default='data/tfds', help='TFDS data_dir to prepare into')
  args = parser.parse_args()
  t0 = time.time()
  path = prepare(args.shards, args.data_dir)
  n = len(data_source(args.data_dir))
  print(f'{path}: {n} examples (array_record) in {time.time() - t0:.1f}s', flush=True)


if __name__ == '__main__':
  main()

"""The distillation set (see `distill.py`) as a TFDS dataset, prepared as array_record.

`distill.py` writes gzip JSONL shards; training on a pod wants a dataset it can read by name,
randomly accessed, from any host. This module wraps the shards in a `GeneratorBasedBuilder`
('d2sd_distill') prepared with file_format='array_record' and read back through
`builder.as_data_source` (what `tfds.data_source` calls): that path needs only `array_record`,
not TensorFlow (not a dependency of this project; tfds imports it lazily, only if installed).

  python scripts/prepare_tfds.py --shards data/distill --data_dir data/tfds

`read_records(data_dir)` returns the same plain dicts, in the same order, as
`records.read_records(shards_dir)`, so the windows and the held-out split by id are the same.

Training reads any prepared TFDS dataset, not only this one (`TfdsSource`, data.source='tfds'
with data.tfds_name / tfds_dir / tfds_split): a dataset with `prompt_ids` and `response_ids`
features is read as records like ours; any other is read as text (`data.text_field`, 'text' by
default), every token a label (teacher-forced). Text teaches a drafter the language, not the
target: drafters trained on the target's own responses (distilled shards) accept more, so text
is for bootstrapping. Random access needs the dataset prepared as array_record.
"""
from __future__ import annotations

import gzip
import json
import os

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from d2sd_jax.train import records as records_lib

NAME = 'd2sd_distill'
FIELDS = ('id', 'style', 'prompt', 'chat', 'source', 'prompt_ids', 'response_ids')  # JSONL order
TEXT_FIELDS = ('id', 'style', 'prompt', 'source')
ID_FIELDS = ('prompt_ids', 'response_ids')


shard_files = records_lib.shard_files  # the distillation shards, sorted (the record order)


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
        description='The target model\'s greedy responses to training prompts (scripts/distill.py).',
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
        # Shard order is kept (no shuffling) so reads match records.read_records exactly.
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download: the shards are local
    if self._shards_dir is None:
      raise ValueError(f'{NAME} is generated from distillation shards: construct it with '
                       'shards_dir=... (see scripts/prepare_tfds.py)')
    return {'train': self._generate_examples(shard_files(self._shards_dir))}

  def _generate_examples(self, files):
    # Keys are file:line, not the record id: ids repeat (distill.py hashes a function's
    # signature, and per-platform variants of a function share it but differ in docstring),
    # and tfds rejects duplicate keys.
    for file in files:
      name = os.path.basename(file)
      try:
        with gzip.open(file, 'rb') as f:
          lines = f.read().split(b'\n')
      except (OSError, EOFError) as e:
        raise ValueError(f'corrupt distillation shard {file}: {e}; delete it and rerun '
                         'scripts/distill.py to regenerate it') from e
      for n, line in enumerate(lines, 1):
        if line.strip():
          yield f'{name}:{n - 1}', _checked(line, f'{file}:{n}')


def _checked(line: bytes, where: str) -> dict:
  """One JSONL line of a shard as an example (ValueError naming `where` = file:line)."""
  try:
    r = json.loads(line)
    if not isinstance(r, dict):
      raise ValueError(f'expected a JSON object, got {type(r).__name__}')
    missing = [k for k in FIELDS if k not in r]
    if missing:
      raise ValueError(f'no {", ".join(missing)} field (distill.py writes {", ".join(FIELDS)})')
    for k in ID_FIELDS:
      records_lib.check_ids(r[k], k, None)
  except ValueError as e:
    raise ValueError(f'{where}: {e}; delete the shard and rerun scripts/distill.py to '
                     'regenerate it') from e
  return {k: r[k] for k in FIELDS}


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


def _builder(data_dir: str, name: str):
  try:  # a registered builder (this module's), or any dataset prepared under data_dir
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise FileNotFoundError(f'TFDS dataset {name!r} not found in {data_dir!r} ({e})') from e
  if not builder.is_prepared():
    # Checked here: otherwise tfds falls back to a TFRECORD default and blames the file format.
    how = (f'python scripts/prepare_tfds.py --shards <distill folder> --data_dir {data_dir}'
           if name == NAME else f"tfds build {name} --data_dir={data_dir} "
           '--file_format=array_record')
    raise FileNotFoundError(f'{name} is not prepared in {data_dir!r}: prepare it with {how}')
  file_format = builder.info.file_format
  if file_format is not None and file_format != tfds.core.FileFormat.ARRAY_RECORD:
    raise ValueError(f'TFDS dataset {name} in {data_dir} is prepared as {file_format.value}: '
                     'reading it by index needs array_record (prepare it again with '
                     'file_format=array_record)')
  return builder


def data_source(data_dir: str, name: str = NAME, split: str = 'train'):
  """The random-access split of the dataset prepared under `data_dir` (for ours, the folder
  given to `prepare`): len() and integer indexing, examples decoded to numpy/bytes."""
  builder = _builder(data_dir, name)
  if split not in builder.info.splits:
    raise ValueError(f'TFDS dataset {name} has no split {split!r} (it has '
                     f'{sorted(builder.info.splits)})')
  return builder.as_data_source(split=split)


class TfdsSource:
  """A prepared TFDS dataset as records (`data.SequenceData`'s source interface).

  Token records (features prompt_ids and response_ids): split by their `id` feature (else the
  example index), as the shards are. Text (feature `text_field`): prompt_ids empty, the text's
  tokens as the response, so every token is a label; split by example index, with no pass over
  the examples at start-up (a text dataset may be large). A window holds the first seq_len
  tokens of a text: split long documents when preparing the dataset to train on all of them."""

  def __init__(self, data_dir: str, name: str = NAME, split: str = 'train',
               text_field: str = 'text', tokenizer=None, seq_len: int = 0,
               vocab_size: int | None = None):
    builder = _builder(data_dir, name)
    self.where = f'TFDS dataset {name} (split {split!r}, {data_dir})'
    self.source = data_source(data_dir, name, split)
    self.features = builder.info.features
    self.tok, self.seq_len, self.vocab_size = tokenizer, seq_len, vocab_size
    if {'prompt_ids', 'response_ids'} <= set(self.features.keys()):
      self.text_field = None
    elif text_field in self.features.keys():
      if not isinstance(self.features[text_field], tfds.features.Text):
        raise ValueError(f'data.text_field={text_field!r} of {self.where} is a '
                         f'{type(self.features[text_field]).__name__} feature, not Text')
      self.text_field = text_field
    else:
      raise ValueError(f'{self.where} has features {sorted(self.features.keys())}: set '
                       'data.text_field to its text feature (or give it prompt_ids and '
                       'response_ids features)')

  def __len__(self):
    return len(self.source)

  def _example(self, i: int) -> dict:
    try:
      return self.source[i]
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(f'{self.where}: example {i} is unreadable ({type(e).__name__}: '
                       f'{e})') from e

  def _ids(self, example: dict, i: int):
    try:
      return tuple(records_lib.check_ids(np.asarray(example[k]).tolist(), k, self.vocab_size)
                   for k in ID_FIELDS)
    except ValueError as e:
      raise ValueError(f'{self.where}: example {i}: {e}') from e

  def index(self):
    if self.text_field is not None:
      return None, None
    ids, has_response = [], []
    has_id = 'id' in self.features.keys()
    for i in range(len(self.source)):
      example = self._example(i)
      _, response = self._ids(example, i)
      ids.append(example['id'].decode('utf-8') if has_id else str(i))
      has_response.append(bool(response))
    return ids, np.asarray(has_response, bool)

  def __getitem__(self, i: int):
    example = self._example(i)
    if self.text_field is None:
      return self._ids(example, i)
    try:
      text = example[self.text_field].decode('utf-8')
    except UnicodeDecodeError as e:
      raise ValueError(f'{self.where}: example {i}: {self.text_field} is not UTF-8 '
                       f'({e})') from e
    # A window keeps the first seq_len tokens: encode a prefix of a long text (a token rarely
    # covers more than 16 characters), and all of it only when that prefix falls short.
    chars = 16 * self.seq_len + 64
    ids = self.tok.encode(text[:chars])
    if len(text) > chars and len(ids) < self.seq_len + 8:
      ids = self.tok.encode(text)
    return [], ids


def read_records(data_dir: str) -> list[dict]:
  """All examples of the dataset prepared under `data_dir`, in shard order, as plain dicts with
  the keys of the JSONL records (what `records.read_records` returns for the shards)."""
  source = data_source(data_dir)
  return [_plain(source[i]) for i in range(len(source))]

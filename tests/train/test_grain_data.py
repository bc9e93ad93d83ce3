"""Training data read per host through grain: every data.source format, exact resume from the
iterator state in the checkpoint, and malformed records named by file and line
(d2sd_jax/train/grain_data.py, with the readers of data.py, records.py and tfds_data.py it
drives, kept together: they share the written datasets and the tiny training config)."""
import gzip
import json
import os
import shutil
import subprocess
import sys

from etils import epath
import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from d2sd_jax.train import data
from d2sd_jax.train import records
from d2sd_jax.train import grain_data
from d2sd_jax.formats import loaders
from d2sd_jax.train import tfds_data
from d2sd_jax.train import training
from tests.train.test_training import tiny_config  # pylint: disable=wrong-import-order
from tests.conftest import ROOT

ALPHABET = 'abcdefghijklmnopqrstuvwxyz'


class TinyText(tfds.core.GeneratorBasedBuilder):
  """A text dataset with no prompt_ids/response_ids: what 'any TFDS text dataset' means."""

  VERSION = tfds.core.Version('1.0.0')

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)  # (see tfds_data.DistillDataset.code_path)

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'body': tfds.features.Text(), 'n': tfds.features.Scalar(np.int32)}))

  def _split_generators(self, dl_manager):
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    for i in range(30):  # repetitive texts of 12..70 characters
      motif = ALPHABET[i % 26:] + ALPHABET[:i % 7]
      yield i, {'body': (motif * 9)[:12 + 2 * i], 'n': i}


def prepare_text(data_dir: str) -> str:
  builder = TinyText(data_dir=data_dir, file_format=tfds.core.FileFormat.ARRAY_RECORD)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
      try_download_gcs=False))
  return data_dir


def write_conversations(path) -> str:
  """ShareGPT and OpenAI conversations with the file's own replies (the labels)."""
  lines = []
  for i in range(14):
    motif = ALPHABET[i:i + 4]
    if i % 2:
      lines.append({'conversations': [{'from': 'human', 'value': f'say {motif}'},
                                      {'from': 'gpt', 'value': motif * 6},
                                      {'from': 'human', 'value': 'again'},
                                      {'from': 'gpt', 'value': motif.upper() * 5}]})
    else:
      lines.append({'id': f'm{i}', 'messages': [
          {'role': 'system', 'content': 'short'}, {'role': 'user', 'content': f'echo {motif}'},
          {'role': 'assistant', 'content': (motif + ' ') * 5}]})
  path.write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def target(tiny_folder):
  return loaders.load_target(tiny_folder)


@pytest.mark.parametrize('processes', [1, 2, 3])
def test_grain_batches_are_the_global_batches_split_by_process(distill_dir, processes):
  """Each process's grain batches, put side by side, are the global batches of the pure
  (seed, step) rule over several epochs: the same batches as before grain on one host, and
  each process reads only its own rows."""
  d = data.SequenceData(records.ShardsSource(distill_dir), 24, 0, 0.2)
  B, per, steps = 6, 6 // processes, 9  # 9 steps of 6 windows: 3+ epochs of the 16 windows
  parts = [grain_data.batches(d, 'train', B, 5, slice(p * per, (p + 1) * per), steps)
           for p in range(processes)]
  for step in range(steps):
    got = [part[step] for part in parts]
    index = np.concatenate([g['index'] for g in got])
    np.testing.assert_array_equal(index, d.indices(step, B, 5))
    tokens = np.concatenate([g['tokens'] for g in got])
    np.testing.assert_array_equal(tokens, np.stack([d.window('train', i)[0] for i in index]))
  it = grain_data.iterator(parts[0], prefetch=2)  # an iterator resumed at step 4 reads step 4
  it.set_state({'next_index': 4})
  np.testing.assert_array_equal(next(it)['index'], parts[0][4]['index'])


def _format(fmt, tmp_path, distill_dir) -> dict:
  """The data config fields of a data.source format (its data made in tmp_path)."""
  if fmt == 'shards':
    return {'source': 'shards', 'path': distill_dir}
  if fmt == 'tfds':
    tfds_data.prepare(distill_dir, str(tmp_path / 'tfds'))
    return {'source': 'tfds', 'tfds_dir': str(tmp_path / 'tfds'), 'path': '/nonexistent'}
  if fmt == 'tfds_text':
    return {'source': 'tfds', 'tfds_dir': prepare_text(str(tmp_path / 'text')),
            'tfds_name': 'tiny_text', 'text_field': 'body'}
  return {'source': 'conversations', 'path': write_conversations(tmp_path / 'chats.jsonl')}


@pytest.mark.parametrize('fmt', ['shards', *(pytest.param(f, marks=pytest.mark.slow)
                                             for f in ('tfds', 'tfds_text', 'conversations'))])
def test_resume_through_grain_is_exact(tiny_folder, distill_dir, tmp_path, capsys, fmt):
  """Per format: a run stopped at step 2 saves the iterator position with its parameters
  (the checkpoint item `data`), and the resumed run reads on from it, running only steps 3-4
  and ending bit-identical to an uninterrupted run."""
  updates = _format(fmt, tmp_path, distill_dir)

  def config(workdir, steps):
    c = tiny_config(tiny_folder, distill_dir, str(tmp_path / workdir), steps=steps)
    c.data.update(updates)
    c.eval_every = 0  # (the held-out evaluation is another test's)
    return c

  whole = training.run(config('a', 4))
  training.run(config('b', 2))
  state = tmp_path / 'b' / 'checkpoints' / '2' / 'data' / 'process_0-of-1.json'
  assert json.loads(state.read_text()) == {'next_index': 2}
  capsys.readouterr()
  ran = []
  resumed = training.run(config('b', 4), on_step=ran.append)
  assert ran == [3, 4]
  assert 'resumed from step 2\n' in capsys.readouterr().out  # from the saved position
  for x, y in zip(jax.tree.leaves(whole['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_checkpoint_without_data_item_resumes_at_its_step(tiny_folder, distill_dir, tmp_path,
                                                          capsys):
  """A checkpoint written before the data item existed (the running CPU job's) resumes at its
  step, bit-exactly; a saved position that disagrees with its step is refused."""
  def config(workdir):
    c = tiny_config(tiny_folder, distill_dir, str(tmp_path / workdir), steps=5)
    c.eval_every = 0
    return c

  whole = training.run(config('a'))
  c = config('b')
  c.train.steps = 3
  training.run(c)
  shutil.copytree(tmp_path / 'b', tmp_path / 'c')
  shutil.rmtree(tmp_path / 'b' / 'checkpoints' / '3' / 'data')
  capsys.readouterr()
  resumed = training.run(config('b'))
  assert 'resumed from step 3 (data position from the step)' in capsys.readouterr().out
  for x, y in zip(jax.tree.leaves(whole['params']), jax.tree.leaves(resumed['params'])):
    np.testing.assert_array_equal(x, y)
  state = tmp_path / 'c' / 'checkpoints' / '3' / 'data' / 'process_0-of-1.json'
  state.write_text(json.dumps({'next_index': 2}))
  with pytest.raises(ValueError, match='data position saved in checkpoint 3'):
    training.run(config('c'))


def test_text_and_conversation_windows(tmp_path, target):
  """Text: every token a label (teacher-forced). Conversations: one record per assistant turn
  of the file, asked with the conversation before it (the file's own earlier replies), the
  reply + EOS as labels."""
  tok = target.tokenizer
  text = tfds_data.TfdsSource(prepare_text(str(tmp_path / 'text')), 'tiny_text', 'train',
                              'body', tok, 24, 96)
  prompt, response = text[3]
  n = int(text.source[3]['n'])  # (tfds shuffles the examples it prepares)
  motif = ALPHABET[n % 26:] + ALPHABET[:n % 7]
  assert prompt == [] and response == tok.encode((motif * 9)[:12 + 2 * n])
  d = data.SequenceData(text, 24, tok.pad_id, 0.2)
  tokens, labels = d.window('train', 0)
  assert labels[:min(24, len(text[int(d.records['train'][0])][1]))].all()
  assert d.size('train') + d.size('eval') == 30 and d.size('eval') > 0

  chats = records.ConversationsSource(write_conversations(tmp_path / 'c.jsonl'), tok)
  ids, _ = chats.index()
  assert ids[:3] == ['m0:0', ids[1], ids[1][:-1] + '1'] and len(ids) == 21
  prompt, response = chats[2]  # turn 1 of the first ShareGPT conversation
  assert tok.decode(prompt) == '[user] say bcde[assistant] ' + 'bcde' * 6 + \
      '[user] again[assistant] '
  assert response == tok.encode('BCDE' * 5) + [tok.eos_ids[0]]
  tokens, labels = data.window(prompt, response, 24, tok.pad_id)  # 12 prompt tokens + 12 labels
  assert tokens[:12].tolist() == prompt[-12:] and tokens[labels].tolist() == response[:12]


def test_any_prepared_tfds_dataset_reads_without_its_code(tmp_path):
  """A dataset prepared elsewhere is read from its files by name: no builder class needed
  (a fresh process that never defines TinyText)."""
  data_dir = prepare_text(str(tmp_path / 'text'))
  code = ('from d2sd_jax.train import tfds_data; '
          f's = tfds_data.TfdsSource({data_dir!r}, "tiny_text", "train", "body"); '
          'print(len(s), s.text_field)')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip().splitlines()[-1] == '30 body'


def test_token_counts_bounded_sample(distill_dir):
  d = data.SequenceData(records.ShardsSource(distill_dir), 24, 0, 0.2)
  tokens, labels = d.arrays('train')
  full = d.token_counts(96, 0)
  np.testing.assert_array_equal(full[0], np.bincount(tokens[labels], minlength=96))
  sample = d.token_counts(96, 0, max_windows=5)
  assert sample[0].sum() < full[0].sum() and (sample[0] <= full[0]).all()
  np.testing.assert_array_equal(sample[0], d.token_counts(96, 0, max_windows=5)[0])  # per host


# --- malformed records: the file and line (or dataset and example), before training ----------

def write_shard(folder, lines) -> str:
  os.makedirs(folder, exist_ok=True)
  with gzip.open(os.path.join(folder, 'shard-00000.jsonl.gz'), 'wt') as f:
    f.write('\n'.join(l if isinstance(l, str) else json.dumps(l) for l in lines) + '\n')
  return str(folder)


GOOD = {'id': 'a', 'style': 's', 'prompt': 'p', 'chat': False, 'source': 'x',
        'prompt_ids': [1, 2, 3], 'response_ids': [4, 5, 6]}


@pytest.mark.parametrize('line,message', [
    ('{"id": "b", "prompt_ids": [1]', 'Expecting'),
    ('[1, 2]', 'expected a JSON object'),
    (json.dumps({'id': 'b', 'prompt_ids': [1]}), 'no response_ids field'),
    (json.dumps({**GOOD, 'response_ids': [1, 'x']}), '"response_ids" must be a list of integer'),
    (json.dumps({**GOOD, 'prompt_ids': [1, 500]}), 'token id 500, outside the target\'s '
                                                    'vocabulary of 96'),
])
def test_malformed_shard_line_names_file_and_line(tmp_path, line, message):
  folder = write_shard(tmp_path / 'd', [GOOD, '', line])
  with pytest.raises(ValueError, match=f'shard-00000.jsonl.gz:3: .*{message}'):
    records.ShardsSource(folder, 96).index()


def test_malformed_records_stop_training_before_it_starts(tiny_folder, tmp_path):
  folder = write_shard(tmp_path / 'd', [GOOD, {**GOOD, 'response_ids': [7, 96]}])
  c = tiny_config(tiny_folder, folder, str(tmp_path / 'run'))
  with pytest.raises(ValueError, match=r'shard-00000.jsonl.gz:2: .*token id 96'):
    training.run(c)
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints') or not os.listdir(
      tmp_path / 'run' / 'checkpoints')
  (tmp_path / 'e').mkdir()
  (tmp_path / 'e' / 'shard-00000.jsonl.gz').write_bytes(b'\x1f\x8b\x08\x00 truncated')
  with pytest.raises(ValueError, match='corrupt distillation shard .*shard-00000'):
    records.ShardsSource(str(tmp_path / 'e')).index()


def test_tfds_errors_name_the_record(tmp_path, target):
  with pytest.raises(ValueError, match=r'shard-00000.jsonl.gz:2: no chat, source field'):
    tfds_data.prepare(write_shard(tmp_path / 'bad', [GOOD, {'id': 'x', 'prompt': 'p',
                                                            'style': 's', 'prompt_ids': [],
                                                            'response_ids': []}]),
                      str(tmp_path / 'tfds_bad'))
  folder = write_shard(tmp_path / 'd', [GOOD, {**GOOD, 'id': 'b', 'response_ids': [200]}])
  tfds_data.prepare(folder, str(tmp_path / 'tfds'))
  with pytest.raises(ValueError, match=r'TFDS dataset d2sd_distill .*example 1: "response_ids" '
                                       r'has token id 200'):
    data.SequenceData(tfds_data.TfdsSource(str(tmp_path / 'tfds'), vocab_size=96), 24, 0, 0.2)
  text_dir = prepare_text(str(tmp_path / 'text'))
  with pytest.raises(ValueError, match=r"features \['body', 'n'\]: set data.text_field"):
    tfds_data.TfdsSource(text_dir, 'tiny_text', 'train', 'text', target.tokenizer, 24)
  with pytest.raises(ValueError, match="data.text_field='n' .* is a Scalar feature, not Text"):
    tfds_data.TfdsSource(text_dir, 'tiny_text', 'train', 'n', target.tokenizer, 24)
  with pytest.raises(ValueError, match=r"no split 'validation'"):
    tfds_data.TfdsSource(text_dir, 'tiny_text', 'validation', 'body', target.tokenizer, 24)
  with pytest.raises(FileNotFoundError, match='not found in|not prepared'):
    tfds_data.TfdsSource(str(tmp_path / 'nothing'), 'no_such_dataset')


@pytest.mark.parametrize('line,message', [
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "unknown from 'robot'"),
    ('{"turns": ["Write a haiku."]}', 'a "turns" line has no assistant reply to train on. '
                                      'Distill the file first'),
    ('{"prompt": "Sort a list."}', 'a "prompt" line has no assistant reply'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', 'a "messages" line has no assistant'),
])
def test_malformed_conversation_line_names_file_and_line(tmp_path, target, line, message):
  path = tmp_path / 'chats.jsonl'
  good = {'messages': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]}
  path.write_text(json.dumps(good) + '\n\n' + line + '\n')
  with pytest.raises(ValueError, match=f'chats.jsonl:3: .*{message}'):
    records.ConversationsSource(str(path), target.tokenizer).index()


def test_several_shard_folders_read_in_order(tmp_path):
  """data.path = 'A,B' reads A's shards, then B's; a folder without shards is named."""
  from d2sd_jax.train import records  # pylint: disable=import-outside-toplevel
  for folder, n in (('a', 2), ('b', 1)):
    (tmp_path / folder).mkdir()
    for k in range(n):
      (tmp_path / folder / f'shard-{k:05d}.jsonl.gz').write_bytes(b'')
  got = records.shard_files(f'{tmp_path / "a"},{tmp_path / "b"}')
  assert [os.path.relpath(f, tmp_path) for f in got] == [
      os.path.join('a', 'shard-00000.jsonl.gz'), os.path.join('a', 'shard-00001.jsonl.gz'),
      os.path.join('b', 'shard-00000.jsonl.gz')]
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='empty'):
    records.shard_files(f'{tmp_path / "a"},{tmp_path / "empty"}')


def test_spec_decode_records_are_training_held_out_split(tmp_path):
  """benchmarks/spec_decode.py --records DIR decodes the prompts of the records training holds
  out (the same ids, the same fraction as configs/drafter1.py), of the style --chat selects."""
  root = ROOT
  sys.path.insert(0, os.path.join(root, 'benchmarks'))
  import spec_decode  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.join(root, 'configs'))
  import drafter1  # pylint: disable=import-outside-toplevel
  assert spec_decode.EVAL_FRACTION == drafter1.get_config().data.eval_fraction
  rows = [{**GOOD, 'id': f'r{i}', 'prompt': f'prompt {i}', 'chat': i % 2 == 0} for i in range(400)]
  folder = write_shard(tmp_path / 'd', rows)
  held = data.held_out_ids([r['id'] for r in rows], spec_decode.EVAL_FRACTION)
  for chat in (True, False):
    want = [r['prompt'] for r, h in zip(rows, held) if h and r['chat'] == chat]
    assert 3 <= len(want) < 40  # a real split: some held out, most not
    assert spec_decode.held_out_record_prompts(folder, 1000, chat) == want
    assert spec_decode.held_out_record_prompts(folder, 2, chat) == want[:2]
  with pytest.raises(SystemExit, match='no held-out chat records'):
    spec_decode.held_out_record_prompts(write_shard(tmp_path / 'e', [GOOD]), 5, True)

"""Distillation (d2sd_jax/train/distill.py, with the prompt readers of formats/conversations.py
it uses) inputs and outputs: prompt files in every format (and their errors), the
turn-by-turn regeneration of conversations, and shards that resume with the same prompts."""

import gzip
import json
import os
import subprocess
import sys

import jax
import pytest

from d2sd_jax.train import batching
from d2sd_jax.formats import conversations
from d2sd_jax.train import distill
from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.formats import loaders
from tests.conftest import ROOT, load_script

LINES = [
    {'prompt': 'Sort a list.'},
    {'prompt': 'def f(x):', 'chat': False, 'id': 'plain-1'},
    {'conversations': [{'from': 'system', 'value': 'Be brief.'},
                       {'from': 'human', 'value': 'Hi'}, {'from': 'gpt', 'value': 'Hello!'},
                       {'from': 'human', 'value': 'Add 2+2'}, {'from': 'gpt', 'value': '4'}]},
    {'messages': [{'role': 'user', 'content': 'Name a prime.'},
                  {'role': 'assistant', 'content': '7'},
                  {'role': 'user', 'content': [{'type': 'text', 'text': 'Another'}]}]},
    {'turns': ['Write a haiku.', 'Now in French.']},
]


_generate = jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size'))


def write_jsonl(path, lines):
  path.write_text('\n'.join(l if isinstance(l, str) else json.dumps(l) for l in lines) + '\n')
  return str(path)


def test_every_format_reads_as_user_turns(tmp_path):
  convs = conversations.read(write_jsonl(tmp_path / 'p.jsonl', LINES[:2] + [''] + LINES[2:]))
  assert [c.style for c in convs] == ['prompt', 'prompt', 'sharegpt', 'messages', 'turns']
  assert [c.user_turns for c in convs] == [('Sort a list.',), ('def f(x):',), ('Hi', 'Add 2+2'),
                                           ('Name a prime.', 'Another'),
                                           ('Write a haiku.', 'Now in French.')]
  assert [c.chat for c in convs] == [True, False, True, True, True]
  assert convs[1].id == 'plain-1' and convs[2].system == 'Be brief.'
  assert convs[2].source.endswith('p.jsonl:4')  # the blank line 3 is skipped, not renumbered
  # The file's assistant turns are dropped: each turn is asked with the replies given here.
  assert convs[2].messages(['Hey.']) == [
      {'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
      {'role': 'assistant', 'content': 'Hey.'}, {'role': 'user', 'content': 'Add 2+2'}]
  assert convs[4].messages([]) == [{'role': 'user', 'content': 'Write a haiku.'}]
  with pytest.raises(ValueError, match='no turn 2'):
    convs[4].messages(['a', 'b'])


@pytest.mark.parametrize('line,message', [
    ('{"prompt": "ok"', 'Expecting'),
    ('["a list"]', 'expected a JSON object'),
    ('{"text": "hi"}', 'no "prompt", "conversations", "messages" or "turns" field'),
    ('{"prompt": 3}', '"prompt" must be a string'),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "unknown from 'robot'"),
    ('{"conversations": [{"from": "human"}]}', r'conversations\[0\] must be an object with'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', 'no user turn'),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
     'system message is only supported as the first'),
    ('{"turns": ["ok", 5]}', r'turns\[1\] must be a string'),
    ('{"turns": ["  "]}', 'an empty user turn'),
    ('{"turns": ["a"], "chat": false}', '"chat": false is only for a single "prompt"'),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
  path = write_jsonl(tmp_path / 'bad.jsonl', [LINES[0], '', line])
  with pytest.raises(ValueError, match=f'bad.jsonl:3: .*{message}'):
    conversations.read(path)


def test_not_utf8_and_missing_and_empty_files(tmp_path):
  (tmp_path / 'latin.jsonl').write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(ValueError, match='latin.jsonl:2: .*utf-8'):
    conversations.read(str(tmp_path / 'latin.jsonl'))
  with pytest.raises(FileNotFoundError, match='not found'):
    conversations.read(str(tmp_path / 'none.jsonl'))
  with pytest.raises(ValueError, match='no prompts'):
    conversations.read(write_jsonl(tmp_path / 'empty.jsonl', ['', '']))


@pytest.fixture(scope='module')
def tiny_target(tiny_folder):
  target = loaders.load_target(tiny_folder)
  settings = AR.GenerationSettings(max_new_tokens=6, eos_ids=target.tokenizer.eos_ids,
                                  pad_id=target.tokenizer.pad_id)
  return target, batching.Generator(target.params, target.cfg, settings, batch_size=2,
                                    length_bounds=(100,), prompt_bucket=128)


def read_shard(path):
  with gzip.open(path, 'rt') as f:
    return [json.loads(line) for line in f]


def ar_alone(target, ids):
  """Greedy AR of one prompt in a batch of its own (generate.generate)."""
  tok = target.tokenizer
  block, lens = AR.pad_prompts([ids], tok.pad_id, bucket=128)
  settings = AR.GenerationSettings(6, tok.eos_ids, tok.pad_id)
  state = _generate(target.params, target.cfg, settings, block, lens, AR.row_keys(0, [0]),
                    block.shape[1] + 6)
  return state.out_BxN[0, :state.num_out_B[0]].tolist()


def test_conversations_regenerate_every_turn_with_own_replies(tiny_target, tmp_path):
  target, generator = tiny_target
  tok = target.tokenizer
  convs = conversations.read(write_jsonl(tmp_path / 'p.jsonl', LINES))
  out = str(tmp_path / 'out')
  os.makedirs(out)
  distill.distill_conversations(convs, tok, out, generator, shard_size=3, max_prompt_tokens=100,
                                chunk_shards=2, log=lambda m: None)
  records = read_shard(f'{out}/shard-00000.jsonl.gz') + read_shard(f'{out}/shard-00001.jsonl.gz')
  assert [r['id'].rsplit(':', 1)[1] for r in records] == ['0', '0', '0', '1', '0', '1', '0', '1']
  by_id = {r['id']: r for r in records}
  assert by_id['plain-1:0']['prompt_ids'] == tok.encode('def f(x):')  # no chat template
  # Turn 1 of the ShareGPT conversation is asked after the target's own turn-0 reply.
  first, second = records[2], records[3]
  reply = tok.decode([t for t in first['response_ids'] if t not in tok.eos_ids])
  assert reply != 'Hello!'
  assert tok.decode(second['prompt_ids']) == (
      f'[system] Be brief.[user] Hi[assistant] {reply}[user] Add 2+2[assistant] ')
  for r in records:
    assert r['response_ids'] == ar_alone(target, r['prompt_ids'])
    assert list(r) == ['id', 'style', 'prompt', 'chat', 'source', 'prompt_ids', 'response_ids']


def test_distill_resumes_with_the_same_prompts_per_shard(tiny_target, tmp_path):
  target, generator = tiny_target
  tok = target.tokenizer
  prompts = [{'id': str(i), 'style': 's', 'prompt': p, 'chat': False, 'source': 'x',
              'prompt_ids': tok.encode(p)} for i, p in enumerate(
                  ['abc', 'hello world', 'x', 'def f():', 'zz top', '1 2 3 4 5 6 7'])]
  out = str(tmp_path)
  with gzip.open(f'{out}/shard-00001.jsonl.gz', 'wt') as f:
    f.write('kept\n')
  distill.distill(prompts, out, generator, shard_size=2, log=lambda m: None)
  with gzip.open(f'{out}/shard-00001.jsonl.gz', 'rt') as f:
    assert f.read() == 'kept\n'  # an existing shard is never regenerated
  for n, rows in [(0, prompts[0:2]), (2, prompts[4:6])]:
    got = read_shard(f'{out}/shard-{n:05d}.jsonl.gz')
    assert [r['id'] for r in got] == [r['id'] for r in rows]
    assert [r['response_ids'] for r in got] == [ar_alone(target, r['prompt_ids']) for r in rows]
  assert sorted(os.listdir(out)) == [f'shard-0000{n}.jsonl.gz' for n in range(3)]


def test_teacher_settings_come_from_the_config_then_the_flags(tmp_path):
  """The target and decoding settings of a decode config (configs/smollm2.py: what the drafters
  serve under), each overridden by its flag; defaults without a config."""
  config = tmp_path / 'decode.py'
  config.write_text(
      'import ml_collections\n'
      'def get_config():\n'
      '  return ml_collections.ConfigDict({"target": "/ckpt/t", "dtype": "bfloat16", '
      '"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 3, "chat_template_kwargs": '
      '\'{"enable_thinking": false}\', "mesh": {"data": 2, "model": 4}, "method": "d2sd"})\n')
  settings = lambda *argv: distill.teacher_settings(
      load_script('distill').arg_parser().parse_args(list(argv)))
  assert settings() == {'target': 'smollm2', 'dtype': 'float32', 'temperature': 0.0, 'top_k': 0,
                        'top_p': 1.0, 'seed': 0, 'chat_template_kwargs': {},
                        'mesh': {'data': -1, 'model': 1}}
  assert settings('--config', str(config)) == {
      'target': '/ckpt/t', 'dtype': 'bfloat16', 'temperature': 0.7, 'top_k': 20, 'top_p': 0.9,
      'seed': 3, 'chat_template_kwargs': {'enable_thinking': False},
      'mesh': {'data': 2, 'model': 4}}
  got = settings('--config', str(config), '--temperature', '0', '--mesh_model', '8',
                 '--dtype', 'float32', '--target', 'smollm2')
  assert (got['temperature'], got['mesh'], got['dtype'], got['target'], got['top_k']) == (
      0.0, {'data': 2, 'model': 8}, 'float32', 'smollm2', 20)
  with pytest.raises(ValueError, match='top_p=0.0 must be in'):
    settings('--top_p', '0')


def test_distill_samples_with_the_settings_and_refuses_others_on_resume(tiny_folder, tmp_path,
                                                                        capsys):
  """--temperature reaches the generator (sampled responses, not greedy AR's), the settings
  are recorded with the shards, and resuming with other settings is refused before loading."""
  prompts = write_jsonl(tmp_path / 'p.jsonl', [{'prompt': p, 'chat': False}
                                               for p in ('abc', 'hello', 'x y z', 'def f')])
  out = str(tmp_path / 'out')
  argv = ['--out', out, '--prompts', prompts, '--target', tiny_folder, '--max_new_tokens', '6',
          '--max_prompt_tokens', '100', '--length_bounds', '100', '--batch_size', '2',
          '--prompt_bucket', '128', '--shard_size', '4', '--temperature', '1.0', '--seed', '7']
  load_script('distill').main(argv)
  settings = json.loads((tmp_path / 'out' / 'settings.json').read_text())
  assert (settings['temperature'], settings['seed'], settings['target']) == (1.0, 7, tiny_folder)
  records = read_shard(f'{out}/shard-00000.jsonl.gz')
  target = loaders.load_target(tiny_folder)
  assert any(r['response_ids'] != ar_alone(target, r['prompt_ids']) for r in records)
  with pytest.raises(SystemExit):
    load_script('distill').main(argv[:-4] + ['--temperature', '0'])
  assert 'was distilled with seed=7, temperature=1.0, not seed=0, temperature=0.0' in \
      capsys.readouterr().err


@pytest.mark.slow  # (two subprocesses)
def test_distill_on_a_model_parallel_mesh_gives_the_same_responses(tiny_folder, tmp_path):
  """--mesh_model 2 (the target's weights split over 2 devices) distills the same greedy
  responses as one device (fresh processes: the device count is fixed at start-up)."""
  prompts = write_jsonl(tmp_path / 'p.jsonl', [{'prompt': p, 'chat': False}
                                               for p in ('abc', 'hello', 'x y z', 'def f')])
  responses = {}
  for name, extra in (('one', []), ('mesh', ['--mesh_model', '2'])):
    out = str(tmp_path / name)
    subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'distill.py'), '--out', out,
                    '--prompts', prompts, '--target', tiny_folder, '--max_new_tokens', '6', '--max_prompt_tokens',
                    '100', '--length_bounds', '100', '--batch_size', '2', '--prompt_bucket',
                    '128', '--shard_size', '4', *extra], check=True, capture_output=True,
                   env={**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=2'})
    responses[name] = [r['response_ids'] for r in read_shard(f'{out}/shard-00000.jsonl.gz')]
  assert responses['mesh'] == responses['one'] and len(responses['one']) == 4


def _write_wordnet(root):
  """A WordNet database of four nouns in its own file formats (index.noun: lemma, pos,
  synset_cnt, p_cnt, pointers, sense_cnt, tagsense_cnt, offsets; data.noun: offset, lex file,
  type, word count (hex), words, pointer count, pointers, gloss)."""
  os.makedirs(root)
  with open(os.path.join(root, 'index.noun'), 'w') as f:
    f.write('  1 header line of the license\n')
    f.write('bread n 1 1 @ 1 9 00000100  \n')        # tagged 9 times: kept
    f.write('cake n 1 1 @ 1 4 00000200  \n')         # kept, a sibling of bread
    f.write('zymurgy n 1 1 @ 1 0 00000300  \n')      # never tagged: dropped
    f.write('hot_dog n 1 1 @ 1 7 00000400  \n')      # not one word of letters: dropped
  with open(os.path.join(root, 'data.noun'), 'w') as f:
    f.write('  1 header\n')
    f.write('00000100 13 n 01 bread 0 001 @ 00000900 n 0000 | baked dough  \n')
    f.write('00000200 13 n 02 cake 0 bar 1 001 @ 00000900 n 0000 | a baked sweet  \n')
    f.write('00000300 04 n 01 zymurgy 0 000 | fermentation chemistry  \n')
    f.write('00000400 13 n 01 hot_dog 0 000 | a sausage  \n')


def test_questions_from_wordnet_nouns(tmp_path):
  """Common nouns become questions: their kind's forms (noun.food: preparing, recipes...) and
  a comparison with a sibling of the same hypernym; rare and multi-word lemmas are left out."""
  root = str(tmp_path / 'wordnet')
  _write_wordnet(root)
  assert distill.wordnet_nouns(root) == [('bread', 'noun.food', '00000900'),
                                         ('cake', 'noun.food', '00000900')]
  questions = distill.question_prompts(root)
  words = {src.split(':')[2] for src, _ in questions}
  assert words == {'bread', 'cake'}
  food = set(distill.QUESTION_FORMS['noun.food'])
  for word in ('bread', 'cake'):
    asked = [q for src, q in questions if src.split(':')[2] == word and src.count(':') == 2]
    assert len(asked) == 2, asked  # one general form, one of its kind
    assert any(q in {f.format(w=word, a='a') for f in food} for q in asked), asked
  for src, q in questions:
    assert '{' not in q and 'zymurgy' not in q
  with pytest.raises(FileNotFoundError, match='apt-get install wordnet-base'):
    distill.wordnet_nouns(str(tmp_path / 'missing'))


def test_package_prompts_never_read_numpy(tmp_path):
  """Documented functions of installed packages are prompts, except in any folder naming
  numpy (its source is evaluation data), tests and vendored copies."""
  doc = '"""Return the thing, computed carefully from its inputs and their order."""'
  for rel in ('pkg/core.py', 'numpy/linalg.py', 'jax/numpy/ops.py', 'pkg/tests/test_core.py',
              'pkg/_vendor/six.py'):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'def public(x):\n    {doc}\n    return x\n\n'
                    f'def test_public():\n    {doc}\n    return 1\n')
  found = distill.package_functions([str(tmp_path)])
  assert [(m, n) for m, n, _, _ in found] == [(os.path.join('pkg', 'core.py'), 'public')]

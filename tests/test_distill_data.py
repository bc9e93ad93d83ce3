"""Distillation inputs and outputs: prompt files in every format (and their errors), the
turn-by-turn regeneration of conversations, and shards that resume with the same prompts."""

import gzip
import json
import os

import jax
import pytest

from d2sd_jax import batching
from d2sd_jax import conversations
from d2sd_jax import distill
from d2sd_jax import generate as G
from d2sd_jax import loaders

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


_generate = jax.jit(G.generate, static_argnums=(1, 2, 6))


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
  settings = G.GenerationSettings(max_new_tokens=6, eos_ids=target.tokenizer.eos_ids,
                                  pad_id=target.tokenizer.pad_id)
  return target, batching.Generator(target.params, target.cfg, settings, batch_size=2,
                                    length_bounds=(100,), prompt_bucket=128)


def read_shard(path):
  with gzip.open(path, 'rt') as f:
    return [json.loads(line) for line in f]


def ar_alone(target, ids):
  """Greedy AR of one prompt in a batch of its own (generate.generate)."""
  tok = target.tokenizer
  block, lens = G.pad_prompts([ids], tok.pad_id, bucket=128)
  settings = G.GenerationSettings(6, tok.eos_ids, tok.pad_id)
  state = _generate(target.params, target.cfg, settings, block, lens, G.row_keys(0, [0]),
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

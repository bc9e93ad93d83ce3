"""One command for the papers' findings on this machine: JSON and PNG in results/.

  python benchmarks/reproduce.py [--quick] [--out results] [--only ladder,trees,sampled,scaling,pareto,calibration]
      (--only reruns those sections and keeps the others from the existing JSON)
      [--sets heldout_questions_chat,prose_chat]   (with --only trees and/or sampled: reruns
      those prompt sets alone, each then with its own run record; the other sets are kept)
      [--drafter1 drafters/smollm2-drafter1 --drafter2 drafters/smollm2-drafter2]
  python benchmarks/reproduce.py --markdown [--write]   # the tables, from results/*.json;
      --write puts them into docs/results.md and the headline table into README.md

Everything runs through `d2sd_jax.load(...).generate` (decode.py's path), batch 1. The ladder,
trees and sampled sections decode in turns, each prompt by every method before the next prompt,
so the machine's drift weighs on every row alike (`lossless_rows`):
- ladder: ar, pld, dflash, dflash_resample, dflash_dflash, d2sd, d2sd_pld, and the best-first
  trees ddtree and d2sd_tree at node budget TREE_BUDGET, greedy, on
  HumanEval in the chat template, HumanEval as plain completion, and a non-code chat set
  (benchmarks/prompts/prose.jsonl): tau, decode tokens/s, speed-up over AR in the same run,
  per-stage times. Every method's completions must equal AR's (lossless), or the run stops.
- trees: the best-first trees at node budget TREE_BUDGET beside the chain and D²SD's tree, both
  its own (36 nodes) and cut to the same budget (ar, pld, dflash, ddtree, d2sd, d2sd(N=16),
  d2sd_tree) and what method=auto picks (from the shipped priors: a fresh choice cache, then
  what the run's own decodes teach it, as a user's first decodes), greedy, on HumanEval in the
  chat template, on held-out code (plain completions of the held-out records of
  data/distill-packages: the split training never sees; documented functions of installed
  packages), on held-out questions (the held-out records of data/distill-questions in the chat
  template) and on the prose chat set. tau, the trees' own expected tau (from their node
  scores), tokens/s, speed-up over AR in the same run; lossless.
- sampled: the trees when sampling (SAMPLED: temperature 0.7, top-p 0.95, seed 0): ar, pld,
  dflash, ddtree and d2sd_tree at TREE_BUDGET nodes, and what method=auto decodes with (a fresh
  choice cache per set), on HumanEval chat and held-out code. tau,
  tokens/s, speed-up over AR in the same run (outputs are draws of the target's law, not AR's
  draws: the law tests check them).
- scaling: gamma = 4 / 8 / 16 for prompt lookup (a diffusion drafter's gamma is fixed by its
  training: its gamma scaling needs one drafter trained per gamma, not done here), and d2sd at
  K = 1 / 2 / 4 branches (HumanEval chat).
- pareto: temperature 1, the two knobs of "speculative diffusion": denoising steps x leniency
  lambda, for dflash (one drafter, so the knobs are the whole story). Speed is the measured
  decode tokens/s; quality is measured three ways on HumanEval plain completions:
    pass@1: each completion, cut at the first top-level statement after the function, is run
      with the problem's tests by a separate `python` process with a timeout (never in this
      process);
    NLL: the target's negative log-likelihood per generated token (temperature 1);
    agreement: the fraction of each completion that is a common prefix with the lossless
      (lambda = 0) run at the same steps and seed.
  Non-dominated points (faster and at least as good on pass@1 and NLL) make the frontier.
- calibration: benchmarks/drafter_quality.py --plot (drafter 1's reliability diagram, ECE).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_decode  # pylint: disable=wrong-import-position
from turns import lossless_rows, per_token_ms, row_of  # pylint: disable=wrong-import-position
from d2sd_jax import files  # pylint: disable=wrong-import-position
from d2sd_jax.formats import checkpoints  # pylint: disable=wrong-import-position
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position

SECTIONS = ('ladder', 'trees', 'sampled', 'scaling', 'pareto', 'calibration')
LADDER = ('ar', 'pld', 'dflash', 'dflash_resample', 'dflash_dflash', 'd2sd', 'd2sd_pld',
          'ddtree', 'd2sd_tree')  # the best-first trees at TREE_BUDGET nodes
TREE_BUDGET = 16  # nodes verified per cycle by the budgeted rows, the anchor included
# (row label, method, knobs): D²SD both with its own 36-node tree and cut to the same budget
TREES = (('ar', 'ar', {}), ('pld', 'pld', {}), ('dflash', 'dflash', {}),
         ('ddtree', 'ddtree', {'tree_budget': TREE_BUDGET}), ('d2sd', 'd2sd', {}),
         (f'd2sd(N={TREE_BUDGET})', 'd2sd', {'tree_budget': TREE_BUDGET}),
         ('d2sd_tree', 'd2sd_tree', {'tree_budget': TREE_BUDGET}),
         ('auto', 'auto', {}))  # what method=auto picks, from the shipped priors (a fresh cache)
# the trees when sampling: the settings users run (chat models' usual temperature and nucleus)
SAMPLED = dict(temperature=0.7, top_p=0.95, seed=0)
SAMPLED_RUNS = (('ar', 'ar', {}), ('pld', 'pld', {}), ('dflash', 'dflash', {}),
                ('ddtree', 'ddtree', {'tree_budget': TREE_BUDGET}),
                ('d2sd_tree', 'd2sd_tree', {'tree_budget': TREE_BUDGET}),
                ('auto', 'auto', {}))
HELD_OUT_CODE = os.path.join(ROOT, 'data', 'distill-packages')
HELD_OUT_QUESTIONS = os.path.join(ROOT, 'data', 'distill-questions')
STOP = ('\ndef ', '\nclass ', '\nif __name__', '\nprint(', '\n#', '\nassert ')


def humaneval(n: int) -> list[dict]:
  return spec_decode.humaneval_problems(n)


def prose(n: int) -> list[str]:
  with open(os.path.join(ROOT, 'benchmarks', 'prompts', 'prose.jsonl')) as f:
    return [json.loads(line)['prompt'] for line in f if line.strip()][:n]


def passes(problem: dict, completion: str, timeout: float = 10.0) -> bool:
  """HumanEval's check of one completion, in a separate python process with a timeout."""
  cut = min([completion.find(s) for s in STOP if s in completion] or [len(completion)])
  program = (problem['prompt'] + completion[:cut] + '\n\n' + problem['test'] +
             f'\n\ncheck({problem["entry_point"]})\n')
  with tempfile.TemporaryDirectory() as tmp:
    try:
      proc = subprocess.run([sys.executable, '-c', program], cwd=tmp, capture_output=True,
                            timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
      return False
  return proc.returncode == 0


def nll_per_token(target, prompt_ids: list[int], completion_ids: list[int]) -> float:
  """The target's mean -log p (temperature 1) of the completion given the prompt."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from d2sd_jax.models import target as model_lib  # pylint: disable=import-outside-toplevel
  if not completion_ids:
    return float('nan')
  ids = np.asarray([list(prompt_ids) + list(completion_ids)], np.int32)
  L = ids.shape[1]
  hidden, _, _ = model_lib.forward(target.params, target.cfg, ids, jnp.arange(L)[None],
                                   model_lib.init_cache(target.cfg, 1, L),
                                   jnp.zeros((1,), jnp.int32), fresh=True)
  logp = jax.nn.log_softmax(model_lib.logits(target.params, target.cfg, hidden)[0], -1)
  P = len(prompt_ids)
  picked = logp[P - 1:L - 1][jnp.arange(L - P), ids[0, P:]]
  return float(-jnp.mean(picked))


def common_prefix(a, b) -> float:
  n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
  return n / max(1, len(a))


def label_of(r: dict) -> str:
  """A row's method, with what method=auto decoded: its pick, or each pick and its prompts."""
  if not r.get('auto_choice'):
    return r['method']
  parts = r.get('auto_parts') or [{'choice': r['auto_choice']}]
  if len(parts) == 1:
    return f"{r['method']} → {parts[0]['choice']}"
  return f"{r['method']} → " + ', '.join(f"{p['choice']} ×{p['prompts']}" for p in parts)


def ladder(dec, n: int, tokens: int, stage_times: bool = True) -> dict:
  sets = {'humaneval_chat': ([p['prompt'] for p in humaneval(n)], True),
          'humaneval_plain': ([p['prompt'] for p in humaneval(n)], False),
          'prose_chat': (prose(n), True)}
  budget = lambda m: {'tree_budget': TREE_BUDGET} if m in ('ddtree', 'd2sd_tree') else {}
  return lossless_rows(dec, 'ladder', sets, [
      (m, m, {'stage_times': stage_times and m != 'ar', **budget(m)}) for m in LADDER], tokens)


def _pick(sets: dict, names) -> dict:
  """The prompt sets named (all for None)."""
  return sets if names is None else {k: v for k, v in sets.items() if k in names}


def trees(dec, n: int, tokens: int, names=None) -> dict:
  sets = {'humaneval_chat': ([p['prompt'] for p in humaneval(n)], True),
          'heldout_code_plain': (spec_decode.held_out_record_prompts(HELD_OUT_CODE, n, False),
                                 False),
          'heldout_questions_chat': (spec_decode.held_out_record_prompts(HELD_OUT_QUESTIONS, n,
                                                                         True), True),
          'prose_chat': (prose(n), True)}
  return lossless_rows(dec, 'trees', _pick(sets, names), TREES, tokens)


def sampled(dec, n: int, tokens: int, names=None) -> dict:
  """The trees at SAMPLED's temperature and top-p, on HumanEval chat and held-out code: tau,
  tokens/s and speed-up over AR in the same run (outputs not compared: `lossless_rows`)."""
  sets = {'humaneval_chat': ([p['prompt'] for p in humaneval(n)], True),
          'heldout_code_plain': (spec_decode.held_out_record_prompts(HELD_OUT_CODE, n, False),
                                 False)}
  return lossless_rows(dec, 'sampled', _pick(sets, names), SAMPLED_RUNS, tokens,
                       sampling=SAMPLED)


def scaling(dec, n: int, tokens: int) -> dict:
  prompts = [p['prompt'] for p in humaneval(n)]
  ar = dec.generate(prompts, tokens, method='ar', batch_size=1)
  ar_ms = per_token_ms(ar.stats)
  out = {'gamma': [], 'branches': []}
  for gamma in (4, 8, 16):  # prompt lookup: gamma is a free knob (a drafter's is trained in)
    g = dec.generate(prompts, tokens, method='pld', batch_size=1, gamma=gamma)
    out['gamma'].append({'gamma': gamma, **row_of('pld', g.stats, ar_ms)})
  for k in (1, 2, 4):
    g = dec.generate(prompts, tokens, method='d2sd', batch_size=1, n_branches=k)
    out['branches'].append({'n_branches': k, **row_of('d2sd', g.stats, ar_ms)})
  print(json.dumps({'scaling': out}), flush=True)
  return out


def pareto(dec, n: int, tokens: int, steps_grid, leniency_grid) -> dict:
  problems = humaneval(n)
  prompts = [p['prompt'] for p in problems]
  tok = dec.target.tokenizer
  prompt_ids = [tok.encode_prompt(p, False) for p in prompts]
  points = []
  for steps in steps_grid:
    lossless = None
    for lam in leniency_grid:
      g = dec.generate(prompts, tokens, method='dflash', chat=False, batch_size=1,
                       temperature=1.0, seed=0, steps=steps, leniency=lam)
      if lam == 0:
        lossless = g.ids
      point = {
          'steps': steps, 'leniency': lam, 'tau': g.stats.get('tau'),
          'decode_tokens_per_s': g.stats['decode_tokens_per_s'],
          'pass_at_1': float(np.mean([passes(p, t) for p, t in zip(problems, g.texts)])),
          'nll_per_token': float(np.nanmean([nll_per_token(dec.target, p, c)
                                             for p, c in zip(prompt_ids, g.ids)])),
          'agreement': (float(np.mean([common_prefix(a, b) for a, b in zip(g.ids, lossless)]))
                        if lossless is not None else None)}
      points.append(point)
      print(json.dumps({'pareto': point}), flush=True)
  for p in points:  # the frontier: no other point is faster and at least as good on both
    p['frontier'] = not any(
        q is not p and q['decode_tokens_per_s'] >= p['decode_tokens_per_s'] and
        q['pass_at_1'] >= p['pass_at_1'] and q['nll_per_token'] <= p['nll_per_token'] and
        (q['decode_tokens_per_s'], q['pass_at_1'], -q['nll_per_token']) !=
        (p['decode_tokens_per_s'], p['pass_at_1'], -p['nll_per_token']) for q in points)
  return {'points': points}


def calibration(out_dir: str, n: int, tokens: int, drafter1: str, drafter2: str) -> dict:
  png = os.path.join(out_dir, 'calibration.png')
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'drafter_quality.py'),
                         '--prompts', str(n), '--new_tokens', str(tokens), '--chat',
                         '--drafter1', drafter1, '--drafter2', drafter2, '--plot', png],
                        capture_output=True, text=True, check=False)
  if proc.returncode:
    raise SystemExit(f'drafter_quality.py failed: {proc.stderr[-2000:]}')
  lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{')]
  return {'png': png, 'rows': lines}


def plots(results: dict, out_dir: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  if 'ladder' in results:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for name, rows in results['ladder'].items():
      rows = [r for r in rows if r['method'] != 'ar (end)']  # (the drift check: not a rung)
      axes[0].plot([r['method'] for r in rows], [r['tau'] for r in rows], 'o-', label=name)
      axes[1].plot([r['method'] for r in rows], [r['speedup_vs_ar'] for r in rows], 'o-',
                   label=name)
    axes[0].set_ylabel('tau (tokens per cycle)')
    axes[1].set_ylabel('speed-up over AR (this CPU)')
    axes[1].axhline(1.0, color='gray', lw=0.5)
    for ax in axes:
      ax.tick_params(axis='x', rotation=30)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, 'ladder.png'), dpi=120)
  if 'pareto' in results:
    pts = results['pareto']['points']
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key in zip(axes, ('pass_at_1', 'nll_per_token')):
      for p in pts:
        ax.scatter(p['decode_tokens_per_s'], p[key], marker='o' if p['frontier'] else 'x')
        ax.annotate(f"s{p['steps']} λ{p['leniency']}", (p['decode_tokens_per_s'], p[key]),
                    fontsize=7)
      ax.set_xlabel('decode tokens/s')
      ax.set_ylabel(key)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, 'pareto.png'), dpi=120)


def drafters_digest(paths) -> dict:
  """Which drafters a run measured: a digest of each drafter folder's file names and bytes, its
  checkpoints' (the trees' reliability curves beside them, node_calibration.json, are refitted
  without changing the drafter)."""
  out = {}
  for name, path in zip(('drafter1', 'drafter2'), paths):
    h = hashlib.sha256()
    for f in sorted(glob.glob(os.path.join(path, '**'), recursive=True)):
      if os.path.isfile(f) and os.path.basename(f) != checkpoints.CALIBRATION_FILE:
        h.update(os.path.relpath(f, path).encode())
        with open(f, 'rb') as fh:
          h.update(fh.read())
    out[name] = h.hexdigest()[:16]
  return out


SHIPPED = (os.path.join(ROOT, 'drafters', 'smollm2-drafter1'),
           os.path.join(ROOT, 'drafters', 'smollm2-drafter2'))


def run_record(argv: list[str], drafters: list[str]) -> dict:
  """The date, machine, command and drafters of a run, kept with each section it wrote."""
  return {'date': time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
          'machine': costmodel.machine(),
          'command': ' '.join(['python benchmarks/reproduce.py', *argv]).strip(),
          'drafters': drafters_digest(drafters)}


def _measured(res: dict, section: str, name: str | None = None,
              shipped: dict | None = None) -> str:
  """A table's provenance; `shipped` (the shipped drafters' digests): a run that measured other
  drafters says so."""
  runs = res.get('runs') or {}
  run = runs.get(f'{section}:{name}', runs.get(section))  # a prompt set rerun alone (--sets)
  if run is None:
    return f'({section}: no run record)'
  other = ''
  if shipped is not None and run.get('drafters') not in (None, shipped):
    other = (f"; **other drafters** ({run['drafters']['drafter1']} / "
             f"{run['drafters']['drafter2']}), not the shipped ones: rerun `--only {section}`")
  return f"({section}: {run['date']}, {run['machine']}, `{run['command']}`{other})"


HEADLINE = ('humaneval_chat', ('method', 'τ', 'tokens/s', 'speed-up vs AR'))


def headline(out_dir: str) -> str:
  """The README's table, from reproduce.json: the ladder on HumanEval in the chat template
  (docs/results.md has every other table, the trees' included)."""
  with open(os.path.join(out_dir, 'reproduce.json')) as f:
    res = json.load(f)
  shipped = drafters_digest(SHIPPED)
  name, head = HEADLINE
  row = lambda r: (f"| {label_of(r)} | {r['tau']} | {r['decode_tokens_per_s']} | "
                   f"{r['speedup_vs_ar']} |")
  table = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  lines = [f'{name} ({res["settings"]}) {_measured(res, "ladder", shipped=shipped)}:', '',
           *table]
  lines += [row(r) for r in res['ladder'][name]]
  return '\n'.join(lines)


def replace_generated(path: str, text: str) -> None:
  """Puts `text` between the file's generated-block markers (the rest is left alone)."""
  files.replace_block(path, BEGIN, END, text.strip('\n') + '\n')


def generated(path: str) -> str:
  """What stands between the markers of `path`."""
  with open(path) as f:
    page = f.read()
  return page.split(BEGIN)[1].split(END)[0].strip('\n')


BEGIN = '<!-- generated by python benchmarks/reproduce.py --markdown --write: do not edit -->'
END = '<!-- end of generated block -->'


def markdown(out_dir: str) -> str:
  """Every table of the JSON files in `out_dir`, each section with its run's date, machine and
  command."""
  lines = []
  shipped = drafters_digest(SHIPPED)
  measured = lambda res, section, name=None: _measured(res, section, name, shipped)
  for path in sorted(glob.glob(os.path.join(out_dir, '*.json'))):
    with open(path) as f:
      res = json.load(f)
    for name, rows in res.get('ladder', {}).items():
      lines += [f'\n{name} ({res["settings"]}) {measured(res, "ladder")}:', '',
                '| method | τ | tokens/s | speed-up vs AR | draft / verify / accept ms |',
                '|---|---|---|---|---|']
      for r in rows:
        st = r.get('stage_ms') or {}
        stages = ' / '.join(str(round(st[k], 1)) for k in ('draft', 'verify', 'accept') if k in st)
        lines.append(f"| {r['method']} | {r['tau']} | {r['decode_tokens_per_s']} | "
                     f"{r['speedup_vs_ar']} | {stages or '–'} |")
    for name, rows in res.get('trees', {}).items():
      lines += [f'\nbest-first trees at {TREE_BUDGET} nodes, {name} ({res["settings"]}) '
                f'{measured(res, "trees", name)}:', '',
                '| method | τ | expected τ (node scores) | tree nodes | tokens/s | speed-up vs AR |',
                '|---|---|---|---|---|---|']
      for r in rows:
        lines.append(f"| {label_of(r)} | {r['tau']} | {r['expected_tau'] or '–'} | "
                     f"{r['tree_size'] or '–'} | {r['decode_tokens_per_s']} | "
                     f"{r['speedup_vs_ar']} |")
    knobs = ', '.join(f'{k} {v}' for k, v in SAMPLED.items())
    for name, rows in res.get('sampled', {}).items():
      lines += [f'\nsampling ({knobs}), trees at {TREE_BUDGET} nodes, {name} '
                f'({res["settings"]}) {measured(res, "sampled", name)}:', '',
                '| method | τ | expected τ (node scores) | tokens/s | speed-up vs AR |',
                '|---|---|---|---|---|']
      lines += [f"| {label_of(r)} | {r['tau']} | {r['expected_tau'] or '–'} | "
                f"{r['decode_tokens_per_s']} | {r['speedup_vs_ar']} |" for r in rows]
    if 'scaling' in res:
      lines += ['', f'γ and K scaling, HumanEval chat {measured(res, "scaling")}:', '',
                '| knob | value | method | τ | tokens/s | speed-up vs AR | tree nodes |',
                '|---|---|---|---|---|---|---|']
      for knob, key in (('gamma', 'gamma'), ('branches', 'n_branches')):
        for r in res['scaling'][knob]:
          lines.append(f"| {key} | {r[key]} | {r['method']} | {r['tau']} | "
                       f"{r['decode_tokens_per_s']} | {r['speedup_vs_ar']} | {r['tree_size']} |")
    if 'calibration' in res:
      q = next((r for r in res['calibration']['rows'] if r.get('summary') == 'drafter_quality'),
               None)
      lines += ['', f"calibration {measured(res, 'calibration')}: "
                f"results/{os.path.basename(res['calibration']['png'])}" + (
          '' if q is None else
          f": drafter 1 ECE {q['ece_raw']} ({q['ece_calibrated']} at its stored temperature "
          f"{q['temperature']}), chain τ estimate {q['tau_estimate_drafter1']}; drafter 2 beats "
          f"drafter 1 at the first re-drafted position for {q['drafter2_better_first']} of "
          f"{q['prefix_lengths']} prefix lengths")]
    if 'pareto' in res:
      lines += ['', f'steps × λ at temperature 1, dflash, HumanEval plain '
                f'{measured(res, "pareto")}:', '',
                '| steps | λ | τ | tokens/s | pass@1 | NLL/token | agreement | frontier |',
                '|---|---|---|---|---|---|---|---|']
      for p in res['pareto']['points']:
        lines.append(f"| {p['steps']} | {p['leniency']} | {p['tau']} | "
                     f"{p['decode_tokens_per_s']} | {p['pass_at_1']:.2f} | "
                     f"{p['nll_per_token']:.3f} | "
                     f"{'–' if p['agreement'] is None else round(p['agreement'], 3)} | "
                     f"{'yes' if p['frontier'] else ''} |")
  return '\n'.join(lines)


def sections_of(only: str) -> list[str]:
  """--only's comma-separated section names, checked."""
  names = [n for n in only.split(',') if n]
  if not names or set(names) - set(SECTIONS):
    raise ValueError(f'--only {only}: sections are {",".join(SECTIONS)}')
  return names


PER_SET = ('trees', 'sampled')  # the sections --sets can rerun one prompt set at a time
PROMPT_SETS = ('humaneval_chat', 'heldout_code_plain', 'heldout_questions_chat', 'prose_chat')


def sets_of(sets: str, only: list[str]) -> list[str] | None:
  """--sets' prompt set names (None: every set), checked against the sections run."""
  names = [n for n in sets.split(',') if n]
  if not names:
    return None
  if set(only) - set(PER_SET):
    raise ValueError(f'--sets reruns prompt sets of {",".join(PER_SET)} only: use it with '
                     f'--only {",".join(PER_SET)} or a part of it')
  if set(names) - set(PROMPT_SETS):
    raise ValueError(f'--sets {sets}: prompt sets are {",".join(PROMPT_SETS)}')
  return names


def kept_sections(path: str, only: list[str], settings: str, drafters: list[str]) -> dict:
  """What a run of the sections `only` starts from. A subset of SECTIONS keeps the existing JSON
  at `path` (the sections it reruns get overwritten) if that file was written with the same
  settings and drafters; every section, or no file yet, starts empty. A file written with other
  settings or drafters is an error (one table would mix two runs); nothing is written then."""
  results = {}
  if os.path.exists(path) and set(only) != set(SECTIONS):
    with open(path) as f:
      results = json.load(f)
    if results.get('settings') != settings:
      raise SystemExit(f'{path} holds a run with other settings ({results.get("settings")}): '
                       'rerun every section, or write elsewhere with --out')
    if results.get('drafters', drafters) != drafters:  # files before the key: not recorded
      raise SystemExit(f'{path} holds a run with drafters {results["drafters"]}, not '
                       f'{drafters}: rerun every section, or write elsewhere with --out')
  results.update(settings=settings, drafters=drafters)
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(ROOT, 'results'))
  parser.add_argument('--quick', action='store_true', help='3 prompts, 32 tokens: a smoke run')
  parser.add_argument('--only', default=','.join(SECTIONS),
                      help='comma-separated sections to run; the others are kept from the '
                      'existing JSON')
  parser.add_argument('--sets', default='',
                      help='comma-separated prompt sets of the trees and sampled sections to '
                      'rerun (e.g. heldout_questions_chat,prose_chat); their other sets are kept')
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--markdown', action='store_true')
  parser.add_argument('--write', action='store_true', help='with --markdown: write the tables '
                      'into docs/results.md and the headline table into README.md')
  args = parser.parse_args()
  if args.markdown:
    print(markdown(args.out))
    if args.write:
      replace_generated(os.path.join(ROOT, 'docs', 'results.md'), markdown(args.out))
      replace_generated(os.path.join(ROOT, 'README.md'), headline(args.out))
    return
  import d2sd_jax  # pylint: disable=import-outside-toplevel
  os.makedirs(args.out, exist_ok=True)
  # method=auto starts from the shipped priors, not from choices remembered on this machine
  os.environ['D2SD_AUTO_CACHE'] = tempfile.mkdtemp(prefix='d2sd-auto-')
  n, tokens = (3, 32) if args.quick else (20, 128)
  settings = f'{n} prompts, {tokens} new tokens, batch 1, greedy unless stated'
  name = 'reproduce-quick.json' if args.quick else 'reproduce.json'
  path = os.path.join(args.out, name)
  try:
    only = sections_of(args.only)
    names = sets_of(args.sets, only)
  except ValueError as e:
    parser.error(str(e))
  # (--sets: every section is kept, and the sets rerun replace theirs)
  results = kept_sections(path, only if names is None else [], settings,
                          [args.drafter1, args.drafter2])
  record = run_record(sys.argv[1:], [args.drafter1, args.drafter2])
  runs = results.setdefault('runs', {})
  for section in only:
    if names is None:  # the whole section: no set keeps a record of its own
      for k in [k for k in runs if k.startswith(f'{section}:')]:
        del runs[k]
      runs[section] = record
  dec = d2sd_jax.load('smollm2', drafter1=args.drafter1, drafter2=args.drafter2)
  # Each section compiles programs of its own: dropped after it, so that the process does not
  # collect every section's (their code's memory maps reach Linux's per-process limit).
  if 'ladder' in only:
    # (--quick: no per-stage times, 3 more programs per method to compile)
    results['ladder'] = ladder(dec, n, tokens, stage_times=not args.quick)
    dec.drop_programs()
  for section, run in (('trees', trees), ('sampled', sampled)):
    if section in only:
      rows = run(dec, n, tokens, names)
      results[section] = {**(results.get(section, {}) if names else {}), **rows}
      if names:
        runs.update({f'{section}:{name}': record for name in rows})
      dec.drop_programs()
  if 'scaling' in only:
    results['scaling'] = scaling(dec, n, tokens)
    dec.drop_programs()
  if 'pareto' in only:
    results['pareto'] = pareto(dec, n, tokens, (1, 2) if args.quick else (1, 2, 4),
                               (0.0, 0.5) if args.quick else (0.0, 0.25, 0.5, 0.75))
  if 'calibration' in only:
    results['calibration'] = calibration(args.out, n, tokens, args.drafter1, args.drafter2)
  with open(path, 'w') as f:
    json.dump(results, f, indent=1)
  plots(results, args.out)
  print(markdown(args.out))


if __name__ == '__main__':
  main()

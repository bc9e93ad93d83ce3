"""How good the drafters are, and what D²SD's second draft recovers, with the SmolLM2 target
(greedy, T = 0).

  python benchmarks/drafter_quality.py [--set humaneval | package:NAME | records:DIR] [--chat]
      [--prompts 20] [--new_tokens 128] [--drafter1 ...] [--drafter2 ...]
      [--out results/drafter_quality.json] [--plot_recovery results/recovery.png]

--set picks the prompts: HumanEval's; the documented functions of an installed package
(package:NAME; plain completions, or with --chat questions about what each function does), e.g.
one that no distillation folder holds; or a distillation folder's held-out records
(records:DIR, their recorded responses: no decoding needed). The target first writes its greedy
completions (AR, decode.py's code path). Then, at every
position of those completions, the drafters draft the next block from the target's own context
features, exactly as at decode time, and we count agreement with what the target wrote:
  * drafter 1, per block position: accuracy and the chain acceptance length it implies;
  * drafter 1's confidence calibration: reliability bins and ECE of c_k against
    P(draft k correct | drafts 1..k-1 correct), raw (T = 1) and with the temperature fitted on
    held-out training data at training time (stored with the drafter; not refitted here);
  * drafter 2 against drafter 1 from the same prefixes: for each prefix length l (the anchor and
    the target's next l tokens given, the rest masked), accuracy at the first re-drafted position
    l+1 and over all masked positions;
  * the recovery table (d2sd_jax/train/recovery.py): where drafter 1's chain is first rejected,
    and for each cut depth the tokens a branch re-drafted there by drafter 1 or drafter 2 adds
    from the true cut, under redraft='exclude' and 'merge' and with a second pass that sees
    the forced first token ('twopass'), and how often the K selected cuts include it; overall
    and by context length (tokens before the anchor).
One JSON line per result; the last line is a summary. --out keeps the set's results (with the
command, date and machine) in a JSON file of all sets.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import io
import json
import os
import shlex
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import smollm2 as smollm2_config  # pylint: disable=wrong-import-position
from spec_decode import humaneval_prompts  # pylint: disable=wrong-import-position

from d2sd_jax import files  # pylint: disable=wrong-import-position
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position
from d2sd_jax.train import calibration  # pylint: disable=wrong-import-position
from d2sd_jax.train import data as data_lib  # pylint: disable=wrong-import-position
from d2sd_jax.train import distill  # pylint: disable=wrong-import-position
from d2sd_jax.train import recovery  # pylint: disable=wrong-import-position
from d2sd_jax.decode import generate as generate_lib  # pylint: disable=wrong-import-position
from d2sd_jax.formats import loaders  # pylint: disable=wrong-import-position
from d2sd_jax.train import losses  # pylint: disable=wrong-import-position
from d2sd_jax.train import features  # pylint: disable=wrong-import-position
from d2sd_jax.formats.drafters import load_drafter

BUCKET = 64
CONTEXT_BUCKETS = (256, 512, 1 << 30)  # recovery by tokens before the anchor: <= 256, <= 512, more
QUESTION = ('What does the function `{name}` of the {package} package do, and how would I call '
            'it? Its signature and docstring:\n```python\n{body}```')


def package_prompts(package: str, n: int, chat: bool) -> list[str]:
  """The first n documented functions of an installed package (distill's order): plain
  completions of the signature and docstring, or (chat) questions about what each does."""
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit(f'package:{package}: no such installed package (pip install it first)')
  root = list(spec.submodule_search_locations)[0]
  functions = sorted(distill.stdlib_functions(root, distill.SKIP_DIRS),
                     key=lambda f: hashlib.sha256(f'{f[0]}:{f[1]}'.encode()).hexdigest())
  out = []
  for module, name, header, doc in functions[:n]:
    body = distill.make_prompt('complete_plain', header, doc)[0]
    out.append(QUESTION.format(name=name, package=package, body=body) if chat else body)
  if not out:
    raise SystemExit(f'package:{package}: no documented functions found under {root}')
  return out


def record_sequences(path: str, n: int, chat: bool):
  """(tokens, n_prompt) of the first n held-out records (training's split) of one style."""
  rows = [r for r in data_lib.held_out_records(path, 0.05) if bool(r['chat']) == chat][:n]
  if not rows:
    raise SystemExit(f'records:{path}: no held-out {"chat" if chat else "plain"} records')
  return [(np.asarray(r['prompt_ids'] + r['response_ids'], np.int32), len(r['prompt_ids']))
          for r in rows]


def target_sequences(prompts, args, target):
  """(tokens, n_prompt) per prompt: the prompt and the target's greedy completion."""
  with tempfile.TemporaryDirectory() as tmp:
    prompts_file = os.path.join(tmp, 'prompts.jsonl')
    with open(prompts_file, 'w') as f:
      for p in prompts:
        f.write(json.dumps({'prompt': p}) + '\n')
    c = smollm2_config.get_config()
    out = os.path.join(tmp, 'ar.jsonl')
    c.update(method='ar', prompts_file=prompts_file, chat=args.chat,
             max_new_tokens=args.new_tokens, output=out)
    generate_lib.run(c, out=io.StringIO())
    with open(out) as f:
      completions = [json.loads(line)['completion_ids'] for line in f]
  seqs = []
  for p, comp in zip(prompts, completions):
    ids = target.tokenizer.encode_prompt(p, args.chat)
    seqs.append((np.asarray(ids + comp, np.int32), len(ids)))
  return seqs


class Scorer:
  """Per-sequence block statistics of one drafter (jitted once per padded length and prefix)."""

  def __init__(self, target, dcfg, dparams, n_anchors: int):
    self.target, self.dcfg, self.dparams, self.n_anchors = target, dcfg, dparams, n_anchors
    self.features = jax.jit(lambda p, t: features.target_features(p, target.cfg, dcfg, t))
    self._score = jax.jit(self._score_fn)

  def _score_fn(self, dparams, tparams, tokens, feats, label_mask, first_anchor, prefix_len):
    L, G = tokens.shape[1], self.dcfg.gamma
    # Anchors from the last prompt token on: every block whose drafts are completion tokens.
    anchors = jnp.minimum(first_anchor + jnp.arange(self.n_anchors), L - 1)[None]
    prefix = jnp.full_like(anchors, prefix_len)
    weights = jnp.ones((1, self.n_anchors, G), jnp.float32)
    return losses.drafter_loss(dparams, self.dcfg, tparams, self.target.cfg, tokens, feats,
                               label_mask, anchors, prefix, weights, calibrate=True)[1]

  def __call__(self, tokens, n_prompt, feats, prefix_len: int, padded: int):
    L = len(tokens)
    tok = np.full((1, padded), self.target.tokenizer.pad_id, np.int32)
    tok[0, :L] = tokens
    mask = np.zeros((1, padded), bool)
    mask[0, n_prompt:L] = True  # labels: the target's completion only
    return jax.device_get(self._score(self.dparams, self.target.params, tok, feats, mask,
                                      n_prompt - 1, jnp.int32(prefix_len)))


def accumulate(stats: dict, m: dict):
  for k in ('count_by_pos', 'calibration'):
    stats[k] = stats.get(k, 0) + np.asarray(m[k], np.float64)
  stats['hits_by_pos'] = stats.get('hits_by_pos', 0) + np.asarray(m['acc_by_pos'] *
                                                                   m['count_by_pos'], np.float64)


def sequences(args, target):
  """(name of the set, [(tokens, n_prompt)]) for --set."""
  kind, _, value = args.set.partition(':')
  style = 'chat' if args.chat else 'plain'
  if kind == 'records':
    return f'{os.path.basename(value.rstrip("/"))}_{style}', record_sequences(
        value, args.prompts, args.chat)
  if kind == 'package':
    prompts = package_prompts(value, args.prompts, args.chat)
    return f'{value}_{style}', target_sequences(prompts, args, target)
  if kind == 'humaneval':
    return f'humaneval_{style}', target_sequences(humaneval_prompts(args.prompts), args, target)
  raise SystemExit(f'--set {args.set!r}: use humaneval, package:NAME or records:DIR')


def recovery_plot(table: dict, names, path: str, title: str) -> None:
  """Per cut depth: how often the chain is first rejected there (bars, left) and the tokens a
  branch re-drafted by each drafter adds from that cut (lines, right)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  cuts = table['by_cut']
  x = np.arange(len(cuts))
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.bar(x, [c['share'] for c in cuts], color='0.85', label='chain first rejected here')
  ax.set_xlabel('cut depth i* (drafts accepted before the first rejection)')
  ax.set_ylabel('share of cycles')
  right = ax.twinx()
  for name in names:
    for rule, style in (('exclude', '-'), ('merge', ':'), ('twopass', '--')):
      right.plot(x, [c[f'{name}_{rule}'] for c in cuts], style, marker='o',
                 label=f'{name} re-draft, {rule}')
  right.set_ylabel('tokens the branch adds at the true cut')
  handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
  ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc='upper right')
  ax.set_title(title, fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--set', default='humaneval',
                      help='humaneval, package:NAME (an installed package) or records:DIR')
  parser.add_argument('--prompts', type=int, default=20)
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--chat', action='store_true', help='wrap prompts in the chat template')
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--n_branches', type=int, default=4, help="D²SD's K (selected cuts)")
  parser.add_argument('--plot', default='', help='write drafter 1\'s reliability diagram here '
                      '(PNG), raw and with the stored temperature')
  parser.add_argument('--plot_recovery', default='', help='write the recovery plot here (PNG)')
  parser.add_argument('--out', default='', help='keep this set\'s results in this JSON file')
  parser.add_argument('--tag', default='', help='kept under SET/TAG in --out (e.g. which drafters)')
  args = parser.parse_args()

  target = loaders.load_target('smollm2', 'float32')
  drafters = {name: load_drafter(path, target) for name, path in
              (('drafter1', args.drafter1), ('drafter2', args.drafter2)) if path}
  if 'drafter1' not in drafters:
    raise SystemExit('--drafter1 is required')
  recovery.check_alike({n: d[:2] for n, d in drafters.items()})
  set_name, seqs = sequences(args, target)
  d1cfg = drafters['drafter1'][0]
  G = d1cfg.gamma
  scorers = {name: Scorer(target, dcfg, params, args.new_tokens) for name, (dcfg, params, _) in drafters.items()}
  stats = {(name, l): {} for name in scorers for l in range(G - 1)}
  padded = -(-max(len(t) for t, _ in seqs) // BUCKET) * BUCKET  # one shape: one compilation
  for tokens, n_prompt in seqs:
    tok = np.full((1, padded), target.tokenizer.pad_id, np.int32)
    tok[0, :len(tokens)] = tokens
    feats = scorers['drafter1'].features(target.params, tok)
    for (name, l), s in stats.items():
      accumulate(s, scorers[name](tokens, n_prompt, feats, l, padded))

  # Drafter 1 from the anchor alone: what a chain sees.
  s = stats[('drafter1', 0)]
  acc = s['hits_by_pos'] / np.maximum(s['count_by_pos'], 1)
  print(json.dumps({'drafter1_accuracy_by_position': [round(float(a), 4) for a in acc[1:]],
                    'labels_per_position': int(s['count_by_pos'][1]),
                    'tau_estimate': round(1 + float(np.sum(np.cumprod(acc[1:]))), 3)}))
  temps = list(calibration.TEMPERATURES)
  t_fit = d1cfg.confidence_temperature
  raw, fitted = s['calibration'][temps.index(1.0)], s['calibration'][temps.index(t_fit)]
  calib = {'ece_raw': round(calibration.ece(raw), 4), 'temperature': t_fit,
           'ece_calibrated': round(calibration.ece(fitted), 4),
           'reliability_raw': calibration.reliability(raw),
           'reliability_calibrated': calibration.reliability(fitted)}
  print(json.dumps({'drafter1_calibration': calib}))
  if args.plot:
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    calibration.reliability_plot(
        {'raw': raw, f'temperature {t_fit}': fitted}, args.plot,
        f'drafter 1 on {len(seqs)} {set_name} prompts')

  rows = []
  for l in range(G - 1):
    row = {'prefix_len': l}
    for name in scorers:
      s = stats[(name, l)]
      hits, count = s['hits_by_pos'][l + 1:], s['count_by_pos'][l + 1:]
      row[f'{name}_first'] = round(float(hits[0] / max(count[0], 1)), 4)
      row[f'{name}_masked'] = round(float(hits.sum() / max(count.sum(), 1)), 4)
    rows.append(row)
    print(json.dumps(row))

  # What a branch at the chain's true first rejection adds, by re-drafter and rule.
  tally = recovery.measure(seqs, target, {n: d[:2] for n, d in drafters.items()},
                           scorers['drafter1'].features, args.n_branches, CONTEXT_BUCKETS,
                           target.tokenizer.pad_id, BUCKET)
  rec = {'all': tally.table()}
  for i, bound in enumerate(CONTEXT_BUCKETS):
    low = 0 if i == 0 else CONTEXT_BUCKETS[i - 1] + 1
    label = f'context {low}-{bound}' if bound < 1 << 30 else f'context > {low - 1}'
    rec[label] = tally.table(i)
  for label, table in rec.items():
    print(json.dumps({'recovery': label, **{k: table[k] for k in (
        'cycles', 'rejection', 'gain_per_cycle', 'gain_per_cycle_if_selected')}}))
  for row in rec['all']['by_cut']:
    print(json.dumps({'recovery_cut': row}))
  if args.plot_recovery:
    recovery_plot(rec['all'], list(drafters), args.plot_recovery,
                  f'{set_name}: {len(seqs)} prompts, {rec["all"]["cycles"]} cycles (teacher-forced)')

  summary = {'summary': 'drafter_quality', 'set': set_name, 'prompts': len(seqs),
             'chat': args.chat, 'new_tokens': args.new_tokens, 'tau_estimate_drafter1':
             round(1 + float(np.sum(np.cumprod(acc[1:]))), 3), **{
                 k: calib[k] for k in ('ece_raw', 'ece_calibrated', 'temperature')},
             'rejection_prior': recovery.rejection_prior(tally),
             'gain_per_cycle': rec['all']['gain_per_cycle']}
  if 'drafter2' in scorers:
    summary['drafter2_better_first'] = sum(r['drafter2_first'] > r['drafter1_first'] for r in rows)
    summary['prefix_lengths'] = len(rows)
  print(json.dumps(summary))
  if args.out:
    record = {'command': 'python benchmarks/drafter_quality.py ' + shlex.join(sys.argv[1:]),
              'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
              'machine': costmodel.machine(), 'drafters': {
                  n: os.path.relpath(p) for n, p in (('drafter1', args.drafter1),
                                                     ('drafter2', args.drafter2)) if p},
              'summary': summary, 'by_prefix': rows, 'recovery': rec}
    results = {}
    if os.path.exists(args.out):
      with open(args.out) as f:
        results = json.load(f)
    results[set_name + (f'/{args.tag}' if args.tag else '')] = record
    files.write_json(args.out, results)


if __name__ == '__main__':
  main()

"""How good the drafters are on HumanEval prompts with the SmolLM2 target (greedy, T = 0).

  python benchmarks/drafter_quality.py [--prompts 20] [--new_tokens 128] [--chat]
      [--drafter1 drafters/smollm2-drafter1] [--drafter2 drafters/smollm2-drafter2]

The target first writes its greedy completions (AR, decode.py's code path). Then, at every
position of those completions, the drafters draft the next block from the target's own context
features, exactly as at decode time, and we count agreement with what the target wrote:
  * drafter 1, per block position: accuracy and the chain acceptance length it implies;
  * drafter 1's confidence calibration: reliability bins and ECE of c_k against
    P(draft k correct | drafts 1..k-1 correct), raw (T = 1) and with the temperature fitted on
    held-out training data at training time (stored with the drafter; not refitted here);
  * drafter 2 against drafter 1 from the same prefixes: for each prefix length l (the anchor and
    the target's next l tokens given, the rest masked), accuracy at the first re-drafted position
    l+1 and over all masked positions.
One JSON line per result; the last line is a summary.
"""
from __future__ import annotations

import argparse
import io
import json
import os
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

from d2sd_jax.train import calibration  # pylint: disable=wrong-import-position
from d2sd_jax.decode import generate as generate_lib  # pylint: disable=wrong-import-position
from d2sd_jax.formats import loaders  # pylint: disable=wrong-import-position
from d2sd_jax.train import losses  # pylint: disable=wrong-import-position
from d2sd_jax.train import features  # pylint: disable=wrong-import-position
from d2sd_jax.formats.drafters import load_drafter

BUCKET = 64


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--prompts', type=int, default=20)
  parser.add_argument('--new_tokens', type=int, default=128)
  parser.add_argument('--chat', action='store_true', help='wrap prompts in the chat template')
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--plot', default='', help='write drafter 1\'s reliability diagram here '
                      '(PNG), raw and with the stored temperature')
  args = parser.parse_args()

  target = loaders.load_target('smollm2', 'float32')
  drafters = {name: load_drafter(path, target) for name, path in
              (('drafter1', args.drafter1), ('drafter2', args.drafter2)) if path}
  if 'drafter1' not in drafters:
    raise SystemExit('--drafter1 is required')
  seqs = target_sequences(humaneval_prompts(args.prompts), args, target)
  d1cfg = drafters['drafter1'][0]
  G = d1cfg.gamma
  for name, (dcfg, _, _) in drafters.items():
    if dcfg.gamma != G or dcfg.feature_layers != d1cfg.feature_layers:
      raise SystemExit(f'{name} differs from drafter 1 in gamma or feature layers: compare '
                       'drafters built alike')
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
        f'drafter 1 on {len(seqs)} HumanEval {"chat" if args.chat else "plain"} prompts')

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
  summary = {'summary': 'drafter_quality', 'prompts': len(seqs), 'chat': args.chat,
             'new_tokens': args.new_tokens, 'tau_estimate_drafter1':
             round(1 + float(np.sum(np.cumprod(acc[1:]))), 3), **{
                 k: calib[k] for k in ('ece_raw', 'ece_calibrated', 'temperature')}}
  if 'drafter2' in scorers:
    summary['drafter2_better_first'] = sum(r['drafter2_first'] > r['drafter1_first'] for r in rows)
    summary['prefix_lengths'] = len(rows)
  print(json.dumps(summary))


if __name__ == '__main__':
  main()

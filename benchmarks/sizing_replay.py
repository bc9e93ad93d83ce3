"""What per-cycle tree sizing rules reach on the trees a method drafts, free of timing noise.

  python benchmarks/sizing_replay.py --set package:networkx [--chat] --prompts 10 \
      --new_tokens 96 --drafter1 drafters/smollm2-drafter1 --drafter2 drafters/smollm2-drafter2 \
      [--method d2sd_tree] [--budget 32] [--gamma 8] [--out results/sizing_replay.json]

Greedy decoding commits the target's own tokens whatever the method, so the position a cycle
starts from is all that differs between sizing rules. This script decodes each prompt with AR,
then steps through the output one token at a time and, after every prefix, drafts the method's
best-first tree at the full budget and prompt lookup's proposal (what an adaptive cycle weighs:
adaptive.choice, adaptive.lookup_wins). For any node count n it then knows, at every position,
what a cycle verifying the tree's first n nodes would commit (the bonus token and the deepest
node whose path is the target's continuation), what the node scores expected, and, from this
machine's measured cycle costs (perf.costmodel, as the adaptive programs read them), what the
cycle costs. A rule is then replayed along the output exactly, cycle by cycle, with no clock:

  fixed N        every cycle verifies N nodes
  adaptive       the shipped rule (adaptive.choice's gain at the running drafted rate, with and
                 without adaptive.lookup_wins' lookup-only cycles), over the given shapes
  best expected  each cycle maximises expected tokens - r * cost at the one rate r that rule
                 reaches (Dinkelbach's fixed point over the whole output): what a rule that
                 knew the long-run rate in advance would reach from the same scores
  oracle         the same, knowing every cycle's real outcome (a near-bound: no rule that
                 sees only the scores is expected to reach it)

Each rule's figure is tokens per second of decoding (committed tokens over summed cycle costs)
and its ratio to the better of fixed 8 and 16. The costs are the adaptive programs' (their
draft at the full budget, then verify and accept n nodes), so a fixed row here is a fixed-size
cycle drafted at the full budget; what a rule would gain from a smaller draft is left out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drafter_quality import package_prompts  # pylint: disable=wrong-import-position
from d2sd_jax.decode import options as options_lib  # pylint: disable=wrong-import-position
from d2sd_jax.decode import runner as runner_lib  # pylint: disable=wrong-import-position
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import adaptive  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import ar  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import lookup as lookup_lib  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import speculative as SP  # pylint: disable=wrong-import-position
from d2sd_jax.spec_decode import tree as tree_lib  # pylint: disable=wrong-import-position

# node counts the rules may choose among (each <= budget): runner.ADAPTIVE_SHAPES'. On a CPU a
# verification of a node count that is not a multiple of 8 costs more than one of the next
# multiple (XLA's vectorised loops): 6 and 12 nodes measured 65.7 and 80.5 ms a cycle against
# 61.3 and 72.4 for 8 and 16, so finer shapes buy nothing there.
SHAPES = (4, 8, 16, 32)


def committed(tokens, parents, valid, truth: list[int], start: int, room: int) -> np.ndarray:
  """[T]: what a cycle verifying the first n + 1 nodes of this tree commits at output position
  `start` (the anchor is truth[start - 1]; a node at depth d stands for truth[start - 1 + d]):
  1 + the depth of the deepest accepted node among them, at most `room`."""
  T = len(tokens)
  ok = np.zeros(T, bool)
  depth = np.zeros(T, int)
  ok[0] = True
  for i in range(1, T):
    p = parents[i]
    depth[i] = depth[p] + 1
    at = start - 1 + depth[i]
    ok[i] = bool(valid[i]) and ok[p] and at < len(truth) and tokens[i] == truth[at]
  deepest = np.maximum.accumulate(np.where(ok, depth, 0))
  return np.minimum(1 + deepest, room)


def positions(dec, settings, prompt_ids: list[int], truth: list[int], width: int):
  """Per output position p = 1 .. len(truth) - 1 (tokens committed before the cycle): the
  tree's [T] committed tokens and scores, and the lookup tree's, drafted after truth[:p]."""
  params = SP.prepare({'target': dec.target.params, **{n: p for n, (_, p) in
                                                     dec.drafters.items()}}, dec.target.cfg)
  cfg = dec.target.cfg
  block, lens = ar.pad_prompts([prompt_ids], dec.target.tokenizer.pad_id, runner_lib.PROMPT_BUCKET,
                               width)
  cache_size = SP.cache_size_needed(block.shape[1], settings)
  init = jax.jit(SP.init_state, static_argnames=('cfg', 'settings', 'cache_size'))
  state = init(params, cfg, settings, block, lens, ar.row_keys(0, [0]), cache_size,
               jnp.asarray(len(truth), jnp.int32))
  out = []
  for p in range(1, len(truth)):
    tree, lookup, state = _position(params, cfg, settings, state)
    tree, lookup, done = jax.device_get((tree, lookup, state.num_out_B[0]))
    assert int(done) == p + 1, 'a cycle verifying the anchor alone commits one token'
    room = len(truth) - p
    out.append((committed(tree.tokens_BxT[0], tree.parents_BxT[0], tree.valid_BxT[0], truth, p,
                          room), tree.score_BxT[0],
                committed(lookup.tokens_BxT[0], lookup.parents_BxT[0], lookup.valid_BxT[0],
                          truth, p, room), lookup.score_BxT[0]))
  return out


def _position_fn(params, cfg, settings, state):
  """The method's tree and prompt lookup's after the committed tokens, then a cycle that
  verifies the anchor alone: it commits exactly the target's next token."""
  tree = SP.draft(params, cfg, settings, state)
  lookup = lookup_lib.lookup_tree(settings, state)
  one = tree_lib.prefix(tree, 1)
  state = SP.accept_and_commit(params, settings, state, one, SP.verify(params, cfg, settings,
                                                                       state, one))
  return tree, lookup, state


_position = jax.jit(_position_fn, static_argnames=('cfg', 'settings'))


def replay(cycles, paid, choose) -> tuple[int, float, int]:
  """Walks one output: at position p, choose(p, memory) -> (n or 'lookup'); returns (tokens,
  seconds at the `paid` costs, cycles)."""
  p, tokens, seconds, count, memory = 0, 0, 0.0, 0, {}
  while p < len(cycles):
    n = choose(p, memory)
    got = cycles[p][2][-1] if n == 'lookup' else cycles[p][0][n - 1]
    tokens += int(got)
    seconds += paid[n]
    count += 1
    p += int(got)
  return tokens, seconds, count


def expected(cycle, n):
  """1 + the expected drafts of the tree's first n nodes (adaptive.choice's tokens)."""
  return 1.0 + float(np.sum(np.exp(cycle[1][1:n])))


def lookup_expected(cycle):
  return 1.0 + float(np.sum(np.exp(cycle[3][1:])))


def shipped_rule(cycles, cost, shapes, gamma, lookup: bool):
  """adaptive.choice and adaptive.lookup_wins, in numpy: the running drafted rate (first
  drafted cycle: its own best ratio), RATE_MEMORY's running means."""
  held = [cost[n] for n in shapes if n >= gamma] or [cost[max(shapes)]]

  def choose(p, mem):
    c = cycles[p]
    rate = mem['tok'] / mem['sec'] if mem.get('sec') else np.inf
    if lookup:
      lk = lookup_expected(c)
      if lk / cost['lookup'] > max(rate, lk / min(held)):
        return 'lookup'
    toks = np.array([expected(c, n) for n in shapes])
    secs = np.array([cost[n] for n in shapes])
    r = np.max(toks / secs) if np.isinf(rate) else rate
    i = int(np.argmax(toks - r * secs))
    if 'sec' not in mem:
      mem.update(tok=toks[i], sec=secs[i])
    else:
      mem['tok'] += adaptive.RATE_MEMORY * (toks[i] - mem['tok'])
      mem['sec'] += adaptive.RATE_MEMORY * (secs[i] - mem['sec'])
    return shapes[i]
  return choose


def at_rate(cycles, cost, shapes, r: float, lookup: bool, real: bool):
  """Each cycle maximises (expected or, `real`, actual) tokens - r * cost."""
  def choose(p, mem):
    c = cycles[p]
    options = [(n, (c[0][n - 1] if real else expected(c, n)) - r * cost[n]) for n in shapes]
    if lookup:
      options.append(('lookup', (c[2][-1] if real else lookup_expected(c)) - r * cost['lookup']))
    return max(options, key=lambda o: o[1])[0]
  return choose


def total(outputs, paid, make_choose) -> dict:
  tokens = seconds = count = 0
  for cycles in outputs:
    t, s, c = replay(cycles, paid, make_choose(cycles))
    tokens, seconds, count = tokens + t, seconds + s, count + c
  return {'tokens_per_s': round(tokens / seconds, 2), 'tau': round(tokens / count, 3)}


def fixed_point(outputs, cost, paid, shapes, lookup: bool, real: bool) -> dict:
  """Dinkelbach's iteration: r <- the rate the rule at r reaches, until it stops rising."""
  r, best = 0.0, None
  for _ in range(30):
    got = total(outputs, paid, lambda cycles: at_rate(cycles, cost, shapes, r, lookup, real))
    if best is not None and got['tokens_per_s'] <= best['tokens_per_s'] + 1e-6:
      break
    best, r = got, got['tokens_per_s']
  return best


def in_loop_costs(dec, args, prompts, width: int, shapes) -> dict:
  """Each choice's seconds a cycle inside the adaptive program's own decode loop, with that
  choice forced: node_costs that make it the only one worth taking (every other shape a
  thousand times dearer; lookup-only cycles priced out), or prompt lookup alone (a lookup cost
  that always wins: every cycle after each prompt's first). The runs decode `prompts` in turns
  (benchmarks/turns.py), so the machine's drift weighs on every choice alike; a cycle's cost
  is decode seconds over cycles. Unlike the cost table (each stage a program of its own), these
  include the loop's own work and the lax.cond / lax.switch of the adaptive program."""
  import turns  # pylint: disable=import-outside-toplevel
  base = {'gamma': args.gamma, 'tree_budget': args.budget, 'adaptive': True,
          'lookup_cycles': True}
  force = lambda n: tuple((m, 1e-3 if m == n else 1.0) for m in sorted({n, args.budget}))
  runs = [(n, args.method, {**base, 'node_costs': force(n), 'lookup_cost': 1e9}) for n in shapes]
  runs.append(('lookup', args.method, {**base, 'node_costs': force(shapes[0]),
                                       'lookup_cost': 1e-9}))
  rows = turns.lossless_rows(dec, 'paid', {'prompts': (prompts, args.chat)},
                             [('ar', 'ar', {})] + runs, args.new_tokens, warm=True)['prompts']
  by_label = {r['method']: r for r in rows}
  out = {}
  for label, _, _ in runs:
    row = by_label[label]
    out[label] = row['ms_per_token'] * row['tau'] / 1e3  # (ms per token times tokens a cycle)
    print(json.dumps({'in_loop_ms': str(label), 'ms_per_cycle': round(1e3 * out[label], 2),
                      'tau': row['tau'], 'lookup_only_share': row.get('lookup_only_share')}),
          file=sys.stderr)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--set', default='package:networkx')
  parser.add_argument('--chat', action='store_true')
  parser.add_argument('--prompts', type=int, default=10)
  parser.add_argument('--new_tokens', type=int, default=96)
  parser.add_argument('--drafter1', default='drafters/smollm2-drafter1')
  parser.add_argument('--drafter2', default='drafters/smollm2-drafter2')
  parser.add_argument('--method', default='d2sd_tree')
  parser.add_argument('--budget', type=int, default=32)
  parser.add_argument('--gamma', type=int, default=8)
  parser.add_argument('--shapes', default=SHAPES, type=lambda t: tuple(map(int, t.split(','))))
  parser.add_argument('--out', default='')
  parser.add_argument('--keep', default='', help='a pickle of the drafted positions: read if '
                      'it exists (no decoding), else written')
  parser.add_argument('--paid', choices=('table', 'loop'), default='table',
                      help="what a replayed cycle costs: the cost table's figure the rules "
                      "choose by, or (loop) each choice's cycle timed inside the adaptive "
                      "program's own decode loop (in_loop_costs)")
  parser.add_argument('--paid_prompts', type=int, default=4,
                      help='with --paid loop: the prompts each choice decodes, in turns')
  args = parser.parse_args()
  import d2sd_jax  # pylint: disable=import-outside-toplevel
  dec = d2sd_jax.load('smollm2', drafter1=args.drafter1, drafter2=args.drafter2)
  tok = dec.target.tokenizer
  prompts = package_prompts(args.set.split(':', 1)[1], args.prompts, args.chat)
  prompt_ids = [tok.encode_prompt(p, args.chat, {}) for p in prompts]
  width = max(map(len, prompt_ids))
  truths = dec.generate(prompts, args.new_tokens, method='ar', chat=args.chat, batch_size=1,
                        prompt_width=width).ids
  options = options_lib.Options(method=args.method, max_new_tokens=args.new_tokens,
                                chat=args.chat, batch_size=1, prompt_width=width,
                                spec={'gamma': args.gamma, 'tree_budget': args.budget})
  spec = options_lib.spec_fields(options, dec.drafters)
  gen = options_lib.generation_settings(options, tok.eos_ids, tok.pad_id)
  shapes = tuple(n for n in args.shapes if n <= args.budget)
  block = runner_lib.round_up(width, runner_lib.PROMPT_BUCKET)
  fixed = SP.SpecSettings(gen, method=args.method, **{**spec, 'adaptive': False},
                          **{n: dec.drafters[n][0] for n in options_lib.drafters_needed(
                              args.method)})
  pld = SP.SpecSettings(gen, method='pld', gamma=fixed.gamma, ngram_max=fixed.ngram_max)
  params = {'target': dec.target.params, **{n: p for n, (_, p) in dec.drafters.items()}}
  table = costmodel.measure(params, dec.target.cfg, [fixed, pld], batch=1, context=block,
                            sizes=tuple(sorted({2, fixed.gamma, *shapes})),
                            log=lambda line: print(line, file=sys.stderr))
  part = lambda s, n: table.draft[costmodel.draft_key(s)] + table.at('verify', n) + table.at(
      'accept', n)
  cost = {n: part(fixed, n) for n in shapes}
  cost['lookup'] = part(pld, fixed.gamma)
  paid = dict(cost)  # what a replayed cycle costs: the table's, or (--paid loop) the loop's
  if args.paid == 'loop':
    paid = in_loop_costs(dec, args, prompts[:args.paid_prompts], width, shapes)
  # (--keep: what the positions were drafted from, so that a pickle of another run is refused)
  drafted_from = [args.method, args.budget, args.gamma, args.drafter1, args.drafter2,
                  prompt_ids, truths]
  outputs = None
  if args.keep and os.path.exists(args.keep):
    with open(args.keep, 'rb') as f:
      kept = pickle.load(f)
    if kept.get('drafted_from') != drafted_from:
      raise SystemExit(f'--keep {args.keep} holds positions drafted for other prompts, drafters '
                       'or settings: give another path, or delete it to draft again')
    outputs = kept['outputs']
  if outputs is None:
    outputs = []
    for i, (ids, truth) in enumerate(zip(prompt_ids, truths)):
      outputs.append(positions(dec, fixed, ids, truth, width))
      print(f'prompt {i}: {len(truth)} tokens', file=sys.stderr, flush=True)
    if args.keep:
      with open(args.keep, 'wb') as f:
        pickle.dump({'drafted_from': drafted_from, 'outputs': outputs}, f)
  rows = {f'fixed {n}': total(outputs, paid, lambda c, n=n: (lambda p, m: n)) for n in shapes}
  for name, sh in ((f'shapes {"/".join(map(str, shapes))}', shapes),):
    for lookup in (False, True):
      tag = f'{name}{", lookup cycles" if lookup else ""}'
      rows[f'adaptive, {tag}'] = total(outputs, paid, lambda c, sh=sh, lk=lookup: shipped_rule(
          c, cost, sh, fixed.gamma, lk))
      rows[f'best expected, {tag}'] = fixed_point(outputs, cost, paid, sh, lookup, real=False)
      rows[f'oracle, {tag}'] = fixed_point(outputs, paid, paid, sh, lookup, real=True)
  base = max(rows['fixed 8']['tokens_per_s'], rows['fixed 16']['tokens_per_s'])
  for name, row in rows.items():
    row['vs_better_fixed_8_16'] = round(row['tokens_per_s'] / base, 3)
    print(json.dumps({'rule': name, **row}))
  if args.out:
    book = {}
    if os.path.exists(args.out):
      with open(args.out) as f:
        book = json.load(f)
    book[f"{args.set}|{'chat' if args.chat else 'plain'}"] = {
        'command': 'python ' + ' '.join(shlex.quote(a) for a in sys.argv),
        'date': datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
        'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs',
        'costs_ms': {str(k): round(1e3 * v, 2) for k, v in cost.items()},
        'paid_ms': {str(k): round(1e3 * v, 2) for k, v in paid.items()}, 'rules': rows}
    with open(args.out, 'w') as f:
      json.dump(book, f, indent=1)


if __name__ == '__main__':
  main()

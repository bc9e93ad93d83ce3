"""The matmuls of one target step, at 1 row (an AR step) and at 8 / 16 rows (a verified tree),
by form: how cheap verification's matmuls alone can be on this machine, in AR steps.

  python benchmarks/matmul_layout.py [--rows 8,16] [--repeats 11] [--quick]

For each projection of the target (SmolLM2-135M's shapes, read from the shipped GGUF's config;
--quick: a tiny config, a smoke test) there are n_layers distinct matrices (random values:
speed does not depend on them), so a product reads its weights from memory as a real step
does, not from a cache. A program multiplies them in sequence, each product feeding the next
input (a scalar of it, through an optimization barrier: the product is computed in full and
not fused into what reads it), 8 times in one `lax.fori_loop` (costmodel.LOOP_ITERS; weights
and input are arguments, so nothing is folded at compile time). All programs run interleaved;
each figure is the median of --repeats.

Per projection it prints the ms of 1 row from [out, in] (model.py's storage: what an AR step
reads), and of R rows in three forms, each with its ratio to 1 row:
  rows [out, in]   x @ w.T from the stored matrices;
  rows [in, out]   x @ w from transposed copies (what verification read before `linear`
                   took columns: it cost a second copy of the weights);
  columns          `model.linear` as it runs on a CPU: (w @ x.T).T, from the stored matrices.
The "all" line sums them (the LM head once, the rest per layer): m, the matmul part of
verifying R nodes in AR steps' matmuls. If these products are a share s of an AR step
(cycle_cost.py's ar_step gives it), and the rest of a verification costs at least the rest of
an AR step (it attends with R times the queries), verification costs at least 1 + s·(m - 1) AR
steps, whatever else changes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from d2sd_jax.perf import costmodel  # pylint: disable=wrong-import-position
from d2sd_jax.formats import loaders  # pylint: disable=wrong-import-position
from d2sd_jax.models import target as model_lib  # pylint: disable=wrong-import-position


def projections(cfg: model_lib.ModelConfig) -> dict[str, tuple[int, int, int]]:
  """name -> (in, out, how many per step) of a target's matmuls."""
  qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  L = cfg.n_layers
  return {'wqkv': (cfg.d_model, qkv_out, L), 'wo': (cfg.n_heads * cfg.head_dim, cfg.d_model, L),
          'w_gate_up': (cfg.d_model, 2 * cfg.d_ff, L), 'w_down': (cfg.d_ff, cfg.d_model, L),
          'lm_head': (cfg.d_model, cfg.vocab_size, 1)}


FORMS = ('rows_oi', 'rows_io', 'columns')  # see the module docstring
HEADINGS = {'rows_oi': 'rows [out, in]', 'rows_io': 'rows [in, out]', 'columns': 'columns'}


def product(form: str, x_RxI, w):
  if form == 'rows_io':
    return jnp.einsum('ri,io->ro', x_RxI, w, preferred_element_type=jnp.float32)
  if form == 'rows_oi':
    return jnp.einsum('ri,oi->ro', x_RxI, w, preferred_element_type=jnp.float32)
  return model_lib.linear(x_RxI[None], w)[0]  # columns on a CPU (one row: a matrix-vector)


def chain_program(form: str):
  """A jitted (x [R, in], weights) -> (x, acc): LOOP_ITERS passes over the weights in order."""

  def one_pass(carry, weights):
    x, acc = carry
    for w in weights:
      y = jax.lax.optimization_barrier(product(form, x, w))
      s = jnp.mean(y)
      x, acc = x + 1e-9 * s, acc + s
    return x, acc

  program = costmodel.loop_program(one_pass)
  return lambda x, weights: program((x, jnp.float32(0)), weights)


class Timed:
  """One (projection, rows, form) program, compiled and warmed up; run() -> ms per pass."""

  def __init__(self, n_in, weights, rows, form, rng):
    self.fn = chain_program(form)
    self.x = jnp.asarray(rng.standard_normal((rows, n_in)), jnp.float32)
    self.weights = weights
    jax.block_until_ready(self.fn(self.x, weights))

  def run(self) -> float:
    t = time.perf_counter()
    jax.block_until_ready(self.fn(self.x, self.weights))
    return (time.perf_counter() - t) / costmodel.LOOP_ITERS * 1e3


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rows', default='8,16', help='verified tree sizes to compare')
  parser.add_argument('--repeats', type=int, default=11)
  parser.add_argument('--quick', action='store_true', help='tiny shapes, 3 repeats: a smoke test')
  args = parser.parse_args()
  if args.quick:
    cfg = model_lib.ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                head_dim=16, d_ff=96)
    args.repeats, what = 3, 'tiny config'
  else:
    cfg, what = loaders.load_target('smollm2').cfg, 'SmolLM2-135M shapes'
  row_counts = [int(r) for r in args.rows.split(',')]
  rng = np.random.default_rng(0)
  timed = {}
  for name, (n_in, n_out, count) in projections(cfg).items():
    w_oi = [jnp.asarray(rng.standard_normal((n_out, n_in)), jnp.float32) for _ in range(count)]
    w_io = [w.T.copy() for w in w_oi]
    timed[name, 1, 'rows_oi'] = Timed(n_in, w_oi, 1, 'rows_oi', rng)
    for r in row_counts:
      for form in FORMS:
        timed[name, r, form] = Timed(n_in, w_io if form == 'rows_io' else w_oi, r, form, rng)
  times = {k: [] for k in timed}
  for _ in range(args.repeats):
    for k, t in timed.items():
      times[k].append(t.run())
  ms = {k: float(np.median(v)) for k, v in times.items()}
  names = list(projections(cfg))
  for r, form in [(1, 'rows_oi')] + [(r, f) for r in row_counts for f in FORMS]:
    ms['all', r, form] = sum(ms[n, r, form] for n in names)
  print(f'{what}, float32, {jax.devices()[0].device_kind}: ms per step (median of '
        f'{args.repeats}), ratio to 1 row [out, in]')
  header = f'{"projection":10s} {"1 row":>7s}'
  for r in row_counts:
    header += ' |' + ''.join(f' {r:2d} rows, {HEADINGS[f]:15s}' for f in FORMS)
  print(header)
  for n in names + ['all']:
    base = ms[n, 1, 'rows_oi']
    line = f'{n:10s} {base:7.2f}'
    for r in row_counts:
      line += ' |' + ''.join(f' {ms[n, r, f]:15.2f} ({ms[n, r, f] / base:4.2f}x)' for f in FORMS)
    print(line, flush=True)


if __name__ == '__main__':
  main()

"""Weight layout for XLA:CPU's small matmuls: [out, in] (model.py's storage) against [in, out].

  python benchmarks/matmul_layout.py

Times x[rows, in] times W for SmolLM2-135M's projection shapes at 1 row (an AR step) and at
8 / 16 / 36 rows (verification trees), each layout jitted alone, mean of 200 calls. A lead for
cheaper verification on a CPU (README, cost of a cycle): the layout that is fastest for one row
is not the fastest for a tree.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ((576, 1536), (1536, 576), (576, 576))  # (in, out): MLP up/gate, MLP down, attention


def mean_ms(fn, *args, n: int = 200) -> float:
  fn(*args).block_until_ready()
  t = time.perf_counter()
  for _ in range(n):
    out = fn(*args)
  out.block_until_ready()
  return (time.perf_counter() - t) / n * 1e3


def main():
  out_in = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
  in_out = jax.jit(lambda x, w: x @ w)
  rng = np.random.default_rng(0)
  for rows in (1, 8, 16, 36):
    cells = []
    for i, o in SHAPES:
      x = jnp.asarray(rng.standard_normal((rows, i)), jnp.float32)
      w = rng.standard_normal((o, i)).astype(np.float32)
      a = mean_ms(out_in, x, jnp.asarray(w))
      b = mean_ms(in_out, x, jnp.asarray(w.T.copy()))
      cells.append(f'{i}x{o}: [out,in] {a:.3f} ms, [in,out] {b:.3f} ms')
    print(f'rows {rows:2d} | ' + ' | '.join(cells), flush=True)


if __name__ == '__main__':
  main()

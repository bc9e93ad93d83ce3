"""benchmarks/matmul_layout.py times the target's real projections: their shapes match the
model's parameters, and --quick runs and prints every row."""
import os
import subprocess
import sys

import jax
import numpy as np

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import matmul_layout  # pylint: disable=wrong-import-position

from d2sd_jax.models import target as M  # pylint: disable=wrong-import-position


def test_projections_are_the_models_matrices():
  """Grouped-query attention (qkv out != in) and an untied head: every projection matrix of
  the model, with its [in, out] shape, and nothing else."""
  cfg = M.ModelConfig(vocab_size=96, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                      d_ff=56, tie_embeddings=False)
  params = M.init_params(cfg, jax.random.PRNGKey(0))
  want = {}
  for name in ('wqkv', 'wo', 'w_gate_up', 'w_down'):
    shapes = {M.as_matrix(lp, name).shape for lp in params['layers']}
    (out, n_in), = shapes
    want[name] = (n_in, out, len(params['layers']))
  want['lm_head'] = (params['lm_head'].shape[1], params['lm_head'].shape[0], 1)
  assert matmul_layout.projections(cfg) == want


def test_every_form_computes_x_times_w_transposed():
  """rows from [out, in], rows from the [in, out] copy and model.linear's columns (8 rows, so
  linear takes columns here) give x @ w.T."""
  assert M.columns_for(8)
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((8, 24)).astype(np.float32), rng.standard_normal((40, 24))
  w = w.astype(np.float32)
  want = x.astype(np.float64) @ w.T.astype(np.float64)
  for form in matmul_layout.FORMS:
    got = matmul_layout.product(form, x, w.T.copy() if form == 'rows_io' else w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=form)


def test_quick_run_prints_every_projection():
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'matmul_layout.py'),
                         '--quick', '--rows', '8'], capture_output=True, text=True, cwd=ROOT,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {line.split()[0]: line for line in proc.stdout.splitlines()[2:]}
  assert list(rows) == ['wqkv', 'wo', 'w_gate_up', 'w_down', 'lm_head', 'all']
  ratios = [float(x.strip('(x)')) for x in rows['all'].split() if x.startswith('(')]
  assert len(ratios) == len(matmul_layout.FORMS) and np.all(np.asarray(ratios) > 0)

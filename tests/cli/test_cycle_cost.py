"""benchmarks/cycle_cost.py --quick (tiny random target and drafters) runs and writes every
figure with its ratio and goal. Slow (about a minute: some twenty small programs compile)."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_cycle_cost_quick_writes_every_figure(tmp_path):
  out = tmp_path / 'cycle_cost.json'
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'cycle_cost.py'),
                         '--quick', '--json', str(out)], capture_output=True, text=True,
                        cwd=ROOT, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  figures = json.loads(out.read_text())['figures']
  goals = {'verify_8': 1.6, 'verify_16': 2.5, 'draft_d2sd_k4': 1.0, 'accept_commit_pld_8': 0.1,
           'accept_commit_d2sd_16': 0.1, 'ar_step_sampled_b': 1.3, 'accept_pld_sampled_b': 0.2}
  for name, goal in goals.items():
    assert figures[name]['goal'] == goal and figures[name]['ratio'] > 0, name
  assert figures['ar_step']['ms'] > 0 and 'verify_pld_sampled_b' in figures
  assert json.loads(proc.stdout.strip().splitlines()[-1])['summary'] == 'cycle_cost'

"""Sharding on 8 virtual CPU devices (each check runs in its own process: see sharded_checks.py)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_check(name, *args):
  proc = subprocess.run([sys.executable, os.path.join(HERE, 'sharded_checks.py'), name, *args],
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0 and f'ok {name}' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_parameter_shardings_follow_the_rules():
  run_check('rules')


def test_sharded_train_step_equals_one_device(tiny_folder, distill_dir, tmp_path):
  run_check('train', tiny_folder, distill_dir, str(tmp_path))


def test_sharded_speculative_generation_equals_unsharded():
  run_check('decode')

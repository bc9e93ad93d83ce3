"""benchmarks/gpu_session.sh (a GPU lease's script) and benchmarks/gpu_results.py (what turns its
output into results/gpu.json and docs/results.md's GPU table). The script runs here end to end on
the CPU at tiny sizes (slow tier); the results script is checked on a made-up lease folder."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import gpu_results  # pylint: disable=wrong-import-position


def fake_lease(out):
  """A folder as gpu_session.sh leaves it (decode rows, log, two runs' metrics)."""
  os.makedirs(out)
  rows = [{'method': 'ar', 'ms_per_token': 2.0, 'decode_tokens_per_s': 500.0},
          {'method': 'pld', 'lossless': True, 'tau': 2.5, 'ms_per_token': 1.0,
           'decode_tokens_per_s': 1000.0, 'speedup_vs_ar': 2.0, 'tree_size': 8},
          {'summary': 'spec_decode', 'prompts': 3, 'new_tokens': 96, 'dtype': 'float32',
           'prompts_file': 'held-out records of data/distill-packages'}]
  with open(os.path.join(out, 'decode.jsonl'), 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  with open(os.path.join(out, 'session.log'), 'w') as f:
    f.write("[10:00:00 +0s] machine: GPU 0: NVIDIA H200 (UUID: GPU-x)\ndate: 2026-12-04\n"
            "{'jax': '0.11.2', 'jaxlib': '0.11.2'}\n")
  for run, evals in (('d1', [(1000, 3.0, 1.5), (2000, 2.5, 1.8)]), ('d2b', [(500, 4.0, 1.2)])):
    with open(os.path.join(out, f'metrics_{run}.jsonl'), 'w') as f:
      for step, loss, tau in evals:
        f.write(json.dumps({'step': step, 'loss': 9.0, 'tokens_per_s': 10.0 * step}) + '\n')
        f.write(json.dumps({'step': step, 'eval': {'loss': loss, 'tau_estimate': tau,
                                                   'ece': 0.01}}) + '\n')


def test_read_lease_and_its_tables(tmp_path):
  """The rows, the machine and date from the log, each run's evaluations in order; the tables
  have one row per method and per run; --write replaces only the marked blocks of docs/results.md
  (decoding) and docs/training.md (training runs)."""
  out = str(tmp_path / 'lease')
  fake_lease(out)
  lease = gpu_results.read_lease(out)
  assert [r['method'] for r in lease['rows']] == ['ar', 'pld']
  assert lease['summary']['prompts'] == 3
  assert lease['machine'] == 'NVIDIA H200, jax 0.11.2' and lease['date'] == '2026-12-04'
  assert set(lease['training']) == {'d1', 'd2b'}
  d1 = lease['training']['d1']
  assert d1['steps'] == 2000 and d1['sequence_tokens_per_s'] == 20000.0
  assert [(e['step'], e['tau_estimate']) for e in d1['evals']] == [(1000, 1.5), (2000, 1.8)]
  assert d1['what'] == gpu_results.RUNS['d1']
  record = {'machine': lease['machine'], 'settings': 'S', 'date': lease['date'], 'command': 'C',
            'roofline': {'chip': 'H', 'ar_step_ms': 0.2, 'measured_ar_step_ms': 2.0},
            'rows': [{'method': 'ar', 'tau': 1.0, 'tokens_per_s': 500.0, 'speedup': 1.0,
                      'predicted_speedup': 1.0},
                     {'method': 'pld', 'tau': 2.5, 'tokens_per_s': 1000.0, 'speedup': 2.0,
                      'predicted_speedup': 1.8}],
            'training': lease['training']}
  text = gpu_results.markdown(record)
  assert '| pld | 2.50 | 1000 | 2.00× | 1.80× |' in text and 'd1' not in text
  runs = gpu_results.training_markdown(record)
  assert '3.0 (step 1,000) → 2.5 | 1.5 → 1.8 |' in runs and '| d2b: ' in runs
  results, training = tmp_path / 'results.md', tmp_path / 'training.md'
  for page in (results, training):
    page.write_text(f'intro\n{gpu_results.BEGIN}\nold\n{gpu_results.END}\noutro\n')
  gpu_results.write_markdown(record, str(results), str(training))
  assert results.read_text() == f'intro\n{gpu_results.BEGIN}\n{text}{gpu_results.END}\noutro\n'
  assert training.read_text() == f'intro\n{gpu_results.BEGIN}\n{runs}{gpu_results.END}\noutro\n'
  training.write_text('no markers\n')
  with pytest.raises(SystemExit, match='needs one'):
    gpu_results.write_markdown(record, str(results), str(training))


@pytest.mark.slow
def test_gpu_session_runs_end_to_end_at_tiny_sizes(tmp_path):
  """The lease's script on this CPU with 1 prompt and 3 training steps a drafter: every method's
  row lossless, both runs trained and exported, at most 8 files of at most 16 MiB (what a lent
  machine returns), and the plain-array copy holds exactly the exported parameters."""
  out, runs = tmp_path / 'out', tmp_path / 'runs'
  env = {**os.environ, 'OUT': str(out), 'RUNS': str(runs), 'PROMPTS': '1', 'D1_STEPS': '3',
         'D2_STEPS': '3', 'TRAIN_ARGS': '--config.eval_every=0',
         'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  bin_dir = os.path.dirname(sys.executable)  # the script calls python3: this interpreter's
  env['PATH'] = bin_dir + os.pathsep + env['PATH']
  proc = subprocess.run(['bash', 'benchmarks/gpu_session.sh', '900'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1200, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  files = sorted(os.listdir(out))
  assert files == ['decode.jsonl', 'drafter1.npz', 'drafter1.tar', 'drafter2.npz',
                   'drafter2.tar', 'metrics_d1.jsonl', 'metrics_d2.jsonl', 'session.log']
  assert all(os.path.getsize(out / f) <= 16 * 2**20 for f in files)
  rows = [json.loads(line) for line in open(out / 'decode.jsonl')]
  methods = [r['method'] for r in rows if 'method' in r]
  assert methods == ['ar', 'pld', 'dflash', 'd2sd', 'ddtree', 'd2sd_tree', 'ar']  # AR first and last
  assert all(r['lossless'] for r in rows if r.get('method', 'ar') != 'ar' and 'method' in r)
  for run in ('d1', 'd2'):
    last = json.loads(open(out / f'metrics_{run}.jsonl').readlines()[-1])
    assert last['step'] == 3
  import jax  # pylint: disable=import-outside-toplevel
  from d2sd_jax.formats import checkpoints, loaders  # pylint: disable=import-outside-toplevel
  target = loaders.load_target('smollm2')
  _, params, meta = checkpoints.load_checkpoint(str(runs / 'drafter1-d1'), target, 'bfloat16')
  arrays = np.load(out / 'drafter1.npz')
  flat = dict((jax.tree_util.keystr(k), np.asarray(v))
              for k, v in jax.tree_util.tree_flatten_with_path(params)[0])
  assert set(arrays.files) == set(flat) | {'__meta__'}
  for k, v in flat.items():
    stored = arrays[k]
    got = stored.view(v.dtype) if v.dtype.name == 'bfloat16' else stored
    np.testing.assert_array_equal(got, v)
  assert json.loads(arrays['__meta__'].tobytes()) == meta


def test_gpu_shapes_takes_the_chip_the_device_names():
  """benchmarks/gpu_shapes.py's roofline chip: from the device's kind (an H100 is not costed at
  an H200's bandwidth, nor a CPU at a GPU's), or --chip."""
  import gpu_shapes  # pylint: disable=import-outside-toplevel
  assert gpu_shapes.chip_for(None, 'NVIDIA H100 80GB HBM3') == 'h100'
  assert gpu_shapes.chip_for(None, 'NVIDIA H200') == 'h200'
  assert gpu_shapes.chip_for(None, 'cpu') is None
  assert gpu_shapes.chip_for('h200', 'cpu') == 'h200'
  with pytest.raises(SystemExit, match='give one of'):
    gpu_shapes.chip_for('a100', 'cpu')


@pytest.mark.slow
def test_gpu_session_shapes_mode_at_tiny_sizes(tmp_path):
  """MODE=shapes on this CPU, rehearsed at tiny shapes (--tiny): no target or drafter files
  needed; shapes.json has, per batch, the AR step and both cycles timed, each program's floor
  (a cycle's above the AR step's, d2sd's above dflash's: its second drafter), their ratios to
  the roofline, and the roofline's prediction for the chip named."""
  out = tmp_path / 'out'
  env = {**os.environ, 'OUT': str(out), 'MODE': 'shapes',
         'SHAPES_ARGS': '--tiny --chip h100 --repeats 1 --batch 1,2',
         'PYTHONPATH': ROOT + os.pathsep + os.environ.get('PYTHONPATH', '')}
  env['PATH'] = os.path.dirname(sys.executable) + os.pathsep + env['PATH']
  proc = subprocess.run(['bash', 'benchmarks/gpu_session.sh', '600'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert sorted(os.listdir(out)) == ['session.log', 'shapes.json', 'shapes.log']
  result = json.loads((out / 'shapes.json').read_text())
  assert result['chip'] == 'h100' and result['weights'] == 'random bfloat16'
  assert [r['batch'] for r in result['rows']] == [1, 2]
  for row in result['rows']:
    assert set(row['seconds']) == {'ar', 'dflash', 'd2sd'}
    assert all(s > 0 for s in row['seconds'].values())
    floor = row['floor_bytes']
    assert floor['ar'] < floor['dflash'] < floor['d2sd'], floor
    assert row['ar_steps']['d2sd'] == pytest.approx(
        row['seconds']['d2sd'] / row['seconds']['ar'])
    roof = row['predicted']['roofline']
    assert roof['chip'] == 'h100' and 0 < roof['ar'] < roof['dflash'] < roof['d2sd']
    assert row['vs_chip_bandwidth']['ar'] == pytest.approx(
        row['seconds']['ar'] * 3.35e12 / floor['ar'])

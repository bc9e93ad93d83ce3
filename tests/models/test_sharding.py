"""Sharding on 8 virtual CPU devices (each check runs in its own process: see
tests/helpers/sharded_checks.py)."""
import os
import subprocess
import sys

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import ROOT


def run_check(name, *args):
  script = os.path.join(ROOT, 'tests', 'helpers', 'sharded_checks.py')
  proc = subprocess.run([sys.executable, script, name, *args],
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0 and f'ok {name}' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_parameter_shardings_follow_the_rules():
  run_check('rules')


def test_kernels_split_over_a_mesh_equal_one_device():
  run_check('kernels')


def test_layers_with_the_residual_stream_split_equal_one_device():
  run_check('split_residual')


@pytest.mark.slow
def test_sharded_train_step_equals_one_device(tiny_folder, distill_dir, tmp_path):
  run_check('train', tiny_folder, distill_dir, str(tmp_path))


@pytest.mark.slow
def test_sharded_speculative_generation_equals_unsharded():
  run_check('decode')


def write_wide_checkpoint(folder, n_layers=48, d=256, ff=1024, vocab=8192, files=4):
  """A Llama checkpoint that is narrow (width 256, 8 heads of 32) but has 55 M parameters, in
  bfloat16 safetensors split over `files` shards with an index, like a downloaded 8B model."""
  os.makedirs(folder, exist_ok=True)
  config = {'model_type': 'llama', 'vocab_size': vocab, 'hidden_size': d,
            'intermediate_size': ff, 'num_hidden_layers': n_layers, 'num_attention_heads': 8,
            'num_key_value_heads': 8, 'head_dim': d // 8, 'rms_norm_eps': 1e-5,
            'rope_theta': 10000.0, 'tie_word_embeddings': False,
            'max_position_embeddings': 512}
  rng = np.random.default_rng(0)
  w = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  shapes = {'self_attn.q_proj.weight': (d, d), 'self_attn.k_proj.weight': (d, d),
            'self_attn.v_proj.weight': (d, d), 'self_attn.o_proj.weight': (d, d),
            'mlp.gate_proj.weight': (ff, d), 'mlp.up_proj.weight': (ff, d),
            'mlp.down_proj.weight': (d, ff), 'input_layernorm.weight': (d,),
            'post_attention_layernorm.weight': (d,)}
  weight_map, n_params = {}, 0
  per_file = -(-n_layers // files)
  for f in range(files):
    tensors = {}
    if f == 0:
      tensors = {'model.embed_tokens.weight': w(vocab, d), 'model.norm.weight': w(d),
                 'lm_head.weight': w(vocab, d)}
    for i in range(f * per_file, min(n_layers, (f + 1) * per_file)):
      tensors.update({f'model.layers.{i}.{name}': w(*shape) for name, shape in shapes.items()})
    name = f'model-{f + 1:05d}-of-{files:05d}.safetensors'
    save_file(tensors, os.path.join(folder, name))
    weight_map.update({k: name for k in tensors})
    n_params += sum(x.size for x in tensors.values())
  with open(os.path.join(folder, 'model.safetensors.index.json'), 'w') as fh:
    json.dump({'weight_map': weight_map}, fh)
  with open(os.path.join(folder, 'config.json'), 'w') as fh:
    json.dump({**config, 'n_params': n_params}, fh)  # n_params: for the check only


@pytest.mark.slow
def test_sharded_bfloat16_load_splits_bytes_and_bounds_host_memory(tmp_path):
  folder = str(tmp_path / 'wide')
  write_wide_checkpoint(folder)
  run_check('load', folder)

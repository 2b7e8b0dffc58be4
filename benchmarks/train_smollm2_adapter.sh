#!/usr/bin/env bash
# Train the gated-LoRA TiDAR adapter for SmolLM2-135M-Instruct (block 4), on the model's own greedy
# continuations of code and chat prompts cut from the Python standard library's train split
# (5% of the files, chosen by a stable hash of their paths, are held out for benchmarks).
#
#   bash benchmarks/train_smollm2_adapter.sh            # the full run (sizes below)
#   SMOKE=1 bash benchmarks/train_smollm2_adapter.sh    # a ~3-minute smoke run of the same pipeline
#
# Step 1 (self-distillation) resumes where it stopped if interrupted; step 2 resumes from the last
# checkpoint (--resume auto). Sizes can be overridden: CODE_PROMPTS, CHAT_PROMPTS, NEW_TOKENS, STEPS.
set -euo pipefail

OUT=${OUT:-outputs/smollm2-tidar}
if [[ "${SMOKE:-0}" == "1" ]]; then
  OUT=${OUT}-smoke
  CODE_PROMPTS=${CODE_PROMPTS:-8}; CHAT_PROMPTS=${CHAT_PROMPTS:-8}; STEPS=${STEPS:-4}; BATCH=${BATCH:-4}; LOG=1
else
  CODE_PROMPTS=${CODE_PROMPTS:-2500}; CHAT_PROMPTS=${CHAT_PROMPTS:-2500}; STEPS=${STEPS:-1200}; BATCH=${BATCH:-8}; LOG=10
fi
NEW_TOKENS=${NEW_TOKENS:-128}

time python -m hf_tidar.training.distill --model smollm2 --output "$OUT/distilled" \
  --code-prompts "$CODE_PROMPTS" --chat-prompts "$CHAT_PROMPTS" --max-new-tokens "$NEW_TOKENS" --batch-size 16

time hf-tidar train --model smollm2 --method lora --block-size 4 --lora-rank 16 \
  --data --distilled "$OUT/distilled" --batch-size "$BATCH" --learning-rate 1e-3 --max-steps "$STEPS" \
  --save-steps 100 --save-total-limit 2 --logging-steps "$LOG" --resume auto --output "$OUT/adapter"

#!/usr/bin/env bash
# Reproduce the shipped gated-LoRA TiDAR adapter for SmolLM2-135M-Instruct (block 4):
#   hf_tidar/adapters/smollm2-135m-instruct-tidar-b4
#
#   bash benchmarks/train_smollm2_adapter.sh            # the run that made the shipped adapter
#   SMOKE=1 bash benchmarks/train_smollm2_adapter.sh    # a few-minute smoke run of the same pipeline
#
# 1. Self-distillation: SmolLM2's own greedy continuations (64 tokens) of 384 code and 384 chat prompts
#    cut from the Python standard library's train split (5% of the files, by a stable hash of their
#    paths, are held out for benchmarks). Resumes where it stopped.
# 2. Gated LoRA (rank 16 on attention + MLP, the [MASK] embedding), diffusion loss only, on the
#    distilled rows plus packed standard-library source (seq 256), batch 8, lr 1e-3 cosine over 150 steps.
#    The shipped adapter is checkpoint-120: the run was stopped there to fit the session's CPU budget
#    (120 steps took 41 minutes on a 2-core CPU, partly shared with other jobs).
#    Every checkpoint is kept (about 170 MB each) so that checkpoint-120 survives a full run.
# 3. Export: the checkpoint's adapter weights only, stored in fp16 (9.9 MB), plus the gate file.
set -euo pipefail

OUT=${OUT:-outputs/smollm2-tidar}
if [[ "${SMOKE:-0}" == "1" ]]; then
  OUT=${OUT}-smoke
  CODE_PROMPTS=${CODE_PROMPTS:-8}; CHAT_PROMPTS=${CHAT_PROMPTS:-8}; STEPS=${STEPS:-4}; KEEP=${KEEP:-4}; LOG=1
else
  CODE_PROMPTS=${CODE_PROMPTS:-384}; CHAT_PROMPTS=${CHAT_PROMPTS:-384}; STEPS=${STEPS:-150}; KEEP=${KEEP:-120}; LOG=5
fi
ADAPTER=${ADAPTER:-$OUT/export}

time hf-tidar distill --model smollm2 --output "$OUT/distilled" \
  --code-prompts "$CODE_PROMPTS" --chat-prompts "$CHAT_PROMPTS" --max-new-tokens 64 --batch-size 32

time hf-tidar train --model smollm2 --method lora --block-size 4 --lora-rank 16 \
  --data stdlib --distilled "$OUT/distilled" --batch-size 8 --seq-len 256 --learning-rate 1e-3 \
  --max-steps "$STEPS" --save-steps "$((KEEP < 10 ? KEEP : 10))" --save-total-limit 16 --logging-steps "$LOG" \
  --resume auto --output "$OUT/adapter"

python - "$OUT/adapter/checkpoint-$KEEP" "$ADAPTER" <<'PY'
import sys

from hf_tidar.checkpoints import load_smollm2
from hf_tidar.training.gated_lora import export_gated_adapter, tidar_base_for_adapter

ar, tokenizer = load_smollm2(quiet=True)
export_gated_adapter(sys.argv[1], tidar_base_for_adapter(ar, tokenizer=tokenizer, block_size=4), sys.argv[2])
print("adapter written to", sys.argv[2])
PY

#!/usr/bin/env bash
# Stage 5 of the SmolLM2-135M-Instruct gated-LoRA adapter: the shipped (stage 4b) adapter trained further on the
# rows of runs/distill-big it never saw (shards 36 on), shard by shard as the distillation writes them.
#
#   bash benchmarks/train_smollm2_adapter_stage4.sh distill-code        # the data, resumable by shard
#   bash benchmarks/train_smollm2_adapter_stage5.sh                     # plain: OUT=runs/adapter-s5
#   OUT=runs/adapter-s5h HARD=4 bash benchmarks/train_smollm2_adapter_stage5.sh   # --hard-block-weight 4
#
# The unseen shards are linked into runs/distill-fresh/shards (renumbered from 0), so stage 4's `train` reads
# them in order; each round trains to the last finished shard (--stop-at-step) and the next resumes exactly.
# The thirteenth session stopped both runs at step 240 to compare them (BENCHMARKS.md).
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=runs/distill-big/shards
DST=runs/distill-fresh/shards
FIRST=${FIRST:-36}
OUT=${OUT:-runs/adapter-s5}
STEPS=${STEPS:-480}
BATCH=${BATCH:-8}
ROWS_PER_SHARD=128
mkdir -p "$DST"

link_unseen_shards() {
  local i=$FIRST source target
  while [[ -f $SRC/$(printf %05d "$i")/dataset_info.json ]]; do
    source=$(realpath "$SRC/$(printf %05d "$i")")
    target=$DST/$(printf %05d $((i - FIRST)))
    [[ -e $target ]] || ln -s "$source" "$target"
    i=$((i + 1))
  done
}

last_step() {
  local last
  last=$(ls -d "$OUT"/checkpoint-* 2>/dev/null | sed 's/.*checkpoint-//' | sort -n | tail -1)
  echo "${last:-0}"
}

while true; do
  link_unseen_shards
  done_steps=$(last_step)
  (( done_steps >= STEPS )) && break
  available=$(( $(ls "$DST" | wc -l) * ROWS_PER_SHARD / BATCH ))
  stop=$(( available < STEPS ? available : STEPS ))
  if (( stop > done_steps )); then
    echo "stage5: steps $done_steps -> $stop ($(date -u +%H:%M:%S))"
    DATA=runs/distill-fresh OUT=$OUT STEPS=$STEPS BATCH=$BATCH STOP=$stop \
      bash benchmarks/train_smollm2_adapter_stage4.sh train
  else
    sleep 60  # wait for the next shard
  fi
done

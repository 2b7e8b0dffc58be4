#!/usr/bin/env bash
# Renders the cards of the adapters this project ships, with `hf-tidar card`, from the inputs in
# model_cards/inputs/NAME/ (training arguments, benchmark, closing notes). Each card is written here
# and into the shipped adapter's folder (its README.md), so the two never differ.
#
#   bash model_cards/render.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for name in smollm2-135m-instruct-tidar-b4; do
  inputs=model_cards/inputs/$name
  hf-tidar card "hf_tidar/adapters/$name" --base-model HuggingFaceTB/SmolLM2-135M-Instruct --license apache-2.0 \
    --training-args "$inputs/training_args.json" --benchmark "$inputs/benchmark.json" --notes "$inputs/notes.md" \
    --output "model_cards/$name.md" --overwrite
  cp "model_cards/$name.md" "hf_tidar/adapters/$name/README.md"
done

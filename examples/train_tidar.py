"""Train a TiDAR model with the stock ``Trainer``: the same options as ``hf-tidar train``.

Examples (2-core CPU friendly sizes; see docs/training.md for GPU clusters):

    python examples/train_tidar.py --model tiny --output outputs/tiny --max-steps 40 --seq-len 128   # smoke test
    python examples/train_tidar.py --model smollm2 --method lora --block-size 4 --output outputs/adapter \\
        --distilled outputs/distilled --data --seq-len 256 --max-steps 200                         # gated LoRA
    torchrun --nproc_per_node 2 examples/train_tidar.py --model tiny --output outputs/ddp --max-steps 40  # DDP
"""

import sys

from hf_tidar.training.train import main

if __name__ == "__main__":
    sys.exit(main())

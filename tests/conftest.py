"""Shared fixtures: tiny models only, so the whole suite stays fast on 2 CPU cores."""

# Triton runs on a CPU-only machine only in interpreter mode, which must be switched on before anything
# imports triton (importing hf_tidar or transformers may). Kept above every other import for that reason.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never reach the Hub (publishing tests intercept HfApi). Without this, pipeline() and PEFT loading try
# the network first and wait for its timeouts where there is none. Read when huggingface_hub is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from toy import train_counting_tidar


@pytest.fixture(scope="session")
def counting_model():
    """A tiny TiDAR Llama whose drafts are right by construction (trained on counting, block 4)."""
    return train_counting_tidar(block_size=4, steps=150)

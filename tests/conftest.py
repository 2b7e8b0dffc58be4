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


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test model is tiny: one thread avoids OpenMP barrier stalls, which cost up to 50x on a busy
    2-core machine. Tests that need more (multi-process training) start their own processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def counting_model():
    """A tiny TiDAR Llama whose drafts are right by construction (trained on counting, block 4)."""
    return train_counting_tidar(block_size=4, steps=150)

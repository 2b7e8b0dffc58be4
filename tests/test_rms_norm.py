"""Llama's RMSNorm on the CPU operator library (``hf_tidar.cpu.norm``): transformers' values up to the last bit of
a sum, a row's bits whatever the other rows, enabled and disabled with the measured path, greedy TiDAR still AR."""

import pytest
import torch
from toy import assert_greedy_tidar_is_ar, tiny_ar_model, train_counting_tidar
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.cpu import norm as measured_norm
from hf_tidar.cpu.norm import rms_norm_kernel
from hf_tidar.tiny import TINY_BACKBONES

kernel = rms_norm_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU operator library needs an x86 CPU and a compiler")


def _norm(width: int, dtype: torch.dtype, seed: int = 0) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


@pytest.mark.parametrize("width", [8, 40, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operator_is_transformers_norm_and_a_rows_bits_do_not_depend_on_the_other_rows(width, dtype):
    norm = _norm(width, dtype)
    x = (torch.randn(1, 12, width, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = kernel(x, norm.weight, norm.variance_epsilon)
    assert got.shape == x.shape and got.dtype == dtype
    # One rounding of the sum of squares may differ (another order): a relative 1e-6 in float32, a bf16 step.
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got, want, **tolerance)
    for row in (0, 5, 11):
        assert torch.equal(kernel(x[:, row : row + 1].contiguous(), norm.weight, norm.variance_epsilon),
                           got[:, row : row + 1])


def test_the_operator_refuses_what_it_cannot_normalise():
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        kernel(torch.randn(4, 8).double(), weight.double(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        kernel(torch.randn(8, 4).t(), weight[:4], 1e-5)
    with pytest.raises(RuntimeError, match="weight must be 8"):
        kernel(torch.randn(4, 8), torch.ones(7), 1e-5)


def test_enable_swaps_the_norms_and_disable_swaps_them_back():
    model = tiny_ar_model(vocab_size=40).float()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = model(ids).logits
    cpu.enable(model)
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert norms and all(type(m).__name__ == "MeasuredLlamaRMSNorm" for m in norms)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    cpu.disable(model)
    assert all(type(m) is LlamaRMSNorm for m in norms) and not any("rms_norm_op" in m.__dict__ for m in norms)


def test_autograd_and_long_inputs_take_transformers_forward(monkeypatch):
    norm = _norm(16, torch.float32)
    plain = _norm(16, torch.float32)
    measured_norm.enable_norms(norm)  # a module of the listed classes is itself swapped
    calls = []
    monkeypatch.setattr(norm, "rms_norm_op", lambda *args: calls.append(1) or kernel(*args))
    x = torch.randn(2, 3, 16, requires_grad=True)
    norm(x).sum().backward()  # autograd records: transformers' forward, which it can differentiate
    assert not calls and norm.weight.grad is not None and x.grad is not None
    with torch.no_grad():
        long = torch.randn(1, measured_norm.MAX_NORM_ROWS + 1, 16)
        assert torch.equal(norm(long), plain(long)) and not calls
        norm(long[:, :4])
    assert calls == [1]


def test_greedy_tidar_with_the_norm_operator_equals_ar_in_float32(monkeypatch):
    model = train_counting_tidar(block_size=4, steps=150).float()
    cpu.enable(model)
    calls = []
    for module in model.modules():
        if "rms_norm_op" in module.__dict__:
            monkeypatch.setattr(module, "rms_norm_op", lambda *args: calls.append(1) or kernel(*args))
    assert_greedy_tidar_is_ar(model, max_new_tokens=20, drafts_accepted=True)
    assert calls


@pytest.mark.parametrize("model_type", sorted(TINY_BACKBONES))
def test_every_backbones_norms_take_the_operator_and_tidar_stays_ar(model_type):
    model = TidarForCausalLM.from_ar(tiny_ar_model(model_type, vocab_size=40).float(), block_size=4).eval()
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    cpu.enable(model)
    assert norms and all(type(m).__name__.startswith("Measured") for m in norms)  # Qwen3's q/k norms too
    assert_greedy_tidar_is_ar(model)

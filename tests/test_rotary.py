"""The rotary position embedding on the CPU operator library (``hf_tidar.cpu.rotary``): transformers' bits in float32
and bfloat16, taken through transformers' ``kernels`` hook by every backbone, transformers' function under autograd,
enabled and disabled with the measured path, greedy TiDAR still AR."""

import pytest
import torch
from toy import assert_greedy_tidar_is_ar, tiny_ar_model, train_counting_tidar
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.cpu.kernel import rotary_kernel
from hf_tidar.cpu.rotary import ROTARY_LAYER_NAME, enable_rotary
from hf_tidar.tiny import TINY_BACKBONES

kernel = rotary_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU operator library needs an x86 CPU and a compiler")


def _rows(batch: int, positions: int, heads: int, dtype: torch.dtype, seed: int, head_dim: int = 64):
    """transformers' layout: the projection's [batch, positions, heads, head_dim] seen as [batch, heads, ...]."""
    x = torch.randn(batch, positions, heads, head_dim, generator=torch.Generator().manual_seed(seed)) * 4
    return x.to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, positions, angle_batch", [(1, 1, 1), (1, 6, 1), (3, 5, 3), (3, 2, 1)])
def test_the_operator_has_transformers_bits(dtype, batch, positions, angle_batch):
    q, k = _rows(batch, positions, 9, dtype, 0), _rows(batch, positions, 3, dtype, 1)
    angles = torch.rand(angle_batch, positions, 32, generator=torch.Generator().manual_seed(2)) * 300
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = kernel(q, k, cos, sin)
    # Bit for bit: a product fused into the sum (one rounding instead of two) would show in float32.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape


def test_the_operator_refuses_what_it_cannot_rotate():
    q, k = _rows(1, 2, 4, torch.float32, 0), _rows(1, 2, 2, torch.float32, 1)
    cos = sin = torch.ones(1, 2, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel(q.double(), k.double(), cos.double(), sin.double())
    with pytest.raises(RuntimeError, match="the same batch, positions"):
        kernel(q, k[:, :, :1], cos, sin)
    with pytest.raises(RuntimeError, match="cos must be"):
        kernel(q, k, cos[:, :1], sin)
    with pytest.raises(RuntimeError, match="sin must be a CPU tensor of the query's dtype"):
        kernel(q, k, cos, sin.bfloat16())


def _rotary_funcs(model):
    return [m._kernel_funcs[ROTARY_LAYER_NAME] for m in model.modules() if ROTARY_LAYER_NAME in m.__dict__.get(
        "_kernel_funcs", {})]


def _count_calls(model, monkeypatch) -> list:
    calls = []
    for func in _rotary_funcs(model):
        monkeypatch.setattr(func, "rotary_op", lambda *args: calls.append(1) or kernel(*args))
    return calls


def test_enable_routes_the_rotary_hook_to_the_operator_and_disable_takes_it_back(monkeypatch):
    model = tiny_ar_model(vocab_size=40).float()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = model(ids).logits
    cpu.enable(model)
    funcs = _rotary_funcs(model)
    assert len(funcs) == model.config.num_hidden_layers and all("rotary_op" in f.__dict__ for f in funcs)
    calls = _count_calls(model, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers  # one call a layer
    cpu.disable(model)
    assert not any("rotary_op" in f.__dict__ or "forward" in f.__dict__ for f in funcs)


def test_autograd_takes_transformers_function(monkeypatch):
    model = tiny_ar_model(vocab_size=40).float()
    enable_rotary(model)
    calls = _count_calls(model, monkeypatch)
    model(torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss.backward()
    assert not calls and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_greedy_tidar_with_the_rotary_operator_equals_ar_in_bfloat16(monkeypatch):
    model = train_counting_tidar(block_size=4, steps=150).to(torch.bfloat16)
    cpu.enable(model)
    calls = _count_calls(model, monkeypatch)
    assert_greedy_tidar_is_ar(model, max_new_tokens=20, drafts_accepted=True)
    assert calls


@pytest.mark.parametrize("model_type", sorted(TINY_BACKBONES))
def test_every_backbones_attention_takes_the_operator_and_tidar_stays_ar(model_type, monkeypatch):
    model = TidarForCausalLM.from_ar(tiny_ar_model(model_type, vocab_size=40).float(), block_size=4).eval()
    cpu.enable(model)
    calls = _count_calls(model, monkeypatch)
    assert_greedy_tidar_is_ar(model)
    assert calls

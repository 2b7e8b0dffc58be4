"""A gated MLP's gate and up projections as one product with ``silu(gate) * up`` in the operator
(``hf_tidar.cpu.mlp``): the values of the two products and transformers' activation, a row's bits whatever the other
rows, the gated adapter's ``[MASK]`` rows in one sequence and in a batch, every backbone, greedy TiDAR still AR."""

import copy

import pytest
import torch
import torch.nn.functional as F
from toy import assert_greedy_tidar_is_ar, counting_batch, tiny_ar_model, train_counting_tidar

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.adapters import to_lean
from hf_tidar.cpu.kernel import (
    gated_bf16_tail_kernel,
    gated_linear_kernel,
    lora_codes_packer,
    packed_bf16_tail_kernel,
    packed_pair_kernel,
    packed_row_kernel,
)
from hf_tidar.cpu.mlp import _packed_factors, disable_gated_mlps, interleave_blocks
from hf_tidar.masks import tidar_training_layout
from hf_tidar.tiny import TINY_BACKBONES
from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter

kernel = gated_linear_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the gated product needs the CPU library (an x86 CPU with AVX2, FMA and F16C, and a compiler)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    packed_pair_kernel() is None, reason="bfloat16 products need the AVX-512 BF16 build"))]


def _products(dtype):
    """(pack, multiply, pack_lora_b) of the packed product for ``dtype``."""
    if dtype == torch.float32:
        pack, multiply = packed_row_kernel()
        return pack, multiply, pack
    return packed_pair_kernel()


def _tolerance(dtype):  # silu is the library's, not torch's: a few float32 ulps, one bfloat16 rounding
    return dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)


def _gated_case(dtype, rows: int, n: int, k: int, gate_rank: int, up_rank: int, seed: int, pack, pack_b):
    """Random ``x`` [rows, k], gate and up weights [n, k] and their LoRA factors (both ranks 0, or neither; the
    smaller rank padded with zeros to the larger, as the operator takes them), the pair packed together, and the
    factors packed as the operator takes them (``(None, None)`` at rank 0)."""
    g = torch.Generator().manual_seed(seed)
    gate, up, x = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (n, k), (rows, k)))
    factors = [torch.randn(*shape, generator=g).to(dtype)
               for shape in ((gate_rank, k), (n, gate_rank), (up_rank, k), (n, up_rank))]
    lora = (None, None)
    if gate_rank:
        lora = _packed_factors(*factors, lora_codes_packer(), pack_b)
        rank = max(gate_rank, up_rank)  # each factor at the common rank: a rank's codes have their own summation
        factors = [torch.cat([a, a.new_zeros(rank - a.shape[0], k)]) if i % 2 == 0
                   else torch.cat([a, a.new_zeros(n, rank - a.shape[1])], dim=1) for i, a in enumerate(factors)]
    return x, gate, up, factors, pack(interleave_blocks(gate, up).contiguous()), lora


def _alone(multiply, pack, pack_b, x, weight, a, b, tail: int):
    """One projection of ``x`` on its own packed product (``multiply``) with its own LoRA factors (none at rank 0)."""
    rank = a.shape[0]
    return multiply(x, pack(weight), weight.shape[0], None, lora_codes_packer()(a.contiguous()) if rank else None,
                    pack_b(b.contiguous()) if rank else None, tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_rank, up_rank", [(0, 0), (4, 4), (20, 3)])  # 20: two blocks of codes, 3 padded
@pytest.mark.parametrize("rows, tail", [(7, 4), (4, 2)])  # 4: a bfloat16 tile of six column blocks
def test_the_operator_is_silu_of_gate_times_up_and_a_rows_bits_do_not_depend_on_the_others(dtype, gate_rank, up_rank,
                                                                                           rows, tail):
    pack, multiply, pack_b = _products(dtype)
    n = 48
    x, gate, up, factors, packed, lora = _gated_case(dtype, rows, n, 40, gate_rank, up_rank, 0, pack, pack_b)
    got = kernel(x, packed, n, *lora, tail)
    want = (F.silu(_alone(multiply, pack, pack_b, x, gate, *factors[:2], tail))
            * _alone(multiply, pack, pack_b, x, up, *factors[2:], tail))
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    for row in range(rows):  # clean rows and tail rows, each alone
        one = kernel(x[row : row + 1].contiguous(), packed, n, *lora, 0 if row >= tail else 1)
        assert torch.equal(one, got[row : row + 1])


@pytest.mark.skipif(gated_bf16_tail_kernel() is None, reason="bfloat16 draft rows need the AVX-512 BF16 build")
@pytest.mark.parametrize("gate_rank, up_rank", [(0, 0), (20, 3)])
@pytest.mark.parametrize("rows, tail", [(12, 3), (7, 4), (16, 4), (14, 6), (9, 0), (5, 5)])  # 3 + 9 in one tile,
def test_draft_rows_in_bfloat16_are_the_bf16_tail_products_and_clean_rows_keep_their_bits(  # two tiles, 6 clean
        gate_rank, up_rank, rows, tail):
    pack, _, _ = _products(torch.float32)
    drafts, tail_product = gated_bf16_tail_kernel(), packed_bf16_tail_kernel()
    n = 48  # K = 41, odd: the last term in float32
    x, gate, up, factors, packed, lora = _gated_case(torch.float32, rows, n, 41, gate_rank, up_rank, rows, pack, pack)
    got = drafts(x, packed, n, *lora, tail)
    assert torch.equal(got[:tail], kernel(x, packed, n, *lora, tail)[:tail])
    gate_out = _alone(tail_product, pack, pack, x, gate, *factors[:2], tail)  # each projection's bfloat16-tail product
    up_out = _alone(tail_product, pack, pack, x, up, *factors[2:], tail)
    torch.testing.assert_close(got[tail:], (F.silu(gate_out) * up_out)[tail:], **_tolerance(torch.float32))
    assert not torch.equal(got[tail:], kernel(x, packed, n, *lora, tail)[tail:]) or tail == rows
    for row in range(tail, rows):  # a draft row's bits do not depend on the other rows
        assert torch.equal(drafts(x[row : row + 1].contiguous(), packed, n, *lora, 0), got[row : row + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_over_its_whole_range(dtype):
    # Identity weights make the gate and up outputs the inputs themselves: silu(x) * x for x across the polynomial's
    # range, the underflow below -87, zeros of both signs and large values; each element alike in a 16-lane block.
    pack, multiply, _ = _products(dtype)
    eye = torch.eye(32, dtype=dtype)
    packed = pack(interleave_blocks(eye, eye).contiguous())
    x = torch.cat([torch.linspace(-100, 100, 30 * 32 - 4), torch.tensor([0.0, -0.0, 3e4, -3e4])]).view(30, 32)
    x = x.to(dtype)
    got = kernel(x, packed, 32, None, None, 30)
    want = F.silu(x.float()).to(dtype).float() * x.float() if dtype == torch.bfloat16 else F.silu(x) * x
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **_tolerance(dtype))
    assert torch.equal(got[-1, [-4, -3, -1]].float(), torch.zeros(3))  # silu(0) * 0, and e^-30000 underflowed


def test_the_operator_refuses_an_output_count_off_the_blocks():
    pack, _, _ = _products(torch.float32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(torch.randn(2, 8), pack(torch.randn(24, 8)), 12, None, None, 2)


def _mlps(model):
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


def _count_calls(model, monkeypatch) -> list:
    calls = []
    for mlp in _mlps(model):
        if "gated_op" in mlp.__dict__:
            monkeypatch.setattr(mlp, "gated_op", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    return calls


def test_enable_swaps_the_mlps_and_disable_swaps_them_back(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = tiny_ar_model(vocab_size=40).float()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = model(ids).logits
    cpu.enable(model)
    mlps = _mlps(model)
    assert len(mlps) == model.config.num_hidden_layers
    assert all(type(m).__name__ == "MeasuredLlamaMLP" for m in mlps)
    calls = _count_calls(model, monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    assert calls == [5] * len(mlps)  # one product a layer, every row
    model(ids, labels=ids).loss.backward()  # autograd: transformers' forward, which it can differentiate
    assert calls == [5] * len(mlps) and all(m.gate_proj.weight.grad is not None for m in mlps)
    cpu.disable(model)
    assert all(type(m).__name__ == "LlamaMLP" and "gated_op" not in m.__dict__ for m in mlps)


def test_a_weight_changed_after_enable_is_packed_again(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = cpu.enable(tiny_ar_model(vocab_size=40).float())
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        model(ids)  # packs every gate/up pair
        for mlp in _mlps(model):
            mlp.up_proj.weight.mul_(-2.0)  # in place: the same tensor, a new version
        got = model(ids).logits
        cpu.disable(model)
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-4, atol=1e-5)


def _lean_adapter_model(dtype):
    """A tiny TiDAR model with a gated adapter that does something (PEFT starts B at zero), in its lean form."""
    ar = tiny_ar_model("llama", vocab_size=32, seed=0)
    torch.manual_seed(1)
    peft = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=4), gated_lora_config(rank=4))
    for name, param in peft.named_parameters():
        if "lora_B" in name or "lora_embedding_A" in name:
            param.data.normal_(0, 0.5)
    return to_lean(peft.eval()).eval().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_lean_adapters_mask_rows_in_one_sequence_and_in_a_batch(dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    fused = cpu.enable(_lean_adapter_model(dtype))
    separate = copy.deepcopy(fused)
    disable_gated_mlps(separate)
    calls = _count_calls(fused, monkeypatch)
    ids = counting_batch(2, 8, 32, torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # a left-padded row
    x = torch.cat([ids, torch.full_like(ids, fused.config.mask_token_id)], dim=1)
    layout = tidar_training_layout(attention, 4)
    with torch.no_grad():
        batch = fused.structured_hidden_states(x, layout, mask_tail_start=8)
        assert calls and all(rows == 32 for rows in calls)  # one product of both sequences a layer
        torch.testing.assert_close(batch, separate.structured_hidden_states(x, layout, mask_tail_start=8),
                                   **(_tolerance(dtype) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)))
        for row in range(2):
            alone = fused.structured_hidden_states(x[row : row + 1], tidar_training_layout(attention[row : row + 1], 4),
                                                   mask_tail_start=8)
            assert torch.equal(batch[row], alone[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tidar_with_the_gated_product_equals_ar(dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = cpu.enable(train_counting_tidar(block_size=4, steps=150).to(dtype))
    calls = _count_calls(model, monkeypatch)
    assert_greedy_tidar_is_ar(model, max_new_tokens=20, drafts_accepted=True)
    assert calls


@pytest.mark.parametrize("model_type", sorted(TINY_BACKBONES))
def test_every_backbones_mlps_take_the_operator_and_tidar_stays_ar(model_type, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = TidarForCausalLM.from_ar(tiny_ar_model(model_type, vocab_size=40).float(), block_size=4).eval()
    cpu.enable(model)
    assert _mlps(model) and all(type(m).__name__.startswith("Measured") for m in _mlps(model))
    calls = _count_calls(model, monkeypatch)
    assert_greedy_tidar_is_ar(model)
    assert calls

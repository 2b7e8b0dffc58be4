"""An attention module's q, k and v projections as one product (``hf_tidar.cpu.qkv``): each output's bits equal its
own packed product's, one product a layer, the gated adapter's ``[MASK]`` rows in one sequence and in a batch, every
backbone (Qwen2's biases, Qwen3's norms), the linears' own forward wherever the product does not run, greedy TiDAR
still AR."""

import copy

import pytest
import torch
from test_gated_mlp import DTYPES, _lean_adapter_model, assert_each_sequence_alone_is_its_batch_row, masked_batch
from toy import assert_greedy_tidar_is_ar, tiny_ar_model, train_counting_tidar

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.cpu.kernel import packed_row_kernel
from hf_tidar.cpu.qkv import PROJECTIONS, disable_shared_qkv, has_shared_qkv
from hf_tidar.generation.cost_profile import profile_key
from hf_tidar.masks import tidar_training_layout
from hf_tidar.tiny import TINY_BACKBONES

pytestmark = pytest.mark.skipif(packed_row_kernel() is None,
                                reason="the shared product needs the packed linears of an AVX-512 build")


def _attentions(model):
    return [m for m in model.modules() if all(hasattr(m, name) for name in PROJECTIONS)]


def _count_products(model, monkeypatch) -> tuple[list, list]:
    """Rows of every shared product, and every call of a projection's own packed product, from now on."""
    shared, own = [], []
    for attention in _attentions(model):
        group = attention.q_proj.__dict__.get("shared_qkv")
        if group is not None:
            multiply = group.multiply
            monkeypatch.setattr(group, "multiply", lambda *a, f=multiply: shared.append(a[0].shape[0]) or f(*a))
        for name in PROJECTIONS:
            module = getattr(attention, name)
            product = module.__dict__["exact_op"]
            monkeypatch.setitem(module.__dict__, "exact_op",
                                lambda *a, f=product, n=name: own.append(n) or f(*a))
    return shared, own


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_product_a_layer_with_each_projections_own_bits(dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    shared = cpu.enable(tiny_ar_model(vocab_size=40).to(dtype))
    separate = copy.deepcopy(shared)
    disable_shared_qkv(separate)
    assert has_shared_qkv(shared) and not has_shared_qkv(separate)
    attentions = _attentions(shared)
    assert len(attentions) == shared.config.num_hidden_layers
    assert all(type(getattr(a, n)).__name__ == "SharedQkvMeasuredLinear" for a in attentions for n in PROJECTIONS)
    products, own = _count_products(shared, monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])
    with torch.no_grad():
        got = shared(ids).logits
        assert torch.equal(got, separate(ids).logits)  # every output column: its own product's bits
    assert products == [10] * len(attentions) and own == []  # one product a layer, of both sequences' rows
    x = torch.randn(1, 3, shared.config.hidden_size).to(dtype)
    with torch.no_grad():  # k_proj on another input than q_proj's last: its own product
        assert torch.equal(attentions[0].k_proj(x), _attentions(separate)[0].k_proj(x))
    assert own == ["k_proj"]


def test_autograd_and_a_changed_weight_take_the_linears_own_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = cpu.enable(tiny_ar_model(vocab_size=40).float())
    products, _ = _count_products(model, monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    model(ids, labels=ids).loss.backward()  # autograd: the linears' own forward, which it can differentiate
    assert products == [] and all(a.v_proj.weight.grad is not None for a in _attentions(model))
    with torch.no_grad():
        model(ids)  # packs the stacked weights
        for attention in _attentions(model):
            attention.k_proj.weight.mul_(-2.0)  # in place: the same tensor, a new version
        got = model(ids).logits
        cpu.disable(model)
        assert all(type(getattr(a, n)) is torch.nn.Linear for a in _attentions(model) for n in PROJECTIONS)
        assert not any("shared_qkv" in getattr(a, n).__dict__ for a in _attentions(model) for n in PROJECTIONS)
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_lean_adapters_mask_rows_in_one_sequence_and_in_a_batch(dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    shared = cpu.enable(_lean_adapter_model(dtype))
    separate = copy.deepcopy(shared)
    disable_shared_qkv(separate)
    assert all(type(a.q_proj).__name__ == "SharedQkvTailLoraLinear" for a in _attentions(shared))
    products, own = _count_products(shared, monkeypatch)
    x, attention = masked_batch(shared.config.mask_token_id)
    layout = tidar_training_layout(attention, 4)
    off = copy.deepcopy(separate)  # the adapter's update of the [MASK] rows zeroed
    for module in off.modules():
        if "lora_b" in module._buffers:
            module.lora_b.zero_()
    with torch.no_grad():
        batch = shared.structured_hidden_states(x, layout, mask_tail_start=8)
        assert products == [32] * len(_attentions(shared)) and own == []
        assert torch.equal(batch, separate.structured_hidden_states(x, layout, mask_tail_start=8))
        assert not torch.equal(batch[:, 8:], off.structured_hidden_states(x, layout, mask_tail_start=8)[:, 8:])
        assert_each_sequence_alone_is_its_batch_row(shared, batch, x, attention)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tidar_with_the_shared_product_equals_ar(dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = cpu.enable(train_counting_tidar(block_size=4, steps=150).to(dtype))
    products, _ = _count_products(model, monkeypatch)
    assert_greedy_tidar_is_ar(model, max_new_tokens=20, drafts_accepted=True)
    assert products


@pytest.mark.parametrize("model_type", sorted(TINY_BACKBONES))
def test_every_backbone_takes_the_shared_product_with_its_own_bits(model_type, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    shared = cpu.enable(TidarForCausalLM.from_ar(tiny_ar_model(model_type, vocab_size=40).float(), block_size=4).eval())
    separate = copy.deepcopy(shared)
    disable_shared_qkv(separate)
    products, own = _count_products(shared, monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(shared(ids).logits, separate(ids).logits)
    assert len(products) == len(_attentions(shared)) > 0 and own == []
    assert_greedy_tidar_is_ar(shared)


def test_a_changed_factor_is_stacked_again(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    shared = cpu.enable(_lean_adapter_model(torch.float32))
    x = torch.cat([torch.tensor([[3, 4, 5, 6]]), torch.full((1, 4), shared.config.mask_token_id)], dim=1)
    with torch.no_grad():
        shared(x)  # stacks every factor
        for attention in _attentions(shared):
            attention.v_proj.lora_b.mul_(3.0)
            attention.v_proj.__dict__.pop("kernel_factors", None)  # the factors themselves, as the kernel takes them
        got = shared(x).logits
        disable_shared_qkv(shared)
        assert torch.equal(got, shared(x).logits)


def test_the_profile_key_says_whether_passes_take_the_shared_product(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = cpu.enable(TidarForCausalLM.from_ar(tiny_ar_model(vocab_size=40).float(), block_size=4).eval())
    with_shared = profile_key(model)
    disable_shared_qkv(model)
    assert profile_key(model) != with_shared and with_shared.endswith("-shared-qkv")

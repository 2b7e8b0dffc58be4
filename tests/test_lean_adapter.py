"""The gated adapter's lean inference form: the same drafts as PEFT's gated form, clean rows untouched."""

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar import cpu
from hf_tidar.adapters import TailLoraLinear, is_lean, to_lean
from hf_tidar.adapters import lean as lean_module
from hf_tidar.cpu import linear as cpu_linear
from hf_tidar.cpu.kernel import few_row_kernel
from hf_tidar.cpu.mlp import disable_gated_mlps
from hf_tidar.masks import tidar_training_layout
from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model, tidar_base_for_adapter

VOCAB, BLOCK = 32, 4


def _gated_pair(dtype=torch.float64, seed=0):
    """A gated PEFT model with non-zero adapters, its lean twin (same weights), and the adapter-free base."""
    ar = tiny_ar_model("llama", vocab_size=VOCAB, seed=seed)
    base = tidar_base_for_adapter(ar, block_size=BLOCK).eval()
    models = []
    for _ in range(2):
        torch.manual_seed(seed + 1)  # both twins get the same adapter weights
        peft = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=4))
        for name, param in peft.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                param.data.normal_(0, 0.5)  # PEFT starts B at zero: make the adapter do something
        models.append(peft.eval())
    lean = to_lean(models[1]).eval()
    return models[0].to(dtype), lean.to(dtype), base.to(dtype)


def _every_product_on_the_kernel(model, tmp_path, monkeypatch) -> None:
    """``cpu.enable(model)`` with every row count of every linear on the few-row kernel, whatever the (short)
    profile measured."""
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "COLD_BYTES", 1 << 16)
    cpu.enable(model)
    for module in model.modules():
        if getattr(module, "choices", None):
            module.choices = [cpu_linear.Choice("few_rows", n + 1) for n in range(len(module.choices))]


def _doubled(ids, mask_id):
    return torch.cat([ids, torch.full_like(ids, mask_id)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_rows_match_peft_and_clean_rows_are_the_base_models(dtype):
    peft, lean, base = _gated_pair(dtype)
    ids = counting_batch(3, 10, VOCAB, torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # a left-padded row
    x = _doubled(ids, lean.config.mask_token_id)
    layout = tidar_training_layout(attention, BLOCK)
    with torch.no_grad():
        want = peft.base_model.model.structured_hidden_states(x, layout)
        got = lean.structured_hidden_states(x, layout)
        found = lean.structured_hidden_states(x, layout, mask_tail_start=ids.shape[1])
        clean = base.structured_hidden_states(x, layout)
    assert torch.equal(got, found)
    assert torch.equal(got[:, : ids.shape[1]], clean[:, : ids.shape[1]])  # bit for bit
    masks = slice(ids.shape[1], None)
    if dtype == torch.float32:
        torch.testing.assert_close(got[:, masks], want[:, masks], rtol=1e-4, atol=1e-5)
    # bf16 rounds the LoRA product in another order: the gap must be small next to the adapter's effect.
    gap = (got[:, masks].float() - want[:, masks].float()).norm()
    effect = (want[:, masks].float() - clean[:, masks].float()).norm()
    assert gap < 0.05 * effect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_kernel_the_update_is_fused_and_clean_rows_stay_the_base_models(dtype, tmp_path, monkeypatch):
    if few_row_kernel(dtype) is None:
        pytest.skip(f"no few-row kernel for {dtype} here (float32: AVX2 + FMA; bfloat16: AVX-512 BF16; a compiler)")
    peft, lean, base = _gated_pair(dtype)
    for model in (lean, base):
        _every_product_on_the_kernel(model, tmp_path, monkeypatch)
    fused = []
    original = cpu_linear.few_rows_lora_forward

    def spy(*args):
        out = original(*args)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(lean_module, "few_rows_lora_forward", spy)
    ids = counting_batch(1, 10, VOCAB, torch.Generator().manual_seed(1))
    x = _doubled(ids, lean.config.mask_token_id)
    layout = tidar_training_layout(torch.ones_like(ids), BLOCK)
    with torch.no_grad():
        want = peft.base_model.model.structured_hidden_states(x, layout)
        got = lean.structured_hidden_states(x, layout)
        clean = base.structured_hidden_states(x, layout)
    assert fused and all(fused)
    assert torch.equal(got[:, :10], clean[:, :10])  # bit for bit
    if dtype == torch.float32:
        torch.testing.assert_close(got[:, 10:], want[:, 10:], rtol=1e-4, atol=1e-5)
    gap = (got[:, 10:].float() - want[:, 10:].float()).norm()  # bf16: the same rounding bound as off the kernel
    assert gap < 0.05 * (want[:, 10:].float() - clean[:, 10:].float()).norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_passs_short_path_makes_one_kernel_call_per_linear_with_the_bits_of_the_checked_path(dtype, tmp_path,
                                                                                              monkeypatch):
    if few_row_kernel(dtype) is None:
        pytest.skip(f"no few-row kernel for {dtype} here (float32: AVX2 + FMA; bfloat16: AVX-512 BF16; a compiler)")
    _, lean, _ = _gated_pair(dtype)
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    cpu.enable(lean)
    disable_gated_mlps(lean)  # every linear on its own (tests/test_gated_mlp.py has the MLPs' one product)
    adapted = [m for m in lean.modules() if isinstance(m, lean_module.TailLoraLinear)]
    assert adapted and all(m.__dict__.get("exact_op") is not None for m in adapted)
    calls = []
    for module in adapted:  # count the calls that take the short path, with LoRA factors
        op = module.exact_op
        module.exact_op = lambda x, w, b, a, f, tail, op=op: calls.append((x.shape[0], tail, a is not None)) or op(
            x, w, b, a, f, tail)
    ids = counting_batch(1, 10, VOCAB, torch.Generator().manual_seed(1))
    x = _doubled(ids, lean.config.mask_token_id)
    layout = tidar_training_layout(torch.ones_like(ids), BLOCK)
    with torch.no_grad():
        short = lean.structured_hidden_states(x, layout, mask_tail_start=10)
        assert calls == [(20, 10, True)] * len(adapted)
        for module in adapted:
            del module.exact_op  # the checked path: the plan, the weight's dtype, the kernel
        checked = lean.structured_hidden_states(x, layout, mask_tail_start=10)
    assert torch.equal(short, checked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_takes_one_fused_call_per_linear_and_each_sequence_keeps_its_own_bits(dtype, tmp_path, monkeypatch):
    """A batch's [MASK] rows are a tail of each sequence, not of the batch: the kernel takes every sequence's clean
    rows and then every [MASK] row in one call, and each sequence's states are bit for bit those it gets alone."""
    if few_row_kernel(dtype) is None:
        pytest.skip(f"no few-row kernel for {dtype} here (float32: AVX2 + FMA; bfloat16: AVX-512 BF16; a compiler)")
    _, lean, _ = _gated_pair(dtype)
    _every_product_on_the_kernel(lean, tmp_path, monkeypatch)
    disable_gated_mlps(lean)  # every linear on its own (tests/test_gated_mlp.py has the MLPs' one product)
    calls = []
    original = cpu_linear.few_rows_lora_forward

    def spy(module, x, tail_start):
        out = original(module, x, tail_start)
        calls.append((x.shape[-2], tail_start, out is not None))
        return out

    monkeypatch.setattr(lean_module, "few_rows_lora_forward", spy)
    ids = counting_batch(2, 8, VOCAB, torch.Generator().manual_seed(1))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # a left-padded row
    x = _doubled(ids, lean.config.mask_token_id)
    with torch.no_grad():
        batch = lean.structured_hidden_states(x, tidar_training_layout(attention, BLOCK), mask_tail_start=8)
        assert calls and all(call == (32, 16, True) for call in calls)  # 2 x (8 clean + 8 [MASK]) rows, one call
        for row in range(2):
            alone = lean.structured_hidden_states(x[row : row + 1], tidar_training_layout(attention[row : row + 1], BLOCK),
                                                  mask_tail_start=8)
            assert torch.equal(batch[row], alone[0])


def test_factors_with_float16_values_reach_the_kernel_in_float16_and_change_no_bit(tmp_path, monkeypatch):
    """cpu.enable hands the kernel float16 copies of factors that float16 holds exactly (an exported adapter's),
    and keeps float32 factors that it does not hold (an adapter fresh from float32 training)."""
    from hf_tidar.cpu.kernel import kernel_takes_half_factors

    if few_row_kernel(torch.float32) is None or not kernel_takes_half_factors():
        pytest.skip("float16 factors need the kernel's AVX-512 build")
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    _, exported, _ = _gated_pair(torch.float32)
    _, fresh, _ = _gated_pair(torch.float32)
    for module in exported.modules():  # as if loaded from a float16 export
        if isinstance(module, TailLoraLinear):
            module.lora_a, module.lora_b = module.lora_a.half().float(), module.lora_b.half().float()
    cpu.enable(exported)
    cpu.enable(fresh)
    linears = [m for m in exported.modules() if isinstance(m, TailLoraLinear)]
    assert linears and all(m.kernel_factors[0].dtype == torch.float16 for m in linears)
    assert not any("kernel_factors" in m.__dict__ for m in fresh.modules())
    ids = counting_batch(1, 10, VOCAB, torch.Generator().manual_seed(1))
    x = _doubled(ids, exported.config.mask_token_id)
    layout = tidar_training_layout(torch.ones_like(ids), BLOCK)
    with torch.no_grad():
        half = exported.structured_hidden_states(x, layout)
        for module in linears:
            del module.kernel_factors
        single = exported.structured_hidden_states(x, layout)
    assert torch.equal(half, single)
    cpu.disable(exported)
    assert not any("kernel_factors" in m.__dict__ for m in exported.modules())


@pytest.mark.parametrize("packed", [False, True])
def test_bfloat16_drafts_take_their_factors_and_leave_clean_rows_alone(packed, tmp_path, monkeypatch):
    from hf_tidar.cpu.kernel import few_row_bf16_tail_kernel, packed_bf16_tail_kernel

    if few_row_bf16_tail_kernel() is None or (packed and packed_bf16_tail_kernel() is None):
        pytest.skip("bfloat16 drafts need the kernel's AVX-512 BF16 build")
    peft, lean, base = _gated_pair(torch.float32)
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "COLD_BYTES", 1 << 16)
    cpu.enable(base, packed=packed)  # float32 drafts on the same products: the bits clean rows must keep
    cpu.enable(lean, draft_dtype=torch.bfloat16, packed=packed)
    q_proj = lean.model.layers[0].self_attn.q_proj
    lora_a = q_proj.draft_factors[0]
    if packed:  # the packed operator takes the clean product's factors (float32, or exact float16 ones)
        assert torch.equal(lora_a.float(), q_proj.lora_a)
    else:  # the unpacked one takes bfloat16 factors
        assert lora_a.dtype == torch.bfloat16 and torch.equal(lora_a, q_proj.lora_a.bfloat16())
    ids = counting_batch(1, 10, VOCAB, torch.Generator().manual_seed(1))
    x = _doubled(ids, lean.config.mask_token_id)
    layout = tidar_training_layout(torch.ones_like(ids), BLOCK)
    with torch.no_grad():
        want = peft.base_model.model.structured_hidden_states(x, layout)
        got = lean.structured_hidden_states(x, layout, mask_tail_start=10)
        clean = base.structured_hidden_states(x, layout)
    assert torch.equal(got[:, :10], clean[:, :10])  # bit for bit
    assert not torch.equal(got[:, 10:], want[:, 10:])  # the drafts did go through bfloat16 ...
    gap = (got[:, 10:] - want[:, 10:]).norm()  # ... and differ from float32 ones by rounding only
    assert gap < 0.05 * (want[:, 10:] - clean[:, 10:]).norm()
    prompts = counting_batch(1, 7, VOCAB, torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(lean.generate(prompts, strategy="tidar", draft_length=3, **settings),
                           lean.generate(prompts, **settings))


@pytest.mark.parametrize("draft_length,groups", [(4, None), (3, [1]), (2, None), (4, [1, 3])])
@pytest.mark.parametrize("measured", [False, True])
def test_tidar_generate_is_the_same_with_lean_and_peft_adapters(draft_length, groups, measured, tmp_path, monkeypatch):
    peft, lean, base = _gated_pair(torch.float64)
    if measured:
        monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
        monkeypatch.setattr(cpu_linear, "COLD_BYTES", 1 << 16)  # a short profile
        lean = cpu.enable(lean.float())
        peft = peft.float()
    prompts = counting_batch(2, 7, VOCAB, torch.Generator().manual_seed(2))
    attention = torch.ones_like(prompts)
    attention[0, :2] = 0
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=attention,
                    strategy="tidar", draft_length=draft_length, draft_groups=groups, return_dict_in_generate=True)
    with torch.no_grad():
        want = peft.generate(prompts, **settings)
        got = lean.generate(prompts, **settings)
        ar = lean.generate(prompts, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=attention)
    assert torch.equal(got.sequences, ar)
    assert got.accepted_lengths == want.accepted_lengths  # the same drafts were proposed and accepted
    if not measured:
        assert torch.equal(got.sequences, want.sequences)


def test_lean_form_is_plain_tidar_model_with_base_state_dict():
    peft, lean, base = _gated_pair(torch.float32)
    assert is_lean(lean) and not hasattr(lean, "peft_config")
    assert isinstance(lean.model.layers[0].self_attn.q_proj, TailLoraLinear)
    assert lean.state_dict().keys() == base.state_dict().keys()
    lean.to(torch.bfloat16)  # the adapter factors follow the model's dtype
    assert lean.model.layers[0].self_attn.q_proj.lora_a.dtype == torch.bfloat16


def test_mask_token_outside_the_tail_is_refused():
    _, lean, _ = _gated_pair(torch.float32)
    ids = torch.tensor([[1, 2, lean.config.mask_token_id, 3]])
    with pytest.raises(ValueError, match="tail of the query"):
        with torch.no_grad():
            lean(input_ids=ids)

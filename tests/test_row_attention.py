"""The row-invariant CPU attention (``tidar_cpu``): sdpa's values, bits that do not depend on the call, and
what it buys: greedy TiDAR equal to greedy AR in bfloat16 on the measured CPU path."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from toy import tiny_ar_model, train_counting_tidar

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.cpu import attention as row_attention
from hf_tidar.cpu import linear as measured
from hf_tidar.cpu.kernel import kernel_dtypes, row_attention_kernel

kernel = row_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU operator library needs an x86 CPU and a compiler")
bf16_kernel = torch.bfloat16 in kernel_dtypes()
needs_bf16_kernel = pytest.mark.skipif(not bf16_kernel, reason="bfloat16 rows on the kernel need its AVX-512 BF16 build")
DTYPES = [torch.float32, torch.bfloat16]


def _tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _inputs(dtype, batch=2, heads=9, kv_heads=3, queries=5, keys=20, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [32, 64, 128, 24])  # the 16-keys-at-a-time builds and the scalar path
# query heads per key/value head: the value sums take up to 4 heads at a time (2 at dim 128)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (7, 1), (2, 2)])
def test_values_are_sdpas(dtype, dim, heads, kv_heads):
    q, k, v = _inputs(dtype, heads=heads, kv_heads=kv_heads, dim=dim)
    mask = torch.rand(2, 1, 5, 20, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 3] = True
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    got = kernel(q, k, v, mask, dim**-0.5)
    assert got.shape == (2, 5, heads, dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.transpose(1, 2), **_tolerance(dtype))
    causal = torch.ones(5, 20, dtype=torch.bool).tril(15)  # no mask: row t sees keys up to t + S - T
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(kernel(q, k, v, None, dim**-0.5).float(), want.transpose(1, 2), **_tolerance(dtype))


def test_a_row_that_sees_nothing_is_zero_and_bad_inputs_are_refused():
    q, k, v = _inputs(torch.float32)
    mask = torch.ones(1, 1, 5, 20, dtype=torch.bool)
    mask[..., 2, :] = False  # a padding row
    out = kernel(q, k, v, mask, 0.125)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])) and out[:, 1].abs().sum() > 0
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        kernel(q[:, :8], k[:, :3], v[:, :3], None, 0.125)
    with pytest.raises(RuntimeError, match="bool"):
        kernel(q, k, v, mask.float(), 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(q, k.double(), v, None, 0.125)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128, 24])
def test_a_rows_bits_depend_only_on_the_keys_it_sees(dtype, dim):
    # A TiDAR pass: row i is draft d_i over the cache and d_0..d_i; later drafts' keys and mask groups'
    # rows are in the call too. The same token in an AR step: one row over exactly those keys.
    q, k, v = _inputs(dtype, batch=1, queries=7, keys=40, dim=dim)
    cache = 33
    mask = torch.zeros(1, 1, 7, 40, dtype=torch.bool)
    mask[..., :cache] = True
    mask[0, 0, 4:, cache + 2 :] = True  # rows 4-6: a mask group that sees later keys, not a prefix
    for i in range(4):
        mask[0, 0, i, cache : cache + i + 1] = True
    together = kernel(q, k, v, mask, dim**-0.5)
    for i in range(4):
        n = cache + i + 1
        alone = kernel(q[:, :, i : i + 1].contiguous(), k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), None,
                       dim**-0.5)
        assert torch.equal(together[:, i], alone[:, 0])


def test_the_backend_falls_back_to_sdpa_where_the_operator_does_not_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(row_attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or ("sdpa", None))
    module = torch.nn.Module()
    q, k, v = _inputs(torch.float32, batch=1, queries=5, keys=9)
    out, _ = row_attention.row_attention_forward(module, q, k, v, None)  # a decoding call: over cached keys
    one, _ = row_attention.row_attention_forward(module, q[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    assert torch.is_tensor(out) and torch.is_tensor(one) and not calls
    for args in [dict(attention_mask=torch.zeros(1, 1, 5, 9)),  # an additive float mask
                 dict(attention_mask=None, dropout=0.1)]:
        row_attention.row_attention_forward(module, q, k, v, **args)
    row_attention.row_attention_forward(module, q, k[:, :, :5], v[:, :, :5], None)  # a prefill: no cache yet
    monkeypatch.setattr(row_attention, "MAX_QUERY", 4)  # a query longer than the operator takes
    row_attention.row_attention_forward(module, q, k, v, None)
    monkeypatch.setattr(row_attention, "MAX_QUERY", 512)
    row_attention.row_attention_forward(module, q.requires_grad_(), k, v, None)  # training
    assert len(calls) == 5


def test_enable_switches_from_sdpa_only_and_disable_switches_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama").float(), block_size=2)
    cpu.enable(model)
    assert model.model.config._attn_implementation == row_attention.ATTN_IMPLEMENTATION
    cpu.disable(model)
    assert model.model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    cpu.enable(model)  # a backend the user chose stays
    assert model.model.config._attn_implementation == "eager"
    cpu.disable(model)
    cpu.enable(model.set_attn_implementation("sdpa") or model, attention=False)
    assert model.model.config._attn_implementation == "sdpa"


def _generate_both(model, prompts, attention_mask=None, draft_length=3, new=28):
    settings = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                    attention_mask=attention_mask)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ar = model.generate(prompts, **settings)
        tidar = model.generate(prompts, strategy="tidar", draft_length=draft_length, return_dict_in_generate=True,
                               **settings)
    assert not [w for w in caught if "rounds differently" in str(w.message)]  # on this path it does not
    return ar, tidar


@needs_bf16_kernel
def test_bf16_tidar_equals_ar_bit_for_bit_on_the_measured_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)
    # An untrained model: its logits tie often in bf16, so any rounding that depends on the pass shows.
    random = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=4).float(), block_size=4)
    counting = train_counting_tidar(block_size=4, steps=150)  # drafts largely right: acceptance is exercised
    g = torch.Generator().manual_seed(0)
    for model in (random, counting):
        model = model.to(torch.bfloat16).eval()
        with pytest.warns(UserWarning, match="rounds differently"):  # off the path, greedy bf16 may differ
            model.generate(torch.tensor([[1, 2, 3]]), strategy="tidar", max_new_tokens=2, do_sample=False)
        model = cpu.enable(model)
        assert cpu.rows_are_call_invariant(model) and not cpu.rows_are_call_invariant(model, measured.MAX_ROWS + 1)
        accepted = 0
        for length in range(3, 40, 3):
            prompt = torch.randint(0, 30, (1, length), generator=g)
            ar, tidar = _generate_both(model, prompt)
            assert torch.equal(tidar.sequences, ar), f"prompt of {length} tokens"
            accepted += ar.shape[1] - length > tidar.forward_passes[0] + 1
        prompts = torch.randint(1, 30, (3, 12), generator=g)
        attention = torch.ones_like(prompts)
        attention[0, :5] = 0
        attention[2, :2] = 0
        ar, tidar = _generate_both(model, prompts, attention)  # left-padded rows, holes in TiDAR's cache
        assert torch.equal(tidar.sequences, ar)
        assert model is random or accepted >= 10


@pytest.mark.skipif(bf16_kernel, reason="this CPU multiplies bfloat16 on the kernel (tested above)")
def test_without_the_bf16_kernel_bf16_passes_are_not_call_invariant_and_greedy_tidar_warns(tmp_path, monkeypatch):
    # On a CPU without AVX-512 BF16 (AVX2 only) the measured path runs bfloat16 on torch's products, whose rounding
    # depends on the row count: the path must not claim exactness, and generate must say so.
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)
    model = cpu.enable(TidarForCausalLM.from_ar(tiny_ar_model("llama").float(), block_size=4).to(torch.bfloat16).eval())
    assert not cpu.rows_are_call_invariant(model)
    with pytest.warns(UserWarning, match="rounds differently"):
        model.generate(torch.tensor([[1, 2, 3]]), strategy="tidar", max_new_tokens=2, do_sample=False)


@needs_bf16_kernel
def test_a_pass_longer_than_the_kernel_takes_is_warned_about(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama").float(), block_size=8).to(torch.bfloat16).eval()
    cpu.enable(model)
    settings = dict(strategy="tidar", max_new_tokens=2, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(torch.tensor([[1, 2, 3]]), draft_length=5, **settings)  # 5 + 25 rows: on the kernel
    assert not [w for w in caught if "rounds differently" in str(w.message)]
    with pytest.warns(UserWarning, match="rounds differently"):  # 6 + 36 rows: past the kernel's 32
        model.generate(torch.tensor([[1, 2, 3]]), draft_length=6, **settings)

"""Drafts in bfloat16 under float32 weights: the [MASK] rows of a pass multiplied in bfloat16 on the CPU kernel,
the clean rows bit for bit as before, so TiDAR output stays exactly AR's."""

import copy
import shutil

import pytest
import torch
from toy import tiny_ar_model, train_counting_tidar

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.adapters import is_lean
from hf_tidar.bench import BenchConfig, Models, default_prompts
from hf_tidar.bench import tiny_ar_model as tiny_byte_model
from hf_tidar.bench.methods import build_methods
from hf_tidar.cpu import linear as measured
from hf_tidar.cpu.kernel import few_row_bf16_tail_kernel, few_row_kernel, supported_isas
from hf_tidar.generation.cost_profile import profile_key

needs_bf16_kernel = pytest.mark.skipif(
    "avx512_bf16" not in supported_isas() or shutil.which("c++") is None,
    reason="bfloat16 drafts need the kernel's AVX-512 BF16 build (and a C++ compiler)",
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies for a draft row: the first K - K mod 32 columns in bfloat16, the rest float32."""
    cut = t.shape[-1] - t.shape[-1] % 32
    return torch.cat([t[..., :cut].bfloat16().float(), t[..., cut:]], dim=-1)


@needs_bf16_kernel
@pytest.mark.parametrize("in_features", [8, 64, 100, 577])
@pytest.mark.parametrize("out_features", [1, 3, 7, 50])
def test_tail_rows_are_bfloat16_products_and_clean_rows_keep_their_bits(in_features, out_features):
    plain, drafts = few_row_kernel(torch.float32), few_row_bf16_tail_kernel()
    torch.manual_seed(out_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    lora_a, lora_b = torch.randn(5, in_features) * 0.1, torch.randn(out_features, 5) * 0.1
    for rows in (1, 2, 5, 9, 13):
        x = torch.randn(rows, in_features)
        for tail in sorted({0, rows // 2, rows - 1, rows}):  # tails inside a row tile and at its edges
            for factors in ((None, None), (lora_a, lora_b)):
                got = drafts(x, weight, bias, *(f if f is None else f.bfloat16() for f in factors), tail)
                want = plain(x, weight, bias, *factors, tail)
                assert torch.equal(got[:tail], want[:tail])  # clean rows: the float32 kernel's bits
                expected = _rounded(x[tail:]) @ _rounded(weight).t() + bias
                if factors[0] is not None:  # the low-rank codes from bfloat16 inputs and factors
                    codes = x[tail:].bfloat16().float() @ lora_a.bfloat16().float().t()
                    expected += codes @ lora_b.bfloat16().float().t()
                torch.testing.assert_close(got[tail:], expected, rtol=1e-4, atol=1e-4)
    x = torch.randn(6, 577)
    weight = torch.randn(50, 577)
    assert not torch.equal(drafts(x, weight, None, None, None, 0), plain(x, weight, None, None, None, 0))


def _count_draft_calls(monkeypatch, packed: bool) -> list[int]:
    """Spy on the draft operator cpu.enable installs (on packed weights or not): the tail start of every call."""
    starts = []
    name = "packed_bf16_tail_kernel" if packed else "few_row_bf16_tail_kernel"
    real = getattr(measured, name)()

    def spy(*args):
        starts.append(args[-1])
        return real(*args)

    monkeypatch.setattr(measured, name, lambda: spy)
    return starts


@needs_bf16_kernel
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("draft_length,groups", [(4, None), (3, None), (3, [1]), (2, [1])])
def test_greedy_tidar_with_bfloat16_drafts_is_ar_token_for_token(draft_length, groups, packed, monkeypatch):
    model = train_counting_tidar(block_size=4, steps=150).float()  # drafts largely right: many are accepted
    starts = _count_draft_calls(monkeypatch, packed)
    cpu.enable(model, draft_dtype=torch.bfloat16, packed=packed)
    assert cpu.linear.draft_dtype_of(model) == torch.bfloat16 and not is_lean(model)
    assert measured.is_packed(model) == packed
    prompts = torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]])
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        for rows in (prompts[:1], prompts):  # one sequence (bfloat16 tail) and a batch (float32 fallback)
            ar = model.generate(rows, **settings)
            out = model.generate(rows, strategy="tidar", draft_length=draft_length, draft_groups=groups,
                                 return_dict_in_generate=True, **settings)
            assert torch.equal(out.sequences, ar)
            assert out.sequences.shape[1] - rows.shape[1] > out.forward_passes[0] + 1  # drafts were accepted
    mask_rows = draft_length * (len(groups) if groups else draft_length)
    if mask_rows >= measured.bf16_draft_min_rows(model):  # the drafts did go through bfloat16
        assert starts and all(0 <= start <= draft_length for start in starts)
    else:  # fewer [MASK] rows than the threshold: float32 is faster there
        assert not starts


@needs_bf16_kernel
@pytest.mark.parametrize("packed", [False, True])
def test_a_plain_forward_finds_its_tail_and_a_mask_before_it_keeps_float32(packed):
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4).eval()
    twin = copy.deepcopy(model)
    cpu.enable(twin, packed=packed)  # float32 drafts on the same products: the bits clean rows must keep
    cpu.enable(model, draft_dtype=torch.bfloat16, packed=packed)
    least = measured.bf16_draft_min_rows(model)
    assert least == (measured.PACKED_BF16_DRAFT_MIN_ROWS if packed else measured.BF16_DRAFT_MIN_ROWS)
    # A linear with a draft operator takes the full path (its tail check), not the kernel linears' short one.
    assert not any("exact_op" in m.__dict__ for m in model.modules() if m.__dict__.get("draft_op") is not None)
    mask = model.config.mask_token_id
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    tails = []  # packed: the gated MLPs' bfloat16-tail operator, with the tail start of each call
    for mlp in mlps if packed else []:
        assert type(mlp).__name__ == "MeasuredLlamaMLP"
        mlp.gated_draft_op = lambda *args, op=mlp.gated_draft_op: tails.append(args[-1]) or op(*args)
    with torch.no_grad():
        tail = torch.tensor([[1, 2, 3, 4] + [mask] * least])
        got, want = model(tail).logits, twin(tail).logits
        assert torch.equal(got[:, :4], want[:, :4]) and not torch.equal(got[:, 4:], want[:, 4:])
        assert tails == ([4] * len(mlps) if packed else [])
        short = tail[:, :-1]  # one [MASK] row fewer than bfloat16 takes: every row float32
        assert torch.equal(model(short).logits, twin(short).logits)
        inside = torch.tensor([[1, 2, mask, 3, 4] + [mask] * 9])  # not a tail: no row is a draft row
        assert torch.equal(model(inside).logits, twin(inside).logits)
        # The LM head's rows are not the query's: clean rows picked after the masks stay float32.
        picked = torch.tensor([*range(4, 4 + least), 0, 1, 2, 3])
        assert torch.equal(model(tail, logits_to_keep=picked).logits[:, -4:], want[:, :4])


@needs_bf16_kernel
def test_the_cost_profile_of_bfloat16_drafts_is_its_own():
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4)
    fp32 = profile_key(cpu.enable(model))
    assert profile_key(cpu.enable(model, draft_dtype="bfloat16")) != fp32
    cpu.disable(model)
    assert cpu.linear.draft_dtype_of(model) is None


def test_bfloat16_drafts_warn_where_the_kernel_cannot_run_them(monkeypatch):
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4)
    monkeypatch.setattr(measured, "few_row_bf16_tail_kernel", lambda: None)
    with pytest.warns(UserWarning, match="drafts stay in the weights' dtype"):
        cpu.enable(model, draft_dtype=torch.bfloat16)
    assert cpu.linear.draft_dtype_of(model) is None


def test_bfloat16_drafts_refuse_what_has_no_drafts():
    with pytest.raises(ValueError, match="applies to TiDAR models"):
        cpu.enable(tiny_ar_model("llama", vocab_size=32).float(), draft_dtype=torch.bfloat16)
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4)
    with pytest.raises(ValueError, match="draft_dtype must be"):
        cpu.enable(model, draft_dtype=torch.float16)


def test_bench_runs_each_tidar_row_again_on_the_bfloat16_draft_copy():
    with pytest.raises(ValueError, match="add --cpu-linears"):
        BenchConfig(model="tiny", draft_dtypes=["float32", "bfloat16"], prompts=default_prompts(1)).validate()
    ar, tokenizer = tiny_byte_model()
    main = TidarForCausalLM.from_ar(ar, block_size=2, tokenizer=tokenizer).eval()
    models = Models(main, tokenizer, main_bf16_drafts=main)
    config = BenchConfig(model="tiny", draft_lengths=[2], methods=["ar", "tidar"], cpu_linears=True,
                         draft_dtypes=["float32", "bfloat16"], prompts=default_prompts(1))
    methods = {m.name: m for m in build_methods(config, models)}
    assert {"tidar-k2", "tidar-auto", "tidar-k2-bf16-drafts", "tidar-auto-bf16-drafts"} <= set(methods)
    copy, original = methods["tidar-k2-bf16-drafts"], methods["tidar-k2"]
    assert copy.model == "main_bf16_drafts" and copy.kwargs == original.kwargs and original.model == "main"

"""The measured CPU linear path: same products as F.linear by every method, and the plan it picks."""

import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import library_of
from toy import tiny_ar_model, train_counting_tidar

from hf_tidar import cpu
from hf_tidar.cpu import linear as measured
from hf_tidar.cpu.kernel import REQUIRED_FLAGS, built_kernel, cpu_flags, few_row_kernel, kernel_dtypes, supported_isas
from hf_tidar.cpu.linear import Choice, MeasuredLinear, best_choices, methods_for

needs_kernel = pytest.mark.skipif(
    not REQUIRED_FLAGS <= cpu_flags() or shutil.which("c++") is None,
    reason="the few-row kernel needs an AVX2 + FMA CPU and a C++ compiler",
)


@pytest.fixture(autouse=True)
def small_profiles(tmp_path, monkeypatch):
    """Profiles go to a temporary cache and time a small pool, so tests stay fast."""
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)


def _with_plan(linear: torch.nn.Linear, choice: Choice) -> torch.nn.Linear:
    linear.__class__ = MeasuredLinear
    linear.choices = [choice] * measured.MAX_ROWS
    linear.plan_dtype = linear.weight.dtype
    linear.few_row_op = few_row_kernel() if choice.method == "few_rows" else None
    linear._packed = None  # made on first use
    return linear


@pytest.mark.parametrize("method", ["linear", "w_xt", "onednn", pytest.param("few_rows", marks=needs_kernel)])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_every_method_computes_the_linear(method, rows, bias):
    torch.manual_seed(0)
    reference = torch.nn.Linear(24, 40, bias=bias)
    layer = _with_plan(torch.nn.Linear(24, 40, bias=bias), Choice(method, 8 if method != "linear" else rows))
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(1, rows, 24)
    with torch.no_grad():
        out = layer(x)
        expected = reference(x)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


BUILDS = [pytest.param(isa, dtype, id=f"{isa}-{str(dtype).removeprefix('torch.')}")
          for isa in ("avx2", "avx512", "avx512_bf16", "amx_bf16") for dtype in kernel_dtypes(isa)]
"""Every build of the kernel and each dtype it multiplies; those this CPU cannot run are skipped."""


def _build(isa: str):
    return library_of(isa).few_row_linear


def _tolerances(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize(("isa", "dtype"), BUILDS)
@pytest.mark.parametrize("in_features", [8, 13, 577])
@pytest.mark.parametrize("out_features", [1, 2, 3, 7, 50])
def test_few_row_kernel_is_a_linear_plus_a_low_rank_tail(isa, dtype, in_features, out_features):
    kernel = _build(isa)
    torch.manual_seed(out_features)
    # bfloat16 operands, float32 reference: the kernel accumulates in float32 and rounds once, at the end.
    weight, bias = torch.randn(out_features, in_features).to(dtype), torch.randn(out_features).to(dtype)
    lora_a, lora_b = torch.randn(5, in_features).to(dtype), torch.randn(out_features, 5).to(dtype)
    for rows in (1, 2, 3, 4, 5, 9, 13, 33):
        x = torch.randn(rows, in_features).to(dtype)
        exact = x.float() @ weight.float().t()
        out = kernel(x, weight, None, None, None, 0)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), exact, **_tolerances(dtype))
        for tail in sorted({0, rows // 2, rows - 1, rows}):  # tails inside a row tile and at its edges
            expected = exact + bias.float()
            expected[tail:] += x[tail:].float() @ lora_a.float().t() @ lora_b.float().t()
            out = kernel(x, weight, bias, lora_a, lora_b, tail)
            torch.testing.assert_close(out.float(), expected, **_tolerances(dtype))


@pytest.mark.parametrize(("isa", "dtype"), BUILDS)
def test_few_row_kernel_gives_a_row_the_same_bits_whatever_the_row_count(isa, dtype):
    # What makes a many-row verification pass agree with one-row AR steps on this path.
    kernel = _build(isa)
    torch.manual_seed(0)
    weight, x = torch.randn(37, 301).to(dtype), torch.randn(11, 301).to(dtype)
    lora_a, lora_b = torch.randn(16, 301).to(dtype), torch.randn(37, 16).to(dtype)
    together = kernel(x, weight, None, None, None, 11)
    for i in range(11):
        assert torch.equal(together[i], kernel(x[i : i + 1], weight, None, None, None, 1)[0])
    assert torch.equal(together[3:7], kernel(x[3:7].contiguous(), weight, None, None, None, 4))
    # A clean row's bits do not depend on the LoRA tail after it either, even in a tile it shares with tail rows
    # (row 6 shares a tile with rows 4 and 5), and a tail row's bits do not depend on the clean rows before it.
    with_tail = kernel(x, weight, None, lora_a, lora_b, 6)
    assert torch.equal(with_tail[:6], together[:6]) and not torch.equal(with_tail[6:], together[6:])
    for i in range(6, 11):
        assert torch.equal(with_tail[i], kernel(x[i : i + 1], weight, None, lora_a, lora_b, 0)[0])


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512_bf16"])
def test_float16_lora_factors_give_the_bits_of_their_float32_values(isa):
    """The AVX-512 builds widen float16 factors exactly: the same sums as float32 factors holding those values;
    the AVX2 build refuses them."""
    kernel = _build(isa)
    torch.manual_seed(1)
    weight, bias = torch.randn(50, 577), torch.randn(50)
    lora_a, lora_b = torch.randn(16, 577).half(), (0.1 * torch.randn(50, 16)).half()
    if isa == "avx2":
        with pytest.raises(RuntimeError, match="float16 LoRA factors need the kernel's AVX-512 build"):
            kernel(torch.randn(3, 577), weight, bias, lora_a, lora_b, 1)
        return
    for rows in (1, 3, 6, 12, 13):
        x = torch.randn(rows, 577)
        for tail in sorted({0, rows // 2, rows - 1, rows}):
            expected = kernel(x, weight, bias, lora_a.float(), lora_b.float(), tail)
            assert torch.equal(kernel(x, weight, bias, lora_a, lora_b, tail), expected)
    for wrong in (lora_a.float(), lora_a.bfloat16()):  # one factor float16, the other not
        with pytest.raises(RuntimeError, match="lora_[ab] must be a contiguous CPU tensor"):
            kernel(torch.randn(3, 577), weight, bias, wrong, lora_b, 1)


@needs_kernel
def test_the_widest_build_this_cpu_runs_is_the_one_used():
    assert few_row_kernel() is built_kernel(supported_isas()[0])
    for dtype in (torch.float32, torch.bfloat16):
        assert (few_row_kernel(dtype) is not None) == (dtype in kernel_dtypes(supported_isas()[0]))
        assert ("few_rows" in methods_for(dtype)) == (dtype in kernel_dtypes(supported_isas()[0]))


def test_a_build_can_be_chosen_and_a_wrong_name_is_refused(monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CPU_KERNEL_ISA", "avx2")
    if "avx2" in supported_isas() and shutil.which("c++"):
        assert few_row_kernel() is built_kernel("avx2") and few_row_kernel(torch.bfloat16) is None
    monkeypatch.setenv("HF_TIDAR_CPU_KERNEL_ISA", "sse2")
    with pytest.raises(ValueError, match="avx512_bf16, avx512, avx2"):
        few_row_kernel()


@needs_kernel
def test_few_row_kernel_refuses_what_it_cannot_multiply():
    kernel = few_row_kernel()
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), None, None, None, 2)
    with pytest.raises(RuntimeError, match="x's dtype"):
        kernel(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64), None, None, None, 2)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        kernel(torch.randn(2, 8), torch.randn(4, 9), None, None, None, 2)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(8, 2).t(), torch.randn(4, 8), None, None, None, 2)


def test_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CPU_KERNEL", "0")
    assert few_row_kernel() is None
    assert "few_rows" not in methods_for(torch.float32)


def test_grad_mode_and_big_inputs_take_the_stock_path():
    layer = _with_plan(torch.nn.Linear(8, 8), Choice("w_xt", 4))
    x = torch.randn(2, 3, 8, requires_grad=True)
    out = layer(x)  # grad enabled: F.linear, so autograd sees the usual op
    out.sum().backward()
    assert x.grad is not None and out.grad_fn.name().startswith(("AddmmBackward", "ViewBackward", "UnsafeView"))
    with torch.no_grad():
        big = torch.randn(measured.MAX_ROWS + 1, 8)
        torch.testing.assert_close(layer(big), F.linear(big, layer.weight, layer.bias))


def test_packed_weight_follows_in_place_changes():
    layer = _with_plan(torch.nn.Linear(16, 16, bias=False), Choice("onednn", 4))
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(2)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_weights_made_under_inference_mode_work_too():
    with torch.inference_mode():  # such weights are inference tensors, which keep no version counter
        layer = _with_plan(torch.nn.Linear(16, 16, bias=False), Choice("onednn", 4))
        x = torch.randn(2, 16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_best_choices_pads_only_the_transposed_forms():
    timings = {
        "linear": {1: 1.0, 2: 5.0, 4: 5.0},
        "w_xt": {1: 2.0, 2: 3.0, 4: 1.5},
    }
    choices = best_choices(timings, max_rows=4)
    assert choices[0] == Choice("linear", 1)
    assert choices[1] == Choice("w_xt", 4)  # 2 rows padded to 4: cheaper than either method on 2
    assert choices[2] == Choice("w_xt", 4)
    assert choices[3] == Choice("w_xt", 4)
    close = best_choices({"linear": {1: 1.0}, "w_xt": {1: 0.9}}, max_rows=1)
    assert close[0] == Choice("linear", 1)  # 10% faster is within the noise margin: torch's path stays
    assert methods_for(torch.float64) == ("linear", "w_xt")  # oneDNN's packed linear takes fp32/bf16 only


def test_enable_keeps_weights_and_greedy_tidar_still_equals_ar():
    model = train_counting_tidar(block_size=4, steps=150)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    settings = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    cpu.enable(model)
    assert cpu.is_enabled(model) and isinstance(model.lm_head, MeasuredLinear)
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        ar = model.generate(prompt, **settings)
        out = model.generate(prompt, strategy="tidar", return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ar)
    assert out.sequences.shape[1] - prompt.shape[1] > out.forward_passes[0] + 1  # drafts were accepted
    cpu.disable(model)
    assert not cpu.is_enabled(model) and type(model.lm_head) is torch.nn.Linear


def test_profiles_are_cached_per_shape(tmp_path):
    model = tiny_ar_model(vocab_size=40).double()  # a dtype no kernel build takes: its plan is measured
    cpu.enable(model)
    files = sorted(p.name for p in tmp_path.rglob("*.json"))
    assert files and all(name.endswith("-float64.json") for name in files)
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert len(files) == len(shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_kernel_takes_the_dtype_it_takes_every_row_count_unmeasured(dtype, tmp_path):
    if few_row_kernel(dtype) is None:
        pytest.skip(f"no few-row kernel for {dtype} on this machine")
    model = tiny_ar_model(vocab_size=40).to(dtype)
    cpu.enable(model)
    assert not list(tmp_path.rglob("*.json"))  # nothing to measure: the kernel is the plan
    plans = [m.choices for m in model.modules() if isinstance(m, MeasuredLinear)]
    assert plans and all(plan == measured.exact_choices() for plan in plans)


@needs_kernel
def test_the_kernel_linears_short_path_gives_the_full_paths_bits_and_steps_aside_where_it_must():
    model = tiny_ar_model(vocab_size=40).float()
    cpu.enable(model)
    linears = [m for m in model.modules() if isinstance(m, MeasuredLinear)]
    assert linears and all(m.__dict__.get("exact_op") is not None for m in linears)
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(1, 5, layer.in_features)
    with torch.no_grad():
        short = layer(x)
        op = layer.__dict__.pop("exact_op")
        assert torch.equal(short, layer(x))  # the full path's checks, the same operator call
        layer.exact_op = op
        long = torch.randn(1, measured.MAX_ROWS + 1, layer.in_features)
        torch.testing.assert_close(layer(long), F.linear(long, layer.weight))  # beyond the plan: F.linear
    x.requires_grad_(True)
    layer(x).sum().backward()  # autograd records: F.linear
    assert x.grad is not None
    cpu.disable(model)
    assert not any("exact_op" in m.__dict__ for m in model.modules())


@pytest.mark.skipif(few_row_kernel(torch.bfloat16) is None, reason="the bfloat16 kernel needs AVX-512 BF16")
def test_unpacked_bfloat16_prefills_take_the_kernel_up_to_its_row_limit(monkeypatch):
    model = tiny_ar_model(vocab_size=40).to(torch.bfloat16)
    cpu.enable(model, packed=False)  # packed (the default), bfloat16 takes the packed limit: tests/test_packed_rows.py
    layer = model.model.layers[0].mlp.down_proj
    assert layer.exact_rows == measured.BF16_MAX_ROWS > measured.MAX_ROWS
    calls = []
    product = layer.exact_op
    monkeypatch.setattr(layer, "exact_op", lambda x, *args: calls.append(x.shape[0]) or product(x, *args))
    x = torch.randn(1, 100, layer.in_features).to(torch.bfloat16)
    with torch.no_grad():
        prompt = layer(x)  # a 100-token prefill's rows
        torch.testing.assert_close(prompt, F.linear(x, layer.weight), rtol=1e-2, atol=1e-2)
        assert torch.equal(prompt[:, 37:38], layer(x[:, 37:38]))  # a row's bits, prefill or decode step
        long = torch.randn(measured.BF16_MAX_ROWS + 1, layer.in_features).to(torch.bfloat16)
        assert torch.equal(layer(long), F.linear(long, layer.weight))  # beyond its limit: F.linear
    assert calls == [100, 1]
    model.float()
    cpu.enable(model, packed=False)  # float32 on the unpacked kernel keeps the plans' limit
    assert model.model.layers[0].mlp.down_proj.exact_rows == measured.MAX_ROWS


def _timings_where_rows_cost(ratio: float):
    """profile_shape stand-in: every method's 12 rows ``ratio`` times its one row (a CPU's measurements, made up)."""
    def profile(out_features, in_features, dtype, *args, **kwargs):
        return {method: {rows: 1e-4 * (ratio if rows == 12 else 1.0) for rows in measured.ROW_GRID}
                for method in measured.methods_for(dtype)}
    return profile


@pytest.mark.parametrize("ratio,warned", [(10.6, True), (1.6, False)])
def test_enable_advises_float32_where_this_cpu_measured_bfloat16_rows_ruinous(ratio, warned, monkeypatch):
    monkeypatch.setattr(measured, "profile_shape", _timings_where_rows_cost(ratio))
    model = tiny_ar_model(vocab_size=40).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu.enable(model, remeasure=True)  # measured even where the kernel multiplies bfloat16
    advice = [str(w.message) for w in caught if "Run the model in float32" in str(w.message)]
    assert len(advice) == (1 if warned else 0)
    if warned:
        assert f"measured {ratio:.1f}x a one-row one" in advice[0]


def test_no_bfloat16_advice_for_a_float32_model(monkeypatch):
    monkeypatch.setattr(measured, "profile_shape", _timings_where_rows_cost(10.6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu.enable(tiny_ar_model(vocab_size=40).float(), remeasure=True)
    assert not [w for w in caught if "Run the model in float32" in str(w.message)]


def test_many_rows_cost_reads_the_fastest_method_at_each_row_count():
    timings = {"linear": {1: 2.0, 12: 30.0}, "w_xt": {1: 3.0, 12: 12.0}, "onednn": {1: 4.0}}
    assert measured.many_rows_cost(timings) == 12.0 / 2.0
    assert measured.many_rows_cost({"linear": {1: 2.0}}) is None

"""The LM head computed from a half-size copy (bfloat16 pairs on AVX-512 BF16, float16 elsewhere) with each row's top
recomputed exactly (``hf_tidar.cpu.top_exact_head``): the operator's argmax and top value are the float32 product's
even where the copy's rounding reorders near ties, and ``generate()`` runs it only where nothing but argmaxes is read,
with the same tokens as the float32 head."""

import copy
import warnings

import pytest
import torch
from toy import tiny_ar_model, train_counting_tidar
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.bench import BenchConfig, Models, default_prompts
from hf_tidar.bench import tiny_ar_model as tiny_byte_model
from hf_tidar.bench.models import _use_measured_linears
from hf_tidar.cpu.kernel import packed_pair_kernel, packed_row_kernel, top_exact_half_kernel, top_exact_kernel
from hf_tidar.cpu.top_exact_head import _row_norms_rounded_up, half_size_head
from hf_tidar.generation.cost_profile import profile_key

KERNELS = {"bfloat16": top_exact_kernel(), "float16": top_exact_half_kernel()}
pytestmark = pytest.mark.skipif(half_size_head() is None, reason="the top-exact head needs this package's CPU kernel")
COPIES = [pytest.param(name, marks=pytest.mark.skipif(op is None, reason=f"no {name} top-exact operator here"))
          for name, op in KERNELS.items()]
SPREAD = {"bfloat16": 2e-3, "float16": 2e-4}
"""How far apart a group's near copies lie: close enough for each copy's rounding to reorder them."""
SETTINGS = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))


def _near_ties(rows: int, n: int, k: int, seed: int, spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a weight whose rows come in groups of 8 near copies: the copy's rounding reorders their logits."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n // 8, k, generator=g).repeat_interleave(8, 0) + spread * torch.randn(n, k, generator=g)
    return torch.randn(rows, k, generator=g), weight


def _operands(weight: torch.Tensor, watched: list[int], copy_dtype: str) -> tuple:
    if copy_dtype == "bfloat16":
        packed = packed_pair_kernel()[0](weight.bfloat16().contiguous())
    else:
        packed = packed_row_kernel()[0](weight.half().contiguous())
    return packed, weight, _row_norms_rounded_up(weight), torch.tensor(watched, dtype=torch.long)


def _rounded_product(x: torch.Tensor, weight: torch.Tensor, copy_dtype: str) -> torch.Tensor:
    """The logits from the copy alone (bfloat16 rounds the inputs too; the float16 product keeps them)."""
    if copy_dtype == "bfloat16":
        return x.bfloat16().float() @ weight.bfloat16().float().t()
    return x @ weight.half().float().t()


def _exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    pack, multiply = packed_row_kernel()
    return multiply(x, pack(weight), weight.shape[0], None, None, None, x.shape[0])


def _assert_exact_top(got: torch.Tensor, exact: torch.Tensor) -> None:
    best = exact.argmax(-1)
    assert torch.equal(got.argmax(-1), best)
    assert torch.equal(got.gather(1, best[:, None]), exact.gather(1, best[:, None]))  # the float32 bits
    assert (got <= exact.gather(1, best[:, None])).all()  # every other logit below the exact top


@pytest.mark.parametrize("copy_dtype", COPIES)
@pytest.mark.parametrize("k", [64, 575])  # 575: an odd K (bfloat16: its last pair padded)
def test_the_top_is_the_float32_products_where_the_copy_reorders_it(k, copy_dtype):
    kernel = KERNELS[copy_dtype]
    x, weight = _near_ties(64, 256, k, seed=k, spread=SPREAD[copy_dtype])
    exact = _exact(x, weight)
    got = kernel(x, *_operands(weight, [], copy_dtype))
    assert (_rounded_product(x, weight, copy_dtype).argmax(-1) != exact.argmax(-1)).sum() >= 5  # the copy alone errs
    _assert_exact_top(got, exact)
    assert not torch.equal(got, exact)  # the rest are the copy's values
    for row in range(3):  # a row's values do not depend on the others
        assert torch.equal(kernel(x[row : row + 1].contiguous(), *_operands(weight, [], copy_dtype)),
                           got[row : row + 1])


@pytest.mark.parametrize("copy_dtype", COPIES)
def test_a_watched_id_is_exact_and_removing_it_leaves_the_exact_top_of_the_rest(copy_dtype):
    x, weight = _near_ties(32, 128, 64, seed=3, spread=SPREAD[copy_dtype])
    watched = 5
    weight[watched] = 4 * weight[0]  # far above the rest on many rows: the top the processor removes
    exact = _exact(x, weight)
    got = KERNELS[copy_dtype](x, *_operands(weight, [watched], copy_dtype))
    assert torch.equal(got[:, watched], exact[:, watched])
    assert (exact.argmax(-1) == watched).sum() >= 8
    got[:, watched] = exact[:, watched] = float("-inf")  # as TiDAR's [MASK] suppression does
    _assert_exact_top(got, exact)


@pytest.mark.skipif(KERNELS["float16"] is None, reason="no float16 top-exact operator here")
def test_the_float16_operator_names_itself_when_refusing_a_float32_copy():
    x, weight = _near_ties(2, 64, 64, seed=5, spread=SPREAD["float16"])
    _, _, norms, watched = _operands(weight, [], "float16")
    with pytest.raises(RuntimeError, match="top_exact_linear_half: packed must be the float16 weight"):
        KERNELS["float16"](x, packed_row_kernel()[0](weight), weight, norms, watched)
    with pytest.raises(RuntimeError, match="top_exact_linear_half: weight must be a contiguous"):
        KERNELS["float16"](x, packed_row_kernel()[0](weight[:32].half().contiguous()), weight, norms, watched)


@pytest.mark.skipif(KERNELS["float16"] is None, reason="no float16 top-exact operator here")
def test_float16_subnormal_weights_keep_the_exact_top():
    # Weights near 2^-20 are float16 subnormals, rounded by up to 2^-25: several percent of each, far beyond the
    # 2^-11 of a normal float16. The bound's |x|_1 term must cover it.
    x, weight = _near_ties(64, 256, 64, seed=11, spread=0.02)
    weight = weight * 2.0**-20
    exact = _exact(x, weight)
    assert (_rounded_product(x, weight, "float16").argmax(-1) != exact.argmax(-1)).sum() >= 5
    _assert_exact_top(KERNELS["float16"](x, *_operands(weight, [], "float16")), exact)


@pytest.mark.skipif(top_exact_kernel() is not None or KERNELS["float16"] is None,
                    reason="the float16 copy is the head's only where there is no bfloat16 one")
def test_a_head_float16_cannot_hold_warns_and_stays_float32():
    model = tiny_ar_model(vocab_size=40).float()
    with torch.no_grad():
        model.get_output_embeddings().weight[3, 0] = 70000.0
    with pytest.warns(UserWarning, match="65504"):
        cpu.enable(model, top_exact_head=True)
    assert getattr(model, "top_exact_head", None) is None
    model = cpu.enable(tiny_ar_model(vocab_size=40).float(), top_exact_head=True)
    with torch.no_grad():
        model.get_output_embeddings().weight[3, 0] = 70000.0  # after enabling: the copy is made again, and refused
    with pytest.raises(ValueError, match="top_exact_head=False"), warnings.catch_warnings():
        model.generate(torch.tensor([[3, 4, 5, 6, 7]]), **SETTINGS)


def _spy(model) -> list[int]:
    """Rows of every call of ``model``'s top-exact operator."""
    calls, state = [], model.top_exact_head
    real = state.op
    state.op = lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest)
    return calls


def test_greedy_ar_and_tidar_write_the_float32_heads_tokens():
    model = train_counting_tidar(block_size=4, steps=150).float()
    exact = cpu.enable(model)
    prompts = torch.tensor([[3, 4, 5, 6, 7], [20, 21, 22, 23, 24]])
    with torch.no_grad():
        want = {s: exact.generate(prompts, strategy=s, draft_length=3, **SETTINGS) if s == "tidar"
                else exact.generate(prompts, **SETTINGS) for s in ("ar", "tidar")}
    cpu.enable(model, top_exact_head=True)
    calls = _spy(model)
    with torch.no_grad():
        assert torch.equal(model.generate(prompts, **SETTINGS), want["ar"])
        assert calls
        calls.clear()
        out = model.generate(prompts, strategy="tidar", draft_length=3, return_dict_in_generate=True, **SETTINGS)
    assert torch.equal(out.sequences, want["tidar"]) and calls
    assert out.sequences.shape[1] - prompts.shape[1] > int(out.forward_passes[0]) + 1  # drafts were accepted
    assert not model.top_exact_head.active  # only inside the call


@pytest.mark.parametrize("options", [dict(do_sample=True), dict(return_dict_in_generate=True, output_scores=True),
                                     dict(repetition_penalty=1.3), dict(num_beams=2)])
def test_calls_that_read_more_than_argmaxes_keep_the_float32_head(options):
    model = cpu.enable(tiny_ar_model(vocab_size=40).float(), top_exact_head=True)
    calls = _spy(model)
    prompts = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        model.generate(prompts, **{**SETTINGS, **options})
        model(prompts)  # and a direct forward
    assert calls == []
    with torch.no_grad():
        model.generate(prompts, **SETTINGS)
    assert calls


class ReadsScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("strategy", ["ar", "tidar"])
def test_a_custom_stopping_criterion_keeps_the_float32_head(strategy):
    model = cpu.enable(train_counting_tidar(block_size=4, steps=20).float(), top_exact_head=True)
    calls = _spy(model)
    with torch.no_grad():
        model.generate(torch.tensor([[3, 4, 5, 6, 7]]), strategy=strategy,
                       stopping_criteria=StoppingCriteriaList([ReadsScores()]), **SETTINGS)
        assert calls == []
        model.generate(torch.tensor([[3, 4, 5, 6, 7]]), strategy=strategy, **SETTINGS)  # the criteria generate builds
    assert calls


def test_the_mixed_verifier_reads_the_float32_head():
    model = cpu.enable(train_counting_tidar(block_size=4, steps=20).float(), top_exact_head=True)
    calls = _spy(model)
    with torch.no_grad(), pytest.warns(UserWarning, match="verifier_weight"):
        model.generate(torch.tensor([[3, 4, 5, 6, 7]]), strategy="tidar", draft_length=2, verifier_weight=0.5,
                       **SETTINGS)
    assert calls == []


def test_a_bfloat16_head_warns_and_stays_as_it_is():
    model = cpu.enable(tiny_ar_model(vocab_size=40).bfloat16())
    with pytest.warns(UserWarning, match="float32 LM head"):
        cpu.enable(model, top_exact_head=True)
    assert getattr(model, "top_exact_head", None) is None


def test_enabling_twice_wraps_once_and_disable_takes_it_back():
    model = cpu.enable(tiny_ar_model(vocab_size=40).float(), top_exact_head=True)
    cpu.enable(model, top_exact_head=True)
    assert model.generate.args[1] == type(model).generate.__get__(model)  # the wrapper wraps transformers' own
    cpu.disable(model)
    assert "generate" not in model.__dict__ and getattr(model, "top_exact_head", None) is None
    assert "top_exact_head" not in model.get_output_embeddings().__dict__


def test_the_cost_profile_of_a_top_exact_head_is_its_own():
    model = TidarForCausalLM.from_ar(tiny_ar_model(vocab_size=32).float(), block_size=4)
    plain = profile_key(cpu.enable(model))
    assert profile_key(cpu.enable(model, top_exact_head=True)) != plain


def test_the_bench_gives_it_to_every_model_on_the_path_but_the_stock_baseline():
    with pytest.raises(ValueError, match="add --cpu-linears"):
        BenchConfig(model="tiny", top_exact_head=True, prompts=default_prompts(1)).validate()
    ar, tokenizer = tiny_byte_model()
    main = TidarForCausalLM.from_ar(copy.deepcopy(ar), block_size=2, tokenizer=tokenizer).eval()
    models = Models(main, tokenizer, ar_baseline=ar)
    _use_measured_linears(models, top_exact_head=True)
    assert models.main.top_exact_head is not None and models.ar_baseline.top_exact_head is not None
    assert getattr(models.stock_baseline, "top_exact_head", None) is None

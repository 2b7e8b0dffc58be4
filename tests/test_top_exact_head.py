"""The LM head computed in bfloat16 with each row's top recomputed exactly (``hf_tidar.cpu.top_exact_head``): the
operator's argmax and top value are the float32 product's even where bfloat16 reorders near ties, and ``generate()``
runs it only where nothing but argmaxes is read, with the same tokens as the float32 head."""

import copy

import pytest
import torch
from toy import tiny_ar_model, train_counting_tidar
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.bench import BenchConfig, Models, default_prompts
from hf_tidar.bench import tiny_ar_model as tiny_byte_model
from hf_tidar.bench.models import _use_measured_linears
from hf_tidar.cpu.kernel import packed_pair_kernel, packed_row_kernel, top_exact_kernel
from hf_tidar.cpu.top_exact_head import _row_norms_rounded_up
from hf_tidar.generation.cost_profile import profile_key

kernel = top_exact_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the top-exact head needs the AVX-512 BF16 build")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))


def _near_ties(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a weight whose rows come in groups of 8 near copies: bfloat16 rounding reorders their logits."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n // 8, k, generator=g).repeat_interleave(8, 0) + 2e-3 * torch.randn(n, k, generator=g)
    return torch.randn(rows, k, generator=g), weight


def _operands(weight: torch.Tensor, watched: list[int]) -> tuple:
    pack_pairs = packed_pair_kernel()[0]
    return (pack_pairs(weight.bfloat16().contiguous()), weight, _row_norms_rounded_up(weight),
            torch.tensor(watched, dtype=torch.long))


@pytest.mark.parametrize("k", [64, 575])  # 575: an odd K, its last pair padded
def test_the_top_is_the_float32_products_where_bfloat16_reorders_it(k):
    x, weight = _near_ties(64, 256, k, seed=k)
    pack, multiply = packed_row_kernel()
    exact = multiply(x, pack(weight), weight.shape[0], None, None, None, x.shape[0])
    got = kernel(x, *_operands(weight, []))
    approx = (x.bfloat16().float() @ weight.bfloat16().float().t())
    assert (approx.argmax(-1) != exact.argmax(-1)).sum() >= 5  # bfloat16 alone picks other tokens on these rows
    best = exact.argmax(-1)
    assert torch.equal(got.argmax(-1), best)
    assert torch.equal(got.gather(1, best[:, None]), exact.gather(1, best[:, None]))  # the float32 bits
    assert (got <= exact.gather(1, best[:, None])).all()  # every other logit below the exact top
    assert not torch.equal(got, exact)  # the rest are bfloat16 values
    for row in range(3):  # a row's values do not depend on the others
        assert torch.equal(kernel(x[row : row + 1].contiguous(), *_operands(weight, [])), got[row : row + 1])


def test_a_watched_id_is_exact_and_removing_it_leaves_the_exact_top_of_the_rest():
    x, weight = _near_ties(32, 128, 64, seed=3)
    watched = 5
    weight[watched] = 4 * weight[0]  # far above the rest on many rows: the top the processor removes
    pack, multiply = packed_row_kernel()
    exact = multiply(x, pack(weight), weight.shape[0], None, None, None, x.shape[0])
    got = kernel(x, *_operands(weight, [watched]))
    assert torch.equal(got[:, watched], exact[:, watched])
    assert (exact.argmax(-1) == watched).sum() >= 8
    got[:, watched] = exact[:, watched] = float("-inf")  # as TiDAR's [MASK] suppression does
    best = exact.argmax(-1)
    assert torch.equal(got.argmax(-1), best)
    assert torch.equal(got.gather(1, best[:, None]), exact.gather(1, best[:, None]))


def _spy(model) -> list[int]:
    """Rows of every call of ``model``'s top-exact operator."""
    calls, state = [], model.top_exact_head
    real = state.op
    state.op = lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest)
    return calls


SETTINGS = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)


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

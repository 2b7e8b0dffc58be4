"""The float32 few-row product on column-packed weights (every build: AVX2 as two 8-lane halves of a block): the linear it stands for, a row's bits
independent of the row count, the LoRA tail, re-packing after a weight change, and where it is (not) used."""

import copy

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import library_of
from toy import tiny_ar_model, train_counting_tidar

from hf_tidar import TidarForCausalLM, cpu
from hf_tidar.cpu import linear as measured
from hf_tidar.cpu.kernel import (
    few_row_bf16_tail_kernel,
    kernel_isa,
    lora_codes_packer,
    packed_bf16_tail_kernel,
    packed_pair_kernel,
    packed_row_kernel,
)
from hf_tidar.cpu.packed import ColumnPackedProduct
from hf_tidar.generation.cost_profile import profile_key

needs_packed = pytest.mark.skipif(packed_row_kernel() is None, reason="the packed product needs the CPU library (an x86 CPU with AVX2, FMA and F16C, and a compiler)")
pack_codes = lora_codes_packer()
needs_pairs = pytest.mark.skipif(packed_pair_kernel() is None, reason="bfloat16 pairs need the AVX-512 BF16 build")


@pytest.fixture(autouse=True)
def small_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "COLD_BYTES", 1 << 16)


def _reference(x, weight, bias=None, lora_a=None, lora_b=None, tail=None):
    """The product in float64, rounded once."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    if lora_a is not None:
        out[tail:] += (x[tail:].double() @ lora_a.double().T) @ lora_b.double().T
    return out.float()


@needs_packed
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (37, 19), (200, 72)])  # whole and partial blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 12, 13, 30])  # every tile height, and several row tiles
def test_the_packed_product_is_the_linear_and_a_rows_bits_do_not_depend_on_the_row_count(out_features, in_features,
                                                                                          rows):
    pack, multiply = packed_row_kernel()
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(out_features, in_features, generator=generator), torch.randn(out_features)
    x = torch.randn(rows, in_features, generator=generator)
    packed = pack(weight)
    assert packed.shape == ((out_features + 15) // 16, in_features, 16)
    got = multiply(x, packed, out_features, bias, None, None, rows)
    torch.testing.assert_close(got, _reference(x, weight, bias), rtol=1e-5, atol=1e-5)
    for row in range(rows):  # each row alone, as a one-row AR step computes it: the same bits
        assert torch.equal(multiply(x[row:row + 1].contiguous(), packed, out_features, bias, None, None, 1), got[row:row + 1])


@needs_packed
@pytest.mark.parametrize("rank,in_features", [(1, 24), (2, 24), (3, 24), (8, 24), (4, 19), (16, 24), (20, 24)])
def test_pack_codes_puts_consecutive_inputs_of_a_low_rank_factor_side_by_side(rank, in_features):
    # Up to 8 codes: S = 16 / (rank rounded up to a power of two) inputs of each code in one vector; over 8, the
    # weight's layout.
    lora_a = torch.randn(rank, in_features)
    packed = pack_codes(lora_a)
    if rank > 8:
        assert torch.equal(packed, packed_row_kernel()[0](lora_a))
        return
    group = 16 // (1 << (rank - 1).bit_length())
    steps = -(-in_features // group)
    assert packed.shape == (1, steps, 16) and packed.dtype == lora_a.dtype
    for r in range(rank):
        for k in range(in_features):
            assert packed[0, k // group, r * group + k % group] == lora_a[r, k]
    assert int((packed != 0).sum()) == rank * in_features  # zeros elsewhere (a random factor has no zero)
    assert pack_codes(lora_a.half()).dtype == torch.float16
    if packed_pair_kernel() is None:
        return
    # bfloat16: pairs of k take the place of single k (for vdpbf16ps), the last pair of an odd K padded with a zero.
    pairs = pack_codes(lora_a.bfloat16())
    assert pairs.shape == (1, -(-((in_features + 1) // 2) // group), 16, 2) and pairs.dtype == torch.bfloat16
    for r in range(rank):
        for k in range(in_features):
            assert pairs[0, k // 2 // group, r * group + k // 2 % group, k % 2] == lora_a[r, k].bfloat16()
    assert int((pairs != 0).sum()) == rank * in_features


@needs_packed
@pytest.mark.parametrize("rank", [1, 2, 3, 4, 8, 16, 20])
@pytest.mark.parametrize("rows,tail", [(6, 2), (12, 3), (13, 0), (5, 5), (20, 7)])
def test_the_lora_tail_is_added_to_the_tail_rows_only(rank, rows, tail):
    # 200 outputs: 13 column blocks, more than one chunk where several row tiles share the blocks (13 and 20 rows)
    pack, multiply = packed_row_kernel()
    generator = torch.Generator().manual_seed(rank + rows)
    weight = torch.randn(200, 24, generator=generator)
    lora_a, lora_b = torch.randn(rank, 24, generator=generator), torch.randn(200, rank, generator=generator)
    x = torch.randn(rows, 24, generator=generator)
    plain = multiply(x, pack(weight), 200, None, None, None, rows)
    got = multiply(x, pack(weight), 200, None, pack_codes(lora_a), pack(lora_b), tail)
    torch.testing.assert_close(got, _reference(x, weight, None, lora_a, lora_b, tail), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:tail], plain[:tail])  # clean rows: the base product, bit for bit
    for row in range(tail, rows):  # a tail row's bits do not depend on the other rows
        alone = multiply(x[row:row + 1].contiguous(), pack(weight), 200, None, pack_codes(lora_a), pack(lora_b), 0)
        assert torch.equal(alone, got[row:row + 1])


@needs_packed
@pytest.mark.parametrize("half", ["lora_a", "lora_b", "both"])
def test_float16_factors_give_the_bits_of_their_float32_values(half):
    pack, multiply = packed_row_kernel()
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 24, generator=generator)
    lora_a, lora_b = torch.randn(16, 24, generator=generator).half(), torch.randn(40, 16, generator=generator).half()
    assert pack(lora_b).dtype == torch.float16 and torch.equal(pack(lora_b).float(), pack(lora_b.float()))
    x = torch.randn(7, 24, generator=generator)
    given_a = lora_a if half in ("lora_a", "both") else lora_a.float()
    given_b = lora_b if half in ("lora_b", "both") else lora_b.float()
    got = multiply(x, pack(weight), 40, None, pack_codes(given_a), pack(given_b), 2)
    assert torch.equal(got, multiply(x, pack(weight), 40, None, pack_codes(lora_a.float()), pack(lora_b.float()), 2))
    torch.testing.assert_close(got, _reference(x, weight, None, lora_a.float(), lora_b.float(), 2), rtol=1e-5,
                               atol=1e-5)
    for drafts in filter(None, [packed_bf16_tail_kernel()]):  # the bfloat16-tail operator takes them too
        got = drafts(x, pack(weight), 40, None, pack_codes(given_a), pack(given_b), 2)
        assert torch.equal(got, drafts(x, pack(weight), 40, None, pack_codes(lora_a.float()), pack(lora_b.float()), 2))


def _bf16_reference(x, weight, bias, lora_a, lora_b):
    """Draft rows: x and weight rounded to bfloat16 (an odd K's last term not), float64 sums, the LoRA update
    from float32 values."""
    xb, wb = x.bfloat16().double(), weight.bfloat16().double()
    if x.shape[1] % 2:
        xb[:, -1], wb[:, -1] = x[:, -1].double(), weight[:, -1].double()
    out = xb @ wb.T + bias.double()
    if lora_a is not None:
        out += (x.double() @ lora_a.double().T) @ lora_b.double().T
    return out


@pytest.mark.skipif(packed_bf16_tail_kernel() is None, reason="bfloat16 draft rows need the AVX-512 BF16 build")
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (37, 19), (200, 72)])
@pytest.mark.parametrize("rows,tail", [(6, 2), (12, 3), (13, 0), (9, 1), (16, 4), (8, 6), (24, 3), (5, 5), (3, 1)])
@pytest.mark.parametrize("rank", [0, 8])
def test_bfloat16_draft_rows_on_packed_weights_keep_the_clean_rows_bits(out_features, in_features, rows, tail, rank):
    pack, multiply = packed_row_kernel()
    drafts = packed_bf16_tail_kernel()
    generator = torch.Generator().manual_seed(rows * 100 + tail)
    weight, bias = torch.randn(out_features, in_features, generator=generator), torch.randn(out_features)
    x = torch.randn(rows, in_features, generator=generator)
    factors = (None, None)
    if rank:
        factors = (torch.randn(rank, in_features, generator=generator), torch.randn(out_features, rank, generator=generator))
    packed = (pack(weight), None, None) if not rank else (pack(weight), pack_codes(factors[0]), pack(factors[1]))
    want = multiply(x, packed[0], out_features, bias, packed[1], packed[2], tail)
    got = drafts(x, packed[0], out_features, bias, packed[1], packed[2], tail)
    # Clean rows: the float32 product's bits (a mixed tile for up to 4 clean rows, separate tiles past that).
    assert torch.equal(got[:tail], want[:tail])
    if tail < rows:
        reference = _bf16_reference(x[tail:], weight, bias, *factors)
        torch.testing.assert_close(got[tail:].double(), reference, rtol=1e-5, atol=1e-4)
        assert not torch.equal(got[tail:], want[tail:])  # they did go through bfloat16


def _assert_bfloat16_rounding_of(got, reference):
    """``got`` is ``reference`` (:func:`_reference` of bfloat16 inputs, exact in float64) rounded to bfloat16, up to
    float32 summation: within one bfloat16 step (2^-8 relative) of each value."""
    assert got.dtype == torch.bfloat16
    reference = reference.double()
    error = (got.double() - reference).abs()
    assert bool((error <= 2.0**-8 * reference.abs() + 1e-3).all()), float(error.max())


@needs_pairs
@pytest.mark.parametrize("out_features,in_features", [(48, 32), (37, 19), (200, 72)])  # whole and partial blocks, odd K
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 12, 13, 30])  # 4: a tile of six column blocks
def test_bfloat16_weights_packed_as_pairs_give_the_linear_and_a_rows_bits_whatever_the_row_count(out_features,
                                                                                               in_features, rows):
    pack, multiply, _ = packed_pair_kernel()
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    packed = pack(weight)
    assert packed.shape == ((out_features + 15) // 16, (in_features + 1) // 2, 16, 2)
    got = multiply(x, packed, out_features, bias, None, None, rows)
    _assert_bfloat16_rounding_of(got, _reference(x, weight, bias))
    for row in range(rows):  # each row alone, as a one-row AR step computes it: the same bits
        assert torch.equal(multiply(x[row:row + 1].contiguous(), packed, out_features, bias, None, None, 1),
                           got[row:row + 1])


@needs_pairs
@pytest.mark.parametrize("rank", [2, 4, 8, 16, 20])
@pytest.mark.parametrize("rows,tail", [(6, 2), (12, 3), (13, 0), (5, 5), (20, 7), (4, 2)])
@pytest.mark.parametrize("in_features", [24, 19])  # 19: the rows' last pair padded for the codes
def test_the_lora_tail_on_bfloat16_pairs_is_added_to_the_tail_rows_only(rank, rows, tail, in_features):
    pack, multiply, pack_columns = packed_pair_kernel()
    generator = torch.Generator().manual_seed(rank + rows)
    weight = torch.randn(200, in_features, generator=generator).bfloat16()
    lora_a = torch.randn(rank, in_features, generator=generator).bfloat16()
    lora_b = torch.randn(200, rank, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    plain = multiply(x, pack(weight), 200, None, None, None, rows)
    got = multiply(x, pack(weight), 200, None, pack_codes(lora_a), pack_columns(lora_b), tail)
    _assert_bfloat16_rounding_of(got, _reference(x, weight, None, lora_a, lora_b, tail))
    assert torch.equal(got[:tail], plain[:tail])  # clean rows: the base product, bit for bit
    if tail < rows:
        assert not torch.equal(got[tail:], plain[tail:])


@needs_pairs
def test_enable_packs_bfloat16_linears_as_pairs_and_greedy_tidar_there_equals_ar():
    model = train_counting_tidar(block_size=4, steps=150).to(torch.bfloat16)
    cpu.enable(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m.exact_op, ColumnPackedProduct) for m in linears)
    assert all(m.exact_rows == measured.PACKED_MAX_ROWS for m in linears)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(1, 9, layer.in_features).bfloat16()
    with torch.no_grad():
        _assert_bfloat16_rounding_of(layer(x)[0], _reference(x[0], layer.weight))
        assert torch.equal(layer(x)[:, 4:5], layer(x[:, 4:5]))  # a row's bits, pass or step
    prompts = torch.tensor([[3, 4, 5, 6, 7], [9, 10, 11, 12, 13]])
    settings = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = model.generate(prompts, **settings)
        out = model.generate(prompts, strategy="tidar", draft_length=3, return_dict_in_generate=True, **settings)
    assert torch.equal(out.sequences, ar)
    assert out.sequences.shape[1] - prompts.shape[1] > int(out.forward_passes.max()) + 1  # drafts were accepted
    cpu.enable(model, packed=False)
    assert not measured.is_packed(model)


@needs_pairs
def test_bfloat16_pairs_add_a_qwen_projections_bias():
    model = cpu.enable(tiny_ar_model("qwen2", vocab_size=40).to(torch.bfloat16))
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.bias is not None and isinstance(layer.exact_op, ColumnPackedProduct)
    x = torch.randn(1, 6, layer.in_features).bfloat16()
    with torch.no_grad():
        out = layer(x)
        _assert_bfloat16_rounding_of(out[0], _reference(x[0], layer.weight, layer.bias))
        assert torch.equal(out[:, 2:3], layer(x[:, 2:3]))


@needs_packed
def test_the_product_follows_weight_changes_and_refuses_bad_layouts():
    pack, multiply = packed_row_kernel()
    product = ColumnPackedProduct(pack, multiply)
    layer = torch.nn.Linear(24, 20)
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.testing.assert_close(product(x, layer.weight, layer.bias, None, None, 3), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(-2)  # in place: the version counter moves
        torch.testing.assert_close(product(x, layer.weight, layer.bias, None, None, 3), F.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(20, 24))  # another tensor
        torch.testing.assert_close(product(x, layer.weight, layer.bias, None, None, 3), F.linear(x, layer.weight, layer.bias))
    with pytest.raises(RuntimeError, match="pack_columns' layout"):
        multiply(x, layer.weight.detach().contiguous(), 20, None, None, None, 3)  # an unpacked weight


@needs_packed
def test_enable_packs_float32_linears_unless_told_not_to(monkeypatch):
    model = tiny_ar_model(vocab_size=40).float()
    monkeypatch.setenv("HF_TIDAR_CPU_PACKED", "0")
    assert not measured.is_packed(cpu.enable(model))
    monkeypatch.delenv("HF_TIDAR_CPU_PACKED")
    cpu.enable(model)
    assert all(isinstance(m.few_row_op, ColumnPackedProduct) for m in model.modules() if isinstance(m, torch.nn.Linear))
    packed_key = profile_key(model)
    cpu.enable(model, packed=False)
    assert not measured.is_packed(model)
    assert profile_key(model) != packed_key  # the cost curve that prices `auto` layouts is measured for each
    if few_row_bf16_tail_kernel() is not None:
        tidar = TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=32).float(), block_size=4)
        cpu.enable(tidar, draft_dtype=torch.bfloat16)  # bfloat16 drafts: the packed product's own draft operator
        linears = [m for m in tidar.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m.few_row_op, ColumnPackedProduct) for m in linears)
        assert all(m.draft_op.func.__self__ is m.few_row_op for m in linears)  # one packed copy serves both


@needs_packed
@pytest.mark.parametrize("draft_length,groups", [(3, None), (4, [1])])
def test_greedy_tidar_on_packed_linears_equals_ar_and_matches_the_unpacked_tokens(draft_length, groups):
    model = train_counting_tidar(block_size=4, steps=150)
    unpacked = copy.deepcopy(model)
    cpu.enable(model)
    cpu.enable(unpacked, packed=False)
    prompts = torch.tensor([[3, 4, 5, 6, 7], [9, 10, 11, 12, 13]])
    settings = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ar = model.generate(prompts, **settings)
        out = model.generate(prompts, strategy="tidar", draft_length=draft_length, draft_groups=groups,
                             return_dict_in_generate=True, **settings)
        assert torch.equal(out.sequences, ar)
        assert torch.equal(unpacked.generate(prompts, **settings), ar)  # another rounding order, the same tokens here
    assert out.sequences.shape[1] - prompts.shape[1] > int(out.forward_passes.max()) + 1  # drafts were accepted


@needs_packed
def test_weights_stay_unpacked_with_a_warning_where_memory_is_short_unless_packing_is_asked_for(monkeypatch):
    model = tiny_ar_model(vocab_size=40).float()
    monkeypatch.setattr(measured, "available_memory", lambda: 1000)  # bytes: less than twice any copy
    with pytest.warns(UserWarning, match="stay unpacked"):
        cpu.enable(model)
    assert not measured.is_packed(model)
    assert measured.is_packed(cpu.enable(model, packed=True))  # asked for: packed regardless
    monkeypatch.setattr(measured, "available_memory", lambda: None)  # unknown: packed
    assert measured.is_packed(cpu.enable(model))


@needs_packed
def test_prefills_take_the_packed_product_up_to_its_row_limit(monkeypatch):
    model = tiny_ar_model(vocab_size=40).float()
    cpu.enable(model)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.exact_rows == measured.PACKED_MAX_ROWS
    calls = []
    product = layer.exact_op
    monkeypatch.setattr(layer, "exact_op", lambda x, *args: calls.append(x.shape[0]) or product(x, *args))
    x = torch.randn(1, 100, layer.in_features)
    with torch.no_grad():
        prompt = layer(x)  # a 100-token prefill's rows
        torch.testing.assert_close(prompt, _reference(x[0], layer.weight)[None], rtol=1e-5, atol=1e-5)
        assert torch.equal(prompt[:, 37:38], layer(x[:, 37:38]))  # a row's bits, prefill or decode step
        monkeypatch.setattr(measured, "MAX_ROWS", 8)  # the plans' limit is not the packed product's
        layer(x)
        long = torch.randn(measured.PACKED_MAX_ROWS + 1, layer.in_features)
        torch.testing.assert_close(layer(long), F.linear(long, layer.weight))  # beyond its limit: F.linear
    assert calls == [100, 1, 100]
    cpu.enable(model, packed=False)
    assert model.model.layers[0].mlp.down_proj.exact_rows == measured.MAX_ROWS


@pytest.mark.parametrize("isa", ["amx_bf16", "avx512_bf16"])
@pytest.mark.parametrize("in_features", [32, 64, 576, 48])  # multiples of 32 take AMX's tiles; 48 does not
@pytest.mark.parametrize("rank", [0, 8])
def test_each_bfloat16_build_gives_the_linear_and_a_rows_bits_whatever_the_row_count(isa, in_features, rank):
    """The AMX build multiplies K = 32 at a time on the tile unit, up to 12 rows a tile and 4 column blocks: its
    sums must still be the linear's, a row's bits the same at every row count (a one-row AR step against a
    many-row pass), and a LoRA tail only on the tail rows."""
    library = library_of(isa)
    generator = torch.Generator().manual_seed(in_features + rank)
    weight = torch.randn(200, in_features, generator=generator).bfloat16()  # 13 column blocks: 3 tiles of 4, one of 1
    bias = torch.randn(200, generator=generator).bfloat16()
    x = torch.randn(30, in_features, generator=generator).bfloat16()
    packed = library.pack_column_pairs(weight)
    factors = (None, None)
    if rank:
        lora_a = torch.randn(rank, in_features, generator=generator).bfloat16()
        lora_b = (0.1 * torch.randn(200, rank, generator=generator)).bfloat16()
        factors = (library.pack_codes(lora_a), library.pack_columns(lora_b))
    for rows in (1, 4, 12, 13, 30):
        tail = rows // 2
        got = library.packed_pair_linear(x[:rows], packed, 200, bias, *factors, tail)
        expected = _reference(x[:rows], weight, bias, *((lora_a, lora_b) if rank else (None, None)), tail)
        _assert_bfloat16_rounding_of(got, expected)
        for row in (0, tail, rows - 1):  # alone, as a one-row step: the same bits (a tail row with its update)
            alone = library.packed_pair_linear(x[row:row + 1].contiguous(), packed, 200, bias, *factors,
                                               0 if row >= tail else 1)
            assert torch.equal(alone, got[row:row + 1]), (rows, row)


def test_the_amx_build_is_this_cpus_bfloat16_product_where_it_runs():
    """On a CPU with AMX the widest build, the one the CPU path packs bfloat16 weights for, is the tile unit's; its
    products differ from vdpbf16ps's by summation order only (the same values within float32 rounding)."""
    amx = library_of("amx_bf16")
    assert kernel_isa() == "amx_bf16" and packed_pair_kernel()[1] is amx.packed_pair_linear
    assert amx.tile_unit_ready()  # Linux gave this process the tile registers: the products below use them
    other = library_of("avx512_bf16")
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 576, generator=generator).bfloat16(), torch.randn(5, 576, generator=generator).bfloat16()
    packed = amx.pack_column_pairs(weight)
    on_tiles = amx.packed_pair_linear(x, packed, 64, None, None, None, 5)
    with_vdpbf16ps = other.packed_pair_linear(x, packed, 64, None, None, None, 5)
    torch.testing.assert_close(on_tiles.float(), with_vdpbf16ps.float(), rtol=2**-7, atol=1e-2)


def test_every_build_this_cpu_runs_gives_the_float32_packed_product_the_same_bits():
    """The AVX2 build holds a 16-column block in two 8-lane registers, in row tiles of at most 6 (the AVX-512 builds:
    12) and with another prefetch: each lane's sum runs over the same terms in the same order, so every build this
    CPU runs must give each row the same bits, LoRA tail included, at every row count."""
    from hf_tidar.cpu.kernel import PACKED_ISAS, supported_isas

    isas = [isa for isa in PACKED_ISAS if isa in supported_isas()]
    if len(isas) < 2:
        pytest.skip(f"this CPU runs one build of the packed product ({', '.join(isas) or 'none'}): nothing to compare")
    generator = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(200, 72, generator=generator), torch.randn(200, generator=generator)
    lora_a, lora_b = torch.randn(4, 72, generator=generator), 0.1 * torch.randn(200, 4, generator=generator)
    x = torch.randn(30, 72, generator=generator)
    outputs = {}
    for isa in isas:
        library = library_of(isa)
        packed, factors = library.pack_columns(weight), (library.pack_codes(lora_a), library.pack_columns(lora_b))
        outputs[isa] = [library.packed_row_linear(x[:rows], packed, 200, bias, *factors, rows // 2)
                        for rows in (1, 5, 6, 7, 12, 13, 30)]
    first, *others = isas
    for isa in others:
        for got, expected in zip(outputs[isa], outputs[first], strict=True):
            assert torch.equal(got, expected), (isa, first, got.shape[0])

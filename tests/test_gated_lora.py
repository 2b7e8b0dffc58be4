"""Gated LoRA: adapters act only on [MASK] positions, so the clean (AR) path is exactly the base model's."""

import warnings

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar.training.gated_lora import (
    GATE_FILE,
    gated_lora_config,
    get_gated_lora_model,
    load_gated_lora,
    load_tidar_adapter,
    save_gated_lora,
    tidar_base_for_adapter,
)

VOCAB, BLOCK = 32, 4


def _trained_gated_model(tie: bool = False, steps: int = 8, seed: int = 0):
    """A gated-LoRA TiDAR model after a few optimizer steps on counting data, and its untouched AR source."""
    ar = tiny_ar_model("llama", vocab_size=VOCAB, tie=tie, seed=seed)
    model = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=4))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = counting_batch(4, 16, VOCAB, generator)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), ar


@pytest.mark.parametrize("tie", [False, True])
def test_clean_logits_exact_and_mask_logits_changed(tie):
    model, _ = _trained_gated_model(tie=tie)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n or "embedding_A" in n)
    ids = counting_batch(2, 12, VOCAB, torch.Generator().manual_seed(5))
    with torch.no_grad():
        gated = model(input_ids=ids, labels=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids, labels=ids).logits
        plain_ar = model(input_ids=ids).logits  # AR forward, no mask tokens at all
        with model.disable_adapter():
            plain_base = model(input_ids=ids).logits
    seq_len = ids.shape[1]
    assert torch.equal(gated[:, :seq_len], base[:, :seq_len])  # every clean logit, [MASK] column included
    assert not torch.allclose(gated[:, seq_len:], base[:, seq_len:])  # the drafts did change
    assert torch.equal(plain_ar, plain_base)
    assert all(p.grad is None or p.requires_grad for p in adapters)


def test_only_adapters_train_and_ar_loss_weight_is_zero():
    model, ar = _trained_gated_model(steps=2)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)
    assert model.base_model.model.config.ar_loss_weight == 0.0
    tidar = model.base_model.model
    for name, weight in ar.state_dict().items():  # base weights untouched by training
        if name in tidar.state_dict() and "embed_tokens" not in name and "lm_head" not in name:
            assert torch.equal(weight, tidar.state_dict()[name]), name


@pytest.mark.parametrize("tie", [False, True])
def test_tidar_greedy_equals_base_greedy_through_peft_generate(tie):
    model, ar = _trained_gated_model(tie=tie)
    prompt = counting_batch(1, 6, VOCAB, torch.Generator().manual_seed(3))
    out = model.generate(input_ids=prompt, max_new_tokens=20, strategy="tidar", return_dict_in_generate=True)
    reference = ar.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, reference)
    assert int(out.forward_passes[0]) < 20  # the strategy really ran (AR would need one pass per token)


def test_save_load_round_trip_and_wrong_base(tmp_path):
    model, ar = _trained_gated_model()
    save_gated_lora(model, tmp_path)
    assert (tmp_path / GATE_FILE).exists() and (tmp_path / "adapter_config.json").exists()
    ids = counting_batch(1, 8, VOCAB, torch.Generator().manual_seed(9))
    loaded = load_tidar_adapter(ar, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, labels=ids).logits, model(input_ids=ids, labels=ids).logits,
                                   rtol=0, atol=0)
    other = tiny_ar_model("llama", vocab_size=VOCAB, hidden_size=48)
    with pytest.raises(ValueError, match="different base model.*hidden_size"):
        load_tidar_adapter(other, tmp_path)
    wrong_mask = tidar_base_for_adapter(tiny_ar_model("llama", vocab_size=VOCAB + 1), block_size=BLOCK)
    with pytest.raises(ValueError, match="vocab_size"):
        load_gated_lora(wrong_mask, tmp_path)
    with pytest.raises(ValueError, match="not a gated TiDAR adapter"):
        load_tidar_adapter(ar, tmp_path / "missing")


def test_peft_alora_does_not_gate_tidar_layouts():
    """Why we gate ourselves: activated LoRA starts at the *last* invocation, so one mask token of a block of 4."""
    from peft.tuners.lora.variants import calculate_alora_offsets

    model, _ = _trained_gated_model(steps=0)
    mask = model.base_model.model.config.mask_token_id
    config = gated_lora_config(rank=2)
    config.alora_invocation_tokens = [mask]
    ids = torch.tensor([[5, 6, 7, mask, mask, mask, mask]])  # prefill layout: prompt + one group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offsets = calculate_alora_offsets({"default": config}, "default", ids)
    assert offsets == [1]  # aLoRA would adapt 1 of the 4 mask tokens
    with pytest.raises(ValueError, match="alora_invocation_tokens"):
        get_gated_lora_model(tidar_base_for_adapter(tiny_ar_model("llama"), block_size=BLOCK), config)


def test_lora_configs_that_would_break_the_gate_are_refused():
    from peft import LoraConfig

    from hf_tidar import TidarForCausalLM
    from hf_tidar.training.gated_lora import gated_lora_config, get_gated_lora_model

    with pytest.raises(ValueError, match="must be a list of module names"):
        gated_lora_config(target_modules="all-linear")
    tidar = TidarForCausalLM.from_ar(tiny_ar_model("llama"), block_size=4)
    for config in (LoraConfig(target_modules=["q_proj", "lm_head"]),
                   LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"])):
        with pytest.raises(ValueError, match="gated LoRA"):
            get_gated_lora_model(tidar, config)


def test_export_from_a_trainer_checkpoint_keeps_only_the_adapter(tmp_path):
    from hf_tidar.training.gated_lora import export_gated_adapter

    model, ar = _trained_gated_model()
    model.save_pretrained(tmp_path / "checkpoint-8", save_embedding_layers=True)  # what Trainer checkpoints hold
    out = export_gated_adapter(tmp_path / "checkpoint-8", tidar_base_for_adapter(ar, block_size=BLOCK),
                               tmp_path / "adapter")
    assert (out / GATE_FILE).exists()
    from safetensors.torch import load_file

    tensors = load_file(out / "adapter_model.safetensors")
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert not any("base_layer" in name for name in tensors)  # the base embedding stays out
    loaded = load_tidar_adapter(ar, out)
    prompt = counting_batch(1, 5, VOCAB, torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, eos_token_id=None, attention_mask=torch.ones_like(prompt))
    ids = dict(input_ids=prompt)
    assert torch.equal(loaded.generate(**ids, strategy="tidar", **kwargs), ar.generate(**ids, do_sample=False, **kwargs))
    with torch.no_grad():
        masks = torch.full_like(prompt, loaded.config.mask_token_id)
        torch.testing.assert_close(loaded(input_ids=torch.cat([prompt, masks], 1)).logits,
                                   model(input_ids=torch.cat([prompt, masks], 1)).logits.to(torch.float64),
                                   atol=1e-2, rtol=1e-2)  # fp16-stored adapter: close to the trained one


def test_truncating_an_adapters_rank_keeps_each_updates_best_approximation_and_exact_output(tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file

    from hf_tidar.training.gated_lora import save_gated_lora, saved_lora_config, truncate_adapter_rank

    model, ar = _trained_gated_model(steps=30)
    save_gated_lora(model, tmp_path / "rank4")
    with pytest.raises(ValueError, match="at least 1"):
        truncate_adapter_rank(tmp_path / "rank4", tmp_path / "rank0", 0)
    shutil.copytree(tmp_path / "rank4", tmp_path / "own-alpha")
    config_path = tmp_path / "own-alpha" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "alpha_pattern": {"q_proj": 8}}))
    with pytest.raises(ValueError, match="alpha_pattern"):  # q_proj's scale would change with r
        truncate_adapter_rank(tmp_path / "own-alpha", tmp_path / "own-alpha-r1", 1)
    kept = truncate_adapter_rank(tmp_path / "rank4", tmp_path / "rank1", 1)
    same = truncate_adapter_rank(tmp_path / "rank4", tmp_path / "rank4-again", 4)  # its own rank: unchanged
    assert kept and all(0 < share < 1 for share in kept.values()) and set(same.values()) == {1.0}
    config = saved_lora_config(tmp_path / "rank1")
    assert config.r == 1 and config.lora_alpha / config.r == saved_lora_config(tmp_path / "rank4").lora_alpha / 4
    full, cut = (load_file(tmp_path / folder / "adapter_model.safetensors") for folder in ("rank4", "rank1"))
    assert all(torch.equal(cut[n], t) for n, t in full.items() if "lora_embedding" in n)  # the [MASK] row's pair
    for name in [n for n in full if n.endswith(".lora_A.weight")]:
        delta = full[name.replace("lora_A", "lora_B")].double() @ full[name].double()
        u, s, vh = torch.linalg.svd(delta)
        best = s[0] * torch.outer(u[:, 0], vh[0])  # Eckart–Young: the best rank-1 approximation
        assert cut[name].shape[0] == 1
        torch.testing.assert_close(cut[name.replace("lora_A", "lora_B")].double() @ cut[name].double(), best,
                                   rtol=1e-5, atol=1e-6)  # the factors are stored in float32
        assert kept[name.removesuffix(".lora_A.weight")] == pytest.approx(float(s[0] ** 2 / (s ** 2).sum()))
    truncated = load_tidar_adapter(ar, tmp_path / "rank1")
    prompt = counting_batch(1, 5, VOCAB, torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, eos_token_id=None, attention_mask=torch.ones_like(prompt))
    assert torch.equal(truncated.generate(prompt, strategy="tidar", **kwargs),
                       ar.generate(prompt, do_sample=False, **kwargs))
    with torch.no_grad():  # the drafts changed: the update is not rank 1
        x = torch.cat([prompt, torch.full_like(prompt, truncated.config.mask_token_id)], 1)
        full_rank = load_tidar_adapter(ar, tmp_path / "rank4")
        assert not torch.allclose(truncated(input_ids=x).logits, full_rank(input_ids=x).logits)


# Options a gate on lora_A's output can't cover: each acts on clean tokens too (or, for DoRA, not through lora_A).
UNGATEABLE = [
    (dict(lora_bias=True), "lora_bias"),
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias='none'"),
]


def _save_adapter_past_the_creation_checks(folder, **options):
    """An adapter folder laid out like save_gated_lora's, made with plain PEFT and ``options``; returns its AR base."""
    from peft import LoraConfig, get_peft_model

    ar = tiny_ar_model("llama", vocab_size=VOCAB)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **options)  # PEFT has no lora_bias on embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tidar_base_for_adapter(ar, block_size=BLOCK), config)
    with torch.no_grad():  # a trained adapter: every delta (lora_B, its bias, DoRA's magnitude) non-zero
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    save_gated_lora(model, folder)
    return ar


@pytest.mark.parametrize("options,message", UNGATEABLE)
def test_load_refuses_adapters_the_gate_cannot_cover(tmp_path, options, message):
    ar = _save_adapter_past_the_creation_checks(tmp_path, **options)
    with pytest.raises(ValueError, match=f"gated LoRA.*{message}"):
        load_tidar_adapter(ar, tmp_path)


@pytest.mark.parametrize("options,message", UNGATEABLE + [
    (dict(init_lora_weights="pissa"), "init_lora_weights"),
    (dict(target_parameters=["mlp.up_proj.weight"]), "target_parameters"),
])
def test_creation_refuses_the_same_options(options, message):
    config = gated_lora_config(rank=4)
    for name, value in options.items():
        setattr(config, name, value)
    base = tidar_base_for_adapter(tiny_ar_model("llama", vocab_size=VOCAB), block_size=BLOCK)
    with pytest.raises(ValueError, match=f"gated LoRA.*{message}"):
        get_gated_lora_model(base, config)


@pytest.mark.parametrize("alpha", [None, 8])
def test_an_adapter_starts_a_higher_rank_run_with_the_same_drafts(tmp_path, alpha):
    """--init-adapter with a higher --lora-rank: the saved factors fill the first rows / columns, the new columns
    of B are zero (rescaled for another alpha / r), so the drafts are the saved adapter's and the new rank trains."""
    from hf_tidar.training.train import load_adapter_weights

    model, ar = _trained_gated_model()  # rank 4, alpha 8: scale 2
    save_gated_lora(model, tmp_path)
    grown = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=8, alpha=alpha))
    load_adapter_weights(grown, str(tmp_path))
    ids = counting_batch(2, 12, VOCAB, torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(grown(input_ids=ids, labels=ids).logits, model(input_ids=ids, labels=ids).logits,
                                   rtol=1e-5, atol=1e-6)
    q_proj = grown.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.count_nonzero(q_proj.lora_A["default"].weight[4:]) > 0  # fresh rows: the new rank gets gradients
    grown.train()
    grown(input_ids=ids, labels=ids).loss.backward()
    assert q_proj.lora_B["default"].weight.grad[:, 4:].abs().sum() > 0
    lower = get_gated_lora_model(tidar_base_for_adapter(ar, block_size=BLOCK), gated_lora_config(rank=2))
    with pytest.raises(ValueError, match="its own rank or a higher one"):
        load_adapter_weights(lower, str(tmp_path))

"""Every standard way to load a gated adapter refuses it; hf_tidar's loaders load it (and older folders) losslessly.

A gated adapter loaded as plain LoRA adapts every token, so the AR path would silently change. Its saved
config carries the ``TIDAR_GATED_LORA`` marker that PEFT and transformers can't load (hf_tidar.adapter_format).
"""

import json
import warnings

import pytest
import torch
from toy import counting_batch, tiny_ar_model

from hf_tidar.adapter_format import GATED_PEFT_TYPE, GatedLoraConfig, mark_gated
from hf_tidar.training.gated_lora import (
    check_gated_lora_config,
    export_gated_adapter,
    gated_lora_config,
    get_gated_lora_model,
    load_gated_lora,
    load_tidar_adapter,
    save_gated_lora,
    saved_lora_config,
    tidar_base_for_adapter,
)

VOCAB, BLOCK, SEED = 32, 4, 0


def _ar():
    return tiny_ar_model("llama", vocab_size=VOCAB, seed=SEED)


def _peft_type(folder) -> str:
    return json.loads((folder / "adapter_config.json").read_text())["peft_type"]


def _set_peft_type(folder, peft_type: str) -> None:
    """Rewrite the saved type: ``"LORA"`` gives the layout save_gated_lora wrote before the marker existed."""
    config = json.loads((folder / "adapter_config.json").read_text())
    config["peft_type"] = peft_type
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _training_logits(model, ids):
    """Logits of the training layout ``[ids | MASK..]``: clean rows first, mask (draft) rows second."""
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A gated adapter with non-zero deltas saved by save_gated_lora, its model, and a saved TiDAR base.

    ``base_model_name_or_path`` points at the base folder, so the Auto classes and ``pipeline`` really get as far
    as loading the adapter (offline).
    """
    root = tmp_path_factory.mktemp("gated")
    model = get_gated_lora_model(tidar_base_for_adapter(_ar(), block_size=BLOCK), gated_lora_config(rank=4)).eval()
    with torch.no_grad():  # a trained adapter: every delta non-zero
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    base = root / "base"
    tidar_base_for_adapter(_ar(), block_size=BLOCK).save_pretrained(base)
    adapter = root / "adapter"
    save_gated_lora(model, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return dict(model=model, base=base, adapter=adapter)


def _standard_load(way: str, adapter, base):
    """Load ``adapter`` as a user of PEFT / transformers would; returns the model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, pipeline

    from hf_tidar.training.data import byte_level_tokenizer

    if way == "PeftModel.from_pretrained":
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    if way == "load_adapter":
        model = AutoModelForCausalLM.from_pretrained(base)
        model.load_adapter(str(adapter))
        return model
    if way == "AutoModelForCausalLM":
        return AutoModelForCausalLM.from_pretrained(str(adapter))
    if way == "AutoPeftModelForCausalLM":
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    return pipeline("text-generation", model=str(adapter), tokenizer=byte_level_tokenizer()).model


WAYS = ["PeftModel.from_pretrained", "load_adapter", "AutoModelForCausalLM", "pipeline", "AutoPeftModelForCausalLM"]


def _clean_logits(model, base):
    """A plain AR forward's logits of ``model`` and of the base checkpoint loaded alone."""
    from transformers import AutoModelForCausalLM

    ids = counting_batch(1, 8, VOCAB, torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits, AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits


@pytest.mark.parametrize("way", WAYS)
def test_every_standard_way_refuses_with_a_message_naming_our_loader(saved, way):
    assert _peft_type(saved["adapter"]) == GATED_PEFT_TYPE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError) as refused:
            _standard_load(way, saved["adapter"], saved["base"])
    message = str(refused.value)  # pipeline wraps it in "Could not load model ..." with the original error's text
    assert "is a gated TiDAR adapter" in message and "hf_tidar.training.load_tidar_adapter(ar_model, folder)" in message
    if way == "PeftModel.from_pretrained":
        assert f"{saved['adapter']} is a gated TiDAR adapter" in message


@pytest.mark.parametrize("way", WAYS)
def test_without_hf_tidar_registered_the_marker_still_refuses(saved, way, monkeypatch):
    """What a user who never imported hf_tidar gets: PEFT's registry lookup fails on the unknown type."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    monkeypatch.delitem(PEFT_TYPE_TO_CONFIG_MAPPING, GATED_PEFT_TYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyError, match=GATED_PEFT_TYPE):
            _standard_load(way, saved["adapter"], saved["base"])


@pytest.mark.parametrize("way", WAYS)
def test_an_old_format_folder_loads_ungated_through_the_standard_ways_until_marked(saved, way, tmp_path):
    """Why the marker: the same files with peft_type "LORA" load silently and change the AR logits.

    Also shows that the clean-logit comparison above would catch an ungated load; mark_gated upgrades the folder.
    """
    import shutil

    old = tmp_path / "old"
    shutil.copytree(saved["adapter"], old)
    _set_peft_type(old, "LORA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ungated, base = _clean_logits(_standard_load(way, old, saved["base"]), saved["base"])
        assert not torch.allclose(ungated.to(base.dtype), base)
        mark_gated(old)
        with pytest.raises(ValueError, match="load_tidar_adapter"):
            _standard_load(way, old, saved["base"])


@pytest.mark.parametrize("marker", [GATED_PEFT_TYPE, "LORA"])
def test_our_loaders_load_marked_and_old_folders_losslessly(saved, marker, tmp_path):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(saved["adapter"], folder)
    _set_peft_type(folder, marker)
    ids = counting_batch(2, 8, VOCAB, torch.Generator().manual_seed(2))
    base = tidar_base_for_adapter(_ar(), block_size=BLOCK).eval()
    for loaded in (load_gated_lora(tidar_base_for_adapter(_ar(), block_size=BLOCK), folder).eval(),
                   load_tidar_adapter(_ar(), folder)):
        got, want, trained = (_training_logits(m, ids) for m in (loaded, base, saved["model"]))
        assert torch.equal(got[:, : ids.shape[1]], want[:, : ids.shape[1]])  # clean rows: the base model's
        assert torch.equal(got[:, ids.shape[1] :], trained[:, ids.shape[1] :])  # drafts: the trained adapter's
        assert not torch.equal(got[:, ids.shape[1] :], want[:, ids.shape[1] :])
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, base(input_ids=ids).logits)  # the AR path
    config = saved_lora_config(folder)
    assert isinstance(config, GatedLoraConfig) and config.peft_type == "LORA" and config.r == 4
    assert _peft_type(folder) == marker  # loading never rewrites the user's folder


def test_every_peft_save_of_a_gated_model_is_marked(saved, tmp_path):
    """Trainer checkpoints are ``model.save_pretrained``; a model loaded by us or wrapped from a plain LoraConfig too."""
    from peft import LoraConfig

    saved["model"].save_pretrained(tmp_path / "checkpoint-1", save_embedding_layers=True)
    loaded = load_gated_lora(tidar_base_for_adapter(_ar(), block_size=BLOCK), saved["adapter"])
    loaded.save_pretrained(tmp_path / "resaved")
    plain = LoraConfig(r=2, target_modules=["q_proj", "embed_tokens"])
    wrapped = get_gated_lora_model(tidar_base_for_adapter(_ar(), block_size=BLOCK), plain)
    wrapped.save_pretrained(tmp_path / "wrapped")
    assert type(plain) is LoraConfig  # the user's object is left alone
    for name in ("checkpoint-1", "resaved", "wrapped"):
        assert _peft_type(tmp_path / name) == GATED_PEFT_TYPE, name


@pytest.mark.parametrize("marker", [GATED_PEFT_TYPE, "LORA"])
def test_export_reads_marked_and_old_trainer_checkpoints(saved, marker, tmp_path):
    checkpoint = tmp_path / "checkpoint-8"
    saved["model"].save_pretrained(checkpoint, save_embedding_layers=True)  # what Trainer writes
    _set_peft_type(checkpoint, marker)
    out = export_gated_adapter(checkpoint, tidar_base_for_adapter(_ar(), block_size=BLOCK), tmp_path / "adapter",
                               dtype=torch.float64)
    assert _peft_type(out) == GATED_PEFT_TYPE
    ids = counting_batch(1, 8, VOCAB, torch.Generator().manual_seed(3))
    assert torch.equal(_training_logits(load_tidar_adapter(_ar(), out), ids), _training_logits(saved["model"], ids))


def test_other_adapter_types_are_still_refused_by_our_loaders(saved, tmp_path):
    import shutil

    shutil.copytree(saved["adapter"], tmp_path / "ia3")
    _set_peft_type(tmp_path / "ia3", "IA3")
    with pytest.raises(ValueError, match="needs a LoRA adapter, got peft_type='IA3'"):
        load_tidar_adapter(_ar(), tmp_path / "ia3")
    with pytest.raises(ValueError, match="not a LoRA one"):
        mark_gated(tmp_path / "ia3")


def test_shipped_adapters_carry_the_marker_and_read_as_gated_lora():
    from pathlib import Path

    import hf_tidar

    folders = sorted((Path(hf_tidar.__file__).parent / "adapters").glob("*/adapter_config.json"))
    assert folders, "the package ships at least the default adapter"
    for path in folders:
        assert _peft_type(path.parent) == GATED_PEFT_TYPE, path
        config = saved_lora_config(path.parent)
        check_gated_lora_config(config, str(path.parent))
        assert config.r == 4 and "embed_tokens" in config.target_modules  # trained at rank 16, truncated by SVD


def test_a_push_publishes_an_old_folder_marked_and_leaves_the_folder_alone(saved, tmp_path):
    import shutil

    from hf_tidar.hub import plan_upload

    old = tmp_path / "old"
    shutil.copytree(saved["adapter"], old)
    _set_peft_type(old, "LORA")
    before = (old / "adapter_config.json").read_text()
    published = plan_upload(old).files["adapter_config.json"]
    assert json.loads(published)["peft_type"] == GATED_PEFT_TYPE
    assert {**json.loads(published), "peft_type": "LORA"} == json.loads(before)  # only the type changes
    assert (old / "adapter_config.json").read_text() == before

"""What a new user meets first: plain float32 conversions, errors that say what to do, only warnings that matter."""

import json
import logging
import warnings

import pytest
import torch
from toy import tiny_ar_model
from transformers import AutoModelForCausalLM, GgufConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

from hf_tidar import CdlmForCausalLM, TidarForCausalLM
from hf_tidar.checkpoints import SMOLLM2_NAME, smollm2_path
from hf_tidar.generation import cost_profile
from hf_tidar.training import byte_level_tokenizer
from hf_tidar.training.gated_lora import (
    get_gated_lora_model,
    load_tidar_adapter,
    save_gated_lora,
    tidar_base_for_adapter,
)


def _gguf_loaded_ar_model():
    """What transformers returns for a GGUF file it unpacked: plain tensors, a GGUF quantization_config kept."""
    ar = tiny_ar_model("llama", vocab_size=50).float()
    ar.config.quantization_config = GgufConfig(gguf_file="model.Q4_1.gguf")
    return ar


@pytest.mark.parametrize("convert", [
    lambda ar: TidarForCausalLM.from_ar(ar, block_size=2),
    lambda ar: CdlmForCausalLM.from_ar(ar, block_size=4),
])
def test_a_gguf_loaded_model_converts_to_a_plain_model_that_saves_twice(convert, tmp_path):
    model = convert(_gguf_loaded_ar_model())
    assert "quantization_config" not in model.config.to_dict()["text_config"]
    model.save_pretrained(tmp_path / "once")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "once", dtype=torch.bfloat16)
    assert getattr(reloaded, "hf_quantizer", None) is None and not getattr(reloaded, "is_quantized", False)
    reloaded.save_pretrained(tmp_path / "twice")


def test_folders_converted_before_lose_the_stale_gguf_entry(tmp_path):
    TidarForCausalLM.from_ar(tiny_ar_model("llama", vocab_size=50).float(), block_size=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["quantization_config"] = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert getattr(reloaded, "hf_quantizer", None) is None
    reloaded.save_pretrained(tmp_path / "again")


def test_a_cached_smollm2_config_with_the_gguf_entry_is_mended(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path))
    folder = tmp_path / SMOLLM2_NAME
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    quantized = {"model_type": "llama", "quantization_config": {"quant_method": "gguf", "dequantize": False}}
    (folder / "config.json").write_text(json.dumps(quantized))
    assert smollm2_path() == folder
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}


# -- errors that say what to do ---------------------------------------------------------------------


def test_from_ar_on_a_converted_model_says_to_pass_the_ar_model(tmp_path):
    tokenizer = byte_level_tokenizer()
    ar = tiny_ar_model("llama", vocab_size=len(tokenizer)).float()
    save_gated_lora(get_gated_lora_model(tidar_base_for_adapter(ar, tokenizer, block_size=2)), tmp_path / "adapter")
    converted = TidarForCausalLM.from_ar(ar, block_size=2)
    with pytest.raises(ValueError, match="pass the original AR model"):
        TidarForCausalLM.from_ar(converted)
    with pytest.raises(ValueError, match="pass the original AR model"):
        load_tidar_adapter(converted, tmp_path / "adapter")


def test_from_ar_on_a_missing_path_says_it_does_not_exist(tmp_path):
    for missing in (tmp_path / "nothing-here", "./nothing-here", "some/deeper/folder"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            TidarForCausalLM.from_ar(missing)


# -- warnings only where the user should act --------------------------------------------------------


def test_conversion_and_adapter_loading_print_no_notice_about_our_own_choices(tmp_path):
    tokenizer = byte_level_tokenizer()
    ar = tiny_ar_model("llama", vocab_size=len(tokenizer), tie=True).float()
    save_gated_lora(get_gated_lora_model(tidar_base_for_adapter(ar, byte_level_tokenizer())), tmp_path / "adapter")
    logging.Logger.warning_once.cache_clear()  # transformers shows each notice once per process
    logger = hf_logging.get_logger("transformers.modeling_utils")
    with CaptureLogger(logger) as captured, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TidarForCausalLM.from_ar(ar, block_size=2)  # mean-resizes the embeddings for [MASK]
        TidarForCausalLM.from_ar(tiny_ar_model("llama", tie=False), block_size=2)  # ...and an untied LM head
        load_tidar_adapter(ar, tmp_path / "adapter", tokenizer=byte_level_tokenizer())  # PEFT, tied embedding
    assert captured.out == ""
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("strategy", ["ar", "tidar"])
def test_generating_past_the_position_limit_is_reported(strategy):
    model = TidarForCausalLM.from_ar(tiny_ar_model("llama", max_position_embeddings=16), block_size=2)
    prompt = torch.randint(0, 64, (1, 10))
    logging.Logger.warning_once.cache_clear()
    logger = hf_logging.get_logger("transformers.generation.stopping_criteria")
    with CaptureLogger(logger) as captured:
        model.generate(prompt, max_new_tokens=4, strategy=strategy, do_sample=False)
    assert captured.out == ""  # 14 tokens fit the 16 positions
    with CaptureLogger(logger) as captured:
        model.generate(prompt, max_new_tokens=10, strategy=strategy, do_sample=False)
    assert "exceeded the model's predefined maximum length (16)" in captured.out


# -- draft_layout="auto": says what it measures, records the load, re-measures a skewed profile -------


@pytest.fixture
def small_tidar(tmp_path, monkeypatch):
    """A tiny TiDAR model with a private profile cache, on a machine that reports a quiet load."""
    monkeypatch.setenv("HF_TIDAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_profile, "machine_load", lambda: {"loadavg": 0.2, "cpus": 2})
    # A tiny model's sub-millisecond timings are noisy on a busy machine; tests of noise set the limit back.
    monkeypatch.setattr(cost_profile, "NOISY_SPREAD", float("inf"))
    return TidarForCausalLM.from_ar(tiny_ar_model("llama").float(), block_size=2)


def test_the_first_auto_layout_call_says_what_it_measures_and_where_it_is_cached(small_tidar, capsys):
    prompt = torch.randint(0, 64, (1, 5))
    small_tidar.generate(prompt, max_new_tokens=3, strategy="tidar", draft_layout="auto")
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("[hf_tidar]")]
    path = cost_profile.profile_path(small_tidar)
    assert len(notices) == 2 and "measuring this machine's forward cost" in notices[0]
    assert " s, once per model" in notices[0] and str(path) in notices[0] and "hf-tidar profile" in notices[0]
    assert "timing 6 draft layouts as real passes" in notices[1] and str(path.parent) in notices[1]  # block 2: 3 + 3
    assert "Profiling forward cost" not in err  # no progress bar when stderr is not a terminal
    profile = json.loads(path.read_text())
    assert profile["cpus"] == 2 and profile["loadavg"] == 0.2 and profile["remeasured"] is False
    del small_tidar._tidar_auto_plan
    small_tidar.generate(prompt, max_new_tokens=3, strategy="tidar", draft_layout="auto")
    assert "[hf_tidar]" not in capsys.readouterr().err  # cached: nothing measured, nothing said


def test_a_profile_on_the_measured_cpu_path_follows_the_kernel_build(small_tidar, monkeypatch):
    # A rebuilt (or another) few-row kernel changes every pass's cost: its profile must not be reused.
    from hf_tidar import cpu
    from hf_tidar.cpu import linear

    plain = cost_profile.profile_path(small_tidar)
    cpu.enable(small_tidar)
    try:
        measured = cost_profile.profile_path(small_tidar)
        monkeypatch.setattr(linear, "build_key", lambda *a: "another-build")
        monkeypatch.setattr(linear, "few_row_kernel", lambda *a: object())
        rebuilt = cost_profile.profile_path(small_tidar)
    finally:
        cpu.disable(small_tidar)
    assert len({plain, measured, rebuilt}) == 3 and cost_profile.profile_path(small_tidar) == plain


def test_profiling_shows_progress_on_a_terminal(small_tidar, capsys, monkeypatch):
    monkeypatch.setattr(cost_profile, "_stderr_is_terminal", lambda: True)
    cost_profile.load_or_measure_costs(small_tidar, 4)
    assert "Profiling forward cost" in capsys.readouterr().err


def _cache_profile(model, **fields):
    path = cost_profile.profile_path(model)
    path.parent.mkdir(parents=True)
    profile = {"seconds": {"1": 1.0, "2": 1.0, "4": 1.0, "6": 1.0}, "loadavg": 0.1, "cpus": 2, "spread": 0.0,
               "remeasured": False, **fields}
    path.write_text(json.dumps(profile))
    return path


@pytest.mark.parametrize("skew", [{"loadavg": 40.0}, {"spread": 0.9}])
def test_a_skewed_profile_is_measured_again_when_the_machine_is_quiet(small_tidar, monkeypatch, capsys, skew):
    path = _cache_profile(small_tidar, **skew)
    monkeypatch.setattr(cost_profile, "NOISY_SPREAD", 0.3)
    costs = cost_profile.load_or_measure_costs(small_tidar, 6)
    assert costs[1] != 1.0 and "measuring it again" in capsys.readouterr().err
    profile = json.loads(path.read_text())
    assert profile["loadavg"] == 0.2 and profile["remeasured"] is True


def test_a_skewed_profile_is_kept_with_a_warning_while_the_machine_is_busy(small_tidar, monkeypatch, capsys):
    _cache_profile(small_tidar, loadavg=40.0)
    monkeypatch.setattr(cost_profile, "machine_load", lambda: {"loadavg": 30.0, "cpus": 2})
    assert cost_profile.load_or_measure_costs(small_tidar, 6)[1] == 1.0
    err = capsys.readouterr().err
    assert "looks skewed (measured under a load average of 40.0 on 2 cores)" in err and "hf-tidar profile" in err


def test_the_cost_curve_is_fitted_non_decreasing_and_keeps_what_was_measured(small_tidar, monkeypatch):
    # A dip (noise on a drifting machine) would make a longer layout look cheaper than a shorter one.
    assert cost_profile.monotone_costs({1: 1.0, 2: 1.3, 3: 1.1, 4: 1.2, 6: 2.0}) == \
        pytest.approx({1: 1.0, 2: 1.2, 3: 1.2, 4: 1.2, 6: 2.0})
    assert cost_profile.monotone_costs({1: 3.0, 2: 1.0}) == pytest.approx({1: 2.0, 2: 2.0})
    rising = {1: 1.0, 2: 1.5, 4: 3.0}
    assert cost_profile.monotone_costs(rising) == rising
    monkeypatch.setattr(cost_profile, "_probe_prefill", lambda model: (0.001, 0.0))
    monkeypatch.setattr(cost_profile, "measure_forward_cost",
                        lambda model, lengths, **kw: {q: {1: 1.0, 2: 0.8, 3: 1.2, 4: 1.3}.get(q, 2.0) for q in lengths})
    costs = cost_profile.load_or_measure_costs(small_tidar, 4)
    assert costs[1] == costs[2] == pytest.approx(0.9) and costs[3] == 1.2
    stored = json.loads(cost_profile.profile_path(small_tidar).read_text())
    assert stored["measured"]["2"] == 0.8 and stored["seconds"]["2"] == pytest.approx(0.9)
    assert stored["spread"] == pytest.approx(0.2)  # the dip is part of the noise reading


def test_every_length_is_timed_in_each_round_against_one_prefill(small_tidar, monkeypatch):
    calls = []
    original = small_tidar.model.forward

    def spy(*args, input_ids=None, **kwargs):
        calls.append(input_ids.shape[1])
        return original(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(small_tidar.model, "forward", spy)
    costs = cost_profile.measure_forward_cost(small_tidar, [1, 2, 4], cache_len=16, repeats=3)
    assert calls == [16] + [1, 2, 4] * 4  # one prefill, a warm-up round, then 3 interleaved rounds
    assert sorted(costs) == [1, 2, 4] and all(t > 0 for t in costs.values())

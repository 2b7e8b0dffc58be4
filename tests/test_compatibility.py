"""Every private transformers / PEFT / torch API that hf_tidar relies on still exists and behaves as used.

docs/compatibility.md lists them with the reason for each; when an upgrade removes one, the test
named after it fails here, before anything deeper breaks.
"""

import pytest
import torch
import transformers
from toy import tiny_ar_model
from transformers import GenerationConfig, GenerationMixin, PrefixConstrainedLogitsProcessor

VERSION = f"transformers {transformers.__version__}"


@pytest.mark.parametrize("name", ["_get_logits_processor", "_get_stopping_criteria", "_prepare_generation_config",
                                  "_prepare_special_tokens"])
def test_generation_mixin_keeps_the_methods_we_override_or_call(name):
    assert callable(getattr(GenerationMixin, name, None)), f"{VERSION} has no GenerationMixin.{name}"


def test_prepare_generation_config_returns_the_config_and_the_leftover_kwargs():
    model = tiny_ar_model("llama")
    config, kwargs = model._prepare_generation_config(None, max_new_tokens=3, strategy="tidar")
    assert isinstance(config, GenerationConfig) and config.max_new_tokens == 3
    assert isinstance(kwargs, dict)


def test_prepare_special_tokens_sets_the_pad_token_tensor():
    model = tiny_ar_model("llama")
    config = GenerationConfig(pad_token_id=0, eos_token_id=1)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=torch.device("cpu"))
    assert isinstance(config._pad_token_tensor, torch.Tensor) and int(config._pad_token_tensor) == 0


def test_prefix_constrained_processor_keeps_its_function_and_beam_count():
    function = lambda batch_id, ids: [0]  # noqa: E731
    processor = PrefixConstrainedLogitsProcessor(function, num_beams=2)
    assert processor._prefix_allowed_tokens_fn is function and processor._num_beams == 2


def test_generation_config_from_model_config_flag_still_exists():
    config = GenerationConfig.from_model_config(tiny_ar_model("llama").config)
    assert config._from_model_config is True


def test_config_attn_implementation_is_readable_and_settable():
    config = tiny_ar_model("llama").config
    config._attn_implementation = "eager"
    assert config._attn_implementation == "eager"


def test_the_mask_carrier_can_still_be_made():
    assert callable(torch._C._disabled_torch_function_impl)
    assert callable(torch.Tensor._make_subclass)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_onednn_linear_ops_are_offered_only_when_present_and_compute_a_linear(dtype):
    from hf_tidar.cpu import linear

    ops_present = all(hasattr(torch.ops.mkldnn, n) for n in ("_reorder_linear_weight", "_linear_pointwise"))
    # oneDNN refuses to pack bfloat16 on a CPU without AVX-512 or AVX-NE-CONVERT (AVX2 only): not offered there.
    dtype_supported = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    offered = torch.backends.mkldnn.is_available() and ops_present and dtype_supported
    assert linear._onednn_available(dtype) == offered
    assert ("onednn" in linear.methods_for(dtype)) == offered
    if not offered:
        pytest.skip(f"this CPU or torch build has no oneDNN {dtype} linear (the measured path then never offers it)")
    weight, x = torch.randn(24, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_method_offered_for_a_dtype_runs_on_this_cpu(dtype):
    from hf_tidar.cpu import linear

    timings = linear.profile_shape(32, 16, dtype, repeats=1, cold_bytes=0)
    assert set(timings) == set(linear.methods_for(dtype))
    assert all(seconds > 0 for per_rows in timings.values() for seconds in per_rows.values())


def test_peft_keeps_its_config_registry_and_hf_tidar_registered_the_refusal():
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from hf_tidar.adapter_format import GATED_PEFT_TYPE, GatedAdapterRefusal

    assert PEFT_TYPE_TO_CONFIG_MAPPING.get(GATED_PEFT_TYPE) is GatedAdapterRefusal


def test_argparse_can_copy_the_options_hf_argument_parser_builds():
    import argparse

    from transformers import HfArgumentParser, TrainingArguments

    source = HfArgumentParser(TrainingArguments, add_help=False)
    target = argparse.ArgumentParser()
    target._add_container_actions(source)
    assert target.parse_args(["--output_dir", "x", "--weight-decay", "0.1"]).weight_decay == 0.1

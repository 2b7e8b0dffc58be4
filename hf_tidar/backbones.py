"""Loading the AR backbone checkpoint a TiDAR or CDLM model wraps, with errors that say what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoModelForCausalLM, PreTrainedModel

from .configuration import is_gguf_quantization


def load_causal_lm(model_or_path: PreTrainedModel | str | os.PathLike, **from_pretrained_kwargs) -> PreTrainedModel:
    """A loaded ``PreTrainedModel`` as is, or ``AutoModelForCausalLM.from_pretrained`` of a folder / hub id.

    Raises:
        FileNotFoundError: ``model_or_path`` is neither an existing path nor something a Hub id can be.
    """
    if isinstance(model_or_path, (str, os.PathLike)):
        check_local_path_exists(model_or_path)
        return AutoModelForCausalLM.from_pretrained(model_or_path, **from_pretrained_kwargs)
    if isinstance(model_or_path, PreTrainedModel):
        return model_or_path
    raise TypeError(f"Expected a PreTrainedModel or a path, got {type(model_or_path).__name__}.")


def check_local_path_exists(path: str | os.PathLike) -> None:
    """Raise ``FileNotFoundError`` for a path that does not exist and cannot be a Hub id either.

    transformers would try it as a Hub id and fail with "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'", which hides that a local folder is simply missing.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(path).exists():
        return
    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise FileNotFoundError(f"no model folder at {path} (the path does not exist)") from None


def check_dense_weights(source: PreTrainedModel) -> None:
    """Refuse a GGUF model whose weights transformers kept packed: there are no plain tensors to copy."""
    quantizer = getattr(source, "hf_quantizer", None)
    if is_gguf_quantization(getattr(source.config, "quantization_config", None)) and getattr(
        quantizer, "packed_modules", None
    ):
        raise ValueError(
            "This GGUF model keeps its weights packed in GGUF blocks. Load it unpacked to convert it: "
            "from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))."
        )

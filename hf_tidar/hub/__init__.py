"""Model cards and Hub publishing for TiDAR models, gated TiDAR adapters and CDLM models.

Cards are ``huggingface_hub.ModelCard`` objects rendered from the Jinja templates in
``hf_tidar/model_cards/``; their metadata is a ``ModelCardData``. Publishing makes one upload
(``HfApi.upload_folder``) holding exactly the files a user needs: safetensors weights, ``config.json``,
``generation_config.json`` with the default strategy, the tokenizer, the card and, for adapters, the PEFT
adapter files. The local folder is only read, never written.

The package: :mod:`.saved_folder` (what a saved folder holds), :mod:`.cards` (rendering and checking cards)
and :mod:`.publish` (planning and making the upload; not named ``push``, which is the function).
"""

from .cards import (
    BENCHMARK_KEYS,
    CARD_FILE,
    COMMON_TAGS,
    DEFAULT_STRATEGY,
    KIND_TAGS,
    KINDS,
    TRAINING_KEYS,
    CardInputs,
    adapter_snippet,
    benchmark_section,
    check_card,
    check_hub_id,
    model_snippet,
    render_card,
    strategy_text,
    training_section,
)
from .publish import (
    ADAPTER_FILES,
    CONFIG_FILES,
    HUB_ERRORS,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    HubPushError,
    UploadPlan,
    plan_upload,
    push,
    set_default_strategy,
)
from .saved_folder import detect_kind, resolve_folder, saved_strategy

__all__ = [
    "ADAPTER_FILES",
    "BENCHMARK_KEYS",
    "CARD_FILE",
    "COMMON_TAGS",
    "CONFIG_FILES",
    "DEFAULT_STRATEGY",
    "HUB_ERRORS",
    "KINDS",
    "KIND_TAGS",
    "TOKENIZER_FILES",
    "TRAINING_KEYS",
    "WEIGHT_FILES",
    "CardInputs",
    "HubPushError",
    "UploadPlan",
    "adapter_snippet",
    "benchmark_section",
    "check_card",
    "check_hub_id",
    "detect_kind",
    "model_snippet",
    "plan_upload",
    "push",
    "render_card",
    "resolve_folder",
    "saved_strategy",
    "set_default_strategy",
    "strategy_text",
    "training_section",
]

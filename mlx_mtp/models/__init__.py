"""MTP family registry: one module per Hugging Face ``model_type``.

A family module provides ``MTP_CONFIG_KEYS``, ``declared_mtp_layers(config)``,
``mtp_layer_of(key, config)``, ``split_weights(weights, config)``,
``sanitize(weights, config, trunk, raw)`` and ``make_layer(trunk, j)``. It may add
``is_raw(weights, config)`` (the checkpoint needs the family's raw-HF fixes),
``prepare(trunk)`` (install per-position state capture in recurrent mixers),
``text_args(trunk)``, and override ``hidden``, ``logits`` and ``embed`` (see `base`).
"""

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

FAMILIES = (
    "deepseek_v3",
    "glm4_moe",
    "llama",
    "mimo",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
)


def get_family(config: dict) -> ModuleType:
    """The family module for a config, or a clear error naming the supported ones."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; mlx-mtp supports: "
            + ", ".join(FAMILIES)
        )
    return importlib.import_module(f"{__name__}.{model_type}")

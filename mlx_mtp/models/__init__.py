"""MTP family registry: one module per Hugging Face ``model_type``.

A family module provides ``MTP_CONFIG_KEYS``, ``declared_mtp_layers(config)``,
``mtp_layer_of(key, config)``, ``split_weights(weights, config)``,
``sanitize(weights, config, trunk)`` and ``make_layer(trunk, j)``, and may override
``hidden``, ``logits`` and ``embed`` (see `base`).
"""

import importlib
from types import ModuleType

from ..errors import UnsupportedModelError

FAMILIES = ("deepseek_v3", "glm4_moe", "mimo")


def get_family(config: dict) -> ModuleType:
    """The family module for a config, or a clear error naming the supported ones."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; mlx-mtp supports: "
            + ", ".join(FAMILIES)
        )
    return importlib.import_module(f"{__name__}.{model_type}")

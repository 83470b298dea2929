"""MTP family registry: one module per Hugging Face ``model_type``, each ending in its
``FAMILY`` (`mlx_mtp.models.family` has the interface, its defaults and the files a new
family touches). Trunks whose checkpoints ship no heads share `retrofit` (heads from
`train-heads`)."""

import dataclasses
import importlib

from ..errors import UnsupportedModelError
from .family import Family

FAMILIES = (
    "bailing_hybrid",
    "bailing_moe_v3",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "deepseek_v41",
    "ernie4_5_moe",
    "exaone_moe",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "gemma4_unified",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "glm_ocr",
    "glm5_next",
    "gpt_oss",
    "hy_v4",
    "llama",
    "longcat_flash",
    "mimo",
    "mimo_v2_flash",
    "mistral",
    "nemotron_h",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen4_exp",
    "step3p5",
    "step3p7",
)

# Model types that share another's module.
SHARED = {
    "gemma4_text": "gemma4",
    "gemma4_unified": "gemma4",
    "glm_moe_dsa": "deepseek_v32",
}

# Trunks with no MTP heads of their own whose family is `retrofit`: a DeepSeek-style
# layer shaped as the trunk's last decoder layer (Gemma 3, gpt-oss and Mistral can
# interleave sliding-window layers; see `mlx_mtp.cache.WindowCache`). Each is tested
# on a fixture (`mlx_mtp.testing.fixtures.write_retrofitted`).
RETROFITTED = {
    "gemma3_text": "retrofit",
    "gpt_oss": "retrofit",
    "mistral": "retrofit",
    "qwen2": "retrofit",
    "qwen3": "retrofit",
}


def get_family(config: dict) -> Family:
    """The family of a config, or a clear error naming the supported ones."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; mlx-mtp supports: "
            + ", ".join(FAMILIES)
        )
    family = Family.from_module(importlib.import_module(module_of(model_type)))
    return dataclasses.replace(family, name=model_type)


def module_of(model_type: str) -> str:
    """The family module of a supported model type."""
    name = RETROFITTED.get(model_type, SHARED.get(model_type, model_type))
    return f"{__name__}.{name}"

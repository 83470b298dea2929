"""Gemma 4 targets (``gemma4``, ``gemma4_unified`` and ``gemma4_text``): no MTP layers
of their own; Google ships their drafters as separate checkpoints, the assistants
(`mlx_mtp.models.gemma4_assistant`), which read this trunk's caches.

The trunk is mlx-lm's (``gemma4`` wraps ``gemma4_text`` as ``language_model``; the
unified variant loads with the same class). What differs from the defaults: the text
model sits one level down in the multimodal wrapper, the logits are soft-capped
(``final_logit_softcapping``), and ``embed`` is the embedding as the first layer sees
it, scaled by sqrt(H): the assistant's input. A ``gemma4`` checkpoint with its vision
tower reads images (`mlx_mtp.models.gemma_vision`).
"""

from typing import Optional

import mlx.core as mx

from . import gemma_vision
from .family import Layout, define

# transformers' Gemma4TextConfig defaults where mlx-lm's ModelArgs defaults differ: a
# config written by transformers leaves out every value equal to its default.
HF_TEXT_DEFAULTS = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_key_value_heads": 4,
    "final_logit_softcapping": None,
    "use_double_wide_mlp": False,
    "num_kv_shared_layers": 0,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
}
# Gemma4UnifiedTextConfig's defaults where they differ again (no per-layer inputs).
HF_UNIFIED_TEXT_DEFAULTS = {
    "sliding_window": 1024,
    "max_position_embeddings": 262144,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
}
HF_SLIDING_PATTERN = 6  # transformers' default layer_types: 5 sliding, 1 full


def hf_text_config(text_config: dict) -> dict:
    """A Gemma 4 text config as transformers reads it, with every value mlx-lm's
    ``ModelArgs`` would otherwise default differently written out (layer types
    included: transformers' default pattern, last layer full attention). A
    ``gemma4_unified_text`` config has the unified model's defaults."""
    defaults = dict(HF_TEXT_DEFAULTS)
    if text_config.get("model_type") == "gemma4_unified_text":
        defaults.update(HF_UNIFIED_TEXT_DEFAULTS)
    cfg = {**defaults, **text_config}
    if not cfg.get("layer_types"):
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = [
            "sliding_attention" if (i + 1) % HF_SLIDING_PATTERN else "full_attention"
            for i in range(n)
        ]
    if cfg["layer_types"] and cfg["layer_types"][-1] != "full_attention":
        cfg["layer_types"] = cfg["layer_types"][:-1] + ["full_attention"]
    return cfg


def fix_config(config: dict) -> dict:
    """Config values for mlx-lm: the text config with transformers' defaults written
    out, and (multimodal) the top-level ``vocab_size`` mlx-lm takes the text
    vocabulary from."""
    if "text_config" in config:
        text = hf_text_config(config["text_config"])
        return {"text_config": text, "vocab_size": text.get("vocab_size", 262144)}
    return {k: v for k, v in hf_text_config(config).items() if k not in config}


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    return None


def split_weights(weights: dict, config: dict):
    return weights, {}


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    return {}


def make_layer(trunk, j: int, config: dict):
    raise NotImplementedError("Gemma 4 drafts with an assistant, not MTP layers")


def text_model(trunk):
    """The mlx-lm ``gemma4_text.Model`` inside the trunk."""
    return getattr(trunk, "language_model", trunk)


def text_args(trunk):
    return text_model(trunk).args


def trunk_classes(config: dict):
    """mlx-lm's class for the checkpoint; a multimodal ``gemma4`` one able to keep
    its vision tower (`mlx_mtp.models.gemma_vision`)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if config.get("model_type") == "gemma4" and "vision_config" in config:
        return gemma_vision.with_vision(model_class, config), args_class
    if config.get("model_type") == "gemma4_unified":

        class Unified(model_class):
            vision_refusal = (
                "Gemma 4 unified's encoder-free vision (vision_embedder) is not "
                "read: it runs as a text model"
            )

        Unified.__name__ = Unified.__qualname__ = model_class.__name__
        return Unified, args_class
    return model_class, args_class


def hidden(trunk, inputs: mx.array, cache):
    if gemma_vision.reads_images(trunk):
        return gemma_vision.hidden(trunk, inputs, cache)
    return text_model(trunk).model(inputs, cache)


def logits(trunk, h: mx.array) -> mx.array:
    lm = text_model(trunk)
    out = (
        lm.model.embed_tokens.as_linear(h) if lm.tie_word_embeddings else lm.lm_head(h)
    )
    cap = lm.final_logit_softcapping
    return out if not cap else mx.tanh(out / cap) * cap


def head(trunk):
    lm = text_model(trunk)
    return lm.model.embed_tokens if lm.tie_word_embeddings else lm.lm_head


def embed(trunk, ids: mx.array) -> mx.array:
    model = text_model(trunk).model
    return model.embed_tokens(ids) * model.embed_scale


def final_norm(trunk):
    return text_model(trunk).model.norm


FAMILY = define(
    LAYOUT=Layout(prefix=lambda config, j: "", fusion={}),
    MTP_CONFIG_KEYS=(),  # no MTP layers: Gemma 4 drafts with an assistant
    EMBEDDING_KEY="model.language_model.embed_tokens.weight",
    FINAL_NORM_KEY="model.language_model.norm.weight",
    fix_config=fix_config,
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    text_args=text_args,
    trunk_classes=trunk_classes,
    hidden=hidden,
    image_processor=gemma_vision.image_processor,
    media=gemma_vision.media,
    image_placeholder=gemma_vision.image_placeholder,
    logits=logits,
    head=head,
    embed=embed,
    final_norm=final_norm,
)

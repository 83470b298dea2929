"""Qwen3.5 / Qwen3.6 dense MTP (the MoE variant is `qwen3_5_moe`).

The checkpoint nests the text model under ``model.language_model.`` (config in
``text_config``), and keeps the MTP tensors at top-level ``mtp.``, in the Qwen layout
described in `qwen3_next`. The MTP block is the family's full-attention decoder layer.
The vision tower at ``model.visual.`` is kept and reads images where mlx-vlm is
installed (`qwen_vision`).
"""

from mlx_lm.models import qwen3_5 as lm
from mlx_lm.models.base import gather_last_axis

from . import qwen3_next, qwen_vision
from .mtp import MTPLayer


def is_raw(weights: dict, config: dict) -> bool:
    """True when mlx-lm's qwen3_5 sanitize shifts this checkpoint's norms."""
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def text_args(trunk):
    return trunk.language_model.args


def head(trunk):
    lm_model = trunk.language_model
    if lm_model.args.tie_word_embeddings:
        return lm_model.model.embed_tokens
    return lm_model.lm_head


def logits(trunk, h):
    lm_model = trunk.language_model
    if lm_model.args.tie_word_embeddings:
        return lm_model.model.embed_tokens.as_linear(h)
    out = lm_model.lm_head(h)
    if lm_model.sharding_group is not None:  # a tensor-parallel head's vocab slices
        out = gather_last_axis(out, lm_model.sharding_group)
    return out


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = text_args(trunk)
    block = qwen3_next.make_block(args, lm.DecoderLayer, lm.SparseMoeBlock, lm.MLP)
    if qwen_vision.reads_images(trunk):
        return qwen_vision.Layer(args.hidden_size, args.rms_norm_eps, block, args)
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


def trunk_classes(config: dict):
    """mlx-lm's class for the checkpoint, able to keep its vision tower."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return qwen_vision.with_vision(model_class, config), args_class


# Qwen3-Next's layout, split, sanitize and Gated-DeltaNet capture, on a trunk nested
# under model.language_model. (mlx-lm's ``trunk.model`` reaches into it)
FAMILY = qwen3_next.FAMILY.derive(
    MTP_CONFIG_KEYS=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
    EMBEDDING_KEY="model.language_model.embed_tokens.weight",
    FINAL_NORM_KEY="model.language_model.norm.weight",
    is_raw=is_raw,
    text_args=text_args,
    head=head,
    logits=logits,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    hidden=qwen_vision.hidden,
    image_processor=qwen_vision.image_processor,
    media=qwen_vision.media,
    image_placeholder=qwen_vision.image_placeholder,
)

"""Qwen3.5 / Qwen3.6 dense MTP (the MoE variant is `qwen3_5_moe`).

The checkpoint nests the text model under ``model.language_model.`` (config in
``text_config``), and keeps the MTP tensors at top-level ``mtp.``, in the Qwen layout
described in `qwen3_next`. The MTP block is the family's full-attention decoder layer.
"""

from mlx_lm.models import qwen3_5 as lm
from mlx_lm.models.base import gather_last_axis

from .capture import install_capture
from .mtp import MTPLayer
from .qwen3_next import (  # noqa: F401  (the family interface)
    LAYOUT,
    declared_mtp_layers,
    make_block,
    mtp_layer_of,
    sanitize,
    split_weights,
)

MTP_CONFIG_KEYS = ("mtp_num_hidden_layers",)


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
    block = make_block(args, lm.DecoderLayer, lm.SparseMoeBlock, lm.MLP)
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


def prepare(trunk) -> None:
    """Make the trunk's Gated-DeltaNet layers record per-position states on request."""
    install_capture(trunk.layers)

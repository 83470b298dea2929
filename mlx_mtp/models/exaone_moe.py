"""EXAONE-MoE (``exaone_moe``, K-EXAONE): Qwen3-Next's MTP names on EXAONE layers.

Tensors sit at top-level ``mtp.``: ``fc`` [H, 2H], ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``norm`` and ``layers.{j}.*`` (vLLM's ``exaone_moe_mtp``); the
norms are plain RMSNorms (no ``1 + w``). Layer j is an EXAONE decoder layer with a dense
MLP (``intermediate_size``) whose attention kind is ``mtp_layer_types[j]`` (default
full) with window ``mtp_sliding_windows[j]`` (0: none; the trunk's ``sliding_window``
when absent). As in the trunk, a full-attention layer has no RoPE when the trunk
interleaves sliding layers (K-EXAONE's MTP layer is full attention, so NoPE).
Embedding and head are the trunk's; no embedding is zeroed at position 0.
"""

import dataclasses

from mlx_lm.models import exaone_moe as lm

from . import qwen3_next
from .family import define
from .mtp import MTPLayer


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Qwen3-Next's mapping of ``mtp.*``, without its ``(1 + w)`` shift."""
    return qwen3_next.sanitize(weights, config, trunk, raw=False)


def layer_kind(config: dict, j: int):
    """``(attention type, window or None)`` of MTP layer j."""
    types = config.get("mtp_layer_types") or []
    kind = types[j] if j < len(types) else "full_attention"
    windows = config.get("mtp_sliding_windows") or []
    window = windows[j] if j < len(windows) else None
    if kind != "sliding_attention":
        return kind, None
    return kind, window or config.get("sliding_window")


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-lm's decoder layer at index L, dense, of the layer's kind."""
    args = trunk.args
    kind, window = layer_kind(config, j)
    extended = dataclasses.replace(
        args,
        layer_types=[*args.layer_types, kind],
        is_moe_layer=[*args.is_moe_layer, False],
    )
    block = lm.DecoderLayer(extended, args.num_hidden_layers)
    layer = MTPLayer(args.hidden_size, args.rms_norm_eps, block)
    layer.window = window
    return layer


# Qwen3-Next's names and split; plain norms (so no is_raw), no recurrent trunk
FAMILY = define(
    LAYOUT=qwen3_next.LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    mtp_layer_of=qwen3_next.mtp_layer_of,
    split_weights=qwen3_next.split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

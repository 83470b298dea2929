"""MiMo-V2-Flash (``mimo_v2_flash``): several MTP layers at ``model.mtp.layers.{j}``.

Each layer holds ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``final_layernorm`` and a
decoder layer with the trunk's sliding-window attention settings (``swa_*`` heads and
head dims, ``swa_rope_theta``, ``sliding_window_size``, the attention-sink bias, the
value scale) and a dense MLP, its post-attention norm named ``pre_mlp_layernorm``
(vLLM's ``mimo_v2_mtp``). The block is mlx-lm's own ``DecoderLayer`` built as a dense
sliding-window layer, so it gets a `mlx_mtp.cache.WindowCache` of that window.

The config does not count the MTP layers (vLLM hard-codes one; transformers and mlx-lm
drop ``model.mtp.``): the checkpoint's tensors do, and all of them are used in order.
Embedding and head are the trunk's; no embedding is zeroed at position 0. FP8 releases
are dequantized with the trunk (`mlx_mtp.loading.dequantize_fp8`).
"""

import re
from typing import Optional

from mlx_lm.models import mimo_v2_flash as lm

from .base import sanitize_layers, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: f"model.mtp.layers.{j}.",
    fusion={
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "final_layernorm": "norm",
    },
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"model\.mtp\.layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    renamed = {
        k.replace(".pre_mlp_layernorm.", ".post_attention_layernorm."): v
        for k, v in weights.items()
    }
    return sanitize_layers(trunk, renamed, config, mtp_layer_of, LAYOUT)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: a dense sliding-window decoder layer, as the released MTP layers."""
    args = trunk.args
    block = lm.DecoderLayer(args, is_moe=False, is_sliding_window=True)
    layer = MTPLayer(args.hidden_size, args.layernorm_epsilon, block)
    layer.window = args.sliding_window_size
    return layer


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=(),  # released configs do not count the MTP layers
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

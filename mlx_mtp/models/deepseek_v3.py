"""DeepSeek-V3 / V3.1 MTP: layers at ``model.layers.{L + j}`` with L =
num_hidden_layers.

Each layer holds ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, copies
of the embedding and head (``embed_tokens``, ``shared_head.head``; checked, then
dropped) and a full MLA + MoE decoder layer. The real model has L = 61; nothing here
assumes it.
"""

import re
from typing import Optional

from mlx_lm.models import deepseek_v3 as lm

from .base import check_copy, sanitize_layers, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: f"model.layers.{config['num_hidden_layers'] + j}.",
    fusion={
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "shared_head.norm": "norm",
    },
    copies={
        "embed_tokens.weight": "model.embed_tokens.weight",
        "shared_head.head.weight": "lm_head.weight",
    },
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """The MTP layer index a tensor belongs to, or None for trunk tensors."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    if m and int(m[1]) >= config["num_hidden_layers"]:
        return int(m[1]) - config["num_hidden_layers"]
    return None


def split_weights(weights: dict, config: dict):
    """Split tensors into (trunk, mtp); check and drop the MTP layers' shared copies."""
    trunk, mtp = split_mtp(weights, config, mtp_layer_of)
    for key in list(mtp):
        name = key.split(".", 3)[3]
        if name in LAYOUT.copies:
            original = trunk.get(
                LAYOUT.copies[name], trunk.get("model.embed_tokens.weight")
            )
            check_copy(mtp.pop(key), original, key)
    return trunk, mtp


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Map the MTP tensors of `split_weights` to the schema ``layers.{j}.*``."""
    return sanitize_layers(trunk, weights, config, mtp_layer_of, LAYOUT)


def make_layer(
    trunk, j: int, config: dict, block_class=lm.DeepseekV3DecoderLayer
) -> MTPLayer:
    """MTP layer j: the trunk's decoder layer class at index L + j (an MoE layer)."""
    args = trunk.args
    block = block_class(args, args.num_hidden_layers + j)
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,
    MASK_AS_ARRAY=True,  # MLA attention adds the mask into its own scores
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

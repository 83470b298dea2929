"""MiMo-7B MTP: layers at ``model.mtp_layers.{j}``, concatenation order [hidden,
embedding].

Names: ``token_layernorm`` (embedding norm), ``hidden_layernorm``, ``input_proj`` [H,
2H], ``final_layernorm`` and a Qwen2 decoder layer. Embedding and head are the trunk's.
"""

import re
from typing import Optional

from mlx_lm.models import mimo as lm

from .base import sanitize_layers, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: f"model.mtp_layers.{j}.",
    fusion={
        "token_layernorm": "enorm",
        "hidden_layernorm": "hnorm",
        "input_proj": "eh_proj",
        "final_layernorm": "norm",
    },
    hidden_first=True,
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"model\.mtp_layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    return sanitize_layers(trunk, weights, config, mtp_layer_of, LAYOUT)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    block = lm.TransformerBlock(args)
    return MTPLayer(
        args.hidden_size, args.rms_norm_eps, block, hidden_first=LAYOUT.hidden_first
    )


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

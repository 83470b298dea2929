"""ERNIE 4.5 MoE (``ernie4_5_moe``): ``mtp_emb_norm`` / ``mtp_hidden_norm`` /
``mtp_linear_proj`` / ``mtp_block``, one entry per MTP layer.

Checkpoint names (as FastDeploy, Baidu's runtime, and vLLM's ``ernie_mtp`` read them):
``model.mtp_emb_norm.{j}``, ``model.mtp_hidden_norm.{j}``, ``model.mtp_linear_proj.{j}``
[H, 2H] and ``model.mtp_block.{j}.*``, an ERNIE decoder layer built at index j of the
MTP stack (dense unless the trunk's MoE range starts at 0; mlx-lm's rule, so its
tensors load as the trunk's do). There is no final norm of its own: FastDeploy closes
the step with the trunk's final norm (``model.norm``), which is copied into the layer.
The concatenation is ``[embedding, hidden]``; like FastDeploy, no embedding is zeroed
at position 0. mlx-lm's trunk ignores ``e_score_correction_bias`` (it routes on the
gate's softmax alone), and so does the MTP block.
"""

import re
from typing import Optional

import mlx.core as mx
from mlx_lm.models import ernie4_5_moe as lm

from .base import mlx_lm_sanitize, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

FUSION = {
    "mtp_emb_norm": "enorm",
    "mtp_hidden_norm": "hnorm",
    "mtp_linear_proj": "eh_proj",
}
LAYOUT = Layout(
    prefix=lambda config, j: "model.",
    fusion={f"{name}.{{j}}": schema for name, schema in FUSION.items()},
)
PATTERN = re.compile(
    r"model\.(mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj|mtp_block)\.(\d+)\.(.+)"
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = PATTERN.fullmatch(key)
    return int(m[2]) if m else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """``model.mtp_*.{j}.*`` -> ``layers.{j}.{enorm,hnorm,eh_proj,block.*}``, and
    ``layers.{j}.norm``, the trunk's final norm."""
    out, blocks = {}, {}
    for key, value in weights.items():
        m = PATTERN.fullmatch(key)
        part, j, leaf = m[1], int(m[2]), m[3]
        if part == "mtp_block":
            blocks.setdefault(j, {})[f"model.layers.0.{leaf}"] = value
        else:
            out[f"layers.{j}.{FUSION[part]}.{leaf}"] = value
    for j, block in blocks.items():
        for key, value in mlx_lm_sanitize(trunk, block).items():
            out[f"layers.{j}.block.{key[len('model.layers.0.'):]}"] = value
        out[f"layers.{j}.norm.weight"] = mx.array(trunk.model.norm.weight)
    return out


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    return MTPLayer(
        args.hidden_size, args.rms_norm_eps, lm.Ernie4_5_DecoderLayer(args, j)
    )


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

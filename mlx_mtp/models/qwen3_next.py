"""Qwen3-Next MTP, and the Qwen MTP layout that Qwen3.5 / 3.6 share.

Tensors sit at top-level ``mtp.``: ``fc`` [H, 2H] (the fusion projection),
``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` (final), and
``layers.{j}.*``, a full-attention decoder layer of the family (gated attention with q/k
norms and partial rotary, then a dense or MoE MLP). Several layers share the fusion
tensors and are used in order. Embedding and head are the trunk's.

Every norm here is ``x * (1 + w)`` in Hugging Face files. mlx-lm adds the 1 to the
trunk's norms when it loads a raw checkpoint; the MTP norms get the 1 under exactly the
same condition, so a conversion that already holds shifted norms is never shifted again.
"""

import re
from typing import Optional

import mlx.core as mx
from mlx_lm.models import qwen3_next as lm

from .capture import install_capture
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: "mtp.",  # fusion tensors shared by every layer
    fusion={
        "fc": "eh_proj",
        "pre_fc_norm_embedding": "enorm",
        "pre_fc_norm_hidden": "hnorm",
        "norm": "norm",
    },
)
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
SHIFTED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """Layer j for ``mtp.layers.{j}.*``, 0 for the shared fusion tensors, else None."""
    if not key.startswith("mtp."):
        return None
    m = re.match(r"mtp\.layers\.(\d+)\.", key)
    return int(m[1]) if m else 0


def split_weights(weights: dict, config: dict):
    trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    return trunk, mtp


def is_raw(weights: dict, config: dict) -> bool:
    """True when mlx-lm's qwen3_next sanitize shifts this checkpoint's norms."""
    return any(
        k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight")
        for k in weights
    )


def stack_experts(block: dict) -> dict:
    """Per-expert or fused (``gate_up_proj``) expert tensors -> mlx-lm's
    ``switch_mlp``."""
    out, per_expert = {}, {}
    for name, value in block.items():
        m = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if m and m[2] in EXPERT_PROJ:
            per_expert.setdefault(m[2], {})[int(m[1])] = value
        elif name == "mlp.experts.gate_up_proj":
            mid = value.shape[-2] // 2
            out["mlp.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out["mlp.switch_mlp.up_proj.weight"] = value[..., mid:, :]
        elif name == "mlp.experts.down_proj":
            out["mlp.switch_mlp.down_proj.weight"] = value
        else:
            out[name] = value
    for proj, experts in per_expert.items():
        out[f"mlp.switch_mlp.{proj}.weight"] = mx.stack(
            [experts[e] for e in sorted(experts)]
        )
    return out


def sanitize(weights: dict, config: dict, trunk, raw: bool = False) -> dict:
    """Map ``mtp.*`` tensors to the schema
    ``layers.{j}.{enorm,hnorm,eh_proj,norm,block}``.

    Args:
        raw: The checkpoint is a raw Hugging Face one (`is_raw`): add 1 to every
            ``(1 + w)`` norm, once.
    """
    fusion, blocks = {}, {}
    for key, value in weights.items():
        name = key[len("mtp.") :]
        m = re.match(r"layers\.(\d+)\.(.+)", name)
        if m:
            if raw and m[2].endswith(SHIFTED) and value.ndim == 1:
                value = value + 1.0
            blocks.setdefault(int(m[1]), {})[m[2]] = value
            continue
        part, _, leaf = name.partition(".")
        target = LAYOUT.fusion.get(part, f"unexpected_{part}")
        if raw and part != "fc" and leaf == "weight":
            value = value + 1.0
        fusion[f"{target}.{leaf}"] = value
    out = {}
    for j in range(1 + max(blocks, default=0)):
        out.update({f"layers.{j}.{k}": v for k, v in fusion.items()})
        block = stack_experts(blocks.get(j, {}))
        out.update({f"layers.{j}.block.{k}": v for k, v in block.items()})
    return out


def make_block(args, decoder_layer, moe_block, dense_mlp):
    """A full-attention decoder layer with the MTP layer's MLP (vLLM: MLP of layer
    0)."""
    block = decoder_layer(args, args.full_attention_interval - 1)
    moe = (
        0 not in getattr(args, "mlp_only_layers", [])
        and args.num_experts > 0
        and 1 % getattr(args, "decoder_sparse_step", 1) == 0
    )
    block.mlp = (
        moe_block(args) if moe else dense_mlp(args.hidden_size, args.intermediate_size)
    )
    return block


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    block = make_block(
        args, lm.Qwen3NextDecoderLayer, lm.Qwen3NextSparseMoeBlock, lm.Qwen3NextMLP
    )
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


def prepare(trunk) -> None:
    """Make the trunk's Gated-DeltaNet layers record per-position states on request."""
    install_capture(trunk.layers)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=MTP_CONFIG_KEYS,
    ZERO_CENTRED_NORMS=True,
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    is_raw=is_raw,
    sanitize=sanitize,
    make_layer=make_layer,
    prepare=prepare,
)

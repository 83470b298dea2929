"""LongCat-Flash (``longcat_flash``): one MTP layer under ``model.mtp.``, an MLA layer
with a dense MLP.

Names (vLLM's ``longcat_flash_mtp``): ``model.mtp.layers.{j}.{enorm,hnorm}.m.weight``,
``eh_proj``, ``input_layernorm``, ``self_attn.*`` (MLA: ``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``),
``post_attention_layernorm``, ``transformer_layer.mlp.*``; the final norm is
``model.mtp.norm`` and ``model.mtp.embed_tokens`` a copy of the embedding (checked,
then dropped). vLLM registers the layer at index 2L (each trunk layer holds two
attention sub-layers); nothing here depends on it.

The block is a DeepSeek-V2-style pre-norm layer built from mlx-lm's own LongCat parts:
its ``LongcatFlashMLA`` (with the LoRA-rank scales ``sqrt(H / q_lora_rank)`` and
``sqrt(H / kv_lora_rank)`` that vLLM folds into the two LoRA norms) and its dense
``LongcatFlashMLP`` (``ffn_hidden_size``). The config does not count the MTP layers;
the tensors do. No embedding is zeroed at position 0.
"""

import re
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import longcat_flash as lm

from .base import check_copy, mlx_lm_sanitize
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: f"model.mtp.layers.{j}.",
    fusion={
        "enorm.m": "enorm",
        "hnorm.m": "hnorm",
        "eh_proj": "eh_proj",
        "norm": "norm",
    },
    norm_prefix=lambda config, j: "model.mtp.",  # one final norm, model.mtp.norm
)
COPY = "model.mtp.embed_tokens.weight"
FUSION_PARTS = ("enorm.m", "hnorm.m", "eh_proj")


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"model\.mtp\.layers\.(\d+)\.", key)
    if m:
        return int(m[1])
    return 0 if key.startswith("model.mtp.") else None


def split_weights(weights: dict, config: dict):
    trunk = {k: v for k, v in weights.items() if not k.startswith("model.mtp.")}
    mtp = {k: v for k, v in weights.items() if k.startswith("model.mtp.")}
    if COPY in mtp:
        check_copy(mtp.pop(COPY), trunk.get("model.embed_tokens.weight"), COPY)
    return trunk, mtp


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """``model.mtp.*`` -> ``layers.{j}.{enorm,hnorm,eh_proj,norm,block.*}``; the MLA's
    ``kv_b_proj`` is split by mlx-lm's sanitize, as the trunk's."""
    out, blocks, norm = {}, {}, None
    for key, value in weights.items():
        if key == "model.mtp.norm.weight":
            norm = value
            continue
        m = re.fullmatch(r"model\.mtp\.layers\.(\d+)\.(.+)", key)
        if m is None:
            out[f"unexpected.{key}"] = value
            continue
        j, name = int(m[1]), m[2]
        part = next((p for p in FUSION_PARTS if name.startswith(p + ".")), None)
        if part is not None:
            out[f"layers.{j}.{LAYOUT.fusion[part]}.{name[len(part) + 1:]}"] = value
            continue
        name = name.replace("transformer_layer.", "", 1)
        if name.startswith("self_attn."):  # mlx-lm's trunk layers hold two MLAs
            name = "self_attn.0." + name[len("self_attn.") :]
        blocks.setdefault(j, {})[f"model.layers.0.{name}"] = value
    for j, block in blocks.items():
        for key, value in mlx_lm_sanitize(trunk, block).items():
            name = key[len("model.layers.0.") :].replace("self_attn.0.", "self_attn.")
            out[f"layers.{j}.block.{name}"] = value
        if norm is not None:
            out[f"layers.{j}.norm.weight"] = norm
    return out


class Block(nn.Module):
    """Pre-norm MLA + dense MLP layer (vLLM's ``DeepseekV2DecoderLayer`` for LongCat's
    MTP), from mlx-lm's LongCat modules."""

    def __init__(self, args):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = lm.LongcatFlashMLA(args)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )
        self.mlp = lm.LongcatFlashMLP(args)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    return MTPLayer(args.hidden_size, args.rms_norm_eps, Block(args))


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=(),  # the tensors count the MTP layers
    MASK_AS_ARRAY=True,  # MLA adds the mask into its own scores
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

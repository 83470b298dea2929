"""Nemotron-H / Nemotron 3 (``nemotron_h``): one MTP step is several sub-layers.

The trunk is mlx-lm's: Mamba-2 (``M``), attention without RoPE (``*``), ReLU² MLP
(``-``) and non-gated ReLU² MoE (``E``) blocks under ``backbone.layers.{i}``, each a
pre-norm residual block (``norm`` then ``mixer``), then ``backbone.norm_f``.

An MTP step is P physical sub-layers at ``mtp.layers.{jP} .. mtp.layers.{jP + P - 1}``,
typed by ``mtp_layers_block_type`` (``["full_attention", "moe"]`` by default; legacy
``attention`` / ``mlp`` names too) or the legacy string ``mtp_hybrid_override_pattern``
(``"*E"``). Sub-layer 0 carries ``enorm``, ``hnorm`` and ``eh_proj``; the last carries
``final_layernorm``; every one is a trunk-style block with its own ``norm`` and
``mixer`` on one continuing residual stream (vLLM's ``nemotron_h_mtp``):

    x = eh_proj([enorm(e), hnorm(h)])
    x = x + mixer_s(norm_s(x))     for s = 0 .. P-1
    z = final_layernorm(x)

The embedding (``backbone.embeddings``) and ``lm_head`` are the trunk's; no embedding is
zeroed at position 0. The block's sub-layers are mlx-lm's own ``NemotronHBlock``s, so
their tensors load as the trunk's do (experts stacked by mlx-lm's sanitize). The
Mamba-2 state rolls back through the capture in `mlx_mtp.models.capture`.
"""

import re
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import nemotron_h as lm

from ..errors import UnsupportedModelError
from .base import mlx_lm_sanitize, split_mtp
from .capture import install_capture
from .family import Layout, define
from .mtp import MTPLayer

DEFAULT_STEP = ("full_attention", "moe")
CHARS = lm.ModelArgs._block_type_to_char
FUSION = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj"}
STEP_NORM = "final_layernorm"


def step_pattern(config: dict) -> str:
    """The sub-layer types of one MTP step, as pattern characters (``"*E"``).

    transformers' rule: an explicit ``mtp_layers_block_type`` wins unless it is the
    default, which the legacy ``mtp_hybrid_override_pattern`` then overrides.
    """
    types = config.get("mtp_layers_block_type") or list(DEFAULT_STEP)
    legacy = config.get("mtp_hybrid_override_pattern")
    if legacy and list(types) == list(DEFAULT_STEP):
        pattern = str(legacy)
    else:
        unknown = sorted(set(types) - CHARS.keys())
        if unknown:
            raise UnsupportedModelError(
                f"unknown Nemotron-H MTP layer type(s) {unknown}; expected any of "
                f"{sorted(CHARS)}"
            )
        pattern = "".join(CHARS[t] for t in types)
    if not pattern or set(pattern) - set("*E-M"):
        raise UnsupportedModelError(f"bad Nemotron-H MTP pattern {pattern!r}")
    return pattern


def _last_prefix(config: dict, j: int) -> str:
    P = len(step_pattern(config))
    return f"mtp.layers.{j * P + P - 1}."


LAYOUT = Layout(
    prefix=lambda config, j: f"mtp.layers.{j * len(step_pattern(config))}.",
    fusion={**FUSION, STEP_NORM: "norm"},
    norm_prefix=_last_prefix,
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """The MTP step a tensor belongs to (sub-layer index // P), None for the trunk."""
    m = re.match(r"mtp\.layers\.(\d+)\.", key)
    if m:
        return int(m[1]) // len(step_pattern(config))
    return 0 if key.startswith("mtp.") else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """``mtp.layers.{i}.*`` -> ``layers.{j}.{enorm,hnorm,eh_proj,norm}`` and
    ``layers.{j}.block.layers.{s}.*`` (i = jP + s), each sub-layer through the trunk's
    own sanitize (as ``backbone.layers.0``)."""
    P = len(step_pattern(config))
    sublayers = {}
    for key, value in weights.items():
        m = re.match(r"mtp\.layers\.(\d+)\.(.+)", key)
        name = f"backbone.layers.0.{m[2]}" if m else f"unexpected.{key}"
        sublayers.setdefault(int(m[1]) if m else -1, {})[name] = value
    out = {}
    for i, tensors in sorted(sublayers.items()):
        j, s = divmod(i, P)
        for key, value in mlx_lm_sanitize(trunk, tensors).items():
            name = key[len("backbone.layers.0.") :]
            part = name.partition(".")[0]
            if s == 0 and part in FUSION:
                out[f"layers.{j}.{FUSION[part]}{name[len(part):]}"] = value
            elif s == P - 1 and part == STEP_NORM:
                out[f"layers.{j}.norm{name[len(part):]}"] = value
            else:
                out[f"layers.{j}.block.layers.{s}.{name}"] = value
    return out


class Step(nn.Module):
    """The sub-layers of one MTP step on one residual stream; the attention sub-layer
    uses the step's cache (a Mamba-2 sub-layer, which would need a recurrent cache of
    its own, is refused at build time)."""

    def __init__(self, args, pattern: str):
        super().__init__()
        self.layers = [lm.NemotronHBlock(args, c) for c in pattern]

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        for layer in self.layers:
            attends = layer.block_type == "*"
            x = layer(
                x, mask=mask if attends else None, cache=cache if attends else None
            )
        return x


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    pattern = step_pattern(config)
    if "M" in pattern or pattern.count("*") > 1:
        raise UnsupportedModelError(
            f"Nemotron-H MTP steps of pattern {pattern!r} are not supported (one "
            "attention sub-layer at most, no Mamba sub-layer; released models use '*E')"
        )
    args = trunk.args
    return MTPLayer(args.hidden_size, args.layer_norm_epsilon, Step(args, pattern))


def hidden(trunk, inputs: mx.array, cache=None) -> mx.array:
    return trunk.backbone(inputs, cache)


def embed(trunk, ids: mx.array) -> mx.array:
    return trunk.backbone.embeddings(ids)


def prepare(trunk) -> None:
    """Make the trunk's Mamba-2 mixers record per-position states on request."""
    install_capture(trunk.layers)


def final_norm(trunk):
    return trunk.backbone.norm_f


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    EMBEDDING_KEY="backbone.embeddings.weight",
    FINAL_NORM_KEY="backbone.norm_f.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    hidden=hidden,
    embed=embed,
    final_norm=final_norm,
    prepare=prepare,
)

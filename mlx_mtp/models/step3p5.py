"""Step-3.5 (``step3p5``): several DeepSeek-style MTP layers, used in order.

MTP layer j sits at ``model.layers.{L + j}`` (L = num_hidden_layers) with ``enorm``,
``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and ``shared_head.output`` (a
copy of ``lm_head``: checked, then dropped, as transformers' ``MtpModel`` projects
with the trunk's head); its decoder layer is nested under ``.transformer.`` (vLLM's
``step3p5_mtp`` drops that level) and is mlx-lm's ``Step3p5DecoderLayer`` at index
L + j, so its attention kind (sliding or full), head count, RoPE and MLP (dense or
MoE, with SwiGLU clamps) come from the config's per-layer lists, which released
configs pad with one entry per MTP layer.

Every norm is ``x * (1 + w)`` in Hugging Face files; the 1 is added when the checkpoint
is raw, under mlx-lm's own condition for the trunk (`is_raw`), so a conversion is never
shifted twice. A sliding-window MTP layer gets a `mlx_mtp.cache.WindowCache` of the
trunk's window (``MTPLayer.window``).
"""

import re
from typing import Optional

from mlx_lm.models import step3p5 as lm

from ..errors import UnsupportedModelError
from .base import check_copy, mlx_lm_sanitize, split_mtp
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
        "shared_head.output.weight": "lm_head.weight",
        "embed_tokens.weight": "model.embed_tokens.weight",
    },
)
# mlx-lm's step3p5 sanitize renames these (and adds 1 to every norm) in a raw checkpoint
RENAMED = (
    (".moe.gate_proj.", ".mlp.switch_mlp.gate_proj."),
    (".moe.up_proj.", ".mlp.switch_mlp.up_proj."),
    (".moe.down_proj.", ".mlp.switch_mlp.down_proj."),
    (".moe.gate.", ".mlp.gate.gate."),
    (".moe.router_bias", ".mlp.gate.router_bias"),
    (".share_expert.", ".mlp.share_expert."),
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"model\.layers\.(\d+)\.", key)
    if m and int(m[1]) >= config["num_hidden_layers"]:
        return int(m[1]) - config["num_hidden_layers"]
    return None


def is_raw(weights: dict, config: dict) -> bool:
    """True when mlx-lm's step3p5 sanitize treats this checkpoint as raw (it renames
    the experts and adds 1 to the norms)."""
    return any(src in k and dst not in k for k in weights for src, dst in RENAMED)


def split_weights(weights: dict, config: dict):
    """Split into (trunk, mtp); check and drop the layers' copies of embedding and
    head."""
    trunk, mtp = split_mtp(weights, config, mtp_layer_of)
    for key in list(mtp):
        name = key.split(".", 3)[3]
        if name in LAYOUT.copies:
            check_copy(mtp.pop(key), trunk.get(LAYOUT.copies[name]), key)
    return trunk, mtp


def _is_norm(name: str) -> bool:
    return name.endswith(".weight") and "norm" in name


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Map ``model.layers.{L+j}.*`` to
    ``layers.{j}.{enorm,hnorm,eh_proj,norm,block.*}``.

    The decoder layer's tensors (``.transformer.`` dropped) go through mlx-lm's
    sanitize as the trunk's layer 0 for the expert renames; its norms and the fusion
    norms get their 1 here, when ``raw``.
    """
    out = {}
    for key, value in weights.items():
        j = mtp_layer_of(key, config)
        name = key[len(LAYOUT.prefix(config, j)) :].replace("transformer.", "", 1)
        if raw and _is_norm(name):
            value = value + 1.0
        part = next((p for p in LAYOUT.fusion if name.startswith(p + ".")), None)
        if part is not None:
            out[f"layers.{j}.{LAYOUT.fusion[part]}{name[len(part):]}"] = value
        elif _is_norm(name):
            out[f"layers.{j}.block.{name}"] = value
        else:
            local = mlx_lm_sanitize(trunk, {f"model.layers.0.{name}": value})
            for k, v in local.items():
                out[f"layers.{j}.block.{k[len('model.layers.0.'):]}"] = v
    return out


def _check_layer_lists(args, j: int) -> None:
    index = args.num_hidden_layers + j
    if args.layer_types and len(args.layer_types) <= index:
        raise UnsupportedModelError(
            f"the Step-3.5 config's layer_types has {len(args.layer_types)} entries, "
            f"none for MTP layer {j} (index {index}); released configs list the MTP "
            "layers after the trunk's"
        )


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-lm's decoder layer at index L + j, with its window if
    sliding."""
    args = trunk.args
    _check_layer_lists(args, j)
    block = lm.Step3p5DecoderLayer(args, args.num_hidden_layers + j)
    layer = MTPLayer(args.hidden_size, args.rms_norm_eps, block)
    if block.is_sliding:
        layer.window = args.sliding_window
    return layer


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    ZERO_CENTRED_NORMS=True,
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    is_raw=is_raw,
    sanitize=sanitize,
    make_layer=make_layer,
)

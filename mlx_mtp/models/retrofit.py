"""Retrofitted MTP heads on any mlx-lm trunk whose checkpoints ship none.

`mlx-mtp train-heads` trains, and llama.cpp's GGUF ``nextn`` tensors carry, one
DeepSeek-style MTP layer at ``model.layers.{L}`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, and a block with the structure of the trunk's last decoder
layer). A family whose trunk is plain mlx-lm takes its hooks from here; only the block
differs, and it is built as a copy of the trunk's own last layer (its weights are then
replaced by the head's), so no family needs to know its decoder layer's constructor.
"""

import copy

from . import deepseek_v3
from .mtp import MTPLayer


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Map ``model.layers.{L + j}.*`` to the schema ``layers.{j}.*``. The block's
    tensors carry the trunk's own (mlx-lm) names already, so no trunk sanitize runs
    (some, such as Gemma 3's, change the trunk itself when called)."""
    out, layout = {}, deepseek_v3.LAYOUT
    for key, value in weights.items():
        j = deepseek_v3.mtp_layer_of(key, config)
        name = key[len(layout.prefix(config, j)) :]
        part, _, leaf = name.rpartition(".")
        if part in layout.fusion:
            out[f"layers.{j}.{layout.fusion[part]}.{leaf}"] = value
        else:
            out[f"layers.{j}.block.{name}"] = value
    return out


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: a block shaped as the trunk's last decoder layer."""
    args = trunk.args
    block = copy.deepcopy(trunk.layers[-1])
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


# DeepSeek-V3's layout, split and layer count; its own sanitize and block; no
# embedding zeroed (train-heads trains without) and the block's own "causal" mask
FAMILY = deepseek_v3.FAMILY.derive(
    sanitize=sanitize,
    make_layer=make_layer,
    defaults=("MASK_FIRST_POSITION", "MASK_AS_ARRAY"),
)

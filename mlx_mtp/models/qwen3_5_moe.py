"""Qwen3.5 / Qwen3.6 MoE MTP: as `qwen3_5`, with an MoE MTP layer (shared expert).

Expert tensors may be stored one per expert or fused (``experts.gate_up_proj`` /
``experts.down_proj``); both load, for the MTP layer (`qwen3_next.stack_experts`) and
for the trunk (per-expert tensors are fused here into the layout mlx-lm's sanitize
expects).
"""

import re

import mlx.core as mx

from . import qwen3_5

_PER_EXPERT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(weights: dict) -> dict:
    """Per-expert trunk tensors -> fused ``experts.gate_up_proj`` /
    ``experts.down_proj``."""
    out, groups = {}, {}
    for key, value in weights.items():
        m = _PER_EXPERT.fullmatch(key)
        if m:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = value
        else:
            out[key] = value
    for prefix, parts in groups.items():
        stack = {p: mx.stack([e[i] for i in sorted(e)]) for p, e in parts.items()}
        out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate(
            [stack["gate"], stack["up"]], axis=-2
        )
        out[f"{prefix}.experts.down_proj"] = stack["down"]
    return out


def split_weights(weights: dict, config: dict):
    trunk, mtp = qwen3_5.FAMILY.split_weights(weights, config)
    return fuse_experts(trunk), mtp


# Qwen3.5's hooks (its make_layer builds the MoE block from the config)
FAMILY = qwen3_5.FAMILY.derive(split_weights=split_weights)

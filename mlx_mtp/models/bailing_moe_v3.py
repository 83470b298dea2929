"""Ling / Ring 3.0 (``bailing_moe_v3``): MTP layers appended after a Kimi Delta
Attention hybrid trunk.

The trunk is mlx-lm's ``bailing_moe_v3``: groups of KDA layers closed by an MLA layer
(with a per-head output gate), MoE MLPs. MTP layer j sits at ``model.layers.{L + j}``
with ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``final_layernorm`` and an MLA + MoE
decoder layer in the trunk's names, mlx-lm's ``BailingDecoderLayer`` at index L + j
(vLLM's ``bailing_moe_v3_mtp``, which also reads the router bias of MTP layers
saved as ``e_score_correction_bias``). The head is the trunk's; no embedding is
zeroed. The KDA state rolls back through the capture in `mlx_mtp.models.capture`.
"""

from mlx_lm.models import bailing_moe_v3 as lm

from . import bailing_hybrid
from .base import sanitize_layers
from .mtp import MTPLayer


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """The layers pass mlx-lm's sanitize as the trunk's last layer (an MoE layer, so
    their experts are stacked as the trunk's are)."""
    weights = {
        k.replace(".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"): v
        for k, v in weights.items()
    }
    last = config["num_hidden_layers"] - 1
    family = bailing_hybrid.FAMILY
    return sanitize_layers(
        trunk, weights, config, family.mtp_layer_of, family.LAYOUT, last
    )


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-lm's decoder layer at index L + j (MLA + MoE there)."""
    args = trunk.args
    block = lm.BailingDecoderLayer(args, args.num_hidden_layers + j)
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


# Ling 2.5's layout, split, embedding, head and recurrent-state capture (here of the
# KDA layers); no embedding zeroed, and its configs are Ling 3.0's (not refused)
FAMILY = bailing_hybrid.FAMILY.derive(
    sanitize=sanitize,
    make_layer=make_layer,
    defaults=("MASK_FIRST_POSITION", "fix_config"),
)

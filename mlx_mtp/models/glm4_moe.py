"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) MTP: DeepSeek naming at ``model.layers.{L + j}``.

Same tensors and forward as DeepSeek-V3 (`deepseek_v3`); the decoder block is GLM's GQA
(biases, q/k norms, partial RoPE) + MoE layer.
"""

from mlx_lm.models import glm4_moe as lm

from . import deepseek_v3
from .mtp import MTPLayer

LAYOUT = deepseek_v3.LAYOUT
MTP_CONFIG_KEYS = deepseek_v3.MTP_CONFIG_KEYS
MASK_FIRST_POSITION = True

declared_mtp_layers = deepseek_v3.declared_mtp_layers
mtp_layer_of = deepseek_v3.mtp_layer_of
split_weights = deepseek_v3.split_weights
sanitize = deepseek_v3.sanitize


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    return deepseek_v3.make_layer(trunk, j, config, block_class=lm.DecoderLayer)

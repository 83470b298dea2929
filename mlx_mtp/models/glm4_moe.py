"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) MTP: DeepSeek naming at ``model.layers.{L + j}``.

Same tensors and forward as DeepSeek-V3 (`deepseek_v3`); the decoder block is GLM's GQA
(biases, q/k norms, partial RoPE) + MoE layer.
"""

from mlx_lm.models import glm4_moe as lm

from . import deepseek_v3
from .mtp import MTPLayer


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    return deepseek_v3.make_layer(trunk, j, config, block_class=lm.DecoderLayer)


# DeepSeek-V3's hooks; GQA attention takes mlx-lm's "causal" mask, not an array
FAMILY = deepseek_v3.FAMILY.derive(make_layer=make_layer, defaults=("MASK_AS_ARRAY",))

"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's MTP layout on an MLA + MoE trunk.

The MTP layer sits at ``model.layers.{L}`` with DeepSeek's names (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, copies of the embedding and head) and a full
``Glm4MoeLiteDecoderLayer`` (MLA with q_a / kv_a LoRA projections, MoE MLP); mlx-lm's
sanitize drops layers >= L, so the MTP tensors are set aside before it runs (as for
every family) and its ``kv_b_proj`` split is applied to them as to the trunk's. The
embedding of the first MTP row is zeroed, as vLLM does for DeepSeek (lightllm and
vLLM's ``glm4_moe_lite_mtp`` reuse DeepSeek's MTP code).
"""

from functools import partial

from mlx_lm.models import glm4_moe_lite as lm

from . import deepseek_v3

# DeepSeek-V3's hooks (MLA attention adds the mask into its own scores)
FAMILY = deepseek_v3.FAMILY.derive(
    make_layer=partial(deepseek_v3.make_layer, block_class=lm.Glm4MoeLiteDecoderLayer)
)

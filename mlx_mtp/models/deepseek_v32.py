"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MTP
layout on an MLA layer with the DSA sparse-attention indexer.

The MTP layer sits at ``model.layers.{L}`` with DeepSeek's names (``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, checked copies of the embedding and head) and a full
``DeepseekV32DecoderLayer``: MLA whose attention is restricted, once the context holds
more than ``index_topk`` positions, to the keys its indexer (``self_attn.indexer.*``:
``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) scores highest, then an MoE MLP. Like
the trunk's layers, it keeps two caches (the MLA latent and the indexer's keys;
``MTPLayer.kv_caches``). GLM-5 is the same model class in mlx-lm (its config nests
RoPE under ``rope_parameters`` and interleaves the indexer's RoPE).
"""

from mlx_lm.models import deepseek_v32 as lm

from . import deepseek_v3
from .mtp import MTPLayer


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    layer = deepseek_v3.make_layer(
        trunk, j, config, block_class=lm.DeepseekV32DecoderLayer
    )
    layer.kv_caches = 2
    return layer


# DeepSeek-V3's hooks (MLA adds the mask into its scores; the indexer selects with it)
FAMILY = deepseek_v3.FAMILY.derive(make_layer=make_layer)

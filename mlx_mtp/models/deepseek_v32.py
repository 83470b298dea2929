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

GLM-5.2 and 5.3 keep an indexer on one layer in four (``indexer_types``: "full" or
"shared", from ``index_topk_freq`` and ``index_skip_topk_offset``): a "shared" layer
reuses the top-k of the full layer before it and ships no indexer. mlx-lm 0.32's DSA
layer computes its own top-k on every layer, so those configs are refused in one line
(`fix_config`) rather than failing on the missing indexer tensors.
"""

from mlx_lm.models import deepseek_v32 as lm

from ..errors import UnsupportedModelError
from . import deepseek_v3
from .mtp import MTPLayer


def fix_config(config: dict) -> dict:
    """No fixes; a config whose layers share indexers is refused (module doc)."""
    shared = "shared" in (config.get("indexer_types") or ())
    if shared or (config.get("index_topk_freq") or 1) > 1:
        raise UnsupportedModelError(
            f"{config.get('model_type')}: layers that share a sparse-attention "
            "indexer (GLM-5.2 / 5.3's indexer_types 'shared', index_topk_freq "
            f"{config.get('index_topk_freq', 1)}) need a trunk mlx-lm "
            "0.32 does not have; GLM-5 and GLM-5.1 (an indexer on every layer) load"
        )
    return {}


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    layer = deepseek_v3.make_layer(
        trunk, j, config, block_class=lm.DeepseekV32DecoderLayer
    )
    layer.kv_caches = 2
    return layer


# DeepSeek-V3's hooks (MLA adds the mask into its scores; the indexer selects with it)
FAMILY = deepseek_v3.FAMILY.derive(make_layer=make_layer, fix_config=fix_config)

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

GLM-5.2 and 5.3 keep an indexer on some layers only (`indexer_types`): a "shared"
layer ships no indexer and attends to the keys the last "full" layer before it
selected. mlx-lm 0.32's DSA layer computes its own selection on every layer, so the
trunk is mlx-lm's model with each shared layer's indexer replaced by a stand-in that
hands on the full layer's top-k (`SharedIndexer`; the full layers' by `FullIndexer`,
which records it): no mlx-lm code is copied, and the weights keep their names. The
MTP layer has an indexer of its own, as released (``index_share_for_mtp_iteration``,
which lets a chain of MTP steps reuse one selection, changes only the drafts: each
step here selects its own, as SGLang does with the flag off).
"""

from functools import lru_cache
from typing import List, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils
from mlx_lm.models import deepseek_v32 as lm

from ..errors import UnsupportedModelError
from ..private import check_private
from . import deepseek_v3
from .mtp import MTPLayer

# mlx-lm's model_type -> classes mapping, under no public name in 0.32
check_private(
    mlx_lm.utils,
    [("_get_classes", "config")],
    "mlx_lm.utils",
    "GLM-5 needs mlx-lm 0.32.x",
)


def indexer_types(config: dict) -> List[str]:
    """Per trunk layer, "full" (an indexer of its own) or "shared" (the selection of
    the last full layer before it): ``indexer_types``; else ``index_topk_pattern``
    ("F" / "S" per layer); else a full layer every ``index_topk_freq`` layers from
    layer ``index_skip_topk_offset - 1`` on, every layer before it full (a freq of 1,
    the default: every layer).

    Raises:
        UnsupportedModelError: the first layer is shared (nothing to share).
    """
    n = config["num_hidden_layers"]
    types = config.get("indexer_types")
    pattern = config.get("index_topk_pattern")
    if types is None and pattern is not None:
        names = {"F": "full", "S": "shared"}
        types = [names[c] for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(config.get("index_topk_freq") or 1, 1)
        first = config.get("index_skip_topk_offset", 2) - 1
        types = ["shared" if max(i - first, 0) % freq else "full" for i in range(n)]
    types = list(types)[:n]
    if types and types[0] != "full":
        raise UnsupportedModelError(
            f"{config.get('model_type')}: the first layer's indexer is "
            f"{types[0]!r}; a shared indexer needs a full layer before it"
        )
    return types


class TopK:
    """The selection of the last full indexer in the current forward pass."""

    value = None


class FullIndexer(lm.Indexer):
    """mlx-lm's indexer, recording its selection for the shared layers after it."""

    def __init__(self, args, top: TopK):
        super().__init__(args)
        self.top = top

    def __call__(self, x, qr, mask, cache=None):
        self.top.value = super().__call__(x, qr, mask, cache)
        return self.top.value


class SharedIndexer(nn.Module):
    """A shared layer's indexer: no weights; the selection of the full layer before
    it. Its key cache takes zero-width keys, so it holds the layer's positions as
    any key cache does (mlx-lm's attention reads it; rollback, batching and memory
    accounting treat it as the others)."""

    def __init__(self, top: TopK):
        super().__init__()
        self.top = top

    def __call__(self, x, qr, mask, cache=None):
        if cache is not None:
            empty = mx.zeros((x.shape[0], 1, x.shape[1], 0), dtype=x.dtype)
            cache.update_and_fetch(empty, empty)
        return self.top.value


class SharedIndexers:
    """Mixin over mlx-lm's DSA ``Model``: each layer's indexer as `TYPES` says."""

    TYPES: Tuple[str, ...] = ()

    def __init__(self, args):
        super().__init__(args)
        top = TopK()
        for layer, kind in zip(self.model.layers, self.TYPES):
            attn = layer.self_attn
            attn.indexer = (
                FullIndexer(args, top) if kind == "full" else SharedIndexer(top)
            )


@lru_cache(maxsize=None)
def _with_shared_indexers(base: type, types: Tuple[str, ...]) -> type:
    return type(base.__name__, (SharedIndexers, base), {"TYPES": types})


def trunk_classes(config: dict):
    """mlx-lm's classes; with shared indexers, its model as `SharedIndexers` makes
    it."""
    model_class, args_class = mlx_lm.utils._get_classes(config)
    types = tuple(indexer_types(config))
    if "shared" not in types:
        return model_class, args_class
    return _with_shared_indexers(model_class, types), args_class


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    layer = deepseek_v3.make_layer(
        trunk, j, config, block_class=lm.DeepseekV32DecoderLayer
    )
    layer.kv_caches = 2
    return layer


# DeepSeek-V3's hooks (MLA adds the mask into its scores; the indexer selects with it)
FAMILY = deepseek_v3.FAMILY.derive(make_layer=make_layer, trunk_classes=trunk_classes)

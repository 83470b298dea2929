"""GLM-5.3-Flash's caches (``glm5_next``), exact under rollback.

mlx-vlm's trunk keeps, per decoder layer:

- a KDA (linear attention) layer: an ``ArraysCache`` of two slots, the short
  convolution's last ``kernel - 1`` inputs and the recurrent state: a
  `mlx_mtp.models.vlm_cache.RecordingArraysCache`;
- a DSA (sparse MLA) layer: the MLA latent, and on a layer with its own indexer the
  indexer's key-valid flags and a ``PoolingCache`` of its pooled keys (a
  `mlx_mtp.models.vlm_cache.PoolCache`), then the projected keys and values
  (`ProjectionRows`); a layer that shares the previous one's selection keeps the
  latent and the projections only. Its KV caches are `KVRows`, trimmed.
"""

from mlx_lm.models.cache import CacheList

from .vlm_cache import KVRows, pool_cache_class, recording_cache_class

WHAT = "GLM-5.3-Flash (glm5_next)"


class ProjectionRows(KVRows):
    """A DSA layer's projected keys and values: a cache derived from the latent,
    which mlx-vlm's attention extends only on a pass of more than 8 positions that
    starts where it ends (else it projects the whole latent and leaves it), so it
    holds the projections of a prefix of the latent's positions, maybe none."""


def make_cache(layers) -> list:
    """The trunk's caches: a `RecordingArraysCache` per KDA layer; per DSA layer,
    `KVRows` for the latent (and the projections), with, on a layer with its own
    indexer, its key-valid flags and a `PoolCache`."""
    return [layer_cache(layer) for layer in layers]


def layer_cache(layer):
    """One decoder layer's cache (`make_cache`), or an MTP block's (a DSA layer)."""
    attention = layer.self_attn
    if getattr(layer, "is_linear", False):
        return recording_cache_class()(2)
    indexer = attention.indexer
    if indexer is None:
        return CacheList(KVRows(), ProjectionRows())
    pool = pool_cache_class()(indexer.index_kpool)
    return CacheList(KVRows(), KVRows(), pool, ProjectionRows())

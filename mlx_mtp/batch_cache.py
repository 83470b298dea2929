"""Caches of several streams decoded together, each row rolled back on its own.

A batched verify pass writes k+1 positions into every row; rows then accept different
numbers of drafts. Each cache type's batched form drops each row's rejected positions
without touching the others' (the cache protocol, `mlx_mtp.cache`):

- full and sliding-window attention layers (and the MTP layers): a
  `mlx_mtp.kv_cache.RaggedKVCache`, every row's entries tagged with their positions;
  a layer's several caches: a `mlx_mtp.cache.RaggedList`;
- recurrent layers: a `mlx_mtp.cache.RecurrentCache` with B rows, which puts back,
  per row, the state recorded at that row's accepted length;
- a family's own cache type: its own batched form (DeepSeek-V4's, one cache per row).

The functions here apply the protocol to a stream's `Caches`: `to_batch` turns one
stream's caches (as `mlx_mtp.cache.make_caches` makes them and the single-stream
prefill fills them) into one-row batch caches, `join` stacks rows, `select` keeps some
rows, and `to_single` gives one row's caches back (a `Session` to go on from later).
`batch_support` says whether a model's caches can batch at all.
"""

from typing import Optional, Sequence

from .cache import Caches, RaggedList, make_caches, ops, prepare
from .kv_cache import COMPACT_SLACK, RaggedKVCache

__all__ = [
    "COMPACT_SLACK",
    "RaggedKVCache",
    "RaggedList",
    "batch_support",
    "join",
    "pad_pass",
    "select",
    "to_batch",
    "to_single",
]


def batch_support(model) -> Optional[str]:
    """None when the model's streams can be decoded in one batch, else why not (one
    line): every trunk and MTP cache must have a batched form (``batch_refusal``)."""
    if model.group is not None:
        return "a trunk sharded over several ranks decodes one stream at a time"
    caches = make_caches(model)
    for c in caches.trunk + caches.mtp:
        refused = ops(c).batch_refusal()
        if refused is not None:
            return f"mlx-mtp has no batched cache for this model's {refused}"
    return None


def pad_pass(caches, padding: Optional[Sequence[int]]) -> None:
    """Left-pad the next pass over trunk ``caches`` (row b's first ``padding[b]``
    inputs are filler: hidden from attention, masked in recurrent layers as in
    mlx-lm's batched prefill); None: after the pass, no padding."""
    prepare(caches, padding)


def to_batch(caches: Caches) -> Caches:
    """One stream's caches (filled by the single-stream prefill) as one-row batch
    caches."""
    return Caches(
        [ops(c).merge([c]) for c in caches.trunk],
        [ops(c).merge([c]) for c in caches.mtp],
    )


def join(a: Caches, b: Caches) -> Caches:
    """``a``'s rows then ``b``'s, in ``a``'s objects."""
    for x, y in zip(a.trunk + a.mtp, b.trunk + b.mtp):
        x.extend(y)
    return a


def select(caches: Caches, rows: Sequence[int]) -> None:
    """Keep ``rows`` of every cache, in that order."""
    for c in caches.trunk + caches.mtp:
        c.filter(rows)


def to_single(batch: Caches, b: int, limits=(None, None), bases=None) -> Caches:
    """Row b's caches as single-stream ones: the trunk's positions below
    ``limits[0]``, the MTP layers' below ``limits[1]``; ``bases``: the marks of a
    launched round not committed, whose recorded states (before it) a recurrent
    cache gives instead of its own."""
    bases = bases or [None] * len(batch.trunk)
    trunk = [c.extract(b, limits[0], m) for c, m in zip(batch.trunk, bases)]
    return Caches(trunk, [c.extract(b, limits[1]) for c in batch.mtp])

"""The cache memory of the server's batch: what a batch of rows holding so many
positions takes (`CacheCost`, read off the model's caches by `cache_cost`), and the
bound it is admitted within unless ``--batch-cache-bytes`` says (`default_budget`)."""

import os
from dataclasses import dataclass
from typing import Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cache import batch_cost, make_caches
from ..speculative import prefill


@dataclass(frozen=True)
class CacheCost:
    """The bytes a batch's caches take: ``per_token`` for each position a row holds
    in the full attention caches (the trunk's and the MTP layers'), ``windows`` the
    bytes per position and the most positions a row keeps of each sliding-window
    cache, and ``per_row`` a row's recurrent states and the room its caches leave
    for rejected drafts (`mlx_mtp.kv_cache.COMPACT_SLACK` positions)."""

    per_token: float
    windows: Tuple[Tuple[float, int], ...]
    per_row: float

    def bytes(self, positions: Sequence[int]) -> int:
        """The caches of a batch whose rows hold ``positions[b]`` positions: every
        row is as wide as the longest (the caches keep rows left-padded)."""
        if not positions:
            return 0
        longest = max(positions)
        row = longest * self.per_token + self.per_row
        row += sum(size * min(longest, n) for size, n in self.windows)
        return int(len(positions) * row)


def cache_cost(model, depth: int) -> CacheCost:
    """The `CacheCost` of ``model``'s batches (``depth`` MTP layers in use), read off
    its caches after a prefill of a few tokens (each cache's ``cost``, the cache
    protocol of `mlx_mtp.cache`)."""
    caches = make_caches(model)
    prefill(model, caches, [0] * (depth + 2), depth, 256)
    return CacheCost(*batch_cost(caches.trunk + caches.mtp))


def device_memory() -> int:
    """The bytes MLX may use: Metal's recommended working set, else the RAM."""
    info = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        found = info()
    except RuntimeError:  # no Metal
        found = {}
    size = found.get("max_recommended_working_set_size") or found.get("memory_size")
    return int(size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget(model) -> int:
    """The cache memory of the batch unless ``batch_cache_bytes`` says: half of what
    `device_memory` leaves after the weights. Of the other half, the kept
    conversations take up to half (`Server`'s default ``prompt_cache_bytes``); each
    is counted at its arrays' full size, the snapshot of a prompt's caches that a
    join keeps too (a full copy: `Session.snapshot`). The rest is for what the
    budgets do not count: an admission's caches while they are copied into the
    batch (the budget counts them once), and the rounds' activations. The weights
    are the model's parameters: tables read by row from their files
    (`mlx_mtp.tables`) are not among them, their pages being the files'."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return max(0, (device_memory() - weights) // 2)

"""Caches for speculative decoding, and the one helper that rolls them back.

The trunk's caches are mlx-lm's own (`make_prompt_cache`); each MTP layer has a plain
`KVCache` whose row i holds position i. Rollback goes through `begin_verify` (called
before a verify pass writes k+1 positions) and `rewind` (called after, with the number
of positions to drop). A cache type joins by registering a `Rollback` adapter: KV caches
trim; a recurrent cache would capture its state per verified position in `begin` and
restore the accepted one in `rewind`, with no change to the decode loop. A cache with no
adapter makes `check_rollback` fail before decoding starts.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .errors import RollbackError


@dataclass
class Caches:
    """The trunk's per-layer caches and one KV cache per MTP layer."""

    trunk: List[Any]
    mtp: List[Any]


def make_caches(model) -> Caches:
    return Caches(trunk=model.make_trunk_cache(), mtp=model.make_mtp_cache())


class TrimRollback:
    """KV caches: a verify pass appends entries; rewinding trims the rejected tail."""

    @staticmethod
    def begin(cache) -> None:
        return None

    @staticmethod
    def rewind(cache, mark, n: int) -> None:
        if n > 0:
            cache.trim(n)


ADAPTERS: Dict[type, Any] = {KVCache: TrimRollback, QuantizedKVCache: TrimRollback}


def _adapter(cache):
    return ADAPTERS.get(type(cache))


def check_rollback(caches: List[Any]) -> None:
    """Raise `RollbackError` unless every cache can be rolled back exactly."""
    bad = sorted({type(c).__name__ for c in caches if _adapter(c) is None})
    if bad:
        raise RollbackError(
            f"speculative decoding needs exact cache rollback, which mlx-mtp does not "
            f"support yet for {', '.join(bad)}; use --num-draft-tokens 0"
        )


def begin_verify(caches: List[Any]) -> List[Any]:
    """Prepare every cache for a verify pass; returns the marks `rewind` needs."""
    return [_adapter(c).begin(c) for c in caches]


def rewind(caches: List[Any], marks: Optional[List[Any]], n: int) -> None:
    """Drop the last ``n`` positions from every cache (``marks`` from `begin_verify`)."""
    marks = marks or [None] * len(caches)
    for c, m in zip(caches, marks):
        _adapter(c).rewind(c, m, n)


def trim_to(cache, length: int) -> None:
    """Trim a KV cache so it holds exactly its first ``length`` positions (if longer)."""
    if cache.offset > length:
        cache.trim(cache.offset - length)


def cache_length(caches: List[Any]) -> int:
    """Positions held by a trunk cache list (all layers hold the same count)."""
    return caches[0].offset if caches else 0

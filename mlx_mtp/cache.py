"""Caches for speculative decoding, and the one helper that rolls them back.

The trunk's caches are mlx-lm's own (`make_prompt_cache`), except that recurrent layers
whose mixer can record per-position states get a `RecurrentCache`; each MTP layer has a
plain `KVCache` whose row i holds position i. Rollback goes through `begin_verify`
(called before a verify pass writes k+1 positions) and `rewind` (called after, with the
number of positions to drop). Each cache type has an adapter:

- KV caches (`KVCache`, `QuantizedKVCache`) trim the rejected tail;
- `RecurrentCache` asks its layer to record ``[conv_state, ssm_state]`` after every
  position of the pass (a `Capture`) and, on rewind, puts back the record at the
  accepted length: O(k) states per layer, no recomputation, and nothing at all to do
  when every draft is accepted.

A cache with no adapter (a sliding-window `RotatingKVCache`, or an `ArraysCache` whose
mixer cannot record states) makes `check_rollback` fail before decoding starts.
"""

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from .errors import MTPError, RollbackError

log = logging.getLogger("mlx_mtp")


@dataclass
class Caches:
    """The trunk's per-layer caches and one KV cache per MTP layer."""

    trunk: List[Any]
    mtp: List[Any]


def make_caches(model, max_kv_size: Optional[int] = None) -> Caches:
    """Fresh caches; ``max_kv_size`` gives attention layers a rotating window, as in
    mlx-lm (models that make their own caches ignore it there too)."""
    trunk = model.make_trunk_cache(max_kv_size=max_kv_size)
    if model.records_states:
        trunk = with_recurrent_caches(trunk)
    caches = Caches(trunk=trunk, mtp=model.make_mtp_cache())
    if max_kv_size and not any(isinstance(c, RotatingKVCache) for c in caches.trunk):
        log.warning(
            "max_kv_size has no effect: %s makes its own caches (as in mlx-lm)",
            model.model_type,
        )
    return caches


@dataclass(frozen=True)
class KVQuantization:
    """mlx-lm's KV-cache quantization settings (``--kv-bits`` and friends)."""

    bits: Optional[int] = None
    group_size: int = 64
    start: int = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START

    def apply(self, caches: List[Any]) -> None:
        """Quantize the trunk's KV caches that reached ``start`` positions, in place,
        at the same points mlx-lm does (after a model call)."""
        if self.bits is None:
            return
        from mlx_lm.generate import maybe_quantize_kv_cache

        self.check(caches)
        maybe_quantize_kv_cache(caches, self.start, self.group_size, self.bits)

    def check(self, caches: List[Any]) -> None:
        """Refuse, before anything is quantized, a group size that does not divide the
        width of the cached keys and values (MLX quantizes along the last axis)."""
        for c in caches:
            for a in (getattr(c, "keys", None), getattr(c, "values", None)):
                if isinstance(a, mx.array) and a.shape[-1] % self.group_size:
                    raise MTPError(_group_size_advice(a.shape[-1], self.group_size))


def _group_size_advice(width: int, group_size: int) -> str:
    fits = [g for g in (128, 64, 32) if width % g == 0]
    advice = (
        f"use --kv-group-size {fits[0]}"
        if fits
        else "no KV quantization group size (32, 64, 128) divides it: drop --kv-bits"
    )
    return (
        f"--kv-bits: this model caches keys/values {width} wide, which "
        f"--kv-group-size {group_size} does not divide; {advice}"
    )


class TrimRollback:
    """KV caches: a verify pass appends entries; rewinding trims the rejected tail."""

    @staticmethod
    def begin(cache) -> None:
        return None

    @staticmethod
    def rewind(cache, mark, n: int) -> None:
        if n > 0:
            cache.trim(n)


class RecurrentCache(ArraysCache):
    """An `ArraysCache` whose layer records its contents after every position of a pass
    when ``capture`` is set (see `mlx_mtp.models.capture`). The layer clears
    ``capture`` when it has recorded."""

    def __init__(self, size: int):
        super().__init__(size)
        self.capture: Optional["Capture"] = None


@dataclass
class Capture:
    """What a recurrent layer recorded during one verify pass.

    ``base`` is the cache contents before the pass, ``steps[t]`` after position t, and
    ``kept`` how many of the pass's positions the cache holds now.
    """

    base: List[Any]
    steps: Optional[List[List[Any]]] = None
    kept: int = 0

    def record(self, steps: List[List[Any]]) -> None:
        self.steps = steps
        self.kept = len(steps)


class CaptureRollback:
    """Recurrent caches: record states per position, restore the accepted one."""

    @staticmethod
    def begin(cache) -> Capture:
        cache.capture = Capture(list(cache.cache))
        return cache.capture

    @staticmethod
    def rewind(cache, mark: Optional[Capture], n: int) -> None:
        if n <= 0:
            return
        if mark is None or mark.steps is None or n > mark.kept:
            raise RollbackError(
                f"cannot roll a recurrent cache back by {n} positions: no state recorded"
            )
        mark.kept -= n
        cache.cache = list(mark.steps[mark.kept - 1] if mark.kept else mark.base)


ADAPTERS: Dict[type, Any] = {
    KVCache: TrimRollback,
    QuantizedKVCache: TrimRollback,
    RecurrentCache: CaptureRollback,
}


def with_recurrent_caches(caches: List[Any]) -> List[Any]:
    """Replace fresh `ArraysCache` entries with `RecurrentCache` (same slots)."""
    return [
        RecurrentCache(len(c.cache)) if type(c) is ArraysCache else c for c in caches
    ]


def _adapter(cache):
    return ADAPTERS.get(type(cache))


def check_rollback(caches: List[Any]) -> None:
    """Raise `RollbackError` unless every cache can be rolled back exactly."""
    bad = sorted({type(c).__name__ for c in caches if _adapter(c) is None})
    if "RotatingKVCache" in bad:
        raise RollbackError(
            "MTP drafting cannot roll back a sliding-window (rotating) KV cache exactly "
            "once it wraps; drop --max-kv-size or use --num-draft-tokens 0"
        )
    if bad:
        raise RollbackError(
            f"speculative decoding needs exact cache rollback, which mlx-mtp does not "
            f"support for {', '.join(bad)} in this model; use --num-draft-tokens 0"
        )


def begin_verify(caches: List[Any]) -> List[Any]:
    """Prepare every cache for a verify pass; returns the marks `rewind` needs."""
    return [a.begin(c) if (a := _adapter(c)) else None for c in caches]


def rewind(
    caches: List[Any], marks: Optional[List[Any]], n: int, strict: bool = True
) -> None:
    """Drop the last ``n`` positions from every cache (``marks`` from `begin_verify`).

    A cache with no exact rollback (only possible in plain decoding, which never
    rewinds mid-generation) raises `RollbackError`, or is left as is when not
    ``strict`` (cleanup on exit).
    """
    marks = marks or [None] * len(caches)
    for c, m in zip(caches, marks):
        adapter = _adapter(c)
        if adapter is not None:
            adapter.rewind(c, m, n)
        elif n > 0 and strict:
            raise RollbackError(f"{type(c).__name__} cannot be rolled back")


def trim_to(cache, length: int) -> None:
    """Trim a KV cache so it holds exactly its first ``length`` positions (if longer)."""
    if cache.offset > length:
        cache.trim(cache.offset - length)

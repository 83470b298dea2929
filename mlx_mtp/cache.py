"""Caches for speculative decoding, and the one helper that rolls them back.

The trunk's caches are mlx-lm's own (`make_prompt_cache`), except that sliding-window
layers get a `WindowCache` and recurrent layers whose mixer can record per-position
states a `RecurrentCache`; each MTP layer has a plain `KVCache` whose row i holds
position i. Rollback goes through `begin_verify`
(called before a verify pass writes k+1 positions) and `rewind` (called after, with the
number of positions to drop). Each cache type has an adapter:

- KV caches (`KVCache`, `QuantizedKVCache`) trim the rejected tail;
- sliding-window layers (mlx-lm's ``RotatingKVCache``: a model's own, without sinks, as
  its ``make_cache`` makes them, and every attention layer under ``--max-kv-size``,
  with its sink tokens) get a `WindowCache`, which gives every query of a multi-token
  pass its own window and keeps enough history to trim the tail, so drafting stays
  exact however often the window wraps;
- `RecurrentCache` asks its layer to record ``[conv_state, ssm_state]`` after every
  position of the pass (a `Capture`) and, on rewind, puts back the record at the
  accepted length: O(k) states per layer, no recomputation, and nothing at all to do
  when every draft is accepted.

A cache with no adapter (a ``RotatingKVCache`` not made by `make_caches`, or an
`ArraysCache` whose mixer cannot record states) makes `check_rollback` fail before
decoding starts.
"""

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
)

from .defaults import MIN_KV_SIZE, SINK_TOKENS
from .errors import MTPError, RollbackError

log = logging.getLogger("mlx_mtp")


@dataclass
class Caches:
    """The trunk's per-layer caches and one KV cache per MTP layer."""

    trunk: List[Any]
    mtp: List[Any]


def make_caches(model, max_kv_size: Optional[int] = None) -> Caches:
    """Fresh caches; ``max_kv_size`` gives attention layers a rotating window, as in
    mlx-lm (models that make their own caches ignore it there too).

    Raises:
        MTPError: ``max_kv_size`` is not None or a whole number >= `MIN_KV_SIZE`.
    """
    check_max_kv_size(max_kv_size)
    made = model.make_trunk_cache(max_kv_size=max_kv_size)
    if max_kv_size and not any(isinstance(c, RotatingKVCache) for c in made):
        log.warning(
            "max_kv_size has no effect: %s makes its own caches (as in mlx-lm)",
            model.model_type,
        )
    trunk = with_list_caches(with_window_caches(made))
    if model.records_states:
        trunk = with_recurrent_caches(trunk)
    caches = Caches(trunk=trunk, mtp=mtp_caches(model))
    return caches


def check_max_kv_size(max_kv_size) -> None:
    """Refuse a ``max_kv_size`` that leaves no room past the sink tokens."""
    if max_kv_size is None:
        return
    if type(max_kv_size) is not int or max_kv_size < MIN_KV_SIZE:
        raise MTPError(
            f"max_kv_size must be a whole number of at least {MIN_KV_SIZE} (the "
            f"{SINK_TOKENS} sink tokens and one more), got {max_kv_size!r}"
        )


def mtp_caches(model) -> List[Any]:
    """One cache per MTP layer: a KV cache, a `WindowCache` for a block with a sliding
    window (``MTPLayer.window``), or a `ListCache` of KV caches for an attention that
    keeps several (``MTPLayer.kv_caches``)."""
    return [_mtp_cache(layer) for layer in model.mtp.layers]


def _mtp_cache(layer):
    if layer.window:
        return WindowCache(layer.window)
    if layer.kv_caches > 1:
        return ListCache(*(KVCache() for _ in range(layer.kv_caches)))
    return KVCache()


class ListCache(CacheList):
    """mlx-lm's `CacheList` (one layer's several caches, e.g. DeepSeek-V3.2's MLA latent
    and indexer keys) with the offset and mask of its first cache and a plain list
    of its caches' states, so it reads like any other cache to the decode loop."""

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def make_mask(self, *args, **kwargs):
        return self.caches[0].make_mask(*args, **kwargs)

    @property
    def state(self):
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v):
        for c, s in zip(self.caches, v):
            c.state = s


def with_list_caches(caches: List[Any]) -> List[Any]:
    """Replace mlx-lm's `CacheList` entries by `ListCache`s of the same caches."""
    return [ListCache(*c.caches) if type(c) is CacheList else c for c in caches]


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
        width of the cached keys and values (MLX quantizes along the last axis), and
        sliding-window layers, whose caches mlx-lm cannot quantize either."""
        if any(isinstance(c, (WindowCache, RotatingKVCache)) for c in caches):
            raise MTPError(
                "--kv-bits: this model has sliding-window attention layers, whose KV "
                "cache cannot be quantized (nor in mlx-lm); drop --kv-bits"
            )
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


class WindowCache(_BaseCache):  # mlx-lm's cache base: its defaults, as its caches have
    """A sliding-window attention layer's cache that a multi-token pass and a rollback
    keep exact.

    Each query at position q sees exactly what one-token decoding with mlx-lm's
    ``RotatingKVCache(max_size=window, keep=keep)`` gives it: the ``keep`` first
    positions (sink tokens; none for a model's own sliding-window layers) and the last
    ``window - keep`` positions, q included, whatever the number of tokens in the pass.
    The sinks are kept apart; the other keys are kept in temporal order in a buffer of
    the last ``window - keep - 1 + slack`` positions (memory O(window + slack)), so a
    pass can be rolled back by up to ``slack`` positions (the drafts of the rounds in
    flight) and every later query still finds its whole window. Rolling back further
    is a `RollbackError`, never a wrong answer.
    """

    step = 256

    def __init__(self, window: int, keep: int = 0, slack: int = 64):
        if not 0 <= keep < window:
            raise ValueError(f"keep must be in [0, window), got {keep}")
        self.window, self.keep, self.slack = window, keep, slack
        self.sinks = None  # (keys, values) of positions < keep
        self.keys = self.values = None  # the buffer of positions >= keep
        self.offset = 0  # absolute position of the next token
        self.start = keep  # absolute position of the oldest buffered entry
        self._base = 0  # its index in the buffer

    @property
    def max_size(self) -> int:
        return self.window

    def _kept(self) -> int:
        return max(0, self.offset - self.start)

    def _reserve(self, keys: mx.array, values: mx.array) -> None:
        """Room for ``keys`` after the kept entries: compact to the front and grow."""
        n, kept = keys.shape[2], self._kept()
        if self.keys is not None and self._base + kept + n <= self.keys.shape[2]:
            return
        size = self.step * ((kept + n + self.step - 1) // self.step)
        B, H, _, dk = keys.shape
        new_k = mx.zeros((B, H, size, dk), keys.dtype)
        new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
        if kept:
            new_k[..., :kept, :] = self.keys[..., self._base : self._base + kept, :]
            new_v[..., :kept, :] = self.values[..., self._base : self._base + kept, :]
        self.keys, self.values, self._base = new_k, new_v, 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append a pass's keys and values; return the sinks and every buffered entry,
        oldest first (`make_mask` says which of them each query sees)."""
        self._check_window()
        n = keys.shape[2]
        s = min(n, max(0, self.keep - self.offset))  # new sink positions
        if s:
            old = self._sinks()
            new = (keys[:, :, :s], values[:, :, :s])
            self.sinks = (
                new
                if old is None
                else tuple(mx.concatenate([o, x], axis=2) for o, x in zip(old, new))
            )
            self.offset += s
            keys, values = keys[:, :, s:], values[:, :, s:]
        if keys.shape[2]:
            self._reserve(keys, values)
            end = self._base + self._kept()
            self.keys[..., end : end + keys.shape[2], :] = keys
            self.values[..., end : end + keys.shape[2], :] = values
            self.offset += keys.shape[2]
        out = self._fetch()
        drop = max(0, self._kept() - (self.window - self.keep - 1 + self.slack))
        self.start += drop  # no later query nor rollback within slack needs them
        self._base += drop
        return out

    def _sinks(self):
        """The sink entries still held (fewer than ``keep`` after an early trim)."""
        held = min(self.keep, self.offset)
        if self.sinks is None or not held:
            return None
        return tuple(a[:, :, :held] for a in self.sinks)

    def _fetch(self):
        parts = []
        if self._kept():
            end = self._base + self._kept()
            buffered = (self.keys[..., self._base : end, :],)
            parts.append(buffered + (self.values[..., self._base : end, :],))
        sinks = self._sinks()
        if sinks is not None:
            parts.insert(0, sinks)
        if len(parts) == 1:
            return parts[0]
        return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in (0, 1))

    def _check_window(self) -> None:
        needed = max(self.keep, self.offset - (self.window - self.keep) + 1)
        if self.start > needed:
            raise RollbackError(
                f"a sliding-window cache was rolled back past the {self.slack} "
                "positions it keeps for rollback"
            )

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """The mask of a pass of N queries over `update_and_fetch`'s entries: query
        at position q sees the sinks and the positions q - (window - keep) + 1 .. q.
        None when every query sees every entry."""
        recent = (window_size or self.window) - self.keep
        end = self.offset + N
        if N == 1 and self._kept() + 1 <= recent and not return_array:
            return None
        sinks = mx.arange(min(self.keep, end))
        k = mx.concatenate([sinks, mx.arange(self.start, max(self.start, end))])[None]
        q = mx.arange(self.offset, end)[:, None]
        return (k <= q) & ((k < self.keep) | (k > q - recent))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if self.offset < self.start and self.start > self.keep:
            raise RollbackError(
                "a sliding-window cache was rolled back past the oldest entry it keeps"
            )
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    def empty(self) -> bool:
        return self.offset == 0 and self.keys is None and self.sinks is None

    @property
    def state(self):
        return [
            a for a in (self.sinks or ()) + (self.keys, self.values) if a is not None
        ]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def committed_kv(cache, last: Optional[int] = None):
    """``(keys, values)`` of the positions a KV or window cache holds, or of its
    ``last`` positions only: views of the cache's buffers, nothing copied. (A reader
    of a trunk's caches between rounds, such as a Gemma 4 assistant.)

    Raises:
        RollbackError: a window cache no longer holds ``last`` positions.
    """
    if isinstance(cache, WindowCache):
        if cache.keep:
            raise MTPError("cannot read a window cache with sink tokens")
        n = cache._kept() if last is None else min(last, cache.offset)
        if n > cache._kept():
            raise RollbackError(
                f"a sliding-window cache holds {cache._kept()} positions; "
                f"{n} were asked for"
            )
        end = cache._base + cache._kept()
        return cache.keys[..., end - n : end, :], cache.values[..., end - n : end, :]
    if type(cache) is KVCache:
        start = 0 if last is None else max(0, cache.offset - last)
        return (
            cache.keys[..., start : cache.offset, :],
            cache.values[..., start : cache.offset, :],
        )
    raise MTPError(f"cannot read the keys and values of a {type(cache).__name__}")


def assistant_kv(model, trunk_caches) -> dict:
    """Layer type -> the trunk's K/V an assistant reads, in place: every committed
    position of its full-attention layer, the last W + 1 of its sliding one."""
    window = model.assistant.window
    return {
        kind: committed_kv(
            trunk_caches[i], window if kind == "sliding_attention" else None
        )
        for kind, i in model.reads.items()
    }


def with_window_caches(caches: List[Any], slack: int = 64) -> List[Any]:
    """Replace fresh ``RotatingKVCache`` entries (a model's sliding-window layers, or
    every layer under ``--max-kv-size``, with its sink tokens) by `WindowCache`s of
    the same window and sinks."""
    return [
        (
            WindowCache(c.max_size, c.keep, slack)
            if type(c) is RotatingKVCache and c.empty()
            else c
        )
        for c in caches
    ]


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
                f"cannot roll a recurrent cache back by {n} positions: "
                "no state recorded"
            )
        mark.kept -= n
        cache.cache = list(mark.steps[mark.kept - 1] if mark.kept else mark.base)


ADAPTERS: Dict[type, Any] = {
    KVCache: TrimRollback,
    QuantizedKVCache: TrimRollback,
    WindowCache: TrimRollback,
    RecurrentCache: CaptureRollback,
}


def with_recurrent_caches(caches: List[Any]) -> List[Any]:
    """Replace fresh `ArraysCache` entries with `RecurrentCache` (same slots)."""
    return [
        RecurrentCache(len(c.cache)) if type(c) is ArraysCache else c for c in caches
    ]


class ListRollback:
    """A layer's several caches (`ListCache`): each rolls back with its own adapter."""

    @staticmethod
    def begin(cache) -> List[Any]:
        return begin_verify(list(cache.caches))

    @staticmethod
    def rewind(cache, marks: Optional[List[Any]], n: int) -> None:
        rewind(list(cache.caches), marks, n)


def _adapter(cache):
    if isinstance(cache, CacheList):
        exact = all(_adapter(c) is not None for c in cache.caches)
        return ListRollback if exact else None
    if getattr(cache, "rolls_back_by_trim", False):  # a family's own cache type
        return TrimRollback
    return ADAPTERS.get(type(cache))


def check_rollback(caches: List[Any]) -> None:
    """Raise `RollbackError` unless every cache can be rolled back exactly."""
    bad = sorted({type(c).__name__ for c in caches if _adapter(c) is None})
    if "RotatingKVCache" in bad:
        raise RollbackError(
            "MTP drafting cannot roll back mlx-lm's sliding-window RotatingKVCache "
            "exactly once it wraps: make the caches with mlx_mtp.cache.make_caches "
            "(its WindowCache rolls back), or decode with num_draft_tokens 0"
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
    """Trim a KV cache so that it holds exactly its first ``length`` positions (when
    it holds more)."""
    if cache.offset > length:
        cache.trim(cache.offset - length)

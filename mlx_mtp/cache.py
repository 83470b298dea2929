"""Caches for speculative decoding, and the protocol every cache type follows.

The trunk's caches are mlx-lm's own (`make_prompt_cache`), except that sliding-window
layers get a `WindowCache` and recurrent layers whose mixer can record per-position
states a `RecurrentCache`; each MTP layer has a plain `KVCache` whose row i holds
position i.

**The cache protocol.** Every operation that depends on a cache's type is a method of
the cache's class, under mlx-lm's batch names where it has one (``BatchKVCache``:
``merge``, ``extend``, ``filter``, ``extract``, ``prepare``, ``finalize``), so that the
decode loop, the batch and the server never switch on a cache type:

- rollback: ``can_roll_back()``; ``mark(record=True)`` before a verify pass writes k+1
  positions (what a rollback needs; ``record`` False: a pass never rolled back, whose
  mark only keeps the states before it); ``rewind(mark, n)`` drops the last n
  positions of every row, ``rewind_rows(drop, mark)`` the last ``drop[b]`` of row b,
  ``keep_below(limits)`` keeps row b's positions below ``limits[b]``;
- rows: ``prepare(left_padding=...)`` / ``finalize()`` around a pass whose rows are
  left-padded; ``merge(caches)`` (a classmethod, as in mlx-lm) makes one batch cache
  whose rows are the given streams' caches; a batch cache ``extend(other)``s,
  ``filter(rows)``s and ``extract(b, below, mark)``s row b as one stream's cache;
  ``batch_refusal()`` names what cannot batch (None when all can);
- memory and copies: ``nbytes``; ``cost()`` ``(per_token, windows, per_row)``, the
  bytes of its batched form read off a cache that has seen a few positions (bytes
  per position held, ``(bytes per position, positions kept)`` of each sliding
  window, and bytes per row); ``snapshot()``, a copy whose arrays are new objects;
- readers: ``read_kv(positions, window)``, ``((keys, values), mask)`` of what a reader
  at row b's ``positions[b]`` sees (a Gemma 4 assistant).

mlx-mtp's caches implement it (`WindowCache` and `RaggedKVCache` in
`mlx_mtp.kv_cache`, `ListCache`, `RaggedList` and `RecurrentCache` here, a family's
own in its module: DeepSeek-V4's in `mlx_mtp.models.deepseek_v4_cache`); mlx-lm's
classes get an adapter here (`LM_ADAPTERS`: ``KVCache`` and ``QuantizedKVCache``
roll back by a trim; any other, such as a ``RotatingKVCache`` not made by
`make_caches` or an ``ArraysCache`` whose mixer cannot record states, has no exact
rollback, which makes `check_rollback` fail before decoding starts). `ops` gives a
cache's operations either way.

How each type rolls back:

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
"""

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .defaults import MIN_KV_SIZE, SINK_TOKENS
from .errors import MTPError, RollbackError
from .kv_cache import (
    NO_COST,
    RaggedKVCache,
    WindowCache,
    copy_arrays,
    kv_cost,
)
from .media import MediaCache
from .one_row import OneRow, TrimsTail
from .rows import Rows, apart, batches_apart

log = logging.getLogger("mlx_mtp")

ApartWindowCache = apart(WindowCache)  # a window whose streams batch apart


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
    keeps several (``MTPLayer.kv_caches``); with a block drafter, one cache per
    drafter layer, its context rows (row i: committed position i): a KV cache, or
    a `WindowCache` when its blocks see the last ``context_windows`` rows only,
    whose streams batch apart (`mlx_mtp.rows.Rows`) when the drafter's passes take
    one stream (its ``rows_apart``)."""
    drafter = model.drafter
    if drafter is not None:
        kind = ApartWindowCache if drafter.rows_apart else WindowCache
        return [KVCache() if w is None else kind(w) for w in drafter.context_windows]
    return [_mtp_cache(layer) for layer in model.mtp.layers]


def block_context(drafter, caches: List[Any], positions) -> List[Any]:
    """Per layer of the block ``drafter``, what a block after ``positions`` (one
    per row) reads of its context cache in ``caches`` (`mtp_caches`): the last rows
    of the layer's window (its ``context_windows``), or all."""
    windows = drafter.context_windows
    return [ops(c).read_kv(positions, w) for c, w in zip(caches, windows)]


def _mtp_cache(layer):
    if layer.window:
        return WindowCache(layer.window)
    if layer.make_caches is not None:
        parts = layer.make_caches()
    else:
        parts = [KVCache() for _ in range(layer.kv_caches)]
    if layer.reads_media:  # the prompt's images (`mlx_mtp.media`)
        parts.append(MediaCache())
    return ListCache(*parts) if len(parts) > 1 else parts[0]


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


# -- mlx-lm's cache classes, adapted to the protocol ---------------------------------


class LMCache(OneRow):
    """An mlx-lm cache with no exact rollback (a ``RotatingKVCache`` that wrapped, an
    ``ArraysCache`` that records no states, ...): plain decoding only, no batch."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def offset(self) -> int:
        return self.cache.offset

    def can_roll_back(self) -> bool:
        return False

    def mark(self, record: bool = True) -> None:
        return None

    def rewind(self, mark, n: int) -> None:
        if n > 0:
            raise RollbackError(f"{type(self.cache).__name__} cannot be rolled back")

    def batch_refusal(self) -> Optional[str]:
        return type(self.cache).__name__

    def merge(self, caches):
        raise MTPError(f"no batched cache for {type(self.cache).__name__}")

    def cost(self):
        return NO_COST

    def snapshot(self):
        return copy_arrays(self.cache)

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        name = type(self.cache).__name__
        raise MTPError(f"cannot read the keys and values of a {name}")


class LMKVCache(TrimsTail, LMCache):
    """mlx-lm's ``KVCache`` and ``QuantizedKVCache``: a rollback trims the tail; a
    ``KVCache``'s rows batch as `RaggedKVCache` rows."""

    def trim(self, n: int) -> None:
        self.cache.trim(n)

    def batch_refusal(self) -> Optional[str]:
        return None if type(self.cache) is KVCache else type(self.cache).__name__

    def merge(self, caches) -> RaggedKVCache:
        """The streams' ``KVCache``s as the rows of one `RaggedKVCache`."""
        rows = [_kv_row(c) for c in caches]
        for r in rows[1:]:
            rows[0].extend(r)
        return rows[0]

    def cost(self):
        return kv_cost(self.cache.keys, self.cache.values)

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        if type(self.cache) is not KVCache:
            return super().read_kv(positions, window)
        c = self.cache
        start = 0 if window is None else max(0, c.offset - window)
        kv = c.keys[..., start : c.offset, :], c.values[..., start : c.offset, :]
        return kv, None


def _kv_row(c: KVCache) -> RaggedKVCache:
    if c.keys is None:
        return RaggedKVCache(1)
    n = c.offset
    return RaggedKVCache.from_kv(c.keys[..., :n, :], c.values[..., :n, :], range(n))


LM_ADAPTERS: Dict[type, type] = {KVCache: LMKVCache, QuantizedKVCache: LMKVCache}


def ops(cache):
    """``cache``'s protocol operations: the cache itself when its class implements
    the protocol (it has ``rewind_rows``), else the adapter of its mlx-lm class
    (`LM_ADAPTERS`; `LMCache`, no rollback, for any other)."""
    if hasattr(cache, "rewind_rows"):
        return cache
    return LM_ADAPTERS.get(type(cache), LMCache)(cache)


# -- a layer's several caches ---------------------------------------------------------


class Marks(list):
    """The marks of a layer's several caches (`ListCache.mark`), one per cache."""

    def filter(self, idx: mx.array) -> "Marks":
        return Marks(filter_mark(m, idx) for m in self)


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

    def _parts(self):
        return [ops(c) for c in self.caches]

    def can_roll_back(self) -> bool:
        return all(p.can_roll_back() for p in self._parts())

    def mark(self, record: bool = True) -> Marks:
        return Marks(p.mark(record) for p in self._parts())

    def rewind(self, mark: Optional[Marks], n: int) -> None:
        for p, m in zip(self._parts(), mark or [None] * len(self.caches)):
            p.rewind(m, n)

    def rewind_rows(self, drop: Sequence[int], mark: Optional[Marks] = None) -> None:
        for p, m in zip(self._parts(), mark or [None] * len(self.caches)):
            p.rewind_rows(drop, m)

    def keep_below(self, limits: Sequence[int]) -> None:
        for p in self._parts():
            p.keep_below(limits)

    def prepare(self, **kwargs) -> None:
        for p in self._parts():
            p.prepare(**kwargs)

    def finalize(self) -> None:
        for p in self._parts():
            p.finalize()

    def batch_refusal(self) -> Optional[str]:
        return next(filter(None, (p.batch_refusal() for p in self._parts())), None)

    @classmethod
    def merge(cls, caches: Sequence["ListCache"]):
        """The streams' caches as one `RaggedList`, each part merged by its type; a
        layer with a part whose streams batch apart batches apart whole (`Rows` of
        the streams' `ListCache`s)."""
        if any(batches_apart(ops(p)) for p in caches[0].caches):
            return Rows.merge(caches)
        parts = zip(*(c.caches for c in caches))
        return RaggedList(*(ops(p[0]).merge(list(p)) for p in parts))

    def cost(self):
        return add_costs(p.cost() for p in self._parts())

    def snapshot(self) -> "ListCache":
        return ListCache(*(p.snapshot() for p in self._parts()))

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise MTPError("cannot read the keys and values of a ListCache")


def with_list_caches(caches: List[Any]) -> List[Any]:
    """Replace mlx-lm's `CacheList` entries by `ListCache`s of the same caches."""
    return [ListCache(*c.caches) if type(c) is CacheList else c for c in caches]


class RaggedList(ListCache):
    """One layer's several ragged caches (DeepSeek-V3.2's MLA latent and indexer
    keys) of B streams, read like a `ListCache` (the first one's offset and mask),
    every row operation applied to each."""

    @property
    def held(self) -> List[int]:
        return self.caches[0].held

    def filter(self, rows: Sequence[int]) -> None:
        for c in self.caches:
            c.filter(rows)

    def extend(self, other: "RaggedList") -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    def extract(self, b: int, below: Optional[int] = None, mark=None) -> ListCache:
        return ListCache(*(c.extract(b, below) for c in self.caches))


# -- recurrent layers -----------------------------------------------------------------


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

    def filter(self, idx: mx.array) -> "Capture":
        """The mark of rows ``idx`` only."""

        def pick(s):
            return None if s is None else s[idx]

        out = Capture([pick(s) for s in self.base])
        if self.steps is not None:
            out.record([[pick(s) for s in step] for step in self.steps])
            out.kept = self.kept
        return out


class RecurrentCache(ArraysCache):
    """An `ArraysCache` whose layer records its contents after every position of a pass
    when ``capture`` is set (see `mlx_mtp.models.capture`). The layer clears
    ``capture`` when it has recorded. Its rows are streams decoded together (one
    for a single stream)."""

    def __init__(self, size: int, rows: int = 1):
        super().__init__(size)
        self.capture: Optional[Capture] = None
        self.rows = rows

    def can_roll_back(self) -> bool:
        return True

    def mark(self, record: bool = True) -> Capture:
        """The contents before a pass; ``record``: the layer records each position's
        too (`capture`)."""
        mark = Capture(list(self.cache))
        if record:
            self.capture = mark
        return mark

    def rewind(self, mark: Optional[Capture], n: int) -> None:
        """Put back the state ``n`` positions before the last recorded one."""
        if n <= 0:
            return
        if mark is None or mark.steps is None or n > mark.kept:
            raise RollbackError(
                f"cannot roll a recurrent cache back by {n} positions: "
                "no state recorded"
            )
        mark.kept -= n
        self.cache = list(mark.steps[mark.kept - 1] if mark.kept else mark.base)

    def rewind_rows(self, drop: Sequence[int], mark: Optional[Capture] = None) -> None:
        """Put back row b's recorded state after its kept positions (``steps[t]``:
        after position t of the pass, ``base``: before it)."""
        if len(drop) == 1:
            return self.rewind(mark, drop[0])
        if not any(drop):
            return
        if mark is None or mark.steps is None:
            raise RollbackError("no state was recorded for a recurrent cache")
        S = len(mark.steps)
        kept = mx.array([S - d for d in drop], dtype=mx.int32)  # 0: the base state
        rows = mx.arange(len(drop))
        slots = []
        for i in range(len(self.cache)):
            stack = mx.stack([mark.base[i]] + [s[i] for s in mark.steps])  # (S+1, B,..)
            slots.append(stack[kept, rows])
        self.cache = slots

    def keep_below(self, limits: Sequence[int]) -> None:
        raise RollbackError("a recurrent cache keeps no positions to drop")

    def prepare(self, left_padding: Optional[Sequence[int]] = None, **kwargs) -> None:
        """Mask row b's first ``left_padding[b]`` inputs of the next pass, as mlx-lm's
        batched prefill does."""
        if left_padding is not None and any(left_padding):
            self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        else:
            self.finalize()

    def finalize(self) -> None:
        self.left_padding = self.lengths = None

    def batch_refusal(self) -> Optional[str]:
        return None

    @classmethod
    def merge(cls, caches: Sequence["RecurrentCache"]) -> "RecurrentCache":
        """The streams' states stacked, one row each."""
        rows = [cls(len(c.cache)) for c in caches]
        for row, c in zip(rows, caches):
            row.cache = list(c.cache)
        for row in rows[1:]:
            rows[0].extend(row)
        return rows[0]

    def extend(self, other: "RecurrentCache") -> None:
        """Append ``other``'s rows. An empty slot (no token seen yet: a one-token
        prompt) is the zero state mlx-lm's mixers start from."""
        rows = (self.rows, other.rows)
        self.cache = [_cat(p, q, rows) for p, q in zip(self.cache, other.cache)]
        self.rows += other.rows

    def filter(self, rows: Sequence[int]) -> None:
        """Keep ``rows``, in that order."""
        idx = mx.array(list(rows), dtype=mx.int32)
        self.cache = [None if s is None else s[idx] for s in self.cache]
        self.rows = len(rows)

    def extract(self, b: int, below=None, mark: Optional[Capture] = None):
        """Row b as one stream's cache; ``mark``: a launched round's, whose states
        before it are given instead of the cache's own."""
        out = RecurrentCache(len(self.cache))
        slots = mark.base if mark is not None else self.cache
        # the row gathered into a buffer of its own: a slice, or a copy of one
        # (which may take over the slice's buffer), would hold every row's states
        # (a kept session is counted at its arrays' sizes:
        # `mlx_mtp.serving.sessions.Sessions`)
        row = mx.array([b])
        out.cache = [None if s is None else mx.take(s, row, axis=0) for s in slots]
        return out

    def cost(self):
        return 0.0, (), float(sum(a.nbytes for a in self.cache if a is not None))

    def snapshot(self) -> "RecurrentCache":
        return copy_arrays(self, skip=("capture",))

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise MTPError("cannot read the keys and values of a RecurrentCache")


def _cat(p, q, rows: Sequence[int]):
    """Two recurrent slots' rows stacked (``rows``: how many each has); an empty
    slot is zeros."""
    if p is None and q is None:
        return None
    like = p if p is not None else q
    p = p if p is not None else mx.zeros((rows[0], *like.shape[1:]), like.dtype)
    q = q if q is not None else mx.zeros((rows[1], *like.shape[1:]), like.dtype)
    return mx.concatenate([p, q])


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


def with_recurrent_caches(caches: List[Any]) -> List[Any]:
    """Replace fresh `ArraysCache` entries with `RecurrentCache` (same slots)."""
    return [
        RecurrentCache(len(c.cache)) if type(c) is ArraysCache else c for c in caches
    ]


# -- over a list of caches ------------------------------------------------------------


def check_rollback(caches: List[Any]) -> None:
    """Raise `RollbackError` unless every cache can be rolled back exactly."""
    bad = sorted({type(c).__name__ for c in caches if not ops(c).can_roll_back()})
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


def begin_verify(caches: List[Any], record: bool = True) -> List[Any]:
    """Prepare every cache for a verify pass; returns the marks `rewind` needs
    (``record`` False: a pass that will not be rolled back, whose marks only keep
    the recurrent states before it)."""
    return [ops(c).mark(record) for c in caches]


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
        o = ops(c)
        if o.can_roll_back() or strict:
            o.rewind(m, n)


def rewind_rows(caches: List[Any], marks: List[Any], drop: Sequence[int]) -> None:
    """Drop the last ``drop[b]`` positions of row b from every cache (``marks`` from
    `begin_verify` before the pass)."""
    marks = marks or [None] * len(caches)
    for c, m in zip(caches, marks):
        ops(c).rewind_rows(drop, m)


def keep_below(caches: List[Any], limits: Sequence[int]) -> None:
    """Every cache keeps row b's positions below ``limits[b]``."""
    for c in caches:
        ops(c).keep_below(limits)


def trim_to(cache, length: int) -> None:
    """Trim a one-stream cache so that it holds at most its first ``length``
    positions."""
    ops(cache).keep_below([length])


def prepare(caches: List[Any], left_padding: Optional[Sequence[int]]) -> None:
    """Left-pad the next pass over ``caches`` (row b's first ``left_padding[b]``
    inputs are filler); None: the padded pass is over (`finalize`)."""
    for c in caches:
        if left_padding is None:
            ops(c).finalize()
        else:
            ops(c).prepare(left_padding=list(left_padding))


def filter_mark(mark, idx: mx.array):
    """A `begin_verify` mark of a batch cache, rows ``idx`` only."""
    return None if mark is None else mark.filter(idx)


def snapshot(cache):
    """A copy of ``cache`` whose arrays are new objects, no rollback record kept."""
    return ops(cache).snapshot()


def add_costs(costs) -> tuple:
    """``(per_token, windows, per_row)`` summed over caches' `cost`s."""
    per_token, windows, per_row = 0.0, (), 0.0
    for t, w, r in costs:
        per_token, windows, per_row = per_token + t, windows + tuple(w), per_row + r
    return per_token, windows, per_row


def batch_cost(caches: List[Any]) -> tuple:
    """The summed `cost` of ``caches`` (see the protocol)."""
    return add_costs(ops(c).cost() for c in caches)


def committed_kv(cache, last: Optional[int] = None):
    """``(keys, values)`` of the positions a one-stream KV or window cache holds, or
    of its ``last`` positions only: views of its buffers, nothing copied. (A reader
    of a trunk's caches between rounds, such as a Gemma 4 assistant.)

    Raises:
        RollbackError: a window cache no longer holds ``last`` positions.
    """
    return ops(cache).read_kv([cache.offset], last)[0]


def assistant_kv(model, trunk_caches) -> dict:
    """Layer type -> the trunk's K/V an assistant reads, in place: every committed
    position of its full-attention layer, the last W + 1 of its sliding one."""
    return assistant_view(model, trunk_caches, [None])[0]


def assistant_view(model, trunk_caches, positions: Sequence[Optional[int]]):
    """What an assistant reads of the trunk's caches for rows at ``positions``:
    ``(kv, masks, position)``; ``masks`` None when every row sees every entry
    given (one stream), and ``position`` then ``positions[0]``, else ``(B,)``."""
    window = model.assistant.window
    kv, masks = {}, {}
    for kind, i in model.reads.items():
        last = window if kind == "sliding_attention" else None
        kv[kind], masks[kind] = ops(trunk_caches[i]).read_kv(positions, last)
    if all(m is None for m in masks.values()):
        return kv, None, positions[0]
    return kv, masks, mx.array(list(positions), dtype=mx.int32)

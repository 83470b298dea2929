"""Caches of several streams decoded together, each row rolled back on its own.

A batched verify pass writes k+1 positions into every row; rows then accept different
numbers of drafts. The caches here drop each row's rejected positions without touching
the others':

- `RaggedKVCache` holds every row's keys and values in one buffer written at a shared
  index, and each entry's *position in its own row's sequence* (``pos``, -1 for an
  entry no query may see: left padding, or a rejected draft). A row's rejected tail
  becomes a hole; the attention mask is built from ``pos``, so a hole is never seen,
  and RoPE reads each row's own next position (``offset``, one per row). Holes cost
  only width: when they pile up, `compact` packs every row's entries to the right.
  A sliding window is a mask on ``pos`` too (and `compact` drops what it no longer
  needs), so one class serves full and sliding-window attention, and the MTP layers'
  caches (whose rows are padded on the left when streams have different numbers of
  pending rows: `pad`).
- The trunk's recurrent layers keep a `mlx_mtp.cache.RecurrentCache` with B rows; its
  per-position capture has every row's states, and `rewind_rows` puts back, per row,
  the state at that row's accepted length.
- DeepSeek-V4's attention layers keep a `V4Rows`
  (`mlx_mtp.models.deepseek_v4_cache`): one `V4Cache` per row, each at its own block
  phase, rolled back by a trim of its own count; left padding never enters it.

`to_batch` turns one stream's caches (as `mlx_mtp.cache.make_caches` makes them and the
single-stream prefill fills them) into one-row batch caches, `join` stacks rows,
`select` keeps some rows, and `to_single` gives one row's caches back (a `Session` to
go on from later). `batch_support` says whether a model's caches can batch at all.
"""

from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache

from .cache import Caches, Capture, ListCache, RecurrentCache, WindowCache
from .models.deepseek_v4_cache import V4Cache, V4Rows

COMPACT_SLACK = 64  # holes of the widest row tolerated before `compact`


class RaggedKVCache(_BaseCache):
    """Keys and values of B rows in one ``(B, heads, T, D)`` buffer.

    Attributes:
        pos: ``(B, T)`` int32, the position of each entry in its row's sequence, or -1
            for an entry no query sees.
        offset: each row's next position (what RoPE reads): an int while every row
            is at the same one (one stream, say: as mlx-lm's ``KVCache``), else a
            ``(B,)`` int32 array.
        held: per row (host side), the number of entries with ``pos >= 0``.
        window: the sliding window of the layer (None: full attention).

    The bookkeeping is on the host while it can be: the offsets always, and ``pos``
    while the cache is *dense* (every row's entries are its last ``T`` positions, in
    order: no hole, no padding). A dense cache's pass costs what a ``KVCache``'s
    does; ``pos`` is stored (and written by each pass) from the first hole or
    padding on.
    """

    step = 256

    def __init__(self, batch_size: int = 0, window: Optional[int] = None):
        self.keys = self.values = None
        self._pos = None  # None: dense (see the class docstring)
        self._off = [0] * batch_size  # host: each row's next position
        self._off_array = None  # `offset`'s array, made on first need
        self.held = [0] * batch_size
        self.window = window
        self._idx = 0
        self._pad = None  # (B,) left padding of the next write (see `pad`)

    @classmethod
    def from_kv(cls, keys, values, positions: Sequence[int], window=None):
        """One row holding ``keys``/``values`` ``(1, heads, n, D)`` at ``positions``."""
        positions = list(positions)
        c = cls(1, window)
        c.keys, c.values = keys, values
        c._idx = keys.shape[2] if keys is not None else 0
        nxt = positions[-1] + 1 if positions else 0
        c._set_offsets([nxt])
        c.held = [len(positions)]
        if positions != list(range(nxt - len(positions), nxt)):
            c._pos = mx.array([positions], dtype=mx.int32)
        return c

    @property
    def batch_size(self) -> int:
        return len(self.held)

    @property
    def offset(self):
        off = self._off
        if off and all(o == off[0] for o in off):
            return off[0]
        if self._off_array is None:
            self._off_array = mx.array(off, dtype=mx.int32)
        return self._off_array

    def _set_offsets(self, offsets: Sequence[int]) -> None:
        self._off, self._off_array = list(offsets), None

    def _offsets(self) -> mx.array:
        """``(B,)`` int32: each row's next position."""
        off = self.offset
        return off if isinstance(off, mx.array) else mx.full((len(self._off),), off)

    @property
    def pos(self) -> mx.array:
        if self._pos is not None:
            return self._pos
        return self._dense_pos(self.keys.shape[2] if self.keys is not None else 0)

    def _dense_pos(self, width: int) -> mx.array:
        """A dense cache's ``pos`` over a buffer ``width`` wide (-1 past ``_idx``)."""
        cols = mx.arange(width, dtype=mx.int32)[None]  # (1, T)
        pos = self._offsets()[:, None] - self._idx + cols  # (B, T)
        return mx.where(cols < self._idx, pos, -1)

    def _store_pos(self) -> None:
        """Leave the dense form: ``pos`` is stored from now on."""
        if self._pos is None:
            self._pos = self.pos

    def pad(self, padding: Sequence[int]) -> None:
        """Left-pad the next write: row b's first ``padding[b]`` inputs are filler
        (their entries get ``pos`` -1 and they take no position)."""
        padding = list(padding)
        if not any(padding):
            return
        self._store_pos()
        self._pad = mx.array(padding, dtype=mx.int32)
        self._set_offsets([o - p for o, p in zip(self._off, padding)])

    def _new_pos(self, n: int) -> mx.array:
        pos = self._offsets()[:, None] + mx.arange(n, dtype=mx.int32)[None]  # (B, n)
        if self._pad is not None:
            pos = mx.where(mx.arange(n)[None] < self._pad[:, None], -1, pos)
        return pos

    def _grow(self, keys, values) -> None:
        B, H, n, Dk = keys.shape
        if self.keys is not None and self._idx + n <= self.keys.shape[2]:
            return
        size = self.step * ((self._idx + n + self.step - 1) // self.step)
        new_k = mx.zeros((B, H, size, Dk), keys.dtype)
        new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
        if self._idx:
            new_k[..., : self._idx, :] = self.keys[..., : self._idx, :]
            new_v[..., : self._idx, :] = self.values[..., : self._idx, :]
        if self._pos is not None:
            new_p = mx.full((B, size), -1, dtype=mx.int32)
            new_p[:, : self._idx] = self._pos[:, : self._idx]
            self._pos = new_p
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append a pass's ``(B, heads, n, D)`` keys and values at the shared index;
        returns every entry (`make_mask` says which each query sees)."""
        n = keys.shape[2]
        self._grow(keys, values)
        end = self._idx + n
        self.keys[..., self._idx : end, :] = keys
        self.values[..., self._idx : end, :] = values
        if self._pos is not None:
            self._pos[:, self._idx : end] = self._new_pos(n)
        pads = [0] * self.batch_size if self._pad is None else self._pad.tolist()
        self.held = [h + n - p for h, p in zip(self.held, pads)]
        self._set_offsets([o + n for o in self._off])
        self._idx, self._pad = end, None
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ) -> mx.array:
        """``(B, 1, N, T + N)`` bool: query i of row b (at position ``offset + i``)
        sees the entries of its row at positions <= its own (within the window), and
        always its own slot (a padded query then attends to itself alone).

        While every row sees every entry (no hole, no padding, inside the window:
        one stream, say), the mask is the one a single stream's cache gives, so that
        attention takes the same path: None for one query, "causal" for several
        (an array when ``return_array``) as mlx-lm's ``KVCache``."""
        window = window_size or self.window
        dense = self._pad is None and all(h == self._idx for h in self.held)
        if dense and window is None:  # as mlx-lm's KVCache
            if N == 1:
                return None
            return create_causal_mask(N, self._idx) if return_array else "causal"
        if dense and N == 1 and self._idx + N <= window and not return_array:
            return None  # as `mlx_mtp.cache.WindowCache`
        q = self._offsets()[:, None] + mx.arange(N, dtype=mx.int32)[None]  # (B, N)
        k = mx.concatenate([self.pos[:, : self._idx], self._new_pos(N)], axis=1)
        k, qq = k[:, None, :], q[:, :, None]  # (B, 1, T + N), (B, N, 1)
        mask = (k >= 0) & (k <= qq)
        if window is not None:
            mask = mask & (k > qq - window)
        own = mx.arange(self._idx + N)[None] == (self._idx + mx.arange(N))[:, None]
        return (mask | own[None])[:, None]

    def rewind_rows(self, drop: Sequence[int]) -> None:
        """Drop the last ``drop[b]`` entries of row b (written by the last pass)."""
        common = min(drop) if drop else 0
        rest = [d - common for d in drop]
        if any(rest):
            self._store_pos()
        self._idx -= common
        self._set_offsets([o - d for o, d in zip(self._off, drop)])
        self.held = [h - d for h, d in zip(self.held, drop)]
        if any(rest):
            cols = mx.arange(self._idx)[None]
            hole = cols >= (self._idx - mx.array(rest, dtype=mx.int32))[:, None]
            self._pos[:, : self._idx] = mx.where(hole, -1, self._pos[:, : self._idx])
        self.compact_if_needed()

    def keep_below(self, limits: Sequence[int]) -> None:
        """Keep only row b's entries at positions < ``limits[b]`` (an MTP layer's
        cache falling back to its frontier); row b's next position is its limit."""
        limits = list(limits)
        cut = [max(o - x, 0) for o, x in zip(self._off, limits)]
        if self._pos is None and len(set(cut)) <= 1:  # dense: a rewind of each row
            common = min(cut[0] if cut else 0, self._idx)
            self._idx -= common
            self.held = [h - common for h in self.held]
        else:
            self._store_pos()
            lim = mx.array(limits, dtype=mx.int32)
            self._pos[:, : self._idx] = mx.where(
                self._pos[:, : self._idx] >= lim[:, None], -1, self._pos[:, : self._idx]
            )
            self.held = [min(h, x) for h, x in zip(self.held, limits)]
        self._set_offsets([min(o, x) for o, x in zip(self._off, limits)])
        self.compact_if_needed()

    def compact_if_needed(self) -> None:
        if self._idx - max(self.held, default=0) > COMPACT_SLACK:
            self.compact()

    def compact(self) -> None:
        """Pack every row's visible entries to the right of a buffer as wide as the
        fullest row (sliding-window rows first forget what no query can see)."""
        if self.keys is None:
            return
        cols = mx.arange(self._idx, dtype=mx.int32)[None]
        pos = self.pos[:, : self._idx]
        if self.window is not None:  # entries no later query sees (rollback: slack)
            pos = mx.where(
                pos < self._offsets()[:, None] - self.window - COMPACT_SLACK, -1, pos
            )
        valid = pos >= 0
        order = mx.argsort(mx.where(valid, cols + self._idx, cols), axis=1)
        counts = valid.sum(axis=1)
        width = int(counts.max().item())
        order = order[:, self._idx - width :]  # (B, width)
        self.keys = mx.take_along_axis(
            self.keys[..., : self._idx, :], order[:, None, :, None], axis=2
        )
        self.values = mx.take_along_axis(
            self.values[..., : self._idx, :], order[:, None, :, None], axis=2
        )
        self._pos = mx.take_along_axis(pos, order, axis=1)
        self.held = counts.tolist()
        self._idx = width

    def select(self, rows: Sequence[int]) -> None:
        """Keep ``rows``, in that order."""
        rows = list(rows)
        idx = mx.array(rows, dtype=mx.int32)
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]
        if self._pos is not None:
            self._pos = self._pos[idx]
        self._set_offsets([self._off[r] for r in rows])
        self.held = [self.held[r] for r in rows]
        self.compact_if_needed()

    def join(self, other: "RaggedKVCache") -> None:
        """Append ``other``'s rows (both right-aligned to the wider buffer)."""
        dense = self._pos is None and other._pos is None
        if other.keys is None and self.keys is None:
            if not dense:
                self._pos = mx.concatenate([self.pos, other.pos])
        elif (
            dense
            and self._idx == other._idx
            and self.keys is not None
            and other.keys is not None
        ):
            width = min(self.keys.shape[2], other.keys.shape[2])
            self.keys = mx.concatenate(
                [self.keys[..., :width, :], other.keys[..., :width, :]]
            )
            self.values = mx.concatenate(
                [self.values[..., :width, :], other.values[..., :width, :]]
            )
        else:
            width = max(self._idx, other._idx)
            parts = [self._aligned(width, other), other._aligned(width, self)]
            self.keys, self.values, self._pos = (
                mx.concatenate([p[i] for p in parts]) for i in range(3)
            )
            self._idx = width
        self._set_offsets(self._off + other._off)
        self.held = self.held + other.held

    def _aligned(self, width: int, like: "RaggedKVCache"):
        """keys, values, pos of the used entries, left-padded to ``width``."""
        ref = self if self.keys is not None else like
        B = self.batch_size
        H, Dk, Dv = ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3]
        keys = mx.zeros((B, H, width, Dk), ref.keys.dtype)
        values = mx.zeros((B, H, width, Dv), ref.values.dtype)
        pos = mx.full((B, width), -1, dtype=mx.int32)
        if self.keys is not None and self._idx:
            keys[..., width - self._idx :, :] = self.keys[..., : self._idx, :]
            values[..., width - self._idx :, :] = self.values[..., : self._idx, :]
            pos[:, width - self._idx :] = self.pos[:, : self._idx]
        return keys, values, pos

    def row_kv(self, b: int, below: Optional[int] = None):
        """Row b's visible entries (at positions < ``below``): ``(keys, values,
        positions)``, positions in order, keys and values ``(1, heads, n, D)``."""
        if self._pos is None:
            pos = list(range(self._off[b] - self._idx, self._off[b]))
        else:
            pos = self._pos[b, : self._idx].tolist()
        below = float("inf") if below is None else below
        cols = [i for i, p in enumerate(pos) if 0 <= p < below]
        if not cols or self.keys is None:
            return None, None, []
        idx = mx.array(cols, dtype=mx.int32)
        keys = mx.contiguous(self.keys[b : b + 1, :, idx])
        values = mx.contiguous(self.values[b : b + 1, :, idx])
        return keys, values, [pos[i] for i in cols]

    def is_trimmable(self) -> bool:
        return False

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self):
        return [a for a in (self.keys, self.values, self._pos) if a is not None]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        held = self._pos.nbytes if self._pos is not None else 0
        return self.keys.nbytes + self.values.nbytes + held


class RaggedList(ListCache):
    """One layer's several ragged caches (DeepSeek-V3.2's MLA latent and indexer
    keys), read like `mlx_mtp.cache.ListCache` (the first one's offset and mask),
    every row operation applied to each."""

    @property
    def held(self) -> List[int]:
        return self.caches[0].held

    def pad(self, padding: Sequence[int]) -> None:
        for c in self.caches:
            c.pad(padding)

    def rewind_rows(self, drop: Sequence[int]) -> None:
        for c in self.caches:
            c.rewind_rows(drop)

    def keep_below(self, limits: Sequence[int]) -> None:
        for c in self.caches:
            c.keep_below(limits)

    def select(self, rows: Sequence[int]) -> None:
        for c in self.caches:
            c.select(rows)

    def join(self, other: "RaggedList") -> None:
        for c, o in zip(self.caches, other.caches):
            c.join(o)


RAGGED = (RaggedKVCache, RaggedList, V4Rows)  # caches whose rows have positions


def batch_support(model) -> Optional[str]:
    """None when the model's streams can be decoded in one batch, else why not (one
    line): every trunk and MTP cache must be a full or sliding-window KV cache, a
    recurrent cache that records its states, or DeepSeek-V4's `V4Cache` (batched
    as one per row, `V4Rows`)."""
    from .cache import make_caches

    if model.group is not None:
        return "a trunk sharded over several ranks decodes one stream at a time"
    caches = make_caches(model)
    for c in caches.trunk + caches.mtp:
        parts = c.caches if type(c) is ListCache else [c]
        for part in parts:
            kind = type(part)
            if kind in (KVCache, WindowCache) and not getattr(part, "keep", 0):
                continue
            if kind is V4Cache:
                continue
            if kind is RecurrentCache and part is c:
                continue
            return f"mlx-mtp has no batched cache for this model's {kind.__name__}"
    return None


def pad_pass(caches: List[Any], padding: Optional[Sequence[int]]) -> None:
    """Left-pad the next pass over trunk ``caches`` (row b's first ``padding[b]``
    inputs are filler: hidden from attention, masked in recurrent layers as in
    mlx-lm's batched prefill); None: after the pass, no padding."""
    for c in caches:
        if isinstance(c, RAGGED):
            if padding is not None:
                c.pad(padding)
        elif padding is not None and any(padding):
            c.left_padding = mx.array(list(padding), dtype=mx.int32)
        else:
            c.left_padding = c.lengths = None


def to_batch(caches: Caches) -> Caches:
    """One stream's caches (filled by the single-stream prefill) as one-row batch
    caches."""
    return Caches(
        [_row_cache(c) for c in caches.trunk], [_row_cache(c) for c in caches.mtp]
    )


def _row_cache(c):
    if type(c) is ListCache:
        return RaggedList(*(_row_cache(x) for x in c.caches))
    if type(c) is KVCache:
        n = c.offset
        if c.keys is None:
            return RaggedKVCache(1)
        return RaggedKVCache.from_kv(c.keys[..., :n, :], c.values[..., :n, :], range(n))
    if isinstance(c, WindowCache):
        if c.keys is None:
            return RaggedKVCache(1, c.window)
        n = c._kept()
        keys = c.keys[..., c._base : c._base + n, :]
        values = c.values[..., c._base : c._base + n, :]
        return RaggedKVCache.from_kv(keys, values, range(c.start, c.offset), c.window)
    if isinstance(c, RecurrentCache):
        out = RecurrentCache(len(c.cache))
        out.cache = list(c.cache)
        return out
    if isinstance(c, V4Cache):
        return V4Rows([c.copy()])
    raise TypeError(f"no batched cache for {type(c).__name__}")


def join(a: Caches, b: Caches, rows: Sequence[int]) -> Caches:
    """``a``'s rows then ``b``'s (``rows``: how many each has), in ``a``'s objects."""
    for x, y in zip(a.trunk + a.mtp, b.trunk + b.mtp):
        if isinstance(x, RAGGED):
            x.join(y)
        else:
            x.cache = [_cat(p, q, rows) for p, q in zip(x.cache, y.cache)]
    return a


def _cat(p, q, rows: Sequence[int]):
    """Two recurrent slots' rows stacked; an empty slot (no token seen yet: a
    one-token prompt) is the zero state mlx-lm's mixers start from."""
    if p is None and q is None:
        return None
    like = p if p is not None else q
    p = p if p is not None else mx.zeros((rows[0], *like.shape[1:]), like.dtype)
    q = q if q is not None else mx.zeros((rows[1], *like.shape[1:]), like.dtype)
    return mx.concatenate([p, q])


def select(caches: Caches, rows: Sequence[int]) -> None:
    """Keep ``rows`` of every cache, in that order."""
    idx = mx.array(list(rows), dtype=mx.int32)
    for c in caches.trunk + caches.mtp:
        if isinstance(c, RAGGED):
            c.select(rows)
        else:
            c.cache = [None if s is None else s[idx] for s in c.cache]


def to_single(batch: Caches, b: int, like: Caches, limits=(None, None), bases=None):
    """Row b's caches as single-stream ones of the kinds in ``like`` (fresh caches of
    the model, as `make_caches` makes them): the trunk's positions below
    ``limits[0]``, the MTP layers' below ``limits[1]``; ``bases``: the marks of a
    launched round not committed, whose recorded states (before it) a recurrent
    cache gives instead of its own."""
    bases = bases or [None] * len(batch.trunk)
    trunk = [
        _single(c, b, x, limits[0], m)
        for c, x, m in zip(batch.trunk, like.trunk, bases)
    ]
    mtp = [_single(c, b, x, limits[1]) for c, x in zip(batch.mtp, like.mtp)]
    return Caches(trunk, mtp)


def _single(c, b: int, like, below=None, mark=None):
    if isinstance(c, RaggedList):
        parts = zip(c.caches, like.caches)
        return ListCache(*(_single(x, b, y, below) for x, y in parts))
    if isinstance(c, V4Rows):
        return c.row(b, below)
    if isinstance(c, RecurrentCache):
        out = RecurrentCache(len(c.cache))
        slots = mark.base if mark is not None else c.cache
        # the row gathered into a buffer of its own: a slice, or a copy of one
        # (which may take over the slice's buffer), would hold every row's states
        # (a kept session is counted at its arrays' sizes, `mlx_mtp.server.Sessions`)
        row = mx.array([b])
        out.cache = [None if s is None else mx.take(s, row, axis=0) for s in slots]
        return out
    keys, values, pos = c.row_kv(b, below)
    if isinstance(like, WindowCache):
        out = WindowCache(like.window, like.keep, like.slack)
        if pos:
            out._reserve(keys, values)
            out.keys[..., : len(pos), :] = keys
            out.values[..., : len(pos), :] = values
            out.start, out.offset = pos[0], pos[-1] + 1
        return out
    out = KVCache()
    if pos:
        if pos != list(range(len(pos))):
            raise ValueError("a row's KV entries are not positions 0..n-1")
        out.update_and_fetch(keys, values)
    return out


def select_mark(mark, idx: mx.array):
    """A `mlx_mtp.cache.begin_verify` mark of a batch cache, rows ``idx`` only."""
    if mark is None:
        return None
    if isinstance(mark, list):  # a `ListCache`'s: one per cache
        return [select_mark(m, idx) for m in mark]

    def pick(s):
        return None if s is None else s[idx]

    out = Capture([pick(s) for s in mark.base])
    if mark.steps is not None:
        out.record([[pick(s) for s in step] for step in mark.steps])
        out.kept = mark.kept
    return out


def rewind_rows(caches: List[Any], marks: List[Any], drop: Sequence[int]) -> None:
    """Drop the last ``drop[b]`` positions of row b from every trunk cache (``marks``
    from `mlx_mtp.cache.begin_verify` before the pass)."""
    for c, m in zip(caches, marks):
        if isinstance(c, RAGGED):
            c.rewind_rows(drop)
        else:
            _restore_rows(c, m, drop)


def _restore_rows(cache: RecurrentCache, mark, drop: Sequence[int]) -> None:
    """Put back row b's recorded state after its kept positions (``steps[t]``: after
    position t of the pass, ``base``: before it)."""
    if not any(drop):
        return
    if mark is None or mark.steps is None:
        raise ValueError("no state was recorded for a recurrent cache")
    S = len(mark.steps)
    kept = mx.array([S - d for d in drop], dtype=mx.int32)  # 0: the base state
    rows = mx.arange(len(drop))
    slots = []
    for i in range(len(cache.cache)):
        stack = mx.stack([mark.base[i]] + [s[i] for s in mark.steps])  # (S+1, B, ...)
        slots.append(stack[kept, rows])
    cache.cache = slots

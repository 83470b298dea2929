"""Key/value caches of attention layers, for one stream and for several.

- `WindowCache` (one stream): a sliding-window attention layer's cache that a
  multi-token pass and a rollback keep exact;
- `RaggedKVCache` (B streams decoded together): every row's keys and values in one
  buffer, each entry tagged with its position in its own row, so that each row rolls
  back on its own; a full-attention layer's or a sliding window's.

Both implement the cache protocol (`mlx_mtp.cache`): one stream's caches become
rows with ``merge``, rows are joined (``extend``), kept (``filter``) and taken back
out as one stream's caches (``extract``), and every row rolls back by its own count
(``rewind_rows``). mlx-lm's ``KVCache`` is adapted to the same protocol in
`mlx_mtp.cache`.
"""

import copy
from typing import Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache

from .errors import MTPError, RollbackError
from .one_row import TrimsTail

COMPACT_SLACK = 64  # holes of the widest row tolerated before `compact`
NO_COST = (0.0, (), 0.0)  # `cost` of a cache holding nothing


def copy_arrays(obj, skip: Iterable[str] = ()):
    """A copy of ``obj`` whose arrays are new array objects (their writes, in place
    on the array objects, then stay apart), and so are its parts' (objects and
    lists in its attributes, walked the same way); attributes named in ``skip``
    are None in the copy."""

    def fresh(v):
        if isinstance(v, mx.array):
            return mx.array(v)
        if isinstance(v, (list, tuple)):
            return type(v)(fresh(x) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return copy_arrays(v)
        return v

    out = copy.copy(obj)
    for name, value in vars(obj).items():
        setattr(out, name, None if name in skip else fresh(value))
    return out


def kv_cost(keys: Optional[mx.array], values, window: Optional[int] = None):
    """The `cost` of a KV cache holding ``keys``/``values`` ``(1, heads, n, D)``
    once batched (a `RaggedKVCache`: an int32 position per entry, and room for
    `COMPACT_SLACK` holes per row; a sliding window keeps ``window`` +
    `COMPACT_SLACK` entries per row)."""
    if keys is None:
        return NO_COST
    per_position = (keys.nbytes + values.nbytes) / keys.shape[-2] + 4
    if window is not None:
        return 0.0, ((per_position, window + COMPACT_SLACK),), 0.0
    return per_position, (), COMPACT_SLACK * per_position


class WindowCache(TrimsTail, _BaseCache):  # mlx-lm's base: its defaults, as its caches
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

    # -- the cache protocol (`mlx_mtp.cache`): one stream, one row (`TrimsTail`) --

    def batch_refusal(self) -> Optional[str]:
        """None: rows of this cache batch as `RaggedKVCache` rows (without sinks)."""
        return type(self).__name__ if self.keep else None

    @classmethod
    def merge(cls, caches: Sequence["WindowCache"]) -> "RaggedKVCache":
        """The streams' caches as the rows of one `RaggedKVCache` (sliding)."""
        rows = [c._as_row() for c in caches]
        for r in rows[1:]:
            rows[0].extend(r)
        return rows[0]

    def _as_row(self) -> "RaggedKVCache":
        if self.keys is None:
            return RaggedKVCache(1, self.window, self.slack)
        keys, values = self.committed_kv()
        positions = range(self.start, self.offset)
        return RaggedKVCache.from_kv(keys, values, positions, self.window, self.slack)

    @classmethod
    def from_kv(cls, keys, values, positions: List[int], window: int, slack: int):
        """A cache (no sinks) holding ``keys``/``values`` ``(1, heads, n, D)`` at
        ``positions`` (consecutive)."""
        out = cls(window, 0, slack)
        if positions:
            out._reserve(keys, values)
            out.keys[..., : len(positions), :] = keys
            out.values[..., : len(positions), :] = values
            out.start, out.offset = positions[0], positions[-1] + 1
        return out

    def cost(self):
        """Bytes per position and positions kept per row once batched."""
        return kv_cost(self.keys, self.values, self.window)

    def snapshot(self) -> "WindowCache":
        return copy_arrays(self)

    def committed_kv(self, last: Optional[int] = None):
        """``(keys, values)`` of the positions held, or of the ``last`` ones only:
        views of the buffers, nothing copied.

        Raises:
            RollbackError: fewer than ``last`` positions are held.
        """
        if self.keep:
            raise MTPError("cannot read a window cache with sink tokens")
        n = self._kept() if last is None else min(last, self.offset)
        if n > self._kept():
            raise RollbackError(
                f"a sliding-window cache holds {self._kept()} positions; "
                f"{n} were asked for"
            )
        end = self._base + self._kept()
        return self.keys[..., end - n : end, :], self.values[..., end - n : end, :]

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        """What a reader at ``positions`` (one row) sees: ``((keys, values), None)``,
        the last ``window`` positions held (all held when None), no mask needed."""
        return self.committed_kv(window), None


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

    def __init__(
        self, batch_size: int = 0, window: Optional[int] = None, slack: int = 64
    ):
        self.keys = self.values = None
        self.slack = slack  # a row's `WindowCache`'s (`extract`)
        self._pos = None  # None: dense (see the class docstring)
        self._off = [0] * batch_size  # host: each row's next position
        self._off_array = None  # `offset`'s array, made on first need
        self.held = [0] * batch_size
        self.window = window
        self._idx = 0
        self._pad = None  # (B,) left padding of the next write (see `pad`)

    @classmethod
    def from_kv(cls, keys, values, positions: Sequence[int], window=None, slack=64):
        """One row holding ``keys``/``values`` ``(1, heads, n, D)`` at ``positions``."""
        positions = list(positions)
        c = cls(1, window, slack)
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

    def prepare(self, left_padding: Optional[Sequence[int]] = None, **kwargs) -> None:
        """As mlx-lm's batch caches: ``left_padding`` for the next write (`pad`)."""
        if left_padding is not None:
            self.pad(left_padding)

    def finalize(self) -> None:
        """Nothing: the write that follows `prepare` takes its padding."""
        return None

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

    def can_roll_back(self) -> bool:
        return True

    def mark(self, record: bool = True) -> None:
        """Nothing to record: a rollback makes holes."""
        return None

    def rewind(self, mark, n: int) -> None:
        """Drop the last ``n`` entries of every row."""
        self.rewind_rows([n] * self.batch_size)

    def rewind_rows(self, drop: Sequence[int], mark=None) -> None:
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

    def filter(self, rows: Sequence[int]) -> None:
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

    def extend(self, other: "RaggedKVCache") -> None:
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

    def extract(self, b: int, below: Optional[int] = None, mark=None):
        """Row b's entries at positions below ``below`` as one stream's cache: a
        `WindowCache` for a sliding window, else mlx-lm's ``KVCache``."""
        keys, values, pos = self.row_kv(b, below)
        if self.window is not None:
            return WindowCache.from_kv(keys, values, pos, self.window, self.slack)
        out = KVCache()
        if pos:
            if pos != list(range(len(pos))):
                raise ValueError("a row's KV entries are not positions 0..n-1")
            out.update_and_fetch(keys, values)
        return out

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        """What readers at ``positions`` (one per row) see: ``((keys, values),
        mask)``, every buffered entry and ``(B, 1, 1, T)`` the ones each row sees
        (its positions below its own, the last ``window`` of them when given)."""
        n = mx.array(list(positions), dtype=mx.int32)[:, None]  # (B, 1)
        pos = self.pos[:, : self._idx]  # (B, T)
        seen = (pos >= 0) & (pos < n)
        if window is not None:
            seen = seen & (pos >= n - window)
        kv = (self.keys[..., : self._idx, :], self.values[..., : self._idx, :])
        return kv, seen[:, None, None, :]

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

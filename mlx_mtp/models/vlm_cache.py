"""mlx-vlm's caches with mlx-mtp's cache protocol (`mlx_mtp.cache`), exact under
rollback, for trunks taken from mlx-vlm (GLM-5.3-Flash, Qwen3.8-Flash-Next).

- `RecordingArraysCache`: mlx-vlm's ``ArraysCache`` (a recurrent layer's
  convolution windows, written by ``update_window``, and recurrent states, written
  by ``update_recurrent``, which mlx-vlm's ``gated_delta_update`` calls with the step
  that advances it) whose two update methods record, during a marked pass, each
  slot after every position: the intermediate recurrent states the step returns
  when asked for them (``state_steps``: the same loop, the same numbers) and views
  of a window's input (the window after position t is rows t + 1 .. t + width). A
  rewind puts back the record at the accepted length; nothing is recomputed.
  (mlx-vlm's own transactions need the pass length before the pass, which
  mlx-mtp's ``mark`` does not know.)
- `PoolCache`: mlx-vlm's ``PoolingCache`` (an indexer's pooled keys) that also
  keeps the raw key rows of its last ``slack + ratio`` positions. Pool w is a
  function of its own ``ratio`` rows only, so a trim keeps the pools wholly before
  the new end and puts the open pool's rows back in its buffer, with no mark: an
  MTP layer's cache, trimmed across several draft passes, rolls back the same way.
- `KVRows`: mlx-lm's KV cache, trimmed.

Each holds one stream; streams decoded together batch apart (`mlx_mtp.rows.Rows`:
every cache here merges apart, so a layer's whole cache does), each row's passes
its own, as in its lone decoding.
"""

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import MTPError, RollbackError
from ..one_row import OneRow, TrimsTail, one_row
from ..rows import merge_apart
from . import vlm

WHAT = "a model whose trunk is mlx-vlm's"
SLACK = 64  # positions a `PoolCache` can roll back


@dataclass
class Record:
    """A `RecordingArraysCache` before a pass (``base``: its slots) and, once the
    pass has run, what each slot holds after every position of it (``steps``: slot ->
    ``("states", intermediate, final)`` or ``("window", source, width)``),
    ``length`` its positions and ``kept`` how many of them the cache holds now."""

    base: List[Any]
    steps: Dict[int, Tuple] = field(default_factory=dict)
    length: int = 0
    kept: int = 0

    def add(self, slot: int, record: Tuple, length: int) -> None:
        self.steps[slot] = record
        self.length = self.kept = length

    def slot_at(self, slot: int, kept: int):
        """Slot ``slot`` after the pass's first ``kept`` positions."""
        record = self.steps.get(slot)
        if record is None or kept == 0:
            return self.base[slot]
        if record[0] == "window":
            _, source, width = record
            return mx.contiguous(source[:, kept : kept + width])
        _, intermediate, final = record
        return final if kept == self.length else intermediate[:, kept - 1]

    def filter(self, idx: mx.array) -> "Record":
        raise MTPError("a one-stream KDA cache's mark has no rows to pick")


def copy_arrays(cache, skip: Sequence[str] = ()):
    """A copy of ``cache`` whose arrays (and those in its lists and tuples) are new
    array objects, so that writes in place on either stay apart; attributes named
    in ``skip`` are None in the copy."""

    def fresh(value):
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, (list, tuple)):
            return type(value)(fresh(v) for v in value)
        return value

    out = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(out, name, None if name in skip else fresh(value))
    return out


class KVRows(TrimsTail, KVCache):
    """mlx-lm's ``KVCache`` (one stream; a rollback trims it) whose streams batch
    apart."""

    def batch_refusal(self) -> Optional[str]:
        return None

    merge = classmethod(merge_apart)

    def cost(self):
        """Per position held, its keys' and values' bytes (read off a cache that
        has seen a position)."""
        if self.keys is None:
            return 0.0, (), 0.0
        return (self.keys.nbytes + self.values.nbytes) / self.keys.shape[2], (), 0.0

    def snapshot(self) -> "KVRows":
        return copy_arrays(self)

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise MTPError("cannot read the keys and values of this layer's cache")


@lru_cache(maxsize=None)
def _vlm_caches():
    return vlm.need(
        "models.cache",
        WHAT,
        [
            ("ArraysCache.update_recurrent", "self, index, length, update"),
            (
                "ArraysCache.update_window",
                "self, index, source, width, *, lengths=None",
            ),
            ("PoolingCache.accumulate_windows", "self, kv, gate, offset"),
        ],
    )


@lru_cache(maxsize=None)
def recording_cache_class() -> type:
    """`RecordingArraysCache` (made on first use: mlx-vlm's ``ArraysCache`` is its
    base)."""

    class RecordingArraysCache(OneRow, _vlm_caches().ArraysCache):
        """A recurrent layer's slots (convolution windows, recurrent states), one
        stream, recording each position of a marked pass (module docstring).

        Attributes:
            offset: The positions seen.
            capture: The `Record` the next pass fills (None: no recording).
        """

        def __init__(self, size: int):
            super().__init__(size)
            self.offset = 0
            self.capture: Optional[Record] = None

        def update_recurrent(self, index, length, update):
            self.offset += int(length)
            if self.capture is None:
                return super().update_recurrent(index, length, update)
            result = update(self.cache[index], length - 1 if length > 1 else None)
            output, state = result[:2]
            self._record(index, ("states", result[2] if length > 1 else None, state))
            self.cache[index] = state
            return output, state

        def update_window(self, index, source, width, *, lengths=None):
            state = super().update_window(index, source, width, lengths=lengths)
            if self.capture is not None:
                self._record(index, ("window", source, int(width)))
            return state

        def _record(self, slot: int, record: Tuple) -> None:
            length = record[1].shape[1] - record[2] if record[0] == "window" else None
            if length is None:
                length = 1 if record[1] is None else record[1].shape[1] + 1
            self.capture.add(slot, record, length)
            if len(self.capture.steps) == len(self.cache):  # the pass is recorded
                self.capture = None

        # -- the cache protocol (`mlx_mtp.cache`): one stream ---------------------

        def can_roll_back(self) -> bool:
            return True

        def mark(self, record: bool = True) -> Record:
            """The slots before a pass; ``record``: the pass records every
            position's."""
            mark = Record(list(self.cache))
            self.capture = mark if record else None
            return mark

        def rewind(self, mark: Optional[Record], n: int) -> None:
            """Put back the slots ``n`` positions before the last recorded one."""
            if n <= 0:
                return
            if mark is None or not mark.steps or n > mark.kept:
                raise RollbackError(
                    f"cannot roll a recurrent cache back by {n} positions: "
                    "no state recorded"
                )
            mark.kept -= n
            self.cache = [mark.slot_at(i, mark.kept) for i in range(len(self.cache))]
            self.offset -= n

        def batch_refusal(self) -> Optional[str]:
            return None

        merge = classmethod(merge_apart)  # the rows' passes are their own (`Rows`)

        def cost(self):
            held = sum(a.nbytes for a in self.cache if a is not None)
            return 0.0, (), float(held)

        def snapshot(self):
            return copy_arrays(self, skip=("capture",))

        def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
            raise MTPError("cannot read the keys and values of a recurrent cache")

    return RecordingArraysCache


@lru_cache(maxsize=None)
def pool_cache_class() -> type:
    """`PoolCache` (mlx-vlm's ``PoolingCache`` is its base)."""

    class PoolCache(OneRow, _vlm_caches().PoolingCache):
        """An indexer's pooled keys, one stream, that trims (module docstring).

        Attributes:
            positions: The index keys accumulated.
            rows: The raw ``(keys, gates)`` rows ``(1, n, d)`` of positions
                ``rows_start ..`` (None before any).
        """

        def __init__(self, ratio: int, slack: int = SLACK):
            super().__init__(ratio)
            self.slack = slack
            self.positions = 0
            self.rows: Optional[Tuple[mx.array, mx.array]] = None
            self.rows_start = 0

        def accumulate_windows(self, kv: mx.array, gate: mx.array, offset):
            self._keep(kv, gate)
            return super().accumulate_windows(kv, gate, offset)

        def _keep(self, kv: mx.array, gate: mx.array) -> None:
            """Append a pass's rows, keeping those a rollback of ``slack`` needs
            (from the start of the pool such a rollback would leave open)."""
            self.positions += kv.shape[1]
            if self.rows is not None:
                kv = mx.concatenate([self.rows[0], kv], axis=1)
                gate = mx.concatenate([self.rows[1], gate], axis=1)
            first = max(0, self.positions - self.slack) // self.ratio * self.ratio
            first = max(first, self.rows_start)
            drop = first - self.rows_start
            self.rows = (kv[:, drop:], gate[:, drop:])
            self.rows_start = first

        def trim(self, n: int) -> int:
            """Forget the last ``n`` positions."""
            if n <= 0:
                return 0
            end = self.positions - n
            start = end - end % self.ratio  # the open pool's first position
            if end < 0 or start < self.rows_start:
                raise RollbackError(
                    f"an indexer's pooled-key cache was rolled back past the "
                    f"{self.slack} positions it keeps for rollback"
                )
            pools = end // self.ratio
            self.pooled = None if pools == 0 else self.pooled[:, :pools]
            kv, gate = (r[:, : end - self.rows_start] for r in self.rows)
            self.remainder = end - start
            self.buf_kv = _open_pool(kv[:, start - self.rows_start :], self.ratio)
            self.buf_gate = _open_pool(gate[:, start - self.rows_start :], self.ratio)
            self.rows, self.positions = (kv, gate), end
            return n

        # -- the cache protocol (`mlx_mtp.cache`): one stream ---------------------

        def can_roll_back(self) -> bool:
            return True

        def mark(self, record: bool = True) -> None:
            return None

        def rewind(self, mark, n: int) -> None:
            self.trim(n)

        def keep_below(self, limits: Sequence[int]) -> None:
            self.trim(self.positions - one_row(limits))

        def batch_refusal(self) -> Optional[str]:
            return None

        merge = classmethod(merge_apart)

        def cost(self):
            """Per position: a pooled key per ``ratio``; per row: the rows kept for
            rollback and the open pool's buffers (read off a cache that has seen a
            position)."""
            if self.rows is None:
                return 0.0, (), 0.0
            row = sum(r.nbytes / max(1, r.shape[1]) for r in self.rows)
            pooled = self.rows[0].nbytes / max(1, self.rows[0].shape[1])
            return pooled / self.ratio, (), row * (self.slack + 2 * self.ratio)

        def snapshot(self):
            return copy_arrays(self)

        def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
            raise MTPError("cannot read the keys and values of an indexer cache")

    return PoolCache


def _open_pool(rows: mx.array, ratio: int) -> mx.array:
    """An open pool's buffer ``(1, ratio, d)`` holding ``rows`` first."""
    buf = mx.zeros((rows.shape[0], ratio, rows.shape[-1]), dtype=rows.dtype)
    if rows.shape[1]:
        buf[:, : rows.shape[1]] = rows
    return buf

"""Streams batched apart: a batch cache whose rows are one-stream caches.

Some passes take one stream at a time: DeepSeek-V4's attention reads a cache at one
position and compression-block phase, mlx-lm's DeepSeek-V4.1 trunk and its DSpark
stages take one ``start_pos`` for every row. Their streams still decode in one
`mlx_mtp.batch.Batch` (one round, rows joining and leaving, one reply per round to
each client): a `Rows` cache holds each row's own one-stream cache, and what reads it
runs row by row (`each_row`) on the row's inputs past its left padding, so a row's
cache holds exactly what its lone decoding would and rolls back by its own count.

`Rows` implements the batch half of the cache protocol (`mlx_mtp.cache`) over its
rows' one-stream operations; a one-stream cache class batches apart by giving its
``merge`` as `merge_apart` (or through `apart`).
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import mlx.core as mx


class RowMarks(list):
    """A `Rows` cache's rollback marks: row b's one-stream mark at ``[b]``."""

    def filter(self, idx: mx.array) -> "RowMarks":
        return RowMarks(self[i] for i in idx.tolist())


class RowReads(list):
    """What readers at ``positions`` see in a `Rows` cache: row b's one-stream
    ``read_kv`` at ``[b]``; ``positions`` per row (host ints)."""

    def __init__(self, reads, positions: Sequence[int]):
        super().__init__(reads)
        self.positions = list(positions)


class Rows:
    """B streams' caches of one layer, each a one-stream cache (``rows``) at its own
    position.

    Attributes:
        padding: Per row, the filler inputs at the start of the next pass (None:
            none); the pass consumes it (`take_padding`).
        whole_pass: Whether the model runs whole passes row by row over these
            caches (`each_row`); False where a layer reads the rows apart within
            a batched pass (DeepSeek-V4's attention, `V4Rows`).
    """

    whole_pass = True

    def __init__(self, rows: List[Any]):
        self.rows = list(rows)
        self.padding: Optional[List[int]] = None

    def pad(self, padding: Sequence[int]) -> None:
        """Left-pad the next pass: row b's first ``padding[b]`` inputs are filler,
        seen by no row's cache."""
        self.padding = list(padding) if any(padding) else None

    def take_padding(self) -> List[int]:
        """The next pass's padding per row (0s when none); it applies to that pass
        only."""
        padding, self.padding = self.padding, None
        return padding or [0] * len(self.rows)

    def prepare(self, left_padding: Optional[Sequence[int]] = None, **kwargs) -> None:
        """As mlx-lm's batch caches: ``left_padding`` for the next pass (`pad`)."""
        if left_padding is not None:
            self.pad(left_padding)

    def finalize(self) -> None:
        """The padded pass is over: no padding left (the pass took it already,
        `take_padding`)."""
        self.padding = None

    # -- rollback: each row by its own count ---------------------------------------

    def can_roll_back(self) -> bool:
        return all(c.can_roll_back() for c in self.rows)

    def mark(self, record: bool = True) -> RowMarks:
        return RowMarks(c.mark(record) for c in self.rows)

    def rewind(self, mark: Optional[RowMarks], n: int) -> None:
        self.rewind_rows([n] * len(self.rows), mark)

    def rewind_rows(self, drop: Sequence[int], mark: Optional[RowMarks] = None) -> None:
        """Forget the last ``drop[b]`` positions of row b (``mark``: `mark`'s)."""
        marks = mark or [None] * len(self.rows)
        for c, m, n in zip(self.rows, marks, drop):
            if n:
                c.rewind(m, n)

    def keep_below(self, limits: Sequence[int]) -> None:
        """Keep row b's positions below ``limits[b]``."""
        for c, limit in zip(self.rows, limits):
            c.keep_below([limit])

    # -- rows ----------------------------------------------------------------------

    def batch_refusal(self) -> Optional[str]:
        return None

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "Rows":
        """The streams' caches as the rows (the objects themselves: the batch
        holds their only copy)."""
        return cls(list(caches))

    def filter(self, rows: Sequence[int]) -> None:
        """Keep ``rows``, in that order."""
        self.rows = [self.rows[r] for r in rows]

    def extend(self, other: "Rows") -> None:
        """Append ``other``'s rows."""
        self.rows += other.rows

    def extract(self, b: int, below: Optional[int] = None, mark=None):
        """Row b's cache on its own (a copy), its positions below ``below``
        (``mark``: the marks of the pass that wrote those above, when one
        was made)."""
        out = self.rows[b].snapshot()
        if below is not None and out.offset > below:
            out.rewind(None if mark is None else mark[b], out.offset - below)
        return out

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        """Each row's own read at its position (`RowReads`)."""
        reads = [c.read_kv([n], window) for c, n in zip(self.rows, positions)]
        return RowReads(reads, positions)

    # -- memory ----------------------------------------------------------------------

    def cost(self):
        return self.rows[0].cost()

    def snapshot(self) -> "Rows":
        return type(self)([c.snapshot() for c in self.rows])

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return all(c.empty() for c in self.rows)

    @property
    def state(self) -> List[mx.array]:
        return [a for c in self.rows for a in c.state if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.rows)


def merge_apart(cls, caches: Sequence[Any]) -> Rows:
    """A one-stream cache class's ``merge`` that batches its streams apart."""
    return Rows.merge(caches)


def batches_apart(cache) -> bool:
    """Whether ``cache``'s class batches its streams apart (its ``merge`` is
    `merge_apart`)."""
    merge = getattr(type(cache), "merge", None)
    return getattr(merge, "__func__", None) is merge_apart


def apart(cls: type) -> type:
    """``cls`` (a one-stream cache class) whose streams batch apart (`Rows`)."""
    return type(f"Apart{cls.__name__}", (cls,), {"merge": classmethod(merge_apart)})


def by_rows(caches: Optional[Sequence[Any]]) -> bool:
    """Whether a pass over ``caches`` runs row by row (they are `Rows` whose
    ``whole_pass`` says so)."""
    return bool(caches) and getattr(caches[0], "whole_pass", False)


def row_caches(caches: Sequence[Rows], b: int) -> List[Any]:
    """Row b's one-stream cache of each of ``caches``."""
    return [c.rows[b] for c in caches]


def each_row(
    fn: Callable[..., Optional[mx.array]],
    x: Union[mx.array, Tuple[mx.array, ...]],
    caches: Sequence[Rows],
) -> Optional[mx.array]:
    """``fn(x_b, caches_b)`` for every row b: ``x_b`` ``(1, L - pad_b, ...)`` its
    inputs past its left padding (the pass's, taken from ``caches``), ``caches_b``
    its one-stream caches; ``x`` a tuple of inputs ``(B, L, ...)``: ``fn(*x_b,
    caches_b)``, each sliced so. Returns the rows' outputs ``(1, L_b, ...)``
    left-padded with zeros to ``(B, L, ...)`` (a row that is padding only runs
    nothing), or None when ``fn`` returns None."""
    padding = [c.take_padding() for c in caches][0]  # the same in every cache
    xs = x if isinstance(x, tuple) else (x,)
    L = xs[0].shape[1]
    outs: List[Optional[mx.array]] = []
    for b, pad in enumerate(padding):
        row = [a[b : b + 1, pad:] for a in xs]
        outs.append(fn(*row, row_caches(caches, b)) if pad < L else None)
    like = next((o for o in outs if o is not None), None)
    if like is None:
        return None
    rows = []
    for out, pad in zip(outs, padding):
        if out is None:
            out = mx.zeros((1, 0, *like.shape[2:]), dtype=like.dtype)
        if pad:
            filler = mx.zeros((1, pad, *like.shape[2:]), dtype=like.dtype)
            out = mx.concatenate([filler, out], axis=1)
        rows.append(out)
    return mx.concatenate(rows)

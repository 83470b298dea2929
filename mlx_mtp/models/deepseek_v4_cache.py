"""DeepSeek-V4's attention caches, exact under rollback.

A V4 attention layer keeps three things per position it has seen:

- the sliding window: its last ``sliding_window`` K = V rows (stored once);
- on compressed layers (``compress_ratios[i] = r > 0``), the compressor's entries: one
  per closed block of r positions, softmax-pooled from the block's projections (with
  r = 4, from the block's second half and the previous block's first half, the
  "overlap"), normed and RoPE'd at the block's first position;
- on r = 4 layers, the indexer's keys: a second compressor of the same kind.

A pass that closes a block adds its entry; a rollback must remove it again and give the
block back its open rows, exactly as if the rejected positions had never been seen.
`CompressorState` therefore keeps the projections of the positions a later block or a
rollback of up to ``slack`` positions may still need (the open block, the previous
block for the overlap, and ``slack`` more), and trims entries to ``positions // r``:
entry w depends only on positions below (w + 1) r, so the entries that stay are
unchanged and nothing is recomputed. Rolling back further than ``slack`` is a
`RollbackError`, never a wrong answer. The window keeps ``slack`` more rows for the
same reason, as `mlx_mtp.cache.WindowCache` does (whose ``update_and_fetch`` and
``make_mask`` V4's attention also reads in its MTP layer).

Streams decoded together (`mlx_mtp.batch`) sit at different positions, hence at
different block phases: `V4Rows` holds one `V4Cache` per row, V4's attention runs
each row's cache part on that row's tokens alone, and each row rolls back by its own
count (a trim of its own cache). Left padding (``pad``) never enters a row's cache.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import MTPError, RollbackError
from ..one_row import TrimsTail
from ..rows import Rows


def _append(old: Optional[mx.array], new: mx.array) -> mx.array:
    return new if old is None else mx.concatenate([old, new], axis=1)


class CompressorState:
    """One compressor's entries and the projections they are pooled from.

    Args:
        ratio: Positions per block (r).
        overlap: Entry w also pools block w - 1's rows (DeepSeek-V4's r = 4).
        slack: Positions a rollback may remove.

    Attributes:
        entries: ``(B, end // r, d)``, one per closed block (None before the first).
        kv, gate: ``(B, end - start, width)`` projections of positions ``start ..
            end - 1`` (the gate with the block-position bias added).
        start: The first position kept (a block start).
        end: Positions seen.
    """

    def __init__(self, ratio: int, overlap: bool, slack: int):
        self.ratio, self.overlap, self.slack = ratio, overlap, slack
        self.entries: Optional[mx.array] = None
        self.kv: Optional[mx.array] = None
        self.gate: Optional[mx.array] = None
        self.start = 0
        self.end = 0

    @property
    def count(self) -> int:
        """Entries made so far."""
        return 0 if self.entries is None else self.entries.shape[1]

    def push(self, kv: mx.array, gate: mx.array) -> Optional[Tuple[mx.array, ...]]:
        """Append a pass's projections ``(B, L, width)``.

        Returns:
            None when no block closed; else ``(kv, gate, first)``: the rows of the
            newly closed blocks ``first ..``, preceded by block ``first - 1``'s rows
            when there is an overlap and ``first > 0``.
        """
        self.kv, self.gate = _append(self.kv, kv), _append(self.gate, gate)
        self.end += kv.shape[1]
        first, closed = self.count, self.end // self.ratio
        if closed == first:
            return None
        lo = (first - 1 if self.overlap and first else first) * self.ratio
        rows = slice(lo - self.start, closed * self.ratio - self.start)
        return self.kv[:, rows], self.gate[:, rows], first

    def add(self, entries: mx.array) -> None:
        """Store the entries of the blocks `push` returned, and drop the projections
        no later block or rollback within ``slack`` needs."""
        self.entries = _append(self.entries, entries)
        blocks = max(0, (self.end - self.slack) // self.ratio - int(self.overlap))
        keep = blocks * self.ratio
        if keep > self.start:
            self.kv = self.kv[:, keep - self.start :]
            self.gate = self.gate[:, keep - self.start :]
            self.start = keep

    def trim_to(self, end: int) -> None:
        """Forget positions ``end ..`` (and the entries of the blocks they closed)."""
        if end >= self.end:
            return
        needed = max(0, end // self.ratio - int(self.overlap)) * self.ratio
        if self.start > needed:
            raise RollbackError(
                "a compressed-attention cache was rolled back past the "
                f"{self.slack} positions it keeps for rollback"
            )
        self.end = end
        if self.entries is not None:
            self.entries = self.entries[:, : end // self.ratio]
        self.kv = self.kv[:, : end - self.start]
        self.gate = self.gate[:, : end - self.start]

    def copy(self) -> "CompressorState":
        """A state that goes on independently (the arrays are shared: no method
        writes into one)."""
        out = CompressorState(self.ratio, self.overlap, self.slack)
        out.entries, out.kv, out.gate = self.entries, self.kv, self.gate
        out.start, out.end = self.start, self.end
        return out

    @property
    def arrays(self) -> List[mx.array]:
        return [a for a in (self.entries, self.kv, self.gate) if a is not None]


class V4Cache(TrimsTail):
    """One V4 attention layer's cache: the sliding window's K = V rows, and on
    compressed layers the compressor's state (``compressed``) and, for r = 4, the
    indexer's (``index``). Its ``trim`` is exact within ``slack`` positions, so it
    rolls back by trimming. It implements the cache protocol (`mlx_mtp.cache`) for
    one stream; its batched form is `V4Rows` (``merge``).
    """

    def __init__(self, window: int, ratio: int = 0, slack: int = 64):
        self.window, self.ratio, self.slack = window, ratio, slack
        self.keys: Optional[mx.array] = None  # (B, 1, offset - start, d)
        self.start = 0  # the position of the oldest row kept
        self.offset = 0
        self.compressed = CompressorState(ratio, ratio == 4, slack) if ratio else None
        self.index = CompressorState(4, True, slack) if ratio == 4 else None

    def make_mask(self, N: int, window_size=None, return_array: bool = True):
        """``(N, kept + N)``: query ``offset + i`` sees positions ``offset + i -
        window + 1 .. offset + i`` of `update_and_fetch`'s rows (call it first)."""
        k = mx.arange(self.start, self.offset + N)[None]
        q = mx.arange(self.offset, self.offset + N)[:, None]
        return (k <= q) & (k > q - (window_size or self.window))

    def update_and_fetch(self, keys: mx.array, values: Optional[mx.array] = None):
        """Append a pass's rows ``(B, 1, L, d)``; returns ``(rows kept, None)``."""
        rows = keys if self.keys is None else mx.concatenate([self.keys, keys], 2)
        self.offset += keys.shape[2]
        keep = max(self.start, self.offset - (self.window - 1 + self.slack))
        self.keys = rows[:, :, keep - self.start :]
        self.start = keep
        return rows, None

    def _compressors(self) -> List[CompressorState]:
        return [s for s in (self.compressed, self.index) if s is not None]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        if self.start > max(0, self.offset - self.window + 1):
            raise RollbackError(
                "a sliding-window cache was rolled back past the "
                f"{self.slack} positions it keeps for rollback"
            )
        if self.keys is not None:
            self.keys = self.keys[:, :, : self.offset - self.start]
        for s in self._compressors():
            s.trim_to(self.offset)
        return n

    def copy(self) -> "V4Cache":
        """A cache that goes on independently of this one (arrays shared: no method
        writes into one, each makes new ones)."""
        out = V4Cache(self.window, self.ratio, self.slack)
        out.keys, out.start, out.offset = self.keys, self.start, self.offset
        out.compressed = self.compressed and self.compressed.copy()
        out.index = self.index and self.index.copy()
        return out

    def cost(self) -> Tuple[float, tuple, float]:
        """Its batched form's bytes (`mlx_mtp.cache`'s protocol), read off a cache
        that has seen a position: the window (its bytes per position, and the
        ``window + slack`` positions it keeps at most), the compressed entries'
        bytes per position seen, and per row the most bytes of the projections its
        compressors keep (``slack + 2 r`` positions)."""
        window = self.keys.nbytes / self.keys.shape[2]
        per_position = kept = 0.0
        for s in self._compressors():
            row = s.kv.nbytes / s.kv.shape[1]  # one position's kv (gate: the same)
            per_position += (row / 2 if s.overlap else row) / s.ratio
            kept += 2 * row * (s.slack + 2 * s.ratio)
        return per_position, ((window, self.window + self.slack),), kept

    # -- the rest of the cache protocol (`mlx_mtp.cache`): one stream (`TrimsTail`) --

    def batch_refusal(self) -> Optional[str]:
        return None

    @classmethod
    def merge(cls, caches: Sequence["V4Cache"]) -> "V4Rows":
        """The streams' caches as the rows of one `V4Rows` (copies)."""
        return V4Rows([c.copy() for c in caches])

    def snapshot(self) -> "V4Cache":
        """A copy whose arrays are new array objects."""
        out = self.copy()
        out.keys = _fresh(self.keys)
        for s in out._compressors():
            s.entries, s.kv, s.gate = map(_fresh, (s.entries, s.kv, s.gate))
        return out

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise MTPError("cannot read the keys and values of a V4Cache")

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> List[mx.array]:
        kept = [self.keys] if self.keys is not None else []
        return kept + [a for s in self._compressors() for a in s.arrays]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def _fresh(a: Optional[mx.array]) -> Optional[mx.array]:
    return None if a is None else mx.array(a)


class V4Rows(Rows):
    """One V4 attention layer's caches of B streams decoded together: a `V4Cache`
    per row (``rows``), each at its own position and block phase (`mlx_mtp.rows`).

    V4's attention, given this, runs the part that reads a cache (RoPE, window,
    compressor, indexer, attention) row by row on that row's tokens past its
    left padding, so a row's cache holds exactly what the row's lone decoding
    would: padded positions never enter it, and a row rolls back by its own count
    (a trim of its cache)."""

    whole_pass = False  # the rest of the pass is batched

    def extract(self, b: int, below: Optional[int] = None, mark=None) -> V4Cache:
        """Row b's cache on its own (a copy), its positions below ``below``."""
        out = self.rows[b].copy()
        if below is not None and out.offset > below:
            out.trim(out.offset - below)
        return out

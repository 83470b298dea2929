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
"""

from typing import List, Optional, Tuple

import mlx.core as mx

from ..errors import RollbackError


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

    @property
    def arrays(self) -> List[mx.array]:
        return [a for a in (self.entries, self.kv, self.gate) if a is not None]


class V4Cache:
    """One V4 attention layer's cache: the sliding window's K = V rows, and on
    compressed layers the compressor's state (``compressed``) and, for r = 4, the
    indexer's (``index``). Its ``trim`` is exact within ``slack`` positions, so the
    decode loop rolls it back by trimming (``rolls_back_by_trim``)."""

    rolls_back_by_trim = True

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

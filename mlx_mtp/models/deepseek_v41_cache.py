"""DeepSeek-V4.1's trunk caches, exact under rollback.

mlx-lm's ``deepseek_v41`` keeps, per decoder layer, a ``LayerCache``: the sliding
window's last ``sliding_window`` K = V rows; on a layer that compresses its own KV (a
``kv_source_layer_ids`` layer of ratio r), one entry per closed group of r positions
(r = 1: one per position) and, on an index source, its index key; and the
projections of the open group's rows (``pending_kv``, ``pending_gate``). It cannot be
rolled back: evicted window rows and pooled groups are gone.

`V41Cache` is that cache, read and written by mlx-lm's own attention and compressor
exactly as before, with what a rollback of up to ``slack`` positions needs:

- the window keeps ``slack`` more rows (mlx-lm's window indices address the rows the
  cache returns, however many, so every query still sees its own window);
- entries are trimmed to ``positions // r``: entry w depends on positions w r ..
  (w + 1) r - 1 only, so the entries that stay are unchanged;
- the open group's projections after a rollback: those of positions before the pass
  are the mark's (`mark`: the state before the pass), those of the pass's positions
  are the projections the pass computed, recorded by `RecordingCompressor` (the same
  ops on the same rows, lazily: evaluated only when a rollback reads them).

Rolling back further than the last marked pass, or than ``slack`` positions, is a
`RollbackError`, never a wrong answer. Streams decoded together batch apart: a
`mlx_mtp.rows.Rows` of one `V41Cache` per row, each row's passes its own (mlx-lm's
trunk takes one position for every row).
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as lm

from ..errors import MTPError, RollbackError
from ..one_row import OneRow
from ..rows import merge_apart


@dataclass
class Mark:
    """A `V41Cache` before a pass (``offset``, the open group's ``pending_kv`` and
    ``pending_gate``) and the pass's compressor projections ``kv``, ``gate``
    ``(B, L, d)`` (None until the pass records them, or when not recording)."""

    offset: int
    pending_kv: Optional[mx.array]
    pending_gate: Optional[mx.array]
    kv: Optional[mx.array] = None
    gate: Optional[mx.array] = None


def _cat(a: Optional[mx.array], b: Optional[mx.array]) -> Optional[mx.array]:
    if a is None or b is None:
        return b if a is None else a
    return mx.concatenate([a, b], axis=1)


class V41Cache(OneRow, lm.LayerCache):
    """One V4.1 decoder layer's cache that rolls back (module docstring).

    Args:
        window_size: The sliding window.
        ratio: The layer's compress ratio when it compresses its own KV (a kv
            source), else 0.
        slack: Positions a rollback may remove.

    Attributes:
        start: The position of the oldest window row kept.
        capture: The mark a `RecordingCompressor` records the next pass into.
    """

    def __init__(self, window_size: int, ratio: int = 0, slack: int = 64):
        super().__init__(window_size)
        self.ratio, self.slack = ratio, slack
        self.start = 0
        self.capture: Optional[Mark] = None

    def update_window(self, kv: mx.array) -> mx.array:
        """Append a pass's rows ``(B, L, d)``; return every row kept before it and
        the pass's (mlx-lm's window indices address them), keeping ``slack`` more
        than the window needs."""
        window = _cat(self.window, kv)
        self.offset += kv.shape[1]
        keep = max(self.start, self.offset - (self.window_size - 1 + self.slack))
        self.window = window[:, keep - self.start :]
        self.start = keep
        return window

    def record(self, kv: mx.array, gate: mx.array) -> None:
        """The pass's compressor projections ``(B, L, d)``, for a rollback into its
        open group (a no-op unless `mark` asked for it)."""
        if self.capture is not None:
            self.capture.kv, self.capture.gate = kv, gate
            self.capture = None

    # -- the cache protocol (`mlx_mtp.cache`): one stream ---------------------------

    def can_roll_back(self) -> bool:
        return True

    def mark(self, record: bool = True) -> Mark:
        """The state before a pass; ``record``: the pass records its projections."""
        mark = Mark(self.offset, self.pending_kv, self.pending_gate)
        self.capture = mark if record and self.ratio > 1 else None
        return mark

    def rewind(self, mark: Optional[Mark], n: int) -> None:
        """Forget the last ``n`` positions (within the pass ``mark`` was made
        for, when the open group needs that pass's projections)."""
        if n <= 0:
            return
        end = self.offset - n
        if self.start > max(0, end - self.window_size + 1):
            raise RollbackError(
                "a DeepSeek-V4.1 window cache was rolled back past the "
                f"{self.slack} positions it keeps for rollback"
            )
        if self.ratio > 1:
            self.pending_kv, self.pending_gate = self._open_rows(end, mark)
        if self.window is not None:
            self.window = self.window[:, : end - self.start]
        if self.ratio:
            kept = end // self.ratio
            for name in ("compress_kv", "index_k"):
                entries = getattr(self, name)
                if entries is not None:
                    setattr(self, name, entries[:, :kept])
        self.offset = end

    def _open_rows(self, end: int, mark: Optional[Mark]):
        """The projections of positions ``end - end % r .. end - 1``: a slice of
        the open group's, or of the mark's and (past it) its pass's."""
        r, first = self.ratio, end - end % self.ratio
        if first >= self.offset - self.offset % r:  # the same open group
            rows = slice(0, end - first)
            return self.pending_kv[:, rows], self.pending_gate[:, rows]
        unrecorded = mark is not None and end > mark.offset and mark.kv is None
        if mark is None or end < mark.offset or unrecorded:
            raise RollbackError(
                "a DeepSeek-V4.1 compressor cannot be rolled back before the pass "
                "it recorded"
            )
        kv, gate = mark.pending_kv, mark.pending_gate
        if end > mark.offset:
            kv, gate = _cat(kv, mark.kv), _cat(gate, mark.gate)
        if kv is None:  # nothing seen before the pass
            return None, None
        base = mark.offset - mark.offset % r  # the position of the rows' first
        rows = slice(first - base, end - base)
        return kv[:, rows], gate[:, rows]

    def batch_refusal(self) -> Optional[str]:
        return None

    merge = classmethod(merge_apart)  # the rows' passes are their own (`Rows`)

    def cost(self):
        """Its batched form's bytes (`mlx_mtp.cache`'s protocol), read off a cache
        that has seen a position: the window (a row's bytes, and the ``window +
        slack`` rows it keeps at most); on a layer that compresses its own KV, an
        entry per ``ratio`` positions and as much again for its index keys (each
        at most a window row: an upper bound); per row, the open group's float32
        projections (kv and gate) over the ``ratio + slack`` positions a rollback
        may need."""
        d = self.window.shape[-1]
        row = self.window.nbytes / self.window.shape[1]
        per_position = 2 * row / self.ratio if self.ratio else 0.0
        kept = 2 * 4 * d * (self.ratio + self.slack) if self.ratio > 1 else 0.0
        return per_position, ((row, self.window_size + self.slack),), kept

    def snapshot(self) -> "V41Cache":
        """A copy whose arrays are new objects, no rollback record kept."""
        out = V41Cache(self.window_size, self.ratio, self.slack)
        out.offset, out.start = self.offset, self.start
        for name in ("window", "compress_kv", "index_k", "pending_kv", "pending_gate"):
            value = getattr(self, name)
            setattr(out, name, None if value is None else mx.array(value))
        return out

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise MTPError("cannot read the keys and values of a DeepSeek-V4.1 cache")


class RecordingCompressor(lm.Compressor):
    """mlx-lm's compressor, which also hands a `V41Cache` the pass's projections
    (the same ``kv_proj`` and ``gate_proj`` of the same float32 rows, left lazy)
    before pooling as mlx-lm does."""

    def __call__(self, x: mx.array, start_pos: int, cache):
        if self.ratio > 1 and isinstance(cache, V41Cache):
            h = x.astype(mx.float32)
            cache.record(self.kv_proj(h), self.gate_proj(h))
        return super().__call__(x, start_pos, cache)


def install(trunk) -> None:
    """Switch the trunk's pooling compressors (ratio > 1) to `RecordingCompressor`
    (only the class changes)."""
    for layer in trunk.layers:
        compressor = getattr(layer.self_attn, "compressor", None)
        if type(compressor) is lm.Compressor and compressor.ratio > 1:
            compressor.__class__ = RecordingCompressor


def make_cache(args, layer_ids) -> list:
    """One `V41Cache` per trunk layer of ``layer_ids`` (those this process runs), a
    kv source with its compress ratio."""
    ratios = list(args.compress_ratios) + [0] * args.num_hidden_layers
    sources = set(args.kv_source_layer_ids)
    return [
        V41Cache(args.sliding_window, ratios[i] if i in sources else 0)
        for i in layer_ids
    ]

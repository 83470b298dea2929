"""The cache protocol's row operations (`mlx_mtp.cache`) for a one-stream cache, and
rollback by trimming the tail: shared by mlx-mtp's `WindowCache`, the adapter of
mlx-lm's KV caches and DeepSeek-V4's cache."""

from typing import Optional, Sequence


def one_row(counts: Sequence[int]) -> int:
    """A one-stream cache's count of ``counts`` (it has one row)."""
    if len(counts) != 1:
        raise ValueError(f"a single-stream cache has one row, not {len(counts)}")
    return counts[0]


class OneRow:
    """Row operations of a cache holding one stream, from its ``rewind(mark, n)``
    and ``offset`` (the positions it holds)."""

    def rewind_rows(self, drop: Sequence[int], mark=None) -> None:
        self.rewind(mark, one_row(drop))

    def keep_below(self, limits: Sequence[int]) -> None:
        """Keep the positions below ``limits[0]``."""
        self.rewind(None, self.offset - one_row(limits))

    def prepare(self, left_padding: Optional[Sequence[int]] = None, **kwargs) -> None:
        if left_padding is not None and any(left_padding):
            raise ValueError("a single-stream cache takes no left padding")

    def finalize(self) -> None:
        return None


class TrimsTail(OneRow):
    """A one-stream cache that rolls back by ``trim(n)``: nothing to record before a
    verify pass."""

    def can_roll_back(self) -> bool:
        return True

    def mark(self, record: bool = True) -> None:
        return None

    def rewind(self, mark, n: int) -> None:
        """Drop the last ``n`` positions."""
        if n > 0:
            self.trim(n)

"""Several ranks (Macs) decoding one sharded model, on MLX's own distributed layer.

Under ``mlx.launch`` every rank runs the same program on its shard of the trunk
(mlx-lm's tensor parallelism, ``Model.shard``, or its pipeline, ``model.pipeline``); the
MTP heads are whole on every rank. A rank's collectives must match every other rank's
call for call, so every decision that picks what runs next is made on rank 0 and shared
(`Sync`): the draft tokens (the verify pass of a sharded trunk must see the same tokens
everywhere), the accepted count and the next token, the sampling seed, and the round
costs the adaptive draft length works from. No floating-point difference between ranks
(another chip, another kernel) can then make their caches diverge.

Sharing is one ``all_sum`` with zeros off rank 0, built into the round's lazy graph, so
it adds no host synchronisation: two small collectives per round, against two per
layer in the verify pass of a tensor-parallel trunk.
"""

import os
from functools import lru_cache
from typing import List, Optional

import mlx.core as mx

from .errors import MTPError


@lru_cache(maxsize=1)
def world() -> mx.distributed.Group:
    """The group of ranks this process was launched in (size 1 when not launched)."""
    return mx.distributed.init()


# Set by mlx.launch (ring, JACCL) or an MPI launcher: without them there is no group
# to join, and MLX's backends are not even started (an MPI library, if one is found,
# would install its own signal handlers).
LAUNCH_VARIABLES = (
    "MLX_RANK",
    "MLX_WORLD_SIZE",
    "MLX_JACCL_COORDINATOR",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
)


def launched() -> Optional[mx.distributed.Group]:
    """The launch's group when this process was launched with several ranks, else
    None."""
    if not any(name in os.environ for name in LAUNCH_VARIABLES):
        return None
    group = world()
    return group if group.size() > 1 else None


class Sync:
    """Rank 0's values, shared with every rank of ``group`` (no-ops without one)."""

    def __init__(self, group: Optional[mx.distributed.Group]):
        self.group = group

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group is not None else 0

    def share(self, x: mx.array) -> mx.array:
        """Rank 0's ``x`` on every rank (lazy)."""
        if self.group is None:
            return x
        # The same graph on every rank (x zeroed, not replaced): ranks must schedule
        # their collectives in the same order, and MLX orders them by the graph.
        mine = mx.where(mx.array(self.rank == 0), x, mx.zeros_like(x))
        return mx.distributed.all_sum(mine, group=self.group)

    def share_values(self, values) -> list:
        """Rank 0's list of numbers on every rank (evaluated)."""
        if self.group is None:
            return list(values)
        shared = self.share(mx.array(values, dtype=mx.float32))
        return shared.tolist()

    def share_int(self, value: int) -> int:
        """Rank 0's integer (0 <= value < 2**31) on every rank."""
        if self.group is None:
            return value
        return int(self.share(mx.array(value, dtype=mx.int32)).item())

    def share_tokens(self, ids: List[int]) -> List[int]:
        """Rank 0's token ids on every rank (the others' ``ids`` are ignored)."""
        if self.group is None:
            return list(ids)
        n = self.share_int(len(ids))
        mine = ids if self.rank == 0 else [0] * n
        return self.share(mx.array(mine, dtype=mx.int32)).tolist() if n else []

    def share_text(self, text: Optional[str]) -> Optional[str]:
        """Rank 0's text (None: the end of its input) on every rank."""
        if self.group is None:
            return text
        data = list(text.encode("utf-8", "surrogateescape")) if text is not None else []
        n = self.share_int(0 if text is None else len(data) + 1) - 1  # -1: the end
        if n < 0:
            return None
        mine = data if self.rank == 0 else [0] * n
        shared = self.share(mx.array(mine, dtype=mx.int32)).tolist() if n else []
        return bytes(shared).decode("utf-8", "surrogateescape")

    def all_ok(self, error: Optional[BaseException]) -> None:
        """Raise on every rank if any rank failed (``error``: this rank's failure, or
        None). Every rank must call it at the same point, failed or not."""
        if self.group is None:
            if error is not None:
                raise error
            return
        failed = mx.distributed.all_sum(
            mx.array(int(error is not None), dtype=mx.int32), group=self.group
        ).item()
        if error is not None:
            raise error
        if failed:
            raise MTPError(
                f"{failed} other rank(s) of {self.group.size()} failed (their message "
                "says why); this rank stops too"
            )


def shard(trunk, group: mx.distributed.Group) -> str:
    """Shard an mlx-lm trunk over ``group`` exactly as mlx-lm's ``sharded_load`` does:
    tensor parallel when its class has ``shard``, else pipeline parallel when it has
    ``model.pipeline``. Returns which ("tensor" or "pipeline")."""
    if hasattr(trunk, "shard"):
        trunk.shard(group)
        return "tensor"
    if hasattr(getattr(trunk, "model", None), "pipeline"):
        trunk.model.pipeline(group)
        return "pipeline"
    raise MTPError(
        f"mlx-lm cannot shard {trunk.model_type} models (its class has neither shard "
        "nor pipeline); run it on one machine"
    )

"""DeepSeek-V4.1: mlx-lm's own ``deepseek_v41`` trunk, and its DSpark drafter.

V4.1's ``mtp.{0,1,2}.*`` tensors are not MTP heads but the three stages of a DSpark
block drafter (`mlx_mtp.models.deepseek_v41_dspark`): ``mtp.0.main_proj`` fuses the
inputs of the target layers ``dspark_target_layer_ids``, one pass over the context
and a block of ``dspark_block_size`` noise tokens proposes the whole block, and
``mtp.2`` ends with a Markov head and a confidence head. ``num_nextn_predict_layers``
counts those stages. The family's ``sanitize`` translates them to the drafter's
names and ``make_drafter`` builds it; loading attaches it as a block drafter (its
context rows in the drafter caches, its taps recorded by the trunk's layers). A
folder without them (an mlx-lm conversion) decodes plainly with no message.

The trunk is mlx-lm's, with caches that roll back (`mlx_mtp.models.deepseek_v41_cache`:
its ``LayerCache`` keeping what a rollback needs), so it drafts exactly, with its
drafter or prompt lookup.
"""

import re
from typing import Optional

from mlx_lm.models import deepseek_v41 as lm

from ..errors import MissingHeadsError
from . import deepseek_v41_cache as v41_cache
from . import deepseek_v41_dspark as v41_dspark
from .base import split_mtp
from .family import Layout, define

LAYOUT = Layout(prefix=lambda config, j: f"mtp.{j}.", fusion={})


class Model(lm.Model):
    """mlx-lm's V4.1 model whose caches roll back: `V41Cache` per layer, and its
    pooling compressors recording what a rollback needs."""

    def __init__(self, args: lm.ModelArgs):
        super().__init__(args)
        v41_cache.install(self)

    def make_cache(self) -> list:
        return v41_cache.make_cache(self.args, [l.layer_idx for l in self.layers])


def trunk_classes(config: dict):
    return Model, lm.ModelArgs


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """Stage j of the DSpark drafter for a ``mtp.{j}.*`` tensor, else None."""
    m = re.match(r"mtp\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    """Set the drafter's tensors aside from the trunk's (mlx-lm's sanitize would drop
    them)."""
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """The stages' tensors under the drafter's names (`v41_dspark.sanitize`)."""
    return v41_dspark.sanitize(weights, config, trunk)


def make_layer(trunk, j: int, config: dict):
    """Refuse: V4.1's ``mtp.*`` are a block drafter (`make_drafter`), not MTP layers.

    Raises:
        MissingHeadsError: always.
    """
    raise MissingHeadsError(
        "DeepSeek-V4.1's mtp.{0,1,2} are a DSpark block drafter, not MTP layers"
    )


def make_drafter(trunk, config: dict) -> v41_dspark.DSparkV41:
    """The DSpark drafter the stages load into."""
    return v41_dspark.DSparkV41(trunk.args, config)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=(),  # num_nextn_predict_layers counts DSpark stages, not heads
    EMBEDDING_KEY="embed.weight",
    FINAL_NORM_KEY="norm.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    make_drafter=make_drafter,
    trunk_classes=trunk_classes,
)

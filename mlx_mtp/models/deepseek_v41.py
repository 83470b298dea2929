"""DeepSeek-V4.1: mlx-lm's own ``deepseek_v41`` trunk; its drafter is refused.

V4.1's ``mtp.{0,1,2}.*`` tensors are not MTP heads but the three stages of a DSpark
block drafter: ``mtp.0.main_proj`` fuses the hidden states of the target layers
``dspark_target_layer_ids``, one non-causal pass over the context and a block of
``dspark_block_size`` noise tokens proposes the whole block, and ``mtp.2`` ends with a
Markov head (a low-rank logit bias from the previous draft token) and a confidence
head. ``num_nextn_predict_layers`` counts those stages. mlx-mtp does not draft with it:
`sanitize` (the first thing that builds heads) refuses it in one line, which loading
turns into plain decoding under ``--allow-missing-heads``. Nothing here counts the
stages as MTP layers, so a folder without them (an mlx-lm conversion) decodes plainly
with no message about missing heads.

The trunk's `LayerCache` cannot roll back, so drafting of any kind (prompt lookup
included) is refused by the decode loop's rollback check; plain decoding is exact.
"""

import re
from typing import Optional

from ..errors import MissingHeadsError
from .base import split_mtp
from .family import Layout, define

DSPARK = (
    "DeepSeek-V4.1's mtp.{0,1,2} are a DSpark block drafter (5-token parallel "
    "proposals with a Markov head), not MTP heads: mlx-mtp does not draft with it"
)

LAYOUT = Layout(prefix=lambda config, j: f"mtp.{j}.", fusion={})


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """Stage j of the DSpark drafter for a ``mtp.{j}.*`` tensor, else None."""
    m = re.match(r"mtp\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    """Set the drafter's tensors aside from the trunk's (mlx-lm's sanitize would drop
    them anyway)."""
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Refuse the drafter.

    Raises:
        MissingHeadsError: always, naming what the ``mtp.*`` tensors are.
    """
    raise MissingHeadsError(DSPARK)


def make_layer(trunk, j: int, config: dict):
    """Refuse: V4.1 has no MTP layer mlx-mtp could build.

    Raises:
        MissingHeadsError: always.
    """
    raise MissingHeadsError(DSPARK)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=(),  # num_nextn_predict_layers counts DSpark stages, not heads
    EMBEDDING_KEY="embed.weight",
    FINAL_NORM_KEY="norm.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
)

"""Step-3.7-Flash (``step3p7``): Step-3.5's text model and its MTP layers inside a
vision-language checkpoint.

The top-level config nests the text model's under ``text_config`` (its
``model_type`` ``step3p5``; ``num_nextn_predict_layers`` 3, the per-layer lists padded
with the MTP layers' entries, as Step-3.5's are: transformers' ``Step3p7TextConfig``
trims them, mlx-lm's ``step3p5`` reads them by index). The text tensors keep
Step-3.5's names (``model.layers.*``, ``model.embed_tokens``, ``model.norm``,
``lm_head``; some conversions spell them under ``model.language_model.``, as
mlx-vlm's ``step3p7`` reads both), with MTP layer j at ``model.layers.{L + j}`` in
Step-3.5's layout (`mlx_mtp.models.step3p5`). The vision tower and its projector
(every other tensor) are left out of the text trunk, which is mlx-lm's ``step3p5``
built from ``text_config``: mlx-lm has no ``step3p7``, and mlx-vlm's text model is the
same one.
"""

import re
from typing import Optional

from mlx_lm.models import step3p5 as lm

from . import step3p5
from .family import Layout

TEXT = re.compile(r"(model\.(layers|embed_tokens|norm)\.|lm_head\.)")
NESTED = "model.language_model."


def text(config: dict) -> dict:
    """The text model's config (``text_config``; a flat one as it is)."""
    return config.get("text_config") or config


def text_name(key: str) -> str:
    """``key`` in Step-3.5's spelling (``model.language_model.`` -> ``model.``)."""
    return "model." + key[len(NESTED) :] if key.startswith(NESTED) else key


LAYOUT = Layout(
    prefix=lambda config, j: step3p5.LAYOUT.prefix(text(config), j),
    fusion=step3p5.LAYOUT.fusion,
    copies=step3p5.LAYOUT.copies,
)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    return step3p5.mtp_layer_of(text_name(key), text(config))


def split_weights(weights: dict, config: dict):
    """Step-3.5's split over the text tensors in Step-3.5's spelling; the vision
    tensors stay with the trunk's (whose sanitize leaves them out)."""
    named = {text_name(k): v for k, v in weights.items()}
    return step3p5.split_weights(named, text(config))


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    named = {text_name(k): v for k, v in weights.items()}
    return step3p5.sanitize(named, text(config), trunk, raw)


class ModelArgs(lm.ModelArgs):
    """mlx-lm's Step-3.5 args, read from the ``text_config`` of a Step-3.7 config."""

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        return super().from_dict(text(params))


class Model(lm.Model):
    """mlx-lm's Step-3.5 model over a Step-3.7 checkpoint's text tensors."""

    def sanitize(self, weights: dict) -> dict:
        named = {text_name(k): v for k, v in weights.items()}
        return super().sanitize({k: v for k, v in named.items() if TEXT.match(k)})


def trunk_classes(config: dict):
    return Model, ModelArgs


FAMILY = step3p5.FAMILY.derive(
    LAYOUT=LAYOUT,
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    trunk_classes=trunk_classes,
)

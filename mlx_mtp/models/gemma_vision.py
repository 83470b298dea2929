"""Images for Gemma 4 targets (``gemma4``: ``Gemma4ForConditionalGeneration``, a
vision tower at ``model.vision_tower.*`` and its projector ``model.embed_vision.*``
beside the text model). Their assistants draft after an image as after text: they
read the target's caches, which hold the image's keys and values like any others.

The text model stays mlx-lm's (``gemma4_text``: its caches roll back and batch as
for text). What an image changes is done as transformers' ``Gemma4Model`` does it
(the reference), with mlx-vlm's parts (``mlx_vlm.models.gemma4``, the extra
``mlx-mtp[vlm]``) used unchanged for the tower, its projector and the image
processor:

- each image is ``<boi>``, one ``<|image|>`` per pooled feature, ``<eoi>``; the
  features (the tower's, projected by ``embed_vision``) replace the embeddings of
  the placeholders, and are not scaled by sqrt(H) as token embeddings are;
- the per-layer inputs (E2B / E4B) read the pad token (``pad_token_id``, 0) at the
  placeholders;
- with ``use_bidirectional_attention: "vision"`` (the 12B, 26B-A4B and 31B
  releases), each image's placeholders attend to one another both ways in the
  sliding-window layers (window and all), and causally elsewhere: transformers'
  ``create_masks_for_vision_model`` (full-attention layers stay causal; mlx-vlm
  0.7.10 opens them too, a difference `tests/test_gemma_vision.py` pins). An image
  is then never split between prefill passes (``images_whole``:
  `mlx_mtp.speculative.chunk_stop`).

Positions stay the token indices (Gemma 4 has no multimodal RoPE). A checkpoint
without the tower, or without mlx-vlm installed, loads as a text model; an image
sent to it is refused in one line.
"""

import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import create_attention_mask

from ..errors import MTPError, one_line
from ..media import Media, MediaCache, Placeholder, build, kept_features, split
from ..private import check_private
from . import vlm

WHAT = "Gemma 4 image input"
TOWER = ("model.vision_tower.", "vision_tower.")
PROJECTOR = ("model.embed_vision.", "embed_vision.")
CLIPPING = ("input_max", "input_min", "output_max", "output_min")

check_private(
    gemma4_text,
    [
        (
            "Gemma4TextModel.__call__",
            "self, inputs=None, cache=None, input_embeddings=None, "
            "per_layer_inputs=None",
        ),
        ("Gemma4TextModel._make_masks", "self, h, cache"),
        (
            "Gemma4TextModel._get_per_layer_inputs",
            "self, input_ids, input_embeddings=None",
        ),
    ],
    "mlx_lm.models.gemma4_text",
    f"{WHAT} needs mlx-lm 0.32",
)


@lru_cache(maxsize=None)
def _vision():
    return vlm.need(
        "models.gemma4.vision",
        WHAT,
        [
            ("VisionModel", "config"),
            ("VisionModel.__call__", "self, pixel_values, pixel_position_ids=None"),
        ],
    )


@lru_cache(maxsize=None)
def _model():
    return vlm.need(
        "models.gemma4.gemma4",
        WHAT,
        [("MultimodalEmbedder", "embedding_dim, text_hidden_size, eps=1e-06")],
    )


@lru_cache(maxsize=None)
def _config():
    return vlm.need(
        "models.gemma4.config", WHAT, [("VisionConfig.from_dict", "params")]
    )


@lru_cache(maxsize=None)
def _processing():
    return vlm.need(
        "models.gemma4.processing_gemma4",
        WHAT,
        [
            (
                "Gemma4ImageProcessor",
                "do_resize=True, size=None, resample=<Resampling.BICUBIC: 3>, "
                "do_rescale=True, rescale_factor=0.00392156862745098, "
                "do_normalize=False, image_mean=None, image_std=None, "
                "do_convert_rgb=True, patch_size=16, max_soft_tokens=280, "
                "pooling_kernel_size=3, **kwargs",
            ),
        ],
    )


# -- the text model -------------------------------------------------------------------


@dataclass
class Reading:
    """How a checkpoint reads images: its `Placeholder`, the token its per-layer
    inputs read at the placeholders, and whether each image attends within itself
    both ways (then one pass holds it whole); ``same``, during a pass with images,
    ``(B, L, L)`` bool: which inputs are features of one image."""

    placeholder: Placeholder
    pad_token: int
    whole: bool
    same: Optional[mx.array] = None


class VisionText(gemma4_text.Gemma4TextModel):
    """mlx-lm's Gemma 4 text model, whose sliding-window masks open each image both
    ways in a pass that holds images (``reading.same``, set by `hidden`)."""

    def _make_masks(self, h, cache):
        masks = super()._make_masks(h, cache)
        same = self.reading.same
        if same is None:
            return masks
        layers = list(zip(self.layers, cache))
        sliding = [c for layer, c in layers if layer.layer_type == "sliding_attention"]
        if not sliding:  # full-attention layers stay causal
            return masks
        base = create_attention_mask(
            h, sliding[0], window_size=self.window_size, return_array=True
        )
        opened = _open_images(base, same, self.window_size)
        return [
            opened if layer.layer_type == "sliding_attention" else m
            for (layer, _), m in zip(layers, masks)
        ]


def _open_images(base: mx.array, same: mx.array, window: int) -> mx.array:
    """A sliding layer's mask ``base`` ``(L, K)`` or ``(B, 1, L, K)`` (the pass's L
    inputs are its last L keys) with each input also seeing the inputs of its
    image within the window: AND(window, OR(causal, same image))."""
    L = same.shape[-1]
    i = mx.arange(L)
    near = i[None, :] > i[:, None] - window  # (L, L): key j within query i's window
    opened = (same & near)[:, None]  # (B, 1, L, L)
    K = base.shape[-1]
    if K > L:
        opened = mx.concatenate(
            [mx.zeros((*opened.shape[:3], K - L), dtype=mx.bool_), opened], axis=-1
        )
    return base | opened


@contextmanager
def _scaled(text):
    """A pass whose input embeddings are already as the first layer sees them (the
    token embeddings scaled by sqrt(H), the image features not): mlx-lm's text model
    scales its inputs by ``embed_scale``, 1 for the pass."""
    scale, text.embed_scale = text.embed_scale, 1.0
    try:
        yield
    finally:
        text.embed_scale = scale


# -- the trunk ------------------------------------------------------------------------


def with_vision(model_class, config: dict):
    """mlx-lm's Gemma 4 ``Model`` class for the checkpoint of ``config``, able to
    keep its vision tower and projector (mlx-vlm's) and to read images
    (`mlx_mtp.media`): its caches then end with a `MediaCache`. Without them it is
    mlx-lm's model."""

    class Model(model_class):
        def __init__(self, args):
            super().__init__(args)
            self.vision_tower = self.embed_vision = self.reading = None
            self.vision_refusal = None  # why a tower the checkpoint has is not kept

        def sanitize(self, weights: dict) -> dict:
            parts = {
                k: v for k, v in weights.items() if k.startswith(TOWER + PROJECTOR)
            }
            weights = model_class.sanitize(self, weights)
            if parts and "vision_config" in config:
                weights.update(self._keep_tower(parts))
            return weights

        def _keep_tower(self, parts: dict) -> dict:
            """The tower's and projector's tensors as ``vision_tower.*`` and
            ``embed_vision.*``, both built (none, and why in ``vision_refusal``,
            without mlx-vlm)."""
            text = self.language_model.args
            try:
                vision = _config().VisionConfig.from_dict(config["vision_config"])
                tower = _vision().VisionModel(vision)
                projector = _model().MultimodalEmbedder(
                    vision.hidden_size, text.hidden_size, eps=vision.rms_norm_eps
                )
            except MTPError as e:
                self.vision_refusal = str(e)
                return {}
            except (ValueError, TypeError, KeyError) as e:  # its config's fields
                self.vision_refusal = f"cannot build the vision tower: {one_line(e)}"
                return {}
            renamed = _renamed(parts, vision.use_clipped_linears)
            self.vision_refusal = _mismatch(renamed, tower, projector) or _no_tokens(
                config
            )
            if self.vision_refusal:
                return {}
            text_config = config.get("text_config", {})
            self.reading = Reading(
                Placeholder(
                    config["image_token_id"],
                    vision.pooling_kernel_size,
                    (config["boi_token_id"],),
                    (config["eoi_token_id"],),
                ),
                pad_token=text_config.get("pad_token_id", 0),
                whole=text_config.get("use_bidirectional_attention") == "vision",
            )
            self.vision_tower, self.embed_vision = tower, projector
            text_model = self.language_model.model
            text_model.__class__ = VisionText  # its masks (`VisionText`)
            text_model.reading = self.reading
            return renamed

        @property
        def images_whole(self) -> bool:
            """Whether each image must be in one pass (`Reading`)."""
            return self.vision_tower is not None and self.reading.whole

        def make_cache(self):
            caches = model_class.make_cache(self)
            return caches + [MediaCache()] if self.vision_tower is not None else caches

        @property
        def quant_predicate(self):
            """The vision tower and projector stay in float under ``-q`` (as
            mlx-vlm converts them); the text model's predicate decides the rest."""
            inner = model_class.quant_predicate.fget(self)

            def predicate(path, module):
                if path.startswith(("vision_tower", "embed_vision")):
                    return False
                return True if inner is None else inner(path, module)

            return predicate

    Model.__name__ = Model.__qualname__ = model_class.__name__
    return Model


def _renamed(parts: dict, clipped: bool) -> dict:
    """Hugging Face's or mlx-vlm's names of the tower and projector as the module's
    (mlx-vlm's Gemma 4 sanitize: clipping bounds kept only where used)."""
    out = {}
    for key, value in parts.items():
        if "rotary_emb" in key or (not clipped and key.endswith(CLIPPING)):
            continue
        for prefixes, name in ((TOWER, "vision_tower."), (PROJECTOR, "embed_vision.")):
            prefix = next((p for p in prefixes if key.startswith(p)), None)
            if prefix is not None:
                out[name + key[len(prefix) :]] = value
    return out


def _mismatch(renamed: dict, tower, projector) -> Optional[str]:
    """Why the checkpoint's tower tensors do not load into the tower its
    ``vision_config`` builds (None: they do, name for name and shape for shape)."""
    wanted = {f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    wanted.update(
        {f"embed_vision.{k}": v for k, v in tree_flatten(projector.parameters())}
    )
    missing = sorted(set(wanted) - set(renamed))
    extra = sorted(set(renamed) - set(wanted))
    if missing or extra:
        name = (missing or extra)[0]
        what = "lacks" if missing else "has an unknown tensor"
        return (
            f"this Gemma 4 checkpoint's vision tower does not match its vision_config "
            f"(it {what} {name}): it loads as a text model"
        )
    for key, value in renamed.items():
        if tuple(value.shape) != tuple(wanted[key].shape):
            return (
                f"this Gemma 4 checkpoint's vision tower does not match its "
                f"vision_config ({key} is {tuple(value.shape)}, not "
                f"{tuple(wanted[key].shape)}): it loads as a text model"
            )
    return None


def _no_tokens(config: dict) -> Optional[str]:
    missing = [
        k for k in ("image_token_id", "boi_token_id", "eoi_token_id") if k not in config
    ]
    if missing:
        return f"this Gemma 4 config has no {missing[0]}: it reads no images"
    return None


def reads_images(trunk) -> bool:
    return getattr(trunk, "vision_tower", None) is not None


def hidden(trunk, inputs: mx.array, cache) -> mx.array:
    """``(B, L, H)`` post-norm hidden states of ``inputs`` ``(B, L)``: with the
    image features of the rows that have images, their per-layer inputs and (for
    ``images_whole``) their images open both ways in the sliding layers."""
    layer_caches, media = split(cache)
    text = trunk.language_model.model
    if media is None or not media.any:
        return text(inputs, layer_caches)
    offsets = layer_caches[0].offset
    e = text.embed_tokens(inputs) * text.embed_scale
    e = media.embeddings(e, offsets)  # (B, L, H)
    per_layer = None
    if text.hidden_size_per_layer_input:
        images = media.images(offsets, inputs.shape[1])  # (B, L)
        ids = mx.where(images, trunk.reading.pad_token, inputs)
        per_layer = text._get_per_layer_inputs(ids)
    if trunk.images_whole and inputs.shape[1] > 1:
        trunk.reading.same = media.same_image(offsets, inputs.shape[1])
    try:
        with _scaled(text):
            return text(
                inputs, layer_caches, input_embeddings=e, per_layer_inputs=per_layer
            )
    finally:
        trunk.reading.same = None


# -- images ---------------------------------------------------------------------------


class ImageProcessor:
    """mlx-vlm's Gemma 4 image processor (aspect-preserving resize within the
    model's soft-token budget), called as the families' processors are:
    ``processor(images=[...])`` gives ``pixel_values`` (one ``(C, H, W)`` array
    per image) and ``image_grid_thw`` (per image ``(1, H / patch, W / patch)``)."""

    def __init__(self, **kwargs):
        self.processor = _processing().Gemma4ImageProcessor(**kwargs)

    def __call__(self, images) -> dict:
        data, _ = self.processor(images)
        pixels = data["pixel_values"]
        pixels = list(pixels) if isinstance(pixels, np.ndarray) else pixels
        p = self.processor.patch_size
        grid = [[1, x.shape[-2] // p, x.shape[-1] // p] for x in pixels]
        return {"pixel_values": pixels, "image_grid_thw": grid}


IMAGE_KEYS = (
    "patch_size",
    "max_soft_tokens",
    "pooling_kernel_size",
    "do_resize",
    "do_rescale",
    "do_normalize",
    "rescale_factor",
    "image_mean",
    "image_std",
    "size",
)


def image_processor(model_path) -> ImageProcessor:
    """The image processor of a model folder, configured from its
    ``processor_config.json`` (its ``image_processor``) or flat
    ``preprocessor_config.json``, as mlx-vlm's ``Gemma4Processor`` reads them."""
    settings = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(model_path) / name
        if path.exists():
            settings = json.loads(path.read_text())
            break
    if isinstance(settings.get("image_processor"), dict):
        kwargs = dict(settings["image_processor"])
        kwargs.pop("image_processor_type", None)
    else:
        kwargs = {k: settings[k] for k in IMAGE_KEYS if k in settings}
    return ImageProcessor(**kwargs)


def media(trunk, ids: List[int], pixel_values, grid_thw) -> Tuple[List[int], Media]:
    """A prompt ``ids`` with one ``<|image|>`` per image (as the chat template writes
    it), as the model reads it (`image_placeholder`), and its
    `mlx_mtp.media.Media`: the tower's features, projected, of all the images (run
    together when they have one size, as mlx-vlm runs them).

    Raises:
        MTPError: the checkpoint's tower is not loaded, or the placeholders are
            not one per image.
    """
    if not reads_images(trunk):
        raise MTPError(
            trunk.vision_refusal
            or "this Gemma 4 checkpoint has no vision tower (a text-only conversion)"
        )

    def features(grid, digests):
        def compute():
            if len({tuple(x.shape) for x in pixel_values}) == 1:
                pixels = mx.array(np.stack(pixel_values))  # (N, C, H, W)
            else:
                pixels = [mx.array(x) for x in pixel_values]
            return trunk.embed_vision(trunk.vision_tower(pixels))[0]  # (N, H)

        return kept_features(trunk, digests, compute)

    return build(ids, image_placeholder(trunk), pixel_values, grid_thw, features)


def image_placeholder(trunk) -> Placeholder:
    return trunk.reading.placeholder

"""Images for Qwen3.5 / 3.6 / 3.8 (``qwen3_5``, ``qwen3_5_moe``): the checkpoints are
multimodal (``Qwen3_5ForConditionalGeneration``), a Qwen3-VL vision tower at
``model.visual.*`` beside the text model, with interleaved multimodal RoPE (M-RoPE)
in the full-attention layers (``mrope_section``: which rotary frequencies take the
temporal, height and width ids).

The text model stays mlx-lm's (its caches roll back and batch as for text). What an
image changes is done here, as mlx-vlm's Qwen3.5 model does it (``mlx_vlm.models.
qwen3_5``, the extra ``mlx-mtp[vlm]``), with its parts used unchanged:

- the vision tower and image processor are mlx-vlm's (Qwen3-VL's);
- the image features replace the embeddings of the image placeholders, and the
  M-RoPE positions of the prompt are mlx-vlm's ``get_rope_index``
  (`mlx_mtp.media`);
- each full-attention layer's rope (mlx-lm's, which rotates by the token index) is
  wrapped by `MRoPE`: in a pass over rows with images it rotates those rows by their
  M-RoPE positions, with mlx-vlm's rotary embedding; rows without images, and every
  pass without images, keep mlx-lm's rope, so text decodes exactly as before.

The MTP layer after an image reads as vLLM's ``Qwen3_5MTP`` does (it is
``SupportsMultiModal``: ``embed_input_ids`` merges the image features, and its
positions are the target's ``(3, N)`` M-RoPE positions): the merged embeddings and
the target's positions, as for GLM-OCR (`mlx_mtp.models.glm_ocr`).

A checkpoint without the tower (an mlx-lm conversion) loads as a text model; one with
it but without mlx-vlm installed loads as a text model too, and an image sent to it
is refused in one line naming the extra.
"""

from functools import lru_cache
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError, one_line
from ..media import Media, MediaCache, Placeholder, build, kept_features, split
from . import vlm
from .mtp import MTPLayer

WHAT = "Qwen3.5 image input"
# Where the tower's tensors sit: Hugging Face's names, then mlx-vlm's and ours.
TOWER = ("model.visual.", "vision_tower.")


@lru_cache(maxsize=None)
def _language():
    return vlm.need(
        "models.qwen3_5.language",
        WHAT,
        [
            (
                "Qwen3_5RotaryEmbedding",
                "dim, max_position_embeddings=2048, base=10000, "
                "mrope_section=[11, 11, 0]",
            ),
            ("apply_multimodal_rotary_pos_emb", "q, k, cos, sin, unqueeze_dim=1"),
            (
                "LanguageModel.get_rope_index",
                "self, input_ids, image_grid_thw=None, video_grid_thw=None, "
                "attention_mask=None",
            ),
        ],
    )


@lru_cache(maxsize=None)
def _vision():
    return vlm.need(
        "models.qwen3_5.vision",
        WHAT,
        [
            ("VisionModel", "config"),
            ("VisionModel.__call__", "self, hidden_states, grid_thw, **kwargs"),
            ("VisionModel.sanitize", "self, weights"),
        ],
    )


@lru_cache(maxsize=None)
def _config():
    return vlm.need(
        "models.qwen3_5.config", WHAT, [("ModelConfig.from_dict", "params")]
    )


@lru_cache(maxsize=None)
def _processing():
    return vlm.need(
        "models.qwen3_vl.processing_qwen3_vl",
        WHAT,
        [
            (
                "_qwen_vl_image_kwargs",
                "pretrained_model_name_or_path, default_patch_size=16",
            ),
            ("Qwen3VLImageProcessor.__call__", "self, images, **kwargs"),
        ],
    )


# -- M-RoPE ---------------------------------------------------------------------------


class Positions:
    """The M-RoPE positions of the pass under way, shared by a model's `MRoPE`s:
    None outside a pass over rows with images."""

    def __init__(self):
        self.ids: Optional[mx.array] = None  # (3, B, L) int32
        self.rows: Optional[mx.array] = None  # (B,) bool: the rows with images
        self.every_row = False

    def set(self, media: MediaCache, offsets, n: int) -> None:
        """The positions of a pass of ``n`` inputs per row from index ``offsets``
        (an int or ``(B,)``), for the rows of ``media`` (None: no row has images)."""
        if not media.any:
            self.clear()
            return
        self.ids = media.position_ids(offsets, n)
        with_images = [m is not None for m in media.rows]
        self.rows, self.every_row = mx.array(with_images), all(with_images)

    def clear(self) -> None:
        self.ids = self.rows = None
        self.every_row = False


class MRoPE(nn.Module):
    """An attention layer's rope, ``rope(x, offset)`` on ``x`` ``(B, heads, L, D)``:
    mlx-lm's, except for the rows with images of a pass with images (`Positions`),
    which are rotated by their M-RoPE positions with mlx-vlm's Qwen3.5 rotary
    embedding (the first ``rotary`` dimensions, as mlx-vlm rotates them)."""

    def __init__(self, rope: nn.Module, args, positions: Positions):
        super().__init__()
        self.rope = rope
        parameters = args.rope_parameters
        self._rotary = _language().Qwen3_5RotaryEmbedding(
            int(args.head_dim * parameters["partial_rotary_factor"]),
            max_position_embeddings=args.max_position_embeddings,
            base=parameters["rope_theta"],
            mrope_section=parameters["mrope_section"],
        )
        self._positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        positions = self._positions
        if positions.ids is None:
            return self.rope(x, offset=offset)
        cos, sin = self._rotary(x, positions.ids)  # (B, L, rotary)
        # mlx-vlm rotates queries and keys in one call: x is the one wanted here
        rotated, _ = _language().apply_multimodal_rotary_pos_emb(x, x[:, :1], cos, sin)
        if positions.every_row:
            return rotated
        plain = self.rope(x, offset=offset)
        return mx.where(positions.rows[:, None, None, None], rotated, plain)


def install(attention_layers, args, positions: Positions) -> None:
    """Wrap the rope of each of ``attention_layers`` (mlx-lm's Qwen3-Next attention)
    in an `MRoPE` reading ``positions``."""
    for attention in attention_layers:
        if not isinstance(attention.rope, MRoPE):
            attention.rope = MRoPE(attention.rope, args, positions)


# -- the trunk ------------------------------------------------------------------------


def with_vision(model_class, config: dict):
    """mlx-lm's Qwen3.5 ``Model`` class for the checkpoint of ``config``, able to
    keep its vision tower (``vision_tower``, mlx-vlm's, built from ``config`` as
    mlx-vlm builds it) and to read images (`mlx_mtp.media`): its caches then end
    with a `MediaCache`. Without the tower it is mlx-lm's model."""

    class Model(model_class):
        def __init__(self, args):
            super().__init__(args)
            self.vision_tower = None
            self.vision_refusal = None  # why a tower the checkpoint has is not kept

        def sanitize(self, weights: dict) -> dict:
            tower = {k: v for k, v in weights.items() if k.startswith(TOWER)}
            weights = model_class.sanitize(self, weights)
            if tower and "vision_config" in config:
                weights.update(self._keep_tower(tower))
            return weights

        def _keep_tower(self, tower: dict) -> dict:
            """The tower's tensors as ``vision_tower.*``, the tower built (none,
            and why in ``vision_refusal``, without mlx-vlm)."""
            try:
                vlm_config = _config().ModelConfig.from_dict(config)
                module = _vision().VisionModel(vlm_config.vision_config)
            except MTPError as e:
                self.vision_refusal = str(e)
                return {}
            except (ValueError, TypeError, KeyError) as e:  # its config's fields
                self.vision_refusal = f"cannot build the vision tower: {one_line(e)}"
                return {}
            self.vision_tower = module
            self.vlm_config = vlm_config
            self.positions = Positions()
            install(_attention(self.layers), self.language_model.args, self.positions)
            renamed = {}
            for key, value in tower.items():
                prefix = next(p for p in TOWER if key.startswith(p))
                renamed[key[len(prefix) :]] = value
            out = module.sanitize(renamed)
            return {f"vision_tower.{k}": v for k, v in out.items()}

        def make_cache(self):
            caches = model_class.make_cache(self)
            return caches + [MediaCache()] if self.vision_tower is not None else caches

        def __call__(self, inputs: mx.array, cache=None, input_embeddings=None):
            if self.vision_tower is None or input_embeddings is not None:
                return model_class.__call__(self, inputs, cache, input_embeddings)
            return logits_of(self, hidden(self, inputs, cache))

        @property
        def quant_predicate(self):
            """The vision tower stays in float under ``-q`` (as mlx-vlm converts
            it); the text model's own predicate decides the rest."""
            inner = model_class.quant_predicate.fget(self)

            def predicate(path, module):
                if path.startswith("vision_tower"):
                    return False
                return True if inner is None else inner(path, module)

            return predicate

    Model.__name__ = Model.__qualname__ = model_class.__name__
    return Model


def _attention(layers) -> list:
    """The full-attention modules of ``layers`` (mlx-lm's Qwen3.5 decoder layers)."""
    return [layer.self_attn for layer in layers if not layer.is_linear]


def _offsets(trunk, layer_caches):
    """The token index of each row's first input (an int or ``(B,)``), from the
    first full-attention layer's cache."""
    for layer, c in zip(trunk.layers, layer_caches):
        if not layer.is_linear:
            return c.offset
    raise MTPError("a Qwen3.5 trunk without a full-attention layer")


def hidden(trunk, inputs: mx.array, cache) -> mx.array:
    """``(B, L, H)`` post-norm hidden states of ``inputs`` ``(B, L)``: with the
    image features and M-RoPE positions of the rows that have images."""
    layer_caches, media = split(cache)
    text = trunk.language_model.model
    if media is None or not media.any:
        return text(inputs, layer_caches)
    offsets = _offsets(trunk, layer_caches)
    e = media.embeddings(text.embed_tokens(inputs), offsets)  # (B, L, H)
    trunk.positions.set(media, offsets, inputs.shape[1])
    try:
        return text(inputs, layer_caches, input_embeddings=e)
    finally:
        trunk.positions.clear()


def logits_of(trunk, h: mx.array) -> mx.array:
    lm = trunk.language_model
    if lm.args.tie_word_embeddings:
        return lm.model.embed_tokens.as_linear(h)
    return lm.lm_head(h)


# -- the MTP layer --------------------------------------------------------------------


class Layer(MTPLayer):
    """A Qwen MTP layer of a trunk that reads images: its input embeddings at image
    placeholders are the image features (row i reads the token after index
    ``offset + i``), and its attention sits at the target's M-RoPE positions (row
    i at token i's). Its cache is ``[KV cache, MediaCache]``."""

    reads_media = True

    def __init__(self, hidden_size: int, eps: float, block, args):
        super().__init__(hidden_size, eps, block)
        self._positions = Positions()
        install([block.self_attn], args, self._positions)

    def __call__(self, embeddings, hidden, mask=None, cache=None):
        if cache is None:
            return super().__call__(embeddings, hidden, mask, None)
        kv, media = cache.caches
        offset = kv.offset
        embeddings = media.embeddings(embeddings, offset, shift=1)
        self._positions.set(media, offset, embeddings.shape[1])
        try:
            return super().__call__(embeddings, hidden, mask, kv)
        finally:
            self._positions.clear()


def reads_images(trunk) -> bool:
    return getattr(trunk, "vision_tower", None) is not None


# -- images ---------------------------------------------------------------------------


def image_processor(model_path):
    """mlx-vlm's Qwen-VL image processor, configured from the model folder's
    ``preprocessor_config.json`` / ``processor_config.json`` as mlx-vlm's is."""
    processing = _processing()
    kwargs = processing._qwen_vl_image_kwargs(str(model_path))
    return processing.Qwen3VLImageProcessor(**kwargs)


def media(trunk, ids: List[int], pixel_values, grid_thw) -> Tuple[List[int], Media]:
    """A prompt ``ids`` with one ``<|image_pad|>`` per image (the config's
    ``image_token_id``; the chat template's ``<|vision_start|><|image_pad|>
    <|vision_end|>``), as the model reads it, and its `mlx_mtp.media.Media`
    (`mlx_mtp.media.build`): the vision tower's features and mlx-vlm's
    ``get_rope_index`` positions.

    Raises:
        MTPError: the checkpoint's tower is not loaded, or the placeholders are
            not one per image.
    """
    if not reads_images(trunk):
        raise MTPError(
            trunk.vision_refusal
            or "this Qwen3.5 checkpoint has no vision tower (a text-only conversion)"
        )
    config, tower = trunk.vlm_config, trunk.vision_tower

    def features(grid, digests):
        def compute():
            pixels = mx.array(pixel_values).astype(tower.patch_embed.proj.weight.dtype)
            return tower(pixels, grid)[0]  # (N, H); Qwen3.5 has no deepstack

        return kept_features(trunk, digests, compute)

    def rope_index(ids, grid):
        holder = _RopeIndex(config)
        return _language().LanguageModel.get_rope_index(holder, ids, grid)

    return build(
        ids, image_placeholder(trunk), pixel_values, grid_thw, features, rope_index
    )


def image_placeholder(trunk) -> Placeholder:
    config = trunk.vlm_config
    return Placeholder(config.image_token_id, config.vision_config.spatial_merge_size)


class _RopeIndex:
    """What mlx-vlm's ``get_rope_index`` reads of its model: the config."""

    def __init__(self, config):
        self.config = config

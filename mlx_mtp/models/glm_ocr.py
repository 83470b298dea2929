"""GLM-OCR (``glm_ocr``, Z.ai): a CogViT vision tower and a 16-layer GLM text model
with multimodal RoPE (M-RoPE: temporal, height and width position ids), and one MTP
layer stored as the text model's layer ``num_hidden_layers``
(``model.language_model.layers.16.*``).

The MTP layer (vLLM's ``GlmOcrMTP``, SGLang's NEXTN) is DeepSeek's: ``enorm``,
``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, copies of the embedding and
head (``embed_tokens``, ``shared_head.head``; checked, then dropped) and a GLM-OCR
decoder layer (four norms around attention and MLP). vLLM zeroes its embedding at
position 0. After an image, as vLLM's multimodal drafting (``EagleProposer.propose``:
``embed_input_ids`` with the multimodal embeddings, the target's ``(3, N)``
positions, +1 on all three per draft step) and SGLang's GLM-OCR fix have it, the
layer reads the merged embeddings (image features at the image's placeholders, not
the placeholder token's embedding) and the target's M-RoPE positions, and the
positions of drafted tokens follow the image's (index plus the prompt's delta, on
all three axes): `mlx_mtp.media`.

mlx-lm has no GLM-OCR, so the trunk is mlx-vlm's (``mlx_vlm.models.glm_ocr``, the
extra ``mlx-mtp[vlm]``): its text model, with its vision tower kept beside it
(``vision_tower``), subclassed to take positions and image features from the
caches (`mlx_mtp.media.MediaCache`) instead of its own per-model state (which holds
one stream's, and forgets it on a rollback), and to make mlx-lm's caches (which
mlx-mtp rolls back and batches). Its vision tower and image processor are used
unchanged.
"""

import re
from functools import lru_cache
from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..errors import MTPError
from ..media import Media as _Media
from ..media import MediaCache, Placeholder, build, kept_features
from . import deepseek_v3, vlm
from .base import check_copy, sanitize_layers, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

WHAT = "GLM-OCR (glm_ocr)"
BASE = "model.language_model."


def _text(config: dict) -> dict:
    return config.get("text_config") or config


LAYOUT = Layout(
    prefix=lambda config, j: f"{BASE}layers.{_text(config)['num_hidden_layers'] + j}.",
    fusion=deepseek_v3.LAYOUT.fusion,  # DeepSeek's names
    copies={
        "embed_tokens.weight": f"{BASE}embed_tokens.weight",
        "shared_head.head.weight": "lm_head.weight",
    },
)


@lru_cache(maxsize=None)
def _language():
    return vlm.need(
        "models.glm_ocr.language",
        WHAT,
        [
            ("LanguageModel", "args, config=None"),
            (
                "LanguageModel.get_rope_index",
                "self, input_ids, image_grid_thw=None, video_grid_thw=None, "
                "attention_mask=None",
            ),
            (
                "GlmOcrTextModel.__call__",
                "self, inputs, inputs_embeds=None, cache=None, mask=None, "
                "position_ids=None",
            ),
            ("GlmOcrDecoderLayer", "config"),
            (
                "GlmOcrDecoderLayer.__call__",
                "self, x, mask=None, cache=None, position_embeddings=None",
            ),
            ("GlmOcrRotaryEmbedding", "config"),
            ("GlmOcrRotaryEmbedding.__call__", "self, x, position_ids"),
        ],
    )


@lru_cache(maxsize=None)
def _vision():
    return vlm.need(
        "models.glm_ocr.vision",
        WHAT,
        [
            ("VisionModel", "config"),
            (
                "VisionModel.__call__",
                "self, hidden_states, grid_thw, output_hidden_states=None",
            ),
            ("VisionModel.sanitize", "self, weights"),
        ],
    )


@lru_cache(maxsize=None)
def _config():
    return vlm.need(
        "models.glm_ocr.config",
        WHAT,
        [("ModelConfig.from_dict", "params"), ("TextConfig.from_dict", "params")],
    )


@lru_cache(maxsize=None)
def _processing():
    return vlm.need(
        "models.glm_ocr.processing",
        WHAT,
        [
            ("_glm_ocr_image_kwargs", "pretrained_model_name_or_path"),
            ("Glm46VImageProcessor.__call__", "self, images, **kwargs"),
        ],
    )


class ModelArgs:
    """mlx-vlm's ``ModelConfig`` from a ``config.json``, its text and vision parts
    read with ``from_dict`` (which skips the keys they do not know)."""

    @staticmethod
    def from_dict(params: dict):
        c = _config()
        params = dict(params)
        params["text_config"] = c.TextConfig.from_dict(params.get("text_config", {}))
        params["vision_config"] = c.VisionConfig.from_dict(
            params.get("vision_config", {})
        )
        return c.ModelConfig.from_dict(params)


@lru_cache(maxsize=None)
def _trunk_class():
    language, vision = _language(), _vision()

    class Model(language.LanguageModel):
        """mlx-vlm's GLM-OCR text model, returning logits, with its vision tower as
        ``vision_tower``; positions and image features come from the caches' last
        entry (`mlx_mtp.media.MediaCache`), and it makes mlx-lm's caches."""

        def __init__(self, config):
            super().__init__(config.text_config, config)
            self.vision_tower = vision.VisionModel(config.vision_config)
            self.model.pipeline = _no_pipeline

        def hidden_states(self, inputs: mx.array, cache=None) -> mx.array:
            """``(B, L, H)`` post-norm hidden states of ``inputs`` ``(B, L)``."""
            layers, media = _split(cache, inputs.shape[0], len(self.layers))
            offset = layers[0].offset if layers[0] is not None else 0
            e = media.embeddings(self.model.embed_tokens(inputs), offset)
            positions = media.position_ids(offset, inputs.shape[1])  # (3, B, L)
            mask = create_attention_mask(e, layers[0])
            return self.model(
                inputs, inputs_embeds=e, cache=layers, mask=mask, position_ids=positions
            )

        def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
            """Logits ``(B, L, V)``, as mlx-lm's models return them."""
            return self.lm_head(self.hidden_states(inputs, cache))

        def make_cache(self) -> List[Any]:
            return [KVCache() for _ in self.layers] + [MediaCache()]

        def quant_predicate(self, path: str, module) -> bool:
            """The vision tower stays in float when the text model is quantized
            (as mlx-vlm converts it)."""
            return not path.startswith("vision_tower")

        def sanitize(self, weights: dict) -> dict:
            """Hugging Face names (``model.language_model.*``, ``model.visual.*``)
            and an mlx-vlm conversion's (``language_model.model.*``,
            ``language_model.lm_head.*``) as this model's (``model.*``, ``lm_head.*``,
            ``vision_tower.*``); a conversion of mlx-mtp's passes unchanged."""
            out = {}
            for key, value in weights.items():
                for old, new in RENAMES:
                    if key.startswith(old):
                        key = new + key[len(old) :]
                        break
                out[key] = value
            return self.vision_tower.sanitize(out)

    return Model


# Checkpoint name prefixes -> the trunk's (Hugging Face's, then mlx-vlm's).
RENAMES = (
    (BASE, "model."),
    ("model.visual.", "vision_tower."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def _split(cache, rows: int, layers: int):
    """(the layers' caches, the `MediaCache`) of a trunk pass's ``cache``."""
    if cache is None:
        return [None] * layers, MediaCache([None] * rows)
    *layer_caches, media = cache
    return layer_caches, media


def _no_pipeline(group) -> None:
    raise MTPError(
        f"{WHAT} runs on one machine: mlx-vlm's trunk cannot be split over ranks"
    )


def trunk_classes(config: dict):
    return _trunk_class(), ModelArgs


def hidden(trunk, inputs: mx.array, cache) -> mx.array:
    return trunk.hidden_states(inputs, cache)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """The MTP layer of ``model.language_model.layers.{L + j}.*`` (j), else None."""
    m = re.match(r"model\.language_model\.layers\.(\d+)\.", key)
    first = _text(config)["num_hidden_layers"]
    if m and int(m[1]) >= first:
        return int(m[1]) - first
    return None


def split_weights(weights: dict, config: dict):
    """(trunk, mtp) tensors, the MTP layers' copies of the embedding and head
    checked and dropped."""
    trunk, mtp = split_mtp(weights, config, mtp_layer_of)
    for key in list(mtp):
        j = mtp_layer_of(key, config)
        name = key[len(LAYOUT.prefix(config, j)) :]
        if name in LAYOUT.copies:
            check_copy(mtp.pop(key), trunk.get(LAYOUT.copies[name]), key)
    return trunk, mtp


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    return sanitize_layers(trunk, weights, config, mtp_layer_of, LAYOUT)


@lru_cache(maxsize=None)
def _mtp_classes():
    language = _language()

    class Block(language.GlmOcrDecoderLayer):
        """GLM-OCR's decoder layer called as an MTP block, ``block(x, mask,
        cache)``, its positions from the cache's `MediaCache`."""

        def __init__(self, args):
            super().__init__(args)
            self.rotary_emb = language.GlmOcrRotaryEmbedding(args)

        def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
            kv, media = _parts(cache, x.shape[0])
            offset = kv.offset if kv is not None else 0
            positions = media.position_ids(offset, x.shape[1])  # (3, B, L)
            return super().__call__(x, mask, kv, self.rotary_emb(x, positions))

    class Layer(MTPLayer):
        """An MTP layer whose input embeddings at image placeholders are the image
        features (row i of the call reads the token after index ``offset + i``)."""

        def __call__(self, embeddings, hidden, mask=None, cache=None):
            kv, media = _parts(cache, embeddings.shape[0])
            offset = kv.offset if kv is not None else 0
            embeddings = media.embeddings(embeddings, offset, shift=1)
            return super().__call__(embeddings, hidden, mask, cache)

        reads_media = True

    return Block, Layer


def _parts(cache, rows: int):
    if cache is None:
        return None, MediaCache([None] * rows)
    return cache.caches


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: a GLM-OCR decoder layer as the block."""
    Block, Layer = _mtp_classes()
    args = trunk.args
    return Layer(args.hidden_size, args.rms_norm_eps, Block(args))


# -- images ---------------------------------------------------------------------------


def image_processor(model_path):
    """mlx-vlm's GLM-OCR image processor, configured from the model folder's
    ``preprocessor_config.json`` / ``processor_config.json`` as mlx-vlm's is."""
    processing = _processing()
    kwargs = processing._glm_ocr_image_kwargs(str(model_path))
    return processing.Glm46VImageProcessor(**kwargs)


def media(trunk, ids: List[int], pixel_values, grid_thw) -> Tuple[List[int], _Media]:
    """A prompt ``ids`` with one image placeholder (the config's ``image_token_id``)
    per image of ``pixel_values`` ``(patches, C*T*P*P)`` and ``grid_thw``
    ``(images, 3)``, as the model reads it, and its `mlx_mtp.media.Media`
    (`mlx_mtp.media.build`): the vision tower's features (run on all the images
    together, as mlx-vlm runs it) and mlx-vlm's ``get_rope_index`` positions.

    Raises:
        MTPError: the placeholders are not one per image.
    """
    tower = trunk.vision_tower

    def features(grid, digests):
        def compute():
            pixels = mx.array(pixel_values).astype(tower.patch_embed.proj.weight.dtype)
            return tower(pixels, grid, output_hidden_states=False)

        return kept_features(trunk, digests, compute)

    return build(
        ids,
        image_placeholder(trunk),
        pixel_values,
        grid_thw,
        features,
        lambda ids, grid: trunk.get_rope_index(ids, image_grid_thw=grid),
    )


def image_placeholder(trunk) -> Placeholder:
    config = trunk.config
    return Placeholder(config.image_token_id, config.vision_config.spatial_merge_size)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,  # vLLM's GLM-OCR MTP is DeepSeek's: position 0 zeroed
    EMBEDDING_KEY=f"{BASE}embed_tokens.weight",
    FINAL_NORM_KEY=f"{BASE}norm.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    hidden=hidden,
    image_processor=image_processor,
    media=media,
    image_placeholder=image_placeholder,
)

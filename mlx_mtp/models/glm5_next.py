"""GLM-5.3-Flash (``glm5_next``, Z.ai): a vision-language model whose text model is
GLM-5-Next (KDA linear-attention layers and, every fourth, DeepSeek sparse attention:
NoPE MLA with a pooled-key indexer, some layers sharing the previous one's selection;
sigmoid-routed MoE with a shared expert; four hyper-connection streams) and one MTP
("nextn") layer.

The checkpoint keeps the text model under ``model.language_model.`` (``lm_head``
at the top, the vision tower under ``model.visual.``, left out of the text trunk)
and the nextn layer as an ordinary decoder layer at index ``num_hidden_layers``, no
top-level ``mtp.*``: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], a DSA attention with
an indexer of its own, an MoE MLP, ``shared_head.norm``, and no hyper-connection
streams. mlx-vlm's drafter (``glm5_next_mtp``, the reference here, as its splitter
reads the release) fuses as DeepSeek's does: it reads the trunk's hidden state after
the streams' mean and ``model.norm``, zeroes position 0's embedding, and projects
with the trunk's head; its output (after ``shared_head.norm``) is also the next
step's hidden state.

mlx-lm has no GLM-5-Next, so the trunk is mlx-vlm's text model
(``mlx_vlm.models.glm5_next.language``, the extra ``mlx-mtp[vlm]``) and the MTP block
mlx-vlm's ``Glm5NextMTPBlock``, used unchanged but for:

- caches that roll back (`mlx_mtp.models.glm5_next_cache`, from
  `mlx_mtp.models.vlm_cache`: its ``ArraysCache`` and ``PoolingCache`` with what a
  rollback needs, mlx-lm's KV caches);
- the checkpoint's names read by its own sanitize, which expects them under its
  vision-language model's ``language_model.``;
- logits through mlx-vlm's ``linear``, as its model computes them (a verify pass of
  up to 8 positions projects each with a decode step's reduction).

Writing the trunk here instead (as for DeepSeek-V4) would copy mlx-vlm's KDA,
pooled indexer, sparse attention and hyper-connection code (about 1,100 lines, with
its verify-shape kernels) for nothing MTP needs.
"""

import re
from dataclasses import replace
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx

from . import glm5_next_cache, vlm
from .base import check_copy, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

WHAT = glm5_next_cache.WHAT
TEXT = "model.language_model."
VLM_TEXT = "language_model."
LAYER = re.compile(
    r"(?:model\.language_model\.|language_model\.model\.|model\.)layers\.(\d+)\."
)
HEAD_NAMES = {
    "enorm": "enorm",
    "hnorm": "hnorm",
    "eh_proj": "eh_proj",
    "shared_head.norm": "norm",
}


def _layers(config: dict) -> int:
    """The trunk's layers (the first nextn layer's index)."""
    return vlm.text_config(config)["num_hidden_layers"]


LAYOUT = Layout(
    prefix=lambda config, j: f"{TEXT}layers.{_layers(config) + j}.",
    fusion=HEAD_NAMES,
    copies={
        "embed_tokens.weight": f"{TEXT}embed_tokens.weight",
        "shared_head.head.weight": "lm_head.weight",
    },
)


@lru_cache(maxsize=None)
def _language():
    return vlm.need(
        "models.glm5_next.language",
        WHAT,
        [
            ("LanguageModel", "config"),
            ("LanguageModel.sanitize", "self, weights"),
            (
                "Glm5NextTextModel.__call__",
                "self, inputs, inputs_embeds=None, cache=None, attention_mask=None, "
                "hidden_sink=None",
            ),
            ("TextConfig.from_dict", "params"),
        ],
    )


@lru_cache(maxsize=None)
def _drafter():
    return vlm.need(
        "speculative.drafters.glm5_next_mtp.glm5_next_mtp",
        WHAT,
        [
            ("Glm5NextMTPBlock", "config, layer_idx"),
            ("Glm5NextMTPBlock.__call__", "self, x, cache=None, last_only=False"),
            ("Glm5NextMTPDraftModel.sanitize", "self, weights"),
        ],
    )


@lru_cache(maxsize=None)
def _linear():
    return vlm.need("models.linear", WHAT, [("linear", "module, x")]).linear


def _to_vlm(weights: dict) -> dict:
    """Text tensors under mlx-vlm's vision-language names (``language_model.model.*``,
    ``language_model.lm_head``), whether raw (``model.language_model.*``) or this
    trunk's own (``model.*``); the vision tower's are left out."""
    out = {}
    for key, value in weights.items():
        if key.startswith(TEXT):
            out[f"{VLM_TEXT}model.{key[len(TEXT):]}"] = value
        elif key.startswith(("model.", "lm_head.")) and not key.startswith(
            "model.visual."
        ):
            out[VLM_TEXT + key] = value
    return out


@lru_cache(maxsize=None)
def _trunk_classes():
    language = _language()

    ModelArgs = vlm.text_args(language.TextConfig)

    class Model(language.LanguageModel):
        """mlx-vlm's GLM-5-Next text model returning logits, with caches that roll
        back, loading the checkpoint's text tensors."""

        def __call__(self, inputs, cache=None, **kwargs):
            """Logits ``(B, L, V)``, as mlx-lm's models return them."""
            return super().__call__(inputs, cache=cache, **kwargs).logits

        def make_cache(self):
            return glm5_next_cache.make_cache(self.layers)

        def sanitize(self, weights: dict) -> dict:
            fixed = super().sanitize(_to_vlm(weights))
            return {k[len(VLM_TEXT) :]: v for k, v in fixed.items()}

    return Model, ModelArgs


def trunk_classes(config: dict):
    return _trunk_classes()


def hidden(trunk, inputs: mx.array, cache):
    """The hidden state after the streams' mean and ``model.norm``."""
    return trunk.model(inputs, cache=cache)


def logits(trunk, h: mx.array) -> mx.array:
    """The trunk's head, as its model applies it (mlx-vlm's ``linear``)."""
    return _linear()(trunk.lm_head, h)


def head(trunk):
    return trunk.lm_head


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """The nextn layer a tensor belongs to (layer index ``num_hidden_layers`` and
    beyond), else None."""
    m = LAYER.match(key)
    layers = _layers(config)
    if m and int(m[1]) >= layers:
        return int(m[1]) - layers
    return None


def split_weights(weights: dict, config: dict):
    """Split tensors into (trunk, mtp); check and drop copies of the embedding and
    head in the nextn layer, if a checkpoint has them."""
    trunk, mtp = split_mtp(weights, config, mtp_layer_of)
    for key in list(mtp):
        name = key[LAYER.match(key).end() :]
        if name in LAYOUT.copies:
            check_copy(mtp.pop(key), trunk.get(LAYOUT.copies[name]), key)
    return trunk, mtp


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """Map the nextn layers' tensors to the schema ``layers.{j}.*``: the fusion and
    norm tensors renamed (`HEAD_NAMES`), the decoder layer's through mlx-vlm's
    drafter sanitize (its fused projections, stacked experts, split ``kv_b_proj``)
    as its splitter hands them over (``mtp_block.*``)."""
    out = {}
    layers = {}
    for key, value in weights.items():
        j = mtp_layer_of(key, config)
        layers.setdefault(j, {})[key[LAYER.match(key).end() :]] = value
    context = SimpleNamespace(args=trunk.args)
    for j, tensors in sorted(layers.items()):
        block = {}
        for name, value in tensors.items():
            src = next((s for s in HEAD_NAMES if name.startswith(s + ".")), None)
            if src is None:
                block["mtp_block." + name] = value
            else:
                out[f"layers.{j}.{HEAD_NAMES[src]}{name[len(src):]}"] = value
        fixed = _drafter().Glm5NextMTPDraftModel.sanitize(context, block)
        for name, value in fixed.items():
            out[f"layers.{j}.block.{name[len('mtp_block.'):]}"] = value
    return out


@lru_cache(maxsize=None)
def _block_class():
    class Block(_drafter().Glm5NextMTPBlock):
        """mlx-vlm's MTP block called as mlx-mtp's blocks are (``block(x, mask,
        cache)``): its sparse attention finds its own causal selection."""

        def __call__(self, x, mask=None, cache=None):
            return super().__call__(x, cache=cache)

    return Block


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-vlm's block at layer index ``num_hidden_layers + j`` (DSA
    attention with its own indexer, MoE), as its drafter builds it."""
    args = trunk.args
    extra = j + 1
    layer_args = replace(
        args,
        num_hidden_layers=args.num_hidden_layers + extra,
        layer_types=[*args.layer_types, *["deepseek_sparse_attention"] * extra],
        mlp_layer_types=[*args.mlp_layer_types, *["sparse"] * extra],
        indexer_types=[*args.indexer_types, *["full"] * extra],
    )
    block = _block_class()(layer_args, args.num_hidden_layers + j)
    layer = MTPLayer(args.hidden_size, args.rms_norm_eps, block)
    layer.make_caches = lambda: glm5_next_cache.layer_cache(block).caches
    return layer


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,  # mlx-vlm's drafter zeroes position 0's embedding
    EMBEDDING_KEY=f"{TEXT}embed_tokens.weight",
    FINAL_NORM_KEY=f"{TEXT}norm.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    hidden=hidden,
    logits=logits,
    head=head,
)

"""Qwen3.8-Flash-Next (``qwen4_exp``, Qwen): a vision-language model whose text model
runs in ``hc_count`` hyper-connection streams (a gated residual around each
sub-layer, a final mixer collapsing them, no final norm), Gated-DeltaNet layers and,
one in ``full_attention_interval``, Qwen sparse attention (QSA: a top-k block
indexer over compressed keys), an MoE MLP with a gated shared expert, and on the
``ple_layer_ids`` layers a per-layer n-gram embedding (PLE) read from a large
hashed table. Every RMSNorm weight is stored zero-centred (applied as 1 + w) except
the delta net's gated output norm.

The checkpoint keeps the text model under ``model.language_model.`` (``lm_head`` at
the top, the vision tower under ``model.visual.``, left out of the text trunk) and
its MTP layer as 31 top-level ``mtp.*`` tensors (mlx-vlm's ``qwen4_exp_mtp``, the
reference here, as its splitter reads the release): ``pre_fc_norm_embedding``, one
``pre_fc_norm_hidden`` over all the streams, ``fc_embedding`` and ``fc_hidden``
(the hidden projection applied to each stream, the embedding's added to every
one), a QSA decoder layer with its hyper-connections (``layers.0``), and its own
``hyper_connection_mixer``. It reads the trunk's streams before the final mixer and
hands its own streams to the next step; its mixer's output goes to the trunk's
head. Hidden states here are therefore packed ``(B, L, (hc + 1) H)``: the streams,
then their mixed collapse the head reads (as DeepSeek-V4's are).

mlx-lm has no Qwen3.8-Flash-Next, so the trunk is mlx-vlm's text model
(``mlx_vlm.models.qwen4_exp.language``, the extra ``mlx-mtp[vlm]``), used unchanged
but for:

- caches that roll back (`mlx_mtp.models.vlm_cache.RecordingArraysCache` for the
  delta net's and the PLE's slots; QSA's ``QSAKVCache`` trimmed, its indexer keys
  with it, `QSARows`);
- the forward: a pass of one position, and a verify pass (a marked one: its
  caches record), run mlx-vlm's batch-invariant forward, which computes each
  position as a one-position pass does (mlx-vlm's own decoding and speculative
  verification run it), and the head through its ``_linear``; a prompt runs its
  ordinary forward, as its model does;
- the checkpoint's names read by its vision-language model's sanitize.

Writing the trunk here instead (as for DeepSeek-V4) would copy mlx-vlm's 2,200
lines of delta-net, sparse-attention, hyper-connection and hashed n-gram code.
"""

from dataclasses import replace
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import MissingHeadsError, MTPError
from ..one_row import TrimsTail
from ..rows import merge_apart
from . import vlm
from .base import split_mtp
from .family import Layout, define
from .vlm_cache import copy_arrays, recording_cache_class

WHAT = "Qwen3.8-Flash-Next (qwen4_exp)"
TEXT = "model.language_model."
VLM_TEXT = "language_model."

# The MTP's names as the release keeps them (after ``mtp.``) -> mlx-mtp's schema
# (``layers.0.*``); its decoder layer is the schema's ``block``.
RELEASE_NAMES = {
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "fc_embedding": "fc_embedding",
    "fc_hidden": "fc_hidden",
    "hyper_connection_mixer": "mixer",
    "layers.0": "block",
}
HALVES = ("fc_embedding", "fc_hidden")
# The n-gram table's shards (``ngram_embedding.shard_{s}`` as released,
# ``ngram_embedding.shards.{s}`` in the trunk): read by row, memory-mapped.
NGRAM_TABLE = ".ngram_embedding.shard"
# The projections the release keeps in full precision: each stream's injection gate
# and the shared expert's gate (a quantized trunk and 8-bit heads keep them float).
FLOAT_LAYERS = ("block_inject_weight", "shared_expert_gate")


LAYOUT = Layout(
    prefix=lambda config, j: "mtp.",
    fusion={
        "pre_fc_norm_embedding": "enorm",
        "pre_fc_norm_hidden": "hnorm",
        "fc_embedding": "eh_proj",
    },
    halves=HALVES,
)


@lru_cache(maxsize=None)
def _language():
    return vlm.need(
        "models.qwen4_exp.language",
        WHAT,
        [
            ("LanguageModel", "args, config=None"),
            (
                "LanguageModel.__call__",
                "self, inputs, inputs_embeds=None, mask=None, cache=None, **kwargs",
            ),
            ("Qwen4ExpDecoderLayer", "config, layer_idx"),
            ("Qwen4ExpGatedResidual", "config, use_combine=True"),
            ("Qwen4ExpRMSNorm", "dim, group_size=None, eps=1e-06"),
            ("QSAKVCache.trim", "self, n"),
            (
                "_QWEN4_BATCH_INVARIANT_FORWARD",
                "language_model, inputs, *, cache=None, inputs_embeds=None, "
                "position_ids=None, skip_logits=False",
            ),
            (
                "_QWEN4_BATCH_INVARIANT_FORWARD._hyper_connection",
                "module, hidden_states",
            ),
            ("_QWEN4_BATCH_INVARIANT_FORWARD._linear", "linear, x"),
            ("TextConfig.from_dict", "params"),
        ],
    )


@lru_cache(maxsize=None)
def _vlm_model():
    return vlm.need(
        "models.qwen4_exp.qwen4_exp",
        WHAT,
        [("Model.sanitize", "self, weights")],
    )


@lru_cache(maxsize=None)
def _drafter():
    return vlm.need(
        "speculative.drafters.qwen4_exp_mtp.qwen4_exp_mtp",
        WHAT,
        [("Qwen4ExpMTPDraftModel.sanitize", "self, weights")],
    )


@lru_cache(maxsize=None)
def _fp8():
    return vlm.need(
        "models.qwen4_exp.fp8",
        WHAT,
        [("convert_qwen4_exp_fp8_weights", "weights")],
    )


@lru_cache(maxsize=None)
def _attention_mask():
    """mlx-vlm's Qwen3.5 causal mask, as its Qwen3.8-Flash-Next drafter takes it."""
    qwen3_5 = vlm.need(
        "models.qwen3_5.language",
        WHAT,
        [("_create_qwen3_5_attention_mask", "h, cache")],
    )
    return qwen3_5._create_qwen3_5_attention_mask


def _forward():
    return _language()._QWEN4_BATCH_INVARIANT_FORWARD


@lru_cache(maxsize=None)
def qsa_rows_class() -> type:
    """`QSARows` (made on first use: mlx-vlm's ``QSAKVCache`` is its base)."""

    class QSARows(TrimsTail, _language().QSAKVCache):
        """A QSA layer's keys, values and indexer keys, one stream: a rollback
        trims them all (mlx-vlm's ``trim``, which drops its compressed-block
        summary, rebuilt from the keys by the next pass)."""

        def batch_refusal(self) -> Optional[str]:
            return None

        merge = classmethod(merge_apart)

        def cost(self):
            """Per position held: its keys, values and index keys (read off a
            cache that has seen a position)."""
            if self.keys is None:
                return 0.0, (), 0.0
            index = 0 if self.index_keys is None else self.index_keys.nbytes
            held = self.keys.nbytes + self.values.nbytes
            per = held / self.keys.shape[2] + index / max(1, self.offset)
            return per, (), 0.0

        def snapshot(self):
            return copy_arrays(self)

        def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
            raise MTPError("cannot read the keys and values of a QSA cache")

    return QSARows


def make_cache(layers) -> list:
    """A `RecordingArraysCache` per delta-net layer (two slots, four with a PLE:
    its convolution window and n-gram token history), a `QSARows` per QSA layer."""
    return [
        (
            recording_cache_class()(4 if "ple" in layer else 2)
            if layer.is_linear
            else qsa_rows_class()()
        )
        for layer in layers
    ]


# What mlx-vlm's position ids read of its vision-language config: text only, no
# image or video token is ever seen (the vision tower is left out).
TEXT_ONLY = SimpleNamespace(
    vision_config=SimpleNamespace(spatial_merge_size=2),
    image_token_id=-1,
    video_token_id=-1,
    vision_start_token_id=-1,
)


def _to_vlm(weights: dict) -> dict:
    """Text tensors as mlx-vlm's vision-language model names them before its
    sanitize: raw ones (``model.language_model.*``, ``lm_head``) as they are, this
    trunk's own (``model.*``) under ``language_model.``; the vision tower's left
    out."""
    out = {}
    for key, value in weights.items():
        if key.startswith(("model.visual.", "mtp.")):
            continue
        if key.startswith(TEXT) or key.startswith("lm_head."):
            out[key] = value
        elif key.startswith("model."):
            out[VLM_TEXT + key] = value
    return out


@lru_cache(maxsize=None)
def _trunk_classes():
    language = _language()

    ModelArgs = vlm.text_args(language.TextConfig)

    class Model(language.LanguageModel):
        """mlx-vlm's Qwen3.8-Flash-Next text model returning logits, with caches
        that roll back, loading the checkpoint's text tensors."""

        def __init__(self, args):
            super().__init__(args, TEXT_ONLY)

        def __call__(self, inputs, cache=None, **kwargs):
            """Logits ``(B, L, V)``, as mlx-lm's models return them."""
            return super().__call__(inputs, cache=cache, **kwargs).logits

        def make_cache(self):
            return make_cache(self.layers)

        @property
        def quant_predicate(self):
            """mlx-vlm's choices (its 8-bit router gates, its n-gram table's
            group), the `FLOAT_LAYERS` kept float."""
            theirs = super().quant_predicate

            def predicate(path, module):
                return not path.endswith(FLOAT_LAYERS) and theirs(path, module)

            return predicate

        def sanitize(self, weights: dict) -> dict:
            context = SimpleNamespace(config=SimpleNamespace(text_config=self.args))
            fixed = _vlm_model().Model.sanitize(context, _to_vlm(weights))
            return {
                k[len(VLM_TEXT) :]: v
                for k, v in fixed.items()
                if k.startswith(VLM_TEXT)
            }

    return Model, ModelArgs


def trunk_classes(config: dict):
    return _trunk_classes()


def _verifying(cache) -> bool:
    """Whether the pass over ``cache`` is a verify pass: its recurrent caches were
    marked to record it."""
    return any(getattr(c, "capture", None) is not None for c in cache)


def _positions(trunk, inputs: mx.array, cache) -> mx.array:
    """Each row's positions ``(B, L)`` from its attention cache's offset, as
    mlx-vlm's speculative verification computes them (text only)."""
    offset = cache[trunk.model.fa_idx].offset
    return offset + mx.arange(inputs.shape[1])[None]


def hidden(trunk, inputs: mx.array, cache=None) -> mx.array:
    """Packed ``(B, L, (hc + 1) H)``: the streams after the last layer, then the
    final mixer's collapse (module docstring)."""
    if cache is not None and (inputs.shape[1] == 1 or _verifying(cache)):
        forward = _forward()
        positions = _positions(trunk, inputs, cache)
        out = forward(
            trunk, inputs, cache=cache, position_ids=positions, skip_logits=True
        )
        streams = out.hidden_states[0]
        mixed = forward._hyper_connection(trunk.model.hyper_connection_mixer, streams)
    else:
        language = _language().LanguageModel
        out = language.__call__(
            trunk, inputs, cache=cache, return_hidden=True, skip_logits=True
        )
        streams = out.hidden_states[0]
        mixed = trunk.model.hyper_connection_mixer(streams)
    return mx.concatenate([streams, mixed.astype(streams.dtype)], axis=-1)


def logits(trunk, h: mx.array) -> mx.array:
    """The trunk's head over the mixed collapse (the last ``hidden_size``)."""
    return _forward()._linear(trunk.lm_head, h[..., -trunk.args.hidden_size :])


def head(trunk):
    return trunk.lm_head


def final_norm(trunk):
    """Refused: the trunk ends with its streams' mixer, no norm.

    Raises:
        MTPError: always.
    """
    raise MTPError(f"{WHAT} has no final norm (a mixer of its streams closes it)")


def hidden_width(args) -> int:
    return (args.hc_count + 1) * args.hidden_size


class MTPLayer(nn.Module):
    """Qwen3.8-Flash-Next's MTP layer over packed hidden states (module
    docstring): mlx-vlm's drafter's parts, as it runs them.

    Attributes:
        window, kv_caches, reads_media, make_caches: as `mlx_mtp.models.mtp.MTPLayer`
            (one QSA cache, `QSARows`).
        float_layers: Names of the projections quantized heads keep float
            (`FLOAT_LAYERS`).
    """

    window = None
    kv_caches = 1
    reads_media = False
    float_layers = FLOAT_LAYERS

    def __init__(self, args):
        super().__init__()
        language = _language()
        H, hc = args.hidden_size, args.hc_count
        layer_args = replace(
            args,
            num_hidden_layers=1,
            layer_types=["qwen_sparse_attention"],
            full_attention_interval=1,
            ple_layer_ids=[],
        )
        self.enorm = language.Qwen4ExpRMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = language.Qwen4ExpRMSNorm(hc * H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)  # [fc_embedding | fc_hidden]
        self.block = language.Qwen4ExpDecoderLayer(layer_args, 0)
        self.mixer = language.Qwen4ExpGatedResidual(layer_args, use_combine=False)
        self.hc = hc
        self.make_caches = lambda: [qsa_rows_class()()]

    def __call__(self, embeddings, hidden, mask=None, cache=None) -> mx.array:
        """``(B, L, H)`` embeddings of t_{i+1} and packed ``hidden`` at i -> the
        packed output; positions from ``cache`` (0 without), the causal mask
        mlx-vlm's drafter takes."""
        B, L, H = embeddings.shape
        streams = self.hnorm(hidden[..., : self.hc * H]).reshape(B, L, self.hc, H)
        e = mx.broadcast_to(self.enorm(embeddings)[:, :, None], streams.shape)
        x = self.eh_proj(mx.concatenate([e, streams], axis=-1))  # (B, L, hc, H)
        x = x.reshape(B, L, self.hc * H)
        offset = 0 if cache is None else cache.offset
        positions = offset + mx.arange(L)[None]
        mask = _attention_mask()(x, cache)
        y = self.block(x, None, mask=mask, cache=cache, position_ids=positions)
        return mx.concatenate([y, self.mixer(y).astype(y.dtype)], axis=-1)


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    """MTP layer 0 for an ``mtp.*`` tensor (the release has one), else None."""
    return 0 if key.startswith("mtp.") else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """The ``mtp.*`` tensors in the schema ``layers.0.*`` (`RELEASE_NAMES`), through
    mlx-vlm's drafter sanitize (its fused experts split as its ``switch_mlp``), FP8
    ones first through its FP8 conversion, as its splitter does."""
    weights = _fp8().convert_qwen4_exp_fp8_weights(dict(weights))
    fixed = _drafter().Qwen4ExpMTPDraftModel.sanitize(None, weights)
    out = {}
    for name, value in fixed.items():
        src = next((s for s in RELEASE_NAMES if name.startswith(s + ".")), None)
        if src is None:
            raise MTPError(f"{WHAT}: unknown MTP tensor mtp.{name}")
        out[f"layers.0.{RELEASE_NAMES[src]}{name[len(src):]}"] = value
    _fuse(out)
    return out


def _fuse(out: dict) -> None:
    """``layers.0.fc_{embedding,hidden}.*`` -> ``layers.0.eh_proj.*``, along the
    input (exact: ``[W_e | W_h] [e; h] = W_e e + W_h h``, and quantized weights stay
    exact: their groups do not straddle the halves).

    Raises:
        MissingHeadsError: the halves' shapes differ.
    """
    e, h = (f"layers.0.{half}." for half in HALVES)
    for key in [k for k in out if k.startswith(e)]:
        part = key[len(e) :]
        if h + part not in out:
            return  # loading then names the missing eh_proj
        halves = [out.pop(e + part), out.pop(h + part)]
        if halves[0].shape != halves[1].shape:
            ours, theirs = (f"mtp.{n}.{part}" for n in HALVES)
            raise MissingHeadsError(
                f"{ours} has shape {tuple(halves[0].shape)} but {theirs}'s is "
                f"{tuple(halves[1].shape)}: the MTP layer is damaged or from "
                "another model"
            )
        out[f"layers.0.eh_proj.{part}"] = mx.concatenate(halves, axis=-1)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    return MTPLayer(trunk.args)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("mtp_num_hidden_layers",),
    ZERO_CENTRED_NORMS=True,
    EMBEDDING_KEY=f"{TEXT}embed_tokens.weight",
    FINAL_NORM_KEY=None,  # no final norm: a mixer of its streams closes the trunk
    MAPPED_TABLES=(NGRAM_TABLE,),
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    hidden=hidden,
    logits=logits,
    head=head,
    final_norm=final_norm,
    hidden_width=hidden_width,
)

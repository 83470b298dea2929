"""Hy4 (``hy_v4``, Tencent): a DeepSeek-V3.2-style trunk (MLA with a sparse-attention
indexer on some layers, "shared" layers reusing the last one's selection; a gated
attention output and per-head attention sinks; sigmoid-routed MoE) carried in four
identity hyper-connection streams, and one MTP layer at ``model.mtp_layers.0.*``.

The MTP layer (mlx-vlm's ``hy_v4_mtp``, vLLM's ``HYV4MTP``) fuses as DeepSeek's does,
with MiMo's names for its final norm: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], then
a decoder layer of the trunk's kind without hyper-connection streams (MLA with an
indexer of its own, MoE), then ``final_layernorm``; it reads the trunk's hidden state
after ``hc_head`` and ``model.norm`` (rank 3: the streams already collapsed) and its
embedding and head are the trunk's. It keeps two caches, as DeepSeek-V3.2's does (the
MLA latent and the indexer's keys).

mlx-lm has no Hy4, so the trunk is mlx-vlm's text model (``mlx_vlm.models.hy_v4``,
the extra ``mlx-mtp[vlm]``) and the MTP block mlx-vlm's ``HyV4MTPDecoderLayer``, both
used as they are with two changes made by subclassing: the trunk makes mlx-lm's
caches (which mlx-mtp rolls back and batches; mlx-vlm's ``HyV4KVCache`` only grows its
buffer differently), and a float ``kv_b_proj`` is split into MLA's ``embed_q`` /
``unembed_out`` before mlx-vlm's sanitize, which handles only the MXFP8 release form
of that tensor. Writing the trunk here instead (as for DeepSeek-V4) would copy
mlx-vlm's 700 lines of attention, routing and expert code for nothing MTP needs.
"""

import re
from dataclasses import replace
from functools import lru_cache
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import CacheList, KVCache

from . import vlm
from .base import sanitize_layers, split_mtp
from .family import Layout, define
from .mtp import MTPLayer

WHAT = "Hy4 (hy_v4)"

LAYOUT = Layout(
    prefix=lambda config, j: f"model.mtp_layers.{j}.",
    fusion={
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "final_layernorm": "norm",
    },
)


@lru_cache(maxsize=None)
def _language():
    return vlm.need(
        "models.hy_v4.language",
        WHAT,
        [
            ("LanguageModel", "config"),
            ("LanguageModel.make_cache", "self"),
            ("LanguageModel.sanitize", "self, weights"),
            ("HyV4Model.__call__", "self, x, cache=None, inputs_embeds=None"),
            ("ModelConfig.from_dict", "params"),
        ],
    )


@lru_cache(maxsize=None)
def _indexer():
    """mlx-vlm's Hy4 indexer, selecting as its DeepSeek-V3.2 indexer does.

    mlx-vlm 0.7.10's ``HyV4Indexer`` picks the top-k keys in a function compiled
    ``shapeless``, which fixes ``argpartition``'s ``kth=-top_k`` to the key count of
    the first call: with any other count (every decode step) it keeps other keys than
    the top k. Its parent's ``__call__`` is the same computation, uncompiled."""
    dsv32 = vlm.need(
        "models.deepseek_v32.language",
        WHAT,
        [("Indexer.__call__", "self, x, qr, mask, cache=None")],
    )
    hy = vlm.need("models.hy_v4.indexer", WHAT, [("HyV4Indexer", "args")])

    class Indexer(hy.HyV4Indexer):
        __call__ = dsv32.Indexer.__call__

    return Indexer


def exact_indexers(layers, args) -> None:
    """Give each of ``layers`` (Hy4 decoder layers) that has an indexer `_indexer`'s
    (same parameters, exact selection)."""
    for layer in layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer = _indexer()(args)


@lru_cache(maxsize=None)
def _drafter():
    return vlm.need(
        "speculative.drafters.hy_v4_mtp.hy_v4_mtp",
        WHAT,
        [
            ("HyV4MTPDecoderLayer", "config, layer_idx"),
            (
                "HyV4MTPDecoderLayer.__call__",
                "self, x, mask=None, cache=None, prev_topk_indices=None",
            ),
        ],
    )


def split_kv_b(weights: dict, args) -> dict:
    """Each float ``self_attn.kv_b_proj.weight`` ``(heads * (nope + v), rank)`` as
    MLA's per-head ``embed_q`` ``(heads, rank, nope)`` and ``unembed_out``
    ``(heads, v, rank)``; one with an MXFP8 ``weight_scale`` (the release's) is
    left to mlx-vlm's sanitize."""
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".self_attn.kv_b_proj.weight")]:
        if key + "_scale" in weights:
            continue
        prefix = key[: -len("kv_b_proj.weight")]
        nope = args.qk_nope_head_dim
        kv = out.pop(key).reshape(args.num_attention_heads, nope + args.v_head_dim, -1)
        out[prefix + "embed_q.weight"] = mx.contiguous(kv[:, :nope].swapaxes(-1, -2))
        out[prefix + "unembed_out.weight"] = mx.contiguous(kv[:, nope:])
    return out


@lru_cache(maxsize=None)
def _trunk_class():
    language = _language()

    class Model(language.LanguageModel):
        """mlx-vlm's Hy4 text model returning logits, with mlx-lm's caches, float
        MLA weights and exact indexers."""

        def __init__(self, config):
            super().__init__(config)
            exact_indexers(self.layers, config)

        def __call__(self, inputs, cache=None, **kwargs):
            """Logits ``(B, L, V)``, as mlx-lm's models return them."""
            return super().__call__(inputs, cache=cache, **kwargs).logits

        def make_cache(self):
            return [
                (
                    CacheList(KVCache())
                    if layer.self_attn.skip_topk
                    # the MLA latent, then the indexer's keys
                    else CacheList(KVCache(), KVCache())
                )
                for layer in self.layers
            ]

        def sanitize(self, weights: dict) -> dict:
            return super().sanitize(split_kv_b(weights, self.args))

    return Model


# The release's dtype: a ModelOpt MXFP8 export (e4m3 bytes with one ue8m0 scale per 32
# inputs, ``weight_scale``; fused experts ``experts.gate_up_proj`` / ``down_proj`` with
# ``*_scale``), which mlx-vlm's sanitize packs as MLX ``mxfp8``.
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}


def fix_config(config: dict) -> dict:
    """A ModelOpt MXFP8 release (no MLX ``quantization``) loads packed: with a
    ``quantization`` entry, mlx-lm's loader quantizes every layer whose sanitized
    tensors come with ``scales``, and the MTP layers are quantized alike."""
    released = config.get("quantization_config") or {}
    modelopt = released.get("quant_method") == "modelopt"
    if modelopt and released.get("quant_algo") == "MXFP8":
        if "quantization" not in config:
            return {"quantization": dict(MXFP8)}
    return {}


def trunk_classes(config: dict):
    return _trunk_class(), _language().ModelConfig


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"model\.mtp_layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """The MTP layers' tensors through the trunk's own fixes (experts stacked and
    fused, ``kv_b_proj`` split), in the schema ``layers.{j}.*``."""
    weights = split_kv_b(weights, trunk.args)
    return sanitize_layers(trunk, weights, config, mtp_layer_of, LAYOUT)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-vlm's Hy4 MTP block (MoE, a full indexer, no
    hyper-connections), as its drafter builds it."""
    args = replace(
        trunk.args,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        moe_layer_freq=1,
        indexer_types=["full"],
    )
    block = _drafter().HyV4MTPDecoderLayer(args, 0)
    exact_indexers([block], args)
    layer = MTPLayer(args.hidden_size, args.rms_norm_eps, block)
    layer.kv_caches = 2
    return layer


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_AS_ARRAY=True,  # MLA adds the mask into its own scores
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    fix_config=fix_config,
)

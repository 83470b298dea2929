"""Hy4 (``hy_v4``, Tencent): a DeepSeek-V3.2-style trunk (MLA with a sparse-attention
indexer on some layers, "shared" layers reusing the last one's selection; a gated
attention output and per-head attention sinks; sigmoid-routed MoE) carried in four
identity hyper-connection streams, and one MTP layer at ``model.mtp_layers.0.*``.

The MTP layer (vLLM's ``HYV4MTP``, SGLang's ``hunyuan_v4_nextn``, mlx-vlm's
``hy_v4_mtp``) fuses as DeepSeek's does, with MiMo's name for its final norm:
``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], a decoder layer of the trunk's kind without
hyper-connection streams (MLA with an indexer of its own, MoE), ``final_layernorm``;
it reads the trunk's hidden state after ``hc_head`` and ``model.norm`` (the streams
collapsed), its embedding and head are the trunk's, and the embedding of position 0
is zeroed (vLLM's ``mtp.py``). It keeps two caches, as DeepSeek-V3.2's does (the MLA
latent and the indexer's keys).

The release (tencent/Hy4-preview, `tests/golden/hy_v4.json`) stores each layer's
routed experts fused (``mlp.experts.gate_up_proj`` (E, 2I, H), ``down_proj``), BF16
or as a ModelOpt MXFP8 export (e4m3 with ``weight_scale`` / ``*_scale``), and each
indexer head as ``[nope | rope]``: RoPE (interleaved) on its last
``qk_rope_head_dim`` dimensions (vLLM, SGLang and transformers agree). The routed
experts clamp their SwiGLU at ``swiglu_limit`` (transformers' ``_apply_gate``); the
shared ones do not.

mlx-lm has no Hy4, so the trunk is mlx-vlm's text model (``mlx_vlm.models.hy_v4``,
the extra ``mlx-mtp[vlm]``) and the MTP block mlx-vlm's ``HyV4MTPDecoderLayer``.
mlx-vlm 0.7.10 reads only the MXFP8 form and differs from the release's references
in three places, so they are used with these changes, by subclassing and at load,
without copying its code:

- its trunk makes mlx-lm's caches (which mlx-mtp rolls back and batches; mlx-vlm's
  ``HyV4KVCache`` only grows its buffer differently);
- float tensors it cannot read are put in its form first (`in_mlx_vlm_form`: a
  float ``kv_b_proj`` split into MLA's ``embed_q`` / ``unembed_out``, float fused
  experts named as its ``switch_mlp``), and each indexer's ``[nope | rope]`` heads
  are permuted to the ``[rope | nope]`` its indexer rotates (as SGLang permutes
  them; the scores are the same dot products);
- its indexers select exactly (`_indexer`: its ``HyV4Indexer`` fixes the top-k's
  ``kth`` to its first call's key count), and its routed experts clamp
  (`ClampedSwiGLU`).

Writing the trunk here instead (as for DeepSeek-V4) would copy mlx-vlm's 700 lines of
attention, routing and expert code for nothing MTP needs.
"""

import re
from dataclasses import replace
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, KVCache

from ..errors import MTPError
from . import mimo, vlm
from .base import sanitize_layers
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


class ClampedSwiGLU(nn.Module):
    """The routed experts' activation: ``silu(min(gate, limit)) * clip(up, ±limit)``
    (called as mlx-vlm's ``SwiGLU``, ``(up, gate)``)."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def __call__(self, up: mx.array, gate: mx.array) -> mx.array:
        gate = mx.minimum(gate, self.limit)
        return nn.silu(gate) * mx.clip(up, -self.limit, self.limit)


def fix_layers(layers, args, limit: Optional[float]) -> None:
    """Give each of ``layers`` (Hy4 decoder layers) an exact indexer (`_indexer`,
    same parameters) where it has one, and routed experts clamped at ``limit``
    (None: unclamped)."""
    for layer in layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer = _indexer()(args)
        experts = getattr(layer.mlp, "switch_mlp", None)
        if experts is not None and limit is not None:
            experts.activation = ClampedSwiGLU(limit)


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


def in_mlx_vlm_form(weights: dict, args) -> dict:
    """Raw Hugging Face tensors as mlx-vlm's sanitize reads them.

    - a float ``self_attn.kv_b_proj.weight`` ``(heads * (nope + v), rank)`` as MLA's
      per-head ``embed_q`` ``(heads, rank, nope)`` and ``unembed_out``
      ``(heads, v, rank)`` (an MXFP8 one, with ``weight_scale``, is its sanitize's);
    - float fused experts ``mlp.experts.{gate_up,down}_proj`` as its
      ``mlp.switch_mlp.*.weight`` (MXFP8 ones, with ``*_scale``, are its sanitize's);
    - each raw layer's indexer heads (``wq_b``, ``wk`` rows and their scales,
      ``k_norm``) from the release's ``[nope | rope]`` to the ``[rope | nope]`` its
      indexer rotates. A layer is raw while it has its ``kv_b_proj``: an MLX
      conversion (split, permuted) passes unchanged.
    """
    out = dict(weights)
    for key in [k for k in weights if k.endswith(".self_attn.kv_b_proj.weight")]:
        prefix = key[: -len("kv_b_proj.weight")]
        for name in [k for k in weights if k.startswith(prefix + "indexer.")]:
            out[name] = _rope_first(out[name], name, args)
        if key + "_scale" in weights:
            continue
        nope = args.qk_nope_head_dim
        kv = out.pop(key).reshape(args.num_attention_heads, nope + args.v_head_dim, -1)
        out[prefix + "embed_q.weight"] = mx.contiguous(kv[:, :nope].swapaxes(-1, -2))
        out[prefix + "unembed_out.weight"] = mx.contiguous(kv[:, nope:])
    for key in [k for k in weights if re.search(r"\.mlp\.experts\.\w+_proj$", k)]:
        if key + "_scale" not in weights:
            prefix, _, name = key.rpartition(".experts.")
            out[f"{prefix}.switch_mlp.{name}.weight"] = out.pop(key)
    return out


def _rope_first(value: mx.array, name: str, args) -> mx.array:
    """An indexer tensor whose rows (``wq_b``: per head) are ``[nope | rope]``, as
    ``[rope | nope]``; other tensors unchanged."""
    if ".wq_b." in name:
        heads = args.index_n_heads
    elif ".wk." in name or ".k_norm." in name:
        heads = 1
    else:
        return value
    rope = args.qk_rope_head_dim
    rows = value.reshape(heads, args.index_head_dim, *value.shape[1:])
    return mx.concatenate([rows[:, -rope:], rows[:, :-rope]], axis=1).reshape(
        value.shape
    )


@lru_cache(maxsize=None)
def _trunk_class(limit: Optional[float]):
    language = _language()

    class Model(language.LanguageModel):
        """mlx-vlm's Hy4 text model returning logits, with mlx-lm's caches, exact
        indexers, clamped routed experts, and the release's float tensors read."""

        def __init__(self, config):
            super().__init__(config)
            fix_layers(self.layers, config, limit)
            # inherited from mlx-vlm's DeepSeek-V3.2 model, which Hy4's forward
            # does not follow (no sends between ranks): refused, not half-run
            self.model.pipeline = _no_pipeline

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
            return super().sanitize(in_mlx_vlm_form(weights, self.args))

    return Model


def _no_pipeline(group) -> None:
    raise MTPError(
        f"{WHAT} runs on one machine: mlx-vlm's trunk cannot be split over ranks"
    )


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
    return _trunk_class(config.get("swiglu_limit")), _language().ModelConfig


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    """The MTP layers' tensors through the trunk's own fixes (`in_mlx_vlm_form`, then
    mlx-vlm's sanitize), in the schema ``layers.{j}.*``."""
    weights = in_mlx_vlm_form(weights, trunk.args)
    return sanitize_layers(trunk, weights, config, mimo.mtp_layer_of, LAYOUT)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-vlm's Hy4 MTP block (MoE, a full indexer, no
    hyper-connections), as its drafter builds it, fixed as the trunk's layers."""
    args = replace(
        trunk.args,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        moe_layer_freq=1,
        indexer_types=["full"],
    )
    block = _drafter().HyV4MTPDecoderLayer(args, 0)
    fix_layers([block], args, config.get("swiglu_limit"))
    layer = MTPLayer(args.hidden_size, args.rms_norm_eps, block)
    layer.kv_caches = 2
    return layer


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,  # vLLM's HYV4 MTP zeroes position 0's embedding
    MASK_AS_ARRAY=True,  # MLA adds the mask into its own scores
    mtp_layer_of=mimo.mtp_layer_of,  # the same place: model.mtp_layers.{j}
    split_weights=mimo.split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    fix_config=fix_config,
)

"""DeepSeek-V4 (``deepseek_v4``: V4-Flash, V4-Pro) and its MTP layer ``mtp.0``.

mlx-lm 0.32 has no V4 trunk, only V4.1's (``deepseek_v41``), whose parts this module
reuses where V4 is the same: the hyper-connection mixing and its Sinkhorn projection,
interleaved RoPE on the trailing ``qk_rope_head_dim`` dims (YaRN with attention factor
1 on compressed layers), the grouped output projection, the clamped SwiGLU experts, the
sqrt-softplus router, its sanitize (DeepSeek's tensor names, expert stacking, FP4 / FP8
repacking) and its tensor-parallel sharding. What V4 does its own way is written here,
from transformers 5.24's ``deepseek_v4`` (the issue's reference) and DeepSeek's
inference code:

- every sub-layer mixes the ``hc_mult`` residual streams with its own hyper-connection
  (pre, post and comb all from that sub-layer's input), and ``hc_head`` collapses them
  before the final norm;
- a compressed layer (ratio r = ``compress_ratios[i]``) pools each block of r positions
  into one K = V entry (`Compressor`: gate + ``ape``, softmax over the block, norm,
  RoPE at the block's start); with r = 4 the entry also pools the previous block's
  first half, and an `Indexer` with a compressor of its own picks each query's
  ``index_topk`` entries; with larger r (HCA) every closed block is seen;
- queries get a per-head unweighted RMS norm; the first ``num_hash_layers`` MoE layers
  route by a fixed token -> experts table (``tid2eid``).

The MTP layer (`MTPLayer`): ``x = e_proj(enorm(embed(t))) + h_proj(hnorm(h))`` per
stream, h being the trunk's streams before ``hc_head``; one window-only V4 block; its
own ``hc_head`` and ``norm``; the trunk's head. ``e_proj`` and ``h_proj`` are fused into
the schema's ``eh_proj`` (exact: ``[W_e | W_h] [e; h] = W_e e + W_h h``). A chained
depth reads the block's output streams, so hidden states here are packed as
``(B, L, (hc_mult + 1) D)``: the streams, then the normed collapse the head reads.
"""

import re
from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v41 as lm

from ..errors import MissingHeadsError, MTPError
from ..private import check_private
from .base import split_mtp
from .deepseek_v4_cache import CompressorState, V4Cache, V4Rows
from .deepseek_v4_quant import MXFP8, expand_release_scales
from .family import Layout, define

# mlx-lm's private helpers of ``deepseek_v41`` that V4 calls, with the parameters it
# calls them with (``*``: the keyword-only ones follow). `check_mlx_lm` compares them
# at import, so that an mlx-lm whose helpers changed fails in one line, not with a
# wrong answer or a TypeError mid-decode.
MLX_LM_PRIVATE = (
    ("_apply_rope", "x, rope, *, rope_dim, offset=0, scale=1.0, inverse=False"),
    ("_window_indices", "*, previous, length, window"),
    ("_sparse_attention", "q, kvs, indices, *, sinks, scale"),
    ("_collapse", "streams, mix"),
    ("_expand", "x, residual, post, comb"),
)


def check_mlx_lm(module=lm) -> None:
    """Refuse, in one `MTPError` line, an mlx-lm whose ``deepseek_v41`` lacks one of
    `MLX_LM_PRIVATE` or has it with other parameters."""
    check_private(
        module,
        MLX_LM_PRIVATE,
        "mlx_lm.models.deepseek_v41",
        "DeepSeek-V4 needs mlx-lm 0.32.x",
    )


check_mlx_lm()

LAYOUT = Layout(
    prefix=lambda config, j: f"mtp.{j}.",
    fusion={"enorm": "enorm", "hnorm": "hnorm", "e_proj": "eh_proj", "norm": "norm"},
    halves=("e_proj", "h_proj"),
)


@dataclass
class ModelArgs(lm.ModelArgs):
    """V4's config (the V4.1 fields it shares, and its own)."""

    model_type: str = "deepseek_v4"
    rms_norm_eps: float = 1e-6
    num_hash_layers: int = 3
    n_shared_experts: int = 1
    num_nextn_predict_layers: int = 1


def _rope(x, rope, offset, scale=1.0, inverse=False):
    return lm._apply_rope(
        x, rope, rope_dim=rope.dims, offset=offset, scale=scale, inverse=inverse
    )


class Compressor(nn.Module):
    """Pools each closed block of ``ratio`` positions into one entry of width ``dim``
    (with ``ratio == 4``, over the block's second half and the previous block's
    first half: the projections are ``2 dim`` wide)."""

    def __init__(self, args: ModelArgs, ratio: int, dim: int):
        super().__init__()
        width = 2 * dim if ratio == 4 else dim
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        self.kv_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.ape = mx.zeros((ratio, width))
        self.kv_norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, state: CompressorState, rope) -> mx.array:
        """Add the pass ``x`` (B, L, D) to ``state``; returns every entry so far
        ``(B, N, dim)``."""
        h = x.astype(mx.float32)
        slots = (state.end + mx.arange(x.shape[1])) % self.ratio
        gate = self.gate_proj(h) + self.ape[slots]
        closed = state.push(self.kv_proj(h), gate)
        if closed is not None:
            state.add(self._pool(*closed, rope))
        if state.entries is None:
            return mx.zeros((x.shape[0], 0, self.dim), dtype=mx.float32)
        return state.entries

    def _pool(self, kv: mx.array, gate: mx.array, first: int, rope) -> mx.array:
        """Entries of blocks ``first ..`` from their rows (``CompressorState.push``)."""
        B, r, d = kv.shape[0], self.ratio, self.dim
        kv = kv.reshape(B, -1, r, kv.shape[-1])  # (B, blocks, r, width)
        gate = gate.reshape(kv.shape)
        if self.overlap:
            if first:  # the rows start with block first - 1
                prev_kv, prev_gate = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
                kv, gate = kv[:, 1:], gate[:, 1:]
            else:  # block 0 has no previous block: weight 0
                pad = (B, 1, r, d)
                prev_kv = mx.concatenate([mx.zeros(pad), kv[:, :-1, :, :d]], axis=1)
                none = mx.full(pad, -mx.inf)
                prev_gate = mx.concatenate([none, gate[:, :-1, :, :d]], axis=1)
            kv = mx.concatenate([prev_kv, kv[..., d:]], axis=2)  # (B, blocks, 2r, d)
            gate = mx.concatenate([prev_gate, gate[..., d:]], axis=2)
        pooled = mx.sum(kv * mx.softmax(gate, axis=2), axis=2)  # (B, blocks, d)
        return _rope(self.kv_norm(pooled), rope, offset=first, scale=r)


def visible_entries(offset: int, length: int, count: int, ratio: int) -> mx.array:
    """``(L, N)``: query ``offset + i`` sees entry w when its block has closed, w <
    (offset + i + 1) // ratio."""
    closed = (offset + 1 + mx.arange(length)) // ratio
    return mx.arange(count)[None] < closed[:, None]


class Indexer(nn.Module):
    """The lightning indexer of an r = 4 layer: each query's ``index_topk`` entries."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.dim = args.index_n_heads, args.index_head_dim
        self.topk = args.index_topk
        self.q_b_proj = nn.Linear(
            args.q_lora_rank, self.num_heads * self.dim, bias=False
        )
        self.weights_proj = nn.Linear(args.hidden_size, self.num_heads, bias=False)
        self.compressor = Compressor(args, 4, self.dim)

    def __call__(
        self, x, q_residual, offset: int, state: CompressorState, rope
    ) -> Optional[mx.array]:
        """``(B, L, topk)`` the entries each query attends to (-1: none), or None
        when there are no more entries than ``topk`` (a query sees every closed
        one)."""
        keys = self.compressor(x, state, rope)  # (B, N, c)
        B, L, N = x.shape[0], x.shape[1], keys.shape[1]
        if N <= self.topk:
            return None
        q = self.q_b_proj(q_residual).reshape(B, L, self.num_heads, self.dim)
        q = _rope(q, rope, offset=offset).astype(mx.float32)
        scores = mx.maximum(q @ keys[:, None].swapaxes(-1, -2), 0.0)  # (B, L, h, N)
        weights = self.weights_proj(x).astype(mx.float32) * self.num_heads**-0.5
        scores = mx.sum(scores * weights[..., None], axis=2) * self.dim**-0.5
        visible = visible_entries(offset, L, N, 4)
        scores = mx.where(visible, scores, -mx.inf)  # (B, L, N)
        top = mx.argpartition(-scores, self.topk - 1, axis=-1)[..., : self.topk]
        top = top.astype(mx.int32)
        seen = mx.take_along_axis(mx.broadcast_to(visible, scores.shape), top, -1)
        return mx.where(seen, top, -1)


class Attention(lm.Attention):
    """V4 attention: shared-K=V MQA over the sliding window and, on compressed
    layers, the compressed entries a query sees; attention sinks; RoPE undone on the
    output; grouped output projection. (V4.1's sub-modules, built without its
    compressors: V4's are `Compressor` and `Indexer`.)"""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__(args, layer_id)
        self.eps, self.window = args.rms_norm_eps, args.sliding_window
        if self.ratio:
            self.compressor = Compressor(args, self.ratio, args.head_dim)
        if self.ratio == 4:
            self.indexer = Indexer(args)

    def __call__(self, x: mx.array, cache: Optional[Any] = None) -> mx.array:
        """A pass over ``x`` (B, L, D) at ``cache.offset`` (a `V4Cache`; in the MTP
        layer, a `mlx_mtp.cache.WindowCache`; None: a pass from position 0; a
        `V4Rows`: each row at its own, `_by_row`)."""
        if isinstance(cache, V4Rows):
            return self._by_row(x, cache)
        cache = V4Cache(self.window, self.ratio) if cache is None else cache
        q_residual, q, kv = self._project(x)
        return self._output(self._attend(x, q_residual, q, kv, cache), x.dtype)

    def _project(self, x: mx.array):
        """The pass's query residual, per-head normed queries ``(B, L, H, d)`` and
        K = V rows ``(B, L, d)``, before RoPE (they read no cache)."""
        B, L, _ = x.shape
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).reshape(B, L, self.num_heads, self.head_dim)
        q = q * mx.rsqrt(
            mx.mean(q.astype(mx.float32) ** 2, -1, keepdims=True) + self.eps
        )
        return q_residual, q, self.kv_norm(self.kv_proj(x))

    def _by_row(self, x: mx.array, rows: V4Rows) -> mx.array:
        """A pass of B streams, each at its own position: the projections and the
        output batched, the part that reads a cache row by row over the row's
        inputs past its left padding (its padded outputs are zeros, seen by no
        other position)."""
        L = x.shape[1]
        q_residual, q, kv = self._project(x)
        outs = []
        for b, (cache, pad) in enumerate(zip(rows.rows, rows.take_padding())):
            part = [mx.zeros((1, pad, self.num_heads, self.head_dim))] if pad else []
            if pad < L:
                mine = (slice(b, b + 1), slice(pad, None))
                args = (x[mine], q_residual[mine], q[mine], kv[mine])
                part.append(self._attend(*args, cache))
            outs.append(mx.concatenate(part, axis=1))
        return self._output(mx.concatenate(outs), x.dtype)

    def _attend(self, x, q_residual, q, kv, cache) -> mx.array:
        """``(B, L, H, d)``: the attention of the pass's queries at ``cache.offset``
        over the window and compressed entries (``cache`` updated), RoPE undone."""
        B, L, _ = x.shape
        offset = cache.offset
        q = _rope(q, self.rope, offset=offset).astype(mx.float32)
        kv = _rope(kv, self.rope, offset=offset)  # (B, L, d)
        window = cache.make_mask(L, return_array=True)  # (L, W), before the update
        held = cache.offset - getattr(cache, "start", 0)  # rows kept before the pass
        keys, _ = cache.update_and_fetch(kv[:, None], kv[:, None, :, :0])
        keys = keys.astype(mx.float32)  # (B, 1, W, d)
        mask = mx.broadcast_to(window, (B, 1, L, keys.shape[2]))
        if self.ratio:
            entries = self.compressor(x, cache.compressed, self.rope)  # (B, N, d)
            top = None
            if self.ratio == 4:
                top = self.indexer(x, q_residual, offset, cache.index, self.rope)
            if top is not None:  # each query its own top-k entries: gather them
                out = self._sparse(q, keys[:, 0], entries, top, held)
                return _rope(out, self.rope, offset=offset, inverse=True)
            seen = visible_entries(offset, L, entries.shape[1], self.ratio)
            seen = mx.broadcast_to(seen, (B, L, entries.shape[1]))[:, None]
            keys = mx.concatenate([keys, entries[:, None]], axis=2)
            mask = mx.concatenate([mask, seen], axis=-1)
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(0, 2, 1, 3),
            keys,
            keys,
            scale=self.head_dim**-0.5,
            mask=mask,
            sinks=self.sinks.astype(mx.float32),
        )  # (B, H, L, d)
        return _rope(out.transpose(0, 2, 1, 3), self.rope, offset=offset, inverse=True)

    def _sparse(self, q, rows, entries, top, held: int) -> mx.array:
        """``(B, L, H, d)``: attention of each query over its window (of ``rows``,
        the ``held`` rows kept before the pass, then the pass's) and its ``top``
        entries, gathered (V4.1's sparse attention): O(window + topk) keys per query
        however many entries there are."""
        B, L = q.shape[:2]
        win = lm._window_indices(previous=held, length=L, window=self.window)
        win = mx.broadcast_to(win, (B, *win.shape))
        return lm._sparse_attention(
            q, [rows, entries], [win, top], sinks=self.sinks, scale=self.head_dim**-0.5
        )

    def _output(self, out: mx.array, dtype) -> mx.array:
        """The grouped output projection of `_attend`'s ``(B, L, H, d)``."""
        B, L = out.shape[:2]
        out = out.astype(dtype).reshape(B * L, self.o_groups, 1, -1)
        out = self.o_a_proj(out, self._group_ids)  # (B L, groups, 1, o_lora_rank)
        return self.o_b_proj(out.reshape(B, L, -1))


def _scores(logits: mx.array, func: str) -> mx.array:
    if func == "sigmoid":
        return mx.sigmoid(logits)
    if func == "softmax":
        return mx.softmax(logits, axis=-1)
    return mx.sqrt(nn.softplus(logits))


class HashRouter(nn.Module):
    """The router of a hash layer: experts ``tid2eid[token]``, weighted by the gate's
    scores, normalised."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        top_k = args.num_experts_per_tok
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.tid2eid = mx.zeros((args.vocab_size, top_k), dtype=mx.int32)
        self.score_func, self.norm = args.scoring_func, args.norm_topk_prob
        self.route_scale = args.routed_scaling_factor

    def __call__(self, x: mx.array, ids: mx.array):
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        scores = _scores(logits, self.score_func)
        chosen = self.tid2eid[ids.reshape(-1)]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm and chosen.shape[-1] > 1:
            weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return chosen, weights * self.route_scale


class MoE(lm.MoE):
    """V4.1's MoE (routed + shared experts, tensor-parallel aware), with a hash router
    on the first ``num_hash_layers`` layers."""

    def __init__(self, args: ModelArgs, hashed: bool):
        super().__init__(args)
        if hashed:
            self.gate = HashRouter(args)

    def __call__(self, x: mx.array, ids: Optional[mx.array] = None) -> mx.array:
        if self.sharding_group is not None:
            x = lm.sum_gradients(self.sharding_group)(x)
        flat = x.reshape(-1, self.dim)
        if isinstance(self.gate, HashRouter):
            indices, weights = self.gate(flat, ids)
        else:
            indices, weights = self.gate(flat)
        out = self.experts(flat, indices, weights)
        out = out + self.shared_experts(flat).astype(mx.float32)
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out.reshape(x.shape).astype(x.dtype)


class DecoderLayer(nn.Module):
    """Attention then MoE, each between its own hyper-connection's collapse and
    expansion of the streams ``(B, L, hc, D)``."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.self_attn = Attention(args, layer_id)
        self.mlp = MoE(args, hashed=layer_id < args.num_hash_layers)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )
        self.attn_hc = lm.HyperConnection(args)
        self.ffn_hc = lm.HyperConnection(args)

    def __call__(self, streams: mx.array, ids: Optional[mx.array], cache) -> mx.array:
        pre, post, comb = self.attn_hc(streams)
        h = self.input_layernorm(lm._collapse(streams, pre))
        streams = lm._expand(self.self_attn(h, cache), streams, post, comb)
        pre, post, comb = self.ffn_hc(streams)
        h = self.post_attention_layernorm(lm._collapse(streams, pre))
        return lm._expand(self.mlp(h, ids), streams, post, comb)


class HyperHead(nn.Module):
    """The final collapse of the streams, weighted by ``sigmoid`` of a projection of
    all of them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        hc = args.hc_mult
        self.fn = mx.zeros((hc, hc * args.hidden_size), dtype=mx.float32)
        self.base = mx.zeros((hc,), dtype=mx.float32)
        self.scale = mx.ones((1,), dtype=mx.float32)
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps

    def __call__(self, streams: mx.array) -> mx.array:
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, weight=None, eps=self.norm_eps)
        pre = mx.sigmoid(flat @ self.fn.T * self.scale + self.base) + self.eps
        return lm._collapse(streams, pre)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.hc_head = HyperHead(args)

    def streams(self, inputs: mx.array, cache: Optional[List[Any]] = None):
        """The last layer's output streams ``(B, L, hc, D)``."""
        cache = cache or make_cache(self.args)
        h = self.embed_tokens(inputs)
        B, L, D = h.shape
        streams = mx.broadcast_to(h[:, :, None], (B, L, self.args.hc_mult, D))
        for layer, layer_cache in zip(self.layers, cache):
            streams = layer(streams, inputs, layer_cache)
        return streams

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None):
        return self.norm(self.hc_head(self.streams(inputs, cache)))


def make_cache(args: ModelArgs) -> List[V4Cache]:
    """One `V4Cache` per trunk layer."""
    ratios = list(args.compress_ratios) + [0] * args.num_hidden_layers
    return [V4Cache(args.sliding_window, r) for r in ratios[: args.num_hidden_layers]]


_HC_HEAD = re.compile(r"(^|\.)hc_head_(fn|base|scale)$")


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = TextModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None):
        return self.lm_head(self.model(inputs, cache))

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self) -> List[V4Cache]:
        return make_cache(self.args)

    shard = lm.Model.shard  # heads, output groups and experts split; the rest whole

    def sanitize(self, weights: dict) -> dict:
        """DeepSeek's names and dtypes to this model's (V4.1's sanitize, with V4's
        ``hc_head``; the release's FP8 128x128 blocks and FP4 experts stay packed, as
        mxfp8 and mxfp4); an MLX conversion passes unchanged."""
        if any(key.startswith("model.") for key in weights):
            return weights
        out = lm.Model.sanitize(self, expand_release_scales(weights))
        return {_HC_HEAD.sub(r"\1hc_head.\2", k): v for k, v in out.items()}

    @property
    def cast_predicate(self):
        keep = ("_hc.", "hc_head.", "sinks", "e_score_correction_bias", "compressor.")

        def predicate(key: str) -> bool:
            return not any(part in key for part in keep) and "tid2eid" not in key

        return predicate


class MTPLayer(nn.Module):
    """V4's MTP layer over packed hidden states (module docstring).

    Attributes:
        window: The block's sliding window (its cache is a `WindowCache`).
    """

    kv_caches = 1

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        D = args.hidden_size
        self.enorm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = DecoderLayer(args, layer_id)
        self.hc_head = HyperHead(args)
        self.norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.window, self.hc = args.sliding_window, args.hc_mult

    def __call__(self, embeddings, hidden, mask=None, cache=None) -> mx.array:
        """``(B, L, D)`` embeddings of t_{i+1} and packed ``hidden`` at i -> the
        packed output (the mask comes from ``cache``, a `WindowCache`)."""
        B, L, D = embeddings.shape
        streams = hidden[..., : self.hc * D].reshape(B, L, self.hc, D)
        e = mx.broadcast_to(self.enorm(embeddings)[:, :, None], streams.shape)
        x = self.eh_proj(mx.concatenate([e, self.hnorm(streams)], axis=-1))
        y = self.block(x, None, cache)
        return _pack(y, self.norm(self.hc_head(y)))


def _pack(streams: mx.array, out: mx.array) -> mx.array:
    """``(B, L, hc, D)`` streams and their ``(B, L, D)`` normed collapse, packed."""
    flat = streams.reshape(*streams.shape[:2], -1)
    return mx.concatenate([flat, out.astype(flat.dtype)], axis=-1)


def fix_config(config: dict) -> dict:
    """A release (FP8 ``quantization_config``, no MLX ``quantization``) loads packed:
    with a ``quantization`` entry, mlx-lm's loader quantizes each layer whose tensors
    come with ``.scales``, in the mode it infers from them (mxfp8 or mxfp4)."""
    released = config.get("quantization_config") or {}
    if released.get("quant_method") == "fp8" and "quantization" not in config:
        return {"quantization": dict(MXFP8)}
    return {}


def trunk_classes(config: dict):
    return Model, ModelArgs


def hidden(trunk: Model, inputs: mx.array, cache=None) -> mx.array:
    """Packed ``(B, L, (hc + 1) D)``: the last layer's streams and the head's input."""
    model = trunk.model
    streams = model.streams(inputs, cache)
    return _pack(streams, model.norm(model.hc_head(streams)))


def logits(trunk: Model, h: mx.array) -> mx.array:
    return trunk.lm_head(h[..., -trunk.args.hidden_size :])


def head(trunk: Model) -> nn.Module:
    """The projection `logits` applies to the last ``hidden_size`` entries."""
    return trunk.lm_head


def hidden_width(args: ModelArgs) -> int:
    return (args.hc_mult + 1) * args.hidden_size


def mtp_layer_of(key: str, config: dict) -> Optional[int]:
    m = re.match(r"mtp\.(\d+)\.", key)
    return int(m[1]) if m else None


def split_weights(weights: dict, config: dict):
    return split_mtp(weights, config, mtp_layer_of)


_FUSION = {"enorm": "enorm", "hnorm": "hnorm", "norm": "norm", "hc_head": "hc_head"}


def sanitize(weights: dict, config: dict, trunk: Model, raw: bool = True) -> dict:
    """``mtp.{j}.*`` to ``layers.{j}.*``: the block's tensors through the trunk's own
    sanitize, ``e_proj`` and ``h_proj`` fused into ``eh_proj``."""
    out = {}
    for j in sorted({mtp_layer_of(k, config) for k in weights}):
        prefix = f"mtp.{j}."
        local = {
            "layers.0." + k[len(prefix) :]: v
            for k, v in weights.items()
            if k.startswith(prefix)
        }
        try:
            local = trunk.sanitize(local)
        except MTPError as e:  # name the tensor as the checkpoint does
            raise MTPError(re.sub(r"^layers\.0\.", prefix, str(e))) from None
        for key, value in local.items():
            name = key[len("model.layers.0.") :]
            head = name.split(".")[0]
            if head in _FUSION:
                dest = _FUSION[head]
            else:
                dest = head if head in LAYOUT.halves else "block." + head
            out[f"layers.{j}.{dest}{name[len(head):]}"] = value
        _fuse(out, j)
    return out


def _fuse(out: dict, j: int) -> None:
    """``layers.{j}.{e,h}_proj.*`` -> ``layers.{j}.eh_proj.*`` (along the input, which
    keeps quantized weights exact: their groups do not straddle the halves).

    Raises:
        MissingHeadsError: the halves' shapes differ.
    """
    e, h = (f"layers.{j}.{half}." for half in LAYOUT.halves)
    for key in [k for k in out if k.startswith(e)]:
        part = key[len(e) :]
        if h + part not in out:
            return  # loading then names the missing eh_proj
        halves = [out.pop(e + part), out.pop(h + part)]
        if halves[0].shape != halves[1].shape:
            ours, theirs = (f"mtp.{j}.{n}.{part}" for n in LAYOUT.halves)
            raise MissingHeadsError(
                f"{ours} has shape {tuple(halves[0].shape)} but {theirs}'s is "
                f"{tuple(halves[1].shape)}: the MTP layer is damaged or from "
                "another model"
            )
        out[f"layers.{j}.eh_proj.{part}"] = mx.concatenate(halves, axis=-1)


def make_layer(trunk: Model, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    layer_id = args.num_hidden_layers + j
    if len(args.compress_ratios) > layer_id and args.compress_ratios[layer_id]:
        raise MissingHeadsError(
            f"MTP layer {j} has compress ratio {args.compress_ratios[layer_id]}; "
            "DeepSeek-V4's MTP layers attend to their sliding window only"
        )
    return MTPLayer(args, layer_id)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,
    MASK_AS_ARRAY=True,
    EMBEDDING_KEY="embed.weight",
    FINAL_NORM_KEY="norm.weight",
    mtp_layer_of=mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    trunk_classes=trunk_classes,
    fix_config=fix_config,
    hidden=hidden,
    logits=logits,
    head=head,
    hidden_width=hidden_width,
)

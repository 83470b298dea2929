"""Gemma 4's MTP drafters, the "assistants" (``gemma4_assistant``, and
``gemma4_unified_assistant`` for ``gemma4_unified`` targets).

An assistant is a separate small checkpoint: a few Gemma 4 text layers, every one
KV-shared, so it has no KV cache of its own. Each layer attends, with its queries only
and with no causal mask, to the target's keys and values of the target's last
non-KV-shared layer of the same type (full or sliding attention). One draft step, at
the constant position p of the newest committed token t_p (not yet run through the
target):

    x = pre_projection(concat(target_embed(t_p) * sqrt(H), h))   # (B, L, 2 H) -> H_d
    y = norm(layers(x, K/V of the target's positions < p))       # queries at p
    logits = tied_head(y) | centroid_head(y)                     # never soft-capped
    h' = post_projection(y)                                      # to the target's H

``h`` is the target's post-norm last hidden state at p - 1 for the first step, then
``h'``; the token is the one just drafted. Sliding layers see the last ``W + 1``
positions (transformers' bidirectional window ``|q - kv| <= W``, flipped). Drafted
tokens are never written to any cache.

This follows transformers' ``Gemma4AssistantForCausalLM`` and its
``SinglePositionMultiTokenCandidateGenerator``, with one deliberate difference: after a
rejection transformers hands the assistant the verify pass's K/V, rejected drafts
included, for positions up to p; here it reads only committed positions (< p), which
is what it reads after a round with every draft accepted.

The decoder layers are mlx-lm's own (`mlx_lm.models.gemma4_text.DecoderLayer`), built
from a config read with transformers' defaults (`text_args`).
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from .gemma4 import hf_text_config

ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")

# The target model types each assistant type is trained for.
TARGET_TYPES = {
    "gemma4_assistant": ("gemma4", "gemma4_text"),
    "gemma4_unified_assistant": ("gemma4_unified", "gemma4_unified_text"),
}


def text_args(text_config: dict) -> gemma4_text.ModelArgs:
    """mlx-lm's args for an assistant's text config (transformers' defaults; every
    layer KV-shared, no per-layer inputs, no MoE, no double-wide MLP, as transformers
    validates)."""
    cfg = hf_text_config(text_config)
    cfg.update(
        num_kv_shared_layers=cfg["num_hidden_layers"],
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
    )
    return gemma4_text.ModelArgs.from_dict(cfg)


class CentroidHead(nn.Module):
    """E2B/E4B's sparse head (transformers' ``Gemma4AssistantMaskedEmbedder``).

    The vocabulary is split into ``num_centroids`` clusters of ``V / num_centroids``
    tokens (``token_ordering``, cluster-major). The top ``top_k`` clusters by centroid
    score are scored with the tied head's rows; every other token gets the smallest
    selected logit minus 1, as the reference does (per row here; the reference takes
    the minimum over the whole batch, the same for one row).
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, k: int):
        super().__init__()
        self.num_centroids, self.top_k, self.vocab_size = num_centroids, k, vocab_size
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab_size,), dtype=mx.int32)

    def __call__(self, y: mx.array, head: nn.Module) -> mx.array:
        """``(B, L, H_d)`` assistant outputs -> ``(B, L, V)`` logits, ``head`` the tied
        embedding (float or quantized)."""
        B, L, _ = y.shape
        scores = self.centroids(y)  # (B, L, C)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        clusters = self.token_ordering.reshape(self.num_centroids, -1)  # (C, V / C)
        ids = clusters[top].reshape(B, L, -1)  # (B, L, top_k * V / C)
        rows = _rows(head, ids.reshape(-1)).reshape(*ids.shape, -1)  # (B, L, S, H_d)
        picked = (rows @ y[..., None]).squeeze(-1)  # (B, L, S)
        floor = picked.min(axis=-1, keepdims=True) - 1
        out = mx.broadcast_to(floor, (B, L, self.vocab_size))
        return mx.put_along_axis(out, ids, picked, axis=-1)


def _rows(head: nn.Module, ids: mx.array) -> mx.array:
    """Rows ``ids`` of an embedding's ``(V, H)`` weight, dequantized if need be."""
    if not hasattr(head, "scales"):
        return head.weight[ids]
    biases = getattr(head, "biases", None)
    return mx.dequantize(
        head.weight[ids],
        head.scales[ids],
        None if biases is None else biases[ids],
        group_size=head.group_size,
        bits=head.bits,
        mode=getattr(head, "mode", "affine"),
    )


class AssistantStack(nn.Module):
    """The assistant's text stack (Hugging Face prefix ``model.``)."""

    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Assistant(nn.Module):
    """A Gemma 4 assistant. Parameter names are the Hugging Face ones (``model.*``,
    ``pre_projection``, ``post_projection``, ``masked_embedding.*``); the tied
    ``lm_head`` is ``model.embed_tokens``.

    Args:
        config: The assistant's ``config.json`` (``text_config``,
            ``backbone_hidden_size``, ``use_ordered_embeddings``, ``num_centroids``,
            ``centroid_intermediate_top_k``).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.model_type = config.get("model_type", "gemma4_assistant")
        self.args = text_args(config.get("text_config") or {})
        self.backbone_hidden_size = config["backbone_hidden_size"]
        H, H_d = self.backbone_hidden_size, self.args.hidden_size
        self.model = AssistantStack(self.args)
        self.pre_projection = nn.Linear(2 * H, H_d, bias=False)
        self.post_projection = nn.Linear(H_d, H, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = CentroidHead(
                H_d,
                self.args.vocab_size,
                config.get("num_centroids", 2048),
                config.get("centroid_intermediate_top_k", 32),
            )

    @property
    def layer_types(self) -> Tuple[str, ...]:
        return tuple(self.args.layer_types)

    @property
    def window(self) -> int:
        """Positions a sliding layer reads: ``W + 1``."""
        return self.args.sliding_window + 1

    def __call__(
        self,
        embeddings: mx.array,
        hidden: mx.array,
        kv: Dict[str, Tuple[mx.array, mx.array]],
        position: int,
        masks: Optional[Dict[str, mx.array]] = None,
    ) -> Tuple[mx.array, mx.array]:
        """Draft steps for L queries at positions ``position .. position + L - 1``.

        Args:
            embeddings: ``(B, L, H)`` the target's scaled embeddings of the tokens.
            hidden: ``(B, L, H)`` target hidden states (or the previous step's ``h'``).
            kv: Layer type -> the target's ``(B, n_kv, T, D)`` keys and values.
            position: RoPE position of the first query.
            masks: Layer type -> ``(L, T)`` bool mask; None: every query sees every
                entry (one decode step, ``kv`` already cut to what it reads).
        Returns:
            ``(B, L, V)`` logits and ``(B, L, H)`` ``h'``.
        """
        masks = masks or {}
        x = self.pre_projection(mx.concatenate([embeddings, hidden], axis=-1))
        for layer in self.model.layers:
            kind = layer.layer_type
            x, _, _ = layer(
                x, masks.get(kind), None, shared_kv=kv[kind], offset=position
            )
        y = self.model.norm(x)  # (B, L, H_d)
        if "masked_embedding" in self:
            logits = self.masked_embedding(y, self.model.embed_tokens)
        else:
            logits = self.model.embed_tokens.as_linear(y)
        return logits, self.post_projection(y)

    def dense_logits(self, y: mx.array) -> mx.array:
        """The tied head over the whole vocabulary (for measurements)."""
        return self.model.embed_tokens.as_linear(y)


def sanitize(weights: dict, config: dict) -> dict:
    """Hugging Face assistant tensors -> `Assistant`'s: the tied ``lm_head`` and the
    unused K/V projections and norms of the (all KV-shared) layers are dropped,
    ``token_ordering`` becomes int32."""
    out = {}
    for key, value in weights.items():
        if key == "lm_head.weight" or "rotary_emb" in key:
            continue
        if any(f".self_attn.{p}." in key for p in ("k_proj", "v_proj", "k_norm")):
            continue
        if key.endswith("token_ordering"):
            value = value.astype(mx.int32)
        out[key] = value
    return out


def reads(target_args) -> Dict[str, int]:
    """Layer type -> index of the target's last non-KV-shared layer of that type,
    whose keys and values the assistant reads (also its cache index: mlx-lm makes
    caches for the non-shared layers only, in order)."""
    shared = getattr(target_args, "num_kv_shared_layers", 0) or 0
    first_shared = target_args.num_hidden_layers - shared
    out = {}
    for i, kind in enumerate(target_args.layer_types[:first_shared]):
        out[kind] = i
    return out

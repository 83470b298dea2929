"""DFlash block drafters (``DFlashDraftModel``, z-lab's) and DFlash2 ones
(``DFlash2DraftModel``: z-lab's Qwen3.8-27B-DFlash2 and its kin), as mlx-vlm 0.7.10's
``qwen3_dflash`` and ``dflash2`` drafters and vLLM's ``qwen3_dflash2`` (PR #52816)
define them.

DFlash is DSpark without the Markov and confidence heads: the same context rows
``hidden_norm(fc(taps))``, the same non-causal block over them, but the block is
``[a, M, ..., M]`` of ``block_size`` rows whose first output is dropped (gamma =
``block_size - 1`` proposals, DSpark's ``sample_from_anchor`` false) and each slot is
drawn from its own logits, soft-capped at ``final_logit_softcapping`` when set.

DFlash2 adds two things, both read here from mlx-vlm's code and an independent torch
reference of the release's numerics:

- around each layer's attention and MLP, a grouped dynamic causal convolution over
  the block's rows: ``kernel_projection`` of the layer's normed input gives per row
  and per channel group two kernels of ``conv_kernel_size`` taps (added to
  ``base_kernel``), the first applied to the normed input before the sublayer, the
  second to the sublayer's output; tap o reads the row o places before (zeros
  before the block's first row, the anchor). Context rows are never convolved;
- a candidate selector instead of a Markov head: slot k keeps the
  ``selector_top_k`` tokens c of highest logit z_k(c) and scores each
  ``z_k(c) + sum_r P[prev_k]_r * (W_h g_k)_r * S[c]_r`` (``predecessor_codebook``
  P, ``successor_codebook`` S, ``hidden_projection`` W_h, ``prev_k`` the token
  drawn at slot k-1, the anchor at slot 0). The slot is drawn from those scores
  (argmax when greedy): its q is their softmax over the candidates, zero
  elsewhere, which is what `slot` returns as logits (-inf off the candidates), so
  rejection sampling stays exact.

Its logits are ``lm_head(g) * output_multiplier``, soft-capped when set; the
embedding is the target's (with its own scale: Gemma's sqrt(H)) times
``input_embedding_scale``. In both, sliding-window layers attend to the last
``sliding_window - 1`` context rows (mlx-vlm's rule; the torch reference's per-query
window differs by at most gamma rows past the window), full ones to all, each
capped by ``draft_window_size``.

Gemma 4's DFlash drafters (z-lab's ``gemma-4-*-DFlash``, mlx-vlm's ``gemma4_dflash``,
dflash-mlx's Gemma path) are DFlash drafters of the same Qwen3-style layers whose
config names the target's ``model_type`` (``gemma4``), may leave the mask token out
(Gemma's ``<mask>``, 4) and mixes sliding and full layers.
"""

from dataclasses import replace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..errors import MTPError
from . import dspark

# dflash_config keys of DFlash2 alone (mlx-vlm's DFlash2Config.from_dict)
OWN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def kind(config: dict) -> Optional[str]:
    """``"DFlash2"``, ``"DFlash"``, or None for a drafter ``config.json`` of
    neither (a DSpark one, say), by mlx-vlm's rule (``get_model_type``): a
    ``dflash_config`` names a DFlash drafter unless it is DSpark's (``projector_type``
    "dspark", a Markov head, or a DSpark architecture), whatever ``model_type``
    (Gemma 4's DFlash drafters say ``gemma4``)."""
    names = config.get("architectures") or ()
    nested = config.get("dflash_config")
    if "DFlash2DraftModel" in names or (
        isinstance(nested, dict) and all(k in nested for k in OWN_KEYS)
    ):
        return "DFlash2"
    if "DFlashDraftModel" in names:
        return "DFlash"
    if not isinstance(nested, dict) or any(a in dspark.ARCHITECTURES for a in names):
        return None
    markov = nested.get("markov_rank") or config.get("markov_rank") or 0
    return None if nested.get("projector_type") == "dspark" or markov else "DFlash"


class DynamicConv(nn.Module):
    """A grouped dynamic causal convolution over a block's rows (see the module
    docstring): ``base_kernel`` ``(2, K, H)``, ``kernel_projection`` ``H -> 2 K G``
    for G groups of ``group`` channels."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * groups, bias=False
        )

    def prepare(self, h: mx.array):
        """``h`` ``(B, R, H)`` a layer's normed block rows -> the first kernel
        applied to them, and the second kernel ``(B, R, K, H)`` for `finish`."""
        B, R, H = h.shape
        two, K, _ = self.base_kernel.shape
        d = self.kernel_projection(h).reshape(B, R, two, K, H // self.group_size)
        kernels = (
            mx.repeat(d, self.group_size, axis=-1) + self.base_kernel
        )  # (B,R,2,K,H)
        return self.apply(h, kernels[:, :, 0]), kernels[:, :, 1]

    @staticmethod
    def apply(x: mx.array, kernel: mx.array) -> mx.array:
        """``sum_o kernel[:, :, o] * x`` shifted down o rows (zeros above the
        block): ``x`` ``(B, R, H)``, ``kernel`` ``(B, R, K, H)``."""
        R = x.shape[1]
        out = kernel[:, :, 0] * x
        for o in range(1, min(kernel.shape[2], R)):
            shifted = mx.concatenate([mx.zeros_like(x[:, :o]), x[:, : R - o]], axis=1)
            out = out + kernel[:, :, o] * shifted
        return out.astype(x.dtype)

    finish = apply


class CandidateSelector(nn.Module):
    """The top-k candidates' scores (see the module docstring)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def __call__(self, z: mx.array, prev: mx.array, g: mx.array, rows=None):
        """``(B, C)`` slot logits over C columns (token ids ``rows``, or all), the
        ``(B,)`` previous tokens and ``(B, H)`` the slot's outputs -> ``(B, C)``
        scores on the top-k columns, -inf on the others."""
        k = min(self.top_k, z.shape[-1])
        columns = mx.argpartition(-z, k - 1, axis=-1)[:, :k]  # (B, k)
        ids = columns if rows is None else rows[columns]
        e = self.predecessor_codebook(prev) * self.hidden_projection(g)  # (B, r)
        edges = (e[:, None] * self.successor_codebook(ids)).sum(axis=-1)  # (B, k)
        scores = mx.take_along_axis(z, columns, axis=-1) + edges
        out = mx.full(z.shape, -mx.inf, dtype=scores.dtype)
        return mx.put_along_axis(out, columns, scores, axis=-1)


class DFlash(dspark.DSpark):
    """A DFlash drafter (parameter names as released; see the module docstring).
    ``spec.block_size`` is gamma = ``block_size - 1``: the anchor row's output is
    dropped (``sample_from_anchor`` false)."""

    WHERE = "the DFlash drafter"

    def __init__(self, config: dict, own_embed: bool = False, own_head: bool = False):
        self.check(config)
        plain = {k: v for k, v in config.items() if k != "dflash_config"}
        plain["dflash_config"] = {
            k: v
            for k, v in (config.get("dflash_config") or {}).items()
            if k in ("mask_token_id", "target_layer_ids", "num_target_layers")
        }
        plain["block_size"] = dspark.draft_key(config, "block_size")
        for key in ("markov_rank", "enable_confidence_head"):
            plain.pop(key, None)
        super().__init__(plain, own_embed, own_head)
        self.spec = replace(
            self.spec, block_size=self.spec.block_size - 1, sample_from_anchor=False
        )
        where = self.WHERE
        self.input_embedding_scale = dspark.number(
            config, "input_embedding_scale", where, 1
        )
        self.output_multiplier = dspark.number(config, "output_multiplier", where, 1)
        # read from the whole config: DFlash2 releases nest them in dflash_config
        self.softcap = dspark.number(config, "final_logit_softcapping", where, None)
        self.windows = dspark.windows_of(config, where)

    @classmethod
    def check(cls, config: dict) -> None:
        """One-line errors for a config mlx-mtp cannot run as its references do: a
        causal block, attention sinks, a sliding layer without its window."""
        where = cls.WHERE
        if dspark.draft_key(config, "is_causal", False) or dspark.draft_key(
            config, "causal", False
        ):
            raise MTPError(
                f"{where} drafts causal blocks; mlx-mtp runs non-causal ones"
            )
        if dspark.draft_key(config, "attention_sink_bias", False):
            raise MTPError(f"{where} has attention sinks, which mlx-mtp does not run")
        if config.get("hidden_act", "silu") != "silu":
            raise MTPError(
                f"{where}: hidden_act {config.get('hidden_act')!r} is not silu"
            )
        if not isinstance(config.get("hidden_size"), int):
            raise MTPError(f"{where}: hidden_size must be a whole number")
        dspark.whole(config, "block_size", where, least=2)
        dspark.windows_of(config, where)

    def block(self, x: mx.array, context, position) -> mx.array:
        """`DSpark.block` after scaling the target's embeddings ``x`` of the block's
        rows by ``input_embedding_scale``."""
        if self.input_embedding_scale != 1:
            x = x * self.input_embedding_scale
        return super().block(x, context, position)

    def slot(self, z: mx.array, prev: mx.array, g: mx.array, state, w2=None, rows=None):
        """A slot's logits over ``z``'s columns: ``z`` scaled and soft-capped; no
        state."""
        if self.output_multiplier != 1:
            z = z * self.output_multiplier
        return super().slot(z, prev, g, state)


class DFlash2(DFlash):
    """A DFlash2 drafter: `DFlash` with each layer's sublayers inside dynamic
    convolutions and a candidate selector (see the module docstring)."""

    WHERE = "the DFlash2 drafter"

    def __init__(self, config: dict, own_embed: bool = False, own_head: bool = False):
        super().__init__(config, own_embed, own_head)
        where, H = self.WHERE, self.args.hidden_size
        K = dspark.whole(config, "conv_kernel_size", where)
        group = dspark.whole(config, "conv_group_size", where)
        for layer in self.layers:
            layer.attention_conv = DynamicConv(H, K, group)
            layer.mlp_conv = DynamicConv(H, K, group)
        self.candidate_selector = CandidateSelector(
            self.args.vocab_size,
            dspark.whole(config, "selector_rank", where),
            H,
            dspark.whole(config, "selector_top_k", where),
        )

    @classmethod
    def check(cls, config: dict) -> None:
        """`DFlash.check`, and a hidden size the convolutions' groups divide and a
        selector no wider than the vocabulary."""
        super().check(config)
        where = cls.WHERE
        H, V = config["hidden_size"], config.get("vocab_size")
        group = dspark.whole(config, "conv_group_size", where)
        dspark.whole(config, "conv_kernel_size", where)
        dspark.whole(config, "selector_rank", where)
        if H % group:
            raise MTPError(f"{where}: conv_group_size {group} does not divide {H}")
        top_k = dspark.whole(config, "selector_top_k", where)
        if isinstance(V, int) and top_k > V:
            raise MTPError(
                f"{where}: selector_top_k {top_k} exceeds the vocabulary {V}"
            )

    def block(self, x: mx.array, context, position) -> mx.array:
        """`DSpark.block` with each layer's sublayers inside its two convolutions;
        ``x`` the target's embeddings of the block's rows."""
        if self.input_embedding_scale != 1:
            x = x * self.input_embedding_scale
        for layer, seen in zip(self.layers, context):
            conv = layer.attention_conv
            h, kernel = conv.prepare(layer.input_layernorm(x))
            x = x + conv.finish(
                self._attend(layer.self_attn, h, seen, position), kernel
            )
            conv = layer.mlp_conv
            h, kernel = conv.prepare(layer.post_attention_layernorm(x))
            x = x + conv.finish(layer.mlp(h), kernel)
        return self.norm(x[:, -self.block_size :])

    def slot(self, z: mx.array, prev: mx.array, g: mx.array, state, w2=None, rows=None):
        """A slot's logits over ``z``'s columns (token ids ``rows``, or all): the
        selector's scores of its candidates, -inf elsewhere; no state."""
        z, state = super().slot(z, prev, g, state)
        return self.candidate_selector(z, prev, g, rows), state


def drafter_class(config: dict):
    """`DFlash2`, `DFlash`, or None for a drafter config of neither kind."""
    return {"DFlash2": DFlash2, "DFlash": DFlash}.get(kind(config))

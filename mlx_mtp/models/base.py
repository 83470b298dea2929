"""The model interface the decode loop relies on, and the wrapper that provides it.

`Model` holds an mlx-lm trunk (built by mlx-lm's own class for the `model_type`) and an
`MTPStack`. It returns logits and hidden states and never samples:

- ``hidden(inputs, cache)``: ``(B, L, H)`` trunk hidden states **after** the final norm,
  the state every MTP family is trained on;
- ``logits(h)``: the shared head, ``(..., H) -> (..., V)``;
- ``mtp_forward(j, hidden, tokens, cache)``: MTP layer j over rows (hidden at i, token
  at i+1), returning its ``(B, L, H)`` post-norm outputs;
- ``__call__(inputs, cache)``: plain trunk logits, so mlx-lm's loops run on it
  unchanged;
- ``assist(tokens, hidden, kv, position)``: with a separate drafter (a Gemma 4
  assistant, `mlx_mtp.models.gemma4_assistant`) instead of MTP layers, one draft step
  of it, reading the target's K/V ``kv``;
- ``draft_context(h, caches)`` / ``draft_block(anchor, context, position)``: with a
  block drafter (DSpark, `mlx_mtp.models.dspark`), its context rows and its block
  pass. ``hidden`` then packs the tapped layers before the post-norm state:
  ``[taps (n * H) ; h (H)]``, and ``logits`` reads the last H.

A family module supplies what differs: which tensors are MTP tensors, how their Hugging
Face names map to `layers.{j}.*`, which decoder block the heads use, and whether the
embedding of the first MTP row is zeroed (vLLM's convention for DeepSeek, GLM and MiMo).
"""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..rows import RowReads, by_rows, each_row
from .capture import install_taps
from .mtp import MTPStack


def trunk_hidden(trunk: nn.Module, inputs: mx.array, cache: Optional[List[Any]]):
    """Post-final-norm hidden states of an mlx-lm `Model` whose `.model` returns
    them."""
    return trunk.model(inputs, cache)


def trunk_logits(trunk: nn.Module, h: mx.array) -> mx.array:
    """Apply the trunk's head to post-norm hidden states, as its `__call__` does."""
    if hasattr(trunk, "lm_head"):
        return trunk.lm_head(h)
    return trunk.model.embed_tokens.as_linear(h)


def trunk_head(trunk: nn.Module) -> nn.Module:
    """The module whose ``(V, H)`` weight `trunk_logits` projects with."""
    return trunk.lm_head if hasattr(trunk, "lm_head") else trunk.model.embed_tokens


class RowsHead:
    """An output projection restricted to some of its rows: ``(..., H) -> (..., V')``.

    The rows (and, for a quantized head, their scales and biases) are gathered once, so
    a draft step reads V' rows instead of V.
    """

    def __init__(self, head: nn.Module, rows: mx.array):
        self.weight = head.weight[rows]
        self.quantized = None
        if hasattr(head, "scales"):
            biases = getattr(head, "biases", None)
            self.quantized = dict(
                scales=head.scales[rows],
                biases=None if biases is None else biases[rows],
                group_size=head.group_size,
                bits=head.bits,
                mode=getattr(head, "mode", "affine"),
            )
        mx.eval(self.weight, self.quantized)

    def __call__(self, h: mx.array) -> mx.array:
        if self.quantized is None:
            return h @ self.weight.T
        return mx.quantized_matmul(h, self.weight, transpose=True, **self.quantized)


def expand(logits: mx.array, rows: mx.array, vocab_size: int) -> mx.array:
    """``(..., V')`` logits over the token ids ``rows`` -> ``(..., V)``, -inf
    elsewhere."""
    full = mx.full((*logits.shape[:-1], vocab_size), -mx.inf, dtype=logits.dtype)
    full[..., rows] = logits
    return full


def trunk_embed(trunk: nn.Module, ids: mx.array) -> mx.array:
    """Token embeddings of the trunk, shared with the MTP layers."""
    return trunk.model.embed_tokens(ids)


def trunk_final_norm(trunk: nn.Module) -> nn.Module:
    """The final norm of an mlx-lm `Model` whose `.model` ends with ``norm``."""
    return trunk.model.norm


class Model(nn.Module):
    """An mlx-lm trunk with its MTP layers attached.

    Args:
        trunk: The mlx-lm model for the checkpoint's ``model_type``.
        mtp: The MTP layers (possibly empty: plain decoding only).
        family: The family's hooks (`mlx_mtp.models.family.Family`).
        source: The folder the weights were loaded from, if any.
        assistant: A separate drafter reading the trunk's caches, and ``reads``, layer
            type -> the trunk cache index whose K/V it reads (see `attach`).
        drafter: A block drafter with its own context caches (see `attach_drafter`),
            fed by ``taps`` of the trunk's layers.
    """

    def __init__(
        self, trunk: nn.Module, mtp: MTPStack, family, source: Optional[Path] = None
    ):
        super().__init__()
        self.trunk = trunk
        self.mtp = mtp
        self.family = family
        self.source = source
        self.model_type = trunk.model_type
        self.round_costs = None  # measured by `mlx_mtp.draft_length.model_costs`
        self.assistant = None
        self.reads: Dict[str, int] = {}
        self.assistant_source: Optional[Path] = None
        self.drafter = None
        self.drafter_source: Optional[Path] = None
        self.taps = None  # `mlx_mtp.models.capture.Taps` a drafter reads
        self.group = None  # the ranks the trunk is sharded over (mlx_mtp.distributed)
        self.sharding: Optional[str] = None  # "tensor" or "pipeline" when sharded
        self.vocab_ranking = None  # `mlx_mtp.draft_vocab.Ranking`, once known

    def attach(self, assistant: nn.Module, reads: Dict[str, int], source=None):
        """Draft with ``assistant`` (it replaces any MTP layers)."""
        self.assistant, self.reads = assistant, dict(reads)
        self.assistant_source = source
        self.mtp = MTPStack([])
        self.round_costs = None

    def attach_drafter(self, drafter: nn.Module, source=None):
        """Draft with the block drafter ``drafter`` (it replaces any MTP layers); the
        trunk's layers it reads record what it reads (its ``TAPS``) from now on."""
        self.drafter, self.drafter_source = drafter, source
        ids = drafter.spec.target_layer_ids
        layers = self.trunk.layers
        if self.sharding == "pipeline":  # those are this rank's: index them all
            layers = self.trunk.model.layers
        self.taps = install_taps(layers, ids, drafter.TAPS)
        self.mtp = MTPStack([])
        self.round_costs = None

    @property
    def num_mtp_layers(self) -> int:
        """Draft layers with a cache row each; an assistant counts as one (it chains
        itself and keeps no rows), and so does a block drafter (its context rows
        move as one MTP layer's)."""
        if self.assistant is not None or self.drafter is not None:
            return 1
        return len(self.mtp.layers)

    @property
    def max_draft(self) -> Optional[int]:
        """The most drafts one round can make (a block drafter's gamma), or None."""
        return None if self.drafter is None else self.drafter.block_size

    @property
    def args(self):
        """The text model's args (hidden_size, max_position_embeddings, ...)."""
        return self.family.text_args(self.trunk)

    @property
    def hidden_width(self) -> int:
        """The last axis of `hidden` (the family's ``hidden_width``, and a block
        drafter's taps before it)."""
        taps = 0 if self.drafter is None else self.drafter.tap_width
        return taps + self.family.hidden_width(self.args)

    @property
    def layers(self):
        return self.trunk.layers

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None):
        return self.trunk(inputs, cache=cache)

    def hidden(self, inputs: mx.array, cache: Optional[List[Any]] = None) -> mx.array:
        if by_rows(cache):  # a trunk whose passes take one stream (`mlx_mtp.rows`)
            return each_row(self.hidden, inputs, cache)
        h = self.family.hidden(self.trunk, inputs, cache)
        if self.taps is None:
            return h
        group = self.group if self.sharding == "pipeline" else None
        taps = self.taps.collect(h, group)
        return mx.concatenate([taps, h], axis=-1)  # (B, L, n H + H)

    def logits(self, h: mx.array) -> mx.array:
        if self.taps is not None:
            h = h[..., -self.family.hidden_width(self.args) :]
        return self.family.logits(self.trunk, h)

    def draft_context(self, h: mx.array, caches: List[Any]) -> None:
        """Append a block drafter's context rows for the packed hidden states ``h``
        ``(B, m, hidden_width)`` of committed positions to its ``caches``."""
        if by_rows(caches):  # a drafter whose passes take one stream
            each_row(self.draft_context, h, caches)
            return
        self.drafter.context(h[..., : self.drafter.tap_width], caches)

    def draft_block(
        self,
        anchor: mx.array,
        context: List[Any],
        position,
        vocab: Optional[int] = None,
    ):
        """A block drafter's pass after the anchors ``anchor`` ``(B,)`` at
        ``position`` (int, or ``(B,)``), reading ``context`` (per drafter layer,
        its cache's ``read_kv``): the slots' logits before the Markov head
        (`block_logits`: ``(B, gamma, V)``, or over a draft vocabulary's rows),
        and the ``(B, gamma, H)`` outputs (`mlx_mtp.models.dspark.DSpark.block`'s,
        which its confidence head reads; ``head_input`` of them is the head's).
        Read from `mlx_mtp.rows.Rows` caches (`RowReads`), each row's pass is its
        own, at its own position."""
        if context and isinstance(context[0], RowReads):
            passes = [
                self.draft_block(anchor[b : b + 1], [c[b] for c in context], n, vocab)
                for b, n in enumerate(context[0].positions)
            ]
            logits, g = zip(*passes)
            return mx.concatenate(logits), mx.concatenate(g)
        d = self.drafter
        ids = d.block_ids(anchor)
        x = d.embed(ids) if "embed_tokens" in d else self.embed(ids)
        g = d.block(x, context, position)
        return self.block_logits(g, vocab), g

    def block_logits(self, g: mx.array, vocab: Optional[int] = None) -> mx.array:
        """The block drafter's slot logits before the Markov head, of its outputs
        ``g`` ``(B, gamma, H)``: ``(B, gamma, V)``, or with ``vocab`` (fewer than V
        tokens) ``(B, gamma, vocab)`` over the token ids `block_rows` (the rows of
        the ``vocab`` tokens ranked first, `mlx_mtp.draft_vocab`), whose pass reads
        those rows of the head only."""
        d = self.drafter
        h = d.head_input(g)
        if vocab is not None and vocab < self.args.vocab_size:
            return self._block_vocab(vocab)[1](h)
        if "lm_head" in d:
            return d.lm_head(h)
        head = self.family.output_head(self.trunk)
        if head is None:
            return self.family.logits(self.trunk, h)
        # the target's projection alone, as the peers bind it: a drafter's `slot`
        # applies its own soft cap, not the target's (Gemma's)
        return head.as_linear(h) if hasattr(head, "as_linear") else head(h)

    def block_rows(self, vocab: Optional[int]) -> Optional[mx.array]:
        """The token ids of `block_logits`' columns with ``vocab`` (None: all)."""
        if vocab is None or vocab >= self.args.vocab_size:
            return None
        return self._block_vocab(vocab)[0]

    def slot_logits(self, z: mx.array, prev: mx.array, g: mx.array, state, vocab=None):
        """``(B, V)`` logits of a block slot and the Markov head's state after it:
        the drafter's `slot` of its `block_logits` ``z`` (``vocab``'s columns) after
        the tokens ``prev`` (a DSpark drafter adds its Markov bias over the same
        rows), -inf outside `block_rows`; ``g`` ``(B, H)`` its outputs."""
        rows = self.block_rows(vocab)
        w2 = None if rows is None else self._block_vocab(vocab)[2]
        logits, state = self.drafter.slot(z, prev, g, state, w2, rows)
        if rows is not None:
            logits = expand(logits, rows, self.args.vocab_size)
        return logits, state

    @property
    def block_vocab_ok(self) -> bool:
        """Whether the block drafter can draft from a draft vocabulary: its head
        (its own, or the target's) is a plain projection whose rows can be read
        alone."""
        d = self.drafter
        return d is not None and (
            "lm_head" in d or self.family.output_head(self.trunk) is not None
        )

    def _block_vocab(self, vocab: int):
        """(rows, head of those rows, ``markov_w2`` of those rows or None), made
        once per draft vocabulary size."""
        made = self.__dict__.setdefault("_block_vocabs", {})
        if vocab not in made:
            d = self.drafter
            rows = self.vocab_ranking.rows(vocab)
            head = d.lm_head if "lm_head" in d else self.family.output_head(self.trunk)
            w2 = None
            if "markov_head" in d:
                w2 = RowsHead(d.markov_head.markov_w2, rows)
            made[vocab] = rows, RowsHead(head, rows), w2
        return made[vocab]

    def draft_logits(self, h: mx.array, vocab: Optional[int] = None) -> mx.array:
        """``(..., V)`` logits an MTP output drafts from (-inf outside the rows drafted
        from): with ``vocab``, the rows of the ``vocab`` tokens ranked first by
        ``self.vocab_ranking`` (`mlx_mtp.draft_vocab`); without, the heads' own draft
        vocabulary when they were trained with one, else the whole head."""
        if vocab is None and "draft_vocab" not in self.mtp:
            return self.logits(h)
        if vocab is not None and vocab >= self.args.vocab_size:
            return self.logits(h)  # every row
        heads = self.__dict__.setdefault("_draft_heads", {})
        if vocab not in heads:
            heads[vocab] = self._draft_head(vocab)
        return heads[vocab](h)

    def _draft_head(self, vocab: Optional[int]):
        """``h -> (..., V)`` logits of the draft vocabulary ``vocab`` (see
        `draft_logits`): the head's rows gathered once, or, for a family whose logits
        are its own kind, its logits masked."""
        rows = self.mtp.draft_vocab if vocab is None else self.vocab_ranking.rows(vocab)
        full = self.family.output_head(self.trunk)
        if full is None:
            mask = mx.zeros((self.args.vocab_size,), dtype=mx.bool_)
            mask[rows] = True
            return lambda h: mx.where(mask, self.logits(h), -mx.inf)
        rows_head, size = RowsHead(full, rows), full.weight.shape[0]
        width = self.args.hidden_size  # a wider (packed) state ends with the head's
        return lambda h: expand(rows_head(h[..., -width:]), rows, size)

    def embed(self, ids: mx.array) -> mx.array:
        return self.family.embed(self.trunk, ids)

    def make_trunk_cache(self, max_kv_size: Optional[int] = None) -> List[Any]:
        """mlx-lm's caches for the trunk (`mlx_mtp.cache.make_caches` gives recurrent
        layers their rollback when `records_states`)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.trunk, max_kv_size=max_kv_size)

    @property
    def records_states(self) -> bool:
        """Whether the trunk's recurrent mixers record their state per position (the
        family's ``prepare`` installed a capture), so their caches can roll back."""
        return self.family.prepare is not None

    def assist(
        self,
        tokens: mx.array,
        hidden: mx.array,
        kv: Dict[str, Tuple[mx.array, mx.array]],
        position: int,
        masks: Optional[Dict[str, mx.array]] = None,
    ) -> Tuple[mx.array, mx.array]:
        """Assistant steps for tokens ``(B, L)`` at positions ``position ..``, with
        ``hidden`` ``(B, L, H)`` the trunk's hidden state before each token (or the
        previous step's ``h'``); ``kv`` maps layer type to the trunk's K/V, as
        `mlx_mtp.models.gemma4_assistant.Assistant` takes them. Returns ``(B, L, V)``
        logits and ``(B, L, H)`` ``h'``."""
        return self.assistant(self.embed(tokens), hidden, kv, position, masks)

    def mtp_forward(
        self, j: int, hidden: mx.array, tokens: mx.array, cache: Optional[Any] = None
    ) -> mx.array:
        """Run MTP layer ``j`` on rows ``(hidden[i], tokens[i])``.

        Row i of the call sits at position ``cache.offset + i``; ``tokens[i]`` is the
        token that follows the position of ``hidden[i]``.

        Args:
            hidden: ``(B, L, H)`` post-norm hidden states (trunk or previous MTP layer).
            tokens: ``(B, L)`` token ids.
        Returns:
            ``(B, L, H)`` post-norm MTP outputs; ``logits(out)`` predicts the token
            after ``tokens``.
        """
        if by_rows([cache]):  # a block whose passes take one stream (`mlx_mtp.rows`)

            def row(h: mx.array, t: mx.array, caches: List[Any]) -> mx.array:
                return self.mtp_forward(j, h, t, caches[0])

            return each_row(row, (hidden, tokens), [cache])
        e = self.embed(tokens)  # (B, L, H)
        offset = cache.offset if cache is not None else 0
        if self.family.MASK_FIRST_POSITION and not isinstance(offset, int):
            # rows of several streams: each row's own positions ``(B, L)``
            keep = (offset[:, None] + mx.arange(e.shape[1])[None] > 0)[..., None]
            e = mx.where(keep, e, mx.zeros_like(e))
        elif self.family.MASK_FIRST_POSITION and offset == 0:
            keep = (mx.arange(e.shape[1]) > 0)[None, :, None]
            e = mx.where(keep, e, mx.zeros_like(e))
        layer = self.mtp.layers[j]
        return layer(e, hidden, self.mtp_mask(e, cache, layer.window), cache)

    def mtp_mask(
        self, e: mx.array, cache: Optional[Any] = None, window: Optional[int] = None
    ):
        """The causal mask of an MTP layer over the rows of ``e`` (B, L, H), in the
        form the family's attention takes ("causal", an array, or None), limited to
        the last ``window`` positions for a sliding-window block (whatever its cache).
        """
        return create_attention_mask(
            e, cache, window_size=window, return_array=self.family.MASK_AS_ARRAY
        )


def mlx_lm_sanitize(trunk: nn.Module, weights: dict) -> dict:
    """Run the sanitize of the mlx-lm (or mlx-vlm) class the trunk was built from
    (not a subclass's)."""
    for cls in type(trunk).__mro__:
        library = cls.__module__.startswith(("mlx_lm.", "mlx_vlm."))
        if library and "sanitize" in vars(cls):
            return cls.sanitize(trunk, weights)
    return weights


def sanitize_layer(
    trunk: nn.Module,
    weights: dict,
    prefix: str,
    head_names: dict,
    j: int,
    as_layer: int = 0,
) -> dict:
    """Translate one MTP layer's Hugging Face tensors to the schema `layers.{j}.*`.

    The layer's tensors are renamed to the trunk's layer 0 and passed through the
    trunk's own sanitize, so the decoder block gets exactly the trunk's fixes (expert
    stacking, FP8 dequantization, MLA splits). Then the fusion and norm parts are
    renamed by ``head_names`` (family name -> schema name) and the rest lands under
    ``block``.

    Args:
        weights: Tensors of the MTP layers, Hugging Face names.
        prefix: The layer's name prefix, e.g. ``"model.layers.3."``.
        as_layer: The trunk layer whose name the tensors pass under (one whose
            sanitize fixes apply to them, e.g. an MoE layer's expert stacking).
    """
    local_prefix = f"model.layers.{as_layer}."
    local = {
        local_prefix + k[len(prefix) :]: v
        for k, v in weights.items()
        if k.startswith(prefix)
    }
    out = {}
    for key, value in mlx_lm_sanitize(trunk, local).items():
        name = key[len(local_prefix) :]
        for src, dst in head_names.items():
            if name.startswith(src + "."):
                out[f"layers.{j}.{dst}{name[len(src):]}"] = value
                break
        else:
            out[f"layers.{j}.block.{name}"] = value
    return out


def check_copy(copy: mx.array, original: Optional[mx.array], what: str) -> None:
    """Check that a duplicated tensor (an MTP layer's embedding or head) equals the
    trunk's.

    Large tensors are compared on a strided subset of rows, which catches heads taken
    from another model without reading gigabytes.
    """
    from ..errors import MissingHeadsError

    if original is None:
        return
    if copy.shape != original.shape:
        raise MissingHeadsError(
            f"{what} has shape {tuple(copy.shape)} but the trunk's is "
            f"{tuple(original.shape)}: the MTP heads do not belong to this model"
        )
    step = max(1, copy.shape[0] // 256)
    if not mx.array_equal(copy[::step], original[::step]).item():
        raise MissingHeadsError(
            f"{what} differs from the trunk's copy: the MTP heads do not belong to "
            "this model"
        )


def split_mtp(weights: dict, config: dict, layer_of) -> tuple:
    """Split tensors into (trunk, mtp) by ``layer_of(key, config)`` (None: trunk)."""
    trunk, mtp = {}, {}
    for k, v in weights.items():
        (trunk if layer_of(k, config) is None else mtp)[k] = v
    return trunk, mtp


def sanitize_layers(
    trunk, weights: dict, config: dict, layer_of, layout, as_layer: int = 0
) -> dict:
    """`sanitize_layer` for every MTP layer present, named as the family's `Layout`
    says."""
    n = 1 + max(layer_of(k, config) for k in weights)
    out = {}
    for j in range(n):
        prefix = layout.prefix(config, j)
        out.update(sanitize_layer(trunk, weights, prefix, layout.fusion, j, as_layer))
    return out

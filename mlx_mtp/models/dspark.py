"""DSpark block drafters for Qwen3-family targets (DeepSeek's DeepSpec release).

A DSpark drafter proposes a whole block of gamma tokens in one pass
(``/work/notes/dspark_spec.md``, cited below as "spec §n"):

- context: per committed position t, the target's residual stream at the tapped
  layers ``target_layer_ids`` is concatenated, ``c_t = hidden_norm(fc(feat_t))``, and
  every drafter layer keeps ``K = RoPE(k_norm(k_proj(c_t)), t)``, ``V = v_proj(c_t)``
  (no input norm on c) in its own KV cache: one row per committed position (§2.2);
- block: ``[a, M, ..., M]`` (anchor a = the pending token at position p, M =
  ``mask_token_id``) at positions p..p+gamma-1; its queries attend, with no mask,
  to every context row (positions < p) and to every block row; a Qwen3 pre-norm
  decoder layer otherwise (§2.3, §2.4); output slot k predicts position p+k+1;
- Markov head: slot k's logits ``z_k + bias_k``, a bias of rank r after prev_k
  (prev_0 = a, prev_k the token drawn at slot k-1), so q_k depends on the drawn
  prefix (§2.5, §3). ``markov_head_type`` (DeepSpec ``markov_head.py``), with
  ``e = W1[prev_k]`` and g_k slot k's normed output:
  ``vanilla``  ``W2 e``;
  ``gated``    ``W2 (sigmoid(gate_proj([g_k ; e])) * e)``;
  ``rnn``      a state s (zero at each block's start): ``[u ; c ; o] =
  joint_proj([s ; e ; g_k])``, ``s <- sigmoid(u) * s + (1 - sigmoid(u)) * tanh(c)``,
  bias ``W2 tanh(o)``;
- confidence head: ``c_k = proj([g_k ; W1[prev_k]])``; the block is cut before the
  first slot k with ``sigmoid(c_k) < tau`` (DeepSpec ``draft_ops.py``, §2.6). c_k
  depends on the tokens drawn before slot k only, so the cut is a stopping time and
  verification stays exact.

The block's own keys and values are never cached, so a rejection needs no drafter
rollback beyond keeping the context rows of committed positions (§4).

Folders: the DeepSpec layout (config keys at the top level, tensors without prefix,
``embed_tokens``/``lm_head`` copies of the target's) and the nested ``dflash_config``
spelling (tensors under ``model.``, no embedding or head), both per spec §1a. A missing
embedding or head is the target's (spec §2.7). The decoder layers are mlx-lm's own
Qwen3 blocks (`mlx_lm.models.qwen3.TransformerBlock`), called part by part.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import MTPError, one_line
from .capture import Taps

# DeepSpec's release; mlx-vlm's published nested configs (Qwen3.8, LFM2).
ARCHITECTURES = (
    "Qwen3DSparkModel",
    "DSparkDraftModel",
    "Lfm2DSparkDraftModel",
    "Gemma4DSparkModel",  # `mlx_mtp.models.gemma4_dspark`
)
# tau when the folder's config has no ``confidence_threshold`` (the key mlx-vlm's
# DeepSeek-V4.1 DSpark config spells, 0.3 there): DeepSpec's own default, 0 (no cut).
# On a memory-bound machine a wider verify pass costs little, while a cut needs its
# lengths on the host before the pass (one more sync per round); its paper's sweep
# (Fig. 5) shows acceptance rising with tau, so a config may ask for one.
DEFAULT_CONFIDENCE_THRESHOLD = 0.0
# Keys the nested spelling keeps in ``dflash_config`` (spec §1a, variant B).
# The mask token of a drafter whose config leaves it out, by its ``model_type``:
# Gemma's ``<mask>`` for Gemma 4's DFlash drafters (mlx-vlm's ``gemma4_dflash``)
IMPLIED_MASK = {"gemma4": 4, "gemma4_text": 4}
NESTED_KEYS = ("mask_token_id", "target_layer_ids", "num_target_layers")


def is_dspark(config: dict) -> bool:
    """Whether a ``config.json`` is a DSpark drafter's (either spelling), or one of
    its kin's (DFlash, DFlash2: `mlx_mtp.models.dflash`)."""
    names = ARCHITECTURES + ("DFlashDraftModel", "DFlash2DraftModel")
    if any(a in names for a in config.get("architectures") or ()):
        return True
    nested = config.get("dflash_config")
    if isinstance(nested, dict):  # mlx-vlm's mark of its block drafters
        return "target_layer_ids" in nested
    return "target_layer_ids" in config and "mask_token_id" in config


@dataclass(frozen=True)
class DSparkSpec:
    """The drafter keys of a DSpark config (spec §1a): ``block_size`` is gamma, the
    proposals per pass (the anchor row not counted)."""

    block_size: int
    target_layer_ids: Tuple[int, ...]
    mask_token_id: int
    num_target_layers: Optional[int] = None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    # UNCONFIRMED defaults (the spec gives none): the head reads W1[prev] when
    # there is a Markov head, as DeepSpec's released config sets it
    confidence_head_with_markov: bool = True
    # DeepSpec's convention (no key in its configs; vLLM's default is true too);
    # false: the speculators' [a, M x gamma] block, row 0 dropped (spec §2.3)
    sample_from_anchor: bool = True
    # tau of the confidence cut, in [0, 1]; 0 (or null in the config): no cut
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD

    @classmethod
    def from_config(cls, config: dict, where="the drafter") -> "DSparkSpec":
        """Read either spelling: a key in ``dflash_config`` wins over the top level."""
        nested = config.get("dflash_config") or {}
        if not isinstance(nested, dict):
            raise MTPError(f"{where}: dflash_config is not an object")

        def get(key, default=None):
            return nested[key] if key in nested else config.get(key, default)

        ids = get("target_layer_ids")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids) or not ids:
            raise MTPError(f"{where}: target_layer_ids must be a list of layer indices")
        mask = get("mask_token_id", IMPLIED_MASK.get(config.get("model_type")))
        for key, value, least in (
            ("block_size", get("block_size"), 1),
            ("mask_token_id", mask, 0),
        ):
            if type(value) is not int or value < least:
                raise MTPError(f"{where}: {key} must be a whole number >= {least}")
        tau = get("confidence_threshold", DEFAULT_CONFIDENCE_THRESHOLD)
        tau = 0.0 if tau is None else tau
        if type(tau) not in (int, float) or not 0 <= tau <= 1:
            raise MTPError(f"{where}: confidence_threshold must be a number in [0, 1]")
        spec = cls(
            block_size=get("block_size"),
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=get("num_target_layers"),
            markov_rank=get("markov_rank", 0) or 0,
            markov_head_type=str(get("markov_head_type") or "vanilla").lower(),
            enable_confidence_head=bool(get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(get("confidence_head_with_markov", True)),
            sample_from_anchor=bool(get("sample_from_anchor", True)),
            confidence_threshold=float(tau),
        )
        if spec.markov_rank and spec.markov_head_type not in MARKOV_HEADS:
            raise MTPError(
                f"{where} has a {spec.markov_head_type!r} Markov head; mlx-mtp runs "
                f"{', '.join(MARKOV_HEADS)} ones"
            )
        return spec


def layer_args(config: dict, where="the drafter") -> qwen3.ModelArgs:
    """mlx-lm's Qwen3 args for the drafter's layers (the config is the target's,
    copied, with the drafter's layer count: spec §1a)."""
    H, heads = config.get("hidden_size"), config.get("num_attention_heads")
    defaults = {
        "model_type": "qwen3",
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
    }
    if isinstance(H, int) and isinstance(heads, int) and heads:
        defaults["head_dim"] = H // heads
    try:
        return qwen3.ModelArgs.from_dict({**defaults, **config})
    except (TypeError, ValueError) as e:
        raise MTPError(
            f"{where}: cannot build its layers from the config: {one_line(e)}"
        ) from None


def draft_key(config: dict, key: str, default=None):
    """A drafter key: ``dflash_config``'s wins over the top level's."""
    nested = config.get("dflash_config") or {}
    return nested[key] if key in nested else config.get(key, default)


def whole(config: dict, key: str, where: str, least: int = 1) -> int:
    """`draft_key` ``key``, a whole number >= ``least`` (else a one-line error)."""
    value = draft_key(config, key)
    if type(value) is not int or value < least:
        raise MTPError(f"{where}: {key} must be a whole number >= {least}")
    return value


def windows_of(config: dict, where: str) -> Tuple[Optional[int], ...]:
    """Per drafter layer, the context rows a block attends to (None: all): the
    last ``sliding_window - 1`` for a sliding layer (mlx-vlm's rule), every row for
    a full one, both capped by ``draft_window_size``."""
    layers = config.get("num_hidden_layers")
    if type(layers) is not int or layers < 1:
        raise MTPError(f"{where}: num_hidden_layers must be a whole number >= 1")
    types = config.get("layer_types") or ["full_attention"] * layers
    if set(types) - {"full_attention", "sliding_attention"}:
        raise MTPError(f"{where}: unknown layer types {sorted(set(types))}")
    if len(types) != layers:
        raise MTPError(f"{where}: {len(types)} layer types for {layers} layers")
    sliding = None
    if "sliding_attention" in types:
        sliding = whole(config, "sliding_window", where, least=2) - 1
    cap = None
    if draft_key(config, "draft_window_size") is not None:
        cap = whole(config, "draft_window_size", where)
    windows = [sliding if t == "sliding_attention" else None for t in types]
    return tuple(
        cap if w is None else w if cap is None else min(w, cap) for w in windows
    )


def number(config: dict, key: str, where: str, default) -> Optional[float]:
    """`draft_key` ``key``, a number (None when unset and no ``default``)."""
    value = draft_key(config, key, default)
    if value is not None and type(value) not in (int, float):
        raise MTPError(f"{where}: {key} must be a number")
    return None if value is None else float(value)


class MarkovHead(nn.Module):
    """The vanilla Markov head (DeepSpec ``VanillaMarkov``; spec §2.5): a bias
    ``W2 W1[prev]`` over the vocabulary, of rank r. Every head is called slot by
    slot over a block, ``state`` threaded from one slot to the next."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def start(self, batch: int, dtype) -> Optional[mx.array]:
        """The state before a block's first slot (None: the head keeps none)."""
        return None

    def __call__(self, prev: mx.array, g: mx.array, state):
        """``(B,)`` previous tokens and ``(B, H)`` the slot's normed outputs ->
        ``(B, V)`` logit biases and the state after the slot."""
        u, state = self.features(prev, g, state)
        return self.markov_w2(u), state

    def features(self, prev: mx.array, g: mx.array, state):
        """The ``(B, r)`` input of ``markov_w2`` for a slot (see `__call__`), and
        the state after the slot."""
        return self.markov_w1(prev), state


class GatedMarkovHead(MarkovHead):
    """DeepSpec ``GatedMarkovHead``: ``W2 (sigmoid(gate_proj([g ; e])) * e)`` with
    ``e = W1[prev]``."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def features(self, prev: mx.array, g: mx.array, state):
        e = self.markov_w1(prev)  # (B, r)
        gate = mx.sigmoid(self.gate_proj(mx.concatenate([g, e], axis=-1)))
        return gate * e, state


class RecurrentMarkovHead(MarkovHead):
    """DeepSpec ``RNNHead``: a GRU-like state s of width r, zero at a block's
    start; per slot ``[u ; c ; o] = joint_proj([s ; e ; g])`` (``e = W1[prev]``),
    ``s <- sigmoid(u) s + (1 - sigmoid(u)) tanh(c)`` and the bias ``W2 tanh(o)``."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank, hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def start(self, batch: int, dtype) -> mx.array:
        return mx.zeros((batch, self.markov_w1.weight.shape[-1]), dtype=dtype)

    def features(self, prev: mx.array, g: mx.array, state: mx.array):
        e = self.markov_w1(prev)  # (B, r)
        joint = self.joint_proj(mx.concatenate([state, e, g], axis=-1))  # (B, 3 r)
        u, c, o = mx.split(joint, 3, axis=-1)
        u = mx.sigmoid(u)
        state = u * state + (1.0 - u) * mx.tanh(c)
        return mx.tanh(o), state


MARKOV_HEADS = {
    "vanilla": MarkovHead,
    "gated": GatedMarkovHead,
    "rnn": RecurrentMarkovHead,
}


class ConfidenceHead(nn.Module):
    """``proj([g_k ; W1[prev_k]])``: a raw logit whose sigmoid estimates slot k's
    acceptance given an accepted prefix (spec §2.6)."""

    def __init__(self, width: int, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=bias)


class DSpark(nn.Module):
    """A DSpark drafter. Parameter names are the DeepSpec ones (spec §1a).

    Args:
        config: The drafter's ``config.json`` (either spelling).
        own_embed: The folder has ``embed_tokens`` (else the target's is used).
        own_head: The folder has ``lm_head`` (else the target's is used).

    Attributes:
        TAPS: The kind of `Taps` its context reads (the outputs of the tapped
            layers, before the final norm: spec §2.1).
        context_windows: Per drafter layer, the last context rows a block attends
            to (None: all; `windows_of`).
        embed_scale: Its own embedding's scale (the target's embedding comes
            scaled as the target's first layer sees it).
        softcap: The soft cap of its slot logits, before the Markov bias (None).
    """

    TAPS = Taps
    WHERE = "the DSpark drafter"
    rows_apart = False  # its passes batch streams (see `mlx_mtp.cache.mtp_caches`)
    embed_scale = 1.0

    def __init__(self, config: dict, own_embed: bool = True, own_head: bool = True):
        super().__init__()
        self.spec = DSparkSpec.from_config(config)
        self.args = args = self.read_args(config)
        H, V, n = args.hidden_size, args.vocab_size, len(self.spec.target_layer_ids)
        if own_embed:
            self.embed_tokens = nn.Embedding(V, H)
        if own_head:
            self.lm_head = nn.Linear(H, V, bias=False)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = self.make_layers(config, args)
        self.windows = windows_of(config, self.WHERE)
        self.softcap = number(config, "final_logit_softcapping", self.WHERE, None)
        r = self.spec.markov_rank
        if r:
            self.markov_head = MARKOV_HEADS[self.spec.markov_head_type](V, r, H)
        if self.spec.enable_confidence_head:
            with_markov = r and self.spec.confidence_head_with_markov
            self.confidence_head = ConfidenceHead(H + (r if with_markov else 0))

    @staticmethod
    def read_args(config: dict) -> qwen3.ModelArgs:
        """The shared widths (`layer_args`)."""
        return layer_args(config)

    @staticmethod
    def make_layers(config: dict, args: qwen3.ModelArgs) -> list:
        """The decoder layers: mlx-lm's Qwen3 blocks (LFM2's with interleaved
        RoPE: spec §2.4)."""
        layers = [qwen3.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        if config.get("rope_is_neox_style") is False:
            for layer in layers:
                layer.self_attn.rope = initialize_rope(
                    args.head_dim,
                    base=args.rope_theta,
                    traditional=True,
                    scaling_config=args.rope_scaling,
                    max_position_embeddings=args.max_position_embeddings,
                )
        return layers

    @property
    def context_windows(self) -> Tuple[Optional[int], ...]:
        return self.windows

    def embed(self, ids: mx.array) -> mx.array:
        """Its own embedding of ``ids``, at its scale."""
        x = self.embed_tokens(ids)
        return x if self.embed_scale == 1 else x * self.embed_scale

    @property
    def block_size(self) -> int:
        """gamma: the proposals of one pass."""
        return self.spec.block_size

    @property
    def tap_width(self) -> int:
        """The width of the concatenated taps ``fc`` reads: n * H."""
        return len(self.spec.target_layer_ids) * self.args.hidden_size

    def context(self, taps: mx.array, caches) -> None:
        """Append the context rows of committed positions to every layer's cache:
        ``taps`` ``(B, m, n * H)`` at positions ``cache.offset ..`` (spec §2.2)."""
        B, m, _ = taps.shape
        c = self.hidden_norm(self.fc(taps))  # (B, m, H)
        for layer, cache in zip(self.layers, caches):
            k, v = self._kv(layer.self_attn, c)
            cache.update_and_fetch(layer.self_attn.rope(k, offset=cache.offset), v)

    def block_ids(self, anchor: mx.array) -> mx.array:
        """``(B,)`` anchors -> ``(B, R)`` block inputs ``[a, M, ...]``: R = gamma rows
        (sample from the anchor, DeepSpec's convention), or gamma + 1 rows whose first
        output is dropped (``sample_from_anchor`` false; spec §2.3)."""
        rows = self.block_size + (0 if self.spec.sample_from_anchor else 1)
        masks = mx.full((anchor.shape[0], rows - 1), self.spec.mask_token_id, mx.int32)
        return mx.concatenate([anchor[:, None].astype(mx.int32), masks], axis=1)

    def block(self, x: mx.array, context, position) -> mx.array:
        """The block pass: ``x`` ``(B, R, H)`` embedded block rows, row b's at
        positions ``position[b] ..`` (an int when every row's is the same), each
        layer attending to its context and to the whole block (no mask within
        it: spec §2.4). ``context[i]``: layer i's ``((keys, values), mask)``,
        keys and values ``(B, n_kv, T, D)`` of committed positions and mask None
        or ``(B, 1, 1, T)`` the entries each row sees (a cache's ``read_kv``).
        Returns ``(B, gamma, H)`` normed outputs, slot k predicting position
        ``position + k + 1``. Nothing is written to any cache."""
        for layer, seen in zip(self.layers, context):
            h = layer.input_layernorm(x)
            x = x + self._attend(layer.self_attn, h, seen, position)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x[:, -self.block_size :])

    def _attend(self, attn, h: mx.array, seen, position) -> mx.array:
        """One layer's attention of the block rows ``h`` ``(B, R, H)`` over
        [context rows ; block rows]."""
        B, R, _ = h.shape
        q = attn.q_norm(attn.q_proj(h).reshape(B, R, attn.n_heads, -1))
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=position)
        k, v = self._kv(attn, h)
        k = attn.rope(k, offset=position)
        (ck, cv), mask = seen
        if ck is not None:  # (B, n_kv, T, D): positions below each row's block
            k, v = mx.concatenate([ck, k], axis=2), mx.concatenate([cv, v], axis=2)
        if mask is not None:
            mask = mx.concatenate([mask, mx.ones((B, 1, 1, R), dtype=mx.bool_)], -1)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask=mask)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, R, -1))

    @staticmethod
    def _kv(attn, x: mx.array):
        """``(B, n_kv, L, D)`` keys (normed, before RoPE) and values of rows ``x``
        ``(B, L, H)``."""
        B, L, _ = x.shape
        k = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1))
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def head_input(self, g: mx.array) -> mx.array:
        """The head's input for `block`'s outputs ``g`` (normed already here)."""
        return g

    def markov_start(self, batch: int, dtype) -> Optional[mx.array]:
        """The Markov head's state before a block's first slot (None: no state)."""
        return self.markov_head.start(batch, dtype) if "markov_head" in self else None

    def markov(self, prev: mx.array, g: mx.array, state, w2=None):
        """``(B, V)`` Markov bias of a slot after the tokens ``prev`` ``(B,)``, its
        normed outputs ``g`` ``(B, H)`` and the head's ``state`` (`markov_start`,
        then what the slot before returned), and the state after it; the bias is
        None without a Markov head (``markov_rank`` 0: slots are independent).
        ``w2``: a projection that replaces ``markov_w2`` (some of its rows: a draft
        vocabulary's, `mlx_mtp.models.base.Model.block_logits`)."""
        if "markov_head" not in self:
            return None, state
        u, state = self.markov_head.features(prev, g, state)
        return (self.markov_head.markov_w2 if w2 is None else w2)(u), state

    def slot(self, z: mx.array, prev: mx.array, g: mx.array, state, w2=None, rows=None):
        """A slot's logits over ``z``'s columns (token ids ``rows``, or all: the
        columns of ``w2``, `markov`'s): ``z`` soft-capped at ``softcap`` when set,
        plus the Markov bias after ``prev`` (mlx-vlm's order); and the Markov
        head's state after the slot."""
        if self.softcap is not None:
            z = mx.tanh(z / self.softcap) * self.softcap
        bias, state = self.markov(prev, g, state, w2)
        return (z if bias is None else z + bias), state

    def confidence(self, g: mx.array, prev: mx.array) -> mx.array:
        """``(...)`` float32 confidence logits c of slot outputs ``g`` ``(..., H)``
        after tokens ``prev`` ``(...)`` (spec §2.6)."""
        parts = [g]
        if self.confidence_head.proj.weight.shape[-1] > g.shape[-1]:
            parts.append(self.markov_head.markov_w1(prev))
        c = self.confidence_head.proj(mx.concatenate(parts, axis=-1))[..., 0]
        return c.astype(mx.float32)

    @property
    def cuts(self) -> bool:
        """Whether the confidence head cuts blocks (it exists and tau > 0)."""
        return "confidence_head" in self and self.spec.confidence_threshold > 0

    def cut(self, g: mx.array, anchor: mx.array, drafts: mx.array) -> mx.array:
        """``(B,)`` block lengths: per row the first slot k < K whose
        ``sigmoid(c_k) < tau``, else K (DeepSpec ``_confident_prefix_length``).
        ``drafts`` ``(B, K)`` the tokens drawn after ``anchor`` ``(B,)``, ``g``
        ``(B, >= K, H)`` the slots' normed outputs; c_k reads slot k's output and
        the token before it, so whether slot k is kept depends on the tokens
        drawn before it only. Requires `cuts`."""
        K = drafts.shape[1]
        prev = mx.concatenate([anchor[:, None], drafts[:, :-1]], axis=1)  # (B, K)
        tau = self.spec.confidence_threshold
        low = (mx.sigmoid(self.confidence(g[:, :K], prev)) < tau).astype(mx.int32)
        return mx.where(low.max(axis=1) > 0, mx.argmax(low, axis=1), K).astype(mx.int32)


def sanitize(weights: dict) -> dict:
    """Drafter tensors -> `DSpark`'s (and `mlx_mtp.models.dflash`'s)
    names: the nested spelling's ``model.`` prefix dropped, RoPE buffers dropped,
    DFlash2's selector codebooks (bare tables) named as embeddings' ``.weight``."""
    out = {}
    for key, value in weights.items():
        if "rotary_emb" in key:
            continue
        key = key[len("model.") :] if key.startswith("model.") else key
        if key.startswith("candidate_selector.") and key.endswith("_codebook"):
            key += ".weight"
        out[key] = value
    return out


def check_pair(config: dict, target: dict, where: str = "the drafter") -> DSparkSpec:
    """Refuse, in one line, a drafter config that does not fit the target's text
    config: vocabulary, hidden size, the tapped layers (-1 .. L-2: the last layer is
    refused, as DeepSpec does, since Hugging Face stores it after the final norm;
    spec §2.1). The drafter's ``model_type`` is its own backbone's ("qwen3" for
    every published one, whatever the target), so it is not compared. Returns the
    drafter's keys."""
    spec = DSparkSpec.from_config(config, where)
    for key, what in (("vocab_size", "a vocabulary"), ("hidden_size", "a hidden size")):
        if config.get(key) != target.get(key):
            raise MTPError(
                f"{where} has {what} of {config.get(key)}; the target's is "
                f"{target.get(key)}"
            )
    L = target.get("num_hidden_layers")
    if spec.num_target_layers is not None and spec.num_target_layers != L:
        raise MTPError(
            f"{where} was trained on a target of {spec.num_target_layers} layers; "
            f"this one has {L}"
        )
    bad = [i for i in spec.target_layer_ids if not -1 <= i < L - 1]
    if bad:
        raise MTPError(
            f"{where} taps layer {bad[0]}, outside this target's layers -1..{L - 2}"
        )
    if spec.mask_token_id >= (target.get("vocab_size") or 0):
        raise MTPError(
            f"{where}'s mask token {spec.mask_token_id} is not in the vocabulary"
        )
    return spec

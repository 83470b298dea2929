"""DeepSeek-V4.1's DSpark block drafter: the stages ``mtp.{0,1,2}`` of its checkpoint,
over mlx-lm's ``deepseek_v41`` trunk.

The drafting machinery is `mlx_mtp.models.dspark`'s (its spec, block inputs, vanilla
Markov head and confidence head; the round's ``draft_block``); what V4.1 changes is
read from DeepSeek's V4.1 inference code (``inference/model.py``: ``DSparkBlock``,
``DSparkAttention``, ``forward_head``; ``/work/notes/dspark_spec.md`` §1b, §2):

- taps: the *input* of each target layer ``dspark_target_layer_ids``, averaged over
  its hyper-connection streams (`StreamInputTaps`), concatenated;
- context: ``main_x = main_norm(main_proj(taps))`` once (stage 0's), then per stage
  ``kv = kv_norm(wkv(main_x))``, RoPE'd at its position and rounded through FP8 as
  the trunk's window rows are; a block sees the last ``sliding_window`` context rows
  (the reference's ring of window slots) and every block row, with no mask;
- block: ``embed([a, M, ..., M])`` (``dspark_block_size`` rows, M the noise token)
  copied into ``hc_mult`` streams, the pre-mix one-hot on stream 0; each stage is
  mlx-lm's V4.1 decoder layer (hyper-connections, norms, MoE with the ``dspark_*``
  expert counts) with `StageAttention` in place of its attention, the next stage's
  pre-mix the previous stage's FFN one; after the last, ``norm`` of the streams
  collapsed by the pre-mix, and the trunk's head; slot k predicts position p + k + 1;
- Markov head ``markov_head.embed`` (W1) and ``.head`` (W2): logits ``z_k + W2
  W1[prev_k]``; confidence head ``proj([x_k ; W1[prev_k]])`` (no bias) of the
  collapse ``x_k`` *before* ``norm``.

The checkpoint has no ``hc_head_*`` (DeepSeek-V4-Flash-0731's DSpark has; V4.1
collapses with the pre-mix). `sanitize` is the one place its names are translated.
"""

import re
import types
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v41 as lm

from ..errors import MissingHeadsError, MTPError
from ..private import check_private
from . import dspark
from .base import check_copy
from .capture import StreamInputTaps

# mlx-lm's private members of ``deepseek_v41`` the drafter calls, with their
# parameters (checked at import, as `mlx_mtp.models.deepseek_v4` does).
MLX_LM_PRIVATE = (
    ("_apply_rope", "x, rope, *, rope_dim, offset=0, scale=1.0, inverse=False"),
    ("_fake_quant_fp8", "x, block_size=32"),
    ("_collapse", "streams, mix"),
    (
        "DecoderLayer.__call__",
        "self, streams, pre_mix, *, start_pos, window_idx, cache, shared",
    ),
)
check_private(
    lm,
    MLX_LM_PRIVATE,
    "mlx_lm.models.deepseek_v41",
    "DeepSeek-V4.1's drafter needs mlx-lm 0.32.x",
)


def text_config(config: dict) -> dict:
    """The text config of a V4.1 ``config.json`` (nested under ``text_config``)."""
    return config.get("text_config") or config


def spec_of(text: dict, where: str = "the DSpark drafter") -> dspark.DSparkSpec:
    """The drafter keys of V4.1's text config, as a `DSparkSpec` (the block samples
    from its anchor; the Markov head is vanilla; the confidence head reads it).

    Raises:
        MissingHeadsError: a key is missing or out of range (one line).
    """
    L, V = text.get("num_hidden_layers"), text.get("vocab_size")
    ids = text.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        raise MissingHeadsError(f"{where}: dspark_target_layer_ids must list layers")
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise MissingHeadsError(f"{where} taps layer {bad[0]}, outside 0..{L - 1}")
    for key, low, top in (
        ("dspark_block_size", 1, None),
        ("dspark_noise_token_id", 0, V),
    ):
        value = text.get(key)
        if type(value) is not int or value < low or (top and value >= top):
            raise MissingHeadsError(f"{where}: {key} is {value!r}")
    return dspark.DSparkSpec(
        block_size=text["dspark_block_size"],
        target_layer_ids=tuple(ids),
        mask_token_id=text["dspark_noise_token_id"],
        num_target_layers=L,
        markov_rank=text.get("dspark_markov_rank", 256),
        enable_confidence_head=True,
    )


def stage_args(args: lm.ModelArgs, text: dict) -> lm.ModelArgs:
    """The trunk's args with the stages' expert counts (``dspark_n_routed_experts``,
    ``dspark_num_experts_per_tok``, the reference's ``dspark_n_activated_experts``;
    the trunk's when unset, as the reference's ``get_moe_config``)."""
    top_k = text.get("dspark_num_experts_per_tok") or text.get(
        "dspark_n_activated_experts"
    )
    return replace(
        args,
        n_routed_experts=text.get("dspark_n_routed_experts") or args.n_routed_experts,
        num_experts_per_tok=top_k or args.num_experts_per_tok,
    )


def stage_kv(attn: lm.Attention, x: mx.array, offset: int) -> mx.array:
    """A stage's K = V rows of ``x`` ``(B, L, H)`` at positions ``offset ..``:
    ``kv_norm(wkv(x))``, RoPE'd, rounded through FP8 as the trunk's window rows.
    ``(B, L, d)``"""
    kv = attn.kv_norm(attn.kv_proj(x))
    kv = lm._apply_rope(kv, attn.rope, rope_dim=attn.rope_dim, offset=offset)
    return lm._fake_quant_fp8(kv, 32)


class StageAttention(lm.Attention):
    """A stage's attention: the block's queries over its context rows and the
    block's own rows, no mask, with the heads' sinks (the reference's
    ``DSparkAttention``); RoPE undone on the output, grouped output projection.
    Called by mlx-lm's decoder layer: ``start_pos`` is the block's first position,
    ``cache`` the stage's context ``((keys, values), mask)``, keys ``(B, 1, T, d)``
    (a cache's ``read_kv``, one stream: mask None)."""

    def __call__(self, x, *, start_pos, window_idx, cache, shared) -> mx.array:
        (context, _), mask = cache
        if mask is not None or not isinstance(start_pos, int):
            raise MTPError("DeepSeek-V4.1's drafter drafts for one stream at a time")
        B, R, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(B, R, self.num_heads, self.head_dim)
        q = lm._apply_rope(q, self.rope, rope_dim=self.rope_dim, offset=start_pos)
        keys = stage_kv(self, x, start_pos)  # (B, R, d)
        if context is not None:
            keys = mx.concatenate([context[:, 0], keys], axis=1)  # (B, T + R, d)
        keys = keys[:, None].astype(mx.float32)
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(0, 2, 1, 3).astype(mx.float32),
            keys,
            keys,
            scale=self.head_dim**-0.5,
            sinks=self.sinks.astype(mx.float32),
        )  # (B, heads, R, d)
        out = out.transpose(0, 2, 1, 3).astype(q.dtype)
        out = lm._apply_rope(
            out, self.rope, rope_dim=self.rope_dim, offset=start_pos, inverse=True
        )
        out = self.o_a_proj(out.reshape(B * R, self.o_groups, 1, -1), self._group_ids)
        return self.o_b_proj(out.reshape(B, R, -1))


def make_stage(args: lm.ModelArgs, layer_id: int) -> lm.DecoderLayer:
    """Stage ``layer_id - num_hidden_layers``: mlx-lm's decoder layer (a window-only
    one: the stages' compress ratios are 0) with `StageAttention`."""
    stage = lm.DecoderLayer(args, layer_id)
    stage.self_attn.__class__ = StageAttention  # its parameters are the same
    return stage


class DSparkV41(dspark.DSpark):
    """V4.1's DSpark drafter (module docstring), a `DSpark` whose layers are V4.1
    stages: its spec, block inputs, Markov head and confidence head are DSpark's.

    Args:
        args: The trunk's args.
        config: The model's ``config.json``.

    Parameter names: ``main_proj``, ``main_norm``, ``layers.{j}.*`` (mlx-lm's V4.1
    layer names), ``norm``, ``markov_head.markov_w1``/``markov_w2`` (W1, W2) and
    ``confidence_head.proj``.
    """

    TAPS = StreamInputTaps
    # a stage's pass takes one position for every row, as the trunk's: streams
    # decoded together keep their context caches apart (`mlx_mtp.rows.Rows`)
    rows_apart = True

    def __init__(self, args: lm.ModelArgs, config: dict):
        nn.Module.__init__(self)
        text = text_config(config)
        self.spec = spec_of(text)
        self.args = args
        H, V, r = args.hidden_size, args.vocab_size, self.spec.markov_rank
        stages = text.get("num_nextn_predict_layers") or 0
        self.windows = (args.sliding_window,) * stages
        self.softcap = None
        self.main_proj = nn.Linear(len(self.spec.target_layer_ids) * H, H, bias=False)
        self.main_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        L = args.num_hidden_layers
        stage = stage_args(args, text)
        self.layers = [make_stage(stage, L + j) for j in range(stages)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.markov_head = dspark.MarkovHead(V, r, H)
        self.confidence_head = dspark.ConfidenceHead(H + r, bias=False)

    def context(self, taps: mx.array, caches) -> None:
        """Append the context rows of committed positions to every stage's cache:
        ``taps`` ``(B, m, n * H)`` at positions ``cache.offset ..``."""
        main_x = self.main_norm(self.main_proj(taps))  # (B, m, H)
        for layer, cache in zip(self.layers, caches):
            kv = stage_kv(layer.self_attn, main_x, cache.offset)[:, None]
            cache.update_and_fetch(kv, kv)  # (B, 1, m, d): K = V

    def block(self, x: mx.array, context, position: int) -> mx.array:
        """The block pass: ``x`` ``(B, gamma, H)`` embedded block rows at positions
        ``position ..``; ``context[j]``: stage j's ``read_kv`` (its last
        ``context_windows`` rows). Returns ``(B, gamma, H)``: the last stage's
        streams collapsed by its pre-mix, before ``norm`` (what the confidence head
        reads; `head_input` norms them), slot k predicting position ``position + k
        + 1``. Nothing is written to any cache."""
        B, R, H = x.shape
        hc = self.args.hc_mult
        streams = mx.broadcast_to(x[:, :, None], (B, R, hc, H))
        pre_mix = (mx.arange(hc) == 0).astype(mx.float32)  # stream 0 alone
        pre_mix = mx.broadcast_to(pre_mix, (B, R, hc))
        for layer, seen in zip(self.layers, context):
            streams, pre_mix = layer(
                streams,
                pre_mix,
                start_pos=position,
                window_idx=None,
                cache=seen,
                shared=None,
            )
        return lm._collapse(streams, pre_mix)

    def head_input(self, x: mx.array) -> mx.array:
        """The head reads the last stage's ``norm`` of `block`'s collapses."""
        return self.norm(x)


# -- checkpoint names -> DSparkV41's ------------------------------------------------

_STAGE = re.compile(r"mtp\.(\d+)\.")
# The first stage's and the last stage's own tensors (``layers.{j}.<name>`` ->
# ``<name>``), and the Markov head's: W1 is ``embed``, W2 ``head``.
_FIRST = ("main_proj.", "main_norm.")
_LAST = ("norm.", "confidence_head.")
_MARKOV = {
    "markov_head.embed.": "markov_head.markov_w1.",
    "markov_head.head.": "markov_head.markov_w2.",
}


def stage_of(key: str) -> int:
    """The stage of a ``mtp.{j}.*`` tensor."""
    return int(_STAGE.match(key)[1])


def check_stages(weights: dict, text: dict) -> int:
    """The stage count ``num_nextn_predict_layers``, checked against the stages the
    checkpoint has (``mtp.0 ..``), each with its attention.

    Raises:
        MissingHeadsError: a stage is missing or extra (one line).
    """
    declared = text.get("num_nextn_predict_layers") or 0
    found = sorted({stage_of(k) for k in weights})
    if found != list(range(declared)):
        raise MissingHeadsError(
            f"the config declares {declared} DSpark stages (num_nextn_predict_layers) "
            f"but the checkpoint has mtp.{{{','.join(map(str, found))}}}"
        )
    for j in found:
        if f"mtp.{j}.attn.wkv.weight" not in weights:
            raise MissingHeadsError(
                f"DSpark stage mtp.{j} lacks mtp.{j}.attn.wkv.weight"
            )
    return declared


def sanitize(weights: dict, config: dict, trunk) -> dict:
    """``mtp.{j}.*`` (DeepSeek's names and release dtypes) -> `DSparkV41`'s names:
    each stage's tensors pass through mlx-lm's V4.1 sanitize as ``layers.{j}.*``
    (renames, stacked experts, FP8 / FP4 repacking, ``wo_a`` groups) with the
    stages' expert count; ``main_proj``, ``main_norm`` (stage 0), ``norm`` and the
    heads (the last stage) become the drafter's own; copies of the trunk's
    ``embed`` / ``head`` in a stage are checked and dropped.

    Raises:
        MissingHeadsError: stages missing, or a copy that is not the trunk's.
    """
    text = text_config(config)
    last = check_stages(weights, text) - 1
    copies = {"embed.weight": trunk.model.embed_tokens, "head.weight": trunk.lm_head}
    local = {}
    for key, value in weights.items():
        j, name = stage_of(key), key[len(_STAGE.match(key)[0]) :]
        if name in copies:
            check_copy(value, copies[name].weight, key)
            continue
        local[f"layers.{j}.{name}"] = value
    stages = types.SimpleNamespace(args=stage_args(trunk.args, text))
    out = {}
    for key, value in lm.Model.sanitize(stages, local).items():
        out[_own_name(key.removeprefix("model."), last)] = value
    return out


def _own_name(name: str, last: int) -> str:
    """``layers.{j}.<name>`` -> the drafter's own name for stage 0's and the last
    stage's own tensors; other names unchanged."""
    j, _, rest = name[len("layers.") :].partition(".")
    if int(j) == 0 and rest.startswith(_FIRST):
        return rest
    if int(j) == last and rest.startswith(_LAST):
        return rest
    for part, own in _MARKOV.items():
        if int(j) == last and rest.startswith(part):
            return own + rest[len(part) :]
    return name

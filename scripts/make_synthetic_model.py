"""A float32 llama- or Qwen3.5-layout checkpoint whose MTP head is accepted at a chosen
rate.

Speed claims need models whose drafts are accepted at a known rate, so that the
runtime's own efficiency (measured speedup / the speedup the acceptance allows) can be
read off independently of head quality. The construction:

- trunk: random llama weights at a real size (--params), embedding scaled so the
  residual stream is dominated by the current token, attention / MLP outputs damped;
  the untied ``lm_head`` maps token x's direction to pi(x), pi one long random cycle,
  so the trunk's greedy next token is pi(x_t) and never loops early. With
  ``--draft-vocab-size N`` the cycle runs over N tokens only and the other rows of
  ``lm_head`` are zero, so the trunk emits those N tokens (a real model's output mass
  is concentrated likewise) and the heads draft from them alone (FR-Spec style, as
  ``mlx-mtp train-heads`` writes them): a draft step then reads N rows of the head;
- head (DeepSeek-style, ``model.layers.{L}``): ``eh_proj = [I | gamma * R]`` passes the
  next token's embedding through (predicting pi(x_{t+1}) = x_{t+2}) plus noise driven by
  the trunk's hidden state; gamma is set by bisection so that teacher-forced agreement
  on greedy continuations equals --acceptance.

    python scripts/make_synthetic_model.py OUT --acceptance 0.7 [--params 300e6]
        [--draft-vocab-size 4096] [--layout qwen3_5 | deepseek_v4]

Without ``--draft-vocab-size`` the heads are in the Hugging Face layout
(``model.layers.{L}.*``); with it, the folder is an mlx-mtp conversion (trunk in
``model.safetensors``, heads and their draft vocabulary in ``mtp.safetensors``).

``--layout qwen3_5`` builds the same construction on a dense Qwen3.5 trunk: groups of
three Gated-DeltaNet layers and one gated full-attention layer (the small Qwen3.5
shapes at --hidden 1024: 12 layers at 300M), whose damped outputs include the
Gated-DeltaNet ``out_proj``; the trunk is written as an MLX conversion
(``language_model.*``, norms as scales, conv weights ``(C, K, 1)``), which mlx-lm's
``load`` takes as is (it drops ``mtp.*``), and the head as Qwen's one MTP layer
(``mtp.fc`` = ``eh_proj``, ``mtp.pre_fc_norm_*``, ``mtp.norm``, ``mtp.layers.0.*`` a
full-attention decoder layer). At 300M, gamma 6.74 gives depth-1 agreement 0.70.

``--layout deepseek_v4`` builds it on DeepSeek-V4-Flash's release layout (DeepSeek's
tensor names, ``mtp.0.e_proj`` / ``h_proj`` kept apart), from the test fixtures' builder
(`mlx_mtp.testing.fixtures`) at the release's shapes scaled by --hidden / 4096
(`deepseek_v4_config`): compress ratios 0, 0, then 4 and 16 alternating (the release's
128 scaled down; the fixture knows 0, 4 and 16), a 64-token window, 16 routed experts
(top 2) and a shared one, hash routing on the first 3 layers, hc_mult 4 with 20
Sinkhorn iterations. Its linear weights are rescaled to mlx-lm's initialisation (std
1 / sqrt(3 fan-in)), the hyper-connections' ``fn`` to the fixture's spread, and the
damped outputs are ``wo_b`` and the experts' ``w2``; the head's ``eh_proj`` is written
as ``e_proj = I``, ``h_proj = gamma * R`` (applied to each of the 4 streams).

``--zipf S`` makes a model for sampling (temperature 1) instead (vocabulary 32768
unless ``--vocab`` says otherwise; not with ``--draft-vocab-size``). Token
``zipf_order[r]`` gets the Zipf weight Z ∝ 1/(r+1)^S, ``zipf_order`` a random
permutation; the cycle pi runs through the Zipf ranks in order, shuffled within blocks
of 64, so that the trunk's output as a whole is Zipf-like; and the trunk's next-token
distribution after x is about the mixture p(pi(x)) = --follow (0.7), the rest spread
∝ Z:

- every embedding is ``EMBED_SCALE * (d_x + u) / sqrt(2)``, d_x a random unit direction
  orthogonal to a fixed unit vector u, so the final-norm hidden state h has a nearly
  constant component m = h·u (measured, as are n = h·d_x and the rms s of h·d_y,
  y != x);
- ``lm_head`` row y is ``alpha_y * d_{pi^-1(y)} + beta_y * u``, with
  ``alpha_y n = lead - log Z(y) + (alpha_y s)^2 / 2`` and
  ``beta_y m = log Z(y) - (alpha_y s)^2 / 2 - alpha_y c·d_{pi^-1(y)}`` (c: the mean of
  h off u, a nearly constant vector the damped layers add): the successor gets the logit
  ``lead``, every other token log Z(y) plus cross-term noise of std alpha_y s (about
  (lead - log Z(y)) / sqrt(H): 0.1 for the top tokens, 0.5 for the rarest at
  H = 1024; the -(alpha_y s)^2 / 2 keeps its mean over contexts Zipf);
  ``lead`` is set by bisection so that the mean p(pi(x)) over random contexts, then over
  contexts sampled from the trunk, is --follow;
- the head is built as above but for ``eh_proj = [M | gamma * R]``: M maps the
  normalized embedding sqrt(H / 2) (d_x + u) to the trunk's mean hidden state at x,
  n d_x + m u + c (with I, q lacks c, which the head's one block does not make: at
  300M the acceptance at gamma 0 was 0.74 and rose with gamma before it fell; with M it
  is 0.94 and falls monotonically). gamma is set so that the expected acceptance of a
  sampled draft, mean over positions of sum_y min(p(y), q(y)) (teacher-forced on sampled
  continuations, p the trunk's distribution at the position the head predicts, both at
  temperature 1), equals --acceptance.

``synthetic.json`` then records the measured trunk p(successor), the sampled acceptance,
and the coverage by the top-N Zipf-ranked tokens (N = 1024 ... 16384) of the expected
next-token distribution averaged over sampled contexts (``coverage``), of its
non-successor part (``coverage_non_successor``) and of the sampled tokens (``sampled``).

    python scripts/make_synthetic_model.py OUT --zipf 1.15 --acceptance 0.66
"""

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

from mlx_mtp.models import get_family  # noqa: E402

EMBED_SCALE = 8.0
LOCAL = 64  # --zipf: the successor cycle keeps to blocks of this many Zipf ranks
DAMPING = 0.2
ZIPF_VOCAB = 32768  # the vocabulary of a --zipf model, unless --vocab says otherwise
COVERAGE_N = (1024, 2048, 4096, 8192, 16384)


def llama_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    hd = 64
    heads = max(1, hidden // hd)
    kv = max(1, heads // 4)
    inter = 64 * round(2.75 * hidden / 64)
    per_layer = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    layers = max(2, round((params - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "float32",
    }


def qwen3_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    """The llama shapes as a Qwen3 checkpoint (``q_norm``/``k_norm`` in every layer,
    built as ones: a Qwen3 trunk whose norms are those of its initialisation)."""
    config = llama_config(params, vocab, hidden)
    config.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        hidden_act="silu",
        attention_bias=False,
    )
    return config


def qwen3_5_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    """A dense Qwen3.5 text model as its Hugging Face config nests it: repeating groups
    of three Gated-DeltaNet layers and one gated full-attention layer (head_dim 256,
    partial rotary 0.25), the small Qwen3.5 shapes at ``hidden`` 1024, one MTP layer;
    untied ``lm_head`` (the construction needs its own rows)."""
    interval = 4
    linear_heads = max(1, hidden // 64)
    heads, kv, hd, lhd = max(1, hidden // 128), max(1, hidden // 512), 256, 128
    inter = 64 * round(3.5 * hidden / 64)
    key_dim = value_dim = linear_heads * lhd
    gdn = hidden * (2 * key_dim + 2 * value_dim + 2 * linear_heads) + value_dim * hidden
    attn = hidden * hd * (2 * heads + 2 * kv) + heads * hd * hidden
    per_layer = (3 * gdn + attn) / interval + 3 * hidden * inter
    groups = max(1, round((params - 2 * vocab * hidden) / per_layer / interval))
    layers = interval * groups
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "linear_num_key_heads": linear_heads,
        "linear_num_value_heads": linear_heads,
        "linear_key_head_dim": lhd,
        "linear_value_head_dim": lhd,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": interval,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * groups,
        "attn_output_gate": True,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


V4_RATIOS = (4, 16)  # the compressed layers' ratios, alternating after two window ones
V4_EXPERTS, V4_TOP_K, V4_WINDOW, V4_INDEX_TOPK, V4_HC = 16, 2, 64, 16, 4
_V4_DERIVED = ("layer_types", "compress_rates")  # `_v4_config` writes these


def deepseek_v4_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    """DeepSeek-V4-Flash's release config (the fixture's keys, `_v4_config`) with its
    shapes scaled by ``hidden`` / 4096 (heads, head_dim, q / o ranks, indexer; experts
    of width hidden / 4), as many layers as ``params`` allows, one MTP layer."""
    from mlx_mtp.testing.fixtures import _v4_config

    s = hidden / 4096
    heads, d = max(4, round(64 * s)), max(32, round(512 * s))
    groups, rank, inter = 4, max(32, round(1024 * s)), max(32, hidden // 4)
    ih, c = max(4, round(64 * s)), max(16, round(128 * s))
    attn = hidden * rank + rank * heads * d + hidden * d + heads * d * rank
    attn += groups * rank * hidden
    compressed = (4 * d * hidden + rank * ih * c + hidden * ih + 4 * c * hidden) / 2
    compressed += d * hidden / 2  # the mean of a ratio-4 layer and a ratio-16 one
    moe = (V4_EXPERTS + 1) * 3 * hidden * inter + V4_EXPERTS * hidden
    hc = 2 * (2 + V4_HC) * V4_HC * V4_HC * hidden  # two hyper-connections' fn
    layers = max(
        3, round((params - 2 * vocab * hidden) / (attn + compressed + moe + hc))
    )
    ratios = ([0, 0] + list(V4_RATIOS) * layers)[:layers] + [0]
    return _v4_config(
        vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=d,
        qk_rope_head_dim=d // 8,
        q_lora_rank=rank,
        o_groups=groups,
        o_lora_rank=rank,
        moe_intermediate_size=inter,
        n_routed_experts=V4_EXPERTS,
        num_experts_per_tok=V4_TOP_K,
        swiglu_limit=10.0,
        num_hash_layers=3,
        sliding_window=V4_WINDOW,
        compress_ratios=ratios,
        index_n_heads=ih,
        index_head_dim=c,
        index_topk=V4_INDEX_TOPK,
        hc_mult=V4_HC,
        hc_sinkhorn_iters=20,
    )


def deepseek_v4_weights(config: dict, seed: int) -> dict:
    """The fixture builder's random release-layout tensors for ``config``, MTP layer
    included: linear weights rescaled from the fixture's std to mlx-lm's init (its
    0.1 at fan-in 64 would grow activations 3x a projection at 1024), ``hc_*_fn`` to
    the spread of their logits at the fixture's hidden size."""
    from mlx_mtp.testing import fixtures

    options = {k: v for k, v in config.items() if k not in _V4_DERIVED}
    init = fixtures._Init(np.random.default_rng(seed))
    tensors = fixtures._deepseek_v4(init, **options)[1]
    hc = np.sqrt(fixtures.HIDDEN / config["hidden_size"])
    out = {}
    for k, v in tensors.items():
        if k.endswith(".weight") and v.ndim == 2:
            v = v / (fixtures.WEIGHT_STD * np.sqrt(3.0 * v.shape[1]))
        elif k.endswith("_fn"):
            v = v * hc
        out[k] = mx.array(v)
    return out


def qwen4_exp_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    """Qwen3.8-Flash-Next's release config (the fixture's keys, `_qwen4_exp`) with
    its shapes scaled by ``hidden`` / 2560: 4 hyper-connection streams (low rank
    hidden / 8), Gated-DeltaNet and QSA layers 3:1 (QSA: 8 heads of 128, 2 KV heads,
    its indexer's 4 heads of 64, a budget of 256 keys in blocks of 4), 16 experts
    (top 4) of width hidden / 4 and a shared one, a PLE n-gram embedding on the
    second layer, as many layers (a multiple of 4) as ``params`` allows, one MTP
    layer."""
    from mlx_mtp.testing import fixtures

    heads, d, kv = 8, 128, 2
    kh, vh, hd = 8, 16, 64
    experts, inter, rank = 16, hidden // 4, hidden // 8
    attn = hidden * heads * d * 3 + 2 * hidden * kv * d + hidden * 5 * 64
    gdn = hidden * (2 * kh * hd + 2 * vh * hd) + vh * hd * hidden
    mixer = 4 * (2 * 4 * hidden * rank + 4 * 4 * hidden)
    moe = (experts + 1) * 3 * hidden * inter + experts * hidden
    per_group = attn + 3 * gdn + 4 * (mixer + moe)
    groups = max(1, round((params - 2 * vocab * hidden) / per_group))
    layers = 4 * groups
    sizes = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * groups,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d,
        rope_parameters={
            "mrope_interleaved": True,
            "mrope_section": [6, 5, 5],  # 32 of 128 dims rotate
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        linear_num_key_heads=kh,
        linear_num_value_heads=vh,
        linear_key_head_dim=hd,
        linear_value_head_dim=hd,
        num_experts=experts,
        num_experts_per_tok=4,
        moe_intermediate_size=inter,
        shared_expert_intermediate_size=inter,
        hc_lowrank=rank,
        indexer_n_heads=4,
        indexer_head_dim=64,
        indexer_budget=256,
        ple_embed_dim=hidden,
        heads_per_ngram=8,
        ngram_vocab_size_base=4096,
        make_ngram_vocab_size_divisible_by=128,
        split_ngram_parts=4,
    )
    init = fixtures._Init(np.random.default_rng(0))
    config = fixtures._qwen4_exp(init, vocab, **sizes)[0]
    config["_sizes"] = sizes
    return config


def qwen4_exp_weights(config: dict, seed: int) -> dict:
    """The fixture builder's random release-layout tensors for ``config``, MTP
    included, linear weights (and the fused experts, per expert) rescaled from the
    fixture's std to mlx-lm's init, as for deepseek_v4; the MTP's final mixer a copy
    of the trunk's, so that its collapse reads as the trunk's does."""
    from mlx_mtp.testing import fixtures

    init = fixtures._Init(np.random.default_rng(seed))
    tensors = fixtures._qwen4_exp(
        init, config["text_config"]["vocab_size"], **config.pop("_sizes")
    )[1]
    out = {}
    for k, v in tensors.items():
        if k.startswith("model.visual."):
            continue
        if (k.endswith(".weight") and v.ndim == 2 and v.dtype != np.int64) or (
            ".experts." in k and v.ndim == 3
        ):
            v = v / (fixtures.WEIGHT_STD * np.sqrt(3.0 * v.shape[-1]))
        out[k] = mx.array(v)
    mixer = "hyper_connection_mixer."
    for k in [k for k in out if k.startswith(f"model.language_model.{mixer}")]:
        out[f"mtp.{mixer}{k.rpartition(mixer)[2]}"] = out[k]
    return out


@dataclass(frozen=True)
class Arch:
    """What the construction needs of a layout: its config, mlx-lm trunk and MTP block
    classes, and the names of the tensors it rewires. The weights are named as the
    mlx-lm trunk's parameters (for llama also the Hugging Face names; for qwen3_5 an
    MLX conversion, which both loaders take as is), the MTP tensors as the family's
    checkpoints name them; a layout with ``weights`` (deepseek_v4: mlx-lm has no
    trunk for it) draws them all there, in its release's names."""

    model_type: str
    config: Callable[[float, int, int], dict]
    embed: str
    lm_head: str
    final_norm: str
    block_prefix: Callable[[dict], str]  # where the MTP block's tensors sit
    # random weights in the checkpoint's names, MTP layer included (None: the mlx-lm
    # trunk's and `block`'s)
    weights: Optional[Callable[[dict, int], dict]] = None
    unit_norm: float = 1.0  # a norm weight that scales by one (0: zero-centred)

    @property
    def layout(self):
        return get_family({"model_type": self.model_type}).LAYOUT

    def is_head(self, key: str, config: dict) -> bool:
        return key.startswith(self.layout.prefix(config, 0))

    def trunk(self, config: dict):
        """A fresh mlx-lm trunk (random weights, from MLX's global generator)."""
        if self.model_type in ("llama", "qwen3"):
            module = importlib.import_module(f"mlx_lm.models.{self.model_type}")
            return module.Model(module.ModelArgs.from_dict(config))
        from mlx_lm.models import qwen3_5

        return qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))

    def block(self, config: dict):
        """A fresh MTP block: the family's full-attention decoder layer."""
        if self.model_type in ("llama", "qwen3"):
            module = importlib.import_module(f"mlx_lm.models.{self.model_type}")
            return module.TransformerBlock(module.ModelArgs.from_dict(config))
        from mlx_lm.models import qwen3_5

        text = qwen3_5.TextModelArgs.from_dict(config["text_config"])
        return qwen3_5.DecoderLayer(text, text.full_attention_interval - 1)


ARCHS = {
    "llama": Arch(
        "llama",
        llama_config,
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        lambda config: ARCHS["llama"].layout.prefix(config, 0),  # DeepSeek-style
    ),
    "qwen3": Arch(
        "qwen3",
        qwen3_config,
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        lambda config: ARCHS["qwen3"].layout.prefix(config, 0),  # DeepSeek-style
    ),
    "qwen3_5": Arch(
        "qwen3_5",
        qwen3_5_config,
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.norm.weight",
        lambda config: "mtp.layers.0.",
    ),
    "deepseek_v4": Arch(
        "deepseek_v4",
        deepseek_v4_config,
        "embed.weight",
        "head.weight",
        "norm.weight",
        lambda config: "mtp.0.",
        deepseek_v4_weights,
    ),
    "qwen4_exp": Arch(
        "qwen4_exp",
        qwen4_exp_config,
        "model.language_model.embed_tokens.weight",
        "lm_head.weight",
        None,  # no final norm: the streams' mixer closes the trunk
        lambda config: "mtp.layers.0.",
        qwen4_exp_weights,
        unit_norm=0.0,
    ),
}
# The trunk's and the head's block outputs, damped: attention, Gated-DeltaNet, MLP
# (V4: attention's wo_b, the experts' w2).
DAMPED = (
    "o_proj.weight",
    "out_proj.weight",
    "down_proj.weight",
    "wo_b.weight",
    ".w2.weight",
    "experts.down_proj",  # fused experts (qwen4_exp)
    "ple.value_proj.weight",  # qwen4_exp's n-gram embedding, added to the streams
)


def build_weights(arch: Arch, config: dict, seed: int, cycle: int = 0, zipf=0.0):
    """The weights (``lm_head`` zero with ``zipf``: `zipf_head` writes it once the
    hidden states are measured), the emitted tokens, with ``zipf`` the parts
    `zipf_head` needs (None without), and pi (without ``zipf``: None with, where
    the successor is the parts' ``succ``) as an array: token x's successor."""
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    if arch.weights is not None:
        w = arch.weights(config, seed)
    else:
        w = {k: v for k, v in tree_flatten(arch.trunk(config).parameters())}
    text = config.get("text_config", config)
    V, H = text["vocab_size"], text["hidden_size"]
    embed = mx.random.normal((V, H)) * (EMBED_SCALE / np.sqrt(H))
    w[arch.embed] = embed
    for k in list(w):
        if k.endswith(DAMPED):
            w[k] = w[k] * DAMPING
    order = rng.permutation(V)[: cycle or V]  # the tokens the trunk emits
    inverse = np.zeros(V, dtype=np.int64)  # lm_head row pi(x) = direction of x
    inverse[order] = np.roll(order, 1)  # pi(order[i]) = order[i + 1]
    parts = successor = None
    if zipf:
        parts = zipf_parts(embed, order, rng, zipf)
        w[arch.embed] = parts.pop("embed")
        w[arch.lm_head] = mx.zeros((V, H))
    else:
        unit = embed / mx.linalg.norm(embed, axis=-1, keepdims=True)
        emitted = np.zeros((V, 1), dtype=np.float32)
        emitted[order] = 4.0
        w[arch.lm_head] = unit[mx.array(inverse)] * mx.array(emitted)
        # row pi(x) of lm_head is x's direction; a token the trunk never emits has
        # no pi (a random successor: a drafter then knows nothing of it)
        successor = rng.integers(0, V, V)
        successor[inverse[order]] = order
    prefix = arch.block_prefix(config)
    if arch.weights is None:  # else the block came with them (and is damped)
        for k, v in tree_flatten(arch.block(config).parameters()):  # after embed
            w[f"{prefix}{k}"] = v * (DAMPING if k.endswith(DAMPED) else 1.0)
    layout = arch.layout
    for name in ("enorm", "hnorm"):
        key = layout.key(config, 0, name)
        w[key] = mx.full(w[key].shape if key in w else (H,), arch.unit_norm)
    if "norm" in layout.fusion.values():  # else the layer has no final norm
        w[layout.key(config, 0, "norm")] = mx.array(w[arch.final_norm])
    w["_noise"] = mx.random.normal((H, H)) / np.sqrt(H)
    return w, np.sort(order), parts, successor


def zipf_parts(embed: mx.array, order, rng, zipf: float) -> dict:
    """--zipf: embeddings with a shared component along a unit vector u, the token
    directions orthogonal to it, the successor map and the Zipf log-weights."""
    V, H = embed.shape
    u = rng.standard_normal(H)
    u = mx.array(u / np.linalg.norm(u), dtype=mx.float32)
    dirs = embed - (embed @ u)[:, None] * u
    dirs = dirs / mx.linalg.norm(dirs, axis=-1, keepdims=True)
    zipf_order = rng.permutation(V)
    # The cycle runs through the Zipf ranks, shuffled within blocks of LOCAL ranks:
    # after any token the trunk most likely goes on to one of about the same rank, so
    # its output as a whole is Zipf-distributed (as a real model's is), not only the
    # share it does not follow the cycle.
    cycle = np.concatenate(
        [rng.permutation(zipf_order[i : i + LOCAL]) for i in range(0, V, LOCAL)]
    )
    succ = np.zeros(V, dtype=np.int64)
    succ[cycle] = np.roll(cycle, -1)  # pi(cycle[i]) = cycle[i + 1]
    inverse = np.zeros(V, dtype=np.int64)
    inverse[succ] = np.arange(V)
    logz = np.zeros(V)
    logz[zipf_order] = -zipf * np.log(np.arange(1, V + 1))
    logz -= np.logaddexp.reduce(logz)
    return {
        "embed": EMBED_SCALE * (dirs + u) / np.sqrt(2.0),
        "dirs": dirs,
        "u": u,
        "succ": succ,
        "inverse": inverse,
        "zipf_order": zipf_order,
        "logz": logz,
    }


def zipf_stats(parts: dict, h: mx.array, tokens: mx.array) -> dict:
    """Statistics of post-norm hidden states ``h`` (N, H) at ``tokens`` (N,): m = mean
    h·u; the mean of h off u, c (the damped layers add a nearly constant vector; its
    products with the directions, kept in ``parts["const"]``, would raise some tokens
    everywhere, so `zipf_coefficients` cancels them through u); n = mean (h - c)·d_x
    and s = rms of (h - c)·d_y over y != x."""
    hu = h @ parts["u"]
    mean = h.mean(0)
    c = mean - (mean @ parts["u"]) * parts["u"]
    const = parts["dirs"] @ c
    dots = h @ parts["dirs"].T - const
    own = mx.take_along_axis(dots, tokens[:, None], axis=1)[:, 0]
    N, V = dots.shape
    s2 = ((dots * dots).sum() - (own * own).sum()) / (N * (V - 1))
    parts["const"], parts["c"] = np.array(const), c
    norm = mx.linalg.norm(h, axis=-1).mean()
    return {
        "n": own.mean().item(),
        "m": hu.mean().item(),
        "s": mx.sqrt(s2).item(),
        "m_rel_std": (mx.sqrt(((hu - hu.mean()) ** 2).mean()) / hu.mean()).item(),
        "mean_off_u_rel": (mx.linalg.norm(c) / norm).item(),
    }


def zipf_passthrough(parts: dict, stats: dict) -> mx.array:
    """The head's ``eh_proj[:, :H]``: enorm(embedding of x) = sqrt(H / 2) (d_x + u) ->
    n d_x + m u + c, the trunk's mean hidden state at x."""
    u, H = parts["u"], parts["u"].shape[0]
    k = float(np.sqrt(2.0 / H))
    off = k * (stats["m"] * u + parts["c"])
    return k * stats["n"] * (mx.eye(H) - u[:, None] * u) + off[:, None] * u


def zipf_coefficients(parts: dict, stats: dict, lead: float):
    """``lm_head`` row y = alpha_y * d_{pi^-1(y)} + beta_y * u."""
    n, m, s = stats["n"], stats["m"], stats["s"]
    logz = parts["logz"]
    alpha = (lead - logz) / n
    for _ in range(4):  # alpha_y n - (alpha_y s)^2 / 2 = lead - log Z(y)
        alpha = (lead - logz + (alpha * s) ** 2 / 2) / n
    const = parts["const"][parts["inverse"]]
    beta = (logz - (alpha * s) ** 2 / 2 - alpha * const) / m
    return mx.array(alpha, dtype=mx.float32), mx.array(beta, dtype=mx.float32)


def zipf_head(parts: dict, stats: dict, lead: float) -> mx.array:
    alpha, beta = zipf_coefficients(parts, stats, lead)
    rows = parts["dirs"][mx.array(parts["inverse"])]
    return alpha[:, None] * rows + beta[:, None] * parts["u"]


def zipf_lead(parts: dict, stats: dict, h: mx.array, tokens: mx.array, follow: float):
    """The successor logit ``lead`` at which the mean p(pi(x)) over the rows is
    ``follow`` (bisection; the rows' hidden states do not depend on ``lm_head``)."""
    dots = (h @ parts["dirs"].T)[:, mx.array(parts["inverse"])]  # h·d_{pi^-1(y)}
    hu = (h @ parts["u"])[:, None]
    succ = mx.array(parts["succ"])[tokens][:, None]

    def p_succ(lead):
        alpha, beta = zipf_coefficients(parts, stats, lead)
        logits = dots * alpha + hu * beta
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.exp(mx.take_along_axis(logp, succ, axis=1)).mean().item()

    lo, hi = -10.0, 30.0
    for _ in range(30):
        lead = (lo + hi) / 2
        if p_succ(lead) < follow:
            lo = lead
        else:
            hi = lead
    return (lo + hi) / 2


def sampled_features(model, vocab_size: int, rng, seed: int, length: int = 256):
    """Continuations of random prompts sampled from the trunk at temperature 1, with
    their hidden states and the trunk's log-probabilities."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=1.0)
    features = []
    for _ in range(4):
        prompt = rng.integers(0, vocab_size, 8).tolist()
        steps = generate_step(
            mx.array(prompt), model.trunk, max_tokens=length, sampler=sampler
        )
        seq = mx.array(prompt + [int(t) for t, _ in steps])[None]
        h = model.hidden(seq)
        logits = model.logits(h)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(h, logp)
        features.append((seq, h, logp, len(prompt)))
    return features


def sampled_acceptance(model, features) -> float:
    """Teacher-forced expected acceptance of a depth-1 draft sampled at temperature 1:
    mean over rows of sum_y min(p(y), q(y)), p the trunk's distribution at the
    position the head predicts."""
    total = rows = 0
    for seq, h, logp, _ in features:
        z = model.mtp_forward(0, h[:, :-1], seq[:, 1:])
        q = mx.softmax(model.logits(z), axis=-1)  # row i predicts token i + 2
        total += mx.minimum(mx.exp(logp[:, 1:]), q).sum().item()
        rows += q.shape[1]
    return total / rows


def zipf_report(parts: dict, features) -> dict:
    """The trunk's measured distribution over the sampled contexts."""
    succ = mx.array(parts["succ"])
    order = mx.array(parts["zipf_order"])
    logz = mx.array(parts["logz"], dtype=mx.float32)
    V = logz.shape[0]
    p_succ, mean_p, mean_ns, corr, rows = 0.0, 0.0, 0.0, 0.0, 0
    sampled, jumped, followed = [], [], 0
    for seq, h, logp, n_prompt in features:
        tokens = seq[0]
        logp = logp[0]
        s = succ[tokens][:, None]
        p = mx.exp(logp)
        ps = mx.take_along_axis(p, s, axis=1)
        is_succ = mx.arange(V)[None] == s
        ns = mx.where(is_succ, 0.0, p) / (1 - ps)
        # Pearson correlation of log p with log Z over the non-successor tokens.
        keep = mx.logical_not(is_succ)
        k = V - 1
        a = mx.where(keep, logp, 0.0)
        b = mx.where(keep, logz[None], 0.0)
        am, bm = a.sum(1, keepdims=True) / k, b.sum(1, keepdims=True) / k
        cov = (mx.where(keep, (a - am) * (b - bm), 0.0)).sum(1)
        va = mx.where(keep, (a - am) ** 2, 0.0).sum(1)
        vb = mx.where(keep, (b - bm) ** 2, 0.0).sum(1)
        corr += (cov / mx.sqrt(va * vb)).sum().item()
        p_succ += ps.sum().item()
        mean_p = mean_p + p.sum(0)
        mean_ns = mean_ns + ns.sum(0)
        rows += p.shape[0]
        gen = np.array(tokens).tolist()
        for prev, t in zip(gen[n_prompt - 1 : -1], gen[n_prompt:]):
            sampled.append(t)
            if t == parts["succ"][prev]:
                followed += 1
            else:
                jumped.append(t)
    mean_p, mean_ns = mean_p / rows, mean_ns / rows
    rank = np.zeros(V, dtype=np.int64)
    rank[parts["zipf_order"]] = np.arange(V)
    cum = np.cumsum(np.array(mean_p[order]))
    cum_ns = np.cumsum(np.array(mean_ns[order]))
    cum_z = np.cumsum(np.exp(parts["logz"][parts["zipf_order"]]))
    ranks = rank[np.array(sampled)]
    jumped_ranks = rank[np.array(jumped, dtype=np.int64)]
    counts = np.bincount(np.array(jumped, dtype=np.int64), minlength=V)
    top = np.argsort(-counts, kind="stable")[:10]
    return {
        "trunk_p_successor": p_succ / rows,
        "zipf_logp_correlation": corr / rows,
        "coverage": {N: float(cum[N - 1]) for N in COVERAGE_N if N <= V},
        "coverage_non_successor": {
            N: float(cum_ns[N - 1]) for N in COVERAGE_N if N <= V
        },
        "coverage_zipf": {N: float(cum_z[N - 1]) for N in COVERAGE_N if N <= V},
        "sampled": {
            "tokens": len(sampled),
            "successor_fraction": followed / len(sampled),
            "coverage": {N: float((ranks < N).mean()) for N in COVERAGE_N if N <= V},
            "coverage_non_successor": {
                N: float((jumped_ranks < N).mean()) for N in COVERAGE_N if N <= V
            },
            # the most frequent sampled non-successor tokens
            "top10_counts": counts[top].tolist(),
            "top10_zipf_ranks": rank[top].tolist(),
        },
    }


def write_conversion(out: Path, arch: Arch, config: dict, w: dict, vocab, info) -> None:
    """Rewrite ``out`` as an mlx-mtp conversion whose heads draft from ``vocab``."""
    from mlx_mtp.heads import HEADS_FILE, heads_section, save_heads
    from mlx_mtp.loading import load_model
    from mlx_mtp.models.mtp import MTPStack

    model = load_model(str(out))[0]
    stack = MTPStack(list(model.mtp.layers), len(vocab))
    stack.draft_vocab = mx.array(vocab, dtype=mx.int32)
    trunk = {k: v for k, v in w.items() if not arch.is_head(k, config)}
    mx.save_safetensors(str(out / "model.safetensors"), trunk, {"format": "pt"})
    save_heads(out / HEADS_FILE, stack)
    config = dict(config)
    config["mtp"] = heads_section(stack, None, {"source": None, "synthetic": info})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def set_gamma(
    arch: Arch, w: dict, config: dict, gamma: float, passthrough=None
) -> None:
    """``eh_proj = [passthrough | gamma R]`` (its halves apart, where the layout
    keeps them so)."""
    H = w["_noise"].shape[0]
    passthrough = mx.eye(H) if passthrough is None else passthrough
    layout = arch.layout
    if layout.halves:
        prefix = layout.prefix(config, 0)
        for name, half in zip(layout.halves, (passthrough, gamma * w["_noise"])):
            w[f"{prefix}{name}.weight"] = half
        return
    w[layout.key(config, 0, "eh_proj")] = mx.concatenate(
        [passthrough, gamma * w["_noise"]], axis=1
    )


def agreement(model, features, vocab=None) -> float:
    """Teacher-forced depth-1 agreement of the head with the trunk's greedy tokens
    (drafting from ``vocab`` only, when given)."""
    hits = total = 0
    for seq, h, greedy in features:
        z = model.mtp_forward(0, h[:, :-1], seq[:, 1:])
        logits = model.logits(z)
        if vocab is not None:
            logits = logits[..., vocab]
        pred = mx.argmax(logits, axis=-1)[0]  # row i predicts token i + 2
        if vocab is not None:
            pred = vocab[pred]
        hits += (pred == greedy[1:]).sum().item()
        total += pred.shape[0]
    return hits / total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--params", type=float, default=300e6)
    p.add_argument(
        "--vocab", type=int, default=None, help=f"32000 ({ZIPF_VOCAB} with --zipf)"
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout",
        choices=sorted(ARCHS),
        default="llama",
        help="llama or qwen3 (dense), qwen3_5 (Gated-DeltaNet and full attention, "
        "3:1), deepseek_v4 (V4-Flash's release layout) or qwen4_exp "
        "(Qwen3.8-Flash-Next's)",
    )
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=0,
        help="tokens the trunk emits and the heads draft from (0: all)",
    )
    p.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        help="Zipf exponent S of a model for sampling at temperature 1 (0: off)",
    )
    p.add_argument(
        "--follow",
        type=float,
        default=0.7,
        help="with --zipf: the trunk's mean probability of its successor token",
    )
    p.add_argument(
        "--dspark",
        type=Path,
        default=None,
        help="also write a predictable DSpark drafter folder for the model here "
        "(--layout llama or qwen3, not with --zipf)",
    )
    p.add_argument(
        "--dspark-acceptance",
        type=float,
        default=None,
        help="the drafter's first-slot acceptance (default: --acceptance)",
    )
    p.add_argument(
        "--drafter-kind",
        choices=["dspark", "dflash2"],
        default="dspark",
        help="the --dspark folder's kind: DSpark (DeepSpec's layout) or DFlash2 "
        "(z-lab's DFlash2DraftModel, its selector keeping every token)",
    )
    p.add_argument("--block-size", type=int, default=8, help="the drafter's block")
    p.add_argument("--dspark-layers", type=int, default=1)
    p.add_argument("--markov-rank", type=int, default=64)
    args = p.parse_args()
    if args.dspark and (args.layout not in ("llama", "qwen3") or args.zipf):
        p.error("--dspark needs --layout llama or qwen3, without --zipf")
    if args.layout in ("deepseek_v4", "qwen4_exp") and args.zipf:
        p.error(f"--zipf is not built for --layout {args.layout}")
    if args.zipf and args.draft_vocab_size:
        p.error("--zipf cannot be combined with --draft-vocab-size")
    if args.zipf < 0:
        p.error("--zipf must be >= 0")
    if args.zipf and not 0 < args.follow < 1:
        p.error("--follow must be in (0, 1)")
    if args.vocab is None:
        args.vocab = ZIPF_VOCAB if args.zipf else 32000
    blas = ensure_fast_blas()
    from mlx.utils import tree_unflatten
    from mlx_lm.generate import generate_step

    from mlx_mtp.loading import load_model
    from mlx_mtp.testing.fixtures import write_tokenizer

    arch = ARCHS[args.layout]
    config = arch.config(args.params, args.vocab, args.hidden)
    hidden = config.get("text_config", config)["hidden_size"]
    w, emitted, parts, successor = build_weights(
        arch, config, args.seed, args.draft_vocab_size, args.zipf
    )
    vocab = mx.array(emitted, dtype=mx.int32) if args.draft_vocab_size else None
    noise = w.pop("_noise")
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out, 512)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))

    def write(gamma):
        w["_noise"] = noise
        set_gamma(arch, w, config, gamma, passthrough)
        w.pop("_noise")
        mx.save_safetensors(str(args.out / "model.safetensors"), w, {"format": "pt"})
        return load_model(str(args.out))[0]

    passthrough = mx.eye(noise.shape[0])
    model = write(0.0)
    rng = np.random.default_rng(args.seed + 1)
    zipf = {}
    if args.zipf:
        # Hidden states do not depend on lm_head: the statistics on random tokens
        # (sampled contexts repeat the frequent ones); lead on random tokens, then
        # again on contexts sampled from that trunk (p(pi(x)) comes out ~0.01 lower
        # there); the measurements and gamma on contexts sampled from the final one.
        seq = mx.array(rng.integers(0, args.vocab, (4, 128)))
        h = model.hidden(seq).reshape(-1, hidden)
        seq = seq.reshape(-1)
        stats = zipf_stats(parts, h, seq)
        passthrough = zipf_passthrough(parts, stats)
        for i in range(2):
            lead = zipf_lead(parts, stats, h, seq, args.follow)
            w[arch.lm_head] = zipf_head(parts, stats, lead)
            model.trunk.update(tree_unflatten([(arch.lm_head, w[arch.lm_head])]))
            features = sampled_features(model, args.vocab, rng, args.seed + 2 + i)
            h = mx.concatenate([f[1][0] for f in features])
            seq = mx.concatenate([f[0][0] for f in features])
        zipf = {"zipf": args.zipf, "follow": args.follow, "lead": lead, **stats}
        zipf.update(zipf_report(parts, features))

        def score():
            return sampled_acceptance(model, features)

    else:
        features = []
        for _ in range(4):  # greedy continuations of random prompts, trunk states fixed
            prompt = rng.integers(0, args.vocab, 8).tolist()
            steps = generate_step(mx.array(prompt), model.trunk, max_tokens=120)
            seq = mx.array(prompt + [int(t) for t, _ in steps])[None]
            h = model.hidden(seq)
            features.append((seq, h, mx.argmax(model.logits(h), axis=-1)[0]))

        def score():
            return agreement(model, features, vocab)

    layer = model.mtp.layers[0]
    if args.zipf:  # the most the head can reach
        layer.eh_proj.weight = mx.concatenate([passthrough, 0 * noise], axis=1)
        zipf["sampled_acceptance_gamma0"] = score()
    lo, hi = 0.0, 64.0
    for _ in range(14):  # bisection on gamma: agreement falls as gamma grows
        gamma = (lo + hi) / 2
        layer.eh_proj.weight = mx.concatenate([passthrough, gamma * noise], axis=1)
        if score() > args.acceptance:
            lo = gamma
        else:
            hi = gamma
    gamma = (lo + hi) / 2
    layer.eh_proj.weight = mx.concatenate([passthrough, gamma * noise], axis=1)
    measured = score()
    write(gamma)
    trunk_params = sum(v.size for k, v in w.items() if not arch.is_head(k, config))
    info = {
        "target_acceptance": args.acceptance,
        "measured_agreement": measured,
        "gamma": gamma,
        "layout": args.layout,
        "trunk_parameters": trunk_params,
        "draft_vocab_size": args.draft_vocab_size,
        "blas": blas,
    }
    if zipf:  # the measured agreement is then the sampled acceptance
        info = {**info, "sampled_acceptance": measured, **zipf}
    if args.draft_vocab_size:
        write_conversion(args.out, arch, config, w, emitted, info)
    if args.dspark:
        info["dspark"] = write_drafter(args, config, features, successor)
    (args.out / "synthetic.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


def write_drafter(args, config: dict, features, successor) -> dict:
    """--dspark: a DSpark drafter folder for the target in ``args.out``, in DeepSpec's
    layout (`mlx_mtp.testing.dspark.write_dspark`, predictable): its Markov head
    carries pi for a share ``agree`` of the tokens, set so that the first slot's
    expected acceptance, ``agree`` times the share of positions at which the trunk's
    greedy token is pi of the current one (on the greedy continuations the head's
    gamma was set on), is --dspark-acceptance. With ``--drafter-kind dflash2`` a
    DFlash2 drafter (`write_dflash2`, predictable: its candidate selector carries pi
    the same way, every token a candidate) of ``--block-size`` proposals (its
    config's ``block_size`` counts the anchor row too), the selector of rank
    --markov-rank."""
    from mlx_mtp.testing.dspark import write_dflash2, write_dspark

    hits = total = 0
    for seq, _, greedy in features:  # past the 8-token random prompts: emitted tokens
        hits += (greedy[8:] == mx.array(successor)[seq[0, 8:]]).sum().item()
        total += greedy.shape[0] - 8
    follows = hits / total
    acceptance = args.dspark_acceptance or args.acceptance
    agree = min(1.0, acceptance / follows)
    layers = config["num_hidden_layers"]
    taps = sorted({1, layers // 2, layers - 2})  # spread, never the last layer
    hidden = config["hidden_size"]
    shape = dict(
        predictable=True,
        agree=agree,
        weight_std=1.0 / np.sqrt(hidden),
        layers=args.dspark_layers,
        target_layer_ids=taps,
        successor=successor,
    )
    if args.drafter_kind == "dflash2":
        write_dflash2(
            args.dspark,
            args.out,
            block_size=args.block_size + 1,
            selector_rank=args.markov_rank,
            group_size=64,
            **shape,
        )
    else:
        write_dspark(
            args.dspark,
            args.out,
            block_size=args.block_size,
            markov_rank=args.markov_rank,
            **shape,
        )
    weights = mx.load(str(args.dspark / "model.safetensors"))
    shared = ("embed_tokens.weight", "lm_head.weight")  # the target's own copies
    params = sum(v.size for k, v in weights.items() if k not in shared)
    return {
        "path": str(args.dspark),
        "kind": args.drafter_kind,
        "trunk_follows_pi": follows,
        "agree": agree,
        "expected_first_slot_acceptance": agree * follows,
        "block_size": args.block_size,
        "layers": args.dspark_layers,
        "markov_rank": args.markov_rank,
        "target_layer_ids": taps,
        "parameters": params,
    }


if __name__ == "__main__":
    main()

"""Tiny random checkpoints in the exact Hugging Face layouts of MTP model families.

``write_checkpoint(family, out_dir)`` writes a complete, offline checkpoint folder:

- ``config.json`` with the family's real key names (tiny sizes, hidden size 64);
- ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
  ``model.safetensors.index.json`` when ``num_shards > 1``; tensors carry the
  official HF names, MTP tensors included, and the MTP tensors sit in the last shard;
- ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
  (a byte-level BPE trained in-process) and ``generation_config.json``.

Families and where their MTP tensors live:

- ``deepseek_v3``: ``model.layers.{num_hidden_layers}.`` (``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.{norm,head}``, ``embed_tokens`` + an MLA/MoE decoder
  layer);
- ``bailing_hybrid``: Ling 2.5, lightning-attention / MLA groups, grouped MoE; one MTP
  layer appended at ``model.layers.{L}.`` (MLA + MoE, ``final_layernorm``);
- ``bailing_moe_v3``: Ling 3.0, Kimi-Delta-Attention / MLA groups; one MTP layer
  appended at ``model.layers.{L}.``;
- ``deepseek_v32`` / ``glm_moe_dsa``: DeepSeek-V3's layout with the DSA indexer
  (``self_attn.indexer.*``) in every MLA layer, the MTP layer's included;
- ``ernie4_5_moe``: softmax-routed MoE; one MTP layer under
  ``model.mtp_{emb_norm,hidden_norm,linear_proj,block}.0.`` (no final norm of its own);
- ``exaone_moe``: sliding layers and a full NoPE layer, MoE; one MTP layer at
  top-level ``mtp.`` (Qwen3-Next's names, plain norms, dense MLP);
- ``glm4_moe``: ``model.layers.{num_hidden_layers}.``, same names, GQA/MoE decoder
  layer;
- ``mimo``: ``model.mtp_layers.{i}.`` (``token_layernorm``, ``hidden_layernorm``,
  ``input_proj``, ``final_layernorm`` + a Qwen2 decoder layer), two layers,
  concat order ``[hidden, embedding]``.
- ``qwen3_5`` / ``qwen3_5_moe``: hybrid trunk (3 Gated-DeltaNet layers, then one gated
  full-attention layer) nested under ``model.language_model.``, config in
  ``text_config``; MTP at top-level ``mtp.`` (``fc``,
  ``pre_fc_norm_{embedding,hidden}``, ``norm``, ``layers.0.*``). The MoE variant stores
  the trunk's experts fused (``experts.gate_up_proj``) and the MTP layer's per expert,
  as releases do.
- ``qwen3_next``: the same hybrid, flat config and ``model.`` names, MoE everywhere,
  per-expert tensors, ``num_nextn_predict_layers``.
- ``nemotron_h``: a Mamba-2 / attention / MoE / MLP trunk under ``backbone.``; one MTP
  step of two sub-layers ``mtp.layers.{0,1}.`` (attention with ``enorm``, ``hnorm``,
  ``eh_proj``; then a latent MoE with ``final_layernorm``).
- ``longcat_flash``: two MLA sub-layers per layer and a shortcut MoE with identity
  experts; one MTP layer at ``model.mtp.layers.0.`` (MLA, dense MLP),
  ``model.mtp.norm``;
- ``mimo_v2_flash``: full and sliding attention (sink biases, v head dim narrower than
  q/k's), MoE; two MTP layers at ``model.mtp.layers.{0,1}.`` (sliding attention, dense
  MLP, ``pre_mlp_layernorm``, ``final_layernorm``), not counted by the config.
- ``step3p5``: sliding / full attention with zero-centred norms and a head-wise gate,
  MoE under ``moe.`` (3-D experts); two MTP layers at ``model.layers.{3,4}.`` (DeepSeek
  names, ``shared_head.output``, the decoder layer under ``.transformer.``);
- ``step3p7``: the ``step3p5`` text model and MTP layers under ``text_config``, beside a
  sample of a vision tower (``vision_model.*``) and projector.

Qwen norms are stored zero-centred, as Hugging Face's ``x * (1 + w)`` convention has
them (except the Gated-DeltaNet output norm); convolution weights are ``(C, 1, K)``.

With ``predictable=True`` the MTP heads are rewired so they often, but not always,
agree with the trunk's greedy next-next token (see ``_make_predictable``). Speculative
decoding on such a checkpoint sees both accepted and rejected drafts.

Only numpy, mlx and tokenizers are used; no torch.
"""

from __future__ import annotations

import functools
import importlib
import json
import pathlib
import re
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

HIDDEN = 64
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32

# Standard deviations of the random weights. With H=64, a std of 0.1 keeps every
# projection roughly norm-preserving and gives logits of std ~0.8 (not degenerate).
EMBED_STD = 0.1
WEIGHT_STD = 0.1
BIAS_STD = 0.02
NORM_NOISE_STD = 0.05

# predictable=True constants (see _make_predictable): trunk embedding scale, noise on
# the hidden-state half of the MTP projection, damping of the MTP layer's outputs.
# Measured teacher-forced top-1 agreement of MTP head vs. the trunk's greedy
# next-next token, greedy continuations (32 tokens) of random 4-8 token prompts,
# seeds 0-3: deepseek_v3 0.48-0.62, glm4_moe 0.59-0.65, mimo 0.48-0.68 (both layers).
# Random heads (predictable=False) agree < 0.01.
PREDICTABLE_EMBED_SCALE = 30.0
PREDICTABLE_PROJ_NOISE = 0.02
PREDICTABLE_DAMPING = 0.2

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

Tensors = Dict[str, np.ndarray]


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def write_checkpoint(
    family: str,
    out_dir,
    *,
    seed: int = 0,
    predictable: bool = False,
    vocab_size: int = 512,
    dtype: str = "float32",
    num_shards: int = 1,
    tokenizer: bool = True,
    **options,
) -> pathlib.Path:
    """Write a tiny random checkpoint of ``family`` into ``out_dir`` and return its
    path.

    The output is a pure function of the arguments (same seed, same bytes).
    ``tokenizer=False`` writes no tokenizer files, which allows vocabularies too small
    for the byte-level BPE (< 259 tokens; the last id is then the eos token).
    ``dtype`` is one of float32 / bfloat16 / float16; it sets the stored tensor dtype
    and ``config["torch_dtype"]``, except ``e_score_correction_bias``, which stays
    float32 as in the real DeepSeek/GLM releases; ``release`` (in ``options``, for a
    family in `_RELEASE_FORMS`) writes its release's dtype instead. ``options`` go to
    the family's builder (``mimo``: ``num_attention_heads``, ``num_key_value_heads``).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(_DTYPES)}")
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    extra, template, preprocessor = _TOKENIZERS.get(
        (family, bool(options.get("vision"))),
        _TOKENIZERS.get(family, ((), CHAT_TEMPLATE, None)),
    )
    if tokenizer:
        write_tokenizer(out, vocab_size, extra, template)
        token_ids = _special_token_ids(vocab_size, extra)
    else:
        token_ids = {tok: vocab_size - 1 for tok in SPECIAL_TOKENS}
    fam = _family(family)
    rng = np.random.default_rng(seed)
    config, tensors = _SPECS[family](_Init(rng), vocab_size, **options)
    config.update(_token_id_config(token_ids))
    config["torch_dtype"] = dtype
    if predictable:
        _make_predictable(fam, config, tensors, rng)
    if options.get("release") is not None:
        tensors = _RELEASE_FORMS[family](config, tensors, options["release"])

    mtp_keys = [k for k in tensors if fam.mtp_layer_of(k, config) is not None]
    _write_weights(out, tensors, mtp_keys, _DTYPES[dtype], num_shards)
    _write_json(out / "config.json", config)
    generation = _generation_config(token_ids)
    if preprocessor is not None:  # a model that reads images
        _write_json(out / "preprocessor_config.json", preprocessor)
        generation["eos_token_id"] = _text_config(config)["eos_token_id"]
    _write_json(out / "generation_config.json", generation)
    return out


def write_tokenizer(
    out_dir,
    vocab_size: int = 512,
    extra: Tuple[str, ...] = (),
    template: str = CHAT_TEMPLATE,
) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json``.

    The tokenizer is a byte-level BPE (Qwen/DeepSeek style) with at most
    ``vocab_size`` tokens; the special tokens ``<|endoftext|>`` (eos, bos and pad),
    ``<|im_start|>`` and ``<|im_end|>`` come right after the BPE vocabulary (ids
    ``vocab_size - 3 .. vocab_size - 1`` up to the corpus limit of ~920 tokens; larger
    vocabularies leave the top embedding rows unused). No BOS is added on encode.
    The chat template is ChatML, or ``template``; ``extra`` special tokens (a
    family's own, GLM's chat and image tokens) follow the usual ones.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(
        _tokenizer_json(vocab_size, tuple(extra)), encoding="utf-8"
    )
    ids = _special_token_ids(vocab_size, tuple(extra))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids, template))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())


# ---------------------------------------------------------------------------
# Random tensors
# ---------------------------------------------------------------------------


class _Init:
    """Draws float32 weights from one seeded generator, in call order."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def normal(self, shape, std: float) -> np.ndarray:
        return (std * self.rng.standard_normal(shape)).astype(np.float32)

    def linear(self, out_dim: int, in_dim: int, std: float = WEIGHT_STD) -> np.ndarray:
        return self.normal((out_dim, in_dim), std)

    def norm(self, dim: int) -> np.ndarray:
        """RMSNorm weight: 1 + small noise."""
        return 1.0 + self.normal((dim,), NORM_NOISE_STD)


class _WidthScaled(_Init):
    """`_Init` whose projections keep the gain they have at `HIDDEN` inputs at any
    input width (std scaled by sqrt(HIDDEN / in_dim)), for fixtures sized up."""

    def linear(self, out_dim: int, in_dim: int, std: float = WEIGHT_STD) -> np.ndarray:
        return self.normal((out_dim, in_dim), std * np.sqrt(HIDDEN / in_dim))


def _dense_mlp(init: _Init, prefix: str, hidden: int, inter: int) -> Tensors:
    """SwiGLU MLP: ``{prefix}{gate,up,down}_proj.weight``."""
    return {
        f"{prefix}gate_proj.weight": init.linear(inter, hidden),
        f"{prefix}up_proj.weight": init.linear(inter, hidden),
        f"{prefix}down_proj.weight": init.linear(hidden, inter),
    }


def _moe_mlp(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """DeepSeek/GLM MoE with per-expert tensors (HF layout, not stacked)."""
    hidden, n_experts = cfg["hidden_size"], cfg["n_routed_experts"]
    inter = cfg["moe_intermediate_size"]
    t = {
        f"{prefix}gate.weight": init.linear(n_experts, hidden),
        f"{prefix}gate.e_score_correction_bias": init.normal((n_experts,), 0.01),
    }
    for e in range(n_experts):
        t.update(_dense_mlp(init, f"{prefix}experts.{e}.", hidden, inter))
    shared = inter * cfg["n_shared_experts"]
    t.update(_dense_mlp(init, f"{prefix}shared_experts.", hidden, shared))
    return t


def _mla_attention(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """DeepSeek-V3 multi-head latent attention (q and kv LoRA), no biases."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v_dim = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    t = {
        f"{prefix}q_a_proj.weight": init.linear(q_rank, hidden),
        f"{prefix}q_a_layernorm.weight": init.norm(q_rank),
        f"{prefix}q_b_proj.weight": init.linear(heads * (nope + rope), q_rank),
        f"{prefix}kv_a_proj_with_mqa.weight": init.linear(kv_rank + rope, hidden),
        f"{prefix}kv_a_layernorm.weight": init.norm(kv_rank),
        f"{prefix}kv_b_proj.weight": init.linear(heads * (nope + v_dim), kv_rank),
        f"{prefix}o_proj.weight": init.linear(hidden, heads * v_dim),
    }
    if "index_topk" in cfg:  # DeepSeek-V3.2's sparse-attention indexer
        ih, d = cfg["index_n_heads"], cfg["index_head_dim"]
        t.update(
            {
                f"{prefix}indexer.wq_b.weight": init.linear(ih * d, q_rank, 0.3),
                f"{prefix}indexer.wk.weight": init.linear(d, hidden, 0.3),
                f"{prefix}indexer.k_norm.weight": init.norm(d),
                f"{prefix}indexer.k_norm.bias": init.normal((d,), BIAS_STD),
                f"{prefix}indexer.weights_proj.weight": init.linear(ih, hidden, 0.3),
            }
        )
    return t


def _gqa_attention(
    init: _Init, prefix: str, cfg: dict, head_dim: int, qk_norm: bool
) -> Tensors:
    """Grouped-query attention with q/k/v biases and a bias-free ``o_proj``."""
    hidden = cfg["hidden_size"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim
    t = {}
    for name, dim in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
        t[f"{prefix}{name}.weight"] = init.linear(dim, hidden)
        t[f"{prefix}{name}.bias"] = init.normal((dim,), BIAS_STD)
    t[f"{prefix}o_proj.weight"] = init.linear(hidden, q_dim)
    if qk_norm:
        t[f"{prefix}q_norm.weight"] = init.norm(head_dim)
        t[f"{prefix}k_norm.weight"] = init.norm(head_dim)
    return t


def _decoder_layer(
    init: _Init,
    prefix: str,
    hidden: int,
    attention: Callable[[str], Tensors],
    mlp: Callable[[str], Tensors],
) -> Tensors:
    """Pre-norm decoder block: input/post-attention norms + ``self_attn.*`` +
    ``mlp.*``."""
    t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
    t.update(attention(f"{prefix}self_attn."))
    t[f"{prefix}post_attention_layernorm.weight"] = init.norm(hidden)
    t.update(mlp(f"{prefix}mlp."))
    return t


def _nextn_head(init: _Init, prefix: str, hidden: int, trunk: Tensors) -> Tensors:
    """DeepSeek-style MTP fusion tensors, incl. exact copies of embed and lm_head."""
    return {
        f"{prefix}enorm.weight": init.norm(hidden),
        f"{prefix}hnorm.weight": init.norm(hidden),
        f"{prefix}eh_proj.weight": init.linear(hidden, 2 * hidden),
        f"{prefix}shared_head.norm.weight": init.norm(hidden),
        f"{prefix}shared_head.head.weight": trunk["lm_head.weight"].copy(),
        f"{prefix}embed_tokens.weight": trunk["model.embed_tokens.weight"].copy(),
    }


def _trunk(init: _Init, cfg: dict, layer: Callable[[str, int], Tensors]) -> Tensors:
    """Embedding, ``num_hidden_layers`` decoder layers, final norm and lm_head."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    t = {"model.embed_tokens.weight": init.normal((vocab, hidden), EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        t.update(layer(f"model.layers.{i}.", i))
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab, hidden)
    return t


# ---------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------


def _moe_layers(
    init: _Init, cfg: dict, attention: Callable[[str], Tensors]
) -> Callable[[str, int], Tensors]:
    """Decoder layers with ``attention``: dense MLP below first_k_dense_replace, else
    MoE."""

    def layer(prefix: str, idx: int) -> Tensors:
        dense = idx < cfg["first_k_dense_replace"]
        return _decoder_layer(
            init,
            prefix,
            HIDDEN,
            attention,
            lambda p: (
                _dense_mlp(init, p, HIDDEN, INTERMEDIATE)
                if dense
                else _moe_mlp(init, p, cfg)
            ),
        )

    return layer


def _deepseek_v3_config(vocab_size: int) -> dict:
    """DeepSeek-V3's config keys at the fixtures' sizes."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _deepseek_v3(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """DeepSeek-V3: 3 MLA layers (layer 0 dense, 1-2 MoE) + MTP at
    ``model.layers.3``."""
    cfg = _deepseek_v3_config(vocab_size)
    layer = _moe_layers(init, cfg, lambda p: _mla_attention(init, p, cfg))
    tensors = _trunk(init, cfg, layer)
    tensors.update(_nextn_layers(init, cfg, tensors, layer))
    return cfg, tensors


def _glm4_moe_lite(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's tensors and MTP layout; its own
    config (MLA norms at ``rms_norm_eps``, one expert group, partial RoPE key)."""
    cfg, tensors = _deepseek_v3(init, vocab_size)
    cfg.update(
        architectures=["Glm4MoeLiteForCausalLM"],
        model_type="glm4_moe_lite",
        rms_norm_eps=1e-5,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.8,
        partial_rotary_factor=1.0,
        rope_theta=1000000.0,
        pad_token_id=vocab_size - 1,
    )
    return cfg, tensors


# Eight index heads: an index score is exactly 0 only when every head's ReLU term is,
# so ties between selected and dropped keys (which any two implementations may break
# differently) stay absent from the tests' sequences.
DSA_INDEXER = {"index_head_dim": 16, "index_n_heads": 8, "index_topk": 4}


def _with_indexer(init: _Init, cfg: dict) -> Tensors:
    """DeepSeek-V3's trunk and MTP layer with the DSA indexer in every attention
    (``index_topk`` small, so that passes past a few tokens attend sparsely)."""
    cfg.update(DSA_INDEXER)
    layer = _moe_layers(init, cfg, lambda p: _mla_attention(init, p, cfg))
    tensors = _trunk(init, cfg, layer)
    tensors.update(_nextn_layers(init, cfg, tensors, layer))
    return tensors


def _deepseek_v32(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """DeepSeek-V3.2 (deepseek_v32): DeepSeek-V3's layout, an indexer in every MLA."""
    cfg = _deepseek_v3_config(vocab_size)
    cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
    return cfg, _with_indexer(init, cfg)


def _glm_moe_dsa(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """GLM-5 (glm_moe_dsa): DeepSeek-V3.2's layers, RoPE under ``rope_parameters``
    (transformers 5 style), the indexer's RoPE interleaved, one expert group."""
    cfg = _deepseek_v3_config(vocab_size)
    cfg.update(
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        n_group=1,
        topk_group=1,
        indexer_rope_interleave=True,
    )
    del cfg["rope_theta"], cfg["rope_scaling"]
    return cfg, _with_indexer(init, cfg)


def _glm4_moe(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """GLM-4.5 (glm4_moe): 2 GQA layers (0 dense, 1 MoE) + MTP at ``model.layers.2``."""
    cfg = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
    }

    layer = _moe_layers(
        init, cfg, lambda p: _gqa_attention(init, p, cfg, cfg["head_dim"], qk_norm=True)
    )
    tensors = _trunk(init, cfg, layer)
    tensors.update(_nextn_layers(init, cfg, tensors, layer))
    return cfg, tensors


def _mimo(
    init: _Init, vocab_size: int, num_attention_heads=4, num_key_value_heads=2
) -> Tuple[dict, Tensors]:
    """MiMo-7B: 2 Qwen2 layers + two MTP layers at ``model.mtp_layers.{0,1}``."""
    cfg = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "num_nextn_predict_layers": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "use_cache": True,
    }
    head_dim = HIDDEN // cfg["num_attention_heads"]

    def layer(prefix: str, idx: int) -> Tensors:
        return _decoder_layer(
            init,
            prefix,
            HIDDEN,
            lambda p: _gqa_attention(init, p, cfg, head_dim, qk_norm=False),
            lambda p: _dense_mlp(init, p, HIDDEN, INTERMEDIATE),
        )

    tensors = _trunk(init, cfg, layer)
    for i in range(cfg["num_nextn_predict_layers"]):
        prefix = f"model.mtp_layers.{i}."
        tensors[f"{prefix}token_layernorm.weight"] = init.norm(HIDDEN)
        tensors[f"{prefix}hidden_layernorm.weight"] = init.norm(HIDDEN)
        tensors[f"{prefix}input_proj.weight"] = init.linear(HIDDEN, 2 * HIDDEN)
        tensors[f"{prefix}final_layernorm.weight"] = init.norm(HIDDEN)
        tensors.update(layer(prefix, cfg["num_hidden_layers"] + i))
    return cfg, tensors


# ---------------------------------------------------------------------------
# Qwen3.5 / Qwen3-Next: hybrid Gated-DeltaNet trunks, MTP at top-level ``mtp.``
# ---------------------------------------------------------------------------

QWEN_LAYERS = 4  # 3 Gated-DeltaNet layers, then 1 gated full-attention layer
QWEN_EXPERTS = 4


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def _qwen_text_config(vocab_size: int, moe: bool) -> dict:
    """The text-model keys shared by Qwen3.5 and Qwen3-Next (tiny sizes)."""
    cfg = {
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": QWEN_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    if moe:
        cfg.update(
            num_experts=QWEN_EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=MOE_INTERMEDIATE,
            shared_expert_intermediate_size=2 * MOE_INTERMEDIATE,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
        )
    return cfg


def _zero_norm(init: _Init, dim: int) -> np.ndarray:
    """A zero-centred ``(1 + w)`` norm weight: small noise around 0."""
    return init.normal((dim,), NORM_NOISE_STD)


def _gated_attention(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Qwen3-Next gated attention: q_proj emits query and gate; q/k norms; no biases."""
    hidden, hd = cfg["hidden_size"], cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * hd
    kv_dim = cfg["num_key_value_heads"] * hd
    return {
        f"{prefix}q_proj.weight": init.linear(2 * q_dim, hidden),
        f"{prefix}k_proj.weight": init.linear(kv_dim, hidden),
        f"{prefix}v_proj.weight": init.linear(kv_dim, hidden),
        f"{prefix}o_proj.weight": init.linear(hidden, q_dim),
        f"{prefix}q_norm.weight": _zero_norm(init, hd),
        f"{prefix}k_norm.weight": _zero_norm(init, hd),
    }


def _gated_deltanet(init: _Init, prefix: str, cfg: dict, fused: bool) -> Tensors:
    """Gated-DeltaNet mixer; ``fused`` is Qwen3-Next's ``in_proj_qkvz`` /
    ``in_proj_ba``."""
    hidden, nv = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = nv * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    if fused:
        t = {
            f"{prefix}in_proj_qkvz.weight": init.linear(conv_dim + value_dim, hidden),
            f"{prefix}in_proj_ba.weight": init.linear(2 * nv, hidden),
        }
    else:
        t = {
            f"{prefix}in_proj_qkv.weight": init.linear(conv_dim, hidden),
            f"{prefix}in_proj_z.weight": init.linear(value_dim, hidden),
            f"{prefix}in_proj_b.weight": init.linear(nv, hidden),
            f"{prefix}in_proj_a.weight": init.linear(nv, hidden),
        }
    kernel = cfg["linear_conv_kernel_dim"]
    t[f"{prefix}conv1d.weight"] = init.normal((conv_dim, 1, kernel), 0.3)
    t[f"{prefix}dt_bias"] = 1.0 + init.normal((nv,), 0.1)
    t[f"{prefix}A_log"] = np.log(init.rng.uniform(1.0, 8.0, nv)).astype(np.float32)
    t[f"{prefix}norm.weight"] = 1.0 + init.normal((cfg["linear_value_head_dim"],), 0.05)
    t[f"{prefix}out_proj.weight"] = init.linear(hidden, value_dim)
    return t


def _qwen_moe(init: _Init, prefix: str, cfg: dict, fused: bool) -> Tensors:
    """Sparse MoE with a gated shared expert; experts fused (3-D) or one per expert."""
    hidden, n, inter = (
        cfg["hidden_size"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
    )
    t = {f"{prefix}gate.weight": init.linear(n, hidden)}
    if fused:
        t[f"{prefix}experts.gate_up_proj"] = init.normal(
            (n, 2 * inter, hidden), WEIGHT_STD
        )
        t[f"{prefix}experts.down_proj"] = init.normal((n, hidden, inter), WEIGHT_STD)
    else:
        for e in range(n):
            t.update(_dense_mlp(init, f"{prefix}experts.{e}.", hidden, inter))
    shared = cfg["shared_expert_intermediate_size"]
    t.update(_dense_mlp(init, f"{prefix}shared_expert.", hidden, shared))
    t[f"{prefix}shared_expert_gate.weight"] = init.linear(1, hidden)
    return t


def _qwen_tensors(
    init: _Init,
    cfg: dict,
    base: str,
    deltanet: Callable[[str], Tensors],
    mlp: Callable[[str, bool], Tensors],
) -> Tensors:
    """Trunk under ``base`` (e.g. ``model.language_model.``) and the ``mtp.`` layer.

    ``mlp(prefix, is_mtp)`` builds an MLP; ``deltanet(prefix)`` a linear-attention
    mixer.
    """
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    t = {f"{base}embed_tokens.weight": init.normal((vocab, hidden), EMBED_STD)}

    def layer(prefix: str, linear: bool, is_mtp: bool) -> None:
        t[f"{prefix}input_layernorm.weight"] = _zero_norm(init, hidden)
        if linear:
            t.update(deltanet(f"{prefix}linear_attn."))
        else:
            t.update(_gated_attention(init, f"{prefix}self_attn.", cfg))
        t[f"{prefix}post_attention_layernorm.weight"] = _zero_norm(init, hidden)
        t.update(mlp(f"{prefix}mlp.", is_mtp))

    for i in range(cfg["num_hidden_layers"]):
        layer(
            f"{base}layers.{i}.", (i + 1) % cfg["full_attention_interval"] != 0, False
        )
    t[f"{base}norm.weight"] = _zero_norm(init, hidden)
    t["lm_head.weight"] = init.linear(vocab, hidden)
    t["mtp.pre_fc_norm_embedding.weight"] = _zero_norm(init, hidden)
    t["mtp.pre_fc_norm_hidden.weight"] = _zero_norm(init, hidden)
    t["mtp.fc.weight"] = init.linear(hidden, 2 * hidden)
    layer("mtp.layers.0.", False, True)
    t["mtp.norm.weight"] = _zero_norm(init, hidden)
    return t


# Qwen3.5's image markers (its tokenizer's special tokens).
QWEN_VL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# ChatML, with image parts as Qwen3.5's template writes them: ``<|vision_start|>
# <|image_pad|><|vision_end|>`` (one placeholder per image; the processor repeats it).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3.5's image processor settings (16-pixel patches, merged 2 x 2), with a pixel
# budget that keeps a fixture's images at 16 to 64 placeholders.
QWEN_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 16384, "longest_edge": 65536},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _qwen_vision(init: _Init, cfg: dict) -> Tensors:
    """The Qwen3-VL vision tower of Qwen3.5 under ``model.visual.`` (Hugging
    Face's names and conv layout)."""
    p, width, inner = "model.visual.", cfg["hidden_size"], cfg["intermediate_size"]
    patch, t_patch = cfg["patch_size"], cfg["temporal_patch_size"]
    merged = width * cfg["spatial_merge_size"] ** 2
    t = {
        f"{p}patch_embed.proj.weight": init.normal(
            (width, 3, t_patch, patch, patch), 0.05
        ),
        f"{p}patch_embed.proj.bias": init.normal((width,), BIAS_STD),
        f"{p}pos_embed.weight": init.normal(
            (cfg["num_position_embeddings"], width), 0.05
        ),
    }

    def linear(name: str, out_dim: int, in_dim: int) -> None:
        t[f"{name}.weight"] = init.linear(out_dim, in_dim)
        t[f"{name}.bias"] = init.normal((out_dim,), BIAS_STD)

    def layer_norm(name: str, dim: int) -> None:
        t[f"{name}.weight"] = init.norm(dim)
        t[f"{name}.bias"] = init.normal((dim,), BIAS_STD)

    for i in range(cfg["depth"]):
        b = f"{p}blocks.{i}."
        layer_norm(f"{b}norm1", width)
        layer_norm(f"{b}norm2", width)
        linear(f"{b}attn.qkv", 3 * width, width)
        linear(f"{b}attn.proj", width, width)
        linear(f"{b}mlp.linear_fc1", inner, width)
        linear(f"{b}mlp.linear_fc2", width, inner)
    layer_norm(f"{p}merger.norm", width)
    linear(f"{p}merger.linear_fc1", merged, merged)
    linear(f"{p}merger.linear_fc2", cfg["out_hidden_size"], merged)
    return t


def _qwen3_5(
    init: _Init,
    vocab_size: int,
    moe: bool = False,
    vision: bool = False,
    hidden: int = HIDDEN,
    layers: int = QWEN_LAYERS,
    vision_width: int = 32,
    vision_depth: int = 2,
) -> Tuple[dict, Tensors]:
    """Qwen3.5 / 3.6 (dense, or MoE): text model under ``model.language_model.``;
    ``vision``: with a 2-block vision tower under ``model.visual.``, and M-RoPE
    over 4 rotary frequencies (sections [2, 1, 1], interleaved: every axis used).

    ``hidden``, ``layers`` (a multiple of 4), ``vision_width`` and ``vision_depth``
    size it up for timing: from a width of 1024 on, the release's head sizes (256
    for attention, of which 64 rotate with sections [11, 11, 10]; 128 for
    Gated-DeltaNet)."""
    text = _qwen_text_config(vocab_size, moe)
    if hidden != HIDDEN or layers != QWEN_LAYERS:
        init = _WidthScaled(init.rng)
        wide = hidden >= 1024
        text.update(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            num_attention_heads=max(4, hidden // 256) if wide else 4,
            num_key_value_heads=2,
            head_dim=256 if wide else 16,
            linear_num_key_heads=max(2, hidden // 256),
            linear_num_value_heads=2 * max(2, hidden // 256),
            linear_key_head_dim=128 if wide else 16,
            linear_value_head_dim=128 if wide else 16,
        )
    wide = text["head_dim"] == 256
    text.update(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        attn_output_gate=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.5 if vision and not wide else 0.25,
            "mrope_section": (
                [11, 11, 10] if wide else [2, 1, 1] if vision else [1, 1, 0]
            ),
            "mrope_interleaved": True,
        },
    )
    name = (
        "Qwen3_5MoeForConditionalGeneration"
        if moe
        else "Qwen3_5ForConditionalGeneration"
    )
    cfg = {
        "architectures": [name],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
    }

    def mlp(prefix: str, is_mtp: bool) -> Tensors:
        if not moe:
            return _dense_mlp(
                init, prefix, text["hidden_size"], text["intermediate_size"]
            )
        return _qwen_moe(init, prefix, text, fused=not is_mtp)

    tensors = _qwen_tensors(
        init,
        text,
        "model.language_model.",
        lambda p: _gated_deltanet(init, p, text, fused=False),
        mlp,
    )
    if vision:
        ids = _special_token_ids(vocab_size, QWEN_VL_TOKENS)
        cfg["vision_config"] = {
            "model_type": "qwen3_5",
            "depth": vision_depth,
            "hidden_size": vision_width,
            "intermediate_size": 2 * vision_width,
            "num_heads": max(2, vision_width // 64),
            "in_channels": 3,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": text["hidden_size"],
            "num_position_embeddings": 2304,
            "hidden_act": "gelu_pytorch_tanh",
            "deepstack_visual_indexes": [],
            "initializer_range": 0.02,
        }
        cfg.update(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
        text["eos_token_id"] = ids[IM_END]
        tensors.update(_qwen_vision(init, cfg["vision_config"]))
    return cfg, tensors


def _qwen3_next(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """Qwen3-Next: flat config with 4.x-style rope keys, MoE in every layer."""
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    cfg.update(_qwen_text_config(vocab_size, moe=True))
    cfg.update(
        num_nextn_predict_layers=1,
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        rope_scaling=None,
    )
    tensors = _qwen_tensors(
        init,
        cfg,
        "model.",
        lambda p: _gated_deltanet(init, p, cfg, fused=True),
        lambda p, is_mtp: _qwen_moe(init, p, cfg, fused=False),
    )
    return cfg, tensors


NEMOTRON_PATTERN = "M*E-M"  # Mamba-2, attention, MoE, MLP, Mamba-2
NEMOTRON_NAMES = {  # pattern character -> layer type, per config style
    "old": {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"},
    "new": {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"},
}


def _nemotron_mamba(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Mamba-2 mixer: fused ``in_proj`` (gate, conv input, dt), depthwise conv (HF
    ``(C, 1, K)``), ``A_log``, ``D``, ``dt_bias``, gated group norm, ``out_proj``."""
    hidden, heads = cfg["hidden_size"], cfg["mamba_num_heads"]
    inner = heads * cfg["mamba_head_dim"]
    conv_dim = inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    return {
        f"{prefix}in_proj.weight": init.linear(inner + conv_dim + heads, hidden),
        f"{prefix}conv1d.weight": init.normal((conv_dim, 1, cfg["conv_kernel"]), 0.3),
        f"{prefix}conv1d.bias": init.normal((conv_dim,), BIAS_STD),
        f"{prefix}dt_bias": init.normal((heads,), 0.5),
        f"{prefix}A_log": np.log(init.rng.uniform(1.0, 16.0, heads)).astype(np.float32),
        f"{prefix}D": init.norm(heads),
        f"{prefix}norm.weight": init.norm(inner),
        f"{prefix}out_proj.weight": init.linear(hidden, inner),
    }


def _nemotron_attention(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Attention without RoPE or biases."""
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        f"{prefix}q_proj.weight": init.linear(q, hidden),
        f"{prefix}k_proj.weight": init.linear(kv, hidden),
        f"{prefix}v_proj.weight": init.linear(kv, hidden),
        f"{prefix}o_proj.weight": init.linear(hidden, q),
    }


def _relu2_mlp(init: _Init, prefix: str, inner: int, outer: int) -> Tensors:
    """Non-gated ReLU² MLP: ``up_proj``, ``down_proj``."""
    return {
        f"{prefix}up_proj.weight": init.linear(inner, outer),
        f"{prefix}down_proj.weight": init.linear(outer, inner),
    }


def _nemotron_moe(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Sigmoid-routed ReLU² experts on a latent width, and a shared expert."""
    hidden, experts = cfg["hidden_size"], cfg["n_routed_experts"]
    latent = cfg["moe_latent_size"]
    t = {
        f"{prefix}gate.weight": init.linear(experts, hidden),
        f"{prefix}gate.e_score_correction_bias": init.normal((experts,), 0.01),
        f"{prefix}fc1_latent_proj.weight": init.linear(latent, hidden),
        f"{prefix}fc2_latent_proj.weight": init.linear(hidden, latent),
    }
    for e in range(experts):
        t.update(
            _relu2_mlp(
                init, f"{prefix}experts.{e}.", cfg["moe_intermediate_size"], latent
            )
        )
    shared = cfg["moe_shared_expert_intermediate_size"]
    t.update(_relu2_mlp(init, f"{prefix}shared_experts.", shared, hidden))
    return t


def _nemotron_block(init: _Init, prefix: str, cfg: dict, kind: str) -> Tensors:
    """One pre-norm block: ``norm`` and the ``mixer`` of pattern character ``kind``."""
    mixer = f"{prefix}mixer."
    t = {f"{prefix}norm.weight": init.norm(cfg["hidden_size"])}
    if kind == "M":
        t.update(_nemotron_mamba(init, mixer, cfg))
    elif kind == "*":
        t.update(_nemotron_attention(init, mixer, cfg))
    elif kind == "E":
        t.update(_nemotron_moe(init, mixer, cfg))
    else:
        t.update(_relu2_mlp(init, mixer, cfg["intermediate_size"], cfg["hidden_size"]))
    return t


def _nemotron_h(
    init: _Init, vocab_size: int, names: str = "legacy", mtp_pattern: str = "*E"
) -> Tuple[dict, Tensors]:
    """Nemotron 3 (nemotron_h): a Mamba-2 / attention / MoE / MLP trunk under
    ``backbone.``, and one MTP step of sub-layers ``mtp.layers.{0,1}`` (attention with
    ``enorm`` / ``hnorm`` / ``eh_proj``, then a latent MoE with ``final_layernorm``).

    ``names``: ``"legacy"`` writes the pattern strings of the released configs
    (``hybrid_override_pattern``, ``mtp_hybrid_override_pattern``); ``"old"`` and
    ``"new"`` write transformers' lists (``layers_block_type``,
    ``mtp_layers_block_type``) with the pre- and post-5.13 type names.
    """
    cfg = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "mamba_hidden_act": "silu",
        "ssm_state_size": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_shared_expert_intermediate_size": 64,
        "moe_latent_size": 32,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if names == "legacy":
        cfg["hybrid_override_pattern"] = NEMOTRON_PATTERN
        cfg["num_hidden_layers"] = len(NEMOTRON_PATTERN)
        cfg["mtp_hybrid_override_pattern"] = mtp_pattern
    else:
        to_name = NEMOTRON_NAMES[names]
        cfg["layers_block_type"] = [to_name[c] for c in NEMOTRON_PATTERN]
        cfg["mtp_layers_block_type"] = [to_name[c] for c in mtp_pattern]
    hidden = cfg["hidden_size"]
    t = {"backbone.embeddings.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i, kind in enumerate(NEMOTRON_PATTERN):
        t.update(_nemotron_block(init, f"backbone.layers.{i}.", cfg, kind))
    t["backbone.norm_f.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    for s, kind in enumerate(mtp_pattern):
        prefix = f"mtp.layers.{s}."
        if s == 0:
            t[f"{prefix}enorm.weight"] = init.norm(hidden)
            t[f"{prefix}hnorm.weight"] = init.norm(hidden)
            t[f"{prefix}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
        t.update(_nemotron_block(init, prefix, cfg, kind))
        if s == len(mtp_pattern) - 1:
            t[f"{prefix}final_layernorm.weight"] = init.norm(hidden)
    return cfg, t


STEP_LAYERS = 3  # full, sliding, sliding; layer 0 dense, 1-2 MoE
STEP_MTP = 2  # one sliding and one full-attention MTP layer, both dense


def _step_attention(init: _Init, prefix: str, cfg: dict, sliding: bool) -> Tensors:
    """Step-3.5 attention: more heads on sliding layers, zero-centred q/k norms and a
    head-wise output gate (``g_proj``)."""
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    other = cfg["attention_other_setting"] if sliding else {}
    heads = other.get("num_attention_heads", cfg["num_attention_heads"])
    groups = other.get("num_attention_groups", cfg["num_attention_groups"])
    return {
        f"{prefix}q_proj.weight": init.linear(heads * d, hidden),
        f"{prefix}k_proj.weight": init.linear(groups * d, hidden),
        f"{prefix}v_proj.weight": init.linear(groups * d, hidden),
        f"{prefix}o_proj.weight": init.linear(hidden, heads * d),
        f"{prefix}q_norm.weight": _zero_norm(init, d),
        f"{prefix}k_norm.weight": _zero_norm(init, d),
        f"{prefix}g_proj.weight": init.linear(heads, hidden),
    }


def _step_moe(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Step-3.5 MoE as released: 3-D expert tensors under ``moe.``, a sigmoid router
    with ``router_bias``, and ``share_expert``."""
    hidden, experts = cfg["hidden_size"], cfg["moe_num_experts"]
    inter = cfg["moe_intermediate_size"]
    t = {
        f"{prefix}moe.gate.weight": init.linear(experts, hidden),
        f"{prefix}moe.router_bias": init.normal((experts,), 0.01),
        f"{prefix}moe.gate_proj.weight": init.normal(
            (experts, inter, hidden), WEIGHT_STD
        ),
        f"{prefix}moe.up_proj.weight": init.normal(
            (experts, inter, hidden), WEIGHT_STD
        ),
        f"{prefix}moe.down_proj.weight": init.normal(
            (experts, hidden, inter), WEIGHT_STD
        ),
    }
    t.update(
        _dense_mlp(init, f"{prefix}share_expert.", hidden, cfg["share_expert_dim"])
    )
    return t


def _step_layer(init: _Init, prefix: str, cfg: dict, idx: int) -> Tensors:
    """Decoder layer ``idx`` (trunk or MTP: the config's lists cover both)."""
    hidden = cfg["hidden_size"]
    sliding = cfg["layer_types"][idx] == "sliding_attention"
    moe = str(idx) in cfg["moe_layers_enum"].split(",")
    t = {f"{prefix}input_layernorm.weight": _zero_norm(init, hidden)}
    t.update(_step_attention(init, f"{prefix}self_attn.", cfg, sliding))
    t[f"{prefix}post_attention_layernorm.weight"] = _zero_norm(init, hidden)
    if moe:
        t.update(_step_moe(init, prefix, cfg))
    else:
        t.update(_dense_mlp(init, f"{prefix}mlp.", hidden, cfg["intermediate_size"]))
    return t


def _step3p5(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """Step-3.5-Flash (step3p5): 3 layers (full, sliding, sliding; dense then MoE) and
    2 MTP layers at ``model.layers.{3,4}`` (decoder layer under ``.transformer.``,
    ``shared_head.output`` a copy of ``lm_head``). The per-layer lists are padded with
    the MTP layers' entries, as released configs are."""
    n = STEP_LAYERS + STEP_MTP
    cfg = {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": STEP_LAYERS,
        "num_nextn_predict_layers": STEP_MTP,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 16,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 6,
            "num_attention_groups": 2,
            "head_dim": 16,
        },
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]
        + ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "rope_theta": [5000000.0, 10000.0, 10000.0, 10000.0, 5000000.0],
        "partial_rotary_factors": [0.5, 1.0, 1.0, 1.0, 0.5],
        "yarn_only_types": ["full_attention"],
        "rope_scaling": None,
        "use_head_wise_attn_gate": True,
        "use_qk_norm": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "share_expert_dim": MOE_INTERMEDIATE,
        "moe_layers_enum": "1,2",
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "norm_expert_weight": True,
        "swiglu_limits": [0.0, 0.0, 0.8, 0.0, 0.0],
        "swiglu_limits_shared": [0.0, 0.0, 0.0, 0.8, 0.0],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    assert len(cfg["layer_types"]) == n
    hidden = cfg["hidden_size"]
    t = {"model.embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(STEP_LAYERS):
        t.update(_step_layer(init, f"model.layers.{i}.", cfg, i))
    t["model.norm.weight"] = _zero_norm(init, hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    for i in range(STEP_LAYERS, n):
        prefix = f"model.layers.{i}."
        t[f"{prefix}enorm.weight"] = _zero_norm(init, hidden)
        t[f"{prefix}hnorm.weight"] = _zero_norm(init, hidden)
        t[f"{prefix}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
        t[f"{prefix}shared_head.norm.weight"] = _zero_norm(init, hidden)
        t[f"{prefix}shared_head.output.weight"] = t["lm_head.weight"].copy()
        t.update(_step_layer(init, f"{prefix}transformer.", cfg, i))
    return cfg, t


def _step3p7(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """Step-3.7-Flash (step3p7): the Step-3.5 fixture's text model and MTP layers
    under ``text_config`` (its ``model_type`` step3p5), beside a sample of the vision
    tower and projector, named as the release keeps them beside the text tensors
    (``vision_model.*``, ``vit_large_projector.*``)."""
    text, t = _step3p5(init, vocab_size)
    cfg = {
        "architectures": ["Step3p7ForConditionalGeneration"],
        "model_type": "step3p7",
        "text_config": text,
        "vision_config": {"model_type": "perception_encoder", "width": 32},
        "image_token_id": vocab_size - 1,
        "understand_projector_stride": 2,
        "projector_bias": False,
        "tie_word_embeddings": False,
    }
    t["vision_model.conv1.weight"] = init.normal((32, 3, 14, 14), 0.02)
    t["vision_model.ln_pre.weight"] = np.ones(32, dtype=np.float32)
    t["vit_large_projector.weight"] = init.linear(HIDDEN, 4 * 32)
    return cfg, t


MIMO_V2_PATTERN = [0, 1, 1]  # full, sliding, sliding attention
MIMO_V2_MTP = 2


def _mimo_v2_attention(init: _Init, prefix: str, cfg: dict, sliding: bool) -> Tensors:
    """MiMo-V2 attention: q/k head dim wider than v's; sink biases on sliding layers."""
    hidden, pre = cfg["hidden_size"], "swa_" if sliding else ""
    heads, kv = cfg[f"{pre}num_attention_heads"], cfg[f"{pre}num_key_value_heads"]
    d, dv = cfg[f"{pre}head_dim"], cfg[f"{pre}v_head_dim"]
    t = {
        f"{prefix}q_proj.weight": init.linear(heads * d, hidden),
        f"{prefix}k_proj.weight": init.linear(kv * d, hidden),
        f"{prefix}v_proj.weight": init.linear(kv * dv, hidden),
        f"{prefix}o_proj.weight": init.linear(hidden, heads * dv),
    }
    if cfg[
        "add_swa_attention_sink_bias" if sliding else "add_full_attention_sink_bias"
    ]:
        t[f"{prefix}attention_sink_bias"] = init.normal((heads,), 0.5)
    return t


def _mimo_v2_flash(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """MiMo-V2-Flash: 3 layers (full, then sliding with sink biases; dense, then MoE)
    and 2 MTP layers at ``model.mtp.layers.{0,1}`` (sliding attention, dense MLP,
    ``pre_mlp_layernorm``); the config does not count them, as released."""
    cfg = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": len(MIMO_V2_PATTERN),
        "hybrid_layer_pattern": MIMO_V2_PATTERN,
        "moe_layer_freq": [0, 1, 1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "v_head_dim": 16,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": 24,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000.0,
        "swa_rope_theta": 10000.0,
        "sliding_window_size": 8,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.707,
        "attention_bias": False,
        "n_routed_experts": 4,
        "n_shared_experts": None,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 4096,
        "layernorm_epsilon": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    hidden = cfg["hidden_size"]

    def layer(prefix: str, sliding: bool, moe: bool, post: str) -> Tensors:
        t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
        t.update(_mimo_v2_attention(init, f"{prefix}self_attn.", cfg, sliding))
        t[f"{prefix}{post}.weight"] = init.norm(hidden)
        mlp = f"{prefix}mlp."
        if moe:
            t[f"{mlp}gate.weight"] = init.linear(cfg["n_routed_experts"], hidden)
            t[f"{mlp}gate.e_score_correction_bias"] = init.normal((4,), 0.01)
            for e in range(cfg["n_routed_experts"]):
                t.update(
                    _dense_mlp(init, f"{mlp}experts.{e}.", hidden, MOE_INTERMEDIATE)
                )
        else:
            t.update(_dense_mlp(init, mlp, hidden, cfg["intermediate_size"]))
        return t

    t = {"model.embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i, (kind, moe) in enumerate(zip(MIMO_V2_PATTERN, cfg["moe_layer_freq"])):
        t.update(
            layer(f"model.layers.{i}.", kind == 1, moe == 1, "post_attention_layernorm")
        )
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    for j in range(MIMO_V2_MTP):
        prefix = f"model.mtp.layers.{j}."
        t[f"{prefix}enorm.weight"] = init.norm(hidden)
        t[f"{prefix}hnorm.weight"] = init.norm(hidden)
        t[f"{prefix}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
        t.update(layer(prefix, True, False, "pre_mlp_layernorm"))
        t[f"{prefix}final_layernorm.weight"] = init.norm(hidden)
    return cfg, t


EXAONE_PATTERN = ["sliding_attention"] * 3 + ["full_attention"]  # "LLLG"


def _exaone_moe(
    init: _Init, vocab_size: int, mtp_sliding: bool = False
) -> Tuple[dict, Tensors]:
    """EXAONE-MoE (K-EXAONE): 4 layers (3 sliding, then full attention without RoPE;
    layer 0 dense, then MoE with a shared expert), q/k norms, and one MTP layer at
    top-level ``mtp.`` (Qwen3-Next's names) with a dense MLP and full attention, as
    released (``mtp_sliding=True``: a sliding-window MTP layer, K-EXAONE 2's kind)."""
    cfg = {
        "architectures": ["ExaoneMoEForCausalLM"],
        "model_type": "exaone_moe",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": len(EXAONE_PATTERN),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": EXAONE_PATTERN,
        "sliding_window": 8,
        "sliding_window_pattern": "LLLG",
        "is_moe_layer": [False, True, True, True],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "first_k_dense_replace": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "num_nextn_predict_layers": 1,
        "mtp_layer_types": ["sliding_attention" if mtp_sliding else "full_attention"],
        "mtp_sliding_windows": [8 if mtp_sliding else 0],
    }
    hidden = cfg["hidden_size"]

    def layer(prefix: str, moe: bool) -> Tensors:
        t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
        t.update(_gqa_attention(init, f"{prefix}self_attn.", cfg, 16, qk_norm=True))
        t = {k: v for k, v in t.items() if not k.endswith("_proj.bias")}  # no biases
        t[f"{prefix}post_attention_layernorm.weight"] = init.norm(hidden)
        if moe:
            mlp = f"{prefix}mlp."
            t[f"{mlp}gate.weight"] = init.linear(cfg["num_experts"], hidden)
            t[f"{mlp}e_score_correction_bias"] = init.normal((4,), 0.01)
            for e in range(cfg["num_experts"]):
                t.update(
                    _dense_mlp(init, f"{mlp}experts.{e}.", hidden, MOE_INTERMEDIATE)
                )
            t.update(
                _dense_mlp(init, f"{mlp}shared_experts.", hidden, MOE_INTERMEDIATE)
            )
        else:
            t.update(
                _dense_mlp(init, f"{prefix}mlp.", hidden, cfg["intermediate_size"])
            )
        return t

    t = {"model.embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i, moe in enumerate(cfg["is_moe_layer"]):
        t.update(layer(f"model.layers.{i}.", moe))
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    t["mtp.fc.weight"] = init.linear(hidden, 2 * hidden)
    t["mtp.pre_fc_norm_embedding.weight"] = init.norm(hidden)
    t["mtp.pre_fc_norm_hidden.weight"] = init.norm(hidden)
    t.update(layer("mtp.layers.0.", False))
    t["mtp.norm.weight"] = init.norm(hidden)
    return cfg, t


def _ernie4_5_moe(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """ERNIE 4.5 MoE (300B-A47B shape): 3 layers (layer 0 dense, then softmax-routed MoE
    with shared experts and the unused ``moe_statics.e_score_correction_bias``), an
    untied head, and one MTP layer: ``model.mtp_{emb_norm,hidden_norm,linear_proj}.0``
    and ``model.mtp_block.0`` (dense), closed by the trunk's final norm."""
    cfg = {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "use_bias": False,
        "tie_word_embeddings": False,
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 2,
        "moe_layer_interval": 1,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_num_shared_experts": 1,
        "moe_capacity": [4, 4, 4],
        "moe_gate": "topk",
        "moe_use_aux_free": True,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
    }
    hidden = cfg["hidden_size"]

    def layer(prefix: str, moe: bool) -> Tensors:
        t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
        t.update(_gqa_attention(init, f"{prefix}self_attn.", cfg, 16, qk_norm=False))
        t = {k: v for k, v in t.items() if not k.endswith(".bias")}
        t[f"{prefix}post_attention_layernorm.weight"] = init.norm(hidden)
        mlp = f"{prefix}mlp."
        if moe:
            t[f"{mlp}gate.weight"] = init.linear(cfg["moe_num_experts"], hidden)
            bias = init.normal((1, cfg["moe_num_experts"]), 0.01)
            t[f"{mlp}moe_statics.e_score_correction_bias"] = bias
            for e in range(cfg["moe_num_experts"]):
                t.update(
                    _dense_mlp(init, f"{mlp}experts.{e}.", hidden, MOE_INTERMEDIATE)
                )
            t.update(
                _dense_mlp(init, f"{mlp}shared_experts.", hidden, MOE_INTERMEDIATE)
            )
        else:
            t.update(_dense_mlp(init, mlp, hidden, cfg["intermediate_size"]))
        return t

    t = {"model.embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(cfg["num_hidden_layers"]):
        t.update(layer(f"model.layers.{i}.", i >= cfg["moe_layer_start_index"]))
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    t["model.mtp_emb_norm.0.weight"] = init.norm(hidden)
    t["model.mtp_hidden_norm.0.weight"] = init.norm(hidden)
    t["model.mtp_linear_proj.0.weight"] = init.linear(hidden, 2 * hidden)
    t.update(layer("model.mtp_block.0.", False))
    return cfg, t


def _longcat_flash(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """LongCat-Flash: 2 layers of two MLA sub-layers, two dense MLPs and a shortcut MoE
    with identity ("zero") experts; one MTP layer at ``model.mtp.layers.0`` (MLA with
    the LoRA-rank scales, dense MLP under ``transformer_layer.``, ``enorm.m`` /
    ``hnorm.m``), ``model.mtp.norm`` and a copy of the embedding."""
    cfg = {
        "architectures": ["LongcatFlashForCausalLM"],
        "model_type": "longcat_flash",
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": INTERMEDIATE,
        "expert_ffn_hidden_size": MOE_INTERMEDIATE,
        "num_layers": 2,
        "num_hidden_layers": 2,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "moe_topk": 2,
        "num_attention_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": False,
        "router_bias": False,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    hidden, ffn = cfg["hidden_size"], cfg["ffn_hidden_size"]
    experts = cfg["n_routed_experts"] + cfg["zero_expert_num"]
    t = {"model.embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for l in range(cfg["num_layers"]):
        prefix = f"model.layers.{l}."
        for i in range(2):
            t[f"{prefix}input_layernorm.{i}.weight"] = init.norm(hidden)
            t.update(_mla_attention(init, f"{prefix}self_attn.{i}.", cfg))
            t[f"{prefix}post_attention_layernorm.{i}.weight"] = init.norm(hidden)
            t.update(_dense_mlp(init, f"{prefix}mlps.{i}.", hidden, ffn))
        t[f"{prefix}mlp.router.classifier.weight"] = init.linear(experts, hidden)
        t[f"{prefix}mlp.router.e_score_correction_bias"] = init.normal((experts,), 0.01)
        for e in range(cfg["n_routed_experts"]):
            t.update(
                _dense_mlp(init, f"{prefix}mlp.experts.{e}.", hidden, MOE_INTERMEDIATE)
            )
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    mtp = "model.mtp.layers.0."
    t["model.mtp.embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
    t[f"{mtp}enorm.m.weight"] = init.norm(hidden)
    t[f"{mtp}hnorm.m.weight"] = init.norm(hidden)
    t[f"{mtp}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
    t[f"{mtp}input_layernorm.weight"] = init.norm(hidden)
    t.update(_mla_attention(init, f"{mtp}self_attn.", cfg))
    t[f"{mtp}post_attention_layernorm.weight"] = init.norm(hidden)
    t.update(_dense_mlp(init, f"{mtp}transformer_layer.mlp.", hidden, ffn))
    t["model.mtp.norm.weight"] = init.norm(hidden)
    return cfg, t


def _bailing_moe(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Ling's MoE: sigmoid router ``gate.weight`` with ``gate.expert_bias``, SwiGLU
    experts, one shared expert."""
    hidden, experts = cfg["hidden_size"], cfg["num_experts"]
    t = {
        f"{prefix}gate.weight": init.linear(experts, hidden),
        f"{prefix}gate.expert_bias": init.normal((experts,), 0.01),
    }
    for e in range(experts):
        t.update(_dense_mlp(init, f"{prefix}experts.{e}.", hidden, MOE_INTERMEDIATE))
    shared = cfg["moe_shared_expert_intermediate_size"]
    t.update(_dense_mlp(init, f"{prefix}shared_experts.", hidden, shared))
    return t


def _bailing_mla(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Ling's MLA: DeepSeek's tensors with ``dense`` as the output projection."""
    t = _mla_attention(init, prefix, cfg)
    t[f"{prefix}dense.weight"] = t.pop(f"{prefix}o_proj.weight")
    return t


def _bailing_lightning(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Lightning attention: fused ``query_key_value``, q/k norms, output gate
    ``g_proj`` with a group norm ``g_norm``, output ``dense``."""
    hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    return {
        f"{prefix}query_key_value.weight": init.linear(3 * heads * d, hidden),
        f"{prefix}query_layernorm.weight": init.norm(d),
        f"{prefix}key_layernorm.weight": init.norm(d),
        f"{prefix}g_proj.weight": init.linear(heads * d, hidden),
        f"{prefix}g_norm.weight": init.norm(heads * d),
        f"{prefix}dense.weight": init.linear(hidden, heads * d),
    }


def _bailing_hybrid(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """Ling 2.5 (bailing_hybrid): 4 layers in groups of 2 (lightning attention, then
    MLA; layer 0 dense, then MoE with grouped routing) and one MTP layer appended at
    ``model.layers.4`` (MLA + MoE, ``final_layernorm``)."""
    cfg = {
        "architectures": ["BailingMoeV2_5ForCausalLM"],
        "model_type": "bailing_hybrid",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_shared_expert_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": 4,
        "layer_group_size": 2,
        "group_norm_size": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rope_interleave": True,
        "rope_theta": 600000.0,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "norm_topk_prob": True,
        "moe_router_enable_expert_bias": True,
        "use_qkv_bias": False,
        "use_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    }
    hidden, L, group = cfg["hidden_size"], cfg["num_hidden_layers"], 2

    def layer(prefix: str, idx: int) -> Tensors:
        is_global = (idx + 1) % group == 0 or idx >= (L // group) * group
        t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
        attention = _bailing_mla if is_global else _bailing_lightning
        t.update(attention(init, f"{prefix}attention.", cfg))
        t[f"{prefix}post_attention_layernorm.weight"] = init.norm(hidden)
        if idx >= cfg["first_k_dense_replace"]:
            t.update(_bailing_moe(init, f"{prefix}mlp.", cfg))
        else:
            t.update(
                _dense_mlp(init, f"{prefix}mlp.", hidden, cfg["intermediate_size"])
            )
        return t

    t = {"model.word_embeddings.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(L):
        t.update(layer(f"model.layers.{i}.", i))
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    mtp = f"model.layers.{L}."
    t[f"{mtp}enorm.weight"] = init.norm(hidden)
    t[f"{mtp}hnorm.weight"] = init.norm(hidden)
    t[f"{mtp}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
    t.update(layer(mtp, L))
    t[f"{mtp}final_layernorm.weight"] = init.norm(hidden)
    return cfg, t


def _bailing_kda(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Kimi Delta Attention: q/k/v projections with short depthwise convolutions (HF
    ``(C, 1, K)``), per-channel gate ``f_proj`` with ``A_log`` / ``dt_bias``, beta
    ``b_proj``, output gate ``g_proj``, per-head ``o_norm``, ``o_proj``."""
    hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    size, kernel = heads * d, cfg["short_conv_kernel_size"]
    t = {}
    for name in ("q", "k", "v"):
        t[f"{prefix}{name}_proj.weight"] = init.linear(size, hidden)
        t[f"{prefix}{name}_conv1d.weight"] = init.normal((size, 1, kernel), 0.3)
    t.update(
        {
            f"{prefix}A_log": np.log(init.rng.uniform(1.0, 16.0, heads)).astype(
                np.float32
            ),
            f"{prefix}f_proj.weight": init.linear(size, hidden),
            f"{prefix}dt_bias": init.normal((size,), 0.5),
            f"{prefix}b_proj.weight": init.linear(heads, hidden),
            f"{prefix}g_proj.weight": init.linear(size, hidden),
            f"{prefix}o_norm.weight": init.norm(d),
            f"{prefix}o_proj.weight": init.linear(hidden, size),
        }
    )
    return t


def _bailing_moe_v3(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """Ling 3.0 (bailing_moe_v3): 4 layers in groups of 2 (KDA, then MLA with a head
    gate; layer 0 dense, then grouped-routing MoE) and one MTP layer appended at
    ``model.layers.4`` (MLA + MoE, its router bias saved as
    ``e_score_correction_bias``, ``final_layernorm``)."""
    cfg = {
        "architectures": ["BailingMoeV3ForCausalLM"],
        "model_type": "bailing_moe_v3",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_shared_expert_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": 4,
        "layer_group_size": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "rope_interleave": True,
        "rope_theta": 6000000.0,
        "short_conv_kernel_size": 4,
        "kda_lower_bound": -5.0,
        "kda_safe_gate": True,
        "no_kda_lora": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    }
    hidden, L, group = cfg["hidden_size"], cfg["num_hidden_layers"], 2

    def layer(prefix: str, idx: int, bias_name: str = "expert_bias") -> Tensors:
        is_kda = not ((idx + 1) % group == 0 or idx >= (L // group) * group)
        t = {f"{prefix}input_layernorm.weight": init.norm(hidden)}
        if is_kda:
            t.update(_bailing_kda(init, f"{prefix}attention.", cfg))
        else:
            t.update(_bailing_mla(init, f"{prefix}attention.", cfg))
            heads = cfg["num_attention_heads"]
            t[f"{prefix}attention.g_proj.weight"] = init.linear(heads, hidden)
        t[f"{prefix}post_attention_layernorm.weight"] = init.norm(hidden)
        if idx >= cfg["first_k_dense_replace"]:
            moe = _bailing_moe(init, f"{prefix}mlp.", cfg)
            bias = moe.pop(f"{prefix}mlp.gate.expert_bias")
            moe[f"{prefix}mlp.gate.{bias_name}"] = bias
            t.update(moe)
        else:
            t.update(
                _dense_mlp(init, f"{prefix}mlp.", hidden, cfg["intermediate_size"])
            )
        return t

    t = {"model.word_embeddings.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(L):
        t.update(layer(f"model.layers.{i}.", i))
    t["model.norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    mtp = f"model.layers.{L}."
    t[f"{mtp}enorm.weight"] = init.norm(hidden)
    t[f"{mtp}hnorm.weight"] = init.norm(hidden)
    t[f"{mtp}eh_proj.weight"] = init.linear(hidden, 2 * hidden)
    t.update(layer(mtp, L, "e_score_correction_bias"))
    t[f"{mtp}final_layernorm.weight"] = init.norm(hidden)
    return cfg, t


# DeepSeek-V4 (release layout: DeepSeek's own tensor names, no ``model.`` prefix)

V4_COMPRESS_RATIOS = [0, 4, 16, 4, 0]  # window, CSA, HCA, CSA; the MTP layer's last
V4_HC_FN_STD = 0.05  # HF inits mHC fn at 0.02; larger so pre/post/comb vary
V4_HC_NOISE_STD = 0.1  # noise on the mHC base (HF: zeros) and scale (HF: ones)
V4_INDEXER_STD = 0.3  # indexer projections, as DSA_INDEXER (spread index scores)
V4_SINK_STD = 0.5
V4_APE_STD = 0.1
V4_ROUTER_BIAS_STD = 0.1


_V4_LAYER_TYPES = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    16: "heavily_compressed_attention",
}


def _v4_config(vocab_size: int, **options) -> dict:
    """DeepSeek-V4-Flash's config keys (the release's legacy names) at tiny sizes."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 1.0,
        "num_hash_layers": 2,
        "sliding_window": 8,
        "compress_ratios": list(V4_COMPRESS_RATIOS),
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 1024,  # = 4096 / factor
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "index_n_heads": 16,  # 8 gave exact top-k ties at 0 (every ReLU off)
        "index_head_dim": 16,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 4,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    unknown = set(options) - set(cfg)
    if unknown:
        raise ValueError(f"unknown deepseek_v4 options: {sorted(unknown)}")
    cfg.update(options)
    # transformers reads the legacy ratios only as 0, 4 or 128; its own keys say the
    # tiny HCA ratio (mlx-mtp, like DeepSeek's code, reads compress_ratios)
    layers = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    cfg["layer_types"] = [_V4_LAYER_TYPES[r] for r in layers]
    cfg["compress_rates"] = {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": 16,
    }
    return cfg


def _v4_hc(init: _Init, name: str, cfg: dict, mixes: int, scales: int) -> Tensors:
    """``{name}_fn`` (mixes, hc * D), ``{name}_base`` (mixes), ``{name}_scale``."""
    width = cfg["hc_mult"] * cfg["hidden_size"]
    return {
        f"{name}_fn": init.normal((mixes, width), V4_HC_FN_STD),
        f"{name}_base": init.normal((mixes,), V4_HC_NOISE_STD),
        f"{name}_scale": 1.0 + init.normal((scales,), V4_HC_NOISE_STD),
    }


def _v4_compressor(
    init: _Init, prefix: str, cfg: dict, dim: int, ratio: int
) -> Tensors:
    """Gated pooling over blocks of ``ratio`` rows; twice as wide with overlap (4)."""
    width = (2 if ratio == 4 else 1) * dim
    hidden = cfg["hidden_size"]
    return {
        f"{prefix}wkv.weight": init.linear(width, hidden),
        f"{prefix}wgate.weight": init.linear(width, hidden),
        f"{prefix}ape": init.normal((ratio, width), V4_APE_STD),
        f"{prefix}norm.weight": init.norm(dim),
    }


def _v4_attention(init: _Init, prefix: str, cfg: dict, ratio: int) -> Tensors:
    """Shared-KV MQA with sinks, a grouped output projection and, for ``ratio`` > 0,
    a compressor (and for ``ratio`` == 4 the indexer with its own compressor)."""
    hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q_rank, groups = cfg["q_lora_rank"], cfg["o_groups"]
    t = {
        f"{prefix}wq_a.weight": init.linear(q_rank, hidden),
        f"{prefix}q_norm.weight": init.norm(q_rank),
        f"{prefix}wq_b.weight": init.linear(heads * d, q_rank),
        f"{prefix}wkv.weight": init.linear(d, hidden),
        f"{prefix}kv_norm.weight": init.norm(d),
        f"{prefix}wo_a.weight": init.linear(
            groups * cfg["o_lora_rank"], heads * d // groups
        ),
        f"{prefix}wo_b.weight": init.linear(hidden, groups * cfg["o_lora_rank"]),
        f"{prefix}attn_sink": init.normal((heads,), V4_SINK_STD),
    }
    if ratio > 0:
        t.update(_v4_compressor(init, f"{prefix}compressor.", cfg, d, ratio))
    if ratio == 4:
        ih, c = cfg["index_n_heads"], cfg["index_head_dim"]
        ix = f"{prefix}indexer."
        t[f"{ix}wq_b.weight"] = init.linear(ih * c, q_rank, V4_INDEXER_STD)
        t[f"{ix}weights_proj.weight"] = init.linear(ih, hidden, V4_INDEXER_STD)
        t.update(_v4_compressor(init, f"{ix}compressor.", cfg, c, ratio))
    return t


def _v4_swiglu(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """``w1`` (gate), ``w2`` (down), ``w3`` (up)."""
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    return {
        f"{prefix}w1.weight": init.linear(inter, hidden),
        f"{prefix}w2.weight": init.linear(hidden, inter),
        f"{prefix}w3.weight": init.linear(inter, hidden),
    }


def _v4_moe(init: _Init, prefix: str, cfg: dict, hashed: bool) -> Tensors:
    """Router (hash table ``tid2eid`` or a float32 ``bias``), experts, shared."""
    n_experts, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    t = {f"{prefix}gate.weight": init.linear(n_experts, cfg["hidden_size"])}
    if hashed:  # each token's row: top_k distinct experts
        draws = init.rng.random((cfg["vocab_size"], n_experts))
        t[f"{prefix}gate.tid2eid"] = np.argsort(draws, axis=1)[:, :top_k].astype(
            np.int32
        )
    else:
        t[f"{prefix}gate.bias"] = init.normal((n_experts,), V4_ROUTER_BIAS_STD)
    for e in range(n_experts):
        t.update(_v4_swiglu(init, f"{prefix}experts.{e}.", cfg))
    t.update(_v4_swiglu(init, f"{prefix}shared_experts.", cfg))
    return t


def _v4_block(init: _Init, prefix: str, cfg: dict, layer_id: int) -> Tensors:
    """One V4 block: mHC for attention and FFN, their norms, attention, MoE."""
    hidden, hc = cfg["hidden_size"], cfg["hc_mult"]
    t = {
        f"{prefix}attn_norm.weight": init.norm(hidden),
        f"{prefix}ffn_norm.weight": init.norm(hidden),
    }
    for site in ("attn", "ffn"):
        t.update(_v4_hc(init, f"{prefix}hc_{site}", cfg, (2 + hc) * hc, 3))
    ratio = cfg["compress_ratios"][layer_id]
    t.update(_v4_attention(init, f"{prefix}attn.", cfg, ratio))
    hashed = layer_id < cfg["num_hash_layers"]
    t.update(_v4_moe(init, f"{prefix}ffn.", cfg, hashed))
    return t


def _deepseek_v4(init: _Init, vocab_size: int, **options) -> Tuple[dict, Tensors]:
    """DeepSeek-V4-Flash in its release layout (DeepSeek's names, as HF
    ``deepseek-ai/DeepSeek-V4-Flash`` ships them): 4 layers (window + hash MoE, CSA +
    hash MoE, HCA, CSA; ``compress_ratios`` [0, 4, 16, 4] plus the MTP layer's 0),
    mHC streams (``hc_mult`` 4), ``hc_head_*``, and one MTP layer ``mtp.0.``
    (``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, ``hc_head_*`` and a
    window-only V4 block with a biased router; no embed/head copies).
    ``options`` override config keys. ``tid2eid`` is int32; ``hc_*``, ``ape``,
    ``attn_sink`` and ``gate.bias`` stay float32 when written (``_to_mx``)."""
    cfg = _v4_config(vocab_size, **options)
    hidden, hc, L = cfg["hidden_size"], cfg["hc_mult"], cfg["num_hidden_layers"]
    if len(cfg["compress_ratios"]) != L + cfg["num_nextn_predict_layers"]:
        raise ValueError("compress_ratios needs one entry per layer and MTP layer")
    t = {"embed.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(L):
        t.update(_v4_block(init, f"layers.{i}.", cfg, i))
    t["norm.weight"] = init.norm(hidden)
    t.update(_v4_hc(init, "hc_head", cfg, hc, 1))
    t["head.weight"] = init.linear(vocab_size, hidden)
    for j in range(cfg["num_nextn_predict_layers"]):
        prefix = f"mtp.{j}."
        t[f"{prefix}e_proj.weight"] = init.linear(hidden, hidden)
        t[f"{prefix}h_proj.weight"] = init.linear(hidden, hidden)
        t[f"{prefix}enorm.weight"] = init.norm(hidden)
        t[f"{prefix}hnorm.weight"] = init.norm(hidden)
        t.update(_v4_block(init, prefix, cfg, L + j))
        t[f"{prefix}norm.weight"] = init.norm(hidden)
        t.update(_v4_hc(init, f"{prefix}hc_head", cfg, hc, 1))
    return cfg, t


def _nextn_layers(
    init: _Init, cfg: dict, trunk: Tensors, layer: Callable[[str, int], Tensors]
) -> Tensors:
    """DeepSeek/GLM MTP layers at ``model.layers.{num_hidden_layers + i}.``."""
    t = {}
    first = cfg["num_hidden_layers"]
    for idx in range(first, first + cfg["num_nextn_predict_layers"]):
        prefix = f"model.layers.{idx}."
        t.update(_nextn_head(init, prefix, cfg["hidden_size"], trunk))
        t.update(layer(prefix, idx))
    return t


# Hy4's identity hyper-connections: HF-style small mixes, with noise on the bases and
# scales so that each stream's pre / post weights differ.
HY_HC_FN_STD = 0.05
HY_HC_NOISE_STD = 0.3
HY_SINK_STD = 0.5  # per-head attention sink logits


def _hy_hc(init: _Init, prefix: str, cfg: dict, head: bool = False) -> Tensors:
    """An identity hyper-connection: ``hc_fn`` (2 hc, hc * D), ``hc_base`` (2 hc),
    ``hc_scale`` (2); the head's ``hc_head_*`` mixes hc streams with one scale."""
    hc, width = cfg["hc_mult"], cfg["hc_mult"] * cfg["hidden_size"]
    name, mixes, scales = ("hc_head", hc, 1) if head else ("hc", 2 * hc, 2)
    return {
        f"{prefix}{name}_fn": init.normal((mixes, width), HY_HC_FN_STD),
        f"{prefix}{name}_base": init.normal((mixes,), HY_HC_NOISE_STD),
        f"{prefix}{name}_scale": 1.0 + init.normal((scales,), HY_HC_NOISE_STD),
    }


def _hy_moe(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """Hy4's MoE as released: the router, the routed experts fused
    (``experts.gate_up_proj`` (E, 2I, H), gate rows first; ``experts.down_proj``
    (E, H, I)) and a shared expert."""
    hidden, n_experts = cfg["hidden_size"], cfg["n_routed_experts"]
    inter = cfg["moe_intermediate_size"]
    return {
        f"{prefix}gate.weight": init.linear(n_experts, hidden),
        f"{prefix}gate.e_score_correction_bias": init.normal((n_experts,), 0.01),
        f"{prefix}experts.gate_up_proj": init.normal(
            (n_experts, 2 * inter, hidden), WEIGHT_STD
        ),
        f"{prefix}experts.down_proj": init.normal(
            (n_experts, hidden, inter), WEIGHT_STD
        ),
        **_dense_mlp(init, f"{prefix}shared_experts.", hidden, inter),
    }


def _hy_v4_layer(init: _Init, prefix: str, cfg: dict, idx: int, mtp: bool) -> Tensors:
    """A Hy4 decoder layer: MLA (an indexer unless the layer is "shared") with an
    output gate and sinks, a dense MLP below ``first_k_dense_replace`` else MoE, and
    (in the trunk) its two hyper-connections."""
    full = mtp or cfg["indexer_types"][idx] == "full"
    heads, v_dim = cfg["num_attention_heads"], cfg["v_head_dim"]

    def attention(p: str) -> Tensors:
        t = _mla_attention(init, p, cfg)
        if not full:
            t = {k: v for k, v in t.items() if not k.startswith(f"{p}indexer.")}
        t[f"{p}linear_gate.weight"] = init.linear(heads * v_dim, HIDDEN)
        t[f"{p}learnable_sink_param"] = init.normal((heads,), HY_SINK_STD)
        return t

    dense = not mtp and idx < cfg["first_k_dense_replace"]
    t = _decoder_layer(
        init,
        prefix,
        HIDDEN,
        attention,
        lambda p: (
            _dense_mlp(init, p, HIDDEN, INTERMEDIATE)
            if dense
            else _hy_moe(init, p, cfg)
        ),
    )
    if not mtp:
        t.update(_hy_hc(init, f"{prefix}hc_attn_layer.hc_pre.", cfg))
        t.update(_hy_hc(init, f"{prefix}hc_mlp_layer.hc_pre.", cfg))
    return t


def _hy_v4(
    init: _Init, vocab_size: int, release: Optional[str] = None
) -> Tuple[dict, Tensors]:
    """Hy4 (hy_v4): 4 layers in 4 hyper-connection streams (0 dense, then MoE;
    indexers on layers 0 and 2, layers 1 and 3 sharing their selections) and one MTP
    layer at ``model.mtp_layers.0`` (``enorm``, ``hnorm``, ``eh_proj``,
    ``final_layernorm``, an MoE decoder layer with its own indexer, no streams).

    ``release`` ("mxfp8", or "dequantized" for its float twin): MLA ranks that MXFP8
    groups of 32 divide, written in the release's form (`_hy_v4_release`)."""
    cfg = _deepseek_v3_config(vocab_size)
    cfg.update(DSA_INDEXER)
    if release is not None:
        cfg.update(kv_lora_rank=32, qk_nope_head_dim=32)
    cfg.update(
        architectures=["HYV4ForCausalLM"],
        model_type="hy_v4",
        num_hidden_layers=4,
        num_key_value_heads=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        indexer_types=["full", "shared", "full", "shared"],
        hc_mult=4,
        hc_eps=1e-6,
        hc_magnitude=2.0,
        rms_norm_eps=1e-5,
        # the release's is 10; at 1 the routed experts' clamp binds in the fixture
        swiglu_limit=1.0,
    )
    t = _trunk(init, cfg, lambda p, i: _hy_v4_layer(init, p, cfg, i, mtp=False))
    t.update(_hy_hc(init, "model.hc_head.", cfg, head=True))
    prefix = "model.mtp_layers.0."
    t.update(
        {
            f"{prefix}enorm.weight": init.norm(HIDDEN),
            f"{prefix}hnorm.weight": init.norm(HIDDEN),
            f"{prefix}eh_proj.weight": init.linear(HIDDEN, 2 * HIDDEN),
            f"{prefix}final_layernorm.weight": init.norm(HIDDEN),
        }
    )
    t.update(_hy_v4_layer(init, prefix, cfg, 0, mtp=True))
    return cfg, t


GLM5_NEXT_TYPES = ["linear_attention", "deepseek_sparse_attention"] * 2
GLM5_NEXT_KDA = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4}


def _kda_attention(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """GLM-5-Next's KDA linear attention, as the release names it: q/k/v
    projections and depthwise convolutions ``(C, 1, kernel)``, the forget gate's
    low-rank pair (``f_a_proj``, ``f_b_proj``), ``b_proj``, the output gate's pair,
    ``A_log`` and ``dt_bias`` (float32), ``o_norm``, ``o_proj``."""
    kda = cfg["linear_attn_config"]
    heads, d, kernel = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    hidden, width = cfg["hidden_size"], heads * d
    t = {}
    for name in ("q", "k", "v"):
        t[f"{prefix}{name}_proj.weight"] = init.linear(width, hidden)
        t[f"{prefix}{name}_conv1d.weight"] = init.normal((width, 1, kernel), 0.3)
    t.update(
        {
            f"{prefix}f_a_proj.weight": init.linear(d, hidden),
            f"{prefix}f_b_proj.weight": init.linear(width, d),
            f"{prefix}b_proj.weight": init.linear(heads, hidden),
            f"{prefix}g_a_proj.weight": init.linear(d, hidden),
            f"{prefix}g_b_proj.weight": init.linear(width, d),
            f"{prefix}A_log": init.normal((heads,), 0.5),
            f"{prefix}dt_bias": init.normal((width,), 0.5),
            f"{prefix}o_norm.weight": init.norm(d),
            f"{prefix}o_proj.weight": init.linear(hidden, width),
        }
    )
    return t


def _dsa_nope_attention(init: _Init, prefix: str, cfg: dict, indexer: bool) -> Tensors:
    """GLM-5-Next's sparse MLA (no RoPE), with its pooled-key indexer (its
    compression gate and positional term) when ``indexer``."""
    t = _mla_attention(
        init, prefix, {k: v for k, v in cfg.items() if k != "index_topk"}
    )
    if indexer:
        ih, d, hidden = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hidden_size"]
        p = f"{prefix}indexer."
        t.update(
            {
                f"{p}wq_b.weight": init.linear(ih * d, cfg["q_lora_rank"], 0.3),
                f"{p}wk.weight": init.linear(d, hidden, 0.3),
                f"{p}k_norm.weight": init.norm(d),
                f"{p}k_norm.bias": init.normal((d,), BIAS_STD),
                f"{p}weights_proj.weight": init.linear(ih, hidden, 0.3),
                f"{p}index_kpool_compress_gate": init.linear(d, hidden),
                f"{p}index_kpool_compress_ape": init.normal(
                    (cfg["index_kpool"], d), V4_APE_STD
                ),
            }
        )
    return t


def _glm5_next_layer(
    init: _Init, prefix: str, cfg: dict, idx: int, mtp: bool
) -> Tensors:
    """A GLM-5-Next decoder layer: KDA or sparse MLA, a dense MLP in the first
    ``first_k_dense_replace`` layers else MoE, and (in the trunk) the attention's
    and MLP's hyper-connections ``hc_{attn,ffn}_{fn,base,scale}``."""
    linear = not mtp and cfg["layer_types"][idx] == "linear_attention"
    indexer = mtp or cfg["indexer_types"][idx] == "full"
    dense = not mtp and cfg["mlp_layer_types"][idx] == "dense"
    t = _decoder_layer(
        init,
        prefix,
        HIDDEN,
        lambda p: (
            _kda_attention(init, p, cfg)
            if linear
            else _dsa_nope_attention(init, p, cfg, indexer)
        ),
        lambda p: (
            _dense_mlp(init, p, HIDDEN, INTERMEDIATE)
            if dense
            else _moe_mlp(init, p, cfg)
        ),
    )
    if not mtp:
        mixes = (2 + cfg["hc_mult"]) * cfg["hc_mult"]
        for site in ("attn", "ffn"):
            t.update(_v4_hc(init, f"{prefix}hc_{site}", cfg, mixes, 3))
    return t


def _glm5_next(init: _Init, vocab_size: int) -> Tuple[dict, Tensors]:
    """GLM-5.3-Flash (glm5_next): its text model under ``text_config`` and
    ``model.language_model.`` (``lm_head`` at the top) beside a sample of its vision
    tower (``model.visual.*``), as the release keeps them. Four layers in four
    hyper-connection streams: KDA, sparse MLA with an indexer, KDA, sparse MLA
    sharing layer 1's selection (the release's indexers are all "full"; mlx-vlm
    reads both); dense, then MoE. The nextn layer at ``layers.4``: ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm``, sparse MLA with its own indexer,
    MoE, no streams, no embedding or head copies (as released). Pools of 4 keys,
    2 selected: the indexer chooses from the ninth position on."""
    text = {
        "model_type": "glm5_next_text",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 0,
        "qk_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 0,
        "mla_use_nope": True,
        "attention_bias": False,
        "index_topk": 8,
        "index_kpool": 4,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_kpool_always_select_tail": True,
        "index_kpool_compress": True,
        "linear_attn_config": dict(GLM5_NEXT_KDA, gate_lower_bound=-5.0),
        "layer_types": list(GLM5_NEXT_TYPES),
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "indexer_types": ["full", "full", "full", "shared"],
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "rms_norm_eps": 1e-5,
        # the release's is 10; at 1 the clamp binds in the fixture
        "swiglu_limit": 1.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": None,  # not the release's 154820, past this vocabulary
    }
    t = _trunk(init, text, lambda p, i: _glm5_next_layer(init, p, text, i, mtp=False))
    t.update(_glm5_next_layer(init, "model.layers.4.", text, 4, mtp=True))
    t.update(
        {
            "model.layers.4.enorm.weight": init.norm(HIDDEN),
            "model.layers.4.hnorm.weight": init.norm(HIDDEN),
            "model.layers.4.eh_proj.weight": init.linear(HIDDEN, 2 * HIDDEN),
            "model.layers.4.shared_head.norm.weight": init.norm(HIDDEN),
        }
    )
    t = {
        (
            k
            if k.startswith("lm_head.")
            else "model.language_model." + k[len("model.") :]
        ): v
        for k, v in t.items()
    }
    t["model.visual.patch_embed.proj.weight"] = init.normal((32, 3, 2, 14, 14), 0.02)
    t["model.visual.post_layernorm.weight"] = np.ones(32, dtype=np.float32)
    cfg = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "vision_config": {
            "model_type": "glm5_next_vision",
            "depth": 1,
            "hidden_size": 32,
        },
        "image_token_id": vocab_size - 1,
        "tie_word_embeddings": False,
    }
    return cfg, t


# Qwen3.8-Flash-Next (qwen4_exp): three Gated-DeltaNet layers, then a QSA layer (gated
# attention with a block indexer), all MoE, in four hyper-connection streams; PLE
# n-gram embeddings on layer 1. Its n-gram hashing, as mlx-vlm's
# ``Qwen4ExpNGramEmbedding`` computes it (SplitMix64 multipliers, prime head sizes).
QWEN4_EXP_TYPES = ["linear_attention"] * 3 + ["full_attention"]
QWEN4_PLE_CONV_STD = 0.1  # the PLE's dilated convolution; 0.3 would rule layer 1
_QWEN4_MASK64 = (1 << 64) - 1
_QWEN4_GAMMA = 0x9E3779B97F4A7C15


def _qwen4_splitmix64(value: int) -> int:
    value = (value + _QWEN4_GAMMA) & _QWEN4_MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _QWEN4_MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _QWEN4_MASK64
    return (value ^ (value >> 31)) & _QWEN4_MASK64


def _qwen4_is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, int(np.sqrt(value)) + 1, 2))


def _qwen4_ngram_buffers(text: dict, ple_index: int) -> Tensors:
    """PLE layer ``ple_index``'s hashing buffers (int64): ``layer_multipliers``
    (ngram_size), ``ngram_heads_vocab_sizes`` (the primes from
    ``ngram_vocab_size_base`` on, numbered across PLE layers) and
    ``ngram_heads_offsets``."""
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    sizes, prime = [], text["ngram_vocab_size_base"] - 1
    for _ in range(ple_index * heads):  # the earlier PLE layers' heads
        prime += 1
        while not _qwen4_is_prime(prime):
            prime += 1
    for _ in range(heads):
        prime += 1
        while not _qwen4_is_prime(prime):
            prime += 1
        sizes.append(prime)
    half = max(1, ((1 << 63) - 1) // max(text["vocab_size"], 1) // 2)
    base = text.get("seed", 1234) + 10007 * ple_index
    multipliers = [
        2 * (_qwen4_splitmix64((base + _QWEN4_GAMMA * (i + 1)) & _QWEN4_MASK64) % half)
        + 1
        for i in range(text["ngram_size"])
    ]
    return {
        "layer_multipliers": np.array(multipliers, dtype=np.int64),
        "ngram_heads_vocab_sizes": np.array(sizes, dtype=np.int64),
        "ngram_heads_offsets": np.cumsum([0] + sizes[:-1]).astype(np.int64),
    }


def _qwen4_hc(init: _Init, prefix: str, text: dict, inject: bool = True) -> Tensors:
    """A gated hyper-connection: a zero-centred ``hc_norm`` over the hc streams
    (grouped per stream), the low-rank mix ``input_mix_weight_{down,up}`` and, but
    in the final mixers, ``block_inject_weight`` (one gate per stream)."""
    width = text["hc_count"] * text["hidden_size"]
    t = {
        f"{prefix}hc_norm.weight": _zero_norm(init, width),
        f"{prefix}input_mix_weight_down.weight": init.linear(text["hc_lowrank"], width),
        f"{prefix}input_mix_weight_up.weight": init.linear(width, text["hc_lowrank"]),
    }
    if inject:
        t[f"{prefix}block_inject_weight.weight"] = init.linear(text["hc_count"], width)
    return t


def _qwen4_ple(init: _Init, prefix: str, text: dict, ple_index: int) -> Tensors:
    """A PLE block: key/value projections of the n-gram embedding, its dilated
    depthwise convolution ``(hc H, 1, kernel)``, three zero-centred grouped norms,
    the hashing buffers and the n-gram table in ``split_ngram_parts`` row shards of
    the padded table (``ple_embed_dim / n-gram heads`` wide)."""
    hidden, dim = text["hidden_size"], text["ple_embed_dim"]
    width = text["hc_count"] * hidden
    kernel = text["ple_conv_kernel_size"]
    t = {
        f"{prefix}key_proj.weight": init.linear(width, dim),
        f"{prefix}value_proj.weight": init.linear(hidden, dim),
        f"{prefix}conv1d.weight": init.normal((width, 1, kernel), QWEN4_PLE_CONV_STD),
        f"{prefix}norm_key.weight": _zero_norm(init, width),
        f"{prefix}norm_query.weight": _zero_norm(init, width),
        f"{prefix}norm_conv.weight": _zero_norm(init, width),
    }
    buffers = _qwen4_ngram_buffers(text, ple_index)
    t.update({f"{prefix}ple_embedding.{k}": v for k, v in buffers.items()})
    sizes = buffers["ngram_heads_vocab_sizes"]
    divisor = text["make_ngram_vocab_size_divisible_by"]
    rows = -(-int(sizes.sum()) // divisor) * divisor
    heads, parts = len(sizes), text["split_ngram_parts"]
    for i in range(parts):  # the first rows % parts shards one row longer
        shard = rows // parts + (1 if i < rows % parts else 0)
        t[f"{prefix}ple_embedding.ngram_embedding.shard_{i}.weight"] = init.normal(
            (shard, dim // heads), EMBED_STD
        )
    return t


def _qwen4_exp_layer(
    init: _Init, prefix: str, text: dict, idx: int, mtp: bool
) -> Tensors:
    """A Qwen4-Exp decoder layer, no block norms: its PLE (layers in the one-indexed
    ``ple_layer_ids``), the attention's hyper-connection, Gated-DeltaNet or QSA
    (Qwen3.5's gated attention and an indexer ``index_qk_proj`` with zero-centred
    ``{q,k}_layernorm``), the MLP's hyper-connection and the MoE (experts fused, as
    released, in the MTP layer too)."""
    t = {}
    if not mtp and idx + 1 in text["ple_layer_ids"]:
        ple_index = sorted(text["ple_layer_ids"]).index(idx + 1)
        t.update(_qwen4_ple(init, f"{prefix}ple.", text, ple_index))
    t.update(_qwen4_hc(init, f"{prefix}attn_hyper_connection.", text))
    if not mtp and text["layer_types"][idx] == "linear_attention":
        t.update(_gated_deltanet(init, f"{prefix}linear_attn.", text, fused=False))
    else:
        p = f"{prefix}self_attn."
        t.update(_gated_attention(init, p, text))
        heads = text["indexer_n_heads"] + text["indexer_kv_heads"]
        d = text["indexer_head_dim"]
        t[f"{p}indexer.index_qk_proj.weight"] = init.linear(
            heads * d, text["hidden_size"]
        )
        t[f"{p}indexer.q_layernorm.weight"] = _zero_norm(init, d)
        t[f"{p}indexer.k_layernorm.weight"] = _zero_norm(init, d)
    t.update(_qwen4_hc(init, f"{prefix}mlp_hyper_connection.", text))
    t.update(_qwen_moe(init, f"{prefix}mlp.", text, fused=True))
    return t


def _qwen4_exp(init: _Init, vocab_size: int, **sizes) -> Tuple[dict, Tensors]:
    """Qwen3.8-Flash-Next (qwen4_exp) as released: text model under ``text_config``
    and ``model.language_model.`` (``lm_head`` at the top), a sample of the vision
    tower (``model.visual.*``), the MTP at top-level ``mtp.``. Four layers in four
    hyper-connection streams (Gated-DeltaNet x 3, then QSA: pools of 4 keys, 2
    selected, so the indexer drops keys once a query sees 3 whole pools, from the
    twelfth key on), MoE in each, PLE n-grams on layer 1; no final norm (the
    ``hyper_connection_mixer`` closes the trunk). The MTP: ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden`` (over all hc streams), ``fc_embedding``, ``fc_hidden``
    (per stream), a QSA/MoE layer with its hyper-connections and its own mixer.
    Norms zero-centred but the Gated-DeltaNet's; every tensor in the checkpoint
    dtype but the PLE's int64 buffers (``A_log``, ``dt_bias`` included, as
    released). ``sizes``: text config values instead of the fixture's (a larger
    model of this layout: `scripts/make_synthetic_model.py`)."""
    eos = vocab_size - 3  # the fixture tokenizer's <|endoftext|> (PLE's separator)
    text = {
        "model_type": "qwen4_exp_text",
        "dtype": "float32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "full_attention_interval": 4,
        "hc_count": 4,
        "hc_lowrank": 8,
        "head_dim": 16,
        "heads_per_ngram": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "indexer_head_dim": 16,
        "indexer_kv_heads": 1,
        "indexer_n_heads": 2,
        "initializer_range": 0.02,
        "layer_types": list(QWEN4_EXP_TYPES),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "make_ngram_vocab_size_divisible_by": 8,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "mtp": {
            "hybrid": True,
            "layer_types": ["full_attention"],
            "num_hidden_layers": 1,
            "rope_theta": 10000000,
        },
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "ngram_size": 3,
        "ngram_vocab_size_base": 61,
        "num_attention_heads": 4,
        "num_experts": QWEN_EXPERTS,
        "num_experts_per_tok": 2,
        "num_hidden_layers": len(QWEN4_EXP_TYPES),
        "num_key_value_heads": 2,
        "output_gate_type": "sigmoid",
        "partial_rotary_factor": 0.25,
        "ple_conv_kernel_size": 4,
        "ple_embed_dim": HIDDEN,
        "ple_layer_ids": [2],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {  # 4 of 16 dims rotate: 2 frequencies, sections [1, 1, 0]
            "mrope_interleaved": True,
            "mrope_section": [1, 1, 0],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": MOE_INTERMEDIATE,
        "split_ngram_parts": 2,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    text.update(sizes)
    base, hidden = "model.language_model.", text["hidden_size"]
    t = {f"{base}embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(text["num_hidden_layers"]):
        t.update(_qwen4_exp_layer(init, f"{base}layers.{i}.", text, i, mtp=False))
    t.update(_qwen4_hc(init, f"{base}hyper_connection_mixer.", text, inject=False))
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    t["model.visual.patch_embed.proj.weight"] = init.normal((32, 3, 2, 16, 16), 0.02)
    t["model.visual.merger.norm.weight"] = np.ones(32, dtype=np.float32)
    t.update(
        {
            "mtp.pre_fc_norm_embedding.weight": _zero_norm(init, hidden),
            "mtp.pre_fc_norm_hidden.weight": _zero_norm(
                init, text["hc_count"] * hidden
            ),
            "mtp.fc_embedding.weight": init.linear(hidden, hidden),
            "mtp.fc_hidden.weight": init.linear(hidden, hidden),
        }
    )
    t.update(_qwen4_hc(init, "mtp.hyper_connection_mixer.", text, inject=False))
    t.update(_qwen4_exp_layer(init, "mtp.layers.0.", text, 0, mtp=True))
    cfg = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        # the release's image markers, at ids the fixture's tokenizer leaves plain
        "image_token_id": vocab_size - 5,
        "video_token_id": vocab_size - 4,
        "vision_start_token_id": vocab_size - 7,
        "vision_end_token_id": vocab_size - 6,
        "language_model_only": False,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "in_channels": 3,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 2304,
            "out_hidden_size": hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    return cfg, t


# GLM-OCR's chat tokens and image markers (its tokenizer's special tokens).
GLM_TOKENS = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|video|>",
)
# GLM-OCR's template, shortened: image parts as ``<|begin_of_image|><|image|>
# <|end_of_image|>`` (one placeholder per image; the processor repeats it).
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# GLM-OCR's image processor settings, with a pixel budget that keeps a fixture's
# images at 16 to 64 placeholders (the release allows far more).
GLM_PREPROCESSOR = {
    "image_processor_type": "Glm46VImageProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 12544, "longest_edge": 100352},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def _glm_ocr_layer(init: _Init, prefix: str, cfg: dict) -> Tensors:
    """A GLM-OCR text layer: four norms around GQA attention (no biases) and a
    fused ``gate_up_proj`` MLP."""
    hidden, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    inter = cfg["intermediate_size"]
    t = {}
    for norm in ("input", "post_self_attn", "post_attention", "post_mlp"):
        t[f"{prefix}{norm}_layernorm.weight"] = init.norm(hidden)
    for name, dim in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        t[f"{prefix}self_attn.{name}.weight"] = init.linear(dim, hidden)
    t[f"{prefix}self_attn.o_proj.weight"] = init.linear(hidden, q)
    t[f"{prefix}mlp.gate_up_proj.weight"] = init.linear(2 * inter, hidden)
    t[f"{prefix}mlp.down_proj.weight"] = init.linear(hidden, inter)
    return t


def _glm_ocr_vision(init: _Init, cfg: dict) -> Tensors:
    """The CogViT tower under ``model.visual.`` (Hugging Face's conv layouts)."""
    p, width = "model.visual.", cfg["hidden_size"]
    out, inner = cfg["out_hidden_size"], cfg["intermediate_size"]
    patch, t_patch, merge = (
        cfg["patch_size"],
        cfg["temporal_patch_size"],
        cfg["spatial_merge_size"],
    )
    t = {
        f"{p}patch_embed.proj.weight": init.normal(
            (width, 3, t_patch, patch, patch), 0.05
        ),
        f"{p}patch_embed.proj.bias": init.normal((width,), BIAS_STD),
    }
    for i in range(cfg["depth"]):
        b = f"{p}blocks.{i}."
        head = width // cfg["num_heads"]
        t.update(
            {
                f"{b}norm1.weight": init.norm(width),
                f"{b}norm2.weight": init.norm(width),
                f"{b}attn.qkv.weight": init.linear(3 * width, width),
                f"{b}attn.qkv.bias": init.normal((3 * width,), BIAS_STD),
                f"{b}attn.proj.weight": init.linear(width, width),
                f"{b}attn.proj.bias": init.normal((width,), BIAS_STD),
                f"{b}attn.q_norm.weight": init.norm(head),
                f"{b}attn.k_norm.weight": init.norm(head),
            }
        )
        for name, shape in (
            ("gate_proj", (inner, width)),
            ("up_proj", (inner, width)),
            ("down_proj", (width, inner)),
        ):
            t[f"{b}mlp.{name}.weight"] = init.linear(*shape)
            t[f"{b}mlp.{name}.bias"] = init.normal((shape[0],), BIAS_STD)
    t[f"{p}post_layernorm.weight"] = init.norm(width)
    t[f"{p}downsample.weight"] = init.normal((out, width, merge, merge), 0.05)
    t[f"{p}downsample.bias"] = init.normal((out,), BIAS_STD)
    m, context = f"{p}merger.", out * 3
    t.update(
        {
            f"{m}proj.weight": init.linear(out, out),
            f"{m}post_projection_norm.weight": init.norm(out),
            f"{m}post_projection_norm.bias": init.normal((out,), BIAS_STD),
            f"{m}gate_proj.weight": init.linear(context, out),
            f"{m}up_proj.weight": init.linear(context, out),
            f"{m}down_proj.weight": init.linear(out, context),
        }
    )
    return t


def _glm_ocr(
    init: _Init,
    vocab_size: int,
    hidden: int = HIDDEN,
    layers: int = 2,
    vision_width: int = 32,
    vision_depth: int = 2,
) -> Tuple[dict, Tensors]:
    """GLM-OCR (glm_ocr): a 2-layer GLM-OCR text model under
    ``model.language_model.`` with M-RoPE (sections summing to half the head
    dimension, as the release's [16, 24, 24] do for 128), a 2-block vision tower
    under ``model.visual.``, and the MTP layer at
    ``model.language_model.layers.2.`` (DeepSeek's fusion names and copies).

    ``hidden``, ``layers``, ``vision_width`` and ``vision_depth`` size it up for
    timing (heads of 16 dimensions up to a width of 256, of the release's 128 from
    1024 on)."""
    ids = _special_token_ids(vocab_size, GLM_TOKENS)
    head_dim = 128 if hidden >= 1024 else 16
    heads = max(4, hidden // head_dim // 2 * 2) if hidden >= 1024 else 4
    text = {
        "model_type": "glm_ocr_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden if hidden > HIDDEN else INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [16, 24, 24] if head_dim == 128 else [2, 3, 3],
            "partial_rotary_factor": 1.0,
            "rope_theta": 10000,
        },
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": [ids[EOS_TOKEN], ids["<|user|>"]],
        "pad_token_id": ids[EOS_TOKEN],
        "dtype": "float32",
    }
    vision = {
        "model_type": "glm_ocr_vision",
        "depth": vision_depth,
        "hidden_size": vision_width,
        "intermediate_size": 2 * vision_width,
        "num_heads": max(2, vision_width // 64),
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "image_size": 336,
        "in_channels": 3,
        "out_hidden_size": hidden,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    }
    cfg = {
        "architectures": ["GlmOcrForConditionalGeneration"],
        "model_type": "glm_ocr",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image|>"],
        "image_start_token_id": ids["<|begin_of_image|>"],
        "image_end_token_id": ids["<|end_of_image|>"],
        "video_token_id": ids["<|video|>"],
        "tie_word_embeddings": False,
    }
    base = "model.language_model."
    t = {f"{base}embed_tokens.weight": init.normal((vocab_size, hidden), EMBED_STD)}
    for i in range(text["num_hidden_layers"]):
        t.update(_glm_ocr_layer(init, f"{base}layers.{i}.", text))
    t[f"{base}norm.weight"] = init.norm(hidden)
    t["lm_head.weight"] = init.linear(vocab_size, hidden)
    prefix = f"{base}layers.{text['num_hidden_layers']}."
    t.update(_glm_ocr_layer(init, prefix, text))
    t.update(
        {
            f"{prefix}enorm.weight": init.norm(hidden),
            f"{prefix}hnorm.weight": init.norm(hidden),
            f"{prefix}eh_proj.weight": init.linear(hidden, 2 * hidden),
            f"{prefix}shared_head.norm.weight": init.norm(hidden),
            f"{prefix}shared_head.head.weight": t["lm_head.weight"].copy(),
            f"{prefix}embed_tokens.weight": t[f"{base}embed_tokens.weight"].copy(),
        }
    )
    t.update(_glm_ocr_vision(init, vision))
    return cfg, t


_HY_QUANTIZED = re.compile(
    r"model\.(layers|mtp_layers)\.\d+\."
    r"(.*(?<!eh)_proj(_with_mqa)?|.*linear_gate)\.weight$"
)
_HY_EXPERTS = re.compile(r".*\.mlp\.experts\.(gate_up|down)_proj$")


def _mxfp8(value: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(..., out, in)`` as e4m3 bytes ``(..., out, in)`` and ue8m0 scales
    ``(..., out, in / 32)`` (MLX's mxfp8, whose packed words are those bytes)."""
    packed, scales = mx.quantize(mx.array(value), group_size=32, bits=8, mode="mxfp8")
    return np.array(packed).view(np.uint8), np.array(scales)


def _hy_v4_release(config: dict, tensors: Tensors, form: str) -> Tensors:
    """Hy4's tensors as its ModelOpt MXFP8 export stores them (``form`` "mxfp8"):
    every decoder-layer projection but the MTP fusion ``eh_proj``, the output gate
    and the fused experts, as e4m3 bytes with ``weight_scale`` (the experts'
    ``*_scale``). Norms, router, embedding, head, hyper-connections and sinks stay
    float. ``form`` "dequantized": the same values in float (the twin an independent
    reference reads)."""
    out = {}
    for key, value in tensors.items():
        if not (_HY_QUANTIZED.match(key) or _HY_EXPERTS.match(key)):
            out[key] = value
            continue
        packed, scales = _mxfp8(value)
        if form != "mxfp8":
            out[key] = _dequantized(packed, scales)
            continue
        out[key] = packed
        out[key + "_scale"] = scales  # W.weight_scale, experts.*_proj_scale
    if form == "mxfp8":
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "MXFP8",
        }
    return out


def _dequantized(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    words = mx.array(packed).view(mx.uint32)
    value = mx.dequantize(words, mx.array(scales), group_size=32, bits=8, mode="mxfp8")
    return np.array(value.astype(mx.float32))


# How the fixture builds each family's config and tensors: ``build(init, vocab_size,
# **options) -> (config, tensors)``. Everything else the fixture needs of a family
# (where its MTP tensors, embedding and final norm sit, its norms' convention) is the
# family's own (`mlx_mtp.models.family`).
_SPECS: Dict[str, Callable[..., Tuple[dict, Tensors]]] = {
    "bailing_hybrid": _bailing_hybrid,
    "bailing_moe_v3": _bailing_moe_v3,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v32": _deepseek_v32,
    "deepseek_v4": _deepseek_v4,
    "ernie4_5_moe": _ernie4_5_moe,
    "exaone_moe": _exaone_moe,
    "glm4_moe": _glm4_moe,
    "glm4_moe_lite": _glm4_moe_lite,
    "glm_moe_dsa": _glm_moe_dsa,
    "glm_ocr": _glm_ocr,
    "glm5_next": _glm5_next,
    "hy_v4": _hy_v4,
    "longcat_flash": _longcat_flash,
    "mimo": _mimo,
    "mimo_v2_flash": _mimo_v2_flash,
    "nemotron_h": _nemotron_h,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": functools.partial(_qwen3_5, moe=True),
    "qwen3_next": _qwen3_next,
    "qwen4_exp": _qwen4_exp,
    "step3p5": _step3p5,
    "step3p7": _step3p7,
}
# A family's release dtype (``release=`` of `write_checkpoint`): ``(config, tensors,
# form) -> tensors``, after ``predictable``'s rewiring (the release stores its result).
_RELEASE_FORMS = {"hy_v4": _hy_v4_release}
# A family's own tokenizer: (extra special tokens, chat template, image
# processor config or None), by family, or by (family, vision) for an option.
_TOKENIZERS = {
    "glm_ocr": (GLM_TOKENS, GLM_CHAT_TEMPLATE, GLM_PREPROCESSOR),
    **{
        (name, True): (QWEN_VL_TOKENS, QWEN_VL_CHAT_TEMPLATE, QWEN_VL_PREPROCESSOR)
        for name in ("qwen3_5", "qwen3_5_moe")
    },
}
FAMILIES = tuple(_SPECS)  # the families with a fixture (llama's is `write_llama`)


def _family(name: str):
    from mlx_mtp.models import get_family

    return get_family({"model_type": name})


def _distinct_layers(family, cfg: dict, tensors: Tensors) -> List[int]:
    """The MTP layers with fusion tensors of their own (Qwen's layers share one set)."""
    layers = {family.mtp_layer_of(k, cfg) for k in tensors} - {None}
    text = _text_config(cfg)
    first = {
        family.LAYOUT.key(text, j, "eh_proj"): j for j in sorted(layers, reverse=True)
    }
    return sorted(first.values())


# ---------------------------------------------------------------------------
# predictable=True
# ---------------------------------------------------------------------------


# Norms of a layer's attention and MLP outputs (GLM-OCR's four-norm layers).
_OUTPUT_NORMS = ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight")


def _make_predictable(
    family,
    cfg: dict,
    tensors: Tensors,
    rng: np.random.Generator,
    embed_scale: float = PREDICTABLE_EMBED_SCALE,
    norm_offset: float = 0.0,
) -> None:
    """Rewire ``tensors`` in place so the MTP heads often agree with the trunk.

    1. The trunk embedding is scaled by ``PREDICTABLE_EMBED_SCALE``: the residual
       stream is dominated by the current token, so the trunk's greedy next token is
       roughly a function f of the current token. Embedding copies inside MTP layers
       stay exact copies of the scaled table.
    2. Each MTP projection passes the normed embedding through: ``[I | 0.02 R]``
       for ``[embedding, hidden]`` order, ``[0.02 R | I]`` for MiMo's
       ``[hidden, embedding]``. The embedding norm is set to ones and the MTP final
       norm to ``model.norm.weight``.
    3. The MTP layer's ``o_proj`` and every MLP ``down_proj`` in it (dense, experts,
       shared experts) are damped by ``PREDICTABLE_DAMPING``. Norms that layers
       apply to those outputs (GLM-OCR's, which would undo it) are damped so in
       every layer, which also lets the current token rule the trunk's next.

    The MTP head at row i then predicts roughly f(t_{i+1}), i.e. t_{i+2}, with
    context effects making it wrong some of the time.
    """
    layout = family.LAYOUT
    text = _text_config(cfg)
    hidden = text["hidden_size"]
    unit_norm = 0.0 if family.ZERO_CENTRED_NORMS else 1.0  # a norm scaling by one
    original = tensors[family.EMBEDDING_KEY]
    embed = original * np.float32(embed_scale)
    for key, value in tensors.items():  # the embedding and its copies in MTP layers
        if value.shape == original.shape and np.array_equal(value, original):
            tensors[key] = embed.copy()
    for j in _distinct_layers(family, cfg, tensors):
        eye = np.eye(hidden, dtype=np.float32)
        # scaled so that the hidden half adds the same share at any width
        std = PREDICTABLE_PROJ_NOISE * np.sqrt(HIDDEN / hidden)
        noise = (std * rng.standard_normal((hidden, hidden))).astype(np.float32)
        halves = [noise, eye] if layout.hidden_first else [eye, noise]
        if layout.halves:  # kept apart: the embedding's, then the hidden state's
            for name, half in zip(layout.halves, halves):
                tensors[f"{layout.prefix(text, j)}{name}.weight"] = half
        else:
            tensors[layout.key(text, j, "eh_proj")] = np.concatenate(halves, axis=1)
        tensors[layout.key(text, j, "enorm")] = np.full(
            hidden, unit_norm, dtype=np.float32
        )
        if "norm" in layout.fusion.values():  # else the trunk's final norm closes it
            final_norm = tensors[family.FINAL_NORM_KEY] + np.float32(norm_offset)
            tensors[layout.key(text, j, "norm")] = final_norm
    for key in tensors:
        if family.mtp_layer_of(key, cfg) is not None and key.endswith(
            ("o_proj.weight", "down_proj.weight", "wo_b.weight", ".w2.weight")
        ):
            tensors[key] = tensors[key] * np.float32(PREDICTABLE_DAMPING)
        if key.endswith(_OUTPUT_NORMS):
            tensors[key] = tensors[key] * np.float32(PREDICTABLE_DAMPING)


# ---------------------------------------------------------------------------
# Writing weights and configs
# ---------------------------------------------------------------------------


# Kept in float32 whatever the checkpoint dtype, as the releases store them: router
# correction biases; DeepSeek-V4's mHC tensors (``hc_*``), compressor ``ape``,
# attention sinks and router ``gate.bias``; Hy4's hyper-connections and sinks.
_FLOAT32_SUFFIXES = (
    "e_score_correction_bias",
    "router_bias",
    "expert_bias",
    ".ape",
    ".attn_sink",
    ".gate.bias",
    ".learnable_sink_param",
)


# Kept int64, as the release stores them: Qwen4-Exp's PLE n-gram hashing buffers.
_INT64_SUFFIXES = (
    ".ple_embedding.layer_multipliers",
    ".ple_embedding.ngram_heads_vocab_sizes",
    ".ple_embedding.ngram_heads_offsets",
)


def _to_mx(name: str, value: np.ndarray, dtype) -> mx.array:
    """Cast to the checkpoint dtype, except the float32 tensors above; V4's hash
    routing table ``tid2eid`` stays int32, Qwen4-Exp's n-gram buffers int64."""
    arr = mx.array(value)
    if value.dtype == np.uint8:  # a release's fp8 bytes and scales
        return arr
    if name.endswith(_INT64_SUFFIXES):
        return arr.astype(mx.int64)
    if name.endswith(".tid2eid"):
        return arr.astype(mx.int32)
    if name.endswith(_FLOAT32_SUFFIXES) or name.rsplit(".", 1)[-1].startswith("hc_"):
        return arr.astype(mx.float32)
    return arr.astype(dtype)


def _shard_groups(
    trunk_keys: List[str], mtp_keys: List[str], num_shards: int
) -> List[List[str]]:
    """Split keys into ``num_shards`` contiguous groups; MTP keys go to the last one."""
    per_shard = -(-len(trunk_keys) // num_shards)
    groups = [
        trunk_keys[i * per_shard : (i + 1) * per_shard] for i in range(num_shards)
    ]
    groups[-1] = groups[-1] + mtp_keys
    return groups


def _write_weights(
    out: pathlib.Path, tensors: Tensors, mtp_keys: List[str], dtype, num_shards: int
) -> None:
    """Write one ``model.safetensors`` or N shards plus the HF index file."""
    arrays = {k: _to_mx(k, v, dtype) for k, v in tensors.items()}
    if num_shards == 1:
        mx.save_safetensors(
            str(out / "model.safetensors"), arrays, metadata={"format": "pt"}
        )
        return
    mtp = set(mtp_keys)
    trunk_keys = [k for k in tensors if k not in mtp]
    weight_map = {}
    for i, keys in enumerate(_shard_groups(trunk_keys, mtp_keys, num_shards)):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {k: arrays[k] for k in keys}
        mx.save_safetensors(str(out / name), shard, metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    total = sum(a.nbytes for a in arrays.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _token_id_config(ids: Dict[str, int]) -> dict:
    eos = ids[EOS_TOKEN]
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}


def _generation_config(ids: Dict[str, int]) -> dict:
    return {
        "bos_token_id": ids[EOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END]],
        "pad_token_id": ids[EOS_TOKEN],
        "do_sample": False,
    }


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few
tokens with a cheap head and then verifies them with the full model in one pass.
When the draft agrees with the model, several tokens are accepted at once; when it
does not, the first wrong token is replaced and the rest of the draft is dropped.
Multi-token prediction adds small extra layers on top of the trunk. Each layer reads
the hidden state of the last position and the embedding of the next token, and it
predicts the token after that. The output is exact: greedy decoding with a draft head
gives the same text as greedy decoding without one, only faster.
Once upon a time there was a little robot who liked to count. It counted the stars,
the trees, the birds in the sky and the fish in the sea. One day it met a cat. "Hello,"
said the robot. "How many lives do you have?" The cat thought about it for a while
and then said, "Nine, but I only use one at a time." The robot was very happy.
It is a truth universally acknowledged that a model in possession of a good cache
must be in want of a faster kernel. The weather today is sunny with a light breeze,
and the temperature will reach twenty degrees in the afternoon. Please remember to
bring an umbrella tomorrow, because it may rain in the evening.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: What is two plus two? Answer: Two plus two is four.
User: Can you write a function that adds two numbers? Assistant: Sure, here it is.

import math
import numpy as np


def add(a, b):
    """Return the sum of a and b."""
    return a + b


def softmax(x, axis=-1):
    x = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


class Counter:
    def __init__(self, start=0):
        self.value = start

    def step(self, n=1):
        self.value += n
        return self.value

    def __repr__(self):
        return f"Counter(value={self.value})"


def forward(self, hidden_states, attention_mask=None, cache=None):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = self.self_attn(hidden_states, attention_mask, cache)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    return residual + self.mlp(hidden_states)


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

numbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
squares = {n: n * n for n in numbers}
total = sum(value for value in squares.values())
print(f"total = {total}, mean = {total / len(numbers):.2f}")
with open("data.txt", "w", encoding="utf-8") as handle:
    handle.write("hello world\\n")
try:
    result = math.sqrt(-1)
except ValueError as error:
    print("error:", error)
'''


def _special_token_ids(vocab_size: int, extra: Tuple[str, ...] = ()) -> Dict[str, int]:
    """Ids of the special tokens in the tokenizer for ``vocab_size`` (and
    ``extra`` special tokens)."""
    tokenizer = _load_trained(vocab_size, extra)
    return {tok: tokenizer.token_to_id(tok) for tok in (*SPECIAL_TOKENS, *extra)}


def _load_trained(vocab_size: int, extra: Tuple[str, ...] = ()):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(vocab_size, extra))


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int, extra: Tuple[str, ...] = ()) -> str:
    """Train the byte-level BPE once per ``vocab_size``, with ``extra`` special
    tokens after the usual ones; return its JSON."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    n_special = len(SPECIAL_TOKENS) + len(extra)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + n_special:
        raise ValueError(f"vocab_size must be >= {len(alphabet) + n_special}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, *extra])
    assert tokenizer.get_vocab_size() <= vocab_size
    return tokenizer.to_str()


def _tokenizer_config(ids: Dict[str, int], template: str = CHAT_TEMPLATE) -> dict:
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in ids
    }
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map() -> dict:
    return {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }


def write_llama(
    out_dir,
    *,
    seed: int = 0,
    heads: bool = False,
    predictable: bool = False,
    sliding_window: Optional[int] = None,
    weight_std: Optional[float] = None,
    vocab_size: Optional[int] = None,
) -> pathlib.Path:
    """A tiny llama checkpoint (tied embeddings, hidden 64, 2 layers) with the fixture
    tokenizer; ``heads=True`` adds one DeepSeek-style MTP layer at ``model.layers.2``
    (as llama.cpp GGUF ``nextn`` tensors or `mlx-mtp train-heads` name them), random,
    or with ``predictable`` rewired to agree often (see `_make_predictable`).
    ``sliding_window=W`` makes the first layer a sliding-window one (``layer_types``,
    as Mistral-style and SmolLM3 configs have), which mlx-lm caches in a
    ``RotatingKVCache(W)``. ``weight_std`` redraws every matrix with that deviation
    (0.3 gives a trunk whose greedy text keeps changing instead of settling on a
    cycle; the predictable heads then scale its embedding by 2 only). ``vocab_size``
    writes no tokenizer and a vocabulary that small (for sampling statistics)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_size:
        ids, token_ids = range(vocab_size), {t: vocab_size - 1 for t in SPECIAL_TOKENS}
    else:
        write_tokenizer(out, 512)
        tok = json.loads((out / "tokenizer.json").read_text())
        ids = list(tok["model"]["vocab"].values())
        ids += [a["id"] for a in tok["added_tokens"]]
        token_ids = _special_token_ids(512)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "vocab_size": 1 + max(ids),
        "torch_dtype": "float32",
        **_token_id_config(token_ids),
    }
    if sliding_window:
        config["sliding_window"] = sliding_window
        config["layer_types"] = ["sliding_attention", "full_attention"]
    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict(config)
    weights = dict(tree_flatten(llama.Model(args).parameters()))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 4
    if weight_std:
        weights = {
            k: mx.random.normal(v.shape) * weight_std if v.ndim == 2 else v
            for k, v in weights.items()
        }
    if heads:
        config["num_nextn_predict_layers"] = 1
        block = dict(tree_flatten(llama.TransformerBlock(args).parameters()))
        weights.update({f"model.layers.2.{k}": v for k, v in block.items()})
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            weights[f"model.layers.2.{norm}.weight"] = mx.ones((HIDDEN,))
        weights["model.layers.2.eh_proj.weight"] = 0.1 * mx.random.normal(
            (HIDDEN, 2 * HIDDEN)
        )
        if predictable:
            tensors = {k: np.array(v) for k, v in weights.items()}
            rng = np.random.default_rng(seed)
            scale = 2.0 if weight_std else PREDICTABLE_EMBED_SCALE
            _make_predictable(_family("llama"), config, tensors, rng, scale)
            weights = {k: mx.array(v) for k, v in tensors.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    _write_json(out / "config.json", config)
    return out


def write_gemma3(
    out_dir,
    *,
    seed: int = 0,
    sliding_window: int = 8,
    predictable: bool = False,
    weight_std: float = 0.2,
    pattern: int = 3,
) -> pathlib.Path:
    """A tiny Gemma 3 text checkpoint (``gemma3_text``, Hugging Face names, hidden 64):
    ``pattern`` layers, all sliding-window ones (window ``sliding_window``) but the
    last, which is full attention (Gemma 3's releases use a pattern of 6); an untied
    ``lm_head`` (a tied one on an embedding-dominated stream repeats the current token);
    a retrofitted MTP layer (`_retrofitted`). Gemma's norms are stored zero-centred
    (``x * (1 + w)``); the MTP layer's own norms are plain."""
    from mlx_lm.models import gemma3_text

    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": pattern,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": sliding_window,
        "sliding_window_pattern": pattern,
        "max_position_embeddings": 2048,
        "vocab_size": 512,
    }
    weights = _retrofitted(gemma3_text, config, seed, weight_std, zero_norms=True)
    if predictable:
        # Gemma's trunk norms are zero-centred, the retrofitted MTP layer's plain
        tensors = _predictable(weights, config, seed, 4.0, norm_offset=1.0)
        head = f"model.layers.{config['num_hidden_layers']}."
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            # Gemma normalizes each block output: damp there, (1 - 0.8) = 0.2
            tensors[f"{head}{norm}.weight"] = np.full(HIDDEN, -0.8, np.float32)
        weights = {k: mx.array(v) for k, v in tensors.items()}
    return _write_retrofitted(out_dir, config, weights)


def write_gpt_oss(
    out_dir,
    *,
    seed: int = 0,
    sliding_window: int = 8,
    predictable: bool = False,
    weight_std: float = 0.2,
) -> pathlib.Path:
    """A tiny gpt-oss checkpoint (attention sinks, biases, an MoE MLP of 4 experts of
    which 2 are used, an untied ``lm_head``): 2 layers, a sliding-window one (window
    ``sliding_window``) then a full-attention one; a retrofitted MTP layer
    (`_retrofitted`). The tensors carry mlx-lm's names (split ``gate_proj`` /
    ``up_proj`` experts): releases ship MXFP4 ``*_blocks`` / ``*_scales``, which
    mlx-lm's sanitize turns into these, and its sanitize has no path for unquantized
    fused ``gate_up_proj`` tensors to test against."""
    from mlx_lm.models import gpt_oss

    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": HIDDEN,
        "intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "sliding_window": sliding_window,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 2048,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    }
    weights = _retrofitted(gpt_oss, config, seed, weight_std, zero_norms=False)
    if predictable:
        tensors = _predictable(weights, config, seed)
        weights = {k: mx.array(v) for k, v in tensors.items()}
    return _write_retrofitted(out_dir, config, weights)


def _retrofitted(module, config: dict, seed: int, std: float, zero_norms: bool):
    """Weights of an mlx-lm ``module`` model for ``config`` (matrices drawn with
    ``std``; 1-D tensors zeroed when ``zero_norms``, for zero-centred norms), plus one
    DeepSeek-style MTP layer at ``model.layers.{L}`` whose block is shaped as the last
    layer, as `train-heads` writes it. ``config`` gains the MTP and token-id keys."""
    from mlx.utils import tree_flatten

    config.update(
        num_nextn_predict_layers=1,
        torch_dtype="float32",
        **_token_id_config(_special_token_ids(512)),
    )
    mx.random.seed(seed)
    params = dict(
        tree_flatten(module.Model(module.ModelArgs.from_dict(config)).parameters())
    )
    weights = {
        k: (
            mx.random.normal(v.shape) * std
            if v.ndim >= 2
            else (v * 0 if zero_norms else v)
        )
        for k, v in params.items()
    }
    L = config["num_hidden_layers"]
    last, head = f"model.layers.{L - 1}.", f"model.layers.{L}."
    for k, v in list(weights.items()):
        if k.startswith(last):
            name = head + k[len(last) :]
            weights[name] = mx.random.normal(v.shape) * std if v.ndim >= 2 else v
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{head}{norm}.weight"] = mx.ones((HIDDEN,))
    weights[f"{head}eh_proj.weight"] = 0.1 * mx.random.normal((HIDDEN, 2 * HIDDEN))
    return weights


def write_retrofitted(
    out_dir,
    model_type: str,
    config: dict,
    *,
    seed: int = 0,
    weight_std: float = 0.2,
    predictable: bool = False,
) -> pathlib.Path:
    """A tiny checkpoint of any plain mlx-lm decoder trunk (``model_type``, its
    ``config`` without the MTP keys) with a retrofitted MTP layer (`_retrofitted`);
    the mlx-lm class is the one mlx-lm maps ``model_type`` to."""
    from mlx_lm.utils import _get_classes

    config = {"model_type": model_type, "vocab_size": 512, **config}
    model_class, _ = _get_classes(config)
    module = importlib.import_module(model_class.__module__)
    weights = _retrofitted(module, config, seed, weight_std, zero_norms=False)
    if predictable:
        tensors = _predictable(weights, config, seed)
        weights = {k: mx.array(v) for k, v in tensors.items()}
    return _write_retrofitted(out_dir, config, weights)


def _predictable(
    weights, config, seed, scale=PREDICTABLE_EMBED_SCALE, norm_offset=0.0
) -> Tensors:
    """`_make_predictable` on mlx weights; returns numpy tensors."""
    tensors = {k: np.array(v) for k, v in weights.items()}
    rng = np.random.default_rng(seed)
    family = _family(config["model_type"])
    _make_predictable(family, config, tensors, rng, scale, norm_offset)
    return tensors


def _write_retrofitted(out_dir, config: dict, weights: dict) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, 512)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    _write_json(out / "config.json", config)
    return out

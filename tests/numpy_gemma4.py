"""Independent float64 numpy reference for one Gemma 4 assistant draft step.

A test oracle for the MLX drafter, written from the transformers sources (not from
this project's MLX code); it must not import mlx or mlx_lm. Sources followed:

- ``models/gemma4_assistant/modeling_gemma4_assistant.py``:
  ``Gemma4AssistantForCausalLM.forward`` (``pre_projection`` -> ``Gemma4TextModel``
  -> ``post_projection`` / head), ``create_attention_masks`` and
  ``Gemma4AssistantMaskedEmbedder`` (the centroid head);
- ``models/gemma4/modeling_gemma4.py``: ``Gemma4TextModel``,
  ``Gemma4TextDecoderLayer``, ``Gemma4TextAttention`` (KV-shared layers),
  ``Gemma4RMSNorm``, ``Gemma4TextMLP``, ``Gemma4TextRotaryEmbedding``,
  ``eager_attention_forward``;
- ``models/gemma4/configuration_gemma4.py`` (defaults, ``per_layer_config``);
- ``modeling_rope_utils._compute_proportional_rope_parameters``;
- ``masking_utils.create_bidirectional_{,sliding_window_}mask``;
- ``generation/candidate_generator.SinglePositionMultiTokenCandidateGenerator``
  (the assistant's input and its constant position).

One step, for a query at position ``p`` (HF: ``position_ids = len(input_ids) - 1``)::

    x = pre_projection([target_embed(t_p) * sqrt(H_target), h])     # (Hd,)
    for each layer (all KV-shared: K/V come from the target):
        x = layer_scalar * (r + post_ff_norm(mlp(pre_ff_norm(r))))
            where r = x + post_attn_norm(attn(input_norm(x)))
    y = norm(x)
    logits = E_a @ y   (or the centroid head),   projected = post_projection @ y
"""

from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np
from safetensors.numpy import load_file

SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma4TextConfig field defaults (configuration_gemma4.py) for what a step reads.
TEXT_DEFAULTS = {
    "hidden_size": 2304,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": None,
    "rope_parameters": None,
    "attention_k_eq_v": False,
    "use_bidirectional_attention": None,
    "tie_word_embeddings": True,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


# ---------------------------------------------------------------------------
# Checkpoint loading

_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_safetensors_by_hand(path, names=None):
    """{name: array} decoded from the file's header; numpy has no bfloat16, so BF16
    becomes float32 (exact), as ``numpy_reference._load_bf16_safetensors`` does.
    Only ``names`` (a set) are read when given."""
    out = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            start, end = info["data_offsets"]
            f.seek(base + start)
            raw = f.read(end - start)
            if info["dtype"] == "BF16":
                bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
                arr = bits.view(np.float32)
            else:
                arr = np.frombuffer(raw, dtype=_NP_DTYPES[info["dtype"]])
            out[name] = arr.reshape(info["shape"])
    return out


def _read_safetensors(path, names=None):
    """{name: array} of one safetensors file (float tensors as float64, integer
    tensors kept as they are); only ``names`` when given."""
    if names is None:
        try:
            tensors = load_file(path)
        except (TypeError, ValueError):  # BF16: no numpy dtype
            tensors = _read_safetensors_by_hand(path)
    else:
        tensors = _read_safetensors_by_hand(path, names)
    return {
        k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v
        for k, v in tensors.items()
    }


_CACHE = {}


def _load(model_dir, names=None):
    """(config dict, {HF name: array}) of a checkpoint folder, cached per folder and
    file stamps (tests call a step many times on the same tiny checkpoint)."""
    model_dir = os.path.abspath(str(model_dir))
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    cfg_path = os.path.join(model_dir, "config.json")
    stamp = tuple(
        (p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in paths + [cfg_path]
    )
    key = (model_dir, None if names is None else tuple(sorted(names)))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1], hit[2]
    with open(cfg_path) as f:
        config = json.load(f)
    weights = {}
    for path in paths:
        weights.update(_read_safetensors(path, None if names is None else set(names)))
    _CACHE[key] = (stamp, config, weights)
    return config, weights


# ---------------------------------------------------------------------------
# Configuration (Gemma4TextConfig.__post_init__, Gemma4AssistantConfig)


def text_config(config):
    """The assistant's resolved text config: defaults, layer types, sliding window,
    RoPE parameters, and per layer ``head_dim`` / ``num_key_value_heads``."""
    cfg = {**TEXT_DEFAULTS, **config["text_config"]}
    n = cfg["num_hidden_layers"]
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        # Gemma4AssistantConfig.validate_architecture: must be 0 (no PLE)
        if cfg.get(key):
            raise ValueError(f"assistant {key} must be 0, got {cfg[key]}")
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if cfg.get(key):
            raise ValueError(f"assistant {key} must be False")
    # Gemma4AssistantConfig.__post_init__ sets num_kv_shared_layers to
    # num_hidden_layers when it is 0/None, and validation requires exactly that:
    # every assistant layer is "reuse" (reads the target's K/V).
    shared = cfg.get("num_kv_shared_layers") or n
    if shared != n:
        raise ValueError(f"all {n} assistant layers must be KV-shared, got {shared}")

    if cfg["use_bidirectional_attention"] == "all":
        # Gemma4TextConfig.__post_init__ halves the window for this mode.
        cfg["sliding_window"] = cfg["sliding_window"] // 2 + 1
    layer_types = cfg["layer_types"]
    if layer_types is None:  # 5 sliding : 1 full
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    layer_types = list(layer_types)
    layer_types[-1] = FULL  # __post_init__ forces the last layer to full attention
    cfg["layer_types"] = layer_types
    cfg["rope_parameters"] = cfg["rope_parameters"] or DEFAULT_ROPE

    # per_layer_config: either serialized in config.json (sparse overrides keyed by
    # layer index, possibly zero-padded strings), or built by __post_init__ from
    # global_head_dim (default 512) and, when attention_k_eq_v,
    # num_global_key_value_heads, for the full-attention layers.
    if "per_layer_config" in cfg:
        overrides = {int(k): v for k, v in (cfg["per_layer_config"] or {}).items()}
    else:
        full = {"head_dim": cfg.get("global_head_dim", 512)}
        kv_heads = cfg.get("num_global_key_value_heads")
        if cfg["attention_k_eq_v"] and kv_heads is not None:
            full["num_key_value_heads"] = kv_heads
        overrides = {i: full for i, t in enumerate(layer_types) if t == FULL}
    cfg["layers"] = [
        {
            "type": layer_types[i],
            "head_dim": overrides.get(i, {}).get("head_dim", cfg["head_dim"]),
            "num_key_value_heads": overrides.get(i, {}).get(
                "num_key_value_heads", cfg["num_key_value_heads"]
            ),
        }
        for i in range(n)
    ]
    return cfg


# ---------------------------------------------------------------------------
# Building blocks (single query: vectors, no batch or sequence axis)


def rmsnorm(x, w, eps):
    """Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 * w over the last axis (the weight
    is applied as is, not as 1 + w); ``w=None`` for the scale-free variant."""
    y = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + eps, -0.5)
    return y if w is None else y * w


def gelu_tanh(x):
    """ACT2FN["gelu_pytorch_tanh"]."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def linear(W, prefix, x):
    """x @ W[prefix.weight].T (+ bias when the checkpoint has one)."""
    y = x @ W[prefix + ".weight"].T
    bias = W.get(prefix + ".bias")
    return y if bias is None else y + bias


def rope_inv_freq(params, head_dim):
    """(head_dim / 2,) inverse frequencies of one layer type.

    "default" (Gemma4TextRotaryEmbedding.compute_default_rope_parameters):
    theta^(-2i/head_dim) for all head_dim/2 pairs; it ignores ``factor`` and
    ``partial_rotary_factor``.
    "proportional" (modeling_rope_utils._compute_proportional_rope_parameters):
    the first int(partial_rotary_factor * head_dim // 2) pairs get
    theta^(-2i/head_dim) (the exponent is over the FULL head_dim), the remaining
    pairs get frequency 0 (cos 1, sin 0: left unrotated); all divided by ``factor``.
    """
    theta = params["rope_theta"]
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "proportional":
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        rotated = theta ** (-np.arange(0, 2 * angles, 2, dtype=np.float64) / head_dim)
        inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles)])
        return inv / params.get("factor", 1.0)
    raise NotImplementedError(f"rope_type {kind!r}")


def apply_rope(x, position, inv_freq):
    """Rotate-half RoPE at one position: x * cos + rotate_half(x) * sin, with
    emb = cat(freqs, freqs) (pairs (i, i + head_dim/2)). x is (heads, head_dim)."""
    freqs = float(position) * inv_freq  # (head_dim/2,)
    emb = np.concatenate([freqs, freqs])  # (head_dim,)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def kv_visible(layer_type, T, sliding_window):
    """(T,) bool: which of the T shared K/V entries the single query sees.

    Full layers (create_bidirectional_mask): all of them. Sliding layers
    (create_bidirectional_sliding_window_mask with q_idx = 0 -> kv_idx <= W, then
    flipped along kv by Gemma4AssistantForCausalLM.create_attention_masks): the
    last W + 1 entries. A 2D padding mask (none here: one unpadded sequence) would
    only remove entries.
    """
    if layer_type == FULL:
        return np.ones(T, dtype=bool)
    before_flip = np.abs(0 - np.arange(T)) <= sliding_window
    return before_flip[::-1]


def attention(W, p, cfg, layer, x, K, V, position):
    """Gemma4TextAttention of a KV-shared layer for one query; x is (Hd,).

    K, V: (n_kv_heads, T, head_dim), the target's keys (k_norm + RoPE done) and
    values (v_norm done). Scaling is 1.0 (q_norm / k_norm take its place)."""
    n_heads, hd = cfg["num_attention_heads"], layer["head_dim"]
    n_kv = layer["num_key_value_heads"]
    if K.shape[0] != n_kv or K.shape[2] != hd or V.shape != K.shape:
        raise ValueError(
            f"{layer['type']} K/V {K.shape}/{V.shape} do not match the assistant's "
            f"({n_kv} kv heads, head_dim {hd})"
        )
    q = linear(W, p + "q_proj", x).reshape(n_heads, hd)  # (H, hd)
    q = rmsnorm(q, W[p + "q_norm.weight"], cfg["rms_norm_eps"])
    inv_freq = rope_inv_freq(cfg["rope_parameters"][layer["type"]], hd)
    q = apply_rope(q, position, inv_freq)
    # repeat_kv: query head h reads kv head h // (H / n_kv)
    rep = n_heads // n_kv
    K, V = np.repeat(K, rep, axis=0), np.repeat(V, rep, axis=0)  # (H, T, hd)
    scores = np.einsum("hd,htd->ht", q, K) * 1.0  # (H, T)
    visible = kv_visible(layer["type"], K.shape[1], cfg["sliding_window"])
    scores = np.where(visible[None, :], scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("ht,htd->hd", probs, V).reshape(n_heads * hd)  # (H * hd,)
    return linear(W, p + "o_proj", out)  # (Hd,)


def decoder_layer(W, i, cfg, x, kv, position):
    """Gemma4TextDecoderLayer (no per-layer input, no MoE); x is (Hd,)."""
    p, eps = f"model.layers.{i}.", cfg["rms_norm_eps"]
    layer = cfg["layers"][i]
    K, V = (np.asarray(a, dtype=np.float64) for a in kv[layer["type"]])
    h = rmsnorm(x, W[p + "input_layernorm.weight"], eps)
    h = attention(W, p + "self_attn.", cfg, layer, h, K, V, position)
    x = x + rmsnorm(h, W[p + "post_attention_layernorm.weight"], eps)
    h = rmsnorm(x, W[p + "pre_feedforward_layernorm.weight"], eps)
    h = linear(
        W,
        p + "mlp.down_proj",
        act(cfg)(linear(W, p + "mlp.gate_proj", h)) * linear(W, p + "mlp.up_proj", h),
    )
    x = x + rmsnorm(h, W[p + "post_feedforward_layernorm.weight"], eps)
    # layer_scalar is a persistent buffer (ones when the file lacks it)
    return x * W.get(p + "layer_scalar", np.ones(1))


def act(cfg):
    """The MLP activation of ``hidden_activation``."""
    if cfg["hidden_activation"] != "gelu_pytorch_tanh":
        raise NotImplementedError(cfg["hidden_activation"])
    return gelu_tanh


def masked_logits(W, config, y, head):
    """Gemma4AssistantMaskedEmbedder: (V,) logits of the centroid head.

    The top ``centroid_intermediate_top_k`` centroids (of ``centroids @ y``) select
    their ``V // num_centroids`` tokens each through ``token_ordering``; those get
    ``head[token] @ y``, every other token min(selected) - 1."""
    V = head.shape[0]
    per = V // config.get("num_centroids", 2048)
    top_k = config.get("centroid_intermediate_top_k", 32)
    centroid_logits = W["masked_embedding.centroids.weight"] @ y  # (C,)
    top = np.argsort(-centroid_logits, kind="stable")[:top_k]  # (k,)
    order = np.asarray(W["masked_embedding.token_ordering"]).astype(np.int64)
    selected = order.reshape(-1, per)[top].reshape(-1)  # (k * per,)
    selected_logits = head[selected] @ y  # (k * per,)
    out = np.full(V, selected_logits.min() - 1.0)
    out[selected] = selected_logits
    return out


# ---------------------------------------------------------------------------
# Public API


def target_embedding(target_dir, token):
    """(H_target,) the target's input embedding of ``token``:
    ``embed_tokens[token] * sqrt(hidden_size)`` (Gemma4TextScaledWordEmbedding;
    in float64 here, where a bf16 model rounds the scale to bf16)."""
    names = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
    config, W = _load(target_dir, names)
    H = config.get("text_config", config)["hidden_size"]
    E = W.get(names[0], W.get(names[1]))
    if E is None:
        raise KeyError(f"no {names[0]} in {target_dir}")
    return E[int(token)] * np.sqrt(H)


def assistant_step(assistant_dir, target_dir, token: int, hidden, kv: dict, position):
    """One assistant draft step in float64.

    assistant_dir: a Hugging Face ``Gemma4AssistantForCausalLM`` folder.
    target_dir: the target's Hugging Face folder (only its embedding and hidden
        size are used).
    token: t_p, the newest committed token (the assistant's input token).
    hidden: (H_target,) the target's post-norm hidden state at p - 1 (or the
        previous step's ``projected_hidden``).
    kv: {"full_attention": (K, V), "sliding_attention": (K, V)}, each
        (n_kv_heads, T, head_dim): the target's keys (after k_norm and RoPE) and
        values (after v_norm) of its last non-shared layer of that type. Used as
        given: full layers see all T entries, sliding layers the last W + 1.
        (Note: HF's candidate generator does not pass exactly positions 0..p-1: it
        cuts the target's returned states to ``[:p + 1]`` from the front, which
        can keep a rejected draft's entry at index p, and the target's sliding
        layer returns only its last W - 1 cached + new entries. This function
        computes the assistant's forward on whatever K/V it is handed.)
    position: p, the query's RoPE position (constant over a round).

    Returns (logits (V,), projected_hidden (H_target,)). The logits are never
    soft-capped.
    """
    config, W = _load(assistant_dir)
    cfg = text_config(config)
    emb = target_embedding(target_dir, token)  # (H_t,)
    hidden = np.asarray(hidden, dtype=np.float64).reshape(-1)  # (H_t,)
    inputs = np.concatenate([emb, hidden])  # (2 H_t,): [embedding, hidden]
    x = linear(W, "pre_projection", inputs)  # (Hd,)
    # Gemma4TextModel with inputs_embeds: no embedding scale on the assistant side
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(W, i, cfg, x, kv, position)
    y = rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])  # (Hd,)
    projected = linear(W, "post_projection", y)  # (H_t,)
    # lm_head is tied to model.embed_tokens (Gemma4AssistantConfig default)
    tied = config.get("tie_word_embeddings", True)
    head = W["model.embed_tokens.weight"] if tied else W["lm_head.weight"]  # (V, Hd)
    if config.get("use_ordered_embeddings", False):
        logits = masked_logits(W, config, y, head)
    else:
        logits = head @ y
    return logits, projected

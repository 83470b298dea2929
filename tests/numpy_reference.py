"""Independent float64 numpy reference for the trunk and MTP heads.

This module is the ground truth that the MLX runtime (`mlx_mtp`) is tested
against. It reads a raw Hugging Face checkpoint folder (``config.json`` plus
``*.safetensors`` with HF tensor names) and runs a teacher-forced forward in
float64. It must not import mlx or mlx_lm.

Families: ``deepseek_v3`` (MLA + MoE), ``glm4_moe`` (GQA with qk-norm and
partial RoPE + MoE), ``mimo`` (Qwen2 layers), and the hybrid Gated-DeltaNet
trunks ``qwen3_5`` (dense), ``qwen3_5_moe`` and ``qwen3_next`` (MoE). The
trunk math follows mlx-lm 0.32.2, which is the trunk we must match.

Conventions pinned here (from the families' transformers and vLLM sources):

- The MTP head reads the trunk hidden state AFTER the trunk's final norm.
- Concat order is ``[enorm(emb), hnorm(hidden)]`` for deepseek_v3 and
  glm4_moe, and the reversed ``[hidden_layernorm(hidden), token_layernorm(emb)]``
  for mimo.
- MTP layer ``j`` row ``i`` pairs hidden row ``i`` with token ``t_{i+j+1}``,
  sits at RoPE position ``i``, attends causally to rows ``0..i`` and predicts
  ``t_{i+j+2}``.
- The token embedding of row 0 (position 0) is set to zero, as vLLM does,
  for deepseek_v3, glm4_moe and mimo, but NOT for the Qwen families.
- Layer ``j >= 1`` reads the output of layer ``j-1`` after that layer's final
  norm (``shared_head.norm`` / ``final_layernorm`` / ``mtp.norm``).
- Embedding and LM head always come from the trunk; the copies inside the
  MTP block (``embed_tokens``, ``shared_head.head``) are ignored.

Qwen families (§1-2): config in ``text_config`` for qwen3_5*, flat for
qwen3_next; trunk tensors under ``model.language_model.`` / ``model.``,
``lm_head.weight`` top-level; MTP at ``mtp.`` with ``fc``,
``pre_fc_norm_{embedding,hidden}``, ``norm`` and one full-attention layer
``mtp.layers.0``. Layer i of the trunk is Gated-DeltaNet unless
``(i + 1) % full_attention_interval == 0``. Every Qwen RMSNorm in the raw
files is applied as ``x_hat * (1 + w)`` (input/post-attention, final, q/k and
all MTP norms), except the Gated-DeltaNet output norm ``linear_attn.norm``,
applied as ``x_hat * w``.
"""

import glob
import importlib
import json
import os
import struct

import numpy as np
from safetensors.numpy import load_file

FAMILIES = (
    "bailing_hybrid",
    "bailing_moe_v3",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "ernie4_5_moe",
    "exaone_moe",
    "glm4_moe_lite",
    "glm4_moe",
    "glm5_next",
    "glm_moe_dsa",
    "glm_ocr",
    "hy_v4",
    "longcat_flash",
    "mimo",
    "mimo_v2_flash",
    "nemotron_h",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "qwen4_exp",
    "step3p5",
    "step3p7",
)

# Families whose reference is a module of its own (same functions as here, or its
# own ``reference_logits(ckpt_dir, tokens)`` when the head is not ``hidden @ lm_head``).
SEPARATE = {
    "bailing_hybrid": "numpy_bailing_hybrid",
    "bailing_moe_v3": "numpy_bailing_moe_v3",
    "deepseek_v4": "numpy_deepseek_v4",
    "ernie4_5_moe": "numpy_ernie4_5_moe",
    "exaone_moe": "numpy_exaone_moe",
    "glm5_next": "numpy_glm5_next",
    "glm_ocr": "numpy_glm_ocr",
    "hy_v4": "numpy_hy_v4",
    "longcat_flash": "numpy_longcat_flash",
    "mimo_v2_flash": "numpy_mimo_v2_flash",
    "nemotron_h": "numpy_nemotron_h",
    "qwen4_exp": "numpy_qwen4_exp",
    "step3p5": "numpy_step3p5",
    "step3p7": "numpy_step3p7",
}

# DeepSeek's q_a_layernorm / kv_a_layernorm use a fixed eps in mlx-lm and HF;
# GLM-4.7-Flash's (glm4_moe_lite, the same MLA + MoE layers otherwise) use rms_norm_eps.
MLA_NORM_EPS = 1e-6
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa")


# ---------------------------------------------------------------------------
# Checkpoint loading


def _load_bf16_safetensors(path):
    """Read a safetensors file by hand; numpy has no bfloat16 dtype."""
    dtypes = {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "I64": np.int64,
        "I32": np.int32,  # DeepSeek-V4's tid2eid
    }
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=dtypes[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


def load_checkpoint(ckpt_dir):
    """Return (config dict, {HF name: float64 array})."""
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        config = json.load(f)
    weights = {}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors"))):
        try:
            tensors = load_file(path)
        except (TypeError, ValueError):
            tensors = _load_bf16_safetensors(path)
        weights.update(tensors)
    if not weights:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    return config, {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


# ---------------------------------------------------------------------------
# Building blocks. x is (n, D) for one sequence of n rows.


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def silu(x):
    return x * sigmoid(x)


def linear(W, prefix, x):
    """x @ W[prefix.weight].T (+ W[prefix.bias] when the checkpoint has it)."""
    y = x @ W[prefix + ".weight"].T
    bias = W.get(prefix + ".bias")
    return y if bias is None else y + bias


def rope_angles(positions, dims, base, scale=1.0):
    """(n, dims/2) angles: position * scale * base^(-2i/dims)."""
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    return np.outer(np.asarray(positions, dtype=np.float64) * scale, inv_freq)


def rope_rotate_half(x, positions, dims, base, scale=1.0):
    """Non-interleaved RoPE (mlx nn.RoPE traditional=False) on x[..., :dims].

    x is (heads, n, head_dim); pairs are (i, i + dims/2); the rest is unchanged.
    """
    ang = rope_angles(positions, dims, base, scale)
    cos, sin = np.cos(ang), np.sin(ang)
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    rotated = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return np.concatenate([rotated, x[..., dims:]], axis=-1)


def interleaved_mrope_axes(sections, half):
    """The position axis (0 temporal, 1 height, 2 width) of each of ``half``
    rotary frequencies under interleaved M-RoPE (transformers' Qwen3-VL / Qwen3.5
    ``apply_interleaved_mrope``: frequency j reads height when j % 3 == 1 and
    j < 3 * sections[1], width when j % 3 == 2 and j < 3 * sections[2], else
    temporal)."""
    axes = np.zeros(half, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


def mrope_rotate_half(x, positions, dims, base, sections):
    """`rope_rotate_half` at ``(3, n)`` M-RoPE positions, interleaved."""
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    axes = interleaved_mrope_axes(sections, dims // 2)
    pos = np.asarray(positions, dtype=np.float64)[axes]  # (dims/2, n)
    ang = pos.T * inv_freq  # (n, dims/2)
    cos, sin = np.cos(ang), np.sin(ang)
    half = dims // 2
    x1, x2 = x[..., :half], x[..., half:dims]
    rotated = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return np.concatenate([rotated, x[..., dims:]], axis=-1)


def rope_interleaved(x, positions, dims, base, scale=1.0):
    """Interleaved RoPE (mlx traditional=True): pairs (2i, 2i+1) of x[..., :dims]."""
    ang = rope_angles(positions, dims, base, scale)
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    out = x.copy()
    out[..., 0:dims:2] = x1 * cos - x2 * sin
    out[..., 1:dims:2] = x1 * sin + x2 * cos
    return out


def causal_attention(q, k, v, scale, allowed=None):
    """Softmax(q k^T * scale) v with a causal mask (and'ed with ``allowed`` (n, n)).

    q is (H, n, d), k is (Hkv, n, d), v is (Hkv, n, dv); Hkv divides H and
    query head h reads kv head h // (H / Hkv). Returns (n, H * dv).
    """
    n_heads, n = q.shape[0], q.shape[1]
    repeat = n_heads // k.shape[0]
    k = np.repeat(k, repeat, axis=0)
    v = np.repeat(v, repeat, axis=0)
    scores = (q @ k.transpose(0, 2, 1)) * scale  # (H, n, n)
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    if allowed is not None:
        future = future | ~allowed
    scores = np.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ v  # (H, n, dv)
    return out.transpose(1, 0, 2).reshape(n, -1)


def mlp(W, prefix, x):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""
    gate = linear(W, prefix + ".gate_proj", x)
    up = linear(W, prefix + ".up_proj", x)
    return linear(W, prefix + ".down_proj", silu(gate) * up)


def _rope_scale(cfg):
    """Position scale for mlx-lm's initialize_rope; only default and linear."""
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return 1.0
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    if kind == "default":
        return 1.0
    if kind == "linear":
        return 1.0 / scaling["factor"]
    raise NotImplementedError(f"rope_scaling type {kind!r} is not in the reference")


# ---------------------------------------------------------------------------
# Mixture of experts (DeepSeek-V3 / GLM-4-MoE "noaux_tc" routing)


def route_tokens(logits, bias, cfg):
    """Pick experts and weights per row, as mlx-lm group_expert_select.

    Selection uses sigmoid(logits) + e_score_correction_bias, limited to the
    best topk_group groups (group score = sum of its 2 best biased scores;
    the other groups are set to 0, not -inf). Weights are the un-biased
    sigmoid scores of the selected experts, normalised when norm_topk_prob
    and top_k > 1, times routed_scaling_factor.
    Returns (indices (n, k), weights (n, k)).
    """
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise NotImplementedError("only sigmoid scoring is in the reference")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise NotImplementedError("only noaux_tc routing is in the reference")
    top_k = cfg["num_experts_per_tok"]
    n_group = cfg.get("n_group", 1) or 1
    topk_group = cfg.get("topk_group", 1) or 1

    scores = sigmoid(logits)  # (n, E)
    choice = scores + bias
    if n_group > 1:
        grouped = choice.reshape(choice.shape[0], n_group, -1).copy()
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (n, G)
        n_drop = n_group - topk_group
        drop = np.argsort(group_scores, axis=-1, kind="stable")[:, :n_drop]
        np.put_along_axis(grouped, drop[..., None], 0.0, axis=1)
        choice = grouped.reshape(choice.shape)

    inds = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, inds, axis=-1)
    if top_k > 1 and cfg.get("norm_topk_prob", True):
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return inds, weights * cfg.get("routed_scaling_factor", 1.0)


def moe(W, prefix, cfg, x):
    """Routed SiLU-gated experts plus shared experts."""
    logits = x @ W[prefix + ".gate.weight"].T
    bias = W.get(prefix + ".gate.e_score_correction_bias")
    if bias is None:
        bias = np.zeros(logits.shape[-1])
    inds, weights = route_tokens(logits, bias, cfg)
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            expert = f"{prefix}.experts.{e}"
            out[row] += w * mlp(W, expert, x[row : row + 1])[0]
    if cfg.get("n_shared_experts"):
        out = out + mlp(W, prefix + ".shared_experts", x)
    return out


# ---------------------------------------------------------------------------
# Attention variants


def mla_attention(W, prefix, cfg, x, positions, shared=None):
    """DeepSeek-V3 multi-head latent attention (no cache, causal). With the DSA
    indexer, a layer that has none (GLM-5.2's "shared" layers) attends to the keys
    the last layer with one selected (``shared["last"]``, which a layer with one
    sets)."""
    n, n_heads = x.shape[0], cfg["num_attention_heads"]
    norm_eps = cfg["rms_norm_eps"] if cfg["model_type"] == "glm4_moe_lite" else None
    norm_eps = norm_eps or MLA_NORM_EPS
    d_nope, d_rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    d_v, rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
    if cfg.get("rope_scaling") is not None:
        raise NotImplementedError(
            "DeepSeek rope_scaling (yarn) is not in the reference"
        )

    if cfg.get("q_lora_rank") is None:
        q = linear(W, prefix + ".q_proj", x)
    else:
        q_a = linear(W, prefix + ".q_a_proj", x)
        q_a = rmsnorm(q_a, W[prefix + ".q_a_layernorm.weight"], norm_eps)
        q = linear(W, prefix + ".q_b_proj", q_a)
    q = q.reshape(n, n_heads, d_nope + d_rope).transpose(1, 0, 2)  # (H, n, dq)
    q_nope, q_pe = q[..., :d_nope], q[..., d_nope:]

    kv_a = linear(W, prefix + ".kv_a_proj_with_mqa", x)
    latent, k_pe = kv_a[:, :rank], kv_a[:, rank:]
    latent = rmsnorm(latent, W[prefix + ".kv_a_layernorm.weight"], norm_eps)
    kv = linear(W, prefix + ".kv_b_proj", latent)
    kv = kv.reshape(n, n_heads, d_nope + d_v).transpose(1, 0, 2)  # (H, n, .)
    k_nope, v = kv[..., :d_nope], kv[..., d_nope:]

    base = rope_base(cfg)
    q_pe = rope_interleaved(q_pe, positions, d_rope, base)
    k_pe = rope_interleaved(k_pe[None], positions, d_rope, base)  # (1, n, d_rope)
    k_pe = np.broadcast_to(k_pe, (n_heads, n, d_rope))

    q_full = np.concatenate([q_nope, q_pe], axis=-1)
    k_full = np.concatenate([k_nope, k_pe], axis=-1)
    scale = (d_nope + d_rope) ** -0.5
    allowed = None
    if prefix + ".indexer.wk.weight" in W:
        allowed = dsa_selection(W, prefix + ".indexer", cfg, x, q_a, positions)
        if shared is not None:
            shared["last"] = allowed
    elif "index_topk" in cfg and shared is not None:
        allowed = shared["last"]
    out = causal_attention(q_full, k_full, v, scale, allowed)
    return linear(W, prefix + ".o_proj", out)


def rope_base(cfg):
    """RoPE base: ``rope_theta``, or transformers 5's ``rope_parameters`` (GLM-5)."""
    return cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get(
        "rope_theta", 10000.0
    )


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def dsa_selection(W, prefix, cfg, x, q_a, positions):
    """DeepSeek-V3.2's sparse-attention indexer (mlx-lm ``deepseek_v32.Indexer``):
    which keys each query attends to, (n, n) booleans; every key when the pass has
    at most ``index_topk`` of them.

    Index score of query i and key j: sum over index heads of
    ``relu(q_h(i) . k(j)) * weights_proj(x_i)_h / sqrt(heads * head_dim)``, with
    ``q = wq_b(q_a_layernorm(q_a_proj(x)))`` and ``k = LayerNorm(wk(x))``, RoPE on
    the first ``qk_rope_head_dim`` dims (interleaved per ``indexer_rope_interleave``,
    default False for deepseek_v32 and True for glm_moe_dsa). The top
    ``index_topk`` keys by score among the causal ones are kept.
    """
    n, heads, d = x.shape[0], cfg["index_n_heads"], cfg["index_head_dim"]
    topk = cfg["index_topk"]
    if n <= topk:
        return None
    interleave = cfg.get("indexer_rope_interleave", cfg["model_type"] == "glm_moe_dsa")
    rope = rope_interleaved if interleave else rope_rotate_half
    base = rope_base(cfg)
    q = linear(W, prefix + ".wq_b", q_a).reshape(n, heads, d).transpose(1, 0, 2)
    k = layer_norm(
        linear(W, prefix + ".wk", x),
        W[prefix + ".k_norm.weight"],
        W[prefix + ".k_norm.bias"],
    )
    d_rope = cfg["qk_rope_head_dim"]
    q, k = rope(q, positions, d_rope, base), rope(k[None], positions, d_rope, base)[0]
    weights = linear(W, prefix + ".weights_proj", x) * (heads**-0.5 * d**-0.5)
    scores = np.maximum(q @ k.T, 0) * weights.T[..., None]  # (heads, n, n)
    scores = scores.sum(axis=0)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    keep = np.argsort(-scores, axis=-1, kind="stable")[:, :topk]
    allowed = np.zeros((n, n), dtype=bool)
    np.put_along_axis(allowed, keep, True, axis=-1)
    return allowed


def gqa_attention(W, prefix, cfg, x, positions, family):
    """Grouped-query attention of glm4_moe and mimo (no cache, causal).

    glm4_moe: per-head q_norm/k_norm before RoPE (when use_qk_norm), RoPE on
    the first head_dim * partial_rotary_factor dims, rope_scaling ignored as
    in mlx-lm. mimo: Qwen2 attention, full RoPE.
    """
    n = x.shape[0]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    base = rope_base(cfg)
    if family == "glm4_moe":
        head_dim = cfg["head_dim"]
        rope_dims = int(head_dim * cfg["partial_rotary_factor"])
        rope_scale, traditional = 1.0, False
    else:
        head_dim = cfg["hidden_size"] // n_heads
        rope_dims = head_dim
        rope_scale, traditional = _rope_scale(cfg), cfg.get("rope_traditional", False)

    q = linear(W, prefix + ".q_proj", x).reshape(n, n_heads, head_dim)
    k = linear(W, prefix + ".k_proj", x).reshape(n, n_kv, head_dim)
    v = linear(W, prefix + ".v_proj", x).reshape(n, n_kv, head_dim)
    if family == "glm4_moe" and cfg.get("use_qk_norm"):
        eps = cfg["rms_norm_eps"]
        q = rmsnorm(q, W[prefix + ".q_norm.weight"], eps)
        k = rmsnorm(k, W[prefix + ".k_norm.weight"], eps)
    q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))  # (heads, n, head_dim)

    rope = rope_interleaved if traditional else rope_rotate_half
    q = rope(q, positions, rope_dims, base, rope_scale)
    k = rope(k, positions, rope_dims, base, rope_scale)
    out = causal_attention(q, k, v, head_dim**-0.5)
    return linear(W, prefix + ".o_proj", out)


# ---------------------------------------------------------------------------
# Decoder layers


def is_moe_layer(cfg, family, layer_idx):
    """The mlx-lm rule for which layers use the MoE MLP."""
    if family == "mimo" or cfg.get("n_routed_experts") is None:
        return False
    if layer_idx < cfg.get("first_k_dense_replace", 0):
        return False
    if family in MLA_FAMILIES:
        return layer_idx % cfg.get("moe_layer_freq", 1) == 0
    return True


def decoder_layer(W, prefix, cfg, family, layer_idx, x, positions, shared=None):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)); ``shared``:
    the trunk's DSA selection state (`mla_attention`)."""
    eps = cfg["rms_norm_eps"]
    a_in = rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps)
    if family in MLA_FAMILIES:
        attn = mla_attention(W, prefix + ".self_attn", cfg, a_in, positions, shared)
    else:
        attn = gqa_attention(W, prefix + ".self_attn", cfg, a_in, positions, family)
    h = x + attn
    m_in = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    if is_moe_layer(cfg, family, layer_idx):
        return h + moe(W, prefix + ".mlp", cfg, m_in)
    return h + mlp(W, prefix + ".mlp", m_in)


# ---------------------------------------------------------------------------
# Trunk and MTP heads


def lm_head_weight(W, cfg, family):
    """Trunk LM head, as mlx-lm picks it.

    mimo ties it to the embedding when tie_word_embeddings; deepseek_v3 and
    glm4_moe always use lm_head.weight.
    """
    if family == "mimo" and cfg.get("tie_word_embeddings", False):
        return W["model.embed_tokens.weight"]
    return W["lm_head.weight"]


def trunk_hidden(W, cfg, family, tokens):
    """Hidden states (n, D) after the trunk's final norm (model.norm)."""
    x = W["model.embed_tokens.weight"][np.asarray(tokens)]
    positions, shared = np.arange(len(tokens)), {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        x = decoder_layer(W, prefix, cfg, family, layer, x, positions, shared)
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


def mtp_prefix(cfg, family, j):
    """Checkpoint prefix of MTP layer j."""
    if family == "mimo":
        return f"model.mtp_layers.{j}"
    return f"model.layers.{cfg['num_hidden_layers'] + j}"


def num_mtp_layers(W, cfg, family):
    """MTP layers present in the checkpoint (checked against the config)."""
    key = "input_proj.weight" if family == "mimo" else "eh_proj.weight"
    return count_mtp_layers(W, cfg, lambda j: f"{mtp_prefix(cfg, family, j)}.{key}")


def count_mtp_layers(W, cfg, key_of):
    """How many j have a tensor ``key_of(j)``, checked against the config's
    ``num_nextn_predict_layers``."""
    count = 0
    while key_of(count) in W:
        count += 1
    declared = cfg.get("num_nextn_predict_layers")
    if count and declared is not None and declared != count:
        raise ValueError(
            f"config declares {declared} MTP layers, checkpoint has {count}"
        )
    return count


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """One MTP layer over rows 0..m-1 at positions 0..m-1.

    hidden is (m, D), post final norm; next_tokens[i] is the token paired
    with hidden row i. Returns z (m, D), the layer output after its final norm.
    """
    prefix, eps = mtp_prefix(cfg, family, j), cfg["rms_norm_eps"]
    emb = W["model.embed_tokens.weight"][np.asarray(next_tokens)].copy()
    emb[0] = 0.0  # vLLM zeroes the embedding at position 0
    if family == "mimo":
        h_n = rmsnorm(hidden, W[prefix + ".hidden_layernorm.weight"], eps)
        e_n = rmsnorm(emb, W[prefix + ".token_layernorm.weight"], eps)
        x = linear(W, prefix + ".input_proj", np.concatenate([h_n, e_n], axis=-1))
        final_norm = prefix + ".final_layernorm.weight"
    else:
        e_n = rmsnorm(emb, W[prefix + ".enorm.weight"], eps)
        h_n = rmsnorm(hidden, W[prefix + ".hnorm.weight"], eps)
        x = linear(W, prefix + ".eh_proj", np.concatenate([e_n, h_n], axis=-1))
        final_norm = prefix + ".shared_head.norm.weight"
    layer_idx = cfg["num_hidden_layers"] + j
    positions = np.arange(x.shape[0])
    y = decoder_layer(W, prefix, cfg, family, layer_idx, x, positions)
    return rmsnorm(y, W[final_norm], eps)


# ---------------------------------------------------------------------------
# Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: hybrid Gated-DeltaNet trunks
#
# Raw HF files store every RMSNorm zero-centred, applied as x_hat * (1 + w),
# except the Gated-DeltaNet output norm (linear_attn.norm), applied as x_hat * w.

QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# normalize_qk's l2-norm eps, added to sum(x^2) (mlx-lm gated_delta.py).
GDN_L2_EPS = 1e-6


def qwen_text_config(config):
    """The text-model config: ``text_config`` for qwen3_5*, else the flat config."""
    return config.get("text_config", config)


def qwen_base(family):
    """Prefix of the trunk tensors (embed_tokens, layers, norm)."""
    return "model." if family == "qwen3_next" else "model.language_model."


def rmsnorm_shifted(x, w, eps):
    """Qwen's zero-centred RMSNorm: x_hat * (1 + w)."""
    return rmsnorm(x, 1.0 + w, eps)


def softplus(x):
    """log(1 + exp(x)) without overflow."""
    return np.logaddexp(0.0, x)


def l2_normalize(x, eps=GDN_L2_EPS):
    """x / sqrt(sum(x^2) + eps) over the last axis (mlx-lm normalize_qk)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_depthwise_conv_silu(x, w):
    """SiLU of a depthwise causal conv1d with zero initial state.

    x is (n, C); w is the HF weight (C, 1, K). Output row t is
    sum_k w[c, 0, k] * x_pad[t + k, c] with K-1 zero rows padded in front
    (cross-correlation, as torch and mlx convolve).
    """
    n, kernel = x.shape[0], w.shape[-1]
    taps = w[:, 0, :]  # (C, K)
    padded = np.concatenate([np.zeros((kernel - 1, x.shape[1])), x], axis=0)
    out = np.zeros_like(x)
    for k in range(kernel):
        out += padded[k : k + n] * taps[:, k]
    return silu(out)


def gdn_inputs(W, prefix, cfg, family, x):
    """Project x to (mixed_qkv (n, 2*Hk*Dk + Hv*Dv), z (n, Hv, Dv), b, a (n, Hv)).

    qwen3_5 has separate in_proj_{qkv,z,b,a}. qwen3_next fuses them into
    in_proj_qkvz / in_proj_ba, grouped per key head: for each of the Hk key
    heads, [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)], with
    r = Hv / Hk (mlx-lm fix_query_key_value_ordering).
    """
    n = x.shape[0]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    if family != "qwen3_next":
        mixed_qkv = linear(W, prefix + ".in_proj_qkv", x)
        z = linear(W, prefix + ".in_proj_z", x).reshape(n, nv, dv)
        b = linear(W, prefix + ".in_proj_b", x)
        a = linear(W, prefix + ".in_proj_a", x)
        return mixed_qkv, z, b, a
    r = nv // nk
    qkvz = linear(W, prefix + ".in_proj_qkvz", x).reshape(n, nk, -1)
    q = qkvz[..., :dk]
    k = qkvz[..., dk : 2 * dk]
    v = qkvz[..., 2 * dk : 2 * dk + r * dv]
    z = qkvz[..., 2 * dk + r * dv :]
    ba = linear(W, prefix + ".in_proj_ba", x).reshape(n, nk, 2 * r)
    b, a = ba[..., :r].reshape(n, nv), ba[..., r:].reshape(n, nv)
    mixed_qkv = np.concatenate(
        [q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=-1
    )
    return mixed_qkv, z.reshape(n, nv, dv), b, a


def gated_delta_rule(q, k, v, g, beta):
    """Sequential gated delta rule from a zero state (mlx-lm gated_delta_ops).

    q, k are (n, Hk, Dk), v is (n, Hv, Dv), g and beta are (n, Hv). Value
    head h reads key head h // (Hv / Hk). Per step, with S (Hv, Dv, Dk):
    S *= g; delta = (v - S k) * beta; S += delta k^T; y = S q.
    Returns y (n, Hv, Dv).
    """
    n, n_v, d_v = v.shape
    repeat = n_v // k.shape[1]
    q = np.repeat(q, repeat, axis=1)
    k = np.repeat(k, repeat, axis=1)
    state = np.zeros((n_v, d_v, k.shape[-1]))
    ys = np.zeros_like(v)
    for t in range(n):
        state = state * g[t][:, None, None]
        kv_mem = np.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        ys[t] = np.einsum("hvk,hk->hv", state, q[t])
    return ys


def gated_deltanet(W, prefix, cfg, family, x):
    """Gated-DeltaNet mixer over one sequence (zero conv and recurrent state)."""
    n = x.shape[0]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    mixed_qkv, z, b, a = gdn_inputs(W, prefix, cfg, family, x)
    conv = causal_depthwise_conv_silu(mixed_qkv, W[prefix + ".conv1d.weight"])
    key_dim = nk * dk
    q = conv[:, :key_dim].reshape(n, nk, dk)
    k = conv[:, key_dim : 2 * key_dim].reshape(n, nk, dk)
    v = conv[:, 2 * key_dim :].reshape(n, nv, dv)
    q = l2_normalize(q) * dk**-0.5
    k = l2_normalize(k)

    a_decay = np.exp(W[prefix + ".A_log"])
    g = np.exp(-a_decay * softplus(a + W[prefix + ".dt_bias"]))
    beta = sigmoid(b)
    y = gated_delta_rule(q, k, v, g, beta)  # (n, Hv, Dv)

    # RMSNormGated: plain weight (not 1 + w), then times silu(z).
    y = rmsnorm(y, W[prefix + ".norm.weight"], cfg["rms_norm_eps"]) * silu(z)
    return linear(W, prefix + ".out_proj", y.reshape(n, nv * dv))


def qwen_head_dim(cfg):
    """Attention head dim (qwen3_5 defaults to hidden_size / heads)."""
    head_dim = cfg.get("head_dim")
    return head_dim or cfg["hidden_size"] // cfg["num_attention_heads"]


def qwen_rope(cfg, family):
    """(rope dims, base, position scale) as mlx-lm's Qwen args derive them.

    qwen3_5 reads rope_theta / partial_rotary_factor / type from
    rope_parameters (text-only M-RoPE is plain RoPE); qwen3_next reads the
    top-level rope_theta / partial_rotary_factor / rope_scaling.
    """
    if family == "qwen3_next":
        base, factor = cfg["rope_theta"], cfg["partial_rotary_factor"]
        scale = _rope_scale(cfg)
    else:
        params = dict(cfg.get("rope_parameters") or {})
        base = params.get("rope_theta", 100000.0)
        factor = params.get("partial_rotary_factor", 0.25)
        scale = _rope_scale({"rope_scaling": params} if params else {})
    return int(qwen_head_dim(cfg) * factor), base, scale


def gated_attention(W, prefix, cfg, family, x, positions):
    """Qwen3-Next / Qwen3.5 gated full attention (no cache, causal), at
    ``positions`` ``(n,)`` or, with images, ``(3, n)`` (M-RoPE).

    q_proj emits, per head, [query (hd), gate (hd)]; q_norm / k_norm are
    per-head (1 + w) RMSNorms before RoPE; the output is
    o_proj(attn * sigmoid(gate)).
    """
    n, eps = x.shape[0], cfg["rms_norm_eps"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = qwen_head_dim(cfg)
    q_gate = linear(W, prefix + ".q_proj", x).reshape(n, n_heads, 2 * head_dim)
    q, gate = q_gate[..., :head_dim], q_gate[..., head_dim:].reshape(n, -1)
    k = linear(W, prefix + ".k_proj", x).reshape(n, n_kv, head_dim)
    v = linear(W, prefix + ".v_proj", x).reshape(n, n_kv, head_dim)
    q = rmsnorm_shifted(q, W[prefix + ".q_norm.weight"], eps)
    k = rmsnorm_shifted(k, W[prefix + ".k_norm.weight"], eps)
    q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))  # (heads, n, head_dim)

    dims, base, scale = qwen_rope(cfg, family)
    if np.ndim(positions) == 2:  # (3, n): M-RoPE, after an image
        sections = cfg["rope_parameters"]["mrope_section"]
        q = mrope_rotate_half(q, positions, dims, base, sections)
        k = mrope_rotate_half(k, positions, dims, base, sections)
    else:
        q = rope_rotate_half(q, positions, dims, base, scale)
        k = rope_rotate_half(k, positions, dims, base, scale)
    out = causal_attention(q, k, v, head_dim**-0.5)
    return linear(W, prefix + ".o_proj", out * sigmoid(gate))


def qwen_expert_weights(W, prefix, e):
    """(gate (I, H), up (I, H), down (H, I)) of expert e, fused or per expert."""
    fused = W.get(prefix + ".experts.gate_up_proj")
    if fused is not None:
        inter = fused.shape[1] // 2
        gate_up = fused[e]
        return gate_up[:inter], gate_up[inter:], W[prefix + ".experts.down_proj"][e]
    expert = f"{prefix}.experts.{e}"
    return (
        W[expert + ".gate_proj.weight"],
        W[expert + ".up_proj.weight"],
        W[expert + ".down_proj.weight"],
    )


def qwen_moe(W, prefix, cfg, family, x):
    """Softmax top-k routed experts plus a sigmoid-gated shared expert."""
    logits = linear(W, prefix + ".gate", x)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top_k = cfg["num_experts_per_tok"]
    inds = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, inds, axis=-1)
    if cfg.get("norm_topk_prob", family != "qwen3_next"):
        weights = weights / weights.sum(axis=-1, keepdims=True)

    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            gate, up, down = qwen_expert_weights(W, prefix, e)
            xr = x[row]
            out[row] += w * (down @ (silu(gate @ xr) * (up @ xr)))
    shared = mlp(W, prefix + ".shared_expert", x)
    return out + sigmoid(linear(W, prefix + ".shared_expert_gate", x)) * shared


def qwen_is_moe_layer(cfg, family, layer_idx):
    """mlx-lm's MoE rule: qwen3_5 iff num_experts > 0; qwen3_next also
    needs layer_idx not in mlp_only_layers and (idx+1) % decoder_sparse_step == 0."""
    if cfg.get("num_experts", 0) <= 0:
        return False
    if family != "qwen3_next":
        return True
    step = cfg.get("decoder_sparse_step", 1)
    return layer_idx not in cfg.get("mlp_only_layers", []) and (
        (layer_idx + 1) % step == 0
    )


def qwen_decoder_layer(W, prefix, cfg, family, layer_idx, x, positions, linear_attn):
    """Pre-norm Qwen hybrid block with a GDN or gated-attention mixer."""
    eps = cfg["rms_norm_eps"]
    a_in = rmsnorm_shifted(x, W[prefix + ".input_layernorm.weight"], eps)
    if linear_attn:
        mixed = gated_deltanet(W, prefix + ".linear_attn", cfg, family, a_in)
    else:
        attn = prefix + ".self_attn"
        mixed = gated_attention(W, attn, cfg, family, a_in, positions)
    h = x + mixed
    m_in = rmsnorm_shifted(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    if qwen_is_moe_layer(cfg, family, layer_idx):
        return h + qwen_moe(W, prefix + ".mlp", cfg, family, m_in)
    return h + mlp(W, prefix + ".mlp", m_in)


def qwen_trunk_hidden(W, cfg, family, tokens):
    """Hidden states (n, D) after the trunk's final (1 + w) norm."""
    base = qwen_base(family)
    x = W[base + "embed_tokens.weight"][np.asarray(tokens)]
    positions = np.arange(len(tokens))
    interval = cfg.get("full_attention_interval", 4)
    for i in range(cfg["num_hidden_layers"]):
        is_linear = (i + 1) % interval != 0
        prefix = f"{base}layers.{i}"
        x = qwen_decoder_layer(W, prefix, cfg, family, i, x, positions, is_linear)
    return rmsnorm_shifted(x, W[base + "norm.weight"], cfg["rms_norm_eps"])


def qwen_lm_head(W, cfg, family):
    """lm_head.weight, or the embedding when the text config ties them."""
    if cfg.get("tie_word_embeddings", False):
        return W[qwen_base(family) + "embed_tokens.weight"]
    return W["lm_head.weight"]


def qwen_num_mtp_layers(W, config, family):
    """MTP layers at ``mtp.layers.{j}`` (checked against the config key)."""
    count = 0
    while f"mtp.layers.{count}.input_layernorm.weight" in W:
        count += 1
    if family == "qwen3_next":
        declared = config.get("num_nextn_predict_layers")
    else:
        declared = qwen_text_config(config).get(
            "mtp_num_hidden_layers", config.get("mtp_num_hidden_layers")
        )
    if count and declared is not None and declared != count:
        raise ValueError(
            f"config declares {declared} MTP layers, checkpoint has {count}"
        )
    return count


def qwen_mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """Qwen MTP layer j over rows 0..m-1 at positions 0..m-1.

    x = fc([pre_fc_norm_embedding(emb), pre_fc_norm_hidden(hidden)]), a
    full-attention decoder layer, then mtp.norm (all norms 1 + w). The row-0
    embedding is NOT zeroed. Returns z (m, D) after mtp.norm.
    """
    eps = cfg["rms_norm_eps"]
    emb = W[qwen_base(family) + "embed_tokens.weight"][np.asarray(next_tokens)]
    e_n = rmsnorm_shifted(emb, W["mtp.pre_fc_norm_embedding.weight"], eps)
    h_n = rmsnorm_shifted(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps)
    x = linear(W, "mtp.fc", np.concatenate([e_n, h_n], axis=-1))
    positions = np.arange(x.shape[0])
    # The MTP layer is a full-attention layer; the MoE rule uses index 0.
    y = qwen_decoder_layer(
        W, f"mtp.layers.{j}", cfg, family, 0, x, positions, linear_attn=False
    )
    return rmsnorm_shifted(y, W["mtp.norm.weight"], eps)


# ---------------------------------------------------------------------------
# Entry point


def reference_logits(ckpt_dir, tokens):
    """Teacher-forced logits for one sequence t_0..t_{n-1}.

    Args:
        ckpt_dir: HF checkpoint folder (config.json + *.safetensors).
        tokens: the token ids t_0..t_{n-1}, n >= 1.

    Returns:
        (main, mtp): main is (n, V), the trunk logits at each position.
        mtp[j] is (n-1-j, V) for MTP layer j: row i holds the logits for
        t_{i+j+2}. Arrays are float64.
    """
    config, W = load_checkpoint(ckpt_dir)
    family = config.get("model_type")
    if family not in FAMILIES:
        raise NotImplementedError(f"model_type {family!r} is not in the reference")
    tokens = [int(t) for t in tokens]
    if family in SEPARATE:
        module = importlib.import_module(f".{SEPARATE[family]}", __package__)
        if hasattr(module, "reference_logits"):
            return module.reference_logits(ckpt_dir, tokens)
        cfg = config
        head = W["lm_head.weight"]
        hidden = module.trunk_hidden(W, cfg, tokens)
        n_mtp = module.num_mtp_layers(W, cfg)
        layer_fn = module.mtp_layer
    elif family in QWEN_FAMILIES:
        cfg = qwen_text_config(config)
        head = qwen_lm_head(W, cfg, family)
        hidden = qwen_trunk_hidden(W, cfg, family, tokens)
        n_mtp = qwen_num_mtp_layers(W, config, family)
        layer_fn = qwen_mtp_layer
    else:
        cfg = config
        head = lm_head_weight(W, cfg, family)
        hidden = trunk_hidden(W, cfg, family, tokens)
        n_mtp = num_mtp_layers(W, cfg, family)
        layer_fn = mtp_layer

    n, main, mtp = len(tokens), hidden @ head.T, []
    for j in range(n_mtp):
        rows = n - 1 - j
        if rows <= 0:
            mtp.append(np.zeros((0, head.shape[0])))
            continue
        # Row i: hidden row i (trunk, or layer j-1 output) with token t_{i+j+1}.
        hidden = layer_fn(W, cfg, family, j, hidden[:rows], tokens[j + 1 :])
        mtp.append(hidden @ head.T)
    return main, mtp

"""Independent float64 numpy reference for Ling 2.5 (``bailing_hybrid``): the
lightning-attention / MLA trunk and its appended MTP layers, from raw Hugging Face
tensors.

Written from vLLM's ``bailing_moe_linear`` / ``bailing_mtp`` and mlx-lm 0.32.2's
``bailing_hybrid`` (the trunk we must match). It must not import mlx or mlx_lm.

- Layer i is MLA when ``(i + 1) % layer_group_size == 0`` or it lies past the last
  whole group, else lightning attention; its MLP is MoE from ``first_k_dense_replace``.
- Lightning attention, per head: q, k, v from ``query_key_value``; per-head RMS q/k
  norms; RoPE (non-interleaved) on the first ``head_dim * partial_rotary_factor`` dims;
  state ``S = exp(g) S + k^T v`` from zero, ``y = (q / sqrt(head_dim)) S``, with the
  ALiBi-like slope ``g`` of the head scaled by ``1 - i / (L - 1) + 1e-5``; then a group
  RMS norm (``group_norm_size`` groups) times ``sigmoid(g_proj(x))``, and ``dense``.
- MLA: DeepSeek's, with the LoRA norms at ``rms_norm_eps``, RoPE interleaved
  (``rope_interleave``), output ``dense``.
- MoE: sigmoid scores; the choice adds ``expert_bias`` and keeps the best
  ``topk_group`` of ``n_group`` groups (by their two best scores; the others at -inf);
  the top-k raw scores, normalised, times ``routed_scaling_factor``; plus the shared
  expert.
- MTP layer j (``model.layers.{L+j}``): ``eh_proj([enorm(e), hnorm(h)])`` with the
  embedding of row 0 zeroed, the MLA + MoE layer, ``final_layernorm``.
"""

import math

import numpy as np

from .numpy_reference import (
    causal_attention,
    linear,
    mlp,
    rmsnorm,
    rope_interleaved,
    rope_rotate_half,
    sigmoid,
)


def is_global(cfg, i):
    group, n = cfg["layer_group_size"], cfg["num_hidden_layers"]
    return (i + 1) % group == 0 or i >= (n // group) * group


def slopes(cfg, i):
    n = cfg["num_attention_heads"]

    def power_of_2(m):
        return [2 ** (-(2 ** -(math.log2(m) - 3)) * (h + 1)) for h in range(m)]

    if math.log2(n).is_integer():
        base = power_of_2(n)
    else:
        p = 2 ** math.floor(math.log2(n))
        base = power_of_2(p) + power_of_2(2 * p)[::2][: n - p]
    factor = 1 - i / max(1, cfg["num_hidden_layers"] - 1) + 1e-5
    return -np.array(base) * factor


def lightning(W, prefix, cfg, i, x):
    n, heads, d, eps = (
        x.shape[0],
        cfg["num_attention_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
    )
    qkv = (
        linear(W, prefix + ".query_key_value", x)
        .reshape(n, 3 * heads, d)
        .transpose(1, 0, 2)
    )
    q, k, v = qkv[:heads], qkv[heads : 2 * heads], qkv[2 * heads :]
    q = rmsnorm(q, W[prefix + ".query_layernorm.weight"], eps)
    k = rmsnorm(k, W[prefix + ".key_layernorm.weight"], eps)
    dims, pos = int(d * cfg["partial_rotary_factor"]), np.arange(n)
    q, k = rope_rotate_half(q, pos, dims, cfg["rope_theta"]), rope_rotate_half(
        k, pos, dims, cfg["rope_theta"]
    )
    decay = np.exp(slopes(cfg, i))[:, None, None]
    state, ys = np.zeros((heads, d, d)), []
    for t in range(n):
        state = decay * state + k[:, t, :, None] * v[:, t, None, :]
        ys.append((q[:, t, None, :] * d**-0.5) @ state)  # (heads, 1, d)
    y = np.concatenate(ys, axis=1).transpose(1, 0, 2).reshape(n, heads * d)
    groups = cfg["group_norm_size"]
    y = (
        rmsnorm(y.reshape(n, groups, -1), 1.0, eps).reshape(n, -1)
        * W[prefix + ".g_norm.weight"]
    )
    return linear(W, prefix + ".dense", y * sigmoid(linear(W, prefix + ".g_proj", x)))


def mla(W, prefix, cfg, x):
    n, heads, eps = x.shape[0], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d_nope, d_rope, d_v, rank = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    if cfg.get("q_lora_rank"):
        q = linear(
            W,
            prefix + ".q_b_proj",
            rmsnorm(
                linear(W, prefix + ".q_a_proj", x),
                W[prefix + ".q_a_layernorm.weight"],
                eps,
            ),
        )
    else:
        q = linear(W, prefix + ".q_proj", x)
    q = q.reshape(n, heads, d_nope + d_rope).transpose(1, 0, 2)
    kv_a = linear(W, prefix + ".kv_a_proj_with_mqa", x)
    latent = rmsnorm(kv_a[:, :rank], W[prefix + ".kv_a_layernorm.weight"], eps)
    kv = (
        linear(W, prefix + ".kv_b_proj", latent)
        .reshape(n, heads, d_nope + d_v)
        .transpose(1, 0, 2)
    )
    rope = rope_interleaved if cfg.get("rope_interleave", True) else rope_rotate_half
    pos, base = np.arange(n), cfg["rope_theta"]
    q_pe = rope(q[..., d_nope:], pos, d_rope, base)
    k_pe = np.broadcast_to(
        rope(kv_a[None, :, rank:], pos, d_rope, base), (heads, n, d_rope)
    )
    q = np.concatenate([q[..., :d_nope], q_pe], axis=-1)
    k = np.concatenate([kv[..., :d_nope], k_pe], axis=-1)
    out = causal_attention(q, k, kv[..., d_nope:], (d_nope + d_rope) ** -0.5)
    return linear(W, prefix + ".dense", out)


def moe(W, prefix, cfg, x):
    scores = sigmoid(x @ W[prefix + ".gate.weight"].T)  # (n, E)
    choice = scores + W.get(prefix + ".gate.expert_bias", 0.0)
    n_group, keep = cfg["n_group"], cfg["topk_group"]
    if n_group > keep:
        grouped = choice.reshape(choice.shape[0], n_group, -1).copy()
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        drop = np.argsort(group_scores, axis=-1, kind="stable")[:, : n_group - keep]
        np.put_along_axis(grouped, drop[..., None], -np.inf, axis=1)
        choice = grouped.reshape(choice.shape)
    top_k, out = cfg["num_experts_per_tok"], np.zeros_like(x)
    for row in range(x.shape[0]):
        inds = np.argsort(-choice[row], kind="stable")[:top_k]
        w = scores[row, inds]
        if top_k > 1 and cfg.get("norm_topk_prob", True):
            w = w / (w.sum() + 1e-20)
        for e, we in zip(inds, w * cfg["routed_scaling_factor"]):
            out[row] += we * mlp(W, f"{prefix}.experts.{e}", x[row : row + 1])[0]
    if cfg.get("num_shared_experts"):
        out = out + mlp(W, prefix + ".shared_experts", x)
    return out


def decoder_layer(W, prefix, cfg, i, x):
    eps = cfg["rms_norm_eps"]
    a = rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps)
    attn = (
        mla(W, prefix + ".attention", cfg, a)
        if is_global(cfg, i)
        else lightning(W, prefix + ".attention", cfg, i, a)
    )
    h = x + attn
    y = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    sparse = i >= cfg["first_k_dense_replace"]
    return h + (
        moe(W, prefix + ".mlp", cfg, y) if sparse else mlp(W, prefix + ".mlp", y)
    )


def trunk_hidden(W, cfg, tokens):
    x = W["model.word_embeddings.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(W, f"model.layers.{i}", cfg, i, x)
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


def num_mtp_layers(W, cfg):
    L = cfg["num_hidden_layers"]
    return len(
        {
            int(k.split(".")[2])
            for k in W
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= L
        }
    )


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps, i = cfg["rms_norm_eps"], cfg["num_hidden_layers"] + j
    prefix = f"model.layers.{i}"
    e = W["model.word_embeddings.weight"][next_tokens[: hidden.shape[0]]].copy()
    e[0] = 0.0  # vLLM zeroes the embedding at position 0
    fused = np.concatenate(
        [
            rmsnorm(e, W[prefix + ".enorm.weight"], eps),
            rmsnorm(hidden, W[prefix + ".hnorm.weight"], eps),
        ],
        axis=-1,
    )
    x = decoder_layer(W, prefix, cfg, i, linear(W, prefix + ".eh_proj", fused))
    return rmsnorm(x, W[prefix + ".final_layernorm.weight"], eps)

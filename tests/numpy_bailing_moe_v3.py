"""Independent float64 numpy reference for Ling 3.0 (``bailing_moe_v3``): the Kimi Delta
Attention / MLA trunk and its appended MTP layers, from raw Hugging Face tensors.

Written from vLLM's ``bailing_moe_v3`` / ``bailing_moe_v3_mtp`` and mlx-lm 0.32.2's
``bailing_moe_v3`` (the trunk we must match). It must not import mlx or mlx_lm.

- Layer i is KDA unless ``(i + 1) % layer_group_size == 0`` or it lies past the last
  whole group (then MLA); MoE from ``first_k_dense_replace``.
- KDA, per head: q, k, v each through a causal depthwise convolution (no bias) and
  SiLU; q, k L2-normalised (eps 1e-6 on the sum of squares), q scaled by
  ``head_dim^-0.5``; per-channel decay ``g = exp(kda_lower_bound * sigmoid(exp(A_log)
  * (f_proj(x) + dt_bias)))``, ``beta = sigmoid(b_proj(x))``; from a zero state
  ``S (Dv, Dk)``: ``S = S * g``, ``S += beta (v - S k) k^T``, ``y = S q``; then the
  per-head RMS ``o_norm`` times ``sigmoid(g_proj(x))``, and ``o_proj``.
- MLA as in Ling 2.5, its output scaled per head by ``sigmoid(g_proj(x))`` before
  ``dense``. MoE as in Ling 2.5 (the router bias may be saved as
  ``e_score_correction_bias`` in MTP layers).
- MTP layer j: ``eh_proj([enorm(e), hnorm(h)])`` (no embedding zeroed), the MLA + MoE
  layer, ``final_layernorm``.
"""

import numpy as np

from . import numpy_bailing_hybrid as ling25
from .numpy_reference import (
    causal_attention,
    causal_depthwise_conv_silu,
    linear,
    mlp,
    rmsnorm,
    rope_interleaved,
    sigmoid,
)


def kda(W, prefix, cfg, x):
    n, heads, d, eps = (
        x.shape[0],
        cfg["num_attention_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
    )

    def stream(name):
        y = causal_depthwise_conv_silu(
            linear(W, f"{prefix}.{name}_proj", x), W[f"{prefix}.{name}_conv1d.weight"]
        )
        return y.reshape(n, heads, d)

    q, k, v = stream("q"), stream("k"), stream("v")
    l2 = lambda t: t / np.sqrt((t * t).sum(axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = l2(q) * d**-0.5, l2(k)
    a = linear(W, prefix + ".f_proj", x).reshape(n, heads, d) + W[
        prefix + ".dt_bias"
    ].reshape(heads, d)
    g = np.exp(
        cfg["kda_lower_bound"] * sigmoid(np.exp(W[prefix + ".A_log"])[:, None] * a)
    )
    beta = sigmoid(linear(W, prefix + ".b_proj", x))  # (n, heads)
    state, ys = np.zeros((heads, d, d)), []
    for t in range(n):
        state = state * g[t][:, None, :]
        memory = (state * k[t][:, None, :]).sum(axis=-1)  # (heads, Dv)
        delta = (v[t] - memory) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        ys.append((state * q[t][:, None, :]).sum(axis=-1))
    y = rmsnorm(np.stack(ys), W[prefix + ".o_norm.weight"], eps)  # (n, heads, d)
    y = y * sigmoid(linear(W, prefix + ".g_proj", x)).reshape(n, heads, d)
    return linear(W, prefix + ".o_proj", y.reshape(n, -1))


def mla(W, prefix, cfg, x):
    n, heads, eps = x.shape[0], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d_nope, d_rope, d_v, rank = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    q = linear(
        W,
        prefix + ".q_b_proj",
        rmsnorm(
            linear(W, prefix + ".q_a_proj", x), W[prefix + ".q_a_layernorm.weight"], eps
        ),
    )
    q = q.reshape(n, heads, d_nope + d_rope).transpose(1, 0, 2)
    kv_a = linear(W, prefix + ".kv_a_proj_with_mqa", x)
    latent = rmsnorm(kv_a[:, :rank], W[prefix + ".kv_a_layernorm.weight"], eps)
    kv = (
        linear(W, prefix + ".kv_b_proj", latent)
        .reshape(n, heads, d_nope + d_v)
        .transpose(1, 0, 2)
    )
    pos, base = np.arange(n), cfg["rope_theta"]
    q_pe = rope_interleaved(q[..., d_nope:], pos, d_rope, base)
    k_pe = np.broadcast_to(
        rope_interleaved(kv_a[None, :, rank:], pos, d_rope, base), (heads, n, d_rope)
    )
    q = np.concatenate([q[..., :d_nope], q_pe], axis=-1)
    k = np.concatenate([kv[..., :d_nope], k_pe], axis=-1)
    out = causal_attention(q, k, kv[..., d_nope:], (d_nope + d_rope) ** -0.5).reshape(
        n, heads, d_v
    )
    out = out * sigmoid(linear(W, prefix + ".g_proj", x))[..., None]
    return linear(W, prefix + ".dense", out.reshape(n, -1))


def decoder_layer(W, prefix, cfg, i, x):
    eps = cfg["rms_norm_eps"]
    a = rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps)
    attn = (
        mla(W, prefix + ".attention", cfg, a)
        if ling25.is_global(cfg, i)
        else kda(W, prefix + ".attention", cfg, a)
    )
    h = x + attn
    y = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    if i < cfg["first_k_dense_replace"]:
        return h + mlp(W, prefix + ".mlp", y)
    bias = prefix + ".mlp.gate.e_score_correction_bias"
    if bias in W:
        W = {**W, prefix + ".mlp.gate.expert_bias": W[bias]}
    return h + ling25.moe(W, prefix + ".mlp", cfg, y)


def trunk_hidden(W, cfg, tokens):
    x = W["model.word_embeddings.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(W, f"model.layers.{i}", cfg, i, x)
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


num_mtp_layers = ling25.num_mtp_layers


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps, i = cfg["rms_norm_eps"], cfg["num_hidden_layers"] + j
    prefix = f"model.layers.{i}"
    e = W["model.word_embeddings.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            rmsnorm(e, W[prefix + ".enorm.weight"], eps),
            rmsnorm(hidden, W[prefix + ".hnorm.weight"], eps),
        ],
        axis=-1,
    )
    x = decoder_layer(W, prefix, cfg, i, linear(W, prefix + ".eh_proj", fused))
    return rmsnorm(x, W[prefix + ".final_layernorm.weight"], eps)

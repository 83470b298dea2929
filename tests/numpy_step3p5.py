"""Independent float64 numpy reference for Step-3.5 (``step3p5``): trunk and MTP layers,
from raw Hugging Face tensors.

Written from vLLM's ``step3p5`` / ``step3p5_mtp`` and mlx-lm 0.32.2's ``step3p5`` (the
trunk we must match). It must not import mlx or mlx_lm.

- Every RMSNorm is ``x_hat * (1 + w)`` (the fusion norms and ``shared_head.norm``
  included); q/k norms are per head.
- Layer i's attention is sliding when ``layer_types[i]`` says so: it then has
  ``attention_other_setting``'s head counts and sees the last ``sliding_window``
  positions (itself included). RoPE is non-interleaved on the first
  ``head_dim * partial_rotary_factors[i]`` dims, base ``rope_theta[i]``. The output of
  each head is scaled by ``sigmoid(g_proj(x))`` before ``o_proj``.
- MLP i is MoE when i is in ``moe_layers_enum``: sigmoid scores, top-k by score +
  ``router_bias``, weights normalised and scaled by ``moe_router_scaling_factor``;
  SwiGLU experts clamped at ``swiglu_limits[i]`` and a shared expert clamped at
  ``swiglu_limits_shared[i]`` (a dense MLP uses the latter too).
- MTP layer j is layer index L + j of these lists, under
  ``model.layers.{L+j}.transformer.``: ``x = eh_proj([enorm(e), hnorm(h)])``, the
  decoder layer, ``shared_head.norm``.
  No embedding is zeroed at position 0; the head is the trunk's ``lm_head``.
"""

import numpy as np

from .numpy_reference import linear, rmsnorm, rope_rotate_half, sigmoid, silu


def norm(W, key, cfg, x):
    return rmsnorm(x, 1.0 + W[key], cfg["rms_norm_eps"])


def swiglu(gate, up, limit):
    g = silu(gate)
    if limit:
        g, up = np.minimum(g, limit), np.clip(up, -limit, limit)
    return g * up


def limit(cfg, key, i):
    values = cfg.get(key) or []
    return values[i] if i < len(values) and values[i] else 0.0


def mlp(W, prefix, x, lim):
    gate = linear(W, prefix + ".gate_proj", x)
    up = linear(W, prefix + ".up_proj", x)
    return linear(W, prefix + ".down_proj", swiglu(gate, up, lim))


def moe(W, prefix, cfg, i, x):
    scores = sigmoid(x @ W[prefix + ".moe.gate.weight"].T)  # (n, E)
    choice = scores + W[prefix + ".moe.router_bias"]
    top_k = cfg["moe_top_k"]
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        inds = np.argsort(-choice[row], kind="stable")[:top_k]
        w = scores[row, inds]
        w = w / (w.sum() + 1e-20) * cfg["moe_router_scaling_factor"]
        for e, we in zip(inds, w):
            gate = W[prefix + ".moe.gate_proj.weight"][e] @ x[row]
            up = W[prefix + ".moe.up_proj.weight"][e] @ x[row]
            y = swiglu(gate, up, limit(cfg, "swiglu_limits", i))
            out[row] += we * (W[prefix + ".moe.down_proj.weight"][e] @ y)
    shared = limit(cfg, "swiglu_limits_shared", i)
    return out + mlp(W, prefix + ".share_expert", x, shared)


def attention(W, prefix, cfg, i, x):
    n, d = x.shape[0], cfg["head_dim"]
    sliding = cfg["layer_types"][i] == "sliding_attention"
    other = (cfg.get("attention_other_setting") or {}) if sliding else {}
    heads = other.get("num_attention_heads", cfg["num_attention_heads"])
    groups = other.get("num_attention_groups", cfg["num_attention_groups"])
    theta = cfg["rope_theta"]
    theta = theta[i] if isinstance(theta, list) else theta
    dims = int(d * cfg["partial_rotary_factors"][i])

    def heads_of(name, h):
        y = linear(W, prefix + name, x).reshape(n, h, d)
        return y.transpose(1, 0, 2)  # (h, n, d)

    q = rmsnorm(
        heads_of(".q_proj", heads),
        1.0 + W[prefix + ".q_norm.weight"],
        cfg["rms_norm_eps"],
    )
    k = rmsnorm(
        heads_of(".k_proj", groups),
        1.0 + W[prefix + ".k_norm.weight"],
        cfg["rms_norm_eps"],
    )
    v = heads_of(".v_proj", groups)
    q, k = rope_rotate_half(q, np.arange(n), dims, theta), rope_rotate_half(
        k, np.arange(n), dims, theta
    )
    k, v = np.repeat(k, heads // groups, axis=0), np.repeat(v, heads // groups, axis=0)
    scores = q @ k.transpose(0, 2, 1) * d**-0.5  # (h, n, n)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None]
    seen = ki <= qi
    if sliding:
        seen &= ki > qi - cfg["sliding_window"]
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (probs / probs.sum(axis=-1, keepdims=True)) @ v  # (h, n, d)
    out = out * sigmoid(linear(W, prefix + ".g_proj", x)).T[..., None]
    return linear(W, prefix + ".o_proj", out.transpose(1, 0, 2).reshape(n, -1))


def decoder_layer(W, prefix, cfg, i, x):
    h = x + attention(
        W,
        prefix + ".self_attn",
        cfg,
        i,
        norm(W, prefix + ".input_layernorm.weight", cfg, x),
    )
    y = norm(W, prefix + ".post_attention_layernorm.weight", cfg, h)
    if str(i) in cfg["moe_layers_enum"].split(","):
        return h + moe(W, prefix, cfg, i, y)
    return h + mlp(W, prefix + ".mlp", y, limit(cfg, "swiglu_limits_shared", i))


def trunk_hidden(W, cfg, tokens):
    x = W["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(W, f"model.layers.{i}", cfg, i, x)
    return norm(W, "model.norm.weight", cfg, x)


def num_mtp_layers(W, cfg):
    L = cfg["num_hidden_layers"]
    return len(
        {
            k.split(".")[2]
            for k in W
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= L
        }
    )


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    i = cfg["num_hidden_layers"] + j
    prefix = f"model.layers.{i}"
    e = W["model.embed_tokens.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            norm(W, prefix + ".enorm.weight", cfg, e),
            norm(W, prefix + ".hnorm.weight", cfg, hidden),
        ],
        axis=-1,
    )
    x = decoder_layer(
        W, prefix + ".transformer", cfg, i, linear(W, prefix + ".eh_proj", fused)
    )
    return norm(W, prefix + ".shared_head.norm.weight", cfg, x)

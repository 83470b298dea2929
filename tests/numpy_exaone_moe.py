"""Independent float64 numpy reference for EXAONE-MoE (``exaone_moe``): trunk and MTP
layers, from raw Hugging Face tensors.

Written from vLLM's ``exaone_moe`` / ``exaone_moe_mtp`` and mlx-lm 0.32.2's
``exaone_moe`` (the trunk we must match). It must not import mlx or mlx_lm.

- Pre-norm layers with plain RMSNorms; attention with per-head q/k norms; RoPE
  (non-interleaved, whole head) on sliding layers, and on full layers only when no
  layer slides (``layer_types`` has no ``sliding_attention``); sliding layers see the
  last ``sliding_window`` positions.
- MoE when ``is_moe_layer[i]``: DeepSeek's noaux_tc routing with the correction bias
  (stored as ``mlp.e_score_correction_bias``), SiLU-gated experts, and
  ``num_shared_experts`` shared experts as one MLP.
- MTP (Qwen3-Next's names, plain norms): ``x = fc([pre_fc_norm_embedding(e),
  pre_fc_norm_hidden(h)])``, the dense layer of kind ``mtp_layer_types[j]`` (window
  ``mtp_sliding_windows[j]``), ``mtp.norm``. No embedding is zeroed at position 0.
"""

import numpy as np

from .numpy_reference import linear, mlp, rmsnorm, rope_rotate_half, route_tokens


def attention(W, prefix, cfg, x, sliding, window):
    n, d = x.shape[0], cfg["head_dim"]
    heads, kv, eps = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["rms_norm_eps"],
    )

    def heads_of(name, h):
        return linear(W, prefix + name, x).reshape(n, h, d).transpose(1, 0, 2)

    q = rmsnorm(heads_of(".q_proj", heads), W[prefix + ".q_norm.weight"], eps)
    k = rmsnorm(heads_of(".k_proj", kv), W[prefix + ".k_norm.weight"], eps)
    v = heads_of(".v_proj", kv)
    if sliding or "sliding_attention" not in cfg["layer_types"]:
        theta = cfg.get("rope_theta", 1000000.0)
        q = rope_rotate_half(q, np.arange(n), d, theta)
        k = rope_rotate_half(k, np.arange(n), d, theta)
    k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)
    scores = q @ k.transpose(0, 2, 1) * d**-0.5
    qi, ki = np.arange(n)[:, None], np.arange(n)[None]
    seen = ki <= qi
    if sliding:
        seen &= ki > qi - window
    scores = np.where(seen, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (probs / probs.sum(axis=-1, keepdims=True)) @ v
    return linear(W, prefix + ".o_proj", out.transpose(1, 0, 2).reshape(n, -1))


def moe(W, prefix, cfg, x):
    inds, weights = route_tokens(
        x @ W[prefix + ".gate.weight"].T, W[prefix + ".e_score_correction_bias"], cfg
    )
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            out[row] += w * mlp(W, f"{prefix}.experts.{e}", x[row : row + 1])[0]
    if cfg.get("num_shared_experts"):
        out = out + mlp(W, prefix + ".shared_experts", x)
    return out


def decoder_layer(W, prefix, cfg, x, sliding, window, sparse):
    eps = cfg["rms_norm_eps"]
    h = x + attention(
        W,
        prefix + ".self_attn",
        cfg,
        rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps),
        sliding,
        window,
    )
    y = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    return h + (
        moe(W, prefix + ".mlp", cfg, y) if sparse else mlp(W, prefix + ".mlp", y)
    )


def trunk_hidden(W, cfg, tokens):
    x = W["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(cfg["layer_types"]):
        sliding = kind == "sliding_attention"
        x = decoder_layer(
            W,
            f"model.layers.{i}",
            cfg,
            x,
            sliding,
            cfg["sliding_window"],
            cfg["is_moe_layer"][i],
        )
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


def num_mtp_layers(W, cfg):
    return len({k.split(".")[2] for k in W if k.startswith("mtp.layers.")})


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps = cfg["rms_norm_eps"]
    e = W["model.embed_tokens.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            rmsnorm(e, W["mtp.pre_fc_norm_embedding.weight"], eps),
            rmsnorm(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    kind = (cfg.get("mtp_layer_types") or ["full_attention"] * (j + 1))[j]
    window = (cfg.get("mtp_sliding_windows") or [0] * (j + 1))[j] or cfg[
        "sliding_window"
    ]
    x = decoder_layer(
        W,
        f"mtp.layers.{j}",
        cfg,
        linear(W, "mtp.fc", fused),
        kind == "sliding_attention",
        window,
        False,
    )
    return rmsnorm(x, W["mtp.norm.weight"], eps)

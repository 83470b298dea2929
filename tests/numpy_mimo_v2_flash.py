"""Independent float64 numpy reference for MiMo-V2-Flash (``mimo_v2_flash``): trunk and
MTP layers, from raw Hugging Face tensors.

Written from vLLM's ``mimo_v2`` / ``mimo_v2_mtp`` and mlx-lm 0.32.2's ``mimo_v2_flash``
(the trunk we must match). It must not import mlx or mlx_lm.

- Layer i is sliding when ``hybrid_layer_pattern[i] == 1``: ``swa_*`` heads and head
  dims, base ``swa_rope_theta``, the last ``sliding_window_size`` positions, and (with
  ``add_swa_attention_sink_bias``) a per-head sink logit in the softmax's denominator.
  Full layers use the plain settings (``add_full_attention_sink_bias``).
- Values are scaled by ``attention_value_scale``; RoPE is non-interleaved on the first
  ``int(partial_rotary_factor * head_dim)`` dims; scores are scaled by head_dim^-0.5.
- MLP i is MoE when ``moe_layer_freq[i] == 1`` (DeepSeek's noaux_tc routing over
  SiLU-gated experts, shared experts when ``n_shared_experts`` is set).
- MTP layer j (``model.mtp.layers.{j}``): ``x = eh_proj([enorm(e), hnorm(h)])``, a
  sliding-window layer with a dense MLP (its second norm is ``pre_mlp_layernorm``),
  ``final_layernorm``. No embedding is zeroed at position 0.
"""

import numpy as np

from .numpy_reference import linear, mlp, moe, rmsnorm, rope_rotate_half


def attention(W, prefix, cfg, sliding, x):
    n, pre = x.shape[0], "swa_" if sliding else ""
    heads, kv = cfg[f"{pre}num_attention_heads"], cfg[f"{pre}num_key_value_heads"]
    d, dv = cfg[f"{pre}head_dim"], cfg[f"{pre}v_head_dim"]
    theta = cfg["swa_rope_theta" if sliding else "rope_theta"]
    dims = int(cfg["partial_rotary_factor"] * d)
    q = linear(W, prefix + ".q_proj", x).reshape(n, heads, d).transpose(1, 0, 2)
    k = linear(W, prefix + ".k_proj", x).reshape(n, kv, d).transpose(1, 0, 2)
    v = linear(W, prefix + ".v_proj", x).reshape(n, kv, dv).transpose(1, 0, 2)
    if cfg.get("attention_value_scale") is not None:
        v = v * cfg["attention_value_scale"]
    q = rope_rotate_half(q, np.arange(n), dims, theta)
    k = rope_rotate_half(k, np.arange(n), dims, theta)
    k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)
    scores = q @ k.transpose(0, 2, 1) * d**-0.5  # (h, n, n)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None]
    seen = ki <= qi
    if sliding:
        seen &= ki > qi - cfg["sliding_window_size"]
    scores = np.where(seen, scores, -np.inf)
    sinks = W.get(prefix + ".attention_sink_bias")
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks[:, None, None] - top)
    out = (weights / total) @ v  # (h, n, dv)
    return linear(W, prefix + ".o_proj", out.transpose(1, 0, 2).reshape(n, -1))


def decoder_layer(W, prefix, cfg, sliding, moe_mlp, x, post="post_attention_layernorm"):
    eps = cfg["layernorm_epsilon"]
    h = x + attention(
        W,
        prefix + ".self_attn",
        cfg,
        sliding,
        rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps),
    )
    y = rmsnorm(h, W[f"{prefix}.{post}.weight"], eps)
    return h + (
        moe(W, prefix + ".mlp", cfg, y) if moe_mlp else mlp(W, prefix + ".mlp", y)
    )


def trunk_hidden(W, cfg, tokens):
    x = W["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        sliding = cfg["hybrid_layer_pattern"][i] == 1
        x = decoder_layer(
            W, f"model.layers.{i}", cfg, sliding, cfg["moe_layer_freq"][i] == 1, x
        )
    return rmsnorm(x, W["model.norm.weight"], cfg["layernorm_epsilon"])


def num_mtp_layers(W, cfg):
    return len({k.split(".")[3] for k in W if k.startswith("model.mtp.layers.")})


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps, prefix = cfg["layernorm_epsilon"], f"model.mtp.layers.{j}"
    e = W["model.embed_tokens.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            rmsnorm(e, W[prefix + ".enorm.weight"], eps),
            rmsnorm(hidden, W[prefix + ".hnorm.weight"], eps),
        ],
        axis=-1,
    )
    x = linear(W, prefix + ".eh_proj", fused)
    x = decoder_layer(W, prefix, cfg, True, False, x, post="pre_mlp_layernorm")
    return rmsnorm(x, W[prefix + ".final_layernorm.weight"], eps)

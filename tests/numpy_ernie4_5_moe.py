"""Independent float64 numpy reference for ERNIE 4.5 MoE (``ernie4_5_moe``): trunk and
MTP layers, from raw Hugging Face tensors.

Written from FastDeploy's ``ernie4_5_mtp`` (Baidu's runtime) and mlx-lm 0.32.2's
``ernie4_5_moe`` (the trunk we must match). It must not import mlx or mlx_lm.

- Pre-norm layers; attention with interleaved RoPE over the whole head
  (``rope_theta``); MLP i is MoE when ``(i + 1) % moe_layer_interval == 0`` and
  ``moe_layer_start_index <= i <= moe_layer_end_index`` (else dense).
- MoE: softmax over the gate's logits, the top ``moe_k`` renormalised (sum clamped at
  1e-12), SiLU-gated experts, plus ``moe_num_shared_experts`` shared experts as one
  MLP. The checkpoint's ``e_score_correction_bias`` is not used (as in mlx-lm).
- MTP layer j: ``x = mtp_linear_proj.j([mtp_emb_norm.j(e), mtp_hidden_norm.j(h)])``, the
  decoder layer ``mtp_block.j`` (the MoE rule at index j), then the trunk's final norm
  ``model.norm``. No embedding is zeroed at position 0.
"""

import numpy as np

from .numpy_reference import causal_attention, linear, mlp, rmsnorm, rope_interleaved


def is_moe(cfg, i):
    end = cfg.get("moe_layer_end_index")
    end = cfg["num_hidden_layers"] - 1 if end is None else end
    start, interval = cfg.get("moe_layer_start_index", 0), cfg.get(
        "moe_layer_interval", 1
    )
    return (i + 1) % interval == 0 and start <= i <= end


def attention(W, prefix, cfg, x):
    n, d = (
        x.shape[0],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = linear(W, prefix + ".q_proj", x).reshape(n, heads, d).transpose(1, 0, 2)
    k = linear(W, prefix + ".k_proj", x).reshape(n, kv, d).transpose(1, 0, 2)
    v = linear(W, prefix + ".v_proj", x).reshape(n, kv, d).transpose(1, 0, 2)
    q = rope_interleaved(q, np.arange(n), d, cfg["rope_theta"])
    k = rope_interleaved(k, np.arange(n), d, cfg["rope_theta"])
    return linear(W, prefix + ".o_proj", causal_attention(q, k, v, d**-0.5))


def moe(W, prefix, cfg, x):
    logits = x @ W[prefix + ".gate.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        inds = np.argsort(-probs[row], kind="stable")[: cfg["moe_k"]]
        w = probs[row, inds] / max(probs[row, inds].sum(), 1e-12)
        for e, we in zip(inds, w):
            out[row] += we * mlp(W, f"{prefix}.experts.{e}", x[row : row + 1])[0]
    if cfg.get("moe_num_shared_experts", 0) > 0:
        out = out + mlp(W, prefix + ".shared_experts", x)
    return out


def decoder_layer(W, prefix, cfg, i, x):
    eps = cfg["rms_norm_eps"]
    h = x + attention(
        W,
        prefix + ".self_attn",
        cfg,
        rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps),
    )
    y = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    return h + (
        moe(W, prefix + ".mlp", cfg, y)
        if is_moe(cfg, i)
        else mlp(W, prefix + ".mlp", y)
    )


def trunk_hidden(W, cfg, tokens):
    x = W["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(W, f"model.layers.{i}", cfg, i, x)
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


def num_mtp_layers(W, cfg):
    return len({k.split(".")[2] for k in W if k.startswith("model.mtp_linear_proj.")})


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps = cfg["rms_norm_eps"]
    e = W["model.embed_tokens.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            rmsnorm(e, W[f"model.mtp_emb_norm.{j}.weight"], eps),
            rmsnorm(hidden, W[f"model.mtp_hidden_norm.{j}.weight"], eps),
        ],
        axis=-1,
    )
    x = decoder_layer(
        W,
        f"model.mtp_block.{j}",
        cfg,
        j,
        linear(W, f"model.mtp_linear_proj.{j}", fused),
    )
    return rmsnorm(x, W["model.norm.weight"], eps)

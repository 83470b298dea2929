"""Independent float64 numpy reference for Nemotron-H (``nemotron_h``): the Mamba-2 /
attention / MLP / MoE trunk and its MTP steps, from raw Hugging Face tensors.

Written from transformers' ``modeling_nemotron_h`` (trunk blocks), vLLM's
``nemotron_h_mtp`` (the MTP step) and mlx-lm 0.32.2 (the trunk we must match: ``dt`` is
clipped to ``time_step_limit`` only, not floored at ``time_step_min`` as transformers
does). It must not import mlx or mlx_lm.

- Every block is pre-norm residual: ``x + mixer(rmsnorm(x))``; the final norm is
  ``backbone.norm_f`` and the MTP reads the hidden state after it.
- Mamba-2, per position t and head h (group g = h // (heads / groups)):
  ``dt = clip(softplus(dt_raw + dt_bias))``, ``S = exp(-exp(A_log) dt) S + dt x B^T``,
  ``y = S C + D x``; then ``rmsnorm_groups(silu(gate) * y) * w`` and ``out_proj``. The
  convolution is causal, depthwise, with bias, then SiLU; its output splits x, B, C.
- Attention has no positional encoding; MLPs are ``down(relu(up(x))^2)``; the MoE routes
  as DeepSeek's noaux_tc (sigmoid + correction bias) and runs its experts on the latent
  width (``fc1_latent_proj`` / ``fc2_latent_proj``) when ``moe_latent_size`` is set,
  plus a shared ReLU² expert on the full width.
- MTP step j: ``x = eh_proj([enorm(e), hnorm(h)])``, then its P sub-layers as trunk
  blocks, then ``final_layernorm``. No embedding is zeroed at position 0.
"""

import numpy as np

from .numpy_reference import (
    causal_attention,
    linear,
    rmsnorm,
    route_tokens,
    silu,
    softplus,
)

CHARS = {
    "full_attention": "*",
    "attention": "*",
    "linear_attention": "M",
    "mamba": "M",
    "moe": "E",
    "mlp": "-",
}


def trunk_pattern(cfg):
    if cfg.get("hybrid_override_pattern"):
        return cfg["hybrid_override_pattern"]
    return "".join(CHARS[t] for t in cfg["layers_block_type"])


def step_pattern(cfg):
    types = cfg.get("mtp_layers_block_type")
    if types and list(types) != ["full_attention", "moe"]:
        return "".join(CHARS[t] for t in types)
    return cfg.get("mtp_hybrid_override_pattern") or "*E"


def relu2_mlp(W, prefix, x):
    return linear(
        W, prefix + ".down_proj", np.maximum(linear(W, prefix + ".up_proj", x), 0) ** 2
    )


def moe(W, prefix, cfg, x):
    inds, weights = route_tokens(
        x @ W[prefix + ".gate.weight"].T,
        W[prefix + ".gate.e_score_correction_bias"],
        cfg,
    )
    latent = cfg.get("moe_latent_size") is not None
    z = linear(W, prefix + ".fc1_latent_proj", x) if latent else x
    out = np.zeros_like(z)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            out[row] += w * relu2_mlp(W, f"{prefix}.experts.{e}", z[row : row + 1])[0]
    if latent:
        out = linear(W, prefix + ".fc2_latent_proj", out)
    if cfg.get("n_shared_experts"):
        out = out + relu2_mlp(W, prefix + ".shared_experts", x)
    return out


def attention(W, prefix, cfg, x):
    n = x.shape[0]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    q = linear(W, prefix + ".q_proj", x).reshape(n, heads, d).transpose(1, 0, 2)
    k = linear(W, prefix + ".k_proj", x).reshape(n, kv, d).transpose(1, 0, 2)
    v = linear(W, prefix + ".v_proj", x).reshape(n, kv, d).transpose(1, 0, 2)
    return linear(W, prefix + ".o_proj", causal_attention(q, k, v, d**-0.5))


def mamba2(W, prefix, cfg, x):
    n = x.shape[0]
    heads, dh = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    groups, ds = cfg["n_groups"], cfg["ssm_state_size"]
    inner = heads * dh
    proj = linear(W, prefix + ".in_proj", x)
    gate, conv_in, dt = np.split(proj, [inner, 2 * inner + 2 * groups * ds], axis=-1)
    w, bias = (
        W[prefix + ".conv1d.weight"][:, 0, :],
        W[prefix + ".conv1d.bias"],
    )  # (C, K)
    kernel = w.shape[-1]
    padded = np.concatenate([np.zeros((kernel - 1, conv_in.shape[1])), conv_in])
    conv = sum(padded[i : i + n] * w[:, i] for i in range(kernel)) + bias
    xs, B, C = np.split(silu(conv), [inner, inner + groups * ds], axis=-1)
    xs = xs.reshape(n, heads, dh)
    B, C = B.reshape(n, groups, ds), C.reshape(n, groups, ds)
    lo, hi = cfg.get("time_step_limit") or (0.0, np.inf)
    dt = np.clip(softplus(dt + W[prefix + ".dt_bias"]), lo, hi)  # (n, heads)
    A = -np.exp(W[prefix + ".A_log"])
    group = np.arange(heads) // (heads // groups)
    state, ys = np.zeros((heads, dh, ds)), []
    for t in range(n):
        decay = np.exp(A * dt[t])[:, None, None]
        state = (
            decay * state + (dt[t][:, None] * xs[t])[..., None] * B[t][group][:, None]
        )
        ys.append(state @ C[t][group][..., None])
    y = np.stack(ys)[..., 0] + W[prefix + ".D"][:, None] * xs  # (n, heads, dh)
    y = (silu(gate) * y.reshape(n, inner)).reshape(n, groups, -1)
    y = rmsnorm(y, 1.0, cfg["layer_norm_epsilon"]).reshape(n, inner)
    return linear(W, prefix + ".out_proj", y * W[prefix + ".norm.weight"])


MIXERS = {"M": mamba2, "*": attention, "E": moe}


def block(W, prefix, cfg, kind, x):
    h = rmsnorm(x, W[prefix + ".norm.weight"], cfg["layer_norm_epsilon"])
    mixer = MIXERS.get(kind)
    if mixer is None:
        return x + relu2_mlp(W, prefix + ".mixer", h)
    return x + mixer(W, prefix + ".mixer", cfg, h)


def trunk_hidden(W, cfg, tokens):
    x = W["backbone.embeddings.weight"][tokens]
    for i, kind in enumerate(trunk_pattern(cfg)):
        x = block(W, f"backbone.layers.{i}", cfg, kind, x)
    return rmsnorm(x, W["backbone.norm_f.weight"], cfg["layer_norm_epsilon"])


def num_mtp_layers(W, cfg):
    P = len(step_pattern(cfg))
    layers = {int(k.split(".")[2]) for k in W if k.startswith("mtp.layers.")}
    return len(layers) // P


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP step j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps, pattern = cfg["layer_norm_epsilon"], step_pattern(cfg)
    first = f"mtp.layers.{j * len(pattern)}"
    e = W["backbone.embeddings.weight"][next_tokens[: hidden.shape[0]]]
    x = linear(
        W,
        first + ".eh_proj",
        np.concatenate(
            [
                rmsnorm(e, W[first + ".enorm.weight"], eps),
                rmsnorm(hidden, W[first + ".hnorm.weight"], eps),
            ],
            axis=-1,
        ),
    )
    for s, kind in enumerate(pattern):
        x = block(W, f"mtp.layers.{j * len(pattern) + s}", cfg, kind, x)
    last = f"mtp.layers.{(j + 1) * len(pattern) - 1}"
    return rmsnorm(x, W[last + ".final_layernorm.weight"], eps)

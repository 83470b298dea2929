"""Independent float64 numpy reference for LongCat-Flash (``longcat_flash``): trunk and
MTP layer, from raw Hugging Face tensors.

Written from vLLM's ``longcat_flash`` / ``longcat_flash_mtp`` and mlx-lm 0.32.2's
``longcat_flash`` (the trunk we must match). It must not import mlx or mlx_lm.

- MLA: ``q = q_b(q_a_layernorm(q_a(x))) * sqrt(H / q_lora_rank)``, latent
  ``kv_a_layernorm(.) * sqrt(H / kv_lora_rank)`` (the LoRA norms at eps 1e-5, as
  mlx-lm builds them), interleaved RoPE on the ``qk_rope_head_dim`` part, base
  ``rope_theta``, scale ``(nope + rope)^-0.5``.
- A trunk layer runs two (MLA, dense MLP) sub-layers on one residual stream; the MoE
  reads the first sub-layer's post-attention input and its output joins after the
  second. MoE: softmax router (+ ``e_score_correction_bias`` for the choice), top
  ``moe_topk`` weights times ``routed_scaling_factor``; experts at index >=
  ``n_routed_experts`` are identities (``zero_expert_type`` "identity").
- MTP layer j: ``x = eh_proj([enorm.m(e), hnorm.m(h)])``, one pre-norm MLA + dense MLP
  layer (``transformer_layer.mlp``), then ``model.mtp.norm``. No embedding zeroed.
"""

import numpy as np

from .numpy_reference import causal_attention, linear, mlp, rmsnorm, rope_interleaved

LORA_NORM_EPS = 1e-5


def mla(W, prefix, cfg, x):
    n, heads, H = x.shape[0], cfg["num_attention_heads"], cfg["hidden_size"]
    d_nope, d_rope, d_v = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    q_a = rmsnorm(
        linear(W, prefix + ".q_a_proj", x),
        W[prefix + ".q_a_layernorm.weight"],
        LORA_NORM_EPS,
    )
    q = (
        linear(W, prefix + ".q_b_proj", q_a)
        .reshape(n, heads, d_nope + d_rope)
        .transpose(1, 0, 2)
    )
    if cfg.get("mla_scale_q_lora"):
        q = q * (H / q_rank) ** 0.5
    kv_a = linear(W, prefix + ".kv_a_proj_with_mqa", x)
    latent = rmsnorm(
        kv_a[:, :kv_rank], W[prefix + ".kv_a_layernorm.weight"], LORA_NORM_EPS
    )
    if cfg.get("mla_scale_kv_lora"):
        latent = latent * (H / kv_rank) ** 0.5
    kv = (
        linear(W, prefix + ".kv_b_proj", latent)
        .reshape(n, heads, d_nope + d_v)
        .transpose(1, 0, 2)
    )
    pos, base = np.arange(n), cfg["rope_theta"]
    q_pe = rope_interleaved(q[..., d_nope:], pos, d_rope, base)
    k_pe = np.broadcast_to(
        rope_interleaved(kv_a[None, :, kv_rank:], pos, d_rope, base), (heads, n, d_rope)
    )
    q = np.concatenate([q[..., :d_nope], q_pe], axis=-1)
    k = np.concatenate([kv[..., :d_nope], k_pe], axis=-1)
    out = causal_attention(q, k, kv[..., d_nope:], (d_nope + d_rope) ** -0.5)
    return linear(W, prefix + ".o_proj", out)


def moe(W, prefix, cfg, x):
    logits = x @ W[prefix + ".router.classifier.weight"].T
    scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    choice = scores + W[prefix + ".router.e_score_correction_bias"]
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        inds = np.argsort(-choice[row], kind="stable")[: cfg["moe_topk"]]
        w = scores[row, inds]
        if cfg.get("norm_topk_prob"):
            w = w / (w.sum() + 1e-20)
        for e, we in zip(inds, w * cfg["routed_scaling_factor"]):
            if e >= cfg["n_routed_experts"]:
                out[row] += we * x[row]  # an identity ("zero") expert
            else:
                out[row] += we * mlp(W, f"{prefix}.experts.{e}", x[row : row + 1])[0]
    return out


def trunk_layer(W, prefix, cfg, x):
    eps, h, shortcut = cfg["rms_norm_eps"], x, None
    for i in range(2):
        h = h + mla(
            W,
            f"{prefix}.self_attn.{i}",
            cfg,
            rmsnorm(h, W[f"{prefix}.input_layernorm.{i}.weight"], eps),
        )
        y = rmsnorm(h, W[f"{prefix}.post_attention_layernorm.{i}.weight"], eps)
        if i == 0:
            shortcut = moe(W, prefix + ".mlp", cfg, y)
        h = h + mlp(W, f"{prefix}.mlps.{i}", y)
    return h + shortcut


def trunk_hidden(W, cfg, tokens):
    x = W["model.embed_tokens.weight"][tokens]
    for l in range(cfg["num_layers"]):
        x = trunk_layer(W, f"model.layers.{l}", cfg, x)
    return rmsnorm(x, W["model.norm.weight"], cfg["rms_norm_eps"])


def num_mtp_layers(W, cfg):
    return len({k.split(".")[3] for k in W if k.startswith("model.mtp.layers.")})


def mtp_layer(W, cfg, family, j, hidden, next_tokens):
    """MTP layer j over rows (hidden row i, token t_{i+j+1}), as `numpy_reference`'s."""
    eps, prefix = cfg["rms_norm_eps"], f"model.mtp.layers.{j}"
    e = W["model.embed_tokens.weight"][next_tokens[: hidden.shape[0]]]
    fused = np.concatenate(
        [
            rmsnorm(e, W[prefix + ".enorm.m.weight"], eps),
            rmsnorm(hidden, W[prefix + ".hnorm.m.weight"], eps),
        ],
        axis=-1,
    )
    x = linear(W, prefix + ".eh_proj", fused)
    h = x + mla(
        W,
        prefix + ".self_attn",
        cfg,
        rmsnorm(x, W[prefix + ".input_layernorm.weight"], eps),
    )
    y = rmsnorm(h, W[prefix + ".post_attention_layernorm.weight"], eps)
    h = h + mlp(W, prefix + ".transformer_layer.mlp", y)
    return rmsnorm(h, W["model.mtp.norm.weight"], eps)

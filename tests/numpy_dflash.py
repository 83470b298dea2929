"""Independent float64 numpy reference for one DFlash or DFlash2 block.

A test oracle for `mlx_mtp.models.dflash`, written from the release's numerics as
an independent torch fixture generator for ``DFlash2DraftModel`` computes them
(grouped dynamic convolution, non-causal block attention over the context rows,
candidate selector) and from mlx-vlm 0.7.10's ``dflash2`` for what that script
leaves out (kernels wider than 2 taps, ``output_multiplier``, soft-capping,
``input_embedding_scale``); not from this project's MLX code. It must not import
mlx or mlx_lm.

    c = hidden_norm(fc(taps))                   context rows, positions 0..p-1
    x = s_in * embed([a, M, ..., M])            positions p..p+gamma
    per layer, for conv in (attention_conv, mlp_conv) around its sublayer f:
        n = norm(x);  d = kernel_projection(n) -> (rows, 2, K, groups)
        w_side = base_kernel[side] + d[:, side] (repeated over each group's channels)
        x += conv_1(f(conv_0(n)))   with conv_j(y)_t = sum_o w_j[t, o] * y_{t-o}
    g = norm(x)[1:];  z = softcap(m * lm_head(g))
    C = top-k of z;   score(c) = z(c) + sum_r P[prev]_r (W_h g)_r S[c]_r on C

A DFlash drafter (no ``*_conv`` or ``candidate_selector`` tensors) is the same with
every convolution the identity and each slot's scores its logits z. A sliding layer
attends to the last ``sliding_window - 1`` context rows only (mlx-vlm's rule); a
Gemma 4 target's embedding is scaled by sqrt(H), as its own first layer sees it, and
its head (the tied embedding) is read without the target's soft cap; a Gemma 4
drafter's mask token is Gemma's ``<mask>`` (4) when its config names none.
"""

from __future__ import annotations

import numpy as np

from .numpy_dspark import _attention, _qkv
from .numpy_reference import linear, load_checkpoint, mlp, rmsnorm


def _conv(x, w):
    """sum_o w[:, o] * x shifted down o rows (zeros above): x (R, H), w (R, K, H)."""
    out = np.zeros_like(x)
    for o in range(w.shape[1]):
        shifted = np.concatenate([np.zeros((o, x.shape[1])), x[: len(x) - o]])[: len(x)]
        out += w[:, o] * shifted
    return out


def _kernels(W, p, n, group):
    """Both sides' per-row kernels (2, R, K, H) of convolution ``p`` over n (the
    identity for a DFlash drafter, which has none)."""
    if p + "base_kernel" not in W:
        return np.ones((2, len(n), 1, n.shape[1]))
    base = W[p + "base_kernel"]  # (2, K, H)
    d = linear(W, p + "kernel_projection", n)
    d = d.reshape(len(n), 2, base.shape[1], -1).repeat(group, axis=-1)
    return (d + base[None]).transpose(1, 0, 2, 3)


def dflash_block(drafter_dir, target_dir, taps, anchor, prevs):
    """One block after context ``taps`` (positions 0..p-1, p = len(taps)), anchor at
    p: ``(gamma, V)`` selector scores of each slot given its previous token
    ``prevs[k]`` (-inf off the slot's candidates), or a DFlash drafter's logits."""
    cfg, W = load_checkpoint(drafter_dir)
    tcfg, T = load_checkpoint(target_dir)
    d = {**cfg, **cfg["dflash_config"]}  # a key in dflash_config wins
    eps, p, R = cfg["rms_norm_eps"], len(taps), d["block_size"]
    group = d.get("conv_group_size", 1)
    gemma = tcfg.get("model_type") == "gemma4"
    embed = T[
        (
            "model.language_model.embed_tokens.weight"
            if gemma
            else "model.embed_tokens.weight"
        )
    ]
    head = T.get("lm_head.weight", embed)
    scale = np.sqrt(cfg["hidden_size"]) if gemma else 1.0
    mask = d.get("mask_token_id", 4 if cfg["model_type"] == "gemma4" else None)
    c = rmsnorm(taps @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = embed[[anchor] + [mask] * (R - 1)] * scale * d.get("input_embedding_scale", 1.0)
    layers = cfg["num_hidden_layers"]
    for i, kind in enumerate(cfg.get("layer_types") or ["full_attention"] * layers):
        L, a = f"layers.{i}.", f"layers.{i}.self_attn."
        n = rmsnorm(x, W[L + "input_layernorm.weight"], eps)
        w = _kernels(W, L + "attention_conv.", n, group)
        seen = p if kind == "full_attention" else min(p, d["sliding_window"] - 1)
        _, kc, vc = _qkv(W, a, cfg, c[p - seen :], np.arange(p - seen, p))
        q, kb, vb = _qkv(W, a, cfg, _conv(n, w[0]), p + np.arange(R))
        k, v = np.concatenate([kc, kb], axis=1), np.concatenate([vc, vb], axis=1)
        out = _attention(q, k, v, cfg["head_dim"] ** -0.5, False)
        x = x + _conv(linear(W, a + "o_proj", out), w[1])
        n = rmsnorm(x, W[L + "post_attention_layernorm.weight"], eps)
        w = _kernels(W, L + "mlp_conv.", n, group)
        x = x + _conv(mlp(W, L + "mlp", _conv(n, w[0])), w[1])
    g = rmsnorm(x, W["norm.weight"], eps)[1:]  # (gamma, H)
    z = (g @ head.T) * d.get("output_multiplier", 1.0)
    cap = d.get("final_logit_softcapping")
    if cap is not None:
        z = np.tanh(z / cap) * cap
    if "candidate_selector.hidden_projection.weight" not in W:
        return z
    P = W["candidate_selector.predecessor_codebook"]
    S = W["candidate_selector.successor_codebook"]
    hp = linear(W, "candidate_selector.hidden_projection", g)  # (gamma, r)
    scores = np.full_like(z, -np.inf)
    for k in range(len(z)):
        top = np.argsort(-z[k], kind="stable")[: d["selector_top_k"]]
        scores[k, top] = z[k, top] + (P[prevs[k]] * hp[k]) @ S[top].T
    return scores

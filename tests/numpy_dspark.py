"""Independent float64 numpy reference for a Qwen3 target's taps and one DSpark block.

A test oracle for `mlx_mtp.models.dspark`, written from the DSpark spec
(``/work/notes/dspark_spec.md``: §2.1 taps, §2.2 context, §2.3 block, §2.4
attention, §2.5 Markov heads, §2.6 confidence head; DeepSpec
``deepspec/modeling/dspark/qwen3/modeling.py``, ``markov_head.py`` and
``eval/dspark/draft_ops.py``), not from this project's MLX code; it must not import
mlx or mlx_lm.

    feat_t = concat_l h_t^(l)          h^(l): output of trunk layer l, before the norm
    c_t = hidden_norm(fc(feat_t))      per drafter layer: K = rope(k_norm(k(c_t)), t)
    x = embed([a, M, ..., M])          at positions p..p+gamma-1
    per layer: x += o(attn(q(ln1 x), [K_ctx ; K_blk])); x += mlp(ln2 x)   (no mask)
    g_k = norm(x_k);  z_k = lm_head(g_k);  e_k = W1[prev_k];  l_k = z_k + b_k
    vanilla: b_k = W2 e_k
    gated:   b_k = W2 (sigmoid(gate_proj([g_k ; e_k])) * e_k)
    rnn:     [u ; c ; o] = joint_proj([s ; e_k ; g_k]), s_0 = 0,
             s <- sigmoid(u) s + (1 - sigmoid(u)) tanh(c),  b_k = W2 tanh(o)
    c_k = proj([g_k ; e_k]);  block length = min{k : sigmoid(c_k) < tau}, else gamma
"""

from __future__ import annotations

import numpy as np

from .numpy_reference import (
    linear,
    load_checkpoint,
    mlp,
    rmsnorm,
    rope_rotate_half,
    sigmoid,
)


def _heads(x, n):
    """(rows, n * d) -> (n, rows, d)."""
    return x.reshape(x.shape[0], n, -1).transpose(1, 0, 2)


def _attention(q, k, v, scale, causal):
    """q (H, n, d) over k, v (Hkv, T, d); a causal mask when ``causal`` (n == T)."""
    rep = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    scores = (q @ k.transpose(0, 2, 1)) * scale
    if causal:
        n = q.shape[1]
        scores = np.where(np.triu(np.ones((n, n), bool), k=1), -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (scores / scores.sum(axis=-1, keepdims=True)) @ v
    return out.transpose(1, 0, 2).reshape(q.shape[1], -1)


def _qkv(W, p, cfg, x, positions):
    """q, k (RoPE'd at ``positions``) and v of attention ``p`` over rows x."""
    eps, D, theta = cfg["rms_norm_eps"], cfg["head_dim"], cfg["rope_theta"]
    q = rmsnorm(
        _heads(linear(W, p + "q_proj", x), cfg["num_attention_heads"]),
        W[p + "q_norm.weight"],
        eps,
    )
    k = rmsnorm(
        _heads(linear(W, p + "k_proj", x), cfg["num_key_value_heads"]),
        W[p + "k_norm.weight"],
        eps,
    )
    v = _heads(linear(W, p + "v_proj", x), cfg["num_key_value_heads"])
    rope = lambda t: rope_rotate_half(t, positions, D, theta)  # noqa: E731
    return rope(q), rope(k), v


def target_taps(target_dir, tokens, layer_ids):
    """(n, len(layer_ids) * H) taps of ``tokens`` through the Qwen3 target."""
    cfg, W = load_checkpoint(target_dir)
    eps, pos = cfg["rms_norm_eps"], np.arange(len(tokens))
    h = W["model.embed_tokens.weight"][tokens]
    outs = {-1: h}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = _qkv(
            W,
            p + "self_attn.",
            cfg,
            rmsnorm(h, W[p + "input_layernorm.weight"], eps),
            pos,
        )
        h = h + linear(
            W,
            p + "self_attn.o_proj",
            _attention(q, k, v, cfg["head_dim"] ** -0.5, True),
        )
        h = h + mlp(
            W, p + "mlp", rmsnorm(h, W[p + "post_attention_layernorm.weight"], eps)
        )
        outs[i] = h
    return np.concatenate([outs[i] for i in layer_ids], axis=-1)


def dspark_block(drafter_dir, taps, anchor, drafts):
    """One block after context ``taps`` (positions 0..p-1, p = len(taps)), anchor
    at p, given the tokens ``drafts`` drawn at its slots: ``(gamma, V)`` base logits
    z, the Markov-corrected logits of each slot given the tokens drawn before it,
    and ``(gamma,)`` confidence logits c."""
    cfg, W = load_checkpoint(drafter_dir)
    W = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in W.items()}
    nested = cfg.get("dflash_config") or {}
    mask_id = nested.get("mask_token_id", cfg.get("mask_token_id"))
    gamma, eps, p = cfg["block_size"], cfg["rms_norm_eps"], len(taps)
    c = rmsnorm(taps @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = W["embed_tokens.weight"][[anchor] + [mask_id] * (gamma - 1)]
    for i in range(cfg["num_hidden_layers"]):
        a = f"layers.{i}.self_attn."
        _, kc, vc = _qkv(W, a, cfg, c, np.arange(p))
        hn = rmsnorm(x, W[f"layers.{i}.input_layernorm.weight"], eps)
        q, kb, vb = _qkv(W, a, cfg, hn, p + np.arange(gamma))
        k, v = np.concatenate([kc, kb], axis=1), np.concatenate([vc, vb], axis=1)
        x = x + linear(
            W, a + "o_proj", _attention(q, k, v, cfg["head_dim"] ** -0.5, False)
        )
        x = x + mlp(
            W,
            f"layers.{i}.mlp",
            rmsnorm(x, W[f"layers.{i}.post_attention_layernorm.weight"], eps),
        )
    g = rmsnorm(x, W["norm.weight"], eps)  # (gamma, H)
    z = g @ W["lm_head.weight"].T  # (gamma, V)
    prev = [anchor] + list(drafts[: gamma - 1])
    e = W["markov_head.markov_w1.weight"][prev]  # (gamma, r)
    head = cfg.get("markov_head_type", "vanilla")
    with_markov = W["confidence_head.proj.weight"].shape[-1] > g.shape[-1]
    features = np.concatenate([g, e], axis=-1) if with_markov else g
    c = linear(W, "confidence_head.proj", features)[:, 0]
    return z, z + _markov_bias(W, head, g, e), c


def _markov_bias(W, head, g, e):
    """(gamma, V) biases of DeepSpec's Markov head ``head`` over a block's slots."""
    w2 = W["markov_head.markov_w2.weight"]  # (V, r)
    if head == "vanilla":
        return e @ w2.T
    if head == "gated":
        gate = sigmoid(linear(W, "markov_head.gate_proj", np.concatenate([g, e], -1)))
        return (gate * e) @ w2.T
    assert head == "rnn", head
    s, out = np.zeros(e.shape[-1]), []
    for k in range(len(e)):
        joint = linear(W, "markov_head.joint_proj", np.concatenate([s, e[k], g[k]]))
        u, cand, o = np.split(joint, 3)
        s = sigmoid(u) * s + (1.0 - sigmoid(u)) * np.tanh(cand)
        out.append(np.tanh(o) @ w2.T)
    return np.stack(out)


def block_length(confidence, tau):
    """The block's length under the cut (DeepSpec's rule): the first slot whose
    sigmoid(c) < tau, else gamma; tau = 0: no cut."""
    low = [k for k, c in enumerate(confidence) if sigmoid(c) < tau]
    return low[0] if tau > 0 and low else len(confidence)

"""Independent float64 numpy reference for Hy4 (``hy_v4``), written from mlx-vlm
0.7.10's ``models/hy_v4`` and ``speculative/drafters/hy_v4_mtp``, with the release's
conventions where vLLM, SGLang and transformers agree and mlx-vlm does not (the
indexer's RoPE dimensions, the experts' clamp, the MTP's position 0).

Trunk: the token embedding copied into ``hc_mult`` streams; per layer, an identity
hyper-connection collapses the streams into the attention's input and spreads its
output back (then the same around the MLP); at the end ``hc_head`` collapses them
and ``model.norm`` normalizes.

- Hyper-connection of streams S (n, hc, D): ``m = rms(S flattened) @ hc_fn.T``
  (no weight; ``rms_norm_eps``); ``pre = sigmoid(m[:hc] * hc_scale[0] +
  hc_base[:hc]) + hc_eps``, ``post = hc_magnitude * sigmoid(m[hc:] * hc_scale[1] +
  hc_base[hc:])``; input ``sum_s pre_s S_s``; after the sub-layer's output y,
  ``S_s += post_s y``. The head: ``pre = sigmoid(m * hc_head_scale + hc_head_base)
  + hc_eps`` over ``hc_head_fn``'s hc mixes.
- Attention: DeepSeek-V3's MLA (interleaved RoPE, ``q_a``/``kv_a`` norms at 1e-6),
  restricted, past ``index_topk`` keys, to the keys its DSA indexer selects (each
  index head ``[nope | rope]``: interleaved RoPE on its last ``qk_rope_head_dim``
  dimensions); a layer whose ``indexer_types`` entry is "shared" has
  no indexer and uses the last full layer's selection. Each head's softmax has a
  sink: ``learnable_sink_param[h]`` joins the denominator (no value). The output is
  gated per head and channel by ``sigmoid(linear_gate(x))`` before ``o_proj``.
- MLP: dense below ``first_k_dense_replace``, else DeepSeek's sigmoid-routed MoE
  whose routed experts (fused: ``experts.gate_up_proj`` (E, 2I, H), gate rows
  first; ``experts.down_proj``) clamp ``gate`` above and ``up`` both ways at
  ``swiglu_limit``; the shared expert does not.

MTP layer j (``model.mtp_layers.{j}``): ``x = eh_proj([enorm(e), hnorm(h)])`` with h
the trunk's post-norm hidden state and the embedding of position 0 zeroed (vLLM's
``mtp.py``), one decoder layer of the same kind without streams (its own indexer),
``final_layernorm``.
"""

import numpy as np

from .numpy_reference import (
    MLA_NORM_EPS,
    count_mtp_layers,
    layer_norm,
    linear,
    load_checkpoint,
    mlp,
    rmsnorm,
    rope_base,
    rope_interleaved,
    route_tokens,
    sigmoid,
    silu,
)


def indexer_types(cfg):
    """ "full" or "shared" per trunk layer (mlx-vlm's default: full on layers 0, 1
    and every fourth from 1)."""
    n = cfg["num_hidden_layers"]
    return cfg.get("indexer_types") or [
        "full" if i < 2 or i % 4 == 1 else "shared" for i in range(n)
    ]


def attention(W, prefix, cfg, x, positions, shared):
    """Gated MLA with sinks over one sequence x (n, D); ``shared["last"]`` is the
    selection of the last layer with an indexer."""
    n, heads = x.shape[0], cfg["num_attention_heads"]
    d_nope, d_rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    d_v, rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_a = linear(W, prefix + ".q_a_proj", x)
    q_a = rmsnorm(q_a, W[prefix + ".q_a_layernorm.weight"], MLA_NORM_EPS)
    q = linear(W, prefix + ".q_b_proj", q_a).reshape(n, heads, d_nope + d_rope)
    q = q.transpose(1, 0, 2)  # (H, n, dq)
    kv_a = linear(W, prefix + ".kv_a_proj_with_mqa", x)
    latent = rmsnorm(kv_a[:, :rank], W[prefix + ".kv_a_layernorm.weight"], MLA_NORM_EPS)
    kv = linear(W, prefix + ".kv_b_proj", latent).reshape(n, heads, d_nope + d_v)
    kv = kv.transpose(1, 0, 2)
    base = rope_base(cfg)
    q_pe = rope_interleaved(q[..., d_nope:], positions, d_rope, base)
    k_pe = rope_interleaved(kv_a[None, :, rank:], positions, d_rope, base)
    q_full = np.concatenate([q[..., :d_nope], q_pe], axis=-1)
    k_pe = np.broadcast_to(k_pe, (heads, n, d_rope))
    k_full = np.concatenate([kv[..., :d_nope], k_pe], axis=-1)

    if prefix + ".indexer.wk.weight" in W:
        shared["last"] = selection(W, prefix + ".indexer", cfg, x, q_a, positions)
    allowed = shared.get("last")

    scale = (d_nope + d_rope) ** -0.5
    sinks = W[prefix + ".learnable_sink_param"]  # (H,)
    out = attend_with_sinks(q_full, k_full, kv[..., d_nope:], scale, sinks, allowed)

    gate = sigmoid(linear(W, prefix + ".linear_gate", x))  # (n, H dv)
    return linear(W, prefix + ".o_proj", out * gate)


def selection(W, prefix, cfg, x, q_a, positions):
    """The indexer's kept keys per query, (n, n) booleans (None: at most
    ``index_topk`` keys, all kept): score ``sum_h relu(q_h . k) * w_h`` with
    ``w = weights_proj(x) / sqrt(heads * head_dim)``, ``q = wq_b(q_a)``,
    ``k = LayerNorm(wk(x))``, RoPE on the last ``qk_rope_head_dim`` dims of each."""
    n, heads, d = x.shape[0], cfg["index_n_heads"], cfg["index_head_dim"]
    if n <= cfg["index_topk"]:
        return None
    rope, base = cfg["qk_rope_head_dim"], rope_base(cfg)
    q = linear(W, prefix + ".wq_b", q_a).reshape(n, heads, d).transpose(1, 0, 2)
    k = linear(W, prefix + ".wk", x)
    k = layer_norm(k, W[prefix + ".k_norm.weight"], W[prefix + ".k_norm.bias"], 1e-6)

    def rotate_tail(t):
        tail = rope_interleaved(t[..., d - rope :], positions, rope, base)
        return np.concatenate([t[..., : d - rope], tail], axis=-1)

    q, k = rotate_tail(q), rotate_tail(k[None])[0]
    w = linear(W, prefix + ".weights_proj", x) * (heads**-0.5 * d**-0.5)
    scores = (np.maximum(q @ k.T, 0) * w.T[..., None]).sum(axis=0)  # (n, n)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    keep = np.argsort(-scores, axis=-1, kind="stable")[:, : cfg["index_topk"]]
    allowed = np.zeros((n, n), dtype=bool)
    np.put_along_axis(allowed, keep, True, axis=-1)
    return allowed


def attend_with_sinks(q, k, v, scale, sinks, allowed):
    """Causal softmax attention (and'ed with ``allowed``) in which head h's
    denominator also holds ``exp(sinks[h])``: a key every query sees, valued zero.
    q, k (H, n, d), v (H, n, dv); returns (n, H dv)."""
    n = q.shape[1]
    scores = (q @ k.transpose(0, 2, 1)) * scale  # (H, n, n)
    blocked = np.triu(np.ones((n, n), dtype=bool), k=1)
    if allowed is not None:
        blocked = blocked | ~allowed
    scores = np.where(blocked, -np.inf, scores)
    sink = np.broadcast_to(sinks[:, None, None], (q.shape[0], n, 1))
    top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    probs = np.exp(scores - top)
    probs /= probs.sum(axis=-1, keepdims=True) + np.exp(sink - top)
    return (probs @ v).transpose(1, 0, 2).reshape(n, -1)


def hyper_pre(W, prefix, cfg, streams):
    """An identity hyper-connection's collapse of streams (n, hc, D): the sub-layer's
    input (n, D) and the post weights (n, hc)."""
    hc = cfg["hc_mult"]
    mixes = _rms(streams, cfg) @ W[prefix + ".hc_fn"].T  # (n, 2 hc)
    scale, base = W[prefix + ".hc_scale"], W[prefix + ".hc_base"]
    pre = sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + cfg["hc_eps"]
    post = cfg["hc_magnitude"] * sigmoid(mixes[:, hc:] * scale[1] + base[hc:])
    return (pre[..., None] * streams).sum(axis=1), post


def hyper_head(W, cfg, streams):
    mixes = _rms(streams, cfg) @ W["model.hc_head.hc_head_fn"].T  # (n, hc)
    scale, base = W["model.hc_head.hc_head_scale"], W["model.hc_head.hc_head_base"]
    pre = sigmoid(mixes * scale[0] + base) + cfg["hc_eps"]
    return (pre[..., None] * streams).sum(axis=1)


def _rms(streams, cfg):
    flat = streams.reshape(streams.shape[0], -1)
    return flat / np.sqrt(
        np.mean(flat * flat, axis=-1, keepdims=True) + cfg["rms_norm_eps"]
    )


def feed_forward(W, prefix, cfg, idx, x, mtp=False):
    dense = not mtp and (
        idx < cfg["first_k_dense_replace"] or idx % cfg.get("moe_layer_freq", 1)
    )
    return mlp(W, prefix, x) if dense else experts(W, prefix, cfg, x)


def experts(W, prefix, cfg, x):
    """Routed experts (fused, clamped) plus the shared expert (plain)."""
    logits = x @ W[prefix + ".gate.weight"].T
    inds, weights = route_tokens(
        logits, W[prefix + ".gate.e_score_correction_bias"], cfg
    )
    gate_up, down = (
        W[prefix + ".experts.gate_up_proj"],
        W[prefix + ".experts.down_proj"],
    )
    inter, limit = down.shape[-1], cfg.get("swiglu_limit") or np.inf
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            h = gate_up[e] @ x[row]
            gate, up = np.minimum(h[:inter], limit), np.clip(h[inter:], -limit, limit)
            out[row] += w * (down[e] @ (silu(gate) * up))
    return out + mlp(W, prefix + ".shared_experts", x)


def trunk_hidden(W, cfg, tokens):
    """Hidden states (n, D) after ``hc_head`` and ``model.norm``."""
    eps, hc = cfg["rms_norm_eps"], cfg["hc_mult"]
    x = W["model.embed_tokens.weight"][np.asarray(tokens)]
    streams = np.repeat(x[:, None, :], hc, axis=1)  # (n, hc, D)
    positions, shared = np.arange(len(tokens)), {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x, post = hyper_pre(W, p + ".hc_attn_layer.hc_pre", cfg, streams)
        a_in = rmsnorm(x, W[p + ".input_layernorm.weight"], eps)
        y = attention(W, p + ".self_attn", cfg, a_in, positions, shared)
        streams = streams + post[..., None] * y[:, None, :]
        x, post = hyper_pre(W, p + ".hc_mlp_layer.hc_pre", cfg, streams)
        m_in = rmsnorm(x, W[p + ".post_attention_layernorm.weight"], eps)
        y = feed_forward(W, p + ".mlp", cfg, i, m_in)
        streams = streams + post[..., None] * y[:, None, :]
    return rmsnorm(hyper_head(W, cfg, streams), W["model.norm.weight"], eps)


def mtp_layer(W, cfg, j, hidden, next_tokens):
    """MTP layer j over rows 0..m-1 (hidden (m, D) post-norm; next_tokens[i] paired
    with row i): its output after ``final_layernorm``."""
    p, eps = f"model.mtp_layers.{j}", cfg["rms_norm_eps"]
    emb = W["model.embed_tokens.weight"][np.asarray(next_tokens)].copy()
    emb[0] = 0.0  # position 0
    e_n = rmsnorm(emb, W[p + ".enorm.weight"], eps)
    h_n = rmsnorm(hidden, W[p + ".hnorm.weight"], eps)
    x = linear(W, p + ".eh_proj", np.concatenate([e_n, h_n], axis=-1))
    positions = np.arange(x.shape[0])
    a_in = rmsnorm(x, W[p + ".input_layernorm.weight"], eps)
    h = x + attention(W, p + ".self_attn", cfg, a_in, positions, {})
    m_in = rmsnorm(h, W[p + ".post_attention_layernorm.weight"], eps)
    h = h + feed_forward(W, p + ".mlp", cfg, 0, m_in, mtp=True)
    return rmsnorm(h, W[p + ".final_layernorm.weight"], eps)


def reference_logits(ckpt_dir, tokens):
    """`numpy_reference.reference_logits` for a Hy4 checkpoint."""
    config, W = load_checkpoint(ckpt_dir)
    cfg = dict(config, indexer_types=indexer_types(config))
    head = W["lm_head.weight"]
    hidden = trunk_hidden(W, cfg, tokens)
    n, main, mtp = len(tokens), hidden @ head.T, []
    count = count_mtp_layers(W, cfg, lambda j: f"model.mtp_layers.{j}.eh_proj.weight")
    for j in range(count):
        rows = n - 1 - j
        hidden = mtp_layer(W, cfg, j, hidden[:rows], tokens[j + 1 :])
        mtp.append(hidden @ head.T)
    return main, mtp

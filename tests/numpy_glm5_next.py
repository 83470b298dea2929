"""Independent float64 numpy reference for GLM-5.3-Flash's text model (``glm5_next``),
written from mlx-vlm 0.7.10's ``models/glm5_next/language.py`` (with
``models/gated_delta.py`` and ``models/deepseek_v4/hyper_connection.py``, their
non-kernel paths) and ``speculative/drafters/glm5_next_mtp``. It must not import mlx.
Full sequence, teacher-forced, no cache, no padding; positions 0..n-1.

The config is ``text_config``; tensors are under ``model.language_model.``,
``lm_head.weight`` at the top; ``model.visual.*`` is not read.

- Trunk: the embedding copied into ``hc_mult`` streams (n, hc, D); per layer, the
  attention (KDA, or sparse MLA by ``layer_types``) and then the MLP, each inside
  a hyper-connection; at the end ``norm(mean over streams)``, logits ``lm_head``.
- Hyper-connection (DeepSeek-V4's mHC) of streams S: ``mix = rms(flat S) @ fn.T``
  (unweighted RMS over hc * D, ``rms_norm_eps``), ``pre = sigmoid(mix * s0 + b) +
  hc_eps``, ``post = 2 sigmoid(mix * s1 + b)``, ``comb = softmax_rows(mix * s2 + b)
  + hc_eps``, then Sinkhorn: columns, then ``hc_sinkhorn_iters - 1`` rounds of rows
  and columns (``x / (sum + hc_eps)``). The sub-layer reads
  ``norm(sum_i pre_i S_i)``; new stream k is ``post_k y + sum_j comb[j, k] S_j``.
- KDA (``linear_attention``): ``q, k, v = silu(causal depthwise conv(q/k/v_proj x))``
  (kernel ``short_conv_kernel_size``, zero history); per head (d = head_dim)
  ``q = d^-1 rms(q, eps 1e-6 / d)``, ``k = d^-0.5 rms(k, eps 1e-6 / d)`` (unit RMS
  without weight), v as is. Per-channel decay ``g = exp(lb * sigmoid(exp(A_log_h)
  * (f_b_proj(f_a_proj x) + dt_bias)))`` (lb ``gate_lower_bound``), ``beta =
  sigmoid(b_proj x)``; the delta rule from a zero state S (H, dv, dk): ``S *= g``
  (along dk), ``S += ((v - S k) beta) k^T``, ``y = S q``. Output
  ``o_proj(o_norm(y) * sigmoid(g_b_proj(g_a_proj x)))``.
- Sparse MLA (NoPE): ``q = q_b_proj(q_a_layernorm(q_a_proj x))`` per head
  (``qk_nope_head_dim``), latent ``c = kv_a_layernorm(kv_a_proj_with_mqa x)``; keys
  and values ``kv_b_proj(c)`` (head h: ``[k (nope) | v]``; mlx-vlm's
  ``embed_q``/``unembed_out`` absorb the same matrices into the query and the
  output); scale ``qk_nope_head_dim^-0.5``. Query p softmaxes over exactly the
  positions its indexer selects (no other causal mask). Norm eps ``rms_norm_eps``.
- Indexer: keys ``k = LayerNorm(wk x)`` (weight, bias, eps 1e-6), cut into pools of
  ``index_kpool`` consecutive positions (the last incomplete pool is no pool);
  pool key ``sum_s softmax_s(x_s @ compress_gate.T + ape[s]) k_s`` per channel.
  Pool w (ending at e_w) is a candidate for query p iff e_w <= p; each query keeps
  ``index_topk // index_kpool`` pools: all candidates when that many pools exist
  or fewer, else the best by ``sum_h relu(q_h . K_w) w_h d^-0.5`` with
  ``q = wq_b(q_a_layernorm(q_a_proj x))``, ``w = weights_proj(x) heads^-0.5``
  (non-candidates chosen to fill are invalid). With
  ``index_kpool_always_select_tail``, query p also sees the partial pool's
  positions ``p + 1 - (p + 1) % kpool .. p``. A "shared" layer reuses the last
  full layer's selection. Ties at the cut (pools whose heads all relu to 0 score
  exactly 0) go to the lower pool here; mlx's argpartition leaves their order
  unspecified, so ``reference_logits(..., ties=[])`` lists where they occur.
- MLP: ``down(silu(min(gate x, L)) * clip(up x, -L, L))``, L = ``swiglu_limit``,
  for the dense layers, the shared expert and the routed experts. MoE: sigmoid
  scores, top-k of ``scores + e_score_correction_bias`` (noaux_tc, groups), weights
  the chosen scores normalized (``norm_topk_prob``) times
  ``routed_scaling_factor``.

MTP (the nextn layer ``layers.{num_hidden_layers}``, mlx-vlm's
``Glm5NextMTPDraftModel``): ``x = eh_proj([enorm(e), hnorm(h)])`` with h the trunk's
final hidden state (after ``norm``) at row i and e the embedding of t_{i+1}, zeroed
at position 0; then ``x += attn(input_layernorm(x))`` (sparse MLA with its own,
"full", indexer), ``x += moe(post_attention_layernorm(x))``, no streams;
``shared_head.norm``; logits with the trunk's ``lm_head``.
"""

import numpy as np

from .numpy_reference import (
    causal_depthwise_conv_silu,
    layer_norm,
    linear,
    load_checkpoint,
    rmsnorm,
    route_tokens,
    sigmoid,
    silu,
)

TEXT = "model.language_model."


def unit_rms(x, eps):
    """RMS norm without a weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def softmax(x, axis):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def text_config(config):
    """The text model's config with mlx-vlm's defaults for the layer kinds."""
    cfg = dict(config.get("text_config") or config)
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = [
            "linear_attention" if i % 4 != 3 else "deepseek_sparse_attention"
            for i in range(n)
        ]
    cfg["layer_types"] = [
        "deepseek_sparse_attention" if t == "full_attention" else t
        for t in cfg["layer_types"]
    ]
    if cfg.get("mlp_layer_types") is None:
        dense = min(cfg.get("first_k_dense_replace", 3), n)
        cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n - dense)
    if cfg.get("indexer_types") is None:
        raise NotImplementedError("indexer_types must be in the config")
    if cfg.get("qk_rope_head_dim", 0) != 0:
        raise NotImplementedError("GLM-5-Next's attention is NoPE")
    return cfg


# ---------------------------------------------------------------------------
# Hyper-connections


def hc_mix(W, name, cfg, streams):
    """(pre (n, hc), post (n, hc), comb (n, hc, hc)) of one sub-layer's mHC."""
    n, hc = streams.shape[:2]
    eps = cfg["hc_eps"]
    mix = unit_rms(streams.reshape(n, -1), cfg["rms_norm_eps"]) @ W[name + "_fn"].T
    base, scale = W[name + "_base"], W[name + "_scale"]
    pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mix[:, 2 * hc :].reshape(n, hc, hc) * scale[2]
    comb = softmax(comb + base[2 * hc :].reshape(hc, hc), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


def hc_branch(W, name, cfg, streams, norm_weight, fn):
    """Collapse streams with ``pre``, run ``fn(norm(.))``, spread back."""
    pre, post, comb = hc_mix(W, name, cfg, streams)
    collapsed = np.einsum("nh,nhd->nd", pre, streams)
    out = fn(rmsnorm(collapsed, norm_weight, cfg["rms_norm_eps"]))
    mixed = np.einsum("njk,njd->nkd", comb, streams)
    return post[..., None] * out[:, None, :] + mixed


# ---------------------------------------------------------------------------
# KDA linear attention


def kda(W, prefix, cfg, x):
    """Kimi delta attention with a per-channel decay over one sequence x (n, D)."""
    n = x.shape[0]
    lin = cfg["linear_attn_config"]
    heads, d = lin["num_heads"], lin["head_dim"]
    lower = lin.get("gate_lower_bound")
    if lower is None:
        lower = -5.0  # mlx-vlm's default (and its safe_gate's)

    def conv(name):
        y = causal_depthwise_conv_silu(
            linear(W, f"{prefix}.{name}_proj", x), W[f"{prefix}.{name}_conv1d.weight"]
        )
        return y.reshape(n, heads, d)

    q, k, v = conv("q"), conv("k"), conv("v")
    q = d**-1.0 * unit_rms(q, 1e-6 / d)
    k = d**-0.5 * unit_rms(k, 1e-6 / d)
    a = linear(W, prefix + ".f_b_proj", linear(W, prefix + ".f_a_proj", x))
    a = a.reshape(n, heads, d) + W[prefix + ".dt_bias"].reshape(heads, d)
    rate = np.exp(W[prefix + ".A_log"]).reshape(heads, 1)
    g = np.exp(lower * sigmoid(rate * a))  # (n, H, dk)
    beta = sigmoid(linear(W, prefix + ".b_proj", x))  # (n, H)

    state = np.zeros((heads, d, d))  # (H, dv, dk)
    y = np.zeros((n, heads, d))
    for t in range(n):
        state = state * g[t][:, None, :]
        delta = (v[t] - np.einsum("hvk,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + delta[:, :, None] * k[t][:, None, :]
        y[t] = np.einsum("hvk,hk->hv", state, q[t])

    y = rmsnorm(y, W[prefix + ".o_norm.weight"], cfg["rms_norm_eps"])
    gate = linear(W, prefix + ".g_b_proj", linear(W, prefix + ".g_a_proj", x))
    y = y * sigmoid(gate.reshape(n, heads, d))
    return linear(W, prefix + ".o_proj", y.reshape(n, heads * d))


# ---------------------------------------------------------------------------
# Pooled-key indexer and sparse MLA


def pool_scores(W, prefix, cfg, x, q_resid):
    """(candidates (n, P) booleans, scores (n, P)) over the complete pools."""
    n, kpool = x.shape[0], cfg["index_kpool"]
    heads, d = cfg["index_n_heads"], cfg["index_head_dim"]
    pools = n // kpool
    keys = layer_norm(
        linear(W, prefix + ".wk", x),
        W[prefix + ".k_norm.weight"],
        W[prefix + ".k_norm.bias"],
        1e-6,
    )
    gates = x @ W[prefix + ".index_kpool_compress_gate"].T
    rows = pools * kpool
    keys = keys[:rows].reshape(pools, kpool, d)
    gates = (
        gates[:rows].reshape(pools, kpool, d) + W[prefix + ".index_kpool_compress_ape"]
    )
    pooled = (softmax(gates, axis=1) * keys).sum(axis=1)  # (P, d)
    ends = np.arange(pools) * kpool + kpool - 1
    candidates = ends[None, :] <= np.arange(n)[:, None]

    q = linear(W, prefix + ".wq_b", q_resid).reshape(n, heads, d)
    w = linear(W, prefix + ".weights_proj", x) * heads**-0.5  # (n, heads)
    scores = np.maximum(np.einsum("nhd,pd->nhp", q, pooled), 0.0) * d**-0.5
    scores = np.einsum("nhp,nh->np", scores, w)
    return candidates, scores


def selection(W, prefix, cfg, x, q_resid, ties=None):
    """(n, n) booleans: the positions each query attends to."""
    n, kpool = x.shape[0], cfg["index_kpool"]
    candidates, scores = pool_scores(W, prefix, cfg, x, q_resid)
    pools = candidates.shape[1]
    keep_k = min(cfg["index_topk"] // kpool, pools)
    allowed = np.zeros((n, n), dtype=bool)
    for p in range(n):
        chosen = np.flatnonzero(candidates[p])
        if pools > keep_k and len(chosen) > keep_k:
            order = chosen[np.argsort(-scores[p, chosen], kind="stable")]
            if (
                ties is not None
                and scores[p, order[keep_k - 1]] == scores[p, order[keep_k]]
            ):
                ties.append((prefix, p))
            chosen = order[:keep_k]
        for w in chosen:
            allowed[p, w * kpool : (w + 1) * kpool] = True
        if cfg.get("index_kpool_always_select_tail", True) and kpool > 1:
            allowed[p, p + 1 - (p + 1) % kpool : p + 1] = True
    return allowed


def sparse_mla(W, prefix, cfg, x, shared, ties=None):
    """NoPE MLA restricted to the indexer's selection; ``shared["last"]`` carries
    the last full layer's selection to the "shared" ones."""
    n, heads = x.shape[0], cfg["num_attention_heads"]
    d_nope, d_v, eps = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["rms_norm_eps"]
    q_resid = rmsnorm(
        linear(W, prefix + ".q_a_proj", x), W[prefix + ".q_a_layernorm.weight"], eps
    )
    q = linear(W, prefix + ".q_b_proj", q_resid).reshape(n, heads, d_nope)
    latent = rmsnorm(
        linear(W, prefix + ".kv_a_proj_with_mqa", x),
        W[prefix + ".kv_a_layernorm.weight"],
        eps,
    )
    kv = linear(W, prefix + ".kv_b_proj", latent).reshape(n, heads, d_nope + d_v)
    k, v = kv[..., :d_nope], kv[..., d_nope:]

    if prefix + ".indexer.wk.weight" in W:
        shared["last"] = selection(W, prefix + ".indexer", cfg, x, q_resid, ties)
    allowed = shared["last"]

    logits = np.einsum("phd,khd->hpk", q, k) * d_nope**-0.5
    logits = np.where(allowed[None], logits, -np.inf)
    probs = softmax(logits, axis=-1)
    out = np.einsum("hpk,khd->phd", probs, v).reshape(n, heads * d_v)
    return linear(W, prefix + ".o_proj", out)


# ---------------------------------------------------------------------------
# MLPs


def limited_mlp(cfg, gate_w, up_w, down_w, x):
    limit = cfg["swiglu_limit"]
    gate = np.minimum(x @ gate_w.T, limit)
    up = np.clip(x @ up_w.T, -limit, limit)
    return (silu(gate) * up) @ down_w.T


def dense_mlp(W, prefix, cfg, x):
    return limited_mlp(
        cfg,
        W[prefix + ".gate_proj.weight"],
        W[prefix + ".up_proj.weight"],
        W[prefix + ".down_proj.weight"],
        x,
    )


def moe(W, prefix, cfg, x):
    """Sigmoid-routed experts plus the shared expert, all clamped."""
    logits = x @ W[prefix + ".gate.weight"].T
    inds, weights = route_tokens(
        logits, W[prefix + ".gate.e_score_correction_bias"], cfg
    )
    out = dense_mlp(W, prefix + ".shared_experts", cfg, x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            y = dense_mlp(W, f"{prefix}.experts.{e}", cfg, x[row : row + 1])
            out[row] += w * y[0]
    return out


# ---------------------------------------------------------------------------
# Trunk and MTP


def trunk_hidden(W, cfg, tokens, ties=None):
    """Hidden states (n, D) after the streams' mean and ``norm``."""
    x = W[TEXT + "embed_tokens.weight"][np.asarray(tokens)]
    streams = np.repeat(x[:, None, :], cfg["hc_mult"], axis=1)
    shared = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{TEXT}layers.{i}"
        if cfg["layer_types"][i] == "linear_attention":
            attn = lambda h, p=p: kda(W, p + ".self_attn", cfg, h)  # noqa: E731
        else:
            attn = lambda h, p=p: sparse_mla(  # noqa: E731
                W, p + ".self_attn", cfg, h, shared, ties
            )
        if cfg["mlp_layer_types"][i] == "sparse":
            ffn = lambda h, p=p: moe(W, p + ".mlp", cfg, h)  # noqa: E731
        else:
            ffn = lambda h, p=p: dense_mlp(W, p + ".mlp", cfg, h)  # noqa: E731
        streams = hc_branch(
            W, p + ".hc_attn", cfg, streams, W[p + ".input_layernorm.weight"], attn
        )
        streams = hc_branch(
            W,
            p + ".hc_ffn",
            cfg,
            streams,
            W[p + ".post_attention_layernorm.weight"],
            ffn,
        )
    return rmsnorm(streams.mean(axis=1), W[TEXT + "norm.weight"], cfg["rms_norm_eps"])


def num_mtp_layers(W, cfg):
    """nextn layers at ``layers.{num_hidden_layers + j}`` (checked against the
    config)."""
    count = 0
    while f"{TEXT}layers.{cfg['num_hidden_layers'] + count}.eh_proj.weight" in W:
        count += 1
    declared = cfg.get("num_nextn_predict_layers")
    if count and declared is not None and declared != count:
        raise ValueError(
            f"config declares {declared} MTP layers, checkpoint has {count}"
        )
    return count


def mtp_layer(W, cfg, j, hidden, next_tokens, ties=None):
    """nextn layer j over rows 0..m-1 (hidden (m, D) post-norm, next_tokens[i] with
    row i, position i): its output after ``shared_head.norm``."""
    p, eps = f"{TEXT}layers.{cfg['num_hidden_layers'] + j}", cfg["rms_norm_eps"]
    emb = W[TEXT + "embed_tokens.weight"][np.asarray(next_tokens)].copy()
    emb[0] = 0.0  # position 0
    e_n = rmsnorm(emb, W[p + ".enorm.weight"], eps)
    h_n = rmsnorm(hidden, W[p + ".hnorm.weight"], eps)
    x = linear(W, p + ".eh_proj", np.concatenate([e_n, h_n], axis=-1))
    a_in = rmsnorm(x, W[p + ".input_layernorm.weight"], eps)
    x = x + sparse_mla(W, p + ".self_attn", cfg, a_in, {}, ties)
    m_in = rmsnorm(x, W[p + ".post_attention_layernorm.weight"], eps)
    x = x + moe(W, p + ".mlp", cfg, m_in)
    return rmsnorm(x, W[p + ".shared_head.norm.weight"], eps)


def reference_logits(ckpt_dir, tokens, ties=None):
    """Teacher-forced logits for one sequence (the contract of
    ``numpy_reference.reference_logits``): main (n, V); mtp[j] (n-1-j, V), row i
    the logits for t_{i+j+2}. ``ties`` (a list) collects (indexer, query) pairs
    whose pool scores tie at the top-k cut."""
    config, W = load_checkpoint(ckpt_dir)
    if config.get("model_type") not in ("glm5_next", "glm5_next_text"):
        raise NotImplementedError(f"model_type {config.get('model_type')!r}")
    cfg = text_config(config)
    tokens = [int(t) for t in tokens]
    head = W["lm_head.weight"]
    hidden = trunk_hidden(W, cfg, tokens, ties)
    n, main, mtp = len(tokens), hidden @ head.T, []
    for j in range(num_mtp_layers(W, cfg)):
        rows = n - 1 - j
        if rows <= 0:
            mtp.append(np.zeros((0, head.shape[0])))
            continue
        hidden = mtp_layer(W, cfg, j, hidden[:rows], tokens[j + 1 :], ties)
        mtp.append(hidden @ head.T)
    return main, mtp

"""Independent float64 numpy reference for DeepSeek-V4 (``deepseek_v4``): trunk and
MTP layers, from the release layout (DeepSeek's own tensor names: ``embed``,
``layers.{i}.attn.wq_a``, ``ffn.experts.{e}.w1``, ``hc_head_fn``, ``mtp.0.e_proj``,
...; HF ``deepseek-ai/DeepSeek-V4-Flash``). It must not import mlx or mlx_lm.

Written from transformers 5.24's ``models/deepseek_v4`` (the trunk target: HF within
1e-4) and DeepSeek's reference ``inference/model.py`` (REF) for the MTP layer, which
HF does not build. Full sequence, teacher-forced, no cache; positions 0..n-1.

- Streams: the embedding is copied into ``hc_mult`` streams (n, hc, D). Each block
  runs two sub-layers (attention, then MoE), each with its own mHC computed from
  that sub-layer's input streams: ``mix = rms(flatten(streams)) @ fn.T`` (unweighted
  RMS over hc * D, eps ``rms_norm_eps``), ``pre = sigmoid(mix * s0 + b) + hc_eps``,
  ``post = 2 sigmoid(mix * s1 + b)``, ``comb = softmax_rows(mix * s2 + b) + hc_eps``,
  then Sinkhorn: columns first, then ``hc_sinkhorn_iters - 1`` rounds of rows then
  columns (each ``x / (sum + hc_eps)``). The sub-layer reads
  ``norm(sum_i pre_i s_i)``; new stream k is ``post_k out + sum_j comb[j, k] s_j``
  (comb applied transposed, as HF and REF's ``hc_post``).
- Head: ``hc_head`` (``pre = sigmoid(rms(flat) @ hc_head_fn.T * scale + base) +
  hc_eps``, no Sinkhorn), then ``norm``, then ``head``.
- Attention (shared-KV MQA, one kv head): ``q = wq_b(q_norm(wq_a x))``, then a per
  head unweighted RMS norm; ``kv = kv_norm(wkv x)`` is both key and value. RoPE is
  interleaved (pairs 2i, 2i+1) on the TRAILING ``qk_rope_head_dim`` dims. Scores are
  scaled by head_dim^-0.5; a per-head sink logit joins each softmax's denominator.
  Window keys: the last ``sliding_window`` positions, self included. The output's
  rope slice is rotated back by its query position (inverse RoPE); ``wo_a`` is block
  diagonal (group g: heads g*H/G.., rows g*o_lora..), then ``wo_b``.
- RoPE: window-only layers (ratio 0) use ``rope_theta``, plain. Compressed layers
  use ``compress_rope_theta`` with YaRN from ``rope_scaling`` (HF
  ``_compute_yarn_parameters``: correction range floor/ceil, linear ramp over
  rope_dim/2, attention factor 1), for queries, keys, compressed entries and the
  indexer alike.
- Compressor (ratio r > 0): ``kv = wkv x``, ``gate = wgate x + ape[slot]`` per block
  of r positions; softmax over the slots per channel, weighted sum, ``norm``, RoPE
  at position ``w * r``. r == 4 overlaps: entry w pools block w-1's first halves
  (``[:d]``) and block w's second halves (``[d:]``) over 2r slots; entry 0 has only
  block 0's (empty slots weigh 0, as HF and REF do from an empty cache). Query p
  sees entries w < (p + 1) // r: all of them with r != 4 (HCA), the indexer's top
  ``index_topk`` of them with r == 4 (CSA).
- Indexer: own compressor at ``index_head_dim`` c (overlap, ratio 4);
  ``q = indexer.wq_b(q_norm(wq_a x))`` with RoPE, no norm;
  ``score = sum_h w_h relu(q_h . k) c^-0.5`` with ``w = weights_proj(x)
  index_n_heads^-0.5``; future entries excluded before the top-k. Ties at the
  top-k boundary are resolved to the lower entry index (torch's order is
  unspecified there; ``topk_ties`` reports them).
- MoE: ``scores = sqrtsoftplus(gate x)`` (or sigmoid). Layers below
  ``num_hash_layers`` take experts ``tid2eid[token]``; the others the top-k of
  ``scores + gate.bias``. Weights are the chosen scores normalised (always, as HF and
  REF; ``norm_topk_prob`` is not read), times ``routed_scaling_factor``. Routed and
  shared experts are SwiGLU with ``w1`` (gate) clamped to <= ``swiglu_limit``, ``w3``
  (up) to [-limit, limit].
- MTP layer j (REF ``MTPBlock``): inputs h, the trunk's streams after its last layer
  BEFORE ``hc_head`` (n, hc, D), and the next tokens t.
  ``x = e_proj(enorm(embed[t]))[:, None] + h_proj(hnorm(h))`` (hnorm per stream),
  the embedding of row 0 (position 0) zeroed as the project does for DeepSeek
  (vLLM's convention); a V4 block with layer id ``num_hidden_layers + j``
  (``compress_ratios[L + j]``, router by hash iff L + j < ``num_hash_layers``);
  logits ``head(mtp.j.norm(hc_head_mtp(y)))`` with ``mtp.j.hc_head_*``. Depth j + 1
  takes y (the MTP's streams before its hc_head) as its h.

Where HF and REF differ, this follows HF: no fp8 fake-quant of kv / compressed kv
(REF simulates QAT there), no fp4 fake-quant and no Hadamard rotation of the indexer's
q and keys (orthogonal, it cancels in q . k up to the fp4 rounding). The fp8/fp4
weight formats of the release are not read here (float checkpoints only).
"""

import math

import numpy as np

from .numpy_reference import (
    count_mtp_layers,
    load_checkpoint,
    rmsnorm,
    sigmoid,
    silu,
    softplus,
)

# ---------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg, compressed):
    """(rope_dim / 2,) inverse frequencies of a window-only or a compressed layer."""
    dim = cfg["qk_rope_head_dim"]
    base = cfg["compress_rope_theta"] if compressed else cfg["rope_theta"]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if not compressed or kind == "default":
        return inv
    if kind != "yarn":
        raise NotImplementedError(f"rope_scaling type {kind!r} is not in the reference")
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (
            dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(scaling.get("beta_fast") or 32)), 0)
    high = min(math.ceil(correction_dim(scaling.get("beta_slow") or 1)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_trailing(x, positions, inv_freq, inverse=False):
    """Interleaved RoPE on the trailing 2 * len(inv_freq) dims of x.

    x is (n, ..., d) with row r at ``positions[r]``; ``inverse`` rotates back.
    """
    dims = 2 * len(inv_freq)
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    if inverse:
        angles = -angles
    shape = (len(angles),) + (1,) * (x.ndim - 2) + (dims // 2,)
    cos, sin = np.cos(angles).reshape(shape), np.sin(angles).reshape(shape)
    out = x.copy()
    x1, x2 = x[..., -dims::2], x[..., -dims + 1 :: 2]
    out[..., -dims::2] = x1 * cos - x2 * sin
    out[..., -dims + 1 :: 2] = x2 * cos + x1 * sin
    return out


def unit_rms(x, eps):
    """RMS norm without a weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def softmax(x, axis):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


# ---------------------------------------------------------------------------
# Compressor, indexer, attention


def compress(W, prefix, cfg, x, ratio, dim):
    """Compressed entries (n // ratio, dim), normed and roped at w * ratio."""
    n_blocks = x.shape[0] // ratio
    if n_blocks == 0:
        return np.zeros((0, dim))
    rows = n_blocks * ratio
    kv = (x[:rows] @ W[prefix + "wkv.weight"].T).reshape(n_blocks, ratio, -1)
    gate = (x[:rows] @ W[prefix + "wgate.weight"].T).reshape(n_blocks, ratio, -1)
    gate = gate + W[prefix + "ape"]
    if ratio == 4:  # overlap: [block w-1's first halves | block w's second halves]
        prev_kv = np.concatenate([np.zeros((1, ratio, dim)), kv[:-1, :, :dim]])
        prev_gate = np.concatenate(
            [np.full((1, ratio, dim), -np.inf), gate[:-1, :, :dim]]
        )
        kv = np.concatenate([prev_kv, kv[:, :, dim:]], axis=1)
        gate = np.concatenate([prev_gate, gate[:, :, dim:]], axis=1)
    pooled = (softmax(gate, axis=1) * kv).sum(axis=1)
    normed = rmsnorm(pooled, W[prefix + "norm.weight"], cfg["rms_norm_eps"])
    return rope_trailing(normed, np.arange(n_blocks) * ratio, rope_inv_freq(cfg, True))


def visible_entries(positions, n_entries, ratio):
    """(n, n_entries) booleans: query p sees entry w iff w < (p + 1) // ratio."""
    return (
        np.arange(n_entries)[None, :] < ((np.asarray(positions) + 1) // ratio)[:, None]
    )


def index_scores(W, prefix, cfg, x, q_res, positions):
    """Indexer scores (n, n_entries), future entries at -inf."""
    n, heads, c = x.shape[0], cfg["index_n_heads"], cfg["index_head_dim"]
    keys = compress(W, prefix + "compressor.", cfg, x, 4, c)
    q = (q_res @ W[prefix + "wq_b.weight"].T).reshape(n, heads, c)
    q = rope_trailing(q, positions, rope_inv_freq(cfg, True))
    weights = (x @ W[prefix + "weights_proj.weight"].T) * heads**-0.5  # (n, heads)
    scores = np.maximum(np.einsum("nhc,wc->nhw", q, keys), 0.0) * c**-0.5
    scores = np.einsum("nhw,nh->nw", scores, weights)
    return np.where(visible_entries(positions, len(keys), 4), scores, -np.inf)


def top_k_mask(scores, k):
    """(n, m) booleans: each row's top k finite scores (ties: lower index first)."""
    keep = np.zeros(scores.shape, dtype=bool)
    for row, values in enumerate(scores):
        finite = np.flatnonzero(np.isfinite(values))
        order = finite[np.argsort(-values[finite], kind="stable")]
        keep[row, order[:k]] = True
    return keep


def topk_ties(scores, k):
    """Rows whose k-th and (k+1)-th best finite scores are equal (tie at the cut)."""
    ties = []
    for row, values in enumerate(scores):
        finite = np.sort(values[np.isfinite(values)])[::-1]
        if len(finite) > k and finite[k - 1] == finite[k]:
            ties.append(row)
    return ties


def attention(W, prefix, cfg, layer_id, x, positions, trace=None):
    """V4 attention over one sequence; x (n, D) is the normed sub-layer input.

    ``trace`` (a dict) receives, for layers with compressed entries, the visibility
    mask ``entries_{layer_id}`` and for CSA layers ``index_{layer_id}`` (scores).
    """
    n, heads, d = x.shape[0], cfg["num_attention_heads"], cfg["head_dim"]
    eps, ratio = cfg["rms_norm_eps"], cfg["compress_ratios"][layer_id]
    inv = rope_inv_freq(cfg, ratio > 0)
    q_res = rmsnorm(x @ W[prefix + "wq_a.weight"].T, W[prefix + "q_norm.weight"], eps)
    q = unit_rms((q_res @ W[prefix + "wq_b.weight"].T).reshape(n, heads, d), eps)
    q = rope_trailing(q, positions, inv)
    kv = rmsnorm(x @ W[prefix + "wkv.weight"].T, W[prefix + "kv_norm.weight"], eps)
    kv = rope_trailing(kv, positions, inv)

    qi, ki = np.asarray(positions)[:, None], np.asarray(positions)[None, :]
    allowed = (ki <= qi) & (ki > qi - cfg["sliding_window"])
    keys = kv
    if ratio > 0:
        entries = compress(W, prefix + "compressor.", cfg, x, ratio, d)
        seen = visible_entries(positions, len(entries), ratio)
        if ratio == 4:
            scores = index_scores(W, prefix + "indexer.", cfg, x, q_res, positions)
            seen &= top_k_mask(scores, cfg["index_topk"])
            if trace is not None:
                trace[f"index_{layer_id}"] = scores
        if trace is not None:
            trace[f"entries_{layer_id}"] = seen
        keys = np.concatenate([kv, entries])
        allowed = np.concatenate([allowed, seen], axis=1)

    logits = np.einsum("nhd,kd->hnk", q, keys) * d**-0.5
    logits = np.where(allowed[None], logits, -np.inf)
    sinks = W[prefix + "attn_sink"][:, None, None]
    top = np.maximum(logits.max(axis=-1, keepdims=True), sinks)
    weights = np.exp(logits - top)
    weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sinks - top)
    out = np.einsum("hnk,kd->nhd", weights, keys)
    out = rope_trailing(out, positions, inv, inverse=True)

    groups, rank = cfg["o_groups"], cfg["o_lora_rank"]
    grouped = out.reshape(n, groups, heads * d // groups)
    wo_a = W[prefix + "wo_a.weight"].reshape(groups, rank, -1)
    mixed = np.einsum("ngi,gri->ngr", grouped, wo_a).reshape(n, groups * rank)
    return mixed @ W[prefix + "wo_b.weight"].T


# ---------------------------------------------------------------------------
# MoE


def score_fn(cfg, logits):
    kind = cfg.get("scoring_func", "sqrtsoftplus")
    if kind == "sqrtsoftplus":
        return np.sqrt(softplus(logits))
    if kind == "sigmoid":
        return sigmoid(logits)
    raise NotImplementedError(f"scoring_func {kind!r} is not in the reference")


def swiglu(W, prefix, cfg, x):
    """w2(silu(min(w1 x, L)) * clip(w3 x, -L, L)), L = swiglu_limit."""
    limit = cfg["swiglu_limit"]
    gate = np.minimum(x @ W[prefix + "w1.weight"].T, limit)
    up = np.clip(x @ W[prefix + "w3.weight"].T, -limit, limit)
    return (silu(gate) * up) @ W[prefix + "w2.weight"].T


def route(W, prefix, cfg, layer_id, x, tokens):
    """(experts (n, k), weights (n, k)) of the hash or the biased top-k router."""
    scores = score_fn(cfg, x @ W[prefix + "gate.weight"].T)
    if layer_id < cfg["num_hash_layers"]:
        inds = W[prefix + "gate.tid2eid"][np.asarray(tokens)].astype(np.int64)
    else:
        choice = scores + W[prefix + "gate.bias"]
        inds = np.argsort(-choice, axis=-1, kind="stable")[
            :, : cfg["num_experts_per_tok"]
        ]
    weights = np.take_along_axis(scores, inds, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return inds, weights * cfg["routed_scaling_factor"]


def moe(W, prefix, cfg, layer_id, x, tokens):
    inds, weights = route(W, prefix, cfg, layer_id, x, tokens)
    out = swiglu(W, prefix + "shared_experts.", cfg, x)
    for row in range(x.shape[0]):
        for e, w in zip(inds[row], weights[row]):
            out[row] += w * swiglu(W, f"{prefix}experts.{e}.", cfg, x[row : row + 1])[0]
    return out


# ---------------------------------------------------------------------------
# mHC, blocks, heads


def hc_mix(W, name, cfg, streams):
    """(pre (n, hc), post (n, hc), comb (n, hc, hc)) of one sub-layer's mHC."""
    n, hc = streams.shape[:2]
    eps = cfg["hc_eps"]
    flat = unit_rms(streams.reshape(n, -1), cfg["rms_norm_eps"])
    mix = flat @ W[name + "_fn"].T
    base, scale = W[name + "_base"], W[name + "_scale"]
    pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mix[:, 2 * hc :] * scale[2] + base[2 * hc :]
    comb = softmax(comb.reshape(n, hc, hc), axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return pre, post, comb


def block(W, prefix, cfg, layer_id, streams, tokens, positions, trace=None):
    """One V4 block on streams (n, hc, D)."""
    eps = cfg["rms_norm_eps"]

    def sublayer(site, norm, fn):
        pre, post, comb = hc_mix(W, f"{prefix}hc_{site}", cfg, streams)
        collapsed = np.einsum("nh,nhd->nd", pre, streams)
        out = fn(rmsnorm(collapsed, W[f"{prefix}{norm}.weight"], eps))
        mixed = np.einsum("njk,njd->nkd", comb, streams)
        return post[..., None] * out[:, None, :] + mixed

    streams = sublayer(
        "attn",
        "attn_norm",
        lambda x: attention(W, prefix + "attn.", cfg, layer_id, x, positions, trace),
    )
    return sublayer(
        "ffn", "ffn_norm", lambda x: moe(W, prefix + "ffn.", cfg, layer_id, x, tokens)
    )


def hc_head(W, prefix, cfg, streams):
    """Collapse streams (n, hc, D) to (n, D) with ``{prefix}hc_head_*``."""
    n = streams.shape[0]
    flat = unit_rms(streams.reshape(n, -1), cfg["rms_norm_eps"])
    mix = flat @ W[prefix + "hc_head_fn"].T
    pre = sigmoid(mix * W[prefix + "hc_head_scale"] + W[prefix + "hc_head_base"])
    return np.einsum("nh,nhd->nd", pre + cfg["hc_eps"], streams)


def head_logits(W, prefix, cfg, streams):
    """head(norm(hc_head(streams))) with ``{prefix}norm`` and ``{prefix}hc_head_*``."""
    x = rmsnorm(
        hc_head(W, prefix, cfg, streams), W[prefix + "norm.weight"], cfg["rms_norm_eps"]
    )
    return x @ W["head.weight"].T


def trunk_streams(W, cfg, tokens, trace=None):
    """The trunk's streams (n, hc, D) after its last layer (before hc_head)."""
    tokens = np.asarray(tokens)
    emb = W["embed.weight"][tokens]
    streams = np.repeat(emb[:, None, :], cfg["hc_mult"], axis=1)
    positions = np.arange(len(tokens))
    for i in range(cfg["num_hidden_layers"]):
        streams = block(W, f"layers.{i}.", cfg, i, streams, tokens, positions, trace)
    return streams


def num_mtp_layers(W, cfg):
    """MTP layers ``mtp.{j}.`` present (checked against num_nextn_predict_layers)."""
    return count_mtp_layers(W, cfg, lambda j: f"mtp.{j}.e_proj.weight")


def mtp_streams(W, cfg, j, streams, next_tokens):
    """MTP layer j's streams (m, hc, D) before its hc_head; row i pairs streams[i]
    with next_tokens[i] at position i."""
    prefix, eps = f"mtp.{j}.", cfg["rms_norm_eps"]
    next_tokens = np.asarray(next_tokens)
    emb = W["embed.weight"][next_tokens].copy()
    emb[0] = 0.0  # position 0's embedding is zeroed (MASK_FIRST_POSITION)
    e = rmsnorm(emb, W[prefix + "enorm.weight"], eps) @ W[prefix + "e_proj.weight"].T
    h = (
        rmsnorm(streams, W[prefix + "hnorm.weight"], eps)
        @ W[prefix + "h_proj.weight"].T
    )
    x = e[:, None, :] + h
    layer_id = cfg["num_hidden_layers"] + j
    return block(W, prefix, cfg, layer_id, x, next_tokens, np.arange(len(next_tokens)))


def check_family(config):
    if config.get("model_type") != "deepseek_v4":
        raise NotImplementedError(f"model_type {config.get('model_type')!r} is not V4")


def reference_logits(ckpt_dir, tokens, trace=None):
    """Teacher-forced logits for one sequence t_0..t_{n-1} (same contract as
    ``numpy_reference.reference_logits``).

    Returns (main, mtp): main is (n, V), the trunk logits at each position; mtp[j] is
    (n-1-j, V) for MTP layer j, row i holding the logits for t_{i+j+2}. float64.
    ``trace`` (a dict) collects the trunk's attention visibility and index scores.
    """
    config, W = load_checkpoint(ckpt_dir)
    check_family(config)
    tokens = [int(t) for t in tokens]
    n = len(tokens)
    streams = trunk_streams(W, config, tokens, trace)
    main, mtp = head_logits(W, "", config, streams), []
    for j in range(num_mtp_layers(W, config)):
        rows = n - 1 - j
        if rows <= 0:
            mtp.append(np.zeros((0, main.shape[1])))
            continue
        streams = mtp_streams(W, config, j, streams[:rows], tokens[j + 1 :])
        mtp.append(head_logits(W, f"mtp.{j}.", config, streams))
    return main, mtp

"""Independent float64 numpy reference for Qwen3.8-Flash-Next's text model
(``qwen4_exp``), written from mlx-vlm 0.7.10's ``models/qwen4_exp/language.py`` (with
``models/qwen3_5/language.py`` and ``qwen3_5/gated_delta.py``, their non-kernel
paths, ``models/rope_utils.py`` and ``qwen3_5_moe/language.py``) and
``speculative/drafters/qwen4_exp_mtp``. It must not import mlx. Full sequence,
teacher-forced, no cache, no padding; positions 0..n-1.

The config is ``text_config``; tensors are under ``model.language_model.``,
``lm_head.weight`` at the top, the MTP at top-level ``mtp.``; ``model.visual.*`` is
not read. The PLE's int64 buffers are read as int64 (``layer_multipliers`` need 64
bits). "Zero-centred" norms are RMSNorms applied as ``x_hat * (1 + w)``; "grouped"
ones normalize each stream's H values apart (``rms_norm_eps`` throughout).

- Trunk: the embedding tiled into ``hc_count`` streams S (n, hc, H); per layer, the
  PLE (on the one-indexed ``ple_layer_ids``) added to S, then the attention (Gated
  DeltaNet, or QSA for ``full_attention``) and the MoE, each inside a gated residual;
  at the end the ``hyper_connection_mixer``'s collapse (no final norm), ``lm_head``.
- Gated residual of S: ``N = hc_norm(S)`` (grouped, zero-centred); ``m =
  silu(down(N) / hc)``; the sub-layer reads ``mean_k sigmoid(up(m))_k * N_k``
  (n, H); stream k gets ``+ 2 sigmoid(block_inject(N)_k / hc) * y``. The final mixer
  (no ``block_inject_weight``) returns the collapse only.
- PLE: token history ``[eos] * (ngram_size - 1) + tokens``; ``s_j(p)`` is the token
  j back from p, or eos when that crosses the start of p's segment (a segment ends
  with an eos token, which belongs to it). For the n-gram of length g (2..ngram_size,
  ``heads_per_ngram`` heads each) ``id = (XOR_{j<g} s_j * layer_multipliers[j]) %
  size_h + offset_h`` (int64; sizes and offsets from the checkpoint); the rows of
  the table (shards concatenated in order), concatenated over heads, give e (n, E).
  ``K = norm_key(key_proj e)`` (grouped), ``V = value_proj e`` (n, H), ``Q =
  norm_query(S)`` (grouped); per stream ``g = K_k . Q_k / sqrt(H)``, ``g = sign(g)
  sqrt(max(|g|, 1e-6))``; ``G_k = sigmoid(g) V``; PLE = ``G + silu(conv(norm_conv(G)))``
  with a causal depthwise conv of dilation ``ngram_size`` (zero history).
- Gated DeltaNet (Qwen3.5's): ``q, k, v = silu(causal depthwise conv(in_proj_qkv
  x))``; ``q = l2(q) dk^-0.5``, ``k = l2(k)`` (eps 1e-6 added to the sum of squares);
  ``g = exp(-exp(A_log) softplus(a + dt_bias))``, ``beta = sigmoid(b)``; the delta
  rule from a zero state; ``out_proj(rms(y) w * act(z))`` with the PLAIN weight and
  act = sigmoid for ``output_gate_type`` "sigmoid" (else silu).
- QSA attention (Qwen3.5's gated attention): ``q_proj`` gives per head [q | gate];
  zero-centred ``q_norm``/``k_norm``; RoPE on the first ``head_dim *
  partial_rotary_factor`` dims (rotate-half; M-RoPE with text positions is plain
  RoPE: all three sections read the same position); softmax over the keys the
  indexer allows, scale ``head_dim^-0.5``; ``o_proj(out * sigmoid(gate))``.
- QSA indexer: ``index_qk_proj x`` gives ``indexer_n_heads`` queries (zero-centred
  ``q_layernorm``, RoPE at p) and one raw key per position; block w (positions
  r w..r w + r - 1, r = ``indexer_compress_ratio``) has key ``k_layernorm(mean of
  its raw keys)``, RoPE at position r w. Query p sees c = (p + 1) // r complete
  blocks; when c > ``indexer_budget / r`` (= topk) it attends to the topk blocks by
  ``sum_h relu(q_h . K_w) / sqrt(d)`` plus the partial block r c..p, else to all of
  0..p (causal). Ties at the cut (blocks whose heads all relu to 0 score exactly
  0, frequent with few indexer heads) go to the HIGHER block, as mlx's
  ``argpartition`` breaks them on CPU (``nth_element`` over (value, index)) and
  Metal (a stable argsort); ``reference_logits(..., ties=[])`` lists where they
  occur.
- MoE (Qwen3.5-MoE's): softmax over ``gate``, top ``num_experts_per_tok``,
  renormalized (``norm_topk_prob``); fused experts ``gate_up_proj`` (E, 2I, H: gate
  rows first), ``down_proj``; plus ``sigmoid(shared_expert_gate x) shared_expert(x)``.

MTP (mlx-vlm's ``Qwen4ExpMTPDraftModel``), row i of the n - 1: ``fc_embedding(
pre_fc_norm_embedding(embed t_{i+1}))`` added to each stream k of ``fc_hidden(P_k)``,
where P is ``pre_fc_norm_hidden`` (zero-centred, over all hc * H values, NOT
grouped) of the trunk's streams at row i BEFORE the final mixer; then one QSA/MoE
decoder layer (``mtp.layers.0``, no PLE, its own indexer) at positions 0..n-2, its
own ``mtp.hyper_connection_mixer``, and the trunk's ``lm_head``.
"""

import glob
import os

import numpy as np
from safetensors.numpy import load_file

from .numpy_reference import (
    _load_bf16_safetensors,
    causal_attention,
    causal_depthwise_conv_silu,
    gated_delta_rule,
    gdn_inputs,
    l2_normalize,
    linear,
    load_checkpoint,
    qwen_lm_head,
    qwen_moe,
    rmsnorm,
    rope_rotate_half,
    sigmoid,
    silu,
    softplus,
)

TEXT = "model.language_model."
MTP = "mtp."


def text_config(config):
    """The text model's config with mlx-vlm's defaults (``TextConfig``)."""
    cfg = dict(config.get("text_config") or config)
    n = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(n)
        ]
    cfg["layer_types"] = [
        "full_attention" if t == "qwen_sparse_attention" else t
        for t in cfg["layer_types"]
    ]
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("ple_embed_dim") is None:
        cfg["ple_embed_dim"] = cfg["hidden_size"]
    cfg.setdefault("hc_count", 4)
    cfg.setdefault("ngram_size", 3)
    cfg.setdefault("heads_per_ngram", 8)
    cfg.setdefault("ple_conv_kernel_size", 4)
    cfg.setdefault("indexer_n_heads", 4)
    cfg.setdefault("indexer_kv_heads", 1)
    cfg.setdefault("indexer_head_dim", 128)
    cfg.setdefault("indexer_budget", 2048)
    cfg.setdefault("indexer_compress_ratio", 4)
    cfg.setdefault("output_gate_type", "sigmoid")
    cfg.setdefault("norm_topk_prob", True)
    if cfg["indexer_kv_heads"] != 1:
        raise NotImplementedError("QSA has one indexer key head")
    if cfg.get("ple_storage"):
        raise NotImplementedError("an external PLE table is not in the reference")
    if cfg.get("rope_parameters") is None:
        cfg["rope_parameters"] = {
            "mrope_section": [11, 11, 10],
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
        }
    kind = cfg["rope_parameters"].get(
        "type", cfg["rope_parameters"].get("rope_type", "default")
    )
    if kind != "default":
        raise NotImplementedError(f"rope type {kind!r} is not in the reference")
    return cfg


def load_int_buffers(ckpt_dir):
    """The checkpoint's integer tensors as stored (``load_checkpoint`` makes
    float64 of everything, which rounds the 64-bit n-gram multipliers)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ckpt_dir, "*.safetensors"))):
        try:
            tensors = load_file(path)
        except (TypeError, ValueError):
            tensors = _load_bf16_safetensors(path)
        out.update({k: v for k, v in tensors.items() if v.dtype.kind in "iu"})
    return out


def zc_norm(x, w, eps, group=None):
    """Zero-centred RMSNorm ``x_hat * (1 + w)``, per ``group`` values when given."""
    if group is None:
        return rmsnorm(x, 1.0 + w, eps)
    shape = x.shape
    y = x.reshape(*shape[:-1], -1, group)
    y = rmsnorm(y, 1.0 + w.reshape(-1, group), eps)
    return y.reshape(shape)


# ---------------------------------------------------------------------------
# Gated residuals (hyper-connections)


def hyper_connection(W, prefix, cfg, streams):
    """(collapse (n, H), injection weights (n, hc) or None) of streams (n, hc H)."""
    n = streams.shape[0]
    hc, H = cfg["hc_count"], cfg["hidden_size"]
    normed = zc_norm(streams, W[prefix + ".hc_norm.weight"], cfg["rms_norm_eps"], H)
    mix = silu(linear(W, prefix + ".input_mix_weight_down", normed) / hc)
    up = sigmoid(linear(W, prefix + ".input_mix_weight_up", mix)).reshape(n, hc, H)
    collapse = (up * normed.reshape(n, hc, H)).mean(axis=1)
    if prefix + ".block_inject_weight.weight" not in W:
        return collapse, None
    inject = 2 * sigmoid(linear(W, prefix + ".block_inject_weight", normed) / hc)
    return collapse, inject


def gated_branch(W, prefix, cfg, streams, fn):
    """Streams plus the injected output of ``fn`` on the residual's collapse."""
    n = streams.shape[0]
    collapse, inject = hyper_connection(W, prefix, cfg, streams)
    y = fn(collapse)  # (n, H)
    return streams + (inject[:, :, None] * y[:, None, :]).reshape(n, -1)


# ---------------------------------------------------------------------------
# PLE: hashed n-gram embeddings


def eos_id(cfg):
    eos = cfg["eos_token_id"]
    return int(eos[0] if isinstance(eos, list) else eos)


def ngram_ids(ints, prefix, cfg, tokens):
    """(n, heads) rows of the n-gram table for ``tokens`` (int64 arithmetic)."""
    size, per = cfg["ngram_size"], cfg["heads_per_ngram"]
    eos, ctx = eos_id(cfg), cfg["ngram_size"] - 1
    mult = ints[prefix + ".layer_multipliers"].astype(np.int64)
    sizes = ints[prefix + ".ngram_heads_vocab_sizes"].astype(np.int64)
    offsets = ints[prefix + ".ngram_heads_offsets"].astype(np.int64)
    hist = [eos] * ctx + list(tokens)
    m = len(hist)
    shifted = np.full((size, m), eos, dtype=np.int64)  # shifted[j, p]: s_j(p)
    last_eos = -1  # the last eos strictly before p
    for p in range(m):
        start = last_eos + 1
        for j in range(size):
            if p - start >= j and p - j >= 0:
                shifted[j, p] = hist[p - j]
        if hist[p] == eos:
            last_eos = p
    blocks = []
    with np.errstate(over="ignore"):
        for g in range(2, size + 1):
            mixed = shifted[0] * mult[0]
            for j in range(1, g):
                mixed = np.bitwise_xor(mixed, shifted[j] * mult[j])
            lo = (g - 2) * per
            s, o = sizes[lo : lo + per], offsets[lo : lo + per]
            blocks.append(np.mod(mixed[:, None], s[None]) + o[None])
    return np.concatenate(blocks, axis=-1)[ctx:]


def ngram_table(W, prefix):
    """The n-gram table: its row shards ``shard_{i}`` concatenated in order."""
    head = prefix + ".ngram_embedding.shard_"
    count = sum(1 for k in W if k.startswith(head))
    return np.concatenate([W[f"{head}{i}.weight"] for i in range(count)], axis=0)


def dilated_conv_silu(x, w, dilation):
    """silu of a causal depthwise conv1d of x (n, C) with taps w (C, 1, K) spaced
    ``dilation`` apart, zero history: ``out[t] = sum_k w[k] x[t - (K-1-k) d]``."""
    n, kernel = x.shape[0], w.shape[-1]
    pad = (kernel - 1) * dilation
    padded = np.concatenate([np.zeros((pad, x.shape[1])), x], axis=0)
    out = np.zeros_like(x)
    for k in range(kernel):
        out += padded[k * dilation : k * dilation + n] * w[:, 0, k]
    return silu(out)


def ple(W, ints, prefix, cfg, streams, tokens):
    """The PLE's addition to the streams (n, hc H)."""
    n, hc, H = streams.shape[0], cfg["hc_count"], cfg["hidden_size"]
    eps = cfg["rms_norm_eps"]
    ids = ngram_ids(ints, prefix + ".ple_embedding", cfg, tokens)
    table = ngram_table(W, prefix + ".ple_embedding")
    emb = table[ids].reshape(n, -1)  # (n, E)
    keys = zc_norm(
        linear(W, prefix + ".key_proj", emb), W[prefix + ".norm_key.weight"], eps, H
    )
    values = linear(W, prefix + ".value_proj", emb)  # (n, H)
    queries = zc_norm(streams, W[prefix + ".norm_query.weight"], eps, H)
    gate = (keys.reshape(n, hc, H) * queries.reshape(n, hc, H)).sum(-1) / np.sqrt(H)
    gate = np.sign(gate) * np.sqrt(np.maximum(np.abs(gate), 1e-6))
    gated = (sigmoid(gate)[:, :, None] * values[:, None, :]).reshape(n, hc * H)
    normed = zc_norm(gated, W[prefix + ".norm_conv.weight"], eps, H)
    conv = dilated_conv_silu(normed, W[prefix + ".conv1d.weight"], cfg["ngram_size"])
    return gated + conv


# ---------------------------------------------------------------------------
# Gated DeltaNet


def gated_deltanet(W, prefix, cfg, x):
    """Qwen3.5's Gated DeltaNet with Qwen4-Exp's output gate (module docstring)."""
    n = x.shape[0]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    mixed_qkv, z, b, a = gdn_inputs(W, prefix, cfg, "qwen3_5", x)
    conv = causal_depthwise_conv_silu(mixed_qkv, W[prefix + ".conv1d.weight"])
    key_dim = nk * dk
    q = conv[:, :key_dim].reshape(n, nk, dk)
    k = conv[:, key_dim : 2 * key_dim].reshape(n, nk, dk)
    v = conv[:, 2 * key_dim :].reshape(n, nv, dv)
    q = l2_normalize(q) * dk**-0.5
    k = l2_normalize(k)
    g = np.exp(-np.exp(W[prefix + ".A_log"]) * softplus(a + W[prefix + ".dt_bias"]))
    y = gated_delta_rule(q, k, v, g, sigmoid(b))  # (n, Hv, Dv)
    act = sigmoid if cfg["output_gate_type"] == "sigmoid" else silu
    y = rmsnorm(y, W[prefix + ".norm.weight"], cfg["rms_norm_eps"]) * act(z)
    return linear(W, prefix + ".out_proj", y.reshape(n, nv * dv))


# ---------------------------------------------------------------------------
# QSA: the block indexer and the gated attention


def rope_of(cfg):
    """(rotated dims, base) of the attention's (and its indexer's) RoPE."""
    params = cfg["rope_parameters"]
    dims = int(cfg["head_dim"] * params["partial_rotary_factor"])
    return dims, params["rope_theta"]


def qsa_selection(W, prefix, cfg, x, ties=None):
    """(n, n) booleans: the keys each query attends to (module docstring)."""
    n, eps = x.shape[0], cfg["rms_norm_eps"]
    heads, d = cfg["indexer_n_heads"], cfg["indexer_head_dim"]
    r = cfg["indexer_compress_ratio"]
    topk = cfg["indexer_budget"] // r
    dims, base = rope_of(cfg)
    positions = np.arange(n)
    qk = linear(W, prefix + ".index_qk_proj", x).reshape(n, heads + 1, d)
    q = zc_norm(qk[:, :heads], W[prefix + ".q_layernorm.weight"], eps)
    q = rope_rotate_half(q.transpose(1, 0, 2), positions, dims, base)  # (h, n, d)
    blocks = n // r
    raw = qk[: blocks * r, heads].reshape(blocks, r, d).mean(axis=1)
    keys = zc_norm(raw, W[prefix + ".k_layernorm.weight"], eps)
    keys = rope_rotate_half(keys, np.arange(blocks) * r, dims, base)  # (blocks, d)
    scores = np.maximum(q @ keys.T, 0.0).sum(axis=0) / np.sqrt(d)  # (n, blocks)

    allowed = np.tril(np.ones((n, n), dtype=bool))
    for p in range(n):
        c = (p + 1) // r
        if c <= topk:
            continue
        # best first; equal scores: the higher block first (mlx's argpartition)
        order = np.lexsort((-np.arange(c), -scores[p, :c]))
        if ties is not None and scores[p, order[topk - 1]] == scores[p, order[topk]]:
            ties.append((prefix, p))
        allowed[p] = False
        for w in order[:topk]:
            allowed[p, w * r : (w + 1) * r] = True
        allowed[p, c * r : p + 1] = True
    return allowed


def qsa_attention(W, prefix, cfg, x, ties=None):
    """Qwen3.5's gated attention restricted to the indexer's selection."""
    n, eps = x.shape[0], cfg["rms_norm_eps"]
    n_heads, n_kv, hd = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    q_gate = linear(W, prefix + ".q_proj", x).reshape(n, n_heads, 2 * hd)
    q, gate = q_gate[..., :hd], q_gate[..., hd:].reshape(n, n_heads * hd)
    k = linear(W, prefix + ".k_proj", x).reshape(n, n_kv, hd)
    v = linear(W, prefix + ".v_proj", x).reshape(n, n_kv, hd)
    q = zc_norm(q, W[prefix + ".q_norm.weight"], eps)
    k = zc_norm(k, W[prefix + ".k_norm.weight"], eps)
    q, k, v = (t.transpose(1, 0, 2) for t in (q, k, v))  # (heads, n, hd)
    dims, base = rope_of(cfg)
    positions = np.arange(n)
    q = rope_rotate_half(q, positions, dims, base)
    k = rope_rotate_half(k, positions, dims, base)
    allowed = qsa_selection(W, prefix + ".indexer", cfg, x, ties)
    out = causal_attention(q, k, v, hd**-0.5, allowed)
    return linear(W, prefix + ".o_proj", out * sigmoid(gate))


# ---------------------------------------------------------------------------
# Decoder layers, trunk and MTP


def decoder_layer(W, ints, prefix, cfg, linear_attn, streams, tokens, ties=None):
    """One Qwen4-Exp layer over streams (n, hc H): PLE, attention, MoE."""
    if prefix + ".ple.key_proj.weight" in W:
        streams = streams + ple(W, ints, prefix + ".ple", cfg, streams, tokens)
    if linear_attn:
        attn = lambda h: gated_deltanet(
            W, prefix + ".linear_attn", cfg, h
        )  # noqa: E731
    else:
        attn = lambda h: qsa_attention(  # noqa: E731
            W, prefix + ".self_attn", cfg, h, ties
        )
    streams = gated_branch(W, prefix + ".attn_hyper_connection", cfg, streams, attn)
    moe = lambda h: qwen_moe(W, prefix + ".mlp", cfg, "qwen3_5_moe", h)  # noqa: E731
    return gated_branch(W, prefix + ".mlp_hyper_connection", cfg, streams, moe)


def trunk_streams(W, ints, cfg, tokens, ties=None):
    """The streams (n, hc H) after the last layer, before the final mixer."""
    x = W[TEXT + "embed_tokens.weight"][np.asarray(tokens)]
    streams = np.tile(x, (1, cfg["hc_count"]))
    for i, kind in enumerate(cfg["layer_types"]):
        streams = decoder_layer(
            W,
            ints,
            f"{TEXT}layers.{i}",
            cfg,
            kind == "linear_attention",
            streams,
            tokens,
            ties,
        )
    return streams


def num_mtp_layers(W, config, cfg):
    """MTP layers at ``mtp.layers.{j}`` (checked against the config); mlx-vlm's
    drafter has one."""
    count = 0
    while f"{MTP}layers.{count}.mlp.gate.weight" in W:
        count += 1
    declared = cfg.get("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers"))
    if count and declared is not None and declared != count:
        raise ValueError(
            f"config declares {declared} MTP layers, checkpoint has {count}"
        )
    if count > 1:
        raise NotImplementedError("mlx-vlm's Qwen4-Exp drafter has one MTP layer")
    return count


def mtp_streams(W, cfg, streams, next_tokens, ties=None):
    """The MTP layer's output streams (m, hc H) over rows 0..m-1 (trunk streams
    ``streams`` (m, hc H) before the mixer, ``next_tokens[i]`` with row i)."""
    m, hc, H = streams.shape[0], cfg["hc_count"], cfg["hidden_size"]
    eps = cfg["rms_norm_eps"]
    emb = W[TEXT + "embed_tokens.weight"][np.asarray(next_tokens)]
    e = linear(
        W,
        MTP + "fc_embedding",
        zc_norm(emb, W[MTP + "pre_fc_norm_embedding.weight"], eps),
    )
    h = zc_norm(streams, W[MTP + "pre_fc_norm_hidden.weight"], eps).reshape(m, hc, H)
    h = linear(W, MTP + "fc_hidden", h)  # per stream
    x = (e[:, None, :] + h).reshape(m, hc * H)
    return decoder_layer(W, {}, MTP + "layers.0", cfg, False, x, next_tokens, ties)


def reference_logits(ckpt_dir, tokens, ties=None):
    """Teacher-forced logits for one sequence (the contract of
    ``numpy_reference.reference_logits``): main (n, V); mtp[0] (n-1, V), row i the
    logits for t_{i+2}. ``ties`` (a list) collects (indexer, query) pairs whose
    block scores tie at the top-k cut."""
    config, W = load_checkpoint(ckpt_dir)
    if config.get("model_type") not in ("qwen4_exp", "qwen4_exp_text"):
        raise NotImplementedError(f"model_type {config.get('model_type')!r}")
    cfg = text_config(config)
    ints = load_int_buffers(ckpt_dir)
    tokens = [int(t) for t in tokens]
    head = qwen_lm_head(W, cfg, "qwen3_5")
    streams = trunk_streams(W, ints, cfg, tokens, ties)
    mixed, _ = hyper_connection(W, TEXT + "hyper_connection_mixer", cfg, streams)
    n, main, mtp = len(tokens), mixed @ head.T, []
    for _ in range(num_mtp_layers(W, config, cfg)):
        if n <= 1:
            mtp.append(np.zeros((0, head.shape[0])))
            continue
        z = mtp_streams(W, cfg, streams[: n - 1], tokens[1:], ties)
        mixed, _ = hyper_connection(W, MTP + "hyper_connection_mixer", cfg, z)
        mtp.append(mixed @ head.T)
    return main, mtp

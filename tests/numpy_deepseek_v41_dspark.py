"""Independent float64 numpy reference for one block of DeepSeek-V4.1's DSpark drafter
(``mtp.{0,1,2}``), from its released tensors and DeepSeek's V4.1 inference code
(``inference/model.py``: ``DSparkBlock``, ``DSparkAttention``, ``Block.forward``,
``forward_head``; ``/work/notes/dspark_spec.md`` §2), not from this project's MLX
code; it must not import mlx or mlx_lm. The taps (the target layers' inputs, averaged
over the streams) are given.

    main_x = main_norm(main_proj(taps))                      stage 0's, for every stage
    ctx_j = fp8(rope(kv_norm_j(wkv_j(main_x)), 0..p-1))[-window:]
    x = embed([a, M, ..., M]) in hc streams, pre = onehot(0)  positions p..p+gamma-1
    per stage: (a_pre, a_post, a_comb) = hc_attn(s)
               s = a_post attn(norm(pre . s)) + a_comb s
               (f_pre, f_post, f_comb) = hc_ffn(s)
               s = f_post moe(norm(a_pre . s)) + f_comb s;  pre = f_pre
    x = pre . s;  z = head(norm(x));  l_k = z_k + W2 W1[prev_k]
    c_k = proj([x_k ; W1[prev_k]])                            the confidence logits

attn: ``q = wq_b(q_norm(wq_a h))`` (no per-head norm, unlike V4), RoPE on the trailing
``qk_rope_head_dim`` dims (interleaved, ``rope_theta``, no YaRN: the stages' compress
ratio is 0); block K = V rows as the context's; softmax over [ctx ; block] with the
head's sink in the denominator, no mask; output RoPE undone, grouped ``wo_a``,
``wo_b``. ``fp8`` is the reference's ``act_quant`` round trip (e4m3, a power-of-two
scale per 32 values). The MoE routes with the ``dspark_*`` expert counts.
"""

import numpy as np

from .numpy_deepseek_v4 import hc_mix, moe, rope_inv_freq, rope_trailing
from .numpy_reference import load_checkpoint, rmsnorm


def fp8_round(x, block=32):
    """The FP8 e4m3 round trip with a power-of-two scale per ``block`` values."""
    shape = x.shape
    b = x.reshape(*shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(axis=-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    y = np.clip(b / scale, -448.0, 448.0)
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(y))), -6.0)  # subnormals
    quantum = 2.0 ** (exponent - 3)  # 3 mantissa bits
    return (np.round(y / quantum) * quantum * scale).reshape(shape)


def stage_kv(W, prefix, cfg, x, positions):
    """A stage's K = V rows of x (n, D) at ``positions``."""
    kv = rmsnorm(
        x @ W[prefix + "wkv.weight"].T,
        W[prefix + "kv_norm.weight"],
        cfg["rms_norm_eps"],
    )
    return fp8_round(rope_trailing(kv, positions, rope_inv_freq(cfg, False)))


def stage_attention(W, prefix, cfg, x, context, positions):
    """The block rows x (n, D) over [context (T, d) ; their own K = V rows]."""
    n, heads, d = x.shape[0], cfg["num_attention_heads"], cfg["head_dim"]
    inv, eps = rope_inv_freq(cfg, False), cfg["rms_norm_eps"]
    q_res = rmsnorm(x @ W[prefix + "wq_a.weight"].T, W[prefix + "q_norm.weight"], eps)
    q = rope_trailing(
        (q_res @ W[prefix + "wq_b.weight"].T).reshape(n, heads, d), positions, inv
    )
    keys = np.concatenate([context, stage_kv(W, prefix, cfg, x, positions)])
    logits = np.einsum("nhd,kd->hnk", q, keys) * d**-0.5
    sinks = W[prefix + "attn_sink"][:, None, None]
    top = np.maximum(logits.max(axis=-1, keepdims=True), sinks)
    weights = np.exp(logits - top)
    weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sinks - top)
    out = rope_trailing(
        np.einsum("hnk,kd->nhd", weights, keys), positions, inv, inverse=True
    )
    groups, rank = cfg["o_groups"], cfg["o_lora_rank"]
    grouped = out.reshape(n, groups, heads * d // groups)
    wo_a = W[prefix + "wo_a.weight"].reshape(groups, rank, -1)
    mixed = np.einsum("ngi,gri->ngr", grouped, wo_a).reshape(n, groups * rank)
    return mixed @ W[prefix + "wo_b.weight"].T


def stage(W, prefix, cfg, streams, pre_mix, context, positions):
    """One stage on streams (n, hc, D) collapsed for attention by ``pre_mix``
    (n, hc); returns the new streams and the FFN's pre-mix for the next stage."""
    eps = cfg["rms_norm_eps"]

    def expand(out, post, comb, s):
        return post[..., None] * out[:, None, :] + np.einsum("njk,njd->nkd", comb, s)

    a_pre, a_post, a_comb = hc_mix(W, prefix + "hc_attn", cfg, streams)
    h = rmsnorm(
        np.einsum("nh,nhd->nd", pre_mix, streams), W[prefix + "attn_norm.weight"], eps
    )
    h = stage_attention(W, prefix + "attn.", cfg, h, context, positions)
    streams = expand(h, a_post, a_comb, streams)
    f_pre, f_post, f_comb = hc_mix(W, prefix + "hc_ffn", cfg, streams)
    h = rmsnorm(
        np.einsum("nh,nhd->nd", a_pre, streams), W[prefix + "ffn_norm.weight"], eps
    )
    moe_cfg = {
        **cfg,
        "num_hash_layers": 0,
        "num_experts_per_tok": cfg["dspark_num_experts_per_tok"],
    }
    h = moe(W, prefix + "ffn.", moe_cfg, cfg["num_hidden_layers"], h, None)
    return expand(h, f_post, f_comb, streams), f_pre


def dspark_block(ckpt_dir, taps, anchor, drafts):
    """Slot logits of one block after context ``taps`` (p, n H) (positions
    0..p-1), anchor at p: ``(gamma, V)`` base logits z, the Markov-corrected logits
    of each slot given the tokens ``drafts`` drawn before it, and ``(gamma,)``
    confidence logits ``proj([x ; W1[prev]])`` of the collapses x before ``norm``."""
    config, W = load_checkpoint(ckpt_dir)
    cfg = config.get("text_config", config)
    eps, p, gamma = cfg["rms_norm_eps"], len(taps), cfg["dspark_block_size"]
    stages, hc = cfg["num_nextn_predict_layers"], cfg["hc_mult"]
    main_x = rmsnorm(
        taps @ W["mtp.0.main_proj.weight"].T, W["mtp.0.main_norm.weight"], eps
    )
    ids = [anchor] + [cfg["dspark_noise_token_id"]] * (gamma - 1)
    streams = np.repeat(W["embed.weight"][ids][:, None, :], hc, axis=1)
    pre_mix = np.zeros((gamma, hc))
    pre_mix[:, 0] = 1.0
    positions = p + np.arange(gamma)
    for j in range(stages):
        prefix = f"mtp.{j}."
        context = stage_kv(W, prefix + "attn.", cfg, main_x, np.arange(p))
        context = context[-cfg["sliding_window"] :]
        streams, pre_mix = stage(W, prefix, cfg, streams, pre_mix, context, positions)
    last = f"mtp.{stages - 1}."
    x = np.einsum("nh,nhd->nd", pre_mix, streams)
    z = rmsnorm(x, W[last + "norm.weight"], eps) @ W["head.weight"].T
    prev = [anchor] + list(drafts[: gamma - 1])
    w1 = W[last + "markov_head.embed.weight"]
    w2 = W[last + "markov_head.head.weight"]
    features = np.concatenate([x, w1[prev]], axis=-1)
    confidence = features @ W[last + "confidence_head.proj.weight"][0]
    return z, z + w1[prev] @ w2.T, confidence

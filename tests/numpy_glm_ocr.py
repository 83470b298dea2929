"""Independent numpy forward pass of GLM-OCR's text model and MTP layer, written from
transformers' ``modeling_glm_ocr`` (the text model) and vLLM's ``glm_ocr_mtp`` (the
MTP layer, DeepSeek's fusion), from the raw Hugging Face checkpoint.

- every layer: ``x + post_self_attn_norm(attn(input_norm(x)))``, then
  ``x + post_mlp_norm(mlp(post_attention_norm(x)))``; the MLP's ``gate_up_proj``
  is ``[gate; up]``;
- M-RoPE: the ``head_dim / 2`` frequencies in ``mrope_section`` runs, run k reading
  position axis k (temporal, height, width), each frequency rotating an adjacent
  pair of dimensions (transformers' ``recomposition_frequencies`` and
  ``rotate_half_llm``);
- positions: text tokens advance all three axes together; an image of t x h x w
  patches merged by m takes ``t*h*w / m**2`` placeholders at (start, start + row,
  start + column), and the text after it starts at ``start + max(h, w) / m``
  (transformers' ``get_rope_index``);
- the MTP layer at row i reads the hidden state at i and the (merged) embedding of
  token i+1, at row i's position, the embedding of row 0 zeroed.
"""

import numpy as np

from .numpy_reference import causal_attention, linear, load_checkpoint, rmsnorm, silu

BASE = "model.language_model."


def mrope(x, positions, sections, base):
    """x ``(heads, n, d)`` rotated at ``positions`` ``(3, n)``."""
    d = x.shape[-1]
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    axis = np.concatenate([np.full(s, k % 3) for k, s in enumerate(sections)])
    pos = np.asarray(positions, dtype=np.float64)[axis]  # (d/2, n)
    ang = pos.T * inv_freq  # (n, d/2)
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def attention(W, prefix, cfg, x, positions):
    n, d = x.shape[0], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg["rope_parameters"]
    q = linear(W, prefix + "self_attn.q_proj", x).reshape(n, heads, d)
    k = linear(W, prefix + "self_attn.k_proj", x).reshape(n, kv, d)
    v = linear(W, prefix + "self_attn.v_proj", x).reshape(n, kv, d)
    q, k, v = (a.transpose(1, 0, 2) for a in (q, k, v))
    sections, theta = rope["mrope_section"], rope["rope_theta"]
    q, k = mrope(q, positions, sections, theta), mrope(k, positions, sections, theta)
    out = causal_attention(q, k, v, d**-0.5)
    return linear(W, prefix + "self_attn.o_proj", out)


def layer(W, prefix, cfg, x, positions):
    eps = cfg["rms_norm_eps"]
    a = attention(
        W, prefix, cfg, rmsnorm(x, W[prefix + "input_layernorm.weight"], eps), positions
    )
    x = x + rmsnorm(a, W[prefix + "post_self_attn_layernorm.weight"], eps)
    h = rmsnorm(x, W[prefix + "post_attention_layernorm.weight"], eps)
    gate, up = np.split(linear(W, prefix + "mlp.gate_up_proj", h), 2, axis=-1)
    m = linear(W, prefix + "mlp.down_proj", silu(gate) * up)
    return x + rmsnorm(m, W[prefix + "post_mlp_layernorm.weight"], eps)


def rope_index(tokens, config, grids):
    """``(3, n)`` positions of ``tokens`` whose image placeholders hold images of
    patch grids ``grids`` ((t, h, w) each), and the delta of the text after."""
    merge = config["vision_config"]["spatial_merge_size"]
    image = config["image_token_id"]
    out, pos, i, g = [], 0, 0, iter(grids)
    while i < len(tokens):
        if tokens[i] != image:
            out.append([pos] * 3)
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(g)
        assert t == 1, "an image is one frame"
        hm, wm = h // merge, w // merge
        out += [[pos, pos + r, pos + c] for r in range(hm) for c in range(wm)]
        i += hm * wm
        pos += max(hm, wm)
    positions = np.array(out, dtype=np.int64).T
    return positions, int(positions.max()) + 1 - len(tokens)


def forward(ckpt_dir, tokens, positions=None, features=None):
    """Teacher-forced ``(main, [mtp])`` logits (float64) of ``tokens``: main
    ``(n, V)``; mtp ``(n - 1, V)``, row i predicting token i + 2.

    Args:
        positions: ``(3, n)`` M-RoPE positions (default: the indices, text only).
        features: ``(n_image, H)`` embeddings of the image placeholders, in order.
    """
    config, W = load_checkpoint(ckpt_dir)
    cfg = config["text_config"]
    n, L, eps = len(tokens), cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    if positions is None:
        positions = np.broadcast_to(np.arange(n), (3, n))
    emb = W[BASE + "embed_tokens.weight"][np.asarray(tokens)].astype(np.float64)
    if features is not None:
        emb[np.asarray(tokens) == config["image_token_id"]] = features
    x = emb
    for i in range(L):
        x = layer(W, f"{BASE}layers.{i}.", cfg, x, positions)
    h = rmsnorm(x, W[BASE + "norm.weight"], eps)
    head = W["lm_head.weight"]
    p = f"{BASE}layers.{L}."
    e = emb[1:].copy()
    e[0] = 0.0  # vLLM zeroes the MTP embedding at position 0
    fused = np.concatenate(
        [
            rmsnorm(e, W[p + "enorm.weight"], eps),
            rmsnorm(h[:-1], W[p + "hnorm.weight"], eps),
        ],
        axis=-1,
    )
    y = layer(W, p, cfg, linear(W, p + "eh_proj", fused), positions[:, :-1])
    z = rmsnorm(y, W[p + "shared_head.norm.weight"], eps)
    return h @ head.T, [z @ head.T]


def reference_logits(ckpt_dir, tokens):
    return forward(ckpt_dir, [int(t) for t in tokens])

"""Independent numpy forward pass of Qwen3.5's text model and MTP layer over a prompt
with images, from the raw Hugging Face checkpoint: the trunk and MTP layer of
`numpy_reference` (Gated-DeltaNet and gated attention, the Qwen MTP fusion), with

- the image placeholders' embeddings replaced by the vision tower's features
  (transformers' ``Qwen3_5Model``: ``masked_scatter`` of the image embeddings);
- interleaved M-RoPE in the full-attention layers at ``(3, n)`` positions
  (`numpy_reference.mrope_rotate_half`), positions as `numpy_glm_ocr.rope_index`
  places them (transformers' ``get_rope_index``: the same rule for Qwen3-VL);
- the MTP layer at row i reading the hidden state at i and the merged embedding of
  token i+1, at token i's position (vLLM's ``Qwen3_5MTP``, which is multimodal).
"""

import numpy as np

from .numpy_reference import (
    linear,
    load_checkpoint,
    qwen_decoder_layer,
    qwen_lm_head,
    rmsnorm_shifted,
)

BASE = "model.language_model."
FAMILY = "qwen3_5"


def forward(ckpt_dir, tokens, positions, features):
    """Teacher-forced ``(main, mtp)`` logits (float64) of ``tokens``: main
    ``(n, V)``; mtp ``(n - 1, V)``, row i predicting token i + 2.

    Args:
        positions: ``(3, n)`` M-RoPE positions.
        features: ``(n_image, H)`` embeddings of the image placeholders, in order
            (None: the placeholder token's own embedding, a control).
    """
    config, W = load_checkpoint(ckpt_dir)
    cfg = config["text_config"]
    eps, interval = cfg["rms_norm_eps"], cfg.get("full_attention_interval", 4)
    tokens = np.asarray(tokens)
    emb = W[BASE + "embed_tokens.weight"][tokens].astype(np.float64)
    if features is not None:
        emb[tokens == config["image_token_id"]] = features
    x = emb
    for i in range(cfg["num_hidden_layers"]):
        linear_attn = (i + 1) % interval != 0
        x = qwen_decoder_layer(
            W, f"{BASE}layers.{i}", cfg, FAMILY, i, x, positions, linear_attn
        )
    h = rmsnorm_shifted(x, W[BASE + "norm.weight"], eps)
    head = qwen_lm_head(W, cfg, FAMILY)
    fused = np.concatenate(
        [
            rmsnorm_shifted(emb[1:], W["mtp.pre_fc_norm_embedding.weight"], eps),
            rmsnorm_shifted(h[:-1], W["mtp.pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    y = qwen_decoder_layer(
        W,
        "mtp.layers.0",
        cfg,
        FAMILY,
        0,
        linear(W, "mtp.fc", fused),
        positions[:, :-1],
        linear_attn=False,
    )
    z = rmsnorm_shifted(y, W["mtp.norm.weight"], eps)
    return h @ head.T, z @ head.T

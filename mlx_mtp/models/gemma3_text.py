"""Gemma 3 text models (``gemma3_text``) with retrofitted MTP heads (`retrofit`).

Gemma 3 interleaves sliding-window layers (window ``sliding_window``) with a
full-attention layer every ``sliding_window_pattern`` layers; mlx-lm caches the former
in a ``RotatingKVCache``, which the decode loop turns into an exact `WindowCache`.
The trunk scales its embeddings by sqrt(hidden_size) inside; the MTP layer takes the
unscaled embedding, as `train-heads` trains it.
"""

from .retrofit import (  # noqa: F401  (the family interface)
    LAYOUT,
    MTP_CONFIG_KEYS,
    declared_mtp_layers,
    make_layer,
    mtp_layer_of,
    sanitize,
    split_weights,
)

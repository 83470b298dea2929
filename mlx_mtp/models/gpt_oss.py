"""gpt-oss (``gpt_oss``) with retrofitted MTP heads (`retrofit`).

gpt-oss alternates sliding-window layers (window ``sliding_window``) with full
attention (``layer_types``), each with learned attention sinks, and an MoE MLP; mlx-lm
caches the sliding layers in a ``RotatingKVCache``, which the decode loop turns into
an exact `WindowCache`.
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

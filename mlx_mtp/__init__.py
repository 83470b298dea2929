"""mlx-mtp: multi-token-prediction speculative decoding on MLX.

from mlx_mtp import load, generate
model, tokenizer = load("path/or/hf-repo")
text = generate(model, tokenizer, "Hello", max_tokens=64)

The names below are imported on first use, so that ``mlx-mtp`` starts (and answers
Ctrl-C) before MLX and transformers are loaded.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DecodeOptions": ".options",
    "DraftPolicy": ".draft_length",
    "GenerationResponse": ".generate",
    "MTPError": ".errors",
    "MTPStats": ".stats",
    "Session": ".speculative",
    "generate": ".generate",
    "load": ".loading",
    "stream_generate": ".generate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlx_mtp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)

"""mlx-mtp: multi-token-prediction speculative decoding on MLX.

from mlx_mtp import load, generate
model, tokenizer = load("path/or/hf-repo")
text = generate(model, tokenizer, "Hello", max_tokens=64)
"""

__version__ = "0.1.0"

from .errors import MTPError
from .generate import GenerationResponse, generate, stream_generate
from .loading import load
from .speculative import MTPStats, Session

__all__ = [
    "GenerationResponse",
    "MTPError",
    "MTPStats",
    "Session",
    "generate",
    "load",
    "stream_generate",
]

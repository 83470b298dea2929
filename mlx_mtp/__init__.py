"""mlx-mtp: multi-token-prediction speculative decoding on MLX.

from mlx_mtp import load, generate
model, tokenizer = load("path/or/hf-repo")
text = generate(model, tokenizer, "Hello", max_tokens=64)

The names below are imported on first use, so that ``mlx-mtp`` starts (and answers
Ctrl-C) before MLX and transformers are loaded.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

_EXPORTS = {
    "DecodeOptions": ".options",
    "BatchResponse": ".generate",
    "DraftPolicy": ".draft_length",
    "GenerationResponse": ".generate",
    "MTPError": ".errors",
    "MTPStats": ".stats",
    "Session": ".speculative",
    "batch_generate": ".generate",
    "generate": ".generate",
    "load": ".loading",
    "stream_generate": ".generate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlx_mtp' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name], __name__)
    for export, where in _EXPORTS.items():  # all of them: importing ``.generate``
        if where == _EXPORTS[name]:  # set the package's ``generate`` to the module
            globals()[export] = getattr(module, export)
    return globals()[name]


def __dir__():
    return sorted(list(globals()) + __all__)


class _Package(types.ModuleType):
    """The package, whose ``generate`` stays the function: importing the submodule
    ``mlx_mtp.generate`` (``from mlx_mtp.generate import stream_generate``) would
    otherwise bind the package's ``generate`` to the module, as mlx-lm's is not."""

    def __setattr__(self, name, value):
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{__name__}.{name}"
        ):
            if _EXPORTS.get(name) == f".{name}":
                value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

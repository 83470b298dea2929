"""Trunks from mlx-vlm, for the families mlx-lm has no text model for (Hy4, ...).

mlx-vlm is an optional dependency (the extra ``mlx-mtp[vlm]``), imported only when a
checkpoint of such a family is loaded: a user without it gets one line naming the
extra. The release is pinned (`RELEASES`), and each family module declares the
mlx-vlm members it relies on with their parameters, checked when it is first
imported (`need`), as the server checks mlx-lm's.
"""

import importlib
from typing import Sequence, Tuple

from ..errors import MTPError
from ..private import check_private

# The mlx-vlm releases whose model code the families here were written against.
RELEASES = ("0.7.10",)
EXTRA = "pip install 'mlx-mtp[vlm]'"


def need(module: str, what: str, declared: Sequence[Tuple[str, str]] = ()) -> object:
    """mlx-vlm's ``module`` (dotted, under ``mlx_vlm``), its ``declared`` members
    (dotted names with their parameters) checked.

    Raises:
        MTPError: mlx-vlm is not installed, is not a pinned release, or lacks a
            declared member or has it with other parameters (one line naming
            ``what`` needs it and how to install it).
    """
    try:
        found = importlib.import_module(f"mlx_vlm.{module}")
    except ImportError as e:
        if (e.name or "").split(".")[0] != "mlx_vlm":
            raise MTPError(
                f"{what} needs mlx-vlm, which cannot be imported ({e}): {EXTRA}"
            ) from None
        raise MTPError(f"{what} needs mlx-vlm: {EXTRA}") from None
    version = _version()
    if version not in RELEASES:
        raise MTPError(
            f"{what} needs mlx-vlm {' or '.join(RELEASES)}, not {version}: {EXTRA}"
        )
    check_private(
        found,
        declared,
        f"mlx_vlm.{module}",
        f"{what} needs mlx-vlm {' or '.join(RELEASES)}",
        package="mlx-vlm",
        version=version,
    )
    return found


def text_config(config: dict) -> dict:
    """A vision-language config's text model config (``text_config``; a flat
    config as it is)."""
    return config.get("text_config") or config


def text_args(base: type) -> type:
    """``base`` (an mlx-vlm text config class) read from a vision-language
    config's ``text_config`` (`text_config`)."""

    class TextArgs(base):
        @classmethod
        def from_dict(cls, params: dict):
            return super().from_dict(text_config(params))

    TextArgs.__name__ = TextArgs.__qualname__ = base.__name__
    TextArgs.__doc__ = f"mlx-vlm's ``{base.__name__}``, read from ``text_config``."
    return TextArgs


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-vlm")
    except PackageNotFoundError:  # on the path without its metadata
        import mlx_vlm

        return getattr(mlx_vlm, "__version__", "?")

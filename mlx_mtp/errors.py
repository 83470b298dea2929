"""Errors that mlx-mtp raises for bad input.

Every error a user can cause (bad paths, bad checkpoints, bad flags, bad prompts) is an
`MTPError`, so the CLI can print it as one line and exit non-zero without a traceback.
"""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line: lines joined (a message that ends in ':'
    before a list keeps its list), cut at ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


class MTPError(ValueError):
    """A clear, user-facing error: the message is the whole story."""


class UnsupportedModelError(MTPError):
    """The checkpoint's architecture has no MTP family file."""


class MissingHeadsError(MTPError):
    """The config declares MTP layers whose tensors are absent, or the reverse."""


class RollbackError(MTPError):
    """A cache cannot be rolled back exactly, so speculative decoding is refused."""


class DiskFullError(MTPError):
    """The disk filled up while writing; what was being written has been removed."""

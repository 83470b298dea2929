"""Where mlx-mtp keeps its own files."""

import functools
import os
from pathlib import Path


def home() -> Path:
    """mlx-mtp's folder for measured round costs, draft vocabularies and the demo
    model: ``$MLX_MTP_HOME``, default ``~/.cache/mlx-mtp``.

    An empty (or whitespace-only) ``$MLX_MTP_HOME`` counts as unset. A relative one is
    resolved against the working directory the first time this process sees that
    value, and that absolute path is kept: a later ``os.chdir`` does not move it.
    """
    value = os.environ.get("MLX_MTP_HOME", "")
    if not value.strip():
        return Path.home() / ".cache" / "mlx-mtp"
    return _absolute(value)


@functools.lru_cache(maxsize=None)
def _absolute(value: str) -> Path:
    return Path(value).expanduser().resolve()

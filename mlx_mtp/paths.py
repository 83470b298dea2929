"""Where mlx-mtp keeps its own files."""

import os
from pathlib import Path


def home() -> Path:
    """mlx-mtp's folder for measured round costs and the demo model:
    ``$MLX_MTP_HOME``, default ``~/.cache/mlx-mtp``."""
    return Path(os.environ.get("MLX_MTP_HOME", Path.home() / ".cache" / "mlx-mtp"))

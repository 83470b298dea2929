"""What the tests of families whose trunk is mlx-vlm's share."""

import sys

from .test_errors import run_cli


def generate_without_mlx_vlm(path, cached, monkeypatch):
    """``mlx-mtp generate`` on the checkpoint at ``path`` as if mlx-vlm were not
    installed: its modules hidden, the family's cached imports of it (``cached``,
    ``lru_cache`` functions) cleared before and after. Returns the CLI's result."""
    for name in [m for m in sys.modules if m.split(".")[0] == "mlx_vlm"]:
        monkeypatch.setitem(sys.modules, name, None)  # "not installed"
    for function in cached:
        function.cache_clear()
    try:
        return run_cli("generate", "--model", str(path), "-p", "hi", "-m", "4")
    finally:
        for function in cached:
            function.cache_clear()

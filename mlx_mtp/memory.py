"""What the machine can give MLX, and the guard that refuses to load a model whose
weights do not fit it (instead of a swap storm, or a kernel panic on a Mac).

The limit (`memory_limit`) is ``MLX_MTP_MEMORY_LIMIT`` when set (bytes, or a size
such as ``24GB``, ``512MiB``), else Metal's recommended working set on a Mac, else
the memory the system says is available now. The weights are what their files hold
(`weights_bytes`: every ``*.safetensors`` of the model's folder, its MTP heads and
drafter included, but the tables read by row from their files), a share of them per
rank when the trunk is sharded.
"""

import os
import re
from pathlib import Path
from typing import Iterable, Optional, Tuple

from .errors import MTPError

LIMIT_ENV = "MLX_MTP_MEMORY_LIMIT"
UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"24GB"``, ``"512 MiB"``, ``"1e9"`` -> bytes.

    Raises:
        MTPError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text or "")
    unit = m and m[2].lower()
    if not m or unit not in UNITS:
        raise MTPError(
            f"{LIMIT_ENV}={text!r} is not a size (bytes, or e.g. 24GB, 512MiB)"
        )
    return int(float(m[1]) * UNITS[unit])


def memory_limit() -> Tuple[int, str]:
    """The bytes MLX may use here and where that number comes from."""
    if os.environ.get(LIMIT_ENV):
        return parse_size(os.environ[LIMIT_ENV]), LIMIT_ENV
    metal = _metal_working_set()
    if metal:
        return metal, "Metal's recommended working set"
    available = _available_memory()
    if available:
        return available, "the memory available now"
    pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return pages, "the machine's memory"


def _metal_working_set() -> Optional[int]:
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    info = getattr(mx, "device_info", None) or mx.metal.device_info
    return int(info().get("max_recommended_working_set_size") or 0) or None


def _available_memory() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), in bytes; None elsewhere."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+)\s+kB", text, re.M)
    return int(m[1]) * 1024 if m else None


def weights_bytes(folders: Iterable[Path]) -> int:
    """The bytes of every ``*.safetensors`` file in ``folders``."""
    total = 0
    for folder in folders:
        for f in Path(folder).glob("*.safetensors"):
            total += f.stat().st_size
    return total


def readable_size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def check_fits(folders: Iterable[Path], ranks: int = 1, mapped: int = 0) -> None:
    """Refuse, in one `MTPError` line, weights (``folders``' safetensors but the
    ``mapped`` bytes of tables read by row from their files, `mlx_mtp.tables`; split
    over ``ranks``) larger than `memory_limit`: how much is missing, and what would
    fit.

    Raises:
        MTPError: the weights do not fit.
    """
    folders = list(folders)
    need = (weights_bytes(folders) - mapped) // max(ranks, 1)
    limit, source = memory_limit()
    if need <= limit:
        return
    per = f" per rank over {ranks}" if ranks > 1 else ""
    besides = f" besides {readable_size(mapped)} read from disk" if mapped else ""
    raise MTPError(
        f"{folders[0]}: its weights take {readable_size(need)}{per}{besides}, "
        "more than the "
        f"{readable_size(limit)} MLX can use here ({source}; "
        f"{readable_size(need - limit)} missing): use a smaller quantization "
        "(mlx-mtp convert -q --q-bits 4), shard it over several Macs, or pass "
        "--force to load it anyway"
    )

"""Finding and validating a source checkpoint before anything is written."""

import json
import struct
from pathlib import Path
from typing import Iterable, List, Optional

from mlx_mtp.errors import MTPError
from mlx_mtp.loading import resolve

# What a conversion copies besides the weights (tokenizer, chat template, generation).
SIDE_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "*.jinja",
    "chat_template*",
    "generation_config.json",
    "preprocessor_config.json",
    "*.py",
)
SOURCE_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.py",
]

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def resolve_source(
    path_or_repo: str,
    revision: Optional[str] = None,
    patterns: Optional[List[str]] = None,
) -> Path:
    """A local folder as is, or a hub repo downloaded (only ``patterns``) into the HF cache."""
    return resolve(path_or_repo, revision, patterns or SOURCE_PATTERNS)


def weight_files(folder: Path) -> List[Path]:
    """The checkpoint's safetensors files; every shard the index names must exist."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_index(folder)
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (folder / name).is_file():
                raise MTPError(
                    f"shard {name} named in {index.name} is missing from {folder}"
                )
        return [folder / name for name in files]
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise MTPError(f"no model*.safetensors in {folder}")
    return files


def read_index(folder: Path) -> dict:
    path = folder / "model.safetensors.index.json"
    try:
        return json.loads(path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise MTPError(f"cannot read {path}: {e}") from None


def check_safetensors(path: Path) -> dict:
    """Read a safetensors header and check that every tensor lies inside the file.

    Returns the header (name -> dtype, shape, offsets). A truncated or corrupt file is a
    one-line `MTPError` naming it, before any conversion work starts.
    """
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header runs past the end of the file")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise MTPError(f"{path} is not a valid safetensors file ({e})") from None
    data = size - 8 - n
    header.pop("__metadata__", None)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            count *= d
        if end > data:
            raise MTPError(
                f"{path} is truncated: tensor {name} ends at byte {end} of {data}"
            )
        width = _DTYPE_BYTES.get(info["dtype"])
        if width is not None and end - begin != count * width:
            raise MTPError(f"{path} is corrupt: tensor {name} has the wrong byte size")
    return header


def check_source(folder: Path) -> List[Path]:
    """Validate every weight file of a checkpoint; returns them."""
    files = weight_files(folder)
    for f in files:
        check_safetensors(f)
    return files


def copy_side_files(src: Path, dst: Path, patterns: Iterable[str] = SIDE_FILES) -> None:
    import shutil

    for pattern in patterns:
        for f in src.glob(pattern):
            if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
                shutil.copy2(f, dst / f.name)


def snapshot_revision(folder: Path) -> Optional[str]:
    """The commit of a hub snapshot folder (``.../snapshots/<commit>``), if it is one."""
    parts = folder.resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return None

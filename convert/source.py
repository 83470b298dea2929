"""Finding and validating a source checkpoint before anything is written."""

import logging
from pathlib import Path
from typing import Iterable, List, Optional

from mlx_mtp.errors import MTPError, one_line
from mlx_mtp.files import read_json, safetensors_header
from mlx_mtp.loading import resolve

log = logging.getLogger("mlx_mtp")

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
    "processor_config.json",
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


def resolve_source(
    path_or_repo: str,
    revision: Optional[str] = None,
    patterns: Optional[List[str]] = None,
) -> Path:
    """A local folder as is, or a hub repo downloaded (only ``patterns``) into the HF
    cache."""
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
        weight_map = read_json(path)["weight_map"]
    except (KeyError, TypeError) as e:
        raise MTPError(f"cannot read {path}: {one_line(e)}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
        raise MTPError(f"{path}: weight_map is not an object of file names")
    return weight_map


def check_safetensors(path: Path) -> dict:
    """Read a safetensors header and check that every tensor lies inside the file
    (`mlx_mtp.files.safetensors_header`); a truncated or corrupt file is a one-line
    `MTPError` naming it, before any conversion work starts."""
    return safetensors_header(path)


def check_source(folder: Path) -> List[Path]:
    """Validate every weight file of a checkpoint; returns them."""
    files = weight_files(folder)
    for f in files:
        check_safetensors(f)
    return files


def copy_side_files(
    src: Path, dst: Path, patterns: Iterable[str] = SIDE_FILES, code: bool = False
) -> None:
    """Copy the tokenizer, template and generation files of ``src`` into ``dst``;
    Python files (custom code) only with ``code``, otherwise a warning names them."""
    import shutil

    skipped = []
    for pattern in patterns:
        for f in src.glob(pattern):
            if not f.is_file() or f.name == "config.json" or f.suffix == ".safetensors":
                continue
            if f.suffix == ".py" and not code:
                skipped.append(f.name)
                continue
            shutil.copy2(f, dst / f.name)
    if skipped:
        log.warning(
            "not copying %s (code from the source; pass --trust-remote-code to copy "
            "it)",
            ", ".join(sorted(set(skipped))),
        )


def snapshot_revision(folder: Path) -> Optional[str]:
    """The commit of a hub snapshot folder (``.../snapshots/<commit>``), if it is
    one."""
    parts = folder.resolve().parts
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return None

"""Reading the files of a model folder and of mlx-mtp's caches without trusting them:
JSON files and the headers of safetensors files."""

import json
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from .errors import MTPError, one_line

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
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


# The journal of an update of a folder's files under way (convert/output.py's
# `replace_files`): while one is there, the folder may hold old and new files mixed.
UPDATE_JOURNAL = re.compile(r"^\.mlx-mtp\.(\d+)\.journal$")


def check_not_mid_update(folder: Path) -> None:
    """Refuse a folder that an update of its files (a graft) left halfway: a
    one-line `MTPError` saying how to finish it, rather than loading old and new
    files mixed."""
    try:
        names = [p.name for p in Path(folder).iterdir()]
    except OSError:
        return
    for name in names:
        m = UPDATE_JOURNAL.match(name)
        if m:
            raise MTPError(
                f"{folder} is halfway through an update of its files (process "
                f"{m[1]}, {name}): if that process is gone, run the same "
                "`mlx-mtp graft` again (with --overwrite) to finish it"
            )


def parse_json(text: Union[str, bytes], what: str) -> Any:
    """The JSON value of ``text``; ``what`` names where it comes from in errors.

    Raises:
        MTPError: one line naming ``what``, for text that is not JSON (not UTF-8,
            malformed, or nested too deeply for Python's parser).
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise MTPError(f"{what} is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise MTPError(f"{what} is not valid JSON ({one_line(e)})") from None


def read_json(path: Path, what: str = "") -> Any:
    """The JSON value in the file ``path``; every JSON file mlx-mtp reads goes through
    here, so that a malformed one is one line before any other library parses it.

    Args:
        path: The file.
        what: What the file is, for errors (default: its path alone).

    Raises:
        MTPError: one line naming the file, for a file that cannot be read or is not
            JSON (see `parse_json`).
    """
    where = f"{what} {path}" if what else str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise MTPError(f"cannot read {where}: {one_line(e)}") from None
    return parse_json(data, where)


def safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, ``{name: {"dtype", "shape", "data_offsets"}}``
    (``__metadata__`` left out), checked entry by entry: every tensor lies inside the
    file and, for known dtypes, has the byte size of its shape.

    Raises:
        MTPError: one line naming the file, for a truncated or malformed file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header runs past the end of the file")
            raw = f.read(n)
    except (struct.error, ValueError) as e:
        raise MTPError(f"{path} is not a valid safetensors file ({e})") from None
    header = parse_json(raw, f"{path} is not a valid safetensors file: its header")
    if not isinstance(header, dict):
        raise MTPError(f"{path} is not a valid safetensors file (header not an object)")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        _check_entry(path, name, info, data)
    return header


def _check_entry(path: Path, name: str, info, data: int) -> None:
    def bad(what):
        return MTPError(
            f"{path} is not a valid safetensors file (tensor {name}: {what})"
        )

    if not isinstance(info, dict):
        raise bad("entry is not an object")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(info.get("dtype"), str):
        raise bad("no dtype")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise bad("no valid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2):
        raise bad("no data_offsets")
    begin, end = offsets
    if not (_whole(begin) and _whole(end) and begin <= end):
        raise bad("bad data_offsets")
    if end > data:
        raise MTPError(
            f"{path} is truncated: tensor {name} ends at byte {end} of {data}"
        )
    count = 1
    for d in shape:
        count *= d
    width = DTYPE_BYTES.get(info["dtype"])
    if width is not None and end - begin != count * width:
        raise MTPError(f"{path} is corrupt: tensor {name} has the wrong byte size")


def _whole(x) -> bool:
    return type(x) is int and x >= 0


def model_stamps(model) -> Optional[list]:
    """The model's folder (and a separate assistant's or block drafter's), each with
    its files' names, sizes and times; None for a model built in memory."""
    if model.source is None:
        return None
    folders = [model.source]
    if model.assistant is not None and model.assistant_source not in (
        None,
        model.source,
    ):
        folders.append(model.assistant_source)
    if model.drafter is not None and model.drafter_source not in (None, model.source):
        folders.append(model.drafter_source)
    stamps = []
    for folder in folders:
        files = sorted(Path(folder).glob("*.safetensors")) + [
            Path(folder, "config.json")
        ]
        stamp = [
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in files
            if f.exists()
        ]
        stamps += [str(folder), stamp]
    return stamps


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, written and synced under a
    temporary name unique to this writer first."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_table(path: Path) -> dict:
    """A cache file of mlx-mtp's, ``{key: entry}``: {} for a file that is absent,
    unreadable or not a JSON object (its entries are for the caller to check)."""
    try:
        table = read_json(path) if path.is_file() else {}
    except MTPError:
        return {}
    return table if isinstance(table, dict) else {}


def write_table(path: Path, table: dict) -> None:
    """Write a cache table of mlx-mtp's whole, as JSON (`write_atomically`: the last
    of concurrent writers wins, the file is always one complete table); a cache
    that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(table))
    except OSError:
        pass

"""Reading the headers of safetensors files without trusting them."""

import json
import struct
from pathlib import Path

from .errors import MTPError

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
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise MTPError(f"{path} is not a valid safetensors file ({e})") from None
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

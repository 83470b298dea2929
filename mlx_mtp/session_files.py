"""Sessions on disk: a `mlx_mtp.speculative.Session` (its caches, whatever their
types, and its decode state) in one safetensors file, for prompt caches that outlive
the process (``mlx-mtp generate --prompt-cache FILE``, the server's disk tier).

The arrays are the file's tensors; the objects around them (caches, lists, the
decode state) are a JSON description in its metadata, with the tokens the session
holds, the model it was made with (`model_key`) and the caller's fields. Reading
rebuilds those objects without running any code from the file: every class it names
must be one of mlx-mtp's or mlx-lm's cache module's, found by its importable name
(never a pickle). Files are written to a temporary name and renamed, so a reader
sees a whole file or none; one that is truncated, malformed, of another format or
another model is refused with `SessionFileError` (a one-line `MTPError`).
"""

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx

from .errors import MTPError
from .files import safetensors_header

FORMAT = "mlx-mtp-session/1"
# Modules whose classes a session file may name (the caches' and the state's).
ALLOWED = ("mlx_mtp.", "mlx_lm.models.cache")


class SessionFileError(MTPError):
    """A session file that cannot be used: unreadable, foreign or of another model."""


def model_key(model) -> str:
    """The identity of ``model``'s weights: its folder's ``config.json`` and the
    names and sizes of its weight files (and its drafter's), hashed."""
    digest = hashlib.sha256()
    for folder in (
        model.source,
        getattr(model, "drafter_source", None),
        getattr(model, "assistant_source", None),
    ):
        if folder is None:
            continue
        folder = Path(folder)
        config = folder / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"-")
        for f in sorted(folder.glob("*.safetensors")):
            digest.update(f"{f.name}:{f.stat().st_size};".encode())
    return digest.hexdigest()[:32]


def save(session, path, key: str, fields: Optional[dict] = None) -> int:
    """Write ``session`` to ``path`` (atomically) for the model ``key``, with
    ``fields`` (JSON values) in its metadata; returns the file's size.

    Raises:
        SessionFileError: the session holds something a file cannot describe.
    """
    session = _evaluated(session)
    arrays: Dict[str, mx.array] = {}
    try:
        tree = _encode(session, arrays)
    except TypeError as e:
        raise SessionFileError(f"cannot save the session: {e}") from None
    meta = {
        "format": FORMAT,
        "model": key,
        "tokens": json.dumps(session.tokens),
        "tree": json.dumps(tree),
        "fields": json.dumps(fields or {}),
    }
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_meta(path, key: Optional[str] = None) -> Tuple[list, dict]:
    """A session file's tokens and fields, from its header alone.

    Raises:
        SessionFileError: not a session file of this format (or, given ``key``, of
            another model), or a truncated or malformed one.
    """
    meta = _metadata(path)
    _check(meta, path, key)
    try:
        return json.loads(meta["tokens"]), json.loads(meta.get("fields", "{}"))
    except ValueError:
        raise SessionFileError(f"{path}: its tokens are not readable") from None


def load(path, key: str):
    """The `Session` a file holds, for the model ``key``.

    Raises:
        SessionFileError: see `read_meta`; or its description names a class that
            is not an allowed one, or does not match its tensors.
    """
    meta = _metadata(path)
    _check(meta, path, key)
    try:
        arrays = mx.load(str(path))
        return _decode(json.loads(meta["tree"]), arrays)
    except SessionFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise SessionFileError(f"{path}: not a readable session ({e})") from None


def _metadata(path) -> dict:
    path = Path(path)
    try:
        safetensors_header(path)  # a truncated or malformed file: one line
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except MTPError as e:
        raise SessionFileError(str(e)) from None
    except (OSError, ValueError) as e:
        raise SessionFileError(f"{path}: cannot read it ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _check(meta: dict, path, key: Optional[str]) -> None:
    if meta.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not an mlx-mtp session file ({FORMAT})")
    if key is not None and meta.get("model") != key:
        raise SessionFileError(f"{path} was made with another model")


def _evaluated(session):
    """A snapshot of ``session`` with its arrays evaluated (its buffers at their
    size, no pending computation)."""
    copy = session.snapshot()
    mx.eval(copy.arrays())
    return copy


# --- the description of the objects --------------------------------------------------


def _encode(value, arrays: Dict[str, mx.array]):
    if isinstance(value, mx.array):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"array": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # inf and nan included
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, arrays) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a dict whose keys are not strings")
        return {"dict": {k: _encode(v, arrays) for k, v in value.items()}}
    if isinstance(value, mx.Dtype):
        return {"dtype": str(value).rpartition(".")[2]}
    cls = type(value)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not _allowed(cls.__module__) or _find(name) is not cls:
        raise TypeError(f"an object of class {name}")
    attrs = {k: _encode(v, arrays) for k, v in vars(value).items()}
    return {"object": name, "attrs": attrs}


def _decode(tree, arrays: Dict[str, mx.array]):
    if not isinstance(tree, dict) or not tree:
        return tree
    if "object" in tree:
        cls = _find(tree["object"])
        if cls is None:
            raise SessionFileError(f"a session file names the class {tree['object']!r}")
        obj = cls.__new__(cls)
        for name, value in tree["attrs"].items():
            object.__setattr__(obj, name, _decode(value, arrays))
        return obj
    kind, body = next(iter(tree.items()))
    if kind == "array":
        return arrays[body]
    if kind == "float":
        return float(body)
    if kind in ("list", "tuple"):
        items = [_decode(v, arrays) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _decode(v, arrays) for k, v in body.items()}
    if kind == "dtype":
        dtype = getattr(mx, body, None)
        if not isinstance(dtype, mx.Dtype):
            raise SessionFileError(f"unknown dtype {body!r} in a session file")
        return dtype
    raise SessionFileError("a session file's description is malformed")


def _allowed(module: str) -> bool:
    return module.startswith(ALLOWED)


def _find(name: str) -> Optional[Any]:
    """The class ``module:qualname`` names, imported (None when it is not there or
    not a class, or the module is not an allowed one)."""
    module, _, qualname = name.partition(":")
    if not _allowed(module) or "<" in qualname:
        return None
    try:
        found = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None

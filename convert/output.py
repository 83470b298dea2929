"""Writing an output folder safely.

Everything a command writes goes to a hidden scratch path next to the destination
(``.NAME.PID.partial``), which is renamed into place only when complete; a lock file
(``.NAME.lock``) keeps two mlx-mtp processes from writing the same destination at once.
An existing destination is replaced only with ``overwrite``, and only when it is
recognisably a model folder that mlx-mtp or mlx-lm wrote: never a user's folder, the
working directory, the home folder, ``/``, or a folder that holds or lies inside a
source. Scratch paths left by a killed process are removed by the next run.
"""

import contextlib
import errno
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_mtp.errors import DiskFullError, MTPError

# What a model folder written by mlx-mtp or mlx-lm may hold (besides hidden files such
# as .DS_Store): weights, configs, tokenizer and template files, the model card.
MODEL_FILES = (
    "*.safetensors",
    "*.json",
    "*.jinja",
    "*.tiktoken",
    "*.model",
    "*.py",
    "*.jsonl",
    "merges.txt",
    "vocab*.txt",
    "README.md",
    "LICENSE*",
)


# --- what may be written where ------------------------------------------------------------


def check_destination(
    dst: Path,
    overwrite: bool,
    sources: Iterable[Path] = (),
    inputs: Iterable[Path] = (),
    what: str = "output folder",
) -> None:
    """Refuse a destination that writing (or replacing) would make lose data.

    Args:
        dst: The folder to be written.
        overwrite: Replace an existing ``dst`` (only a model folder, see
            `not_model_folder`).
        sources: Folders ``dst`` may neither contain nor lie inside.
        inputs: Files or folders ``dst`` may not contain (read, never written).
    """
    dst = Path(dst).expanduser()
    check_place(dst, sources, inputs, what)
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise MTPError(f"{dst} already exists (use --overwrite to replace it)")
    reason = not_model_folder(dst)
    if reason:
        raise MTPError(
            f"not replacing {dst}: {reason}; remove it yourself or choose another path"
        )


def check_place(
    dst: Path,
    sources: Iterable[Path] = (),
    inputs: Iterable[Path] = (),
    what: str = "output folder",
) -> None:
    """Refuse ``/``, the home folder, the working directory or a folder above it, and
    a ``dst`` that is, holds or lies inside a source, or holds an input (see
    `check_destination`)."""
    dst, sources = Path(dst).expanduser(), list(sources)
    real = dst.resolve()
    for name, place in (("/", Path("/")), ("the home folder", Path.home())):
        if real == place.resolve():
            raise MTPError(f"refusing to write the {what} to {name} ({dst})")
    if real == Path.cwd().resolve() or real in Path.cwd().resolve().parents:
        raise MTPError(
            f"refusing to write the {what} to {dst}: it holds the working directory"
        )
    for src in sources:
        src_real = Path(src).expanduser().resolve()
        if real == src_real:
            raise MTPError(f"the {what} {dst} is the source itself")
        if src_real in real.parents:
            raise MTPError(f"the {what} {dst} is inside the source {src}")
        if real in src_real.parents:
            raise MTPError(f"the {what} {dst} contains the source {src}")
    for src in inputs:
        if real in Path(src).expanduser().resolve().parents:
            raise MTPError(f"the {what} {dst} contains the input {src}")


def not_model_folder(path: Path) -> Optional[str]:
    """Why ``path`` is not a model folder that mlx-mtp or mlx-lm wrote (None if it is).

    Such a folder holds a ``config.json`` object that mlx-mtp annotated (an ``mtp`` or
    ``mlx_mtp`` section) or MLX-written weights (safetensors whose metadata says
    ``"format": "mlx"``), no subfolders, and only the files a conversion writes
    (`MODEL_FILES`).
    """
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is a file, not a model folder"
    entries = sorted(path.iterdir())
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir() or entry.is_symlink():
            return f"it holds {entry.name}{'/' if entry.is_dir() else ''}"
        if not any(entry.match(p) for p in MODEL_FILES):
            return f"it holds {entry.name}, which mlx-mtp does not write"
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return "it has no config.json (not a model folder)"
    if "mtp" in config or "mlx_mtp" in config:
        return None
    weights = [e for e in entries if e.match("model*.safetensors")]
    if not weights or not all(_written_by_mlx(w) for w in weights):
        return "its weights were not written by mlx-mtp or mlx-lm"
    return None


def _written_by_mlx(path: Path) -> bool:
    """Whether a safetensors file carries MLX's ``{"format": "mlx"}`` metadata."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 1 << 26)))
        return header.get("__metadata__", {}).get("format") == "mlx"
    except (OSError, ValueError, struct.error, AttributeError):
        return False


# --- scratch paths, locks and stale leftovers ---------------------------------------------


def scratch_path(dst: Path, tag: str = "partial") -> Path:
    """A hidden path next to ``dst`` owned by this process: ``.NAME.PID.TAG``."""
    return dst.parent / f".{dst.name}.{os.getpid()}.{tag}"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dst: Path) -> None:
    """Remove the scratch paths of ``dst`` (`scratch_path`) whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.(\d+)\.\w")
    if not dst.parent.is_dir():
        return
    for entry in dst.parent.iterdir():
        m = pattern.match(entry.name)
        if m and not _alive(int(m[1])):
            _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def locked(dst: Path):
    """Hold ``.NAME.lock`` next to ``dst`` while writing it; another live mlx-mtp
    process holding it is an error, a dead one's lock is taken over."""
    lock = dst.parent / f".{dst.name}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                raise MTPError(
                    f"another mlx-mtp process (PID {pid}) is writing {dst}; wait for "
                    f"it to finish (or remove {lock} if it is gone)"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
    else:
        raise MTPError(f"cannot take the lock {lock}")
    try:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


# --- writing ------------------------------------------------------------------------------


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk (or quota) is full: an ``OSError`` with ENOSPC /
    EDQUOT, or MLX's ``[write] Unable to write`` (which carries no errno; a failed write
    to a local folder is a full disk in practice)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and str(e).startswith("[write]")


@contextlib.contextmanager
def writing(dst: Path, outcome: str = "nothing was written"):
    """Turn a full disk while writing ``dst`` into a one-line `DiskFullError`."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(
            f"no space left on {Path(dst).parent.resolve()} while writing "
            f"{Path(dst).name}; {outcome}"
        ) from None


def reserve(path: Path, size: int) -> None:
    """Give the (sparse) file ``path`` its ``size`` bytes on disk now, so that writing
    it through a memory map cannot hit a full disk later (a SIGBUS, not an error).
    Raises ``OSError(ENOSPC)`` when they do not fit."""
    free = shutil.disk_usage(path.parent).free
    if size > free + path.stat().st_blocks * 512:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    if hasattr(os, "posix_fallocate"):  # Linux; macOS relies on the check above
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged_folder(dst: Path, overwrite: bool = False, sources: Iterable[Path] = ()):
    """Yield a fresh scratch folder; on success it becomes ``dst``.

    ``dst`` is checked with `check_destination` before and again, under the lock, just
    before the rename (another process may have made it meanwhile). An existing ``dst``
    is replaced only after the new folder is complete. On any error or interruption
    the scratch folder is removed and ``dst`` is untouched (a hard kill leaves only
    ``.NAME.PID.partial``, which the next run removes); a full disk is one `MTPError`.
    """
    dst = Path(dst).expanduser()
    check_destination(dst, overwrite, sources)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst)
    tmp, old = scratch_path(dst), scratch_path(dst, "old")
    _remove(tmp)
    with locked(dst):
        tmp.mkdir()
        try:
            with writing(dst):
                yield tmp
            check_destination(dst, overwrite, sources)
            if os.path.lexists(dst):
                os.replace(dst, old)
                os.replace(tmp, dst)
            else:
                os.rename(tmp, dst)
        finally:
            _remove(tmp)
            _remove(old)


def replace_files(writers: dict) -> None:
    """Write several files as one step: ``write(tmp_path)`` for each ``{path: write}``
    first, then rename them all into place (a failed or interrupted write changes
    none of them)."""
    staged = {}
    try:
        for path, write in writers.items():
            remove_stale(path)
            staged[path] = path.parent / f".{path.name}.{os.getpid()}.partial"
            with writing(path):
                write(staged[path])
        for path, tmp in staged.items():
            os.replace(tmp, path)
    finally:
        for tmp in staged.values():
            _remove(tmp)


def save_trunk(
    folder: Path, model: nn.Module, shard_gb: float = 5.0, progress=True
) -> dict:
    """Write the trunk as mlx-lm does (``model[-i-of-n].safetensors`` + index), evaluating
    one shard at a time and releasing the model's arrays as they are written.

    mlx-lm's ``save_model(..., donate_model=True)`` writes the same files the same way,
    but takes no shard size (the tests write several shards of a tiny model, as large
    checkpoints have) and shows no progress, hence this version.

    Returns the index's weight map.
    """
    from mlx_lm.utils import get_total_parameters
    from tqdm import tqdm

    weights = dict(tree_flatten(model.parameters()))
    total_parameters = get_total_parameters(model)
    limit = int(shard_gb * (1 << 30))
    shards, size = [], 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    total = sum(v.nbytes for v in weights.values())
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weights.clear()
    n = len(shards)
    name = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    weight_map = {}
    with tqdm(total=n, unit="shard", desc="writing", disable=not progress) as bar:
        for i in range(n):  # (the bar ends its line also when a write fails)
            shard, shards[i] = shards[i], None
            file = name.format(i + 1, n)
            mx.save_safetensors(str(folder / file), shard, metadata={"format": "mlx"})
            weight_map.update({k: file for k in shard})
            del shard
            mx.clear_cache()
            bar.update()
    index = {
        "metadata": {"total_size": total, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return weight_map

"""Writing an output folder safely.

Everything a command writes goes to a hidden scratch path next to the destination
(``.NAME.PID.partial``), which is renamed into place only when complete; a lock file
(``.NAME.lock``) keeps two mlx-mtp processes from writing the same destination at once.
An existing destination is replaced only with ``overwrite``, and only when it is
recognisably a model folder that mlx-mtp or mlx-lm wrote: never a user's folder, the
working directory, the home folder, ``/``, or a folder that holds or lies inside a
source. Each replacement is all-or-nothing: what a killed process left is settled by
the next run (the old version put back, or the new one finished; scratch removed).
"""

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import threading
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_mtp.errors import DiskFullError, MTPError
from mlx_mtp.files import UPDATE_JOURNAL

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


# --- what may be written where --------------------------------------------------------


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


# --- scratch paths, locks and what dead runs left -------------------------------------
#
# How a replacement stays all-or-nothing, whatever stops it (an error, Ctrl-C, SIGKILL):
# - A folder (`staged_folder`): the new one is written to ``.NAME.PID.partial``; once it
#   is complete the old one is renamed to ``.NAME.PID.old``, the new one into place, and
#   the old one to ``.NAME.PID.trash`` before it is deleted. So ``.old`` is always a
#   complete earlier version: it is put back when NAME is missing, deleted when NAME is
#   there.
# - Files of a folder (`replace_files`): each new file is written to
#   ``.FILE.PID.partial``; once all are complete, a journal ``.mlx-mtp.PID.journal``
#   naming them is written (the commit point), then each is renamed into place and the
#   journal deleted. Renames a journal names are finished; partial files no journal
#   names are deleted.
# The process that stops settles its own paths in its ``finally`` blocks; what a dead
# process left is settled by the next run (`remove_stale`, under the lock).

SWAP_TAGS = ("partial", "old", "trash")  # a folder swap's scratch paths
JOURNAL = UPDATE_JOURNAL  # mlx_mtp.files: loading refuses a folder mid-update
STAGED = re.compile(r"^\..+\.(\d+)\.partial$")  # staged files, the journal's own
_held = set()  # the locks this process holds
_held_guard = threading.Lock()


def scratch_path(dst: Path, tag: str = "partial", pid: Optional[int] = None) -> Path:
    """A hidden path next to ``dst`` owned by process ``pid`` (default: this one):
    ``.NAME.PID.TAG``."""
    return dst.parent / f".{dst.name}.{os.getpid() if pid is None else pid}.{tag}"


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


def _scratch(dst: Path):
    """``(path, pid, tag)`` for each scratch path of ``dst`` (`scratch_path`)."""
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.(\d+)\.([\w-]+)$")
    if not dst.parent.is_dir():
        return []
    found = (pattern.match(e.name) for e in dst.parent.iterdir())
    return [(dst.parent / m[0], int(m[1]), m[2]) for m in found if m]


def remove_stale(dst: Path) -> None:
    """Settle what dead processes left of ``dst``: put back or delete their ``.old``
    folder, finish the file replacements they committed inside the folder ``dst``,
    delete their other scratch paths. The paths of live processes are left alone."""
    dst = Path(dst)
    for pid in sorted({pid for _, pid, _ in _scratch(dst) if not _alive(pid)}):
        _settle(dst, pid)
    if dst.is_dir():
        _settle_files(dst)


def _settle(dst: Path, pid: int, tags: Optional[Iterable[str]] = None) -> None:
    """Undo the folder swap of process ``pid`` on ``dst`` where it stopped (its
    ``.old`` folder back in place, or deleted when ``dst`` is the new one), then delete
    its scratch paths (those of ``tags`` only, if given)."""
    old = scratch_path(dst, "old", pid)
    if os.path.lexists(old):
        if os.path.lexists(dst):
            _discard(old, scratch_path(dst, "trash", pid))
        else:
            with contextlib.suppress(FileNotFoundError):  # another run put it back
                os.rename(old, dst)
    for path, owner, tag in _scratch(dst):
        if owner == pid and (tags is None or tag in tags):
            _remove(path)


def _settle_files(folder: Path, mine: bool = False) -> None:
    """Finish the file replacements (`replace_files`) dead processes (``mine``: and
    this one) committed in ``folder``; delete the staged files they did not."""

    def stale(pid: int) -> bool:
        return (mine and pid == os.getpid()) or not _alive(pid)

    for entry in sorted(folder.iterdir()):
        m = JOURNAL.match(entry.name)
        if m and stale(int(m[1])):
            _commit(entry, int(m[1]))
    for entry in sorted(folder.iterdir()):
        m = STAGED.match(entry.name)
        if m and stale(int(m[1])):
            _remove(entry)


def _discard(path: Path, trash: Path) -> None:
    """Delete ``path``, renamed to ``trash`` first (a half-deleted folder is never
    taken for a complete one)."""
    os.rename(path, trash)
    _remove(trash)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def locked(dst: Path):
    """Hold ``.NAME.lock`` next to ``dst`` while writing it; another live mlx-mtp
    process holding it (or this one, already) is an error; a dead one's lock, or one
    this process left, is taken over."""
    lock = dst.parent / f".{dst.name}.lock"
    key = str(lock.parent.resolve() / lock.name)
    with _held_guard:
        if key in _held:
            raise MTPError(f"{dst} is being written already (by this process)")
        _held.add(key)
    try:
        fd = _take(lock, dst)
    except BaseException:
        _held.discard(key)
        raise
    try:
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
        yield
    finally:
        _held.discard(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def _take(lock: Path, dst: Path) -> int:
    """Create ``lock`` (taking over a dead process's, or one this process left); its
    file descriptor."""
    for _ in range(2):
        try:
            return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise MTPError(
                    f"another mlx-mtp process (PID {pid}) is writing {dst}; wait for "
                    f"it to finish (or remove {lock} if it is gone)"
                ) from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    raise MTPError(f"cannot take the lock {lock}")


# --- writing --------------------------------------------------------------------------


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
    is replaced only after the new folder is complete, and all-or-nothing (see the
    notes above `SWAP_TAGS`): on any error or interruption the scratch folder is removed
    and ``dst`` is what it was; after a hard kill the next run finds the old or the new
    ``dst``. A full disk is one `MTPError`.
    """
    dst = Path(dst).expanduser()
    check_destination(dst, overwrite, sources)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = scratch_path(dst)
    with locked(dst):
        remove_stale(dst)
        _settle(dst, os.getpid(), SWAP_TAGS)  # what an interrupted cleanup left
        check_destination(dst, overwrite, sources)  # a dead run's folder may be back
        os.mkdir(tmp)
        try:
            with writing(dst):
                yield tmp
            check_destination(dst, overwrite, sources)
            _swap(tmp, dst)
        finally:
            _settle(dst, os.getpid(), SWAP_TAGS)


def _swap(new: Path, dst: Path) -> None:
    """Put the complete folder ``new`` at ``dst``: an existing ``dst`` is renamed to
    ``.NAME.PID.old`` first, and deleted last."""
    if not os.path.lexists(dst):
        os.rename(new, dst)
        return
    old = scratch_path(dst, "old")
    os.rename(dst, old)
    os.rename(new, dst)
    _discard(old, scratch_path(dst, "trash"))


def replace_files(writers: dict) -> None:
    """Write several files of one folder as one step: ``write(tmp_path)`` for each
    ``{path: write}``, then rename them all into place.

    All-or-nothing (see the notes above `SWAP_TAGS`): until every new file is complete
    none replaces its old one, and an error or interruption deletes them; once they
    are, the renames are finished by this call's cleanup, or after a hard kill by the
    next run (`remove_stale` of the folder). The caller holds the folder's lock.
    """
    paths = [Path(p) for p in writers]
    folder = paths[0].parent
    if any(p.parent != folder for p in paths):
        raise ValueError("replace_files writes the files of one folder")
    remove_stale(folder)
    _settle_files(folder, mine=True)
    pid = os.getpid()
    journal = folder / f".mlx-mtp.{pid}.journal"
    staged = [scratch_path(p) for p in paths]
    try:
        for path, tmp, write in zip(paths, staged, writers.values()):
            with writing(path):
                write(tmp)
        _write_journal(journal, [p.name for p in paths])
        _commit(journal, pid)
    finally:
        if os.path.lexists(journal):
            _commit(journal, pid)  # committed: finish
        for tmp in staged + [folder / f".mlx-mtp.{pid}.partial"]:
            _remove(tmp)


def _write_journal(journal: Path, names: list) -> None:
    """Write the list of files to rename into place, complete or not at all."""
    tmp = journal.with_suffix(".partial")
    with open(tmp, "w") as f:
        json.dump(names, f)
    os.replace(tmp, journal)


def _commit(journal: Path, pid: int) -> None:
    """Rename into place the files staged by ``pid`` that ``journal`` names (those
    not renamed yet), then delete the journal."""
    folder = journal.parent
    for name in _journal_names(journal):
        with contextlib.suppress(FileNotFoundError):  # renamed already
            os.replace(folder / f".{name}.{pid}.partial", folder / name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal)


def _journal_names(journal: Path) -> list:
    """The file names a journal lists (plain names in its folder; [] if it is not
    such a list, which `replace_files` never writes)."""
    try:
        names = json.loads(journal.read_text())
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(names, list) or not all(
        isinstance(n, str) and n and Path(n).name == n and n not in (".", "..")
        for n in names
    ):
        return []
    return names


def save_trunk(
    folder: Path, model: nn.Module, shard_gb: float = 5.0, progress=True
) -> dict:
    """Write the trunk as mlx-lm does (``model[-i-of-n].safetensors`` + index),
    evaluating one shard at a time and releasing the model's arrays as they are
    written.

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

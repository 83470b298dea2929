"""The models on this machine (``mlx-mtp models``): mlx-mtp's own folder (the demo's
conversion), the Hugging Face cache, and any folders named; for each, its
``model_type``, size on disk, quantization, what it drafts with (MTP heads: a
conversion's or the checkpoint's own layers; a block drafter; an assistant) and
whether its weights fit the memory MLX can use here (`mlx_mtp.memory`).

Only ``config.json`` and the safetensors files' sizes and index are read: nothing
is loaded, and a folder that is not a model is skipped.
"""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from . import assistant, memory
from .files import safetensors_header
from .models import dflash, dspark, get_family
from .paths import home


@dataclass(frozen=True)
class Entry:
    """One model folder: ``name`` (a hub repo id or the folder), ``path``,
    ``model_type``, ``size`` (bytes of its safetensors), ``quantization`` (e.g.
    "4-bit affine", "fp8", "float"), ``drafts`` (what it drafts with, or "none")
    and ``fits`` (its weights within `memory.memory_limit`)."""

    name: str
    path: str
    model_type: str
    size: int
    quantization: str
    drafts: str
    fits: bool


def scan(folders: Iterable[Path] = (), hub: bool = True) -> List[Entry]:
    """The models in ``folders`` (each a model, or a folder of models), mlx-mtp's
    home and, when ``hub``, the Hugging Face cache; sorted by name."""
    limit, _ = memory.memory_limit()
    found = {}
    for name, path in _candidates(folders, hub):
        entry = describe(path, name, limit)
        if entry is not None and entry.path not in found:
            found[entry.path] = entry
    return sorted(found.values(), key=lambda e: e.name)


def _candidates(folders: Iterable[Path], hub: bool):
    for folder in [*map(Path, folders), home()]:
        if (folder / "config.json").is_file():
            yield str(folder), folder
        elif folder.is_dir():
            for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
                yield str(sub), sub
    if hub:
        yield from _hub_snapshots()


def _hub_snapshots():
    """``(repo id, snapshot folder)`` of each model in the Hugging Face cache (its
    most recent revision)."""
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # no cache yet, or one huggingface-hub cannot read
        return
    for repo in cache.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        latest = max(repo.revisions, key=lambda r: r.last_modified)
        yield repo.repo_id, Path(latest.snapshot_path)


def describe(path: Path, name: str, limit: int) -> Optional[Entry]:
    """``path``'s `Entry`, or None when it is not a model folder (no readable
    ``config.json`` with a ``model_type``, or no weights)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not config.get("model_type"):
        return None
    size = memory.weights_bytes([path])
    if not size:
        return None
    return Entry(
        name=name,
        path=str(path),
        model_type=str(config["model_type"]),
        size=size,
        quantization=_quantization(config),
        drafts=_drafts(path, config),
        fits=size <= limit,
    )


def _quantization(config: dict) -> str:
    q = config.get("quantization")
    if isinstance(q, dict) and q.get("bits"):
        return f"{q['bits']}-bit {q.get('mode', 'affine')}"
    released = config.get("quantization_config") or (
        config.get("text_config") or {}
    ).get("quantization_config")
    if isinstance(released, dict):
        method = released.get("quant_method", "?")
        return str(released.get("quant_algo") or method).lower()
    dtype = config.get("torch_dtype") or config.get("dtype") or "float"
    return str(dtype)


def _drafts(path: Path, config: dict) -> str:
    """What the folder drafts with, read from its config and tensor names."""
    if dspark.is_dspark(config):
        return f"is a {dflash.kind(config) or 'DSpark'} drafter (--draft-model)"
    if assistant.is_assistant(config):
        return "is a Gemma 4 assistant (--draft-model)"
    mtp = config.get("mtp")
    if isinstance(mtp, dict):
        bits = (mtp.get("quantization") or {}).get("bits")
        precision = f", {bits}-bit" if bits else ""
        n = mtp.get("num_layers", 0)
        return f"MTP heads ({n} layer{'' if n == 1 else 's'}{precision})"
    if isinstance(config.get("drafter"), dict):
        kept = config["drafter"].get("config") or {}
        return f"a {dflash.kind(kept) or 'DSpark'} drafter"
    if isinstance(config.get("assistant"), dict):
        return "a Gemma 4 assistant"
    try:
        family = get_family(config)
    except Exception:  # a model type mlx-mtp does not run
        return "unsupported model type"
    declared = family.declared_mtp_layers(config)
    names = _tensor_names(path)
    present = {family.mtp_layer_of(n, config) for n in names} - {None}
    if present:
        if family.make_drafter is not None:
            return "a block drafter in the checkpoint"
        return f"{_layers(len(present))} in the checkpoint"
    if declared:
        return f"none ({_layers(declared)} declared, their tensors absent)"
    if str(config.get("model_type", "")).startswith("gemma4"):
        return "none (its Gemma 4 assistant drafts: --draft-model)"
    return "none (prompt lookup; train-heads can add heads)"


def _layers(n: int) -> str:
    return f"{n} MTP layer{'' if n == 1 else 's'}"


def _tensor_names(path: Path) -> List[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError):
            return []
    names = []
    for f in sorted(path.glob("model*.safetensors")):
        try:
            names += list(safetensors_header(f))
        except Exception:  # a truncated file: no names from it
            continue
    return names


def table(entries: List[Entry]) -> str:
    """The entries as an aligned text table."""
    if not entries:
        return "no models found"
    rows = [("model", "type", "size", "quantization", "drafts with", "fits")]
    for e in entries:
        size = memory.readable_size(e.size)
        rows.append(
            (
                e.name,
                e.model_type,
                size,
                e.quantization,
                e.drafts,
                "yes" if e.fits else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in rows
    )


def as_json(entries: List[Entry]) -> str:
    return json.dumps([asdict(e) for e in entries], indent=1)

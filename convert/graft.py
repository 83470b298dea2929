"""``mlx-mtp graft --from SRC --mlx-path EXISTING``: add MTP heads from a
Hugging Face checkpoint to an MLX conversion that lacks them (e.g. an mlx-community
4-bit model), downloading only the shards that hold the MTP tensors."""

import logging
import re
from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlx_mtp import draft_vocab as ranking
from mlx_mtp.errors import MTPError
from mlx_mtp.heads import (
    HEADS_FILE,
    has_heads_file,
    heads_section,
    provenance,
    quantize_heads,
    save_heads,
    source_fingerprint,
)
from mlx_mtp.loading import build_mtp, load_trunk, read_config
from mlx_mtp.models import get_family
from mlx_mtp.models.base import Model
from mlx_mtp.models.mtp import MTPStack

from .hf import _cast, _save_config, check_head_dtypes
from .output import locked, remove_stale, replace_files
from .source import check_safetensors, read_index, resolve_source, snapshot_revision

log = logging.getLogger("mlx_mtp")

# Config keys that must agree between the trunk and the heads' source.
SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts",
    "linear_num_value_heads",
    "linear_num_key_heads",
)


def graft_heads(
    hf_path: str,
    mlx_path: str,
    *,
    revision: Optional[str] = None,
    head_bits: int = 8,
    overwrite: bool = False,
    rank_vocab: bool = True,
) -> Path:
    """Attach the MTP heads of ``hf_path`` to the MLX conversion at ``mlx_path``, and
    (``rank_vocab``) the ranking of its vocabulary for draft vocabularies
    (`mlx_mtp.draft_vocab`)."""
    if head_bits not in (4, 8, 16):
        raise MTPError("head_bits must be 4, 8 or 16")
    dst = Path(mlx_path)
    remove_stale(dst)  # a killed graft's files: finished before the config is read
    if not (dst / "config.json").is_file():
        raise MTPError(f"{dst} is not a model folder (no config.json)")
    dst_config = read_config(dst)
    family = get_family(dst_config)
    if has_heads_file(dst_config) and not overwrite:
        raise MTPError(f"{dst} already has MTP heads (use --overwrite to replace them)")
    src = resolve_source(hf_path, revision, patterns=["*.json"])
    _check_apart(dst, src)
    src_config = read_config(src)
    _check_match(dst, dst_config, src_config, hf_path, src)

    files = _mtp_files(hf_path, src, src_config, family, revision)
    tensors = {}
    for f in files:
        check_safetensors(f)
        for k, v in mx.load(str(f)).items():
            if family.mtp_layer_of(k, src_config) is not None:
                tensors[k] = v
    if not tensors:
        raise MTPError(f"{hf_path} has no MTP tensors")
    trunk, config, _ = load_trunk(dst, family, lazy=True)
    _, mtp = family.split_weights(tensors, src_config)
    stack = build_mtp(trunk, family, mtp, src_config, raw=True)
    check_head_dtypes(stack, hf_path)
    _cast(stack, _float_dtype(trunk, family), None)
    quantization = quantize_heads(stack, head_bits)
    mx.eval(stack.parameters())

    local = Path(hf_path).expanduser().exists()
    source = str(src.resolve()) if local else hf_path
    revision = revision or snapshot_revision(src)
    record = provenance(source, head_bits, revision, src, grafted=True)
    dst_config["mtp"] = heads_section(stack, quantization, record)
    writers = {dst / HEADS_FILE: lambda p: save_heads(p, stack)}
    ranked = None
    if rank_vocab and "draft_vocab" not in stack:
        ranked = ranking.rank_folder(dst, Model(trunk, MTPStack([]), family, dst))
    if ranked is not None:
        dst_config["mtp"]["draft_vocab"] = ranked[1]
        writers[dst / ranking.FILE] = lambda p: ranking.save_ranking(p, ranked[0])
    writers[dst / "config.json"] = lambda p: _save_config(dst_config, p.parent, p.name)
    with locked(dst):
        replace_files(writers)
    return dst


def _check_apart(dst: Path, src: Path) -> None:
    """Grafting writes into ``dst``: it must not be, hold or lie inside the source."""
    a, b = dst.resolve(), src.resolve()
    if a == b or b in a.parents or a in b.parents:
        raise MTPError(
            f"{dst} and the heads' source {src} overlap: grafting would write into "
            "the source"
        )


def _text(config: dict) -> dict:
    return {**config, **config.get("text_config", {})}


def _check_match(
    dst: Path, dst_config: dict, src_config: dict, hf_path: str, src: Path
):
    """Refuse heads whose source does not match the trunk (shapes, or provenance)."""
    a, b = _text(dst_config), _text(src_config)
    if dst_config.get("model_type") != src_config.get("model_type"):
        raise MTPError(
            f"model_type differs: the trunk is {dst_config.get('model_type')!r}, the "
            f"heads' source {src_config.get('model_type')!r}"
        )
    differ = [k for k in SHAPE_KEYS if k in a and k in b and a[k] != b[k]]
    if differ:
        k = differ[0]
        raise MTPError(
            f"the trunk does not match the heads' source: {k} is {a[k]} in {dst} but "
            f"{b[k]} in {hf_path}"
        )
    origin = dst_config.get("mlx_mtp", {})
    theirs = source_fingerprint(src)  # None unless every weight file is here
    if origin.get("source_fingerprint") and theirs:
        if origin["source_fingerprint"] != theirs:
            raise MTPError(
                f"{dst} was converted from {origin.get('source')}, not from {hf_path} "
                "(their weights differ)"
            )
    elif _is_repo(origin.get("source")) and _is_repo(hf_path):
        if origin["source"] != hf_path:
            raise MTPError(
                f"{dst} was converted from {origin['source']}, not {hf_path}"
            )
    base = _base_model(dst)
    if base and _is_repo(hf_path) and base != hf_path:
        raise MTPError(f"{dst} was converted from {base}, not from {hf_path}")


def _is_repo(name: Optional[str]) -> bool:
    return bool(name) and not Path(name).expanduser().exists() and name.count("/") == 1


def _base_model(folder: Path) -> Optional[str]:
    """``base_model`` of an mlx-lm model card (README.md front matter), if any."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    m = re.search(r"^base_model:\s*(\S+)\s*$", card.read_text(errors="ignore"), re.M)
    return m[1].strip("'\"") if m else None


def _mtp_files(hf_path, src: Path, config: dict, family, revision):
    """The safetensors files that hold MTP tensors, fetching only those."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_index(src)
        shards = sorted(
            {
                f
                for k, f in weight_map.items()
                if family.mtp_layer_of(k, config) is not None
            }
        )
        if not shards:
            raise MTPError(f"{hf_path} has no MTP tensors (per its safetensors index)")
    else:
        shards = ["model.safetensors"]
    missing = [s for s in shards if not (src / s).is_file()]
    if missing:
        if Path(hf_path).expanduser().exists():
            raise MTPError(
                f"shard {missing[0]} named in the index is missing from {src}"
            )
        src = resolve_source(hf_path, revision, patterns=shards + ["*.json"])
    return [src / s for s in shards]


def _float_dtype(trunk, family):
    """The trunk's float dtype (that of its token embeddings, dequantized if need be),
    so the heads match it."""
    return family.embed(trunk, mx.array([0])).dtype

"""Embedding tables read by row from their files, never loaded whole.

Some trunks carry tables of which a step reads a few rows: Qwen3.8-Flash-Next's
hashed n-gram embedding is 128 shards of 2,500,012 x 160 (about 100 GB in BF16,
26 GB at 4 bits), read at a few dozen rows a token. Loaded as parameters, such a
table is wired into memory whole. A family names its tables (``MAPPED_TABLES``:
a part of their tensor names, in the checkpoint and in the trunk), and the loader
replaces each such ``nn.Embedding`` with a `MappedEmbedding` over its tensors' byte
ranges in the safetensors files (``numpy.memmap``, read-only): a lookup reads the
rows it needs, the operating system keeps the pages it reads as long as memory
allows, and nothing of the table counts among the model's parameters, in MLX's
peak or in the server's cache budget (`mapped_bytes` counts it apart).

A `MappedEmbedding` gives exactly what ``nn.Embedding`` (float) or
``nn.QuantizedEmbedding`` (``weight``, ``scales``, ``biases`` as mlx-lm stores them)
give over the same tensors: the same rows, dequantized by the same call.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .files import safetensors_header

# safetensors dtype -> (numpy dtype of the bytes, MLX view of them or None)
STORED = {
    "F32": (np.float32, None),
    "F16": (np.float16, None),
    "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, None),
    "U8": (np.uint8, None),
}
PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class Stored:
    """Where a tensor lies: its file, the byte its data starts at, its safetensors
    dtype and shape."""

    file: Path
    offset: int
    dtype: str
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(STORED[self.dtype][0]).itemsize

    def map(self) -> np.memmap:
        """The tensor as a read-only ``numpy.memmap`` of its bytes."""
        kind = STORED[self.dtype][0]
        return np.memmap(
            self.file, dtype=kind, mode="r", offset=self.offset, shape=self.shape
        )


def locate(folder: Path, markers: Iterable[str]) -> Dict[str, Stored]:
    """The tensors of ``folder``'s ``model*.safetensors`` whose names contain one of
    ``markers``, by name, in a dtype a `MappedEmbedding` reads (`STORED`); from the
    files' headers alone."""
    markers = tuple(markers)
    found = {}
    if not markers:
        return found
    for f in sorted(Path(folder).glob("model*.safetensors")):
        header = safetensors_header(f)
        with open(f, "rb") as stream:
            start = 8 + int.from_bytes(stream.read(8), "little")
        for name, info in header.items():
            if any(m in name for m in markers) and info["dtype"] in STORED:
                found[name] = Stored(
                    f,
                    start + int(info["data_offsets"][0]),
                    info["dtype"],
                    tuple(int(d) for d in info["shape"]),
                )
    return found


def stored_bytes(folder: Path, markers: Iterable[str]) -> int:
    """The bytes of ``folder``'s tensors that `locate` finds (what a load maps)."""
    return sum(s.nbytes for s in locate(folder, markers).values())


class MappedEmbedding(nn.Module):
    """An embedding whose rows are read from its file when looked up.

    Args:
        weight: The stored ``(N, D)`` table (``(N, D * bits / 32)`` packed when
            quantized).
        scales, biases: A quantized table's (``biases`` None for modes without).
        quantization: ``group_size``, ``bits`` and ``mode`` of a quantized table.
    """

    def __init__(
        self,
        weight: Stored,
        scales: Optional[Stored] = None,
        biases: Optional[Stored] = None,
        quantization: Optional[dict] = None,
    ):
        super().__init__()
        self._stored = tuple(s for s in (weight, scales, biases) if s is not None)
        self._maps = tuple(s.map() for s in self._stored)
        self._views = tuple(STORED[s.dtype][1] for s in self._stored)
        self._quantization = None
        if scales is not None:
            q = quantization or {}
            self._quantization = {
                "group_size": q["group_size"],
                "bits": q["bits"],
                "mode": q.get("mode", "affine"),
            }

    @property
    def weight(self) -> np.memmap:
        """The stored table, read-only (its shape is what code asking an embedding
        for ``weight.shape`` reads: mlx-lm's ``quantize_model``)."""
        return self._maps[0]

    @property
    def nbytes(self) -> int:
        """The bytes the table's tensors take in their files."""
        return sum(s.nbytes for s in self._stored)

    def _rows(self, i: int, ids: np.ndarray) -> mx.array:
        rows = mx.array(self._maps[i][ids])
        view = self._views[i]
        return rows if view is None else rows.view(view)

    def __call__(self, ids: mx.array) -> mx.array:
        """``(...)`` row ids -> ``(..., D)``, as the loaded table gives them (the
        ids are read on the host: the lookup waits for them)."""
        flat = np.asarray(ids).reshape(-1).astype(np.int64)
        parts = [self._rows(i, flat) for i in range(len(self._maps))]
        if self._quantization is None:
            out = parts[0]
        else:
            w, scales, *biases = parts
            out = mx.dequantize(
                w, scales, biases[0] if biases else None, **self._quantization
            )
        return out.reshape(*ids.shape, out.shape[-1])

    def to_quantized(self, **kwargs) -> "MappedEmbedding":
        """Itself: a mapped table is read in the form it is stored in (mlx-lm's
        loader asks every layer its config names to quantize, and its
        ``quantize_model`` every layer that can be)."""
        return self


def mapped_bytes(module: nn.Module) -> int:
    """The bytes of ``module``'s `MappedEmbedding` tables (not among its parameters:
    the operating system pages them in from their files as they are read)."""
    return sum(m.nbytes for m in module.modules() if isinstance(m, MappedEmbedding))


def map_tables(
    trunk: nn.Module,
    weights: dict,
    raw_names: Dict[int, Tuple[str, mx.array]],
    located: Dict[str, Stored],
    markers: Iterable[str],
    quantization: Optional[dict],
) -> dict:
    """Replace ``trunk``'s embeddings under ``markers`` by `MappedEmbedding` tables
    over their stored tensors; ``weights`` (the sanitized ones) without theirs.

    Args:
        raw_names: ``id(array) -> (checkpoint name, array)`` of the arrays as read,
            before the trunk's sanitize renamed them (an array sanitize changed is
            not the stored one: its table stays loaded).
        located: The stored tensors, by checkpoint name (`locate`).
        quantization: The config's ``quantization`` (per-layer entries by path).
    """
    from mlx_lm.utils import infer_quant_config

    markers = tuple(markers)

    def stored(key: str) -> Optional[Stored]:
        array = weights.get(key)
        name, raw = raw_names.get(id(array), (None, None))
        return located.get(name) if raw is array else None

    for path, module in trunk.named_modules():
        if not isinstance(module, nn.Embedding) or not any(m in path for m in markers):
            continue
        parts = {p: f"{path}.{p}" for p in PARTS if f"{path}.{p}" in weights}
        found = {p: stored(key) for p, key in parts.items()}
        if "weight" not in found or None in found.values():
            continue
        q = None
        if "scales" in found:
            q = (quantization or {}).get(path)
            if not isinstance(q, dict):
                q = infer_quant_config(path, module, weights)
        table = MappedEmbedding(
            found["weight"], found.get("scales"), found.get("biases"), q
        )
        _replace(trunk, path, table)
        for key in parts.values():
            del weights[key]
    return weights


GROUPS = (128, 64, 32)  # affine group sizes, largest first


def quantize_tables(
    trunk: nn.Module, markers: Iterable[str], bits: int, group_size: int, mode: str
) -> dict:
    """Quantize ``trunk``'s tables under ``markers`` that mlx-lm's ``quantize_model``
    leaves float because ``group_size`` does not divide their rows (Qwen3.8-Flash-
    Next's 160-wide n-gram rows at the default 64): at ``bits``, affine, in the
    largest group that divides them, as mlx-vlm converts them (a table no group
    divides, or one in another mode, stays float).

    Returns:
        The per-layer ``quantization`` entries of the tables quantized.
    """
    markers = tuple(markers)
    done = {}

    def predicate(path, module):
        if not isinstance(module, nn.Embedding) or mode != "affine":
            return False
        if not any(m in path for m in markers):
            return False
        width = module.weight.shape[-1]
        if width % group_size == 0:
            return False  # quantize_model's to quantize
        group = next((g for g in GROUPS if width % g == 0), None)
        if group is None:
            return False
        done[path] = {"group_size": group, "bits": bits, "mode": "affine"}
        return done[path]

    if markers:
        nn.quantize(trunk, class_predicate=predicate)
    return done


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted module ``path`` under ``root``."""
    *parents, last = path.split(".")
    node = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    if isinstance(node, list):
        node[int(last)] = new
    else:
        setattr(node, last, new)

"""The MTP heads of an MLX conversion: ``mtp.safetensors`` plus a ``"mtp"`` config
section.

A conversion keeps the trunk exactly as mlx-lm writes it (``model*.safetensors``, which
is all mlx-lm reads, so plain mlx-lm loads the folder and ignores the heads) and the
heads in their own file, already in mlx-mtp's schema
``layers.{j}.{enorm,hnorm,eh_proj,norm,block.*}`` and already fixed up (experts
stacked, norms shifted, copies dropped): loading translates nothing, so nothing can be
shifted twice. The config section records what loading needs to rebuild the same layers,
and where the heads came from:

    "mtp": {"format": "mlx-mtp/1", "file": "mtp.safetensors", "num_layers": 1,
            "quantization": {"group_size": 64, "bits": 8, "mode": "affine"} | null,
            "provenance": {"source", "source_revision", "source_fingerprint",
                           "mlx_mtp_version", "trunk_quantization", "head_bits",
                           "dtype"}}

The trunk's own provenance is the config's ``"mlx_mtp"`` section (same keys).
"""

import hashlib
import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import __version__
from .errors import MissingHeadsError, MTPError
from .files import read_json, safetensors_header
from .models import get_family
from .models.mtp import MTPStack

FORMAT = "mlx-mtp/1"
HEADS_FILE = "mtp.safetensors"


def has_heads_file(config: dict) -> bool:
    return isinstance(config.get("mtp"), dict)


def quantized_modes(module: nn.Module) -> Dict[str, dict]:
    """``{path: {"group_size", "bits", "mode"}}`` of the leaf modules of ``module``
    that are already quantized (e.g. built packed from a release), as ``nn.quantize``'s
    per-path predicate returns them."""
    leaves = tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module)
    return {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
        for path, m in leaves
        if "scales" in m and all(hasattr(m, a) for a in ("group_size", "bits", "mode"))
    }


def quantize_heads(stack: MTPStack, bits: int, group_size: int = 64) -> Optional[dict]:
    """Quantize every float linear layer of the heads whose input width allows it
    (affine), but those a layer names in its ``float_layers``; layers that came
    quantized (a release's mxfp8/mxfp4) stay as they are.

    Returns the quantization record for the config: the affine settings, plus one
    entry per layer that came quantized; None when nothing is (``bits`` 16, no packed
    layers: the heads keep the float dtype).
    """
    packed = quantized_modes(stack)
    if bits >= 16:
        return {**next(iter(packed.values())), **packed} if packed else None
    layers = getattr(stack, "layers", ())  # an assistant has none
    floats = tuple(n for l in layers for n in getattr(l, "float_layers", ()))

    def predicate(path, m):
        if floats and path.endswith(floats):  # a layer the release keeps float
            return False
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(stack, group_size=group_size, bits=bits, class_predicate=predicate)
    return {"group_size": group_size, "bits": bits, "mode": "affine", **packed}


def quantize_like(
    module: nn.Module, weights: dict, quantization: Optional[dict]
) -> None:
    """Quantize the layers of ``module`` whose tensors come quantized (``.scales``):
    as ``quantization`` names the layer's path, else in the mode, bits and group size
    mlx-lm infers from its tensors (as its loader does)."""
    from mlx_lm.utils import infer_quant_config

    quantization = quantization or {}

    def predicate(path, m):
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        if isinstance(quantization.get(path), dict):
            return quantization[path]
        return infer_quant_config(path, m, weights)

    nn.quantize(module, class_predicate=predicate)


def load_strict(stack: MTPStack, weights: dict) -> MTPStack:
    """Load ``weights`` into ``stack``; a missing, extra or misshapen tensor is an
    error."""
    expected = dict(tree_flatten(stack.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"unexpected {_names(extra)}")
        raise MissingHeadsError("MTP weights do not match: " + "; ".join(parts))
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise MissingHeadsError(
                f"MTP tensor {name} has shape {tuple(value.shape)}, expected "
                f"{tuple(expected[name].shape)}"
            )
    stack.load_weights(list(weights.items()))
    return stack


def _names(keys, limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def save_heads(path: Path, stack: nn.Module) -> None:
    """Write the heads' (or an assistant's) tensors to the file ``path`` (MLX appends
    ``.safetensors`` to a name without it; the file is renamed back to exactly
    ``path``)."""
    weights = dict(tree_flatten(stack.parameters()))
    path = Path(path)
    written = path if path.suffix == ".safetensors" else Path(f"{path}.safetensors")
    mx.save_safetensors(str(written), weights, metadata={"format": "mlx"})
    if written != path:
        written.replace(path)


def provenance(
    source: Optional[str],
    head_bits: Optional[int],
    revision: Optional[str] = None,
    folder: Optional[Path] = None,
    **extra,
) -> dict:
    """Where a conversion's weights came from (the ``provenance`` of the ``mtp``
    section, and the config's ``mlx_mtp`` section): the source's name, revision and
    weight fingerprint (of ``folder``, its files), this mlx-mtp's version, the heads'
    bits, and any ``extra`` fields."""
    return {
        "source": source,
        "source_revision": revision,
        "source_fingerprint": source_fingerprint(folder) if folder else None,
        "mlx_mtp_version": __version__,
        "head_bits": head_bits,
        **extra,
    }


def heads_section(stack: MTPStack, quantization, provenance: dict) -> dict:
    section = {
        "format": FORMAT,
        "file": HEADS_FILE,
        "num_layers": len(stack.layers),
        "quantization": quantization,
        "provenance": provenance,
    }
    if "draft_vocab" in stack:
        section["draft_vocab_size"] = int(stack.draft_vocab.shape[0])
    return section


def read_section_file(model_path: Path, section: dict, default: str, what: str):
    """The tensors of the file a config section names (``what``: "MTP heads", "an
    assistant"), its format checked; one-line errors for the rest."""
    if section.get("format") != FORMAT:
        raise MTPError(
            f"{model_path}: {what} in format {section.get('format')!r}; this "
            f"mlx-mtp reads {FORMAT!r} (upgrade mlx-mtp or convert again)"
        )
    path = model_path / section.get("file", default)
    if not path.is_file():
        raise MissingHeadsError(f"{path} is missing (the config names {what})")
    safetensors_header(path)
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise MTPError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def load_heads(model_path: Path, config: dict, family, trunk) -> MTPStack:
    """Rebuild the heads of a conversion exactly as they were written."""
    section = config["mtp"]
    weights = read_section_file(model_path, section, HEADS_FILE, "MTP heads")
    layers = [family.make_layer(trunk, j, config) for j in range(section["num_layers"])]
    stack = MTPStack(layers, section.get("draft_vocab_size", 0))
    quantize_like(stack, weights, section.get("quantization"))
    return load_strict(stack, weights)


def source_fingerprint(folder: Path, sample: int = 1 << 16) -> Optional[str]:
    """sha256 of a checkpoint's token embedding (name, dtype, shape, first ``sample``
    bytes): cheap, independent of how the files are sharded or whether they hold MTP
    tensors, and different for checkpoints that share a layout but not their weights.
    The embedding is the family's ``EMBEDDING_KEY``: the shortest name ending with
    its last two parts (``embed_tokens.weight``), as Hugging Face and MLX files both
    name it. None when the config (of a supported family) or the file holding the
    embedding is absent (e.g. a partial download)."""
    index = folder / "model.safetensors.index.json"
    try:
        config = read_json(folder / "config.json")
        if not isinstance(config, dict):
            return None
        suffix = ".".join(get_family(config).EMBEDDING_KEY.split(".")[-2:])
        if index.is_file():
            weight_map = read_json(index)["weight_map"]
        else:
            weight_map = {
                k: "model.safetensors"
                for k in safetensors_header(folder / "model.safetensors")
            }
        if not isinstance(weight_map, dict):
            return None
    except (OSError, KeyError, TypeError, ValueError):  # MTPError is a ValueError
        return None
    names = sorted(
        (k for k in weight_map if k == suffix or k.endswith("." + suffix)), key=len
    )
    if not names or not (folder / weight_map[names[0]]).is_file():
        return None
    name, path = names[0], folder / weight_map[names[0]]
    try:
        info = safetensors_header(path)[name]
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            f.seek(8 + n + info["data_offsets"][0])
            data = f.read(
                min(sample, info["data_offsets"][1] - info["data_offsets"][0])
            )
    except (OSError, KeyError, ValueError):
        return None
    digest = hashlib.sha256(json.dumps([name, info["dtype"], info["shape"]]).encode())
    digest.update(data)
    return digest.hexdigest()

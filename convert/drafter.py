"""DSpark block drafters in the converter (the format is `mlx_mtp.models.dspark`'s):

- `convert_drafter`: a drafter checkpoint alone -> an MLX folder that
  ``--draft-model`` loads beside its target's conversion;
- `graft_drafter`: a drafter (a checkpoint or its conversion) stored beside an MLX
  conversion of its target (``graft DRAFTER --mlx-path TARGET``: `DRAFTER_FILE`
  and the config's ``drafter`` section), so that the folder alone runs the pair;
  only the drafter's config and weights are fetched.

Its layers (attention, MLP, ``fc``, the Markov and confidence heads where their
widths allow) are quantized at ``head_bits`` (affine, group 64), as MTP heads are;
16 keeps them float. The copies of the target's embedding and head that DeepSpec
drafters carry are kept as they came (cast to ``dtype`` if given): the loader drops
each when it is the target's, a quantized target's too (it quantizes the copy's
rows alike and compares them: `mlx_mtp.loading`), so no second V x H table is held.
"""

from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from mlx_mtp import assistant as assistants
from mlx_mtp.errors import MTPError
from mlx_mtp.heads import FORMAT, provenance, save_heads
from mlx_mtp.loading import (
    ASSISTANT_PATTERNS,
    DRAFTER_FILE,
    drop_shared_copies,
    dspark_with,
    has_drafter_section,
    load_trunk,
    read_config,
)
from mlx_mtp.models import dflash, dspark, get_family

from .assistant import _float_dtype, _source_name, _write_json
from .output import locked, remove_stale, replace_files, staged_folder
from .source import copy_side_files, resolve_source, snapshot_revision

GROUP_SIZE = 64
COPIES = ("embed_tokens", "lm_head")  # the target's tables, kept unquantized


def read_drafter(src: Path, config: dict, where: str, weights=None) -> dspark.DSpark:
    """The `DSpark` drafter of the checkpoint (or conversion) in ``src``, as it
    came; ``weights``: its tensors under DSpark's names, if read already."""
    dspark.DSparkSpec.from_config(config, where)  # one-line errors for a bad config
    if weights is None:
        weights = dspark.sanitize(assistants.read_weights(src))
    return dspark_with(config, weights, where)


def _cast(drafter: nn.Module, dtype: Optional[str]) -> None:
    if dtype is None:
        return
    to = getattr(mx, dtype)

    def cast(_, v):
        return v.astype(to) if mx.issubdtype(v.dtype, mx.floating) else v

    drafter.update(tree_map_with_path(cast, drafter.parameters()))


def quantize_drafter(drafter: nn.Module, bits: int) -> Optional[dict]:
    """Quantize the drafter's linear layers whose input width allows it, but the
    target's tables (`COPIES`); returns the config's quantization record (None
    for ``bits`` 16)."""
    if bits >= 16:
        return None

    def predicate(path, m):
        return (
            hasattr(m, "to_quantized")
            and path not in COPIES
            and m.weight.shape[-1] % GROUP_SIZE == 0
        )

    nn.quantize(drafter, group_size=GROUP_SIZE, bits=bits, class_predicate=predicate)
    return {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}


def convert_drafter(
    src: Path, source: str, revision, dst: Path, options, protect
) -> None:
    """Write the MLX conversion of the DSpark drafter checkpoint ``src`` to
    ``dst`` (a temporary folder renamed at the end)."""
    config = read_config(src)
    if config.get("quantization"):
        raise MTPError(f"{source} is already an MLX conversion; use it as it is")
    drafter = read_drafter(src, config, source)
    _cast(drafter, options.dtype)
    quantization = quantize_drafter(drafter, options.head_bits)
    mx.eval(drafter.parameters())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["mlx_mtp"] = provenance(
        source, options.head_bits, revision, None, dtype=options.dtype
    )
    if quantization:
        config["quantization"] = quantization
    with staged_folder(dst, options.overwrite, protect) as tmp:
        save_heads(tmp / "model.safetensors", drafter)
        _write_json(tmp / "config.json", config)
        copy_side_files(src, tmp, code=False)


def graft_drafter(
    hf_path: str,
    mlx_path: str,
    *,
    revision: Optional[str] = None,
    head_bits: int = 8,
    overwrite: bool = False,
) -> Path:
    """Store the DSpark drafter ``hf_path`` (a checkpoint, or its conversion as it
    is) beside the MLX conversion of its target at ``mlx_path``: checked against
    the target, its copies of the target's tables dropped (`drop_shared_copies`),
    cast to the trunk's float dtype and quantized at ``head_bits`` (16: float);
    every other file of the folder is left as it was."""
    dst = Path(mlx_path)
    remove_stale(dst)  # a killed graft's files: finished before the config is read
    config = read_config(dst)
    if has_drafter_section(config) and not overwrite:
        raise MTPError(f"{dst} already has a drafter (use --overwrite to replace it)")
    if assistants.has_assistant_section(config):
        raise MTPError(f"{dst} drafts with an assistant; it takes no DSpark drafter")
    src = resolve_source(hf_path, revision, ASSISTANT_PATTERNS)
    where = f"the DSpark drafter {hf_path}"
    d_config = read_config(src)
    if not dspark.is_dspark(d_config):
        raise MTPError(f"{hf_path} is not a DSpark drafter")
    dspark.check_pair(d_config, assistants.target_text_config(config), where)
    family = get_family(config)
    trunk, _, _ = load_trunk(dst, family, lazy=True)
    weights = dspark.sanitize(assistants.read_weights(src))
    weights = drop_shared_copies(trunk, family, family.text_args(trunk), weights)
    drafter = read_drafter(src, d_config, where, weights)
    quantization = d_config.get("quantization")
    if not quantization:
        _cast(drafter, _float_dtype(trunk))
        quantization = quantize_drafter(drafter, head_bits)
    mx.eval(drafter.parameters())
    kept = {k: v for k, v in d_config.items() if k not in ("quantization", "mlx_mtp")}
    record = provenance(
        _source_name(hf_path, src), head_bits, revision or snapshot_revision(src)
    )
    config["drafter"] = {
        "format": FORMAT,
        "file": DRAFTER_FILE,
        "config": {k: v for k, v in kept.items() if not k.startswith("_")},
        "quantization": quantization,
        "provenance": {**record, "grafted": True},
    }
    with locked(dst):
        replace_files(
            {
                dst / DRAFTER_FILE: lambda p: save_heads(p, drafter),
                dst / "config.json": lambda p: _write_json(p, config),
            }
        )
    return dst


def drafter_kind(path_or_repo: str, revision=None) -> Optional[str]:
    """The kind of block drafter a source (folder or hub repo) is: "DSpark",
    "DFlash" or "DFlash2"; None for none (only its config is fetched)."""
    config = read_config(resolve_source(path_or_repo, revision, ["config.json"]))
    if not dspark.is_dspark(config):
        return None
    return dflash.kind(config) or "DSpark"

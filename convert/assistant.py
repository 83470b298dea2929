"""Gemma 4 assistants in the converter (the format is `mlx_mtp.assistant`'s):

- `convert_assistant`: an assistant checkpoint alone -> an MLX assistant folder
  (quantized on its own: 8 bits by default with ``-q``, like MTP heads);
- `pair_section`: an assistant written beside its target's conversion (``convert
  --hf-path TARGET --draft-hf-path ASSISTANT``), so that the folder alone runs the
  pair while plain mlx-lm loads the target;
- `graft_assistant`: the same added to an existing MLX conversion of the target
  (``graft --from ASSISTANT``), fetching only the assistant's config and weights.
"""

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_map

from mlx_mtp import assistant as assistants
from mlx_mtp.errors import MTPError
from mlx_mtp.heads import provenance, quantize_heads
from mlx_mtp.loading import ASSISTANT_PATTERNS, load_trunk, read_config
from mlx_mtp.models import get_family
from mlx_mtp.models.gemma4 import text_model
from mlx_mtp.models.gemma4_assistant import Assistant

from .output import locked, remove_stale, replace_files, staged_folder
from .source import copy_side_files, resolve_source, snapshot_revision


def read_assistant_config(src: Path, where: str) -> dict:
    """The config of the assistant checkpoint in ``src``, checked."""
    config = read_config(src)
    assistants.check_config(config, where)
    if config.get("quantization"):
        raise MTPError(f"{where} is already an MLX conversion; use it as it is")
    return config


def read_assistant(src: Path, config: dict) -> Assistant:
    """The `Assistant` of the checkpoint in ``src``, float."""
    return assistants.build(config, assistants.read_weights(src), None)


def _prepare(assistant: Assistant, dtype, bits: int) -> Optional[dict]:
    """Cast to ``dtype`` (if given), quantize at ``bits`` (16: keep floats)."""
    if dtype is not None:
        assistant.update(_cast(assistant.parameters(), getattr(mx, dtype)))
    quantization = quantize_heads(assistant, bits)
    mx.eval(assistant.parameters())
    return quantization


def _cast(params, dtype):
    def cast(v):
        return v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v

    return tree_map(cast, params)


def _source_name(path_or_repo: str, src: Path) -> str:
    local = Path(path_or_repo).expanduser().exists()
    return str(src.resolve()) if local else path_or_repo


def convert_assistant(
    src: Path, source: str, revision, dst: Path, options, protect
) -> None:
    """Write the MLX conversion of the assistant checkpoint ``src`` to ``dst``."""
    config = read_assistant_config(src, source)
    assistant = read_assistant(src, config)
    bits = options.head_bits
    quantization = _prepare(assistant, options.dtype, bits)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["mlx_mtp"] = provenance(source, bits, revision, None, dtype=options.dtype)
    if quantization:
        config["quantization"] = quantization
    with staged_folder(dst, options.overwrite, protect) as tmp:
        assistants.save(tmp / "model.safetensors", assistant)
        _write_json(tmp / "config.json", config)
        copy_side_files(src, tmp, code=False)


def pair_section(
    draft_path: str,
    revision,
    trunk,
    target_config: dict,
    target_dir: Path,
    dtype,
    bits: int,
) -> Tuple[Assistant, dict]:
    """The assistant ``draft_path`` checked against the (lazy) target ``trunk`` from
    ``target_dir``, cast and quantized; with its config section. Raises one-line
    errors on a mismatch."""
    src = resolve_source(draft_path, revision, ASSISTANT_PATTERNS)
    where = f"the assistant {draft_path}"
    config = read_assistant_config(src, where)
    assistants.check_pair(config, target_config, where)
    assistants.check_tokenizers(src, target_dir)
    assistant = read_assistant(src, config)
    assistants.check_layers(assistant, trunk, where)
    quantization = _prepare(assistant, dtype, bits)
    record = provenance(
        _source_name(draft_path, src), bits, revision or snapshot_revision(src)
    )
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    return assistant, assistants.section(config, quantization, record)


def graft_assistant(
    hf_path: str,
    mlx_path: str,
    *,
    revision: Optional[str] = None,
    head_bits: int = 8,
    overwrite: bool = False,
) -> Path:
    """Add the assistant ``hf_path`` to the MLX conversion of its target at
    ``mlx_path`` (``assistant.safetensors`` and the config's ``assistant`` section;
    every other file, ``vision_config`` included, is left as it was)."""
    dst = Path(mlx_path)
    remove_stale(dst)  # a killed graft's files: finished before the config is read
    config = read_config(dst)
    if assistants.has_assistant_section(config) and not overwrite:
        raise MTPError(
            f"{dst} already has an assistant (use --overwrite to replace it)"
        )
    family = get_family(config)
    trunk, _, _ = load_trunk(dst, family, lazy=True)
    dtype = _float_dtype(trunk)
    assistant, section = pair_section(
        hf_path, revision, trunk, config, dst, dtype, head_bits
    )
    section["provenance"]["grafted"] = True
    config["assistant"] = section
    with locked(dst):
        replace_files(
            {
                dst
                / assistants.ASSISTANT_FILE: lambda p: assistants.save(p, assistant),
                dst / "config.json": lambda p: _write_json(p, config),
            }
        )
    return dst


def _float_dtype(trunk) -> str:
    dtype = text_model(trunk).model.norm.weight.dtype
    return {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32")


def _write_json(path: Path, config: dict) -> None:
    path.write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")


def is_assistant_source(path_or_repo: str, revision=None) -> bool:
    """Whether a source (folder or hub repo) is an assistant checkpoint (only its
    config is fetched)."""
    src = resolve_source(path_or_repo, revision, ["config.json"])
    return assistants.is_assistant(read_config(src))

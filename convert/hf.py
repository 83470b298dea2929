"""``mlx-mtp convert``: a Hugging Face checkpoint (or llama-family GGUF file) with MTP
heads -> an MLX folder.

The trunk goes through the runtime's own loader (mlx-lm's class and sanitize, with the
MTP tensors set aside), mlx-lm's quantization and dtype casting, and is written as
mlx-lm writes it. The heads go through the family's sanitize (the same code that loads
a raw checkpoint) and are written, quantized at ``head_bits``, to ``mtp.safetensors``.
Weights are loaded lazily and written one shard at a time.
"""

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path

from mlx_mtp import assistant as assistants
from mlx_mtp import draft_vocab, tables
from mlx_mtp.assistant import is_assistant
from mlx_mtp.errors import MissingHeadsError, MTPError
from mlx_mtp.heads import (
    HEADS_FILE,
    heads_section,
    provenance,
    quantize_heads,
    quantized_modes,
    save_heads,
)
from mlx_mtp.loading import (
    build_mtp,
    check_declared,
    load_model,
    load_trunk,
    read_config,
)
from mlx_mtp.models import dspark, get_family

from .assistant import convert_assistant, pair_section
from .drafter import convert_drafter
from .gguf import gguf_to_hf, is_gguf
from .output import (
    check_destination,
    remove_stale,
    save_trunk,
    scratch_path,
    staged_folder,
)
from .source import check_source, copy_side_files, resolve_source, snapshot_revision

log = logging.getLogger("mlx_mtp")

DTYPES = ("float16", "bfloat16", "float32")
Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


@dataclass(frozen=True)
class Options:
    """What `convert` writes.

    Attributes:
        quantize, q_bits, q_group_size, q_mode: Trunk quantization, as mlx-lm's convert.
        head_bits: 4 or 8 to quantize the heads (affine, group 64), 16 to keep them in
            the float dtype. Default (None): 8 when the trunk is quantized, else 16.
        dtype: Float dtype of the unquantized parameters (default: the checkpoint's;
            float32 for GGUF, whose quantized weights are dequantized).
        overwrite: Replace an existing output (a model folder only, see
            `mlx_mtp.convert.output.check_destination`).
        require_heads: Refuse a checkpoint without MTP tensors (default: warn).
        shard_gb: Largest output shard.
        progress: Show a progress bar.
        copy_code: Copy the source's ``*.py`` files (custom tokenizer or model code,
            run only with ``trust_remote_code``); default: leave them out, with a
            warning.
        rank_vocab: Rank the vocabulary for draft vocabularies (`mlx_mtp.draft_vocab`:
            one pass of the converted model over a built-in text) and store the
            ranking with the heads.
    """

    quantize: bool = False
    q_bits: Optional[int] = None
    q_group_size: Optional[int] = None
    q_mode: str = "affine"
    head_bits: Optional[int] = None
    dtype: Optional[str] = None
    overwrite: bool = False
    require_heads: bool = False
    shard_gb: float = 5.0
    progress: bool = True
    copy_code: bool = False
    rank_vocab: bool = True

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DTYPES:
            raise MTPError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.q_mode not in Q_MODES:
            raise MTPError(f"q_mode must be one of {', '.join(Q_MODES)}")
        if self.head_bits is None:
            object.__setattr__(self, "head_bits", 8 if self.quantize else 16)
        if self.head_bits not in (4, 8, 16):
            raise MTPError("head_bits must be 4, 8 or 16")


def convert(
    hf_path: str,
    mlx_path: str,
    *,
    revision: Optional[str] = None,
    upload_repo: Optional[str] = None,
    draft_hf_path: Optional[str] = None,
    **options,
) -> Path:
    """Convert ``hf_path`` (folder, hub repo, or llama-family ``.gguf`` file) into the
    MLX folder ``mlx_path``. A Gemma 4 assistant checkpoint becomes an MLX assistant
    (quantized at ``head_bits``).

    Args:
        revision: Hub revision of the source.
        upload_repo: Upload the result to this hub repo.
        draft_hf_path: A Gemma 4 assistant (folder or hub repo) to write beside the
            target, so that the folder runs the pair (`mlx_mtp.assistant`).
        options: What to write, the fields of `Options`.

    Returns:
        The output folder.
    """
    options = Options(**options)
    overwrite, dtype = options.overwrite, options.dtype
    dst = Path(mlx_path).expanduser()
    if is_gguf(hf_path):
        gguf = Path(hf_path).expanduser().resolve()
        check_destination(dst, overwrite, inputs=[gguf])
        dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(dst)
        tmp = scratch_path(dst, "gguf")
        try:
            tmp.mkdir()
            src = gguf_to_hf(gguf, tmp, dtype or "float32")
            _convert_folder(src, str(gguf), None, dst, options, [gguf], draft_hf_path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        if not Path(hf_path).expanduser().exists():
            warn_if_too_big(hf_path, revision, options)
        src = resolve_source(hf_path, revision)
        check_destination(dst, overwrite, sources=[src])
        source = str(src.resolve()) if Path(hf_path).expanduser().exists() else hf_path
        revision = revision or snapshot_revision(src)
        if draft_hf_path is not None:
            draft = Path(draft_hf_path).expanduser()
            protect = [src] + ([draft.resolve()] if draft.exists() else [])
            check_destination(dst, overwrite, sources=protect)
        else:
            protect = [src]
        _convert_folder(src, source, revision, dst, options, protect, draft_hf_path)
    if upload_repo:
        _upload(dst, upload_repo, hf_path)
    return dst


def converted_bytes(source_bytes: int, options: Options, source_bits: int = 16) -> int:
    """About how many bytes a conversion of ``source_bytes`` of weights stored at
    ``source_bits`` a value takes: quantized, ``q_bits`` a value plus a 16-bit
    scale and bias per group (affine; one 8-bit scale per 32 for mx/nv modes);
    else the dtype's width (the source's by default)."""
    values = source_bytes * 8 / source_bits
    if options.quantize:
        bits, group = options.q_bits or 4, options.q_group_size or 64
        per_value = bits + (8 / 32 if options.q_mode != "affine" else 32 / group)
        return int(values * per_value / 8)
    width = {"float32": 32, "float16": 16, "bfloat16": 16}.get(options.dtype or "", 0)
    return int(values * (width or source_bits) / 8)


def warn_if_too_big(repo: str, revision: Optional[str], options: Options) -> None:
    """Before a hub checkpoint downloads: a warning when its conversion will not fit
    the memory MLX can use here (`mlx_mtp.memory`), read off the hub's file sizes (a
    conversion for another machine is fine, so it goes on). Silent when the hub
    cannot say."""
    from mlx_mtp.memory import memory_limit, readable_size

    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        sizes = [
            f.size or 0
            for f in info.siblings or ()
            if f.rfilename.endswith(".safetensors")
        ]
    except Exception:  # offline, gated, unknown: nothing to say
        return
    bits = 8 if any("fp8" in t.lower() for t in (info.tags or ())) else 16
    need = converted_bytes(sum(sizes), options, bits)
    limit, source = memory_limit()
    if need > limit:
        log.warning(
            "%s converts to about %s, more than the %s MLX can use here (%s): the "
            "conversion goes on, but the result will not load on this machine "
            "without --force (fewer bits: -q --q-bits 4)",
            repo,
            readable_size(need),
            readable_size(limit),
            source,
        )


def _convert_folder(
    src: Path, source: str, revision, dst: Path, o: Options, protect, draft=None
) -> None:
    """Convert the checkpoint folder ``src`` (named ``source`` in the provenance), with
    the assistant ``draft`` beside it if given; ``protect``: the user's inputs, which
    ``dst`` may not hold or lie in."""
    check_source(src)
    src_config = read_config(src)
    if is_assistant(src_config):
        if draft is not None:
            raise MTPError(f"{source} is an assistant itself: it takes no assistant")
        return convert_assistant(src, source, revision, dst, o, protect)
    if dspark.is_dspark(src_config):
        if draft is not None:
            raise MTPError(f"{source} is a DSpark drafter: it takes no assistant")
        return convert_drafter(src, source, revision, dst, o, protect)
    if draft is not None and dspark.is_dspark(_draft_config(draft)):
        raise MTPError(
            f"{draft} is a DSpark drafter: convert it alone (--hf-path) for "
            "--draft-model, or graft it onto the target's conversion"
        )
    family = get_family(src_config)
    trunk, config, split = load_trunk(src, family, lazy=True)
    if getattr(trunk, "vision_refusal", None):  # the conversion reads text only
        log.warning("the vision tower is left out: %s", trunk.vision_refusal)
    stack = None
    if not split.mtp and draft is None:
        msg = f"{source} has no MTP tensors"
        if o.require_heads:
            raise MissingHeadsError(msg)
        hint = " (Gemma 4 drafts with an assistant: --draft-hf-path)"
        log.warning(
            "%s; converting the trunk only%s",
            msg,
            hint if family.name.startswith("gemma4") else "",
        )
    elif check_declared(family, config, split.mtp, allow_missing_heads=False):
        stack = build_mtp(trunk, family, split.mtp, config, split.raw)
        check_head_dtypes(stack, source)

    dtype = o.dtype or config.get("torch_dtype") or config.get("dtype")
    dtype = dtype or config.get("text_config", {}).get("dtype")
    assistant = None
    if draft is not None:
        float_dtype = dtype if dtype in DTYPES else None
        assistant, section = pair_section(
            draft, None, trunk, config, src, float_dtype, o.head_bits
        )
    if dtype in DTYPES:
        _cast(trunk, getattr(mx, dtype), getattr(trunk, "cast_predicate", None))
        if stack is not None:
            _cast(stack, getattr(mx, dtype), None)
    trunk_quant = None
    # A release's packed layers (DeepSeek-V4's mxfp8/mxfp4) stay as released; -q
    # quantizes the float ones, and the config names every packed layer's mode.
    packed = quantized_modes(trunk)
    if o.quantize:
        from mlx_lm.utils import quantize_model

        config.pop("quantization", None)  # so that -q's settings are the default
        trunk, config = quantize_model(
            trunk, config, o.q_group_size, o.q_bits, mode=o.q_mode
        )
        q = config["quantization"]  # -q's settings, mlx-lm's defaults filled in
        q.update(
            tables.quantize_tables(
                trunk, family.MAPPED_TABLES, q["bits"], q["group_size"], q["mode"]
            )
        )
        trunk_quant = {
            k: config["quantization"][k] for k in ("group_size", "bits", "mode")
        }
    if packed:
        config["quantization"] = {**config["quantization"], **packed}
        config["quantization_config"] = config["quantization"]
    heads_quant = quantize_heads(stack, o.head_bits) if stack is not None else None

    record = provenance(
        source,
        o.head_bits if stack is not None else None,
        revision,
        src,
        trunk_quantization=trunk_quant,
        dtype=dtype,
    )
    config["mlx_mtp"] = record
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        del config["quantization_config"]  # dequantized or repacked on the way
    with staged_folder(dst, o.overwrite, protect) as tmp:
        if stack is not None:
            save_heads(tmp / HEADS_FILE, stack)
            config["mtp"] = heads_section(stack, heads_quant, record)
        if assistant is not None:
            assistants.save(tmp / assistants.ASSISTANT_FILE, assistant)
            config["assistant"] = section
        save_trunk(tmp, trunk, o.shard_gb, o.progress)
        _save_config(config, tmp)
        copy_side_files(src, tmp, code=o.copy_code)
        if stack is not None and o.rank_vocab and "draft_vocab" not in stack:
            _store_ranking(tmp, config)


def _draft_config(draft: str) -> dict:
    """The config of the draft model ``draft`` (a folder or hub repo; only its
    config is fetched)."""
    return read_config(resolve_source(draft, None, ["config.json"]))


def _store_ranking(folder: Path, config: dict) -> None:
    """Rank the vocabulary of the conversion written in ``folder`` for draft
    vocabularies (`mlx_mtp.draft_vocab`), as it will run: quantized if it is."""
    ranked = draft_vocab.rank_folder(folder, load_model(str(folder), group=None)[0])
    if ranked is None:
        log.warning("no tokenizer in the output: the vocabulary is ranked on first use")
        return
    ranking, entry = ranked
    draft_vocab.save_ranking(folder / draft_vocab.FILE, ranking)
    config["mtp"]["draft_vocab"] = entry
    _save_config(config, folder)


def check_head_dtypes(stack, source: str) -> None:
    """Refuse heads that are neither floating point nor quantized as MLX stores them
    (uint32 weights beside their scales, which are floating point or, in the mx*
    modes, uint8): they would be written as they are, or fail to quantize."""
    params = dict(tree_flatten(stack.parameters()))
    for key, value in params.items():
        if not key.startswith("layers.") or mx.issubdtype(value.dtype, mx.floating):
            continue
        base, _, leaf = key.rpartition(".")
        weight = params.get(f"{base}.weight")
        quantized = f"{base}.scales" in params and weight.dtype == mx.uint32
        if quantized and leaf in ("weight", "scales"):
            continue
        dtype = str(value.dtype).rpartition(".")[2]
        raise MTPError(
            f"{source}: the MTP tensor {key} is {dtype}; heads must be floating point "
            "(or quantized as MLX stores them: uint32 weights with scales)"
        )


def _cast(module, dtype, predicate) -> None:
    """Cast floating parameters to ``dtype`` (those ``predicate(path)`` allows)."""

    def cast(path, v):
        if mx.issubdtype(v.dtype, mx.floating) and (
            predicate is None or predicate(path)
        ):
            return v.astype(dtype)
        return v

    module.update(tree_map_with_path(cast, module.parameters()))


def _save_config(config: dict, folder: Path, name: str = "config.json") -> None:
    """Write ``config`` as mlx-lm does; ``vision_config`` is kept for a model
    whose vision tower the conversion keeps (one that reads images)."""
    from mlx_lm.utils import save_config

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        keep = get_family(config).media is not None
    except MTPError:
        keep = False
    save_config(config, folder / name, keep_vision_config=keep)


def _upload(folder: Path, repo: str, source: str) -> None:
    from mlx_lm.utils import create_model_card, upload_to_hub

    hub_source = None if Path(source).expanduser().exists() else source
    try:
        create_model_card(folder, hub_source)
        upload_to_hub(str(folder), repo)
    except Exception as e:  # hub errors have many types
        raise MTPError(f"upload to {repo} failed: {str(e).splitlines()[0]}") from None

"""Load a checkpoint with its MTP heads.

    load(path_or_hf_repo) -> (model, tokenizer)

The trunk is built by mlx-lm's own class for the ``model_type`` through mlx-lm's
``load_model`` (so quantized MLX conversions load exactly as mlx-lm loads them); the
only change is a sanitize that first sets the MTP tensors aside. Those are translated by
the family module and loaded strictly into an `MTPStack`. The tables a family reads by
row (``MAPPED_TABLES``) are memory-mapped from their files, not loaded
(`mlx_mtp.tables`).
"""

import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import assistant as assistants
from . import distributed, draft_vocab, memory, tables
from .errors import MissingHeadsError, MTPError, one_line
from .files import check_not_mid_update, read_json, safetensors_header
from .heads import (
    has_heads_file,
    load_heads,
    load_strict,
    quantize_like,
    read_section_file,
)
from .models import dflash, dspark, gemma4_dspark, get_family
from .models.base import Model
from .models.mtp import MTPStack

log = logging.getLogger("mlx_mtp")


def resolve(
    path_or_hf_repo: str,
    revision: Optional[str] = None,
    allow_patterns: Optional[List[str]] = None,
) -> Path:
    """A local folder, or a Hugging Face repo downloaded exactly as mlx-lm does (only
    the files matching ``allow_patterns``, default mlx-lm's)."""
    # mlx-lm's own hub download (its allow-patterns and cache layout); mlx-lm 0.32
    # (pinned) has no public function for it.
    from mlx_lm.utils import _download

    path = Path(path_or_hf_repo).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix.lower() == ".gguf" and magic != b"GGUF":
            raise MTPError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        if magic == b"GGUF":
            raise MTPError(
                f"{path} is a GGUF file: convert it first "
                f"(mlx-mtp convert --hf-path {path} --mlx-path OUT)"
            )
        raise MTPError(f"{path} is a file, not a model folder")
    if path.exists():
        if not (path / "config.json").is_file():
            raise MTPError(f"{path} has no config.json: not a model folder")
        return path
    if path_or_hf_repo.startswith((".", "/", "~")) or path_or_hf_repo.count("/") != 1:
        raise MTPError(f"model path {path_or_hf_repo!r} does not exist")
    try:
        return _download(path_or_hf_repo, revision, allow_patterns)
    except Exception as e:  # hub errors have many types; all mean "cannot get it"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise MTPError(
            f"no folder {path_or_hf_repo!r} here, and cannot fetch it from the "
            f"Hugging Face hub: {reason}"
        ) from None


# Config fields that must be whole numbers (or null) and plain numbers, where present.
INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
PER_LAYER_FIELDS = ("rope_theta",)  # Step-3.5 lists one per layer


def read_config(model_path: Path) -> dict:
    """``config.json`` of a model folder, checked to be an object whose size fields
    are numbers (a one-line `MTPError` otherwise)."""
    path = model_path / "config.json"
    config = read_json(path)
    check_config(config, path)
    return config


# JSON files of a model folder that mlx-lm or transformers parse after mlx-mtp.
FOLDER_JSON = ("tokenizer_config.json", "generation_config.json")


def check_folder_json(model_path: Path) -> None:
    """Refuse a model folder whose `FOLDER_JSON` files (those present) are not JSON
    objects, in one line naming the file, before another library parses them (and
    fails with a traceback, or ignores a malformed ``generation_config.json``)."""
    for name in FOLDER_JSON:
        path = model_path / name
        if path.is_file() and not isinstance(read_json(path), dict):
            raise MTPError(f"{path} is not a JSON object")


def check_config(config, path) -> None:
    """Refuse a config that is not an object, or whose fields have the wrong type."""
    if not isinstance(config, dict):
        raise MTPError(f"{path} is not a JSON object")
    text = config.get("text_config", {})
    if not isinstance(text, dict):
        raise MTPError(f"{path}: text_config is not an object")
    if not isinstance(config.get("model_type", ""), str):
        raise MTPError(f"{path}: model_type is not a string")
    for section in (config, text):
        for key in INT_FIELDS:
            v = section.get(key)
            if v is not None and (type(v) is not int or v < 0):
                raise MTPError(f"{path}: {key} must be a whole number, not {v!r}")
        for key in FLOAT_FIELDS:
            v = section.get(key)
            if v is not None and not _is_number(v, key in PER_LAYER_FIELDS):
                raise MTPError(f"{path}: {key} must be a number, not {v!r}")


def _is_number(v, per_layer: bool) -> bool:
    """A JSON number, or (``per_layer``) a non-empty list of them."""
    if per_layer and isinstance(v, list) and v:
        return all(type(x) in (int, float) for x in v)
    return type(v) in (int, float)


class MTPSplit:
    """A ``get_model_classes`` for mlx-lm's ``load_model`` whose model class sets the
    MTP tensors aside, and the tensors it set aside.

    mlx-lm's loader reads every weight file and hands all tensors to the model class's
    ``sanitize`` once, before it loads them strictly (an unknown name is an error).
    That call is the one place where the MTP tensors pass by, so the subclass's
    sanitize takes them out there (after dequantizing FP8 checkpoints) and keeps them
    in ``mtp``, with ``raw``, whether the family's raw Hugging Face fixes apply.
    ``load_model``'s ``get_model_classes`` is public and documented as defaulting to
    ``_get_classes``, the model_type -> class mapping, which mlx-lm 0.32 (pinned)
    exposes under no public name; this wraps it.
    """

    def __init__(self, family, tables: Optional[Dict[str, tables.Stored]] = None):
        self.family = family
        self.mtp: Dict[str, mx.array] = {}
        self.raw = True
        self.tables = tables

    def __call__(self, config: dict):
        from mlx_lm.utils import _get_classes

        classes = self.family.trunk_classes or _get_classes
        model_class, args_class = classes(config)
        split = self

        class Trunk(model_class):
            def sanitize(self, weights):
                raw_names = {id(v): (k, v) for k, v in weights.items()}
                weights = dequantize_fp8(weights, fp8_block(config))
                split.raw = split.family.is_raw(weights, config)
                weights, split.mtp = split.family.split_weights(weights, config)
                if hasattr(model_class, "sanitize"):
                    weights = model_class.sanitize(self, weights)
                if split.tables:
                    weights = tables.map_tables(
                        self,
                        weights,
                        raw_names,
                        split.tables,
                        split.family.MAPPED_TABLES,
                        config.get("quantization"),
                    )
                return weights

        Trunk.__name__ = Trunk.__qualname__ = model_class.__name__
        return Trunk, args_class


def fp8_block(config: dict) -> Tuple[int, int]:
    """Block size of a Hugging Face FP8 checkpoint's ``weight_scale_inv`` (default
    128)."""
    q = config.get("quantization_config") or {}
    return tuple(q.get("weight_block_size") or (128, 128))


def dequantize_fp8(weights: dict, block: Tuple[int, int] = (128, 128)) -> dict:
    """Dequantize block-scaled FP8 weights (DeepSeek / GLM releases) to bfloat16.

    A ``W.weight`` stored as float8 e4m3 (read as uint8) with ``W.weight_scale_inv`` of
    shape ``(ceil(out / bm), ceil(in / bn))`` becomes ``from_fp8(weight) * scale`` per
    block; other tensors pass through. Lazy, like the rest of loading.
    """
    if not any(k.endswith(".weight_scale_inv") for k in weights):
        return weights
    bm, bn = block
    out = {}
    for key, value in weights.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale = weights.get(key + "_scale_inv") if key.endswith(".weight") else None
        if scale is not None:
            m, n = value.shape
            w = mx.from_fp8(value, dtype=mx.float32)
            s = mx.repeat(mx.repeat(scale.astype(mx.float32), bm, 0), bn, 1)[:m, :n]
            value = (w * s).astype(mx.bfloat16)
        out[key] = value
    return out


def config_fixes(config: dict, family=None) -> dict:
    """The family's `fix_config`, and config keys mlx-lm's ModelArgs need that a
    transformers-5 config only has inside ``rope_parameters`` (flat ``rope_theta``,
    ``partial_rotary_factor``, and ``rope_scaling`` for non-default RoPE such as
    DeepSeek's YaRN). Nested text configs (Qwen3.5) are read from ``rope_parameters``
    by mlx-lm itself."""
    fixes = family.fix_config(config) if family is not None else {}
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "text_config" in config:
        return fixes
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope and key not in config:
            fixes[key] = rope[key]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default" and not config.get("rope_scaling"):
        fixes["rope_scaling"] = {
            k: v
            for k, v in rope.items()
            if k not in ("rope_theta", "partial_rotary_factor")
        }
    return fixes


def load_trunk(
    model_path: Path, family, lazy: bool, map_tables: bool = False
) -> Tuple[nn.Module, dict, MTPSplit]:
    """Build the trunk with mlx-lm; returns ``(trunk, config, split)``, ``split``
    holding the checkpoint's MTP tensors (see `MTPSplit`).

    Args:
        map_tables: Read the family's ``MAPPED_TABLES`` by row from their files
            (`mlx_mtp.tables`) instead of loading them (a conversion, which writes
            them, loads them).
    """
    from mlx_lm.utils import load_model

    located = None
    if map_tables and family.MAPPED_TABLES:
        located = tables.locate(model_path, family.MAPPED_TABLES)
    split = MTPSplit(family, located)
    try:
        trunk, config = load_model(
            model_path,
            lazy=True,
            model_config=config_fixes(read_config(model_path), family),
            get_model_classes=split,
        )
        if not lazy:
            mx.eval(trunk.parameters())
    except MTPError:
        raise
    except FileNotFoundError as e:
        raise MTPError(f"{model_path}: {e}") from None
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise MTPError(
            f"cannot load the trunk from {model_path}: {one_line(e)}"
        ) from None
    except (TypeError, AttributeError, IndexError) as e:  # a mistyped config field
        raise MTPError(
            f"cannot build the model from {model_path / 'config.json'} "
            f"(a field of the wrong type?): {one_line(e)}"
        ) from None
    if family.prepare is not None:
        family.prepare(trunk)
    return trunk, config, split


def build_mtp(
    trunk: nn.Module, family, tensors: dict, config: dict, raw: bool = True
) -> MTPStack:
    """Build and strictly load the MTP layers from their checkpoint tensors.

    Args:
        raw: The checkpoint is in raw Hugging Face form (see the family's ``is_raw``).

    Raises:
        MissingHeadsError: the family's MTP tensors are a block drafter
            (``make_drafter``: loaded by `attach_own_drafter`, not kept as heads).
    """
    if family.make_drafter is not None:
        raise MissingHeadsError(
            f"{family.name}'s MTP tensors are a block drafter, not MTP layers: "
            "it drafts from the original checkpoint, and no conversion keeps it yet"
        )
    weights = family.sanitize(tensors, config, trunk, raw=raw)
    n = 1 + max(int(k.split(".")[1]) for k in weights)
    stack = MTPStack([family.make_layer(trunk, j, config) for j in range(n)])
    quantize_like(stack, weights, config.get("quantization"))
    return load_strict(stack, weights)


def check_declared(family, config: dict, raw: dict, allow_missing_heads: bool) -> bool:
    """Cross-check MTP tensors with the config; True when heads should be built."""
    declared = family.declared_mtp_layers(config)
    found = {family.mtp_layer_of(k, config) for k in raw}
    if declared and len(found) < declared:
        what = "no MTP tensors" if not found else f"tensors for {len(found)} only"
        msg = (
            f"config declares {declared} MTP layer(s) ({family.MTP_CONFIG_KEYS[0]}) "
            f"but the checkpoint has {what}"
        )
        if not allow_missing_heads:
            raise MissingHeadsError(
                msg + " (use --allow-missing-heads to decode without)"
            )
        log.warning("%s; decoding without MTP heads", msg)
        return False
    if found and not declared and family.MTP_CONFIG_KEYS:
        log.warning("MTP tensors found but the config declares none; using them")
    return bool(found)


def load_model(
    path_or_hf_repo: str,
    *,
    revision: Optional[str] = None,
    allow_missing_heads: bool = False,
    lazy: bool = False,
    draft_model: Optional[str] = None,
    group: Any = "auto",
    force: bool = False,
) -> Tuple[Model, dict, Path]:
    """Load a model with its MTP heads (no tokenizer).

    Returns:
        ``(model, config, model_path)``. See `load` for the arguments.
    """
    group = distributed.launched() if group == "auto" else group
    if group is not None and group.size() == 1:
        group = None
    loaded, error = None, None
    try:
        loaded = _load_model(
            path_or_hf_repo,
            revision,
            allow_missing_heads,
            lazy,
            draft_model,
            group,
            force,
        )
    except Exception as e:  # every rank must reach the check below, failed or not
        if group is None:
            raise
        error = e
    distributed.Sync(group).all_ok(error)
    return loaded


def _load_model(
    path_or_hf_repo: str,
    revision: Optional[str],
    allow_missing_heads: bool,
    lazy: bool,
    draft_model: Optional[str],
    group,
    force: bool = False,
) -> Tuple[Model, dict, Path]:
    """`load_model` on this rank: the trunk sharded over ``group`` (if any), the MTP
    heads whole; weights that do not fit the machine refused unless ``force``
    (`mlx_mtp.memory.check_fits`)."""
    model_path = resolve(path_or_hf_repo, revision)
    config = read_config(model_path)
    if not force:
        folders = [model_path]
        if draft_model is not None and Path(draft_model).is_dir():
            folders.append(Path(draft_model))
        mapped = _table_bytes(model_path, config)
        memory.check_fits(folders, 1 if group is None else group.size(), mapped)
    if assistants.is_assistant(config):
        raise MTPError(
            f"{model_path} is a Gemma 4 assistant, a drafter for a Gemma 4 model: load "
            f"the model and pass this as its draft model (--draft-model {model_path})"
        )
    family = get_family(config)
    check_not_mid_update(model_path)
    check_folder_json(model_path)
    check_shards(model_path)
    for f in sorted(model_path.glob("model*.safetensors")):
        safetensors_header(f)  # a truncated or malformed file: one line naming it
    lazy_trunk = lazy or group is not None
    trunk, config, split = load_trunk(model_path, family, lazy_trunk, map_tables=True)
    stack = MTPStack([])
    if has_heads_file(config):  # an mlx-mtp conversion
        try:
            stack = load_heads(model_path, config, family, trunk)
        except MissingHeadsError as e:
            _without(e, allow_missing_heads, "MTP heads")
            stack = MTPStack([])
        if not lazy:
            mx.eval(stack.parameters())
    elif family.make_drafter is None and check_declared(
        family, config, split.mtp, allow_missing_heads
    ):
        try:
            stack = build_mtp(trunk, family, split.mtp, config, split.raw)
        except MissingHeadsError as e:
            _without(e, allow_missing_heads, "MTP heads")
            stack = MTPStack([])
        if not lazy:
            mx.eval(stack.parameters())
    model = Model(trunk, stack, family, source=model_path)
    if stack.layers and has_heads_file(config):
        model.vocab_ranking = _stored_ranking(model_path, config, model)
    if group is not None:
        model.group, model.sharding = group, distributed.shard(trunk, group)
    if draft_model is not None:
        attach_assistant(model, config, model_path, draft_model)
    elif family.make_drafter is not None and split.mtp:
        attach_own_drafter(model, split.mtp, config, allow_missing_heads)
    elif has_drafter_section(config):
        attach_drafter_section(model, config, model_path, allow_missing_heads)
    elif assistants.has_assistant_section(config):
        try:
            assistant = assistants.load_section(model_path, config)
        except MissingHeadsError as e:
            _without(e, allow_missing_heads, "the assistant")
        else:
            where = f"the assistant in {model_path}"
            assistants.check_pair(config["assistant"]["config"], config, where)
            reads = assistants.check_layers(assistant, trunk, where)
            model.attach(assistant, reads, model_path)
    if not lazy:
        evaluate_all(model)
    model.eval()
    return model, config, model_path


def _table_bytes(model_path: Path, config: dict) -> int:
    """The bytes of the tables a load maps (`mlx_mtp.tables`), 0 for a model type
    not known here (its load then says why in one line)."""
    try:
        markers = get_family(config).MAPPED_TABLES
    except MTPError:
        return 0
    return tables.stored_bytes(model_path, markers)


def _stored_ranking(model_path: Path, config: dict, model: Model):
    """The draft vocabulary ranking a conversion stores (`mlx_mtp.draft_vocab`); one
    that cannot be read is ranked again on first use, with a warning."""
    try:
        return draft_vocab.load_stored(model_path, config["mtp"], model.args.vocab_size)
    except MTPError as e:
        log.warning("%s; the vocabulary is ranked again when first needed", e)
        return None


def check_shards(model_path: Path) -> None:
    """Refuse a folder whose ``model.safetensors.index.json`` names a weight file that
    is not there (a partial copy or download), naming the first one missing."""
    index = model_path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = read_json(index, "the weight index")["weight_map"]
        names = sorted(set(weight_map.values()))
    except MTPError:
        raise
    except (KeyError, TypeError, AttributeError):
        raise MTPError(f"cannot read the weight index {index}") from None
    missing = [n for n in names if not (model_path / str(n)).is_file()]
    if missing:
        raise MTPError(
            f"{model_path} lacks {missing[0]}, which its weight index names"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


def evaluate_all(module: nn.Module) -> None:
    """Evaluate every array of a module, parameters and private ones (precomputed RoPE
    frequencies, say): a lazy array left behind would be evaluated later on the
    loading thread's stream, which another thread (a server's) cannot use."""
    arrays = []
    for m in module.modules():
        for value in m.values():
            if isinstance(value, mx.array):
                arrays.append(value)
            elif isinstance(value, (list, tuple)):
                arrays.extend(v for v in value if isinstance(v, mx.array))
    mx.eval(arrays)


def _without(e: MissingHeadsError, allowed: bool, what: str) -> None:
    """Decode without ``what`` (with a warning) when allowed; else the error, with
    the flag that allows it."""
    if not allowed:
        raise MissingHeadsError(
            f"{e} (use --allow-missing-heads to decode without)"
        ) from None
    log.warning("%s; decoding without %s", e, what)


DRAFTER_FILE = "drafter.safetensors"  # a DSpark drafter kept beside a conversion


def has_drafter_section(config: dict) -> bool:
    """Whether a conversion keeps a DSpark drafter beside its trunk (``graft``)."""
    return isinstance(config.get("drafter"), dict)


# Files of an assistant checkpoint: all a draft model needs from the hub (not its
# tokenizer, tens of MB for Gemma's 262k tokens: a local one is compared with the
# target's, the vocabulary size always).
ASSISTANT_PATTERNS = [
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
]


def attach_assistant(
    model: Model,
    config: dict,
    model_path: Path,
    draft_model: str,
) -> None:
    """Load the assistant or DSpark drafter ``draft_model`` (a folder or hub repo: a
    Hugging Face checkpoint or an MLX conversion of it), check that it fits the
    target, and draft with it."""
    path = resolve(draft_model, None, ASSISTANT_PATTERNS)
    a_config = read_config(path)
    where = f"the draft model {path}"
    if dspark.is_dspark(a_config):
        return attach_dspark(model, config, path, a_config, where)
    if (
        has_heads_file(a_config)
        or assistants.has_assistant_section(a_config)
        or has_drafter_section(a_config)
    ):
        raise MTPError(
            f"{where} is a target's conversion, not an assistant; --draft-model takes "
            "a Gemma 4 assistant"
        )
    assistants.check_config(a_config, where)
    assistants.check_pair(a_config, config, where)
    assistants.check_tokenizers(path, model_path)
    weights = assistants.read_weights(path)
    assistant = assistants.build(a_config, weights, a_config.get("quantization"))
    reads = assistants.check_layers(assistant, model.trunk, where)
    model.attach(assistant, reads, path)


def attach_dspark(model: Model, config: dict, path: Path, d_config: dict, where: str):
    """Load the DSpark drafter in ``path`` (either spelling), check that it fits the
    target (``config``), and draft with it: `mlx_mtp.models.dspark`."""
    weights = dspark.sanitize(assistants.read_weights(path))
    drafter = build_dspark(model, config, d_config, weights, where)
    model.attach_drafter(drafter, path)


def build_dspark(
    model: Model, config: dict, d_config: dict, weights: dict, where: str
) -> dspark.DSpark:
    """The DSpark drafter of ``d_config`` with ``weights`` (DSpark's names; layers
    that come quantized are built so, as ``d_config``'s ``quantization`` says),
    checked against the target (``config``); its copies of the target's embedding
    and head dropped for the target's own (`_shared_copies`). Over several ranks
    the drafter runs whole on each, as MTP layers do, reading the tapped layers'
    outputs, which a tensor-parallel trunk gives every rank whole and a pipelined
    one sums over its ranks (`mlx_mtp.models.capture.Taps.collect`)."""
    dspark.check_pair(d_config, assistants.target_text_config(config), where)
    return dspark_with(d_config, _shared_copies(model, weights), where)


def dspark_with(d_config: dict, weights: dict, where: str) -> dspark.DSpark:
    """The DSpark drafter of ``d_config`` holding exactly ``weights`` (its own
    embedding and head where they are among them; layers that come quantized
    built so); one-line errors for tensors missing or misshapen."""
    kind = dflash.drafter_class(d_config) or dspark.DSpark
    if gemma4_dspark.is_gemma4_dspark(d_config):
        kind = gemma4_dspark.Gemma4DSpark
    drafter = kind(
        d_config, "embed_tokens.weight" in weights, "lm_head.weight" in weights
    )
    quantize_like(drafter, weights, d_config.get("quantization"))
    try:
        load_strict(drafter, weights)
    except MissingHeadsError as e:
        raise MissingHeadsError(
            f"{where}: " + str(e).replace("MTP ", "drafter ")
        ) from None
    return drafter


def attach_drafter_section(model: Model, config: dict, model_path: Path, allowed):
    """Draft with the DSpark drafter a conversion keeps beside its trunk (``graft``
    of a drafter: `DRAFTER_FILE` and the config's ``drafter`` section). One that is
    missing or does not load is refused in one line, or decoded without under
    ``allowed``."""
    section = config["drafter"]
    where = f"the DSpark drafter in {model_path}"
    try:
        weights = read_section_file(
            model_path, section, DRAFTER_FILE, "a DSpark drafter"
        )
        d_config = dict(section.get("config") or {})
        d_config["quantization"] = section.get("quantization")
        drafter = build_dspark(model, config, d_config, weights, where)
    except MissingHeadsError as e:
        _without(e, allowed, "its DSpark drafter")
        return
    model.attach_drafter(drafter, model_path)


def attach_own_drafter(model: Model, tensors: dict, config: dict, allowed: bool):
    """Draft with the block drafter a checkpoint keeps in its MTP tensors
    (DeepSeek-V4.1's DSpark stages), built by its family. One that does not load
    (stages missing, tensors missing or misshapen) is refused in one line naming
    the checkpoint's tensors, or decoded without under ``allowed``. Over several
    ranks it runs whole on each (`build_dspark`)."""
    family = model.family
    try:
        weights = family.sanitize(tensors, config, model.trunk, raw=True)
        drafter = family.make_drafter(model.trunk, config)
        quantize_like(drafter, weights, config.get("quantization"))
        load_strict(drafter, weights)
    except MissingHeadsError as e:
        named = re.sub(r"\blayers\.(\d+)\.", r"mtp.\1.", str(e))
        named = named.replace("MTP weights", "the DSpark drafter's weights")
        _without(MissingHeadsError(named), allowed, "its DSpark drafter")
        return
    model.attach_drafter(drafter, model.source)


def _shared_copies(model: Model, weights: dict) -> dict:
    """`drop_shared_copies` for the target ``model``."""
    return drop_shared_copies(model.trunk, model.family, model.args, weights)


def drop_shared_copies(trunk, family, args, weights: dict) -> dict:
    """The drafter's tensors without its ``embed_tokens``/``lm_head`` when they are
    the target's (DeepSpec stores frozen copies: spec §2.7), compared on a strided
    subset of rows; the target's are then used, and no second V x H copy is kept.
    A float copy is the target's quantized table when it quantizes alike to the
    same packed rows (the target's conversion quantized the same values). A copy
    that differs, or comes quantized, stays the drafter's own."""
    V, H = args.vocab_size, args.hidden_size
    rows = mx.arange(0, V, max(1, V // 256))
    tables = {
        "embed_tokens.weight": getattr(
            getattr(trunk, "model", None), "embed_tokens", None
        ),
        "lm_head.weight": family.output_head(trunk),
    }
    out = dict(weights)
    for name, table in tables.items():
        mine = weights.get(name)
        if mine is None or table is None or mine.shape != (V, H):
            continue
        if f"{name[: -len('weight')]}scales" in weights:
            continue
        if _same_rows(mine[rows], table, rows):
            del out[name]
    return out


def _same_rows(mine: mx.array, table, rows: mx.array) -> bool:
    """Whether ``mine`` holds the rows ``rows`` of ``table`` (an embedding or a
    linear layer) in the table's float dtype; for a quantized table, whether
    ``mine`` in the dtype it was quantized from (its scales') packs to the same
    rows."""
    if not hasattr(table, "scales"):
        weight = table.weight[rows]
        return mx.array_equal(mine.astype(weight.dtype), weight).item()
    packed = mx.quantize(
        mine.astype(table.scales.dtype),
        group_size=table.group_size,
        bits=table.bits,
        mode=getattr(table, "mode", "affine"),
    )
    biases = getattr(table, "biases", None)
    theirs = [table.weight[rows], table.scales[rows]]
    theirs += [] if biases is None else [biases[rows]]
    return len(packed) == len(theirs) and all(
        a.shape == b.shape and mx.array_equal(a, b).item()
        for a, b in zip(packed, theirs)
    )


def load(
    path_or_hf_repo: str,
    *,
    revision: Optional[str] = None,
    allow_missing_heads: bool = False,
    lazy: bool = False,
    tokenizer_config: Optional[dict] = None,
    trust_remote_code: bool = False,
    draft_model: Optional[str] = None,
    group: Any = "auto",
    force: bool = False,
):
    """Load a model with its MTP heads, and its tokenizer.

    Args:
        path_or_hf_repo: A local folder (Hugging Face checkpoint or MLX conversion) or a
            Hugging Face repo id, resolved through huggingface-hub as mlx-lm does.
        revision: Hub revision (branch, tag or commit).
        allow_missing_heads: When the config declares MTP layers that the checkpoint
            lacks, warn and load for plain decoding instead of failing.
        lazy: Leave weights unevaluated until first use.
        tokenizer_config: Extra tokenizer options, as in mlx-lm.
        trust_remote_code: Allow the tokenizer to run Python code from the model
            folder (``auto_map``). Off by default: such a folder is then an error,
            never a question on the terminal.
        draft_model: A Gemma 4 assistant or a DSpark drafter (folder or hub repo)
            to draft with instead of MTP heads; a pair folder (`mlx_mtp.assistant`)
            brings its own assistant.
        group: The ranks to shard the trunk over (`mlx_mtp.distributed`): "auto" is
            every rank of an ``mlx.launch`` with several (none otherwise); None loads
            the whole model on this process.
        force: Load weights larger than the memory MLX can use here
            (`mlx_mtp.memory.memory_limit`), which are otherwise refused.

    Returns:
        ``(model, tokenizer)``: an `mlx_mtp.models.base.Model` and mlx-lm's
        ``TokenizerWrapper``.

    Raises:
        MTPError: on any problem with the path, config, weights or heads.
    """
    model, config, model_path = load_model(
        path_or_hf_repo,
        revision=revision,
        allow_missing_heads=allow_missing_heads,
        lazy=lazy,
        draft_model=draft_model,
        group=group,
        force=force,
    )
    options = {"trust_remote_code": trust_remote_code, **(tokenizer_config or {})}
    tokenizer, error = None, None
    try:
        tokenizer = _tokenizer(model_path, options, config)
    except Exception as e:  # every rank must reach the check below, failed or not
        if model.group is None:
            raise
        error = e
    distributed.Sync(model.group).all_ok(error)
    return model, tokenizer


def _tokenizer(model_path: Path, options: dict, config: dict):
    """mlx-lm's tokenizer wrapper, or one clear `MTPError`."""
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(
            model_path, options, eos_token_ids=config.get("eos_token_id")
        )
    except Exception as e:  # tokenizer errors have many types
        reason = one_line(e)
        if "custom code" in reason:
            reason = (
                "it needs Python code from the model folder, which mlx-mtp does not "
                "run unless asked (pass --trust-remote-code if you trust this model)"
            )
        raise MTPError(
            f"cannot load the tokenizer from {model_path}: {reason}"
        ) from None

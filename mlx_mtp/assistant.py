"""Gemma 4 assistants beside their target: whether a pair fits, and an assistant's
files.

An assistant is read from one of three places:

- a Hugging Face checkpoint (``config.json`` with ``model_type`` ``gemma4_assistant`` or
  ``gemma4_unified_assistant``, ``model*.safetensors`` in Hugging Face names);
- an MLX conversion of it (the same, its tensors already in `Assistant`'s names and
  possibly quantized: ``quantization`` in the config);
- a pair folder, the target's conversion (which plain mlx-lm loads as the target) with
  the assistant beside it in ``assistant.safetensors`` and a config section

      "assistant": {"format": "mlx-mtp/1", "file": "assistant.safetensors",
                    "config": {the assistant's config}, "quantization": {...} | null,
                    "provenance": {...}}

`check_pair` refuses, one line each, an assistant that does not fit its target.
"""

from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from .errors import MissingHeadsError, MTPError, one_line
from .files import read_json, safetensors_header
from .heads import FORMAT, load_strict, quantize_like, read_section_file, save_heads
from .models.gemma4 import text_model
from .models.gemma4_assistant import (
    ASSISTANT_TYPES,
    TARGET_TYPES,
    Assistant,
    reads,
    sanitize,
)

ASSISTANT_FILE = "assistant.safetensors"


def is_assistant(config: dict) -> bool:
    return config.get("model_type") in ASSISTANT_TYPES


def has_assistant_section(config: dict) -> bool:
    return isinstance(config.get("assistant"), dict)


def check_config(config: dict, where) -> None:
    """Refuse an assistant config that cannot be built, in one line."""
    if not is_assistant(config):
        raise MTPError(
            f"{where} is neither a Gemma 4 assistant (model_type "
            f"{config.get('model_type')!r}; expected one of "
            f"{', '.join(ASSISTANT_TYPES)}) nor a DSpark drafter (config keys "
            "target_layer_ids and mask_token_id, or architectures Qwen3DSparkModel)"
        )
    text = config.get("text_config")
    if not isinstance(text, dict) or not isinstance(
        config.get("backbone_hidden_size"), int
    ):
        raise MTPError(
            f"{where}: an assistant config needs a text_config object and an integer "
            "backbone_hidden_size"
        )
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if type(text.get(key, 1)) is not int or text.get(key, 1) <= 0:
            raise MTPError(f"{where}: text_config.{key} must be a positive integer")


def target_text_config(config: dict) -> dict:
    return config.get("text_config") or config


def check_pair(
    assistant_config: dict,
    target_config: dict,
    where: str = "the assistant",
) -> None:
    """Refuse, before anything is built, an assistant whose config does not fit the
    target's: the model type it is trained for, the backbone width, the vocabulary."""
    a_type, t_type = assistant_config["model_type"], target_config.get("model_type")
    if t_type not in TARGET_TYPES[a_type]:
        raise MTPError(
            f"{where} is a {a_type}, which drafts for "
            f"{' or '.join(TARGET_TYPES[a_type])} targets; this target is {t_type!r}"
        )
    target = target_text_config(target_config)
    hidden = target.get("hidden_size")
    if assistant_config["backbone_hidden_size"] != hidden:
        raise MTPError(
            f"{where} was trained for a target of hidden size "
            f"{assistant_config['backbone_hidden_size']}; this target's is {hidden}"
        )
    a_vocab = assistant_config["text_config"].get("vocab_size", 262144)
    t_vocab = target.get("vocab_size", 262144)
    if a_vocab != t_vocab:
        raise MTPError(
            f"{where} has a vocabulary of {a_vocab} tokens; the target's has {t_vocab}"
        )


def check_layers(assistant: Assistant, trunk, where: str = "the assistant") -> Dict:
    """Refuse an assistant whose layers cannot read the target's caches; returns
    layer type -> the target cache index each type reads (`reads`)."""
    lm = text_model(trunk)
    read = reads(lm.args)
    for layer in assistant.model.layers:
        kind, attn = layer.layer_type, layer.self_attn
        if kind not in read:
            raise MTPError(
                f"{where} reads the target's {kind.replace('_', ' ')} layers, and this "
                "target has no such layer with keys and values of its own"
            )
        source = lm.model.layers[read[kind]].self_attn
        if attn.head_dim != source.head_dim or attn.n_heads % source.n_kv_heads:
            raise MTPError(
                f"{where}'s {kind.replace('_', ' ')} layers ({attn.n_heads} heads of "
                f"{attn.head_dim}) cannot attend to the target's ({source.n_kv_heads} "
                f"key/value heads of {source.head_dim})"
            )
    if "sliding_attention" in read:
        window, target_window = assistant.args.sliding_window, lm.args.sliding_window
        if window > target_window:
            raise MTPError(
                f"{where} has a sliding window of {window}; the target's, whose "
                f"positions it reads, is {target_window}"
            )
    return read


def check_tokenizers(assistant_dir: Optional[Path], target_dir: Path) -> None:
    """Refuse an assistant folder whose tokenizer's vocabulary differs from the
    target's (checked when both folders have a ``tokenizer.json``)."""
    if assistant_dir is None:
        return
    a, t = assistant_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if not (a.is_file() and t.is_file()) or a.read_bytes() == t.read_bytes():
        return
    if _vocabulary(a) != _vocabulary(t):
        raise MTPError(
            f"the assistant's tokenizer ({a}) is not the target's ({t}): they map "
            "tokens to different ids"
        )


def _vocabulary(path: Path):
    try:
        data = read_json(path, "the tokenizer")
        vocab = (data.get("model") or {}).get("vocab")
        added = sorted(
            (t.get("id"), t.get("content")) for t in data.get("added_tokens") or []
        )
    except (OSError, ValueError, AttributeError) as e:
        raise MTPError(f"cannot read {path}: {one_line(e)}") from None
    return vocab, added


def read_weights(folder: Path) -> dict:
    """All tensors of an assistant checkpoint's ``model*.safetensors``."""
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise MissingHeadsError(f"{folder} has no model*.safetensors")
    weights = {}
    for f in files:
        safetensors_header(f)
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError, OSError) as e:
            raise MTPError(f"cannot read {f}: {one_line(e)}") from None
    return weights


def build(config: dict, weights: dict, quantization: Optional[dict]) -> Assistant:
    """An `Assistant` loaded strictly from Hugging Face or MLX tensors."""
    assistant = Assistant(config)
    weights = sanitize(weights, config)
    quantize_like(assistant, weights, quantization)
    try:
        load_strict(assistant, weights)
    except MissingHeadsError as e:
        raise MissingHeadsError(str(e).replace("MTP ", "assistant ")) from None
    return assistant


def load_section(model_path: Path, config: dict) -> Assistant:
    """The assistant of a pair folder."""
    section = config["assistant"]
    weights = read_section_file(model_path, section, ASSISTANT_FILE, "an assistant")
    path = model_path / section.get("file", ASSISTANT_FILE)
    check_config(section.get("config") or {}, path)
    return build(section["config"], weights, section.get("quantization"))


def section(
    assistant_config: dict, quantization: Optional[dict], provenance: dict
) -> dict:
    """The config section of an assistant written beside its target."""
    return {
        "format": FORMAT,
        "file": ASSISTANT_FILE,
        "config": assistant_config,
        "quantization": quantization,
        "provenance": provenance,
    }


def save(path: Path, assistant: Assistant) -> None:
    """Write the assistant's tensors to exactly ``path``."""
    save_heads(path, assistant)

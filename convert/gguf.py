"""Llama-family GGUF files (llama.cpp) as conversion sources.

``gguf_to_hf(path, out)`` writes an ordinary Hugging Face checkpoint folder from a GGUF
file, so the rest of the conversion is the usual path: ``config.json`` (LlamaForCausalLM
from the ``llama.*`` metadata), ``model.safetensors`` with Hugging Face names (weights
dequantized to ``dtype``; llama.cpp's interleaved q/k rows permuted back), and
``tokenizer.json`` / ``tokenizer_config.json`` (with the chat template) built from the
``tokenizer.ggml.*`` metadata. MTP tensors that llama.cpp writes (``blk.{L}.nextn.*``)
become DeepSeek-style ``model.layers.{L}.*`` heads. MLX reads the file itself
(``mx.load``: F32, F16, Q4_0, Q4_1, Q8_0 as affine-quantized arrays).
"""

import json
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from mlx_mtp.errors import MTPError, one_line

BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 blocks: q/k norms and a norm before and after each sub-block.
GEMMA3_BLOCK = {
    **BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
NEXTN = {
    "eh_proj": "eh_proj",
    "enorm": "enorm",
    "hnorm": "hnorm",
    "shared_head_norm": "shared_head.norm",
    "shared_head_head": "shared_head.head",
    "embed_tokens": "embed_tokens",
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def is_gguf(path: str) -> bool:
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def read_gguf(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    """Tensors and metadata of a GGUF file. MLX reads the legacy types itself (F32,
    F16, Q4_0, Q4_1, Q8_0; quantized ones as affine triplets); a file with other
    types (K-quants, Q5_0, ...) is read by llama.cpp's ``gguf`` package, which
    dequantizes every type to float32."""
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        if "gguf" not in str(e).lower():
            raise MTPError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
        return _read_with_gguf(path)
    return weights, {k: _plain(v) for k, v in meta.items()}


def _read_with_gguf(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:  # pragma: no cover - a dependency
        raise MTPError("reading this GGUF file needs the gguf package") from None
    try:
        reader = GGUFReader(str(path))
        meta = {name: field.contents() for name, field in reader.fields.items()}
        weights = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = dequantize(t.data, t.tensor_type).reshape(shape)
            weights[t.name] = mx.array(data.astype("float32"))
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise MTPError(f"cannot read {path}: {one_line(e)}") from None
    return weights, meta


def _plain(v):
    """Metadata values as Python scalars and lists."""
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def hf_name(name: str, block: dict = BLOCK) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, leaf = name.rsplit(".", 1)
    if base in TOP:
        return f"{TOP[base]}.{leaf}"
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{leaf}"
    if (
        parts[0] == "blk"
        and len(parts) == 4
        and parts[2] == "nextn"
        and parts[3] in NEXTN
    ):
        return f"model.layers.{parts[1]}.{NEXTN[parts[3]]}.{leaf}"
    raise MTPError(
        f"unknown GGUF tensor {name} (llama-family and Gemma 3 files are supported)"
    )


def unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row interleaving (the inverse of its ``permute``)."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def dequantized(weights: dict, name: str) -> mx.array:
    """A tensor as floats: affine-quantized triplets (group 32) are dequantized."""
    w = weights[name]
    base = name[: -len(".weight")]
    if f"{base}.scales" not in weights:
        return w.astype(mx.float32)
    scales = weights[f"{base}.scales"].astype(mx.float32)
    biases = weights[f"{base}.biases"].astype(mx.float32)
    bits = w.shape[-1] // scales.shape[-1]
    return mx.dequantize(w, scales, biases, group_size=32, bits=bits)


def gguf_config(meta: dict, weights: dict) -> dict:
    arch = meta.get("general.architecture")
    if arch == "gemma3":
        return gemma3_config(meta, weights)
    if arch != "llama":
        raise MTPError(
            f"GGUF architecture {arch!r} is not supported (llama and gemma3 only)"
        )

    def get(key, default=None):
        return meta.get(f"llama.{key}", default)

    nextn = int(get("nextn_predict_layers", 0) or 0)
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")) - nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(weights["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if nextn:
        config["num_nextn_predict_layers"] = nextn
    return config


def gemma3_config(meta: dict, weights: dict) -> dict:
    """A Hugging Face ``gemma3_text`` config from ``gemma3.*`` metadata. Gemma 3 puts
    a full-attention layer after every five sliding-window ones and scales queries
    by the head width, as its released configs say; llama.cpp keeps neither."""

    def get(key, default=None):
        return meta.get(f"gemma3.{key}", default)

    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length"))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 1000000.0)),
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "max_position_embeddings": int(get("context_length", 32768)),
        "vocab_size": int(weights["token_embd.weight"].shape[0]),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def write_tokenizer(meta: dict, out: Path, context: int) -> None:
    """tokenizer.json (byte-level BPE) and its configs from ``tokenizer.ggml.*``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]
    if kind == "llama" and meta.get("general.architecture") == "gemma3":
        _sentencepiece_tokenizer(meta).save(str(out / "tokenizer.json"))
        _write_tokenizer_configs(meta, tokens, out, context)
        return
    if kind != "gpt2":
        raise MTPError(
            f"GGUF tokenizer {kind!r} is not supported (byte-level BPE, and "
            "Gemma 3's sentencepiece)"
        )
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":  # digits split one by one
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == 3  # CONTROL
        ]
    )
    tok.save(str(out / "tokenizer.json"))
    _write_tokenizer_configs(meta, tokens, out, context)


def _sentencepiece_tokenizer(meta: dict):
    """Gemma 3's sentencepiece vocabulary as a ``tokenizers`` object, rebuilt as
    transformers rebuilds it from GGUF metadata (merges recovered from the token
    order, multi-space tokens respelled). That builder lives in a transformers module
    without a public name; it needs no torch."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise MTPError(
            "this transformers cannot build a sentencepiece tokenizer from GGUF"
        ) from None
    vocab = {
        "tokenizer_type": "llama",
        "tokens": meta["tokenizer.ggml.tokens"],
        "scores": meta.get("tokenizer.ggml.scores"),
        "token_type": meta.get("tokenizer.ggml.token_type"),
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], vocab)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        from tokenizers import processors

        name = meta["tokenizer.ggml.tokens"][bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{name} $A",
            pair=f"{name} $A {name} $B",
            special_tokens=[(name, bos)],
        )  # the model wants <bos> first, as llama.cpp adds it
    return backend


def _write_tokenizer_configs(meta: dict, tokens, out: Path, context: int) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` from the metadata."""

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        f"{k}_token": token(k) for k in ("bos", "eos", "unknown", "padding") if token(k)
    }
    special = {
        k.replace("unknown", "unk").replace("padding", "pad"): v
        for k, v in special.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def gguf_to_hf(path: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face checkpoint folder of a llama-family or Gemma 3 GGUF file
    into ``out``."""
    weights, meta = read_gguf(path)
    config = gguf_config(meta, weights)
    config["torch_dtype"] = dtype
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    gemma = config["model_type"] == "gemma3_text"
    tensors = {}
    for name in weights:
        if name.endswith((".scales", ".biases")):
            continue
        w = dequantized(weights, name)
        if gemma and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norms with the 1 added
        elif gemma:
            pass  # llama.cpp permutes q/k rows for llama only
        elif ".attn_q." in name:
            w = unpermute(w, heads)
        elif ".attn_k." in name:
            w = unpermute(w, kv)
        block = GEMMA3_BLOCK if gemma else BLOCK
        tensors[hf_name(name, block)] = w.astype(DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(out / "model.safetensors"), tensors, metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(meta, out, config["max_position_embeddings"])
    return out

"""Llama-family GGUF files (llama.cpp) as conversion sources.

``gguf_to_hf(path, out)`` writes an ordinary Hugging Face checkpoint folder from a GGUF
file, so the rest of the conversion is the usual path: ``config.json`` (LlamaForCausalLM
from the ``llama.*`` metadata), ``model.safetensors`` with Hugging Face names (weights
dequantized to ``dtype``; llama.cpp's interleaved q/k rows permuted back), and
``tokenizer.json`` / ``tokenizer_config.json`` (with the chat template) built from the
``tokenizer.ggml.*`` metadata. MTP tensors that llama.cpp writes (``blk.{L}.nextn.*``)
become DeepSeek-style ``model.layers.{L}.*`` heads.

`check_header` first checks every length, count, type and offset of the file's header
in Python: a crafted file is one `MTPError`, never a crash of a native reader. MLX then
reads a file of the types it reads natively (``mx.load``: F32, F16, Q4_0, Q4_1, Q8_0,
as affine-quantized arrays); the ``gguf`` package reads any other.
"""

import json
import mmap
import struct
from pathlib import Path
from typing import Dict, FrozenSet, NamedTuple, Tuple

import mlx.core as mx

from mlx_mtp.errors import DiskFullError, MTPError, one_line

from .output import is_disk_full

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


# --- the header, checked before any reader sees the file ------------------------------

VERSIONS = (2, 3)  # v1 (32-bit lengths) is gone from llama.cpp too
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DIM = 2**31 - 1  # MLX's shapes are 32-bit
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, FLOAT64 = 8, 9, 12
# What MLX's own reader (gguflib) is given: the ggml types it reads without its
# ``gguf_tensor_to_f16`` (F32, F16, Q4_0, Q4_1, Q8_0), in files without float64
# metadata (which it misparses, or crashes on); every other file is read by the
# ``gguf`` package, in Python.
MLX_TENSOR_TYPES = frozenset({0, 1, 2, 3, 8})
# GGUF value type -> struct format of its scalar
SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd"))


class _Header:
    """Bounded little-endian reads from a GGUF file's bytes: each read, length and
    count is checked against what is left of the file before it is used."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0
        self.value_types = set()

    def fail(self, problem: str) -> MTPError:
        return _invalid(self.path, problem)

    def left(self) -> int:
        return len(self.data) - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(
                f"{what} at byte {self.pos}: {n} bytes, past the end of the file "
                f"({len(self.data)} bytes)"
            )

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"the length of {what}")
        self.need(n, what)
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - n} is not UTF-8") from None

    def count(self, n: int, least: int, what: str) -> None:
        """Refuse ``n`` items of at least ``least`` bytes each that cannot fit."""
        if n * least > self.left():
            raise self.fail(
                f"it claims {n} {what}, more than its {len(self.data)} bytes can hold"
            )


def _invalid(path: Path, problem: str) -> MTPError:
    return MTPError(f"cannot read {path}: not a valid GGUF file: {problem}")


class Header(NamedTuple):
    """What `check_header` found: the metadata value types (of array items too) and
    the ggml tensor types the file uses."""

    value_types: FrozenSet[int]
    tensor_types: FrozenSet[int]


def check_header(path: Path) -> Header:
    """Check a GGUF file's whole header against its size, in Python, so that MLX's
    and the ``gguf`` package's readers only ever see well-formed files: magic, a
    version in `VERSIONS`, tensor and metadata counts, every key, string and array
    length, known value types (no arrays of arrays), ``general.alignment``, and for
    each tensor 1 to `MAX_DIMS` dimensions from 1 to `MAX_DIM`, a known ggml type
    whose blocks divide the first dimension, and an aligned offset whose data lies
    inside the file. Raises a one-line `MTPError` naming the file and the problem."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) < 24:
                raise _invalid(path, "it is too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _check(_Header(data, path))
    except OSError as e:
        raise MTPError(f"cannot read {path}: {one_line(e)}") from None


def _check(h: _Header) -> Header:
    if h.data[:4] != b"GGUF":
        raise h.fail("it does not start with GGUF")
    h.pos = 4
    version = h.unpack("I", "the version")
    if version not in VERSIONS:
        raise h.fail(f"version {version} is not supported (2 and 3 are)")
    n_tensors = h.unpack("Q", "the tensor count")
    n_kv = h.unpack("Q", "the metadata count")
    alignment = _check_metadata(h, n_kv)
    tensor_types = _check_tensors(h, n_tensors, alignment)
    return Header(frozenset(h.value_types), tensor_types)


def _check_metadata(h: _Header, n_kv: int) -> int:
    """Step over the ``n_kv`` metadata entries; the file's alignment."""
    h.count(n_kv, 8 + 4 + 1, "metadata entries")
    alignment = DEFAULT_ALIGNMENT
    keys = set()
    for _ in range(n_kv):
        key = h.string("a metadata key")
        if key in keys:
            raise h.fail(f"the metadata key {key!r} appears twice")
        keys.add(key)
        kind = h.unpack("I", f"the type of {key!r}")
        h.value_types.add(kind)
        if key == "general.alignment":
            alignment = _alignment(h, kind)
        else:
            _skip_value(h, kind, key)
    return alignment


def _check_tensors(h: _Header, n_tensors: int, alignment: int) -> FrozenSet[int]:
    """Read the ``n_tensors`` tensor entries and check that each one's data lies,
    aligned, inside the file; their ggml types."""
    h.count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensors")
    from gguf.constants import GGML_QUANT_SIZES

    sizes = {int(kind): size for kind, size in GGML_QUANT_SIZES.items()}
    tensors = [_tensor_info(h, sizes) for _ in range(n_tensors)]
    names = [name for name, _, _, _ in tensors]
    if len(set(names)) < len(names):
        raise h.fail("a tensor name appears twice")
    start = -(-h.pos // alignment) * alignment
    room = len(h.data) - start if tensors else 0
    for name, _, offset, size in tensors:
        if offset % alignment:
            raise h.fail(
                f"the offset {offset} of tensor {name!r} is not {alignment}-aligned"
            )
        if offset + size > room:
            raise h.fail(
                f"tensor {name!r} ({size} bytes at data offset {offset}) runs past the "
                f"end of the file ({len(h.data)} bytes)"
            )
    return frozenset(kind for _, kind, _, _ in tensors)


def _alignment(h: _Header, kind: int) -> int:
    if kind != 4:
        raise h.fail("general.alignment is not a uint32")
    alignment = h.unpack("I", "general.alignment")
    if alignment == 0 or alignment & (alignment - 1):
        raise h.fail(f"general.alignment {alignment} is not a power of two")
    return alignment


def _skip_value(h: _Header, kind: int, key: str) -> None:
    """Step over one metadata value of type ``kind``."""
    if kind in SCALARS:
        h.unpack(SCALARS[kind], f"the value of {key!r}")
    elif kind == STRING:
        h.string(f"the value of {key!r}")
    elif kind == ARRAY:
        item = h.unpack("I", f"the item type of {key!r}")
        h.value_types.add(item)
        n = h.unpack("Q", f"the length of {key!r}")
        if item in SCALARS:
            size = struct.calcsize("<" + SCALARS[item])
            h.need(n * size, f"the {n} items of {key!r}")
            h.pos += n * size
        elif item == STRING:
            h.count(n, 8, f"strings in {key!r}")
            what = f"a string in {key!r}"
            for _ in range(n):
                h.string(what)
        else:
            raise h.fail(
                f"{key!r} is an array of value type {item} (unknown or nested)"
            )
    else:
        raise h.fail(f"{key!r} has value type {kind}, which GGUF does not define")


def _tensor_info(h: _Header, sizes: dict) -> Tuple[str, int, int, int]:
    """One tensor's header entry, checked: (name, ggml type, data offset, size in
    bytes). ``sizes``: ggml type -> (elements, bytes) of its blocks."""
    name = h.string("a tensor name")
    n_dims = h.unpack("I", f"the dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise h.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = [h.unpack("Q", f"a dimension of {name!r}") for _ in range(n_dims)]
    if not all(1 <= d <= MAX_DIM for d in dims):
        raise h.fail(f"tensor {name!r} has a dimension out of range: {dims}")
    kind = h.unpack("I", f"the type of {name!r}")
    if kind not in sizes:
        raise h.fail(f"tensor {name!r} has ggml type {kind}, which is unknown")
    block, block_bytes = sizes[kind]
    if dims[0] % block:
        raise h.fail(
            f"the rows of tensor {name!r} ({dims[0]}) are not whole {block}-blocks"
        )
    elements = 1
    for d in dims:
        elements *= d
    offset = h.unpack("Q", f"the offset of {name!r}")
    return name, kind, offset, elements // block * block_bytes


# --- reading --------------------------------------------------------------------------


def read_gguf(path: Path) -> Tuple[Dict[str, mx.array], dict]:
    """Tensors and metadata of a GGUF file, once `check_header` has passed it. MLX
    reads the legacy types itself (F32, F16, Q4_0, Q4_1, Q8_0; quantized ones as
    affine triplets); a file with other types (K-quants, Q5_0, ...) is read by
    llama.cpp's ``gguf`` package, which dequantizes every type to float32."""
    header = check_header(path)
    if FLOAT64 in header.value_types or not header.tensor_types <= MLX_TENSOR_TYPES:
        return _read_with_gguf(path)
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
        _save_tokenizer(_sentencepiece_tokenizer(meta), out)
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
    _save_tokenizer(tok, out)
    _write_tokenizer_configs(meta, tokens, out, context)


def _save_tokenizer(tok, out: Path) -> None:
    """``tokenizer.json``, written by Python (a full disk is an ``OSError``)."""
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")


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


HF_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def gguf_to_hf(path: Path, out: Path, dtype: str = "float32") -> Path:
    """Write the Hugging Face checkpoint folder of a llama-family or Gemma 3 GGUF file
    into ``out`` (the `HF_FILES`). A full disk is one `DiskFullError`, the files
    written so far removed."""
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
    try:
        _write_hf(out, tensors, config, meta)
    except (OSError, RuntimeError) as e:
        if not is_disk_full(e):
            raise
        for name in HF_FILES:
            (out / name).unlink(missing_ok=True)
        raise DiskFullError(
            f"no space left on {out.parent} while writing the Hugging Face copy of "
            f"{path.name}; nothing was kept"
        ) from None
    return out


def _write_hf(out: Path, tensors: dict, config: dict, meta: dict) -> None:
    mx.save_safetensors(
        str(out / "model.safetensors"), tensors, metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(meta, out, config["max_position_embeddings"])

"""DeepSeek-V4 fixtures in the release's dtypes: float tensors (numpy) quantized as the
release stores them (FP8 e4m3 with ue8m0 128x128 block scales, FP4 e2m1 experts with
ue8m0 scales per 32 inputs), written with the release's safetensors dtype names, and
the release's config keys. The inverse of `mlx_mtp.models.deepseek_v4_quant`."""

import json
import os
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from ..models.deepseek_v4_quant import (
    _FP4_NAME,
    _FP8_NAME,
    _FP32_NAME,
    FP8_BLOCK,
    GROUP,
)


def release_kind_of_name(name: str) -> Optional[str]:
    """``"fp8"``, ``"fp4"`` or None: how the V4 release stores the tensor ``name``
    (attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``, ``indexer.wq_b``,
    shared experts and the MTP ``e_proj``/``h_proj`` in FP8; routed experts in FP4)."""
    if _FP4_NAME.match(name):
        return "fp4"
    if _FP8_NAME.match(name):
        return "fp8"
    return None


def to_release(
    tensors: Dict[str, np.ndarray], block: Tuple[int, int] = FP8_BLOCK
) -> Dict[str, np.ndarray]:
    """``tensors`` (release names, float numpy) with the weights the release quantizes
    in its dtypes: FP8 e4m3 bytes (uint8) with ue8m0 ``block`` scales (uint8), FP4
    e2m1 packed low nibble first (int8, ``(out, in / 2)``) with ue8m0 scales per row
    and 32 inputs (uint8), each scale as ``<name>.scale`` beside ``<name>.weight``.
    Scales are the smallest powers of two that fit the block's largest magnitude;
    values round to nearest, ties to even. Other tensors pass through. ValueError for
    an FP4 weight whose input width is not a multiple of 32."""
    out = {}
    for name, value in tensors.items():
        kind = release_kind_of_name(name)
        if kind is None:
            out[name] = value
            continue
        base = name[: -len(".weight")]
        if kind == "fp8":
            out[name], out[f"{base}.scale"] = quantize_fp8_np(value, block)
        elif value.shape[-1] % GROUP:
            raise ValueError(
                f"{name}: fp4 needs an input width divisible by {GROUP}, "
                f"not {value.shape[-1]}"
            )
        else:
            out[name], out[f"{base}.scale"] = quantize_fp4_np(value)
    return out


def _positive_codes(max_code: int, decode) -> np.ndarray:
    return np.array([decode(c) for c in range(max_code + 1)], dtype=np.float64)


def _e4m3(code: int) -> float:
    exponent, mantissa = code >> 3, code & 7
    if exponent == 0:
        return mantissa / 8 * 2.0**-6
    return (1 + mantissa / 8) * 2.0 ** (exponent - 7)


_E4M3 = _positive_codes(0x7E, _e4m3)  # 0x7f is NaN
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _round_to_codes(q: np.ndarray, table: np.ndarray, sign_bit: int) -> np.ndarray:
    """Codes of the nearest ``table`` magnitudes (ascending by code), ties to the even
    code, with ``sign_bit`` set for negative values."""
    mag = np.abs(q)
    upper = np.clip(np.searchsorted(table, mag), 1, len(table) - 1)
    lower = upper - 1
    d_low, d_up = mag - table[lower], table[upper] - mag
    code = np.where((d_up < d_low) | ((d_up == d_low) & (upper % 2 == 0)), upper, lower)
    return (code | np.where(q < 0, sign_bit, 0)).astype(np.uint8)


def _exponents(amax: np.ndarray, top: float) -> np.ndarray:
    """The smallest e with ``amax / 2 ** e <= top`` per block (-127 for zeros),
    within e8m0's range."""
    mantissa, exponent = np.frexp(amax.astype(np.float64) / top)
    exponent = exponent - (mantissa == 0.5)
    return np.clip(np.where(amax > 0, exponent, -127), -127, 127)


def quantize_fp8_np(
    w: np.ndarray, block: Tuple[int, int] = FP8_BLOCK
) -> Tuple[np.ndarray, np.ndarray]:
    """A 2-D float array as FP8 e4m3 bytes and ue8m0 block-scale bytes
    ``(ceil(out / bm), ceil(in / bn))``."""
    bm, bn = block
    out, width = w.shape
    rows, cols = -(-out // bm), -(-width // bn)
    padded = np.zeros((rows * bm, cols * bn), dtype=np.float64)
    padded[:out, :width] = w
    blocks = padded.reshape(rows, bm, cols, bn)
    e = _exponents(np.abs(blocks).max(axis=(1, 3)), 448.0)
    factor = np.repeat(np.repeat(np.exp2(-e), bm, 0), bn, 1)[:out, :width]
    q = np.clip(w.astype(np.float64) * factor, -448.0, 448.0)
    return _round_to_codes(q, _E4M3, 0x80), (e + 127).astype(np.uint8)


def quantize_fp4_np(w: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """A float array ``(..., out, in)`` as FP4 e2m1 packed two per byte, low nibble
    first (int8 ``(..., out, in / 2)``), and ue8m0 scale bytes ``(..., out, in / 32)``.
    """
    groups = w.astype(np.float64).reshape(*w.shape[:-1], -1, GROUP)
    e = _exponents(np.abs(groups).max(axis=-1), 6.0)
    q = np.clip(groups * np.exp2(-e)[..., None], -6.0, 6.0).reshape(w.shape)
    codes = _round_to_codes(q, _E2M1, 0x8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(np.int8), (e + 127).astype(np.uint8)


def release_config(block: Tuple[int, int] = FP8_BLOCK) -> dict:
    """The config.json keys the V4 release declares its dtypes with."""
    return {
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(block),
        },
        "expert_dtype": "fp4",
    }


_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int16): "I16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.bool_): "BOOL",
}


def _bfloat16_bytes(x: np.ndarray) -> bytes:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def _release_dtype(name: str, value: np.ndarray, tensors: dict) -> str:
    if value.dtype == np.uint8 and name.endswith(".scale"):
        if name[: -len("scale")] + "weight" in tensors:
            return "F8_E8M0"
    if value.dtype == np.uint8 and name.endswith(".weight"):
        if name[: -len("weight")] + "scale" in tensors:
            return "F8_E4M3"
    if value.dtype not in _ST_DTYPES:
        raise ValueError(f"{name}: no safetensors dtype for {value.dtype}")
    return _ST_DTYPES[value.dtype]


def write_release_safetensors(
    path, tensors: Dict[str, np.ndarray], float_dtype: str = "float32"
) -> Path:
    """Write ``tensors`` (as `to_release` returns them) to the safetensors file
    ``path`` with the release's dtype names: ``F8_E4M3`` for a uint8 ``.weight``
    beside a ``.scale``, ``F8_E8M0`` for that uint8 ``.scale``, ``I8`` for packed FP4;
    float32 arrays as ``F32``, or ``BF16`` when ``float_dtype`` is ``"bfloat16"``
    (except the ``hc_*``, ``ape``, ``attn_sink`` and ``gate.bias`` tensors, which the
    release keeps in float32). Written to a temporary name, then renamed."""
    if float_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"float_dtype must be float32 or bfloat16, not {float_dtype}")
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        dtype = _release_dtype(name, value, tensors)
        if dtype == "F32" and float_dtype == "bfloat16" and not _FP32_NAME.search(name):
            dtype, blob = "BF16", _bfloat16_bytes(value)
        else:
            blob = value.astype(value.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)
    return path

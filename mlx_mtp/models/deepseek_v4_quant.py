"""DeepSeek-V4's released dtypes and MLX's ``mxfp8`` / ``mxfp4`` layouts.

The V4 release stores most projections as FP8 e4m3 (safetensors ``F8_E4M3``, which
``mx.load`` reads as uint8) with one ue8m0 scale per 128x128 block (``F8_E8M0``, read
as uint8 exponent bytes, value ``2 ** (byte - 127)``), named ``<name>.scale`` beside
``<name>.weight``; and the routed experts as FP4 e2m1, two values per byte with the
first in the low nibble (``I8``, read as int8), with one ue8m0 scale per 32 inputs of
each row. Both are exactly MLX's microscaling modes (group 32, e8m0 scales), so loading
keeps them packed and loses nothing:

- `repack_fp8`, `repack_fp4`: one tensor pair to MLX's ``(uint32 weight, uint8
  scales)``; `repack_release`: every pair of a checkpoint dict (raw names), with the
  FP8 weights MLX cannot pack (input width not a multiple of 32) dequantized instead.
- `expand_release_scales`: the same, in the form mlx-lm's ``deepseek_v41`` sanitize
  packs (release names and bytes, scales per row).
- `quantization_config_for`, `quantized_modes`: the per-path ``quantization`` entries
  mlx-lm's loader and ``nn.quantize`` take, from packed tensors or built modules.
- `to_release`, `write_release_safetensors`, `release_config`: the inverse, for
  fixtures: float tensors (numpy) in the release's dtypes, file and config keys.
"""

import json
import os
import re
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import MTPError

FP8_BLOCK = (128, 128)
GROUP = 32
MXFP8 = {"group_size": GROUP, "bits": 8, "mode": "mxfp8"}
MXFP4 = {"group_size": GROUP, "bits": 4, "mode": "mxfp4"}

_LAYER = r"(?:layers|mtp)\.\d+\."
_FP8_NAME = re.compile(
    rf"^(?:{_LAYER}attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    rf"|{_LAYER}ffn\.shared_experts\.w[123]"
    r"|mtp\.\d+\.[eh]_proj)\.weight$"
)
_FP4_NAME = re.compile(rf"^{_LAYER}ffn\.experts\.\d+\.w[123]\.weight$")
# Float tensors the release keeps in float32 when the rest is bfloat16.
_FP32_NAME = re.compile(r"(?:^|\.)hc_|\.ape$|\.attn_sink$|\.gate\.bias$")


# ---------------------------------------------------------------------------
# Release -> MLX
# ---------------------------------------------------------------------------


def ue8m0(scale: mx.array) -> mx.array:
    """Scales as e8m0 exponent bytes: uint8 as is; floating scales must be powers of
    two (``2 ** (byte - 127)``), else MTPError."""
    if scale.dtype == mx.uint8:
        return scale
    if not mx.issubdtype(scale.dtype, mx.floating):
        raise MTPError(f"ue8m0 scales must be uint8 or floating, not {scale.dtype}")
    exponent = mx.round(mx.log2(scale.astype(mx.float32)))
    if not mx.array_equal(mx.power(2.0, exponent), scale.astype(mx.float32)).item():
        raise MTPError("ue8m0 scales must be powers of two")
    return (exponent + 127).astype(mx.uint8)


def repack_fp8(
    weight: mx.array, scale: mx.array, block: Tuple[int, int] = FP8_BLOCK
) -> Tuple[mx.array, mx.array]:
    """An FP8 e4m3 weight (uint8 ``(..., out, in)``) with ue8m0 block scales
    ``(..., ceil(out / bm), ceil(in / bn))`` as MLX ``mxfp8`` (group 32): the bytes
    viewed as uint32 ``(..., out, in / 4)`` and the scales repeated to one per row and
    32 inputs, ``(..., out, in / 32)``. Lossless. MTPError when MLX cannot hold it:
    ``in`` or ``bn`` not a multiple of 32, or scales of the wrong shape."""
    bm, bn = block
    *lead, out, width = weight.shape
    grid = (*lead, -(-out // bm), -(-width // bn))
    if weight.dtype != mx.uint8:
        raise MTPError(f"an fp8 weight must be uint8, not {weight.dtype}")
    if tuple(scale.shape) != grid:
        raise MTPError(
            f"fp8 scales of shape {tuple(scale.shape)} for a weight of shape "
            f"{tuple(weight.shape)} and {bm}x{bn} blocks; expected {grid}"
        )
    if width % GROUP or bn % GROUP:
        raise MTPError(
            f"mxfp8 needs the input width ({width}) and the block ({bn}) to be "
            f"multiples of {GROUP}"
        )
    scales = mx.repeat(ue8m0(scale), bm, axis=-2)[..., :out, :]
    scales = mx.repeat(scales, bn // GROUP, axis=-1)[..., : width // GROUP]
    return weight.view(mx.uint32), scales


def repack_fp4(weight: mx.array, scale: mx.array) -> Tuple[mx.array, mx.array]:
    """An FP4 e2m1 weight packed two per byte, low nibble first (int8 or uint8
    ``(..., out, in / 2)``, e.g. stacked experts ``(E, out, in / 2)``), with ue8m0
    scales ``(..., out, in / 32)``, as MLX ``mxfp4``: the bytes viewed as uint32
    ``(..., out, in / 8)`` and the scales as they are. Lossless."""
    if weight.dtype not in (mx.int8, mx.uint8):
        raise MTPError(f"a packed fp4 weight must be int8 or uint8, not {weight.dtype}")
    want = (*weight.shape[:-1], weight.shape[-1] * 2 // GROUP)
    if tuple(scale.shape) != want or weight.shape[-1] % (GROUP // 2):
        raise MTPError(
            f"fp4 scales of shape {tuple(scale.shape)} for a packed weight of shape "
            f"{tuple(weight.shape)}; expected {want}"
        )
    return weight.view(mx.uint32), ue8m0(scale)


def dequantize_fp8(
    weight: mx.array,
    scale: mx.array,
    block: Tuple[int, int] = FP8_BLOCK,
    dtype: mx.Dtype = mx.bfloat16,
) -> mx.array:
    """``from_fp8(weight) * 2 ** (scale - 127)`` per block, in ``dtype``, for the FP8
    weights `repack_fp8` cannot pack (exact in float32 and, for e4m3 values whose
    scaled exponent stays in range, in bfloat16)."""
    bm, bn = block
    out, width = weight.shape[-2:]
    exponent = ue8m0(scale).astype(mx.float32) - 127
    factor = mx.repeat(mx.repeat(mx.power(2.0, exponent), bm, -2), bn, -1)
    values = mx.from_fp8(weight, dtype=mx.float32)
    return (values * factor[..., :out, :width]).astype(dtype)


def release_kind(
    weight: mx.array, scale: mx.array, block: Tuple[int, int] = FP8_BLOCK
) -> Optional[str]:
    """``"fp8"``, ``"fp4"`` or None (not a release pair) for a weight and its
    ``.scale``: FP8 is a uint8 weight whose scales tile it in ``block`` blocks; FP4 an
    int8 or uint8 weight of ``in / 2`` bytes per row with one scale per row and 32
    inputs (int8 is FP4 only; a uint8 shape that fits both is FP8)."""
    *lead, out, width = weight.shape
    shape = tuple(scale.shape)
    if weight.dtype == mx.uint8 and shape == (
        *lead,
        -(-out // block[0]),
        -(-width // block[1]),
    ):
        return "fp8"
    fp4 = (*lead, out, width // 16)
    if weight.dtype in (mx.int8, mx.uint8) and width % 16 == 0 and shape == fp4:
        return "fp4"
    return None


def is_release_quantized(weights: Dict[str, mx.array]) -> bool:
    """Whether ``weights`` (raw release names) hold a FP8 or FP4 pair: a ``.weight``
    of uint8 or int8 beside its ``.scale``."""
    return any(
        k.endswith(".scale") and _packed(weights.get(k[:-5] + "weight"))
        for k in weights
    )


def repack_release(
    weights: Dict[str, mx.array],
    block: Tuple[int, int] = FP8_BLOCK,
    dtype: mx.Dtype = mx.bfloat16,
) -> Dict[str, mx.array]:
    """Every release pair ``X.weight`` + ``X.scale`` of ``weights`` (raw names, before
    any renaming or stacking) as MLX's ``X.weight`` (uint32) + ``X.scales`` (uint8);
    an FP8 weight MLX cannot pack (input width not a multiple of 32) becomes a float
    ``X.weight`` in ``dtype`` instead. Other tensors, and a ``.scale`` beside a float
    weight, pass through. Lazy. MTPError names a pair of the wrong shape or dtype."""
    out = {}
    for key, value in weights.items():
        if key.endswith(".scale") and _packed(weights.get(key[:-5] + "weight")):
            continue
        scale = weights.get(key[:-6] + "scale") if key.endswith(".weight") else None
        if scale is None or not _packed(value):
            out[key] = value
            continue
        out.update(_repack_pair(key[: -len(".weight")], value, scale, block, dtype))
    return out


def expand_release_scales(
    weights: Dict[str, mx.array],
    block: Tuple[int, int] = FP8_BLOCK,
    dtype: mx.Dtype = mx.bfloat16,
) -> Dict[str, mx.array]:
    """`repack_release` for mlx-lm's ``deepseek_v41`` sanitize, which renames, stacks
    the experts, splits ``wo_a`` into its groups and views each ``.weight`` beside a
    ``.scale`` as uint32, but takes the scales per row (32x32 tiles): each release
    pair keeps its names and weight bytes, its ``.scale`` becomes MLX's per row and 32
    inputs; the FP8 weights MLX cannot pack become floats, without ``.scale``."""
    packed = repack_release(weights, block, dtype)
    out = {}
    for key, value in packed.items():
        if key.endswith(".scales") and key[:-1] in weights:
            out[key[:-1]] = value
        elif key.endswith(".weight") and key[:-6] + "scales" in packed:
            out[key] = weights[key]
        else:
            out[key] = value
    return out


def _packed(weight: Optional[mx.array]) -> bool:
    return weight is not None and weight.dtype in (mx.uint8, mx.int8)


def _repack_pair(base, weight, scale, block, dtype) -> Dict[str, mx.array]:
    kind = release_kind(weight, scale, block)
    try:
        if kind == "fp4":
            w, s = repack_fp4(weight, scale)
        elif kind == "fp8" and weight.shape[-1] % GROUP:
            return {f"{base}.weight": dequantize_fp8(weight, scale, block, dtype)}
        elif kind == "fp8":
            w, s = repack_fp8(weight, scale, block)
        else:
            raise MTPError(
                f"scales of shape {tuple(scale.shape)} fit neither fp8 "
                f"{block[0]}x{block[1]} blocks nor fp4 rows"
            )
    except MTPError as e:
        raise MTPError(f"{base}.weight {tuple(weight.shape)}: {e}") from None
    return {f"{base}.weight": w, f"{base}.scales": s}


def quantization_config_for(
    weights: Dict[str, mx.array], default: Optional[dict] = None
) -> Optional[dict]:
    """The ``quantization`` dict mlx-lm's loader takes for ``weights`` (MLX names, after
    `repack_release` and renaming/stacking): ``default`` (`MXFP8` if None) plus one
    entry per module path whose packed tensors are mxfp8 or mxfp4 (a uint32
    ``P.weight`` beside uint8 ``P.scales``); None when there are none (all float)."""
    entries = {}
    for key, scales in weights.items():
        if not key.endswith(".scales") or scales.dtype != mx.uint8:
            continue
        path = key[: -len(".scales")]
        weight = weights.get(f"{path}.weight")
        if weight is None or weight.dtype != mx.uint32:
            continue
        bits = weight.shape[-1] // scales.shape[-1]
        if bits not in (4, 8) or weight.shape[-1] != bits * scales.shape[-1]:
            raise MTPError(f"{path}: packed tensors fit neither mxfp8 nor mxfp4")
        entries[path] = dict(MXFP8 if bits == 8 else MXFP4)
    if not entries:
        return None
    return {**dict(default or MXFP8), **entries}


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


# ---------------------------------------------------------------------------
# Float -> release (fixtures)
# ---------------------------------------------------------------------------


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

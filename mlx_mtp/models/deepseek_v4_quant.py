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
- `quantization_config_for`: the per-path ``quantization`` entries mlx-lm's loader
  and ``nn.quantize`` take, from packed tensors.

The inverse, float tensors in the release's dtypes for fixtures, is
`mlx_mtp.testing.deepseek_v4_release`.
"""

import re
from typing import Dict, Optional, Tuple

import mlx.core as mx

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
    inputs (int8 is FP4 only; a uint8 shape that fits both is FP8). A weight of fewer
    than two dimensions is neither."""
    if weight.ndim < 2:
        return None
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
    if weight.ndim < 2:
        raise MTPError(
            f"{base}.weight {tuple(weight.shape)}: a packed (FP8/FP4 bytes) weight "
            f"beside a .scale must be a matrix (rows, inputs), not {weight.ndim}-D; "
            "the checkpoint is damaged or not a DeepSeek-V4 release"
        )
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

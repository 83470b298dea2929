"""Each family against a real release's tensor names and shapes (tests/golden/*.json,
from the releases' own files: each records its source), not only against the
fixtures' reading of the layout.

The tensors are zero-strided views of their real shapes (no memory), so the whole
path runs at full size: FP8 dequantization (or, for DeepSeek-V4, FP8 and FP4 kept
packed as mxfp8 and mxfp4), the family's split (trunk vs MTP, copies checked and
dropped), its sanitize, a strict load into the MTP layers the family builds from the
release's config, and the trunk's sample against the trunk's own parameters.
"""

import json
import re
from itertools import product
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from mlx_mtp.heads import quantize_like
from mlx_mtp.loading import build_mtp, config_fixes, dequantize_fp8, fp8_block
from mlx_mtp.models import get_family

GOLDEN = Path(__file__).parent / "golden"
LAYOUTS = sorted(p.stem for p in GOLDEN.glob("*.json"))
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# As mx.load reads them (float8 as its bytes).
DTYPES = {
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "F8_E4M3": mx.uint8,
    "F8_E8M0": mx.uint8,
    "I8": mx.int8,
    "I64": mx.int64,
}


def expand(pattern: str) -> list:
    """``a.{0-2}.b.{5,7}`` -> the names it stands for (``a.0.b.5``, ...)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = []
    for spec in parts[1::2]:
        numbers = []
        for item in spec.split(","):
            lo, _, hi = item.partition("-")
            numbers += [str(n) for n in range(int(lo), int(hi or lo) + 1)]
        choices.append(numbers)
    out = []
    for picked in product(*choices):
        name = parts[0]
        for value, rest in zip(picked, parts[2::2]):
            name += value + rest
        out.append(name)
    return out


def tensors(table: dict) -> dict:
    """Zero-strided arrays of the table's shapes and dtypes, by name."""
    out = {}
    for pattern, (shape, *dtype) in table.items():
        kind = DTYPES[dtype[0] if dtype else "BF16"]
        for name in expand(pattern):
            out[name] = mx.broadcast_to(mx.zeros((), dtype=kind), shape)
    return out


def values(weights: dict) -> int:
    """The number of weight values ``weights`` hold, scales not counted: a release's
    FP4 ``W.weight`` (int8 beside ``W.scale``) two per byte, an MLX microscaled one
    (uint32 beside ``W.scales``, group 32) 32 per scale, any other tensor one per
    element."""
    total = 0
    for key, value in weights.items():
        base, _, kind = key.rpartition(".")
        if kind in ("scale", "scales") and f"{base}.weight" in weights:
            continue
        if value.dtype == mx.int8 and f"{base}.scale" in weights:
            total += 2 * value.size
        elif value.dtype == mx.uint32 and f"{base}.scales" in weights:
            total += 32 * weights[f"{base}.scales"].size
        else:
            total += value.size
    return total


def classes(family, config: dict):
    """The trunk's classes, as loading takes them: the family's, else mlx-lm's."""
    return (family.trunk_classes or _get_classes)(config)


@pytest.fixture(scope="module", params=LAYOUTS)
def golden(request):
    doc = json.loads((GOLDEN / f"{request.param}.json").read_text())
    family = get_family(doc["config"])
    config = {**doc["config"], **config_fixes(doc["config"], family)}
    weights = {**tensors(doc["trunk"]), **tensors(doc["mtp"])}
    weights = dequantize_fp8(weights, fp8_block(config))
    return doc, family, config, weights


def test_the_family_is_the_releases(golden):
    doc, family, config, _ = golden
    assert family.name == doc["family"] == config["model_type"]
    assert "huggingface.co/" in doc["model"] and doc["source"]


def test_split_finds_exactly_the_mtp_tensors(golden):
    """Every MTP tensor of the release on the MTP side, every trunk tensor on the
    trunk side, and the copies of trunk tensors checked and dropped."""
    doc, family, config, weights = golden
    trunk, mtp = family.split_weights(dict(weights), config)
    expected = dequantize_fp8(tensors(doc["mtp"]), fp8_block(config))
    copies = doc.get("copies", {})
    assert sorted(mtp) == sorted(set(expected) - set(copies))
    assert sorted(trunk) == sorted(set(weights) - set(expected))
    assert all(trunk[original] is not None for original in copies.values())


def test_sanitize_maps_every_mtp_tensor_into_the_layers(golden):
    """The MTP tensors, sanitized, load strictly into the layers the family builds
    from the release's config (every name and shape as the heads want), and none is
    dropped on the way (the same number of weight values: stacked, split, renamed or
    repacked)."""
    doc, family, config, weights = golden
    model_class, args_class = classes(family, config)
    trunk_model = model_class(args_class.from_dict(config))
    _, mtp = family.split_weights(dict(weights), config)
    raw = family.is_raw(weights, config)
    stack = build_mtp(trunk_model, family, mtp, config, raw)
    declared = family.declared_mtp_layers(config)
    assert len(stack.layers) == (declared or len(stack.layers)) >= 1
    sanitized = family.sanitize(mtp, config, trunk_model, raw=raw)
    assert values(sanitized) == values(mtp)


def test_the_trunk_sample_loads_into_the_trunk(golden):
    """The trunk's tensors, through the trunk class's own sanitize (the family's,
    for a trunk mlx-lm has not: DeepSeek-V4), are the parameters of the model built
    from the release's config, quantized as mlx-lm's loader quantizes it: every name
    and shape of the top level and of each sampled layer (what the sanitize drops,
    such as a vision tower, is not counted)."""
    doc, family, config, weights = golden
    model_class, args_class = classes(family, config)
    trunk_model = model_class(args_class.from_dict(config))
    trunk, _ = family.split_weights(dict(weights), config)
    sanitize = getattr(trunk_model, "sanitize", dict)
    sanitized = sanitize(dict(trunk))
    quantize_like(trunk_model, sanitized, config.get("quantization"))
    sampled = {int(m[1]) for key in sanitized if (m := LAYER.search(key))}
    expected = {
        name: value.shape
        for name, value in tree_flatten(trunk_model.parameters())
        if not (m := LAYER.search(name)) or int(m[1]) in sampled
    }
    assert {name: value.shape for name, value in sanitized.items()} == expected

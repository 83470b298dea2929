"""Each family against a real release's tensor names and shapes (tests/golden/*.json,
from the releases' own files: each records its source), not only against the
fixtures' reading of the layout.

The tensors are zero-strided views of their real shapes (no memory), so the whole
path runs at full size: FP8 dequantization, the family's split (trunk vs MTP, copies
checked and dropped), its sanitize, and a strict load into the MTP layers the family
builds from the release's config.
"""

import json
import re
from itertools import product
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from mlx_mtp.loading import build_mtp, config_fixes, dequantize_fp8, fp8_block
from mlx_mtp.models import get_family

GOLDEN = Path(__file__).parent / "golden"
LAYOUTS = sorted(p.stem for p in GOLDEN.glob("*.json"))
DTYPES = {"BF16": mx.bfloat16, "F32": mx.float32, "F8_E4M3": mx.uint8}


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


def elements(weights: dict) -> int:
    return sum(v.size for v in weights.values())


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
    dropped on the way (the same number of elements: stacked, split or renamed)."""
    doc, family, config, weights = golden
    model_class, args_class = _get_classes(config)
    trunk_model = model_class(args_class.from_dict(config))
    _, mtp = family.split_weights(dict(weights), config)
    raw = family.is_raw(weights, config)
    stack = build_mtp(trunk_model, family, mtp, config, raw)
    declared = family.declared_mtp_layers(config)
    assert len(stack.layers) == (declared or len(stack.layers)) >= 1
    sanitized = family.sanitize(mtp, config, trunk_model, raw=raw)
    assert elements(sanitized) == elements(mtp)

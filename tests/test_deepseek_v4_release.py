"""A DeepSeek-V4 fixture in the release's dtypes (FP8 e4m3 128x128 blocks, FP4
experts): it loads and converts with those weights packed (mxfp8, mxfp4), computing
what its float twin (the release bytes decoded in numpy) computes."""

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.convert import convert
from mlx_mtp.loading import load_model
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing import deepseek_v4_release as rel
from mlx_mtp.testing.fixtures import write_checkpoint

from .test_deepseek_v4_quant import decode_fp4, decode_fp8
from .test_greedy import plain_greedy

TOKENS = mx.array([[1, 5, 9, 3, 7, 2, 11, 13, 17, 4, 6, 8, 10, 12, 14, 19, 21, 23]])


def _decoded(release: dict) -> dict:
    out = {}
    for name, value in release.items():
        kind = rel.release_kind_of_name(name)
        if name.endswith(".scale") and kind is None:
            continue
        scale = release.get(name[: -len("weight")] + "scale")
        if kind == "fp8":
            value = decode_fp8(value, scale).astype(np.float32)
        elif kind == "fp4":
            value = decode_fp4(value, scale).astype(np.float32)
        out[name] = value
    return out


def _folder(src, dst, tensors: dict, config: dict):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model*.safetensors*"))
    rel.write_release_safetensors(dst / "model.safetensors", tensors)
    merged = json.loads((dst / "config.json").read_text()) | config
    (dst / "config.json").write_text(json.dumps(merged))
    return dst


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """``(release folder, float twin folder)``."""
    root = tmp_path_factory.mktemp("v4release")
    src = write_checkpoint("deepseek_v4", root / "float", tokenizer=False)
    tensors = {}
    for f in sorted(src.glob("model*.safetensors")):
        tensors |= {k: np.array(v) for k, v in mx.load(str(f)).items()}
    packed = rel.to_release(tensors)
    return (
        _folder(src, root / "release", packed, rel.release_config()),
        _folder(src, root / "twin", _decoded(packed), {}),
    )


def _modes(module) -> dict:
    counts = {}
    for _, m in tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module):
        if "scales" in m:
            counts[m.mode] = counts.get(m.mode, 0) + 1
    return counts


def _logits(model):
    return model.logits(model.hidden(TOKENS))


def test_release_loads_packed_and_computes_as_its_twin(release):
    packed, twin = (load_model(str(p), group=None)[0] for p in release)
    assert _modes(packed.trunk) == {"mxfp8": 34, "mxfp4": 12}
    assert _modes(packed.mtp) == {"mxfp8": 9, "mxfp4": 3}
    assert _modes(twin.trunk) == _modes(twin.mtp) == {}
    assert mx.abs(_logits(packed) - _logits(twin)).max().item() < 1e-4
    floats = dict(tree_flatten(twin.mtp.leaf_modules(), is_leaf=nn.Module.is_module))
    for path, m in tree_flatten(packed.mtp.leaf_modules(), is_leaf=nn.Module.is_module):
        if "scales" in m:
            w = mx.dequantize(
                m.weight, m.scales, None, m.group_size, m.bits, m.mode, dtype=mx.float32
            )
            assert mx.array_equal(w, floats[path].weight), path


@pytest.mark.parametrize("quantize", [False, True])
def test_conversion_keeps_the_release_packed(release, quantize, tmp_path):
    src = release[0]
    out = convert(
        str(src), str(tmp_path / "out"), quantize=quantize, q_bits=8, rank_vocab=False
    )
    config = json.loads((out / "config.json").read_text())
    entries = [
        v["mode"] for v in config["quantization"].values() if isinstance(v, dict)
    ]
    assert entries.count("mxfp8") == 34 and entries.count("mxfp4") == 12
    assert "quant_method" not in config["quantization_config"]
    model = load_model(str(out), group=None)[0]
    reference = load_model(str(src), group=None)[0]
    assert _modes(model.mtp) == {"mxfp8": 9, "mxfp4": 3}
    if quantize:
        assert config["mlx_mtp"]["trunk_quantization"]["mode"] == "affine"
        assert _modes(model.trunk)["affine"] > 0
    else:
        assert _modes(model.trunk) == {"mxfp8": 34, "mxfp4": 12}
        assert mx.array_equal(_logits(model), _logits(reference))


def test_a_packed_release_drafts_and_decodes_as_plain_decoding(release, tmp_path):
    """Greedy k = 1..3 on the packed release, and on its -q conversion, emit plain
    decoding's tokens."""
    converted = convert(
        str(release[0]), str(tmp_path / "q"), quantize=True, rank_vocab=False
    )
    prompt = TOKENS[0].tolist()
    for path in (release[0], converted):
        model = load_model(str(path), group=None)[0]
        expected = plain_greedy(model, prompt, 24)
        for k in (1, 2, 3):
            steps = mtp_generate_step(
                prompt, model, HEADS, num_draft_tokens=k, max_tokens=24
            )
            assert [o.token for o in steps] == expected, (path, k)


@pytest.mark.parametrize("name", ["mtp.0.norm.weight", "layers.0.attn.q_norm.weight"])
def test_a_packed_vector_is_one_line_naming_it(release, name, tmp_path):
    """A 1-D norm weight typed ``F8_E4M3`` beside a ``.scale`` (a damaged release), in
    the MTP layer or the trunk: ``generate`` and ``convert`` exit 1 with one line
    that names the tensor as the file does and says what was expected."""
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    src = tmp_path / "damaged"
    shutil.copytree(release[0], src)
    tensors = {
        k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    assert tensors[name].ndim == 1
    tensors[name] = np.zeros(tensors[name].shape, np.uint8)
    tensors[name[: -len("weight")] + "scale"] = np.full((1,), 127, np.uint8)
    rel.write_release_safetensors(src / "model.safetensors", tensors)
    shape = tensors[name].shape
    for args in (
        ["generate", "--model", src, "-p", "hi", "-m", "2"],
        ["convert", "--hf-path", src, "--mlx-path", tmp_path / "out"],
    ):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert isinstance(result.exception, SystemExit), result.exception
        assert result.exit_code == 1, result.output
        line = result.output.strip().splitlines()[-1]
        assert line.startswith(f"mlx-mtp: error: {name} {shape}: "), result.output
        assert "must be a matrix (rows, inputs), not 1-D" in line
    assert not (tmp_path / "out").exists()

"""DeepSeek-V4's released dtypes (FP8 e4m3 with ue8m0 128x128 block scales, FP4 e2m1
experts with ue8m0 per-32 scales) against MLX's mxfp8/mxfp4: every repack checked
exactly against numpy decodes of the release bytes written here, independently of the
module and of MLX."""

import json
import struct
from functools import partial
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import infer_quant_config

from mlx_mtp.errors import MTPError
from mlx_mtp.heads import quantized_modes
from mlx_mtp.models import deepseek_v4_quant as q
from mlx_mtp.testing import deepseek_v4_release as rel

# e2m1 by code: sign bit 3, then magnitude codes 0-7.
E2M1 = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64
)


def e4m3(codes: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bytes as float64 (exponent bias 7, subnormals, 0x7f/0xff NaN)."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exponent, mantissa = (c >> 3) & 0xF, c & 7
    normal = (8 + mantissa) * np.exp2(exponent - 10.0)
    value = np.where(exponent == 0, mantissa * 2.0**-9, normal)
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * value)


def e8m0(codes: np.ndarray) -> np.ndarray:
    return np.exp2(codes.astype(np.float64) - 127)


def decode_fp8(w: np.ndarray, s: np.ndarray, block=(128, 128)) -> np.ndarray:
    out, width = w.shape
    factor = np.kron(e8m0(s), np.ones(block))[:out, :width]
    return e4m3(w) * factor


def decode_fp4(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    b = packed.view(np.uint8)
    pairs = np.stack([E2M1[b & 0xF], E2M1[b >> 4]], axis=-1)
    values = pairs.reshape(*b.shape[:-1], 2 * b.shape[-1])
    return values * np.repeat(e8m0(s), 32, axis=-1)


def fp8_bytes(rng, shape) -> np.ndarray:
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    return np.where((codes & 0x7F) == 0x7F, 0x7E, codes).astype(np.uint8)


def mx_dequant(w, s, mode) -> np.ndarray:
    bits = 8 if mode == "mxfp8" else 4
    d = mx.dequantize(w, s, mode=mode, group_size=32, bits=bits, dtype=mx.float32)
    return np.array(d).astype(np.float64)


@pytest.mark.parametrize("shape", [(200, 160), (128, 256), (40, 32)])
def test_repack_fp8_equals_the_block_decode(shape):
    rng = np.random.default_rng(0)
    out, width = shape
    w = fp8_bytes(rng, shape)
    s = rng.integers(110, 140, (-(-out // 128), -(-width // 128))).astype(np.uint8)
    wq, sq = q.repack_fp8(mx.array(w), mx.array(s))
    assert wq.dtype == mx.uint32 and wq.shape == (out, width // 4)
    assert sq.dtype == mx.uint8 and sq.shape == (out, width // 32)
    np.testing.assert_array_equal(mx_dequant(wq, sq, "mxfp8"), decode_fp8(w, s))


def test_repack_fp8_other_blocks_and_float_scales():
    rng = np.random.default_rng(1)
    w, s = fp8_bytes(rng, (70, 96)), rng.integers(120, 135, (3, 3)).astype(np.uint8)
    expect = decode_fp8(w, s, (32, 32))
    wq, sq = q.repack_fp8(mx.array(w), mx.array(s), block=(32, 32))
    np.testing.assert_array_equal(mx_dequant(wq, sq, "mxfp8"), expect)
    scales = mx.array(e8m0(s).astype(np.float32))
    wq, sq = q.repack_fp8(mx.array(w), scales, block=(32, 32))
    np.testing.assert_array_equal(mx_dequant(wq, sq, "mxfp8"), expect)


@pytest.mark.parametrize("lead", [(), (3,)])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_repack_fp4_equals_the_lut_decode(lead, dtype):
    rng = np.random.default_rng(2)
    packed = rng.integers(0, 256, (*lead, 24, 48)).astype(np.uint8).view(dtype)
    s = rng.integers(115, 135, (*lead, 24, 3)).astype(np.uint8)
    wq, sq = q.repack_fp4(mx.array(packed), mx.array(s))
    assert wq.dtype == mx.uint32 and wq.shape == (*lead, 24, 12)
    expect = decode_fp4(packed, s)
    if lead:  # MLX dequantizes one matrix at a time
        got = np.stack([mx_dequant(wq[e], sq[e], "mxfp4") for e in range(lead[0])])
    else:
        got = mx_dequant(wq, sq, "mxfp4")
    np.testing.assert_array_equal(got, expect)


def test_fp4_low_nibble_comes_first():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x71  # low code 1 (0.5), high code 7 (6.0)
    wq, sq = q.repack_fp4(
        mx.array(packed.view(np.int8)), mx.full((1, 1), 127, mx.uint8)
    )
    assert mx_dequant(wq, sq, "mxfp4")[0, :2].tolist() == [0.5, 6.0]


def normal(rng, *shape) -> np.ndarray:
    return (0.05 * rng.standard_normal(shape)).astype(np.float32)


def fixture_tensors(rng):
    """Release names at fixture sizes (hidden 64, ranks 32 and 16), plus odd rows."""
    n = partial(normal, rng)
    t = {
        "embed.weight": n(32, 64),
        "layers.0.attn.wq_a.weight": n(32, 64),
        "layers.0.attn.wq_b.weight": n(200, 32),
        "layers.0.attn.wkv.weight": n(16, 64),
        "layers.0.attn.wo_b.weight": n(64, 16),
        "layers.0.attn.compressor.wkv.weight": n(32, 64),
        "layers.0.attn.indexer.wq_b.weight": n(48, 32),
        "layers.0.hc_attn_fn": n(24, 256),
        "layers.0.ffn.gate.weight": n(4, 64),
        "layers.0.ffn.shared_experts.w1.weight": n(32, 64),
        "mtp.0.e_proj.weight": n(64, 64),
        "mtp.0.ffn.experts.1.w2.weight": n(64, 32),
    }
    for e in range(2):
        t[f"layers.0.ffn.experts.{e}.w1.weight"] = n(32, 64)
        t[f"layers.0.ffn.experts.{e}.w2.weight"] = n(64, 32)
    t["layers.0.ffn.experts.0.w1.weight"][3, :32] = 0.0  # a zero group
    return t


def release_decode(release, name):
    base = name[: -len(".weight")]
    if rel.release_kind_of_name(name) == "fp4":
        return decode_fp4(release[name], release[f"{base}.scale"])
    return decode_fp8(release[name], release[f"{base}.scale"])


def test_to_release_dtypes_shapes_and_accuracy():
    tensors = fixture_tensors(np.random.default_rng(3))
    release = rel.to_release(tensors)
    for name, value in tensors.items():
        kind = rel.release_kind_of_name(name)
        if kind is None:
            assert release[name] is value and name[:-6] + "scale" not in release
            continue
        w, s = release[name], release[name[:-6] + "scale"]
        assert s.dtype == np.uint8
        if kind == "fp8":
            assert w.dtype == np.uint8 and w.shape == value.shape
            assert s.shape == (-(-value.shape[0] // 128), 1)
            top, step = 448.0, 2.0**-4  # half a spacing, relative to the value
        else:
            assert w.dtype == np.int8 and w.shape == (
                value.shape[0],
                value.shape[1] // 2,
            )
            assert s.shape == (value.shape[0], value.shape[1] // 32)
            top, step = 6.0, 2.0**-2
        decoded = release_decode(release, name)
        scale = np.kron(e8m0(s), np.ones((128, 128) if kind == "fp8" else (1, 32)))
        scale = scale[: value.shape[0], : value.shape[1]]
        assert np.all(np.abs(value) <= top * scale)  # the scale fits every block
        bound = np.maximum(
            np.abs(value) * step, scale * (2.0**-10 if kind == "fp8" else 0.25)
        )
        assert np.all(np.abs(decoded - value) <= bound), name
    assert rel.release_kind_of_name("layers.0.attn.compressor.wkv.weight") is None
    assert (
        rel.release_kind_of_name("layers.0.attn.indexer.compressor.wkv.weight") is None
    )


def test_to_release_rounds_like_mlx_to_fp8():
    """The FP8 codes are the nearest e4m3 values, as MLX's own conversion rounds."""
    w = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)
    codes, s = rel.quantize_fp8_np(w)
    scaled = w.astype(np.float64) / e8m0(s)[0, 0]
    assert np.array_equal(
        codes, np.array(mx.to_fp8(mx.array(scaled.astype(np.float32))))
    )


def test_to_release_ties_go_to_even_and_scales_are_tight():
    """Halfway values round to the even code; a block whose largest magnitude is
    exactly the format's largest value gets scale 1 (byte 127), the smallest fit."""
    fp8 = np.float32(
        [[448.0, 1 + 1 / 16, 1 + 3 / 16, -(2**-10), 3 * 2**-10] + [0] * 27]
    )
    codes, s = rel.quantize_fp8_np(fp8)
    assert s.tolist() == [[127]]
    assert codes[0, :5].tolist() == [0x7E, 0x38, 0x3A, 0x80, 0x02]
    fp4 = np.float32([[6.0, 0.25, 0.75, 2.5, -5.0, 1.25] + [0] * 26])
    packed, s = rel.quantize_fp4_np(fp4)
    assert s.tolist() == [[127]]
    assert decode_fp4(packed, s)[0, :6].tolist() == [6.0, 0.0, 1.0, 2.0, -4.0, 1.0]


def test_release_round_trip_through_mlx():
    """float -> release bytes -> `repack_release` -> MLX dequantized equals the numpy
    decode of the release bytes; fp8 weights of width 16 (no mxfp8) load as floats."""
    release = rel.to_release(fixture_tensors(np.random.default_rng(5)))
    loaded = q.repack_release(
        {k: mx.array(v) for k, v in release.items()}, dtype=mx.float32
    )
    assert not any(k.endswith(".scale") for k in loaded)
    for name in release:
        kind = rel.release_kind_of_name(name)
        if kind is None:
            continue
        expect = release_decode(release, name)
        scales = loaded.get(name[:-6] + "scales")
        if release[name].shape[1] % 32 and kind == "fp8":
            assert scales is None and loaded[name].dtype == mx.float32
            np.testing.assert_array_equal(np.array(loaded[name]), expect)
            continue
        mode = "mxfp8" if kind == "fp8" else "mxfp4"
        np.testing.assert_array_equal(mx_dequant(loaded[name], scales, mode), expect)
    config = q.quantization_config_for(loaded)
    assert config["layers.0.attn.wq_a"] == q.MXFP8
    assert config["layers.0.ffn.experts.0.w1"] == q.MXFP4
    assert "layers.0.attn.wo_b" not in config and "embed" not in config


def test_written_file_loads_as_the_repack_expects(tmp_path):
    tensors = fixture_tensors(np.random.default_rng(6))
    tensors["layers.0.ffn.gate.tid2eid"] = np.arange(8, dtype=np.int32).reshape(4, 2)
    release = rel.to_release(tensors)
    path = rel.write_release_safetensors(tmp_path / "model.safetensors", release)
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["layers.0.attn.wq_a.weight"]["dtype"] == "F8_E4M3"
    assert header["layers.0.attn.wq_a.scale"]["dtype"] == "F8_E8M0"
    assert header["layers.0.ffn.experts.0.w1.weight"]["dtype"] == "I8"
    assert header["layers.0.ffn.experts.0.w1.scale"]["dtype"] == "F8_E8M0"
    assert header["layers.0.ffn.gate.tid2eid"]["dtype"] == "I32"
    loaded = mx.load(str(path))
    assert set(loaded) == set(release)
    assert loaded["layers.0.attn.wq_a.weight"].dtype == mx.uint8
    assert loaded["layers.0.attn.wq_a.scale"].dtype == mx.uint8
    assert loaded["layers.0.ffn.experts.0.w1.weight"].dtype == mx.int8
    for name, value in release.items():
        np.testing.assert_array_equal(np.array(loaded[name]), value)
    assert q.is_release_quantized(loaded) and not q.is_release_quantized(
        {k: v for k, v in loaded.items() if not k.endswith(".scale")}
    )
    wq, sq = q.repack_fp4(
        loaded["layers.0.ffn.experts.1.w2.weight"],
        loaded["layers.0.ffn.experts.1.w2.scale"],
    )
    expect = release_decode(release, "layers.0.ffn.experts.1.w2.weight")
    np.testing.assert_array_equal(mx_dequant(wq, sq, "mxfp4"), expect)


def test_bfloat16_floats_keep_the_release_float32_ones(tmp_path):
    tensors = {
        "embed.weight": np.float32([[1.0, 1 + 2**-9, 3.0e-3]]),
        "layers.0.hc_attn_fn": np.float32([[1 + 2**-20]]),
        "layers.0.attn.attn_sink": np.float32([0.1]),
        "layers.0.ffn.gate.bias": np.float32([0.2]),
    }
    path = rel.write_release_safetensors(
        tmp_path / "m.safetensors", tensors, "bfloat16"
    )
    loaded = mx.load(str(path))
    assert loaded["embed.weight"].dtype == mx.bfloat16
    expect = mx.array(tensors["embed.weight"]).astype(mx.bfloat16)
    assert mx.array_equal(loaded["embed.weight"], expect)
    for name in (
        "layers.0.hc_attn_fn",
        "layers.0.attn.attn_sink",
        "layers.0.ffn.gate.bias",
    ):
        assert loaded[name].dtype == mx.float32
        np.testing.assert_array_equal(np.array(loaded[name]), tensors[name])


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq_a = nn.Linear(64, 40, bias=False)
        self.wo_b = nn.Linear(16, 64, bias=False)
        self.experts = SwitchLinear(64, 32, 2, bias=False)


def test_quantization_config_builds_layers_that_load_and_match():
    """mlx-lm's per-path predicate, fed `quantization_config_for`, builds mxfp8 and
    mxfp4 layers that load strictly and compute with the released values;
    `infer_quant_config` (what mlx-lm does for paths the dict leaves out) agrees, and
    `quantized_modes` reads the same modes back from the built modules."""
    rng = np.random.default_rng(7)
    n = partial(normal, rng)
    release = {"wo_b.weight": n(64, 16)}
    release["wq_a.weight"], release["wq_a.scale"] = rel.quantize_fp8_np(n(40, 64))
    release["experts.weight"], release["experts.scale"] = rel.quantize_fp4_np(
        n(2, 32, 64)
    )
    weights = q.repack_release({k: mx.array(v) for k, v in release.items()})
    config = q.quantization_config_for(weights)
    assert config == {**q.MXFP8, "wq_a": q.MXFP8, "experts": q.MXFP4}

    model = Tiny()
    for path in ("wq_a", "experts"):
        module = dict(model.named_modules())[path]
        assert infer_quant_config(path, module, weights) == config[path]

    def predicate(path, m):  # mlx_lm.utils.load_model's, for the dict's paths
        return config.get(path, False) if hasattr(m, "to_quantized") else False

    nn.quantize(model, **q.MXFP8, class_predicate=predicate)
    model.load_weights(list(weights.items()), strict=True)
    assert quantized_modes(model) == {"wq_a": q.MXFP8, "experts": q.MXFP4}

    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    w = decode_fp8(release["wq_a.weight"], release["wq_a.scale"])
    np.testing.assert_allclose(np.array(model.wq_a(x)), np.array(x) @ w.T, atol=2e-4)
    e1 = decode_fp4(release["experts.weight"], release["experts.scale"])[1]
    got = model.experts(x[:, None, None, :], mx.array([[1]] * 3)).reshape(3, 32)
    np.testing.assert_allclose(np.array(got), np.array(x) @ e1.T, atol=2e-4)


def test_float_only_weights_have_no_quantization():
    assert q.quantization_config_for({"a.weight": mx.zeros((4, 4))}) is None
    assert q.repack_release({"a.weight": mx.zeros((4, 4))}).keys() == {"a.weight"}


def test_release_config_declares_the_release_keys():
    config = rel.release_config()
    assert config["expert_dtype"] == "fp4"
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }


def test_malformed_pairs_are_one_line_errors():
    w = mx.zeros((64, 64), mx.uint8)
    with pytest.raises(MTPError, match=r"layers\.0\.attn\.wq_a\.weight \(64, 64\)"):
        q.repack_release(
            {
                "layers.0.attn.wq_a.weight": w,
                "layers.0.attn.wq_a.scale": mx.zeros((2, 3), mx.uint8),
            }
        )
    with pytest.raises(MTPError, match="expected"):
        q.repack_fp8(w, mx.zeros((1, 2), mx.uint8))
    with pytest.raises(MTPError, match="multiples of 32"):
        q.repack_fp8(mx.zeros((4, 16), mx.uint8), mx.zeros((1, 1), mx.uint8))
    with pytest.raises(MTPError, match="expected"):
        q.repack_fp4(mx.zeros((4, 16), mx.int8), mx.zeros((4, 2), mx.uint8))
    with pytest.raises(MTPError, match="powers of two"):
        q.repack_fp8(w, mx.full((1, 1), 0.3))
    vector = {"mtp.0.norm.weight": mx.zeros((64,), mx.uint8)}  # F8_E4M3, 1-D
    vector["mtp.0.norm.scale"] = mx.zeros((1,), mx.uint8)
    with pytest.raises(MTPError, match=r"^mtp\.0\.norm\.weight \(64,\): .* not 1-D"):
        q.repack_release(vector)
    assert (
        q.release_kind(vector["mtp.0.norm.weight"], vector["mtp.0.norm.scale"]) is None
    )
    with pytest.raises(ValueError, match="fp4 needs an input width"):
        rel.to_release(
            {"layers.0.ffn.experts.0.w2.weight": np.zeros((4, 16), np.float32)}
        )


def test_mlx_lm_v41_sanitize_packs_the_expanded_release():
    """`expand_release_scales` then mlx-lm's ``deepseek_v41`` sanitize (which the V4
    trunk reuses) on the fixture builder's tensors: ``wo_a`` split into its groups and
    the experts stacked, each packed tensor exactly the numpy decode."""
    from mlx_lm.models import deepseek_v41

    from mlx_mtp.testing import fixtures

    cfg, tensors = fixtures._deepseek_v4(
        fixtures._Init(np.random.default_rng(8)),
        64,
        num_hidden_layers=1,
        compress_ratios=[0, 0],
        num_hash_layers=0,
    )
    release = rel.to_release(
        {k: v for k, v in tensors.items() if k.startswith("layers.")}
    )
    expanded = q.expand_release_scales({k: mx.array(v) for k, v in release.items()})
    me = SimpleNamespace(args=SimpleNamespace(o_groups=2, n_routed_experts=4))
    weights = deepseek_v41.Model.sanitize(me, expanded)
    config = q.quantization_config_for(weights)
    attn, ffn = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert config[f"{attn}o_a_proj"] == config[f"{attn}q_a_proj"] == q.MXFP8
    assert config[f"{ffn}experts.switch_mlp.down_proj"] == q.MXFP4
    assert config[f"{ffn}shared_experts.up_proj"] == q.MXFP8
    wo_a = decode_fp8(
        release["layers.0.attn.wo_a.weight"], release["layers.0.attn.wo_a.scale"]
    ).reshape(2, 16, -1)
    for g in range(2):
        w, s = (
            weights[f"{attn}o_a_proj.weight"][g],
            weights[f"{attn}o_a_proj.scales"][g],
        )
        np.testing.assert_array_equal(mx_dequant(w, s, "mxfp8"), wo_a[g])
    name = "layers.0.ffn.experts.3.w2"
    down = f"{ffn}experts.switch_mlp.down_proj"
    got = mx_dequant(
        weights[f"{down}.weight"][3], weights[f"{down}.scales"][3], "mxfp4"
    )
    expect = decode_fp4(release[f"{name}.weight"], release[f"{name}.scale"])
    np.testing.assert_array_equal(got, expect)

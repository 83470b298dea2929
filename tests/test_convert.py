"""``mlx-mtp convert``: round trips, plain mlx-lm compatibility, graft, check,
safety."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm import generate as lm_generate
from mlx_lm import load as lm_load
from mlx_lm.utils import quantize_model

from mlx_mtp.cli import main
from mlx_mtp.convert import check, convert, graft_heads
from mlx_mtp.draft_vocab import FILE as RANKING
from mlx_mtp.errors import MTPError
from mlx_mtp.heads import quantize_heads
from mlx_mtp.loading import load_model
from mlx_mtp.models import get_family
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import FAMILIES

PROMPT = [5, 77, 301, 12, 9, 140, 88, 2]
N = 32
PRECISIONS = {
    "float": {},
    "q8": dict(quantize=True, q_bits=8),
    "q4": dict(quantize=True, q_bits=4),  # heads stay 8-bit
}


def greedy(model, k):
    return [
        o.token
        for o in mtp_generate_step(
            PROMPT, model, HEADS, num_draft_tokens=k, max_tokens=N
        )
    ]


def in_memory(src, precision):
    """The source loaded and quantized in memory as the conversion should have been."""
    model, config, _ = load_model(str(src))
    options = PRECISIONS[precision]
    if options:
        quantize_model(model.trunk, config, None, options["q_bits"])
        quantize_heads(model.mtp, 8)
    return model


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_greedy_identity(family, precision, checkpoint, tmp_path):
    src = checkpoint(family, predictable=True)
    out = convert(str(src), tmp_path / "mlx", progress=False, **PRECISIONS[precision])
    config = json.loads((out / "config.json").read_text())
    assert config["mtp"]["quantization"] == (
        None
        if precision == "float"
        else {"group_size": 64, "bits": 8, "mode": "affine"}
    )
    assert config["mlx_mtp"]["source"] == str(src.resolve())
    assert config["mlx_mtp"]["source_fingerprint"]
    converted = load_model(str(out))[0]
    reference = in_memory(src, precision)
    expected = greedy(reference, 0)
    assert greedy(converted, 0) == expected  # the conversion is faithful
    stats = list(
        mtp_generate_step(PROMPT, converted, HEADS, num_draft_tokens=2, max_tokens=N)
    )
    assert [o.token for o in stats] == expected  # and MTP decoding on it is exact
    assert stats[-1].stats.accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_mlx_lm_loads_conversions(family, checkpoint, tmp_path):
    """mlx-lm loads the trunk of every conversion whose model type it has."""
    if get_family({"model_type": family}).trunk_classes:
        pytest.skip(f"mlx-lm 0.32 has no {family} trunk (mlx-mtp brings its own)")
    out = convert(
        str(checkpoint(family)), tmp_path / "mlx", quantize=True, progress=False
    )
    model, tokenizer = lm_load(str(out))  # heads ignored: mtp.safetensors is not read
    text = lm_generate(model, tokenizer, "def f(x):", max_tokens=8)
    assert isinstance(text, str) and text
    assert (out / "tokenizer.json").is_file() and (out / "mtp.safetensors").is_file()


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_5",
        "deepseek_v3",
        "glm4_moe_lite",
        "deepseek_v32",
        "deepseek_v4",
        "exaone_moe",
        "ernie4_5_moe",
        "longcat_flash",
        "bailing_hybrid",
        "bailing_moe_v3",
        "mimo_v2_flash",
        "nemotron_h",
        "step3p5",
        "step3p7",
        "glm_ocr",
    ],
)
def test_graft_onto_conversion_without_heads(family, checkpoint, tmp_path, caplog):
    src = checkpoint(family, predictable=True, num_shards=2)
    plain_src = strip_heads(src, tmp_path / "plain-src")
    bare = convert(
        str(plain_src), tmp_path / "bare", quantize=True, q_bits=4, progress=False
    )
    assert "no MTP tensors" in caplog.text
    assert load_model(str(bare), allow_missing_heads=True)[0].num_mtp_layers == 0
    grafted = graft_heads(str(src), str(bare), head_bits=8)
    full = convert(str(src), tmp_path / "full", quantize=True, q_bits=4, progress=False)
    a, b = load_model(str(grafted))[0], load_model(str(full))[0]
    assert a.num_mtp_layers == b.num_mtp_layers >= 1
    seq = mx.array(PROMPT)[None]
    ha = a.hidden(seq)
    np.testing.assert_allclose(
        np.array(a.logits(a.mtp_forward(0, ha, seq))),
        np.array(b.logits(b.mtp_forward(0, b.hidden(seq), seq))),
        atol=1e-5,
    )
    assert greedy(a, 2) == greedy(a, 0)
    with pytest.raises(MTPError, match="already has MTP heads"):
        graft_heads(str(src), str(grafted))


def test_graft_command_and_its_old_spelling(checkpoint, tmp_path):
    """Both spellings graft; the ranking of the vocabulary is stored with the heads
    unless --no-rank-vocab says not to."""
    src = checkpoint("deepseek_v3", predictable=True)
    plain_src = strip_heads(src, tmp_path / "plain-src", "model.layers.3.")
    for old_spelling in (False, True):
        bare = convert(str(plain_src), tmp_path / f"bare{old_spelling}", progress=False)
        if old_spelling:
            args = ["convert", "--graft-heads-from", src, "--mlx-path", bare]
        else:
            args = ["graft", "--from", src, "--mlx-path", bare, "--no-rank-vocab"]
        result = run_cli(*args)
        assert result.exit_code == 0, result.output
        assert ("now `mlx-mtp graft" in result.output) == old_spelling
        assert load_model(str(bare))[0].num_mtp_layers == 1
        ranked = "draft_vocab" in json.loads((bare / "config.json").read_text())["mtp"]
        assert (bare / RANKING).exists() == ranked == old_spelling


def test_graft_refuses_a_different_trunk(checkpoint, tmp_path):
    out = convert(str(checkpoint("glm4_moe")), tmp_path / "glm", progress=False)
    with pytest.raises(MTPError, match="model_type differs"):
        graft_heads(str(checkpoint("mimo")), str(out), overwrite=True)
    other_vocab = checkpoint("glm4_moe", vocab_size=320)
    with pytest.raises(MTPError, match="vocab_size is 512 .* but 320"):
        graft_heads(str(other_vocab), str(out), overwrite=True)
    other_weights = checkpoint("glm4_moe", seed=5)
    with pytest.raises(MTPError, match="not from .*weights differ"):
        graft_heads(str(other_weights), str(out), overwrite=True)


def test_check_reports_and_catches_broken_heads(checkpoint, tmp_path):
    src = checkpoint("qwen3_next", predictable=True)
    out = convert(str(src), tmp_path / "q8", quantize=True, q_bits=8, progress=False)
    report = check(str(out))
    assert report.passed and report.head_agreement[0] > 0.95
    assert (
        report.head_quantization["bits"] == 8 and report.trunk_quantization["bits"] == 8
    )
    result = run_cli("check", out)
    assert (
        result.exit_code == 0 and "head 0:" in result.output and "ok" in result.output
    )
    clean = mx.load(str(out / "mtp.safetensors"))

    def broken_check(edit):
        mx.save_safetensors(str(out / "mtp.safetensors"), edit(dict(clean)))
        return check(str(out))

    # the norms shifted a second time
    report = broken_check(
        lambda w: {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in w.items()}
    )
    assert not report.passed
    result = run_cli("check", out)
    assert result.exit_code == 1 and "FAIL" in result.output
    # the concatenation order swapped: [hidden, embedding], not [embedding, hidden]
    proj = "layers.0.eh_proj.weight"
    w = mx.dequantize(
        clean[proj], clean[proj[:-6] + "scales"], clean[proj[:-6] + "biases"], bits=8
    )
    swapped = mx.concatenate([w[:, 64:], w[:, :64]], axis=1)
    q, scales, biases = mx.quantize(swapped, group_size=64, bits=8)
    report = broken_check(
        lambda w: {
            **w,
            proj: q,
            proj[:-6] + "scales": scales,
            proj[:-6] + "biases": biases,
        }
    )
    assert report.head_agreement[0] < 0.3 and not report.passed


def test_cli_convert_and_bad_inputs(checkpoint, tmp_path):
    src = checkpoint("mimo", predictable=True)
    out = tmp_path / "cli"
    result = run_cli(
        "convert", "--hf-path", src, "--mlx-path", out, "-q", "--head-bits", "16"
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["mtp"]["quantization"] is None
    again = run_cli("convert", "--hf-path", src, "--mlx-path", out)
    assert again.exit_code == 1 and "already exists" in again.output
    assert (out / RANKING).exists()  # ranked for draft vocabularies by default
    args = ("convert", "--hf-path", src, "--mlx-path", out, "--overwrite")
    assert run_cli(*args, "--no-rank-vocab").exit_code == 0
    assert not (out / RANKING).exists()
    assert run_cli(*args, "--rank-vocab").exit_code == 0 and (out / RANKING).exists()
    assert run_cli("convert", "--mlx-path", out).exit_code == 2  # no mode
    assert run_cli("convert", "--hf-path", src).exit_code == 2  # no output


def strip_heads(src, dst, prefix=None):
    """A copy of checkpoint ``src`` without its MTP tensors: names under ``prefix`` (a
    string or a tuple of them), or by default those its family's split finds."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    weights = {}
    for f in src.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    config = json.loads((src / "config.json").read_text())
    layer_of = get_family(config).mtp_layer_of
    if prefix is None:
        weights = {k: v for k, v in weights.items() if layer_of(k, config) is None}
    else:
        weights = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    mx.save_safetensors(str(dst / "model.safetensors"), weights, {"format": "pt"})
    return dst


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_sources(checkpoint, tmp_path):
    def fails(src, *needles, extra=()):
        before = sorted(p.name for p in src.iterdir())
        result = run_cli(
            "convert", "--hf-path", src, "--mlx-path", tmp_path / "out", *extra
        )
        assert result.exit_code == 1, result.output
        line = result.output.strip().splitlines()[-1]
        assert line.startswith("mlx-mtp: error:") and all(
            n in line for n in needles
        ), line
        assert not (tmp_path / "out").exists()
        assert sorted(p.name for p in src.iterdir()) == before  # source untouched
        assert not list(tmp_path.glob(".out*"))

    truncated = _copy(checkpoint("glm4_moe"), tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    fails(truncated, "truncated")
    sharded = _copy(checkpoint("deepseek_v3", num_shards=3), tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    fails(sharded, "model-00002-of-00003.safetensors", "missing")
    garbage = _copy(checkpoint("mimo"), tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    fails(garbage, "not a valid safetensors")
    unknown = _copy(checkpoint("mimo"), tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "llama4"
    (unknown / "config.json").write_text(json.dumps(config))
    fails(unknown, "unsupported model_type 'llama4'")
    headless = strip_heads(checkpoint("qwen3_5"), tmp_path / "headless", "mtp.")
    fails(headless, "no MTP tensors", extra=["--require-heads"])


def test_interrupted_conversion_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    import mlx_mtp.convert.output as output

    src = checkpoint("deepseek_v3", num_shards=2)
    calls = []

    def interrupted(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return save(path, *args, **kwargs)

    save = mx.save_safetensors
    monkeypatch.setattr(output.mx, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), tmp_path / "out", progress=False, shard_gb=1e-4)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []  # no destination, no partial folder


def test_transformers5_rope_parameters_are_flattened(checkpoint, tmp_path):
    src = _copy(checkpoint("qwen3_next", predictable=True), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config.pop("rope_theta"),
        "partial_rotary_factor": config.pop("partial_rotary_factor"),
    }
    (src / "config.json").write_text(json.dumps(config))
    out = convert(str(src), tmp_path / "out", progress=False)
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_theta"] == 10000000.0 and saved["partial_rotary_factor"] == 0.25
    model = load_model(str(out))[0]
    assert greedy(model, 2) == greedy(
        load_model(str(checkpoint("qwen3_next", True)))[0], 0
    )


def to_fp8_checkpoint(src, dst, block=16):
    """A copy of ``src`` with every 2-D projection stored as block-scaled FP8
    (``F8_E4M3`` + ``weight_scale_inv``), as DeepSeek / GLM release them, and the
    same model with those weights dequantized, in float32, as a reference."""
    import struct

    weights = mx.load(str(src / "model.safetensors"))
    fp8, ref = {}, {}
    for k, v in weights.items():
        if k.endswith("proj.weight") and v.ndim == 2:
            m, n = v.shape  # not always multiples of the block: pad, as releases do
            a = mx.pad(mx.abs(v), ((0, -m % block), (0, -n % block)))
            s = a.reshape(-(-m // block), block, -(-n // block), block).max(axis=(1, 3))
            s = mx.maximum(s, 1e-12) / 448.0
            full = mx.repeat(mx.repeat(s, block, 0), block, 1)[:m, :n]
            q = mx.to_fp8(v / full)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            ref[k] = (mx.from_fp8(q, dtype=mx.float32) * full).astype(mx.bfloat16)
        else:
            fp8[k] = ref[k] = v
    for folder, tensors in ((dst / "fp8", fp8), (dst / "ref", ref)):
        shutil.copytree(src, folder)
        mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    # relabel the uint8 tensors as F8_E4M3, as torch writes them
    path = dst / "fp8" / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for k, info in header.items():
        if k != "__metadata__" and info["dtype"] == "U8":
            info["dtype"] = "F8_E4M3"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])
    config = json.loads((dst / "fp8" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (dst / "fp8" / "config.json").write_text(json.dumps(config))
    return dst / "fp8", dst / "ref"


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_fp8_checkpoints_are_dequantized(family, checkpoint, tmp_path):
    fp8, ref = to_fp8_checkpoint(checkpoint(family, predictable=True), tmp_path)
    seq = mx.array(PROMPT)[None]

    def outputs(model):
        h = model.hidden(seq)
        return np.array(model.logits(h)), np.array(
            model.logits(model.mtp_forward(0, h, seq))
        )

    expected = outputs(load_model(str(ref))[0])
    for got in (outputs(load_model(str(fp8))[0]),):
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, atol=1e-3)
    out = convert(str(fp8), tmp_path / "mlx", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    for a, b in zip(outputs(load_model(str(out))[0]), expected):
        np.testing.assert_allclose(a, b, atol=1e-3)


def test_graft_from_the_hub_fetches_only_mtp_shards(checkpoint, tmp_path, monkeypatch):
    """Graft from a hub repo: the index is read first, then only the shards holding
    MTP tensors are requested (huggingface-hub ``allow_patterns``)."""
    import fnmatch

    import mlx_lm.utils

    src = checkpoint("deepseek_v3", predictable=True, num_shards=3)
    requests = []

    def fake_download(repo, revision=None, allow_patterns=None):
        assert repo == "org/tiny-deepseek"
        requests.append(list(allow_patterns))
        cache = tmp_path / "hub-cache"
        cache.mkdir(exist_ok=True)
        for f in src.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, cache / f.name)
        return cache

    monkeypatch.setattr(mlx_lm.utils, "_download", fake_download)
    stripped = strip_heads(src, tmp_path / "plain", "model.layers.3.")
    bare = convert(str(stripped), tmp_path / "bare", progress=False)
    graft_heads("org/tiny-deepseek", str(bare))
    fetched = sorted(p.name for p in (tmp_path / "hub-cache").glob("*.safetensors"))
    assert fetched == ["model-00003-of-00003.safetensors"]  # the MTP shard only
    assert requests[0] == ["*.json"]
    model = load_model(str(bare))[0]
    assert model.num_mtp_layers == 1 and greedy(model, 2) == greedy(model, 0)

"""Bad input gets one clear line and a non-zero exit, never a traceback."""

import json
import shutil

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_mtp import MTPError, generate, load, stream_generate
from mlx_mtp.cli import main
from mlx_mtp.errors import MissingHeadsError, UnsupportedModelError


@pytest.fixture
def broken(checkpoint, tmp_path):
    """``broken(family, edit_weights=None, edit_config=None) -> path`` of a damaged copy."""

    def make(family, edit_weights=None, edit_config=None):
        out = tmp_path / "broken"
        shutil.copytree(checkpoint(family), out)
        if edit_weights:
            weights = mx.load(str(out / "model.safetensors"))
            edit_weights(weights)
            mx.save_safetensors(str(out / "model.safetensors"), weights)
        if edit_config:
            config = json.loads((out / "config.json").read_text())
            edit_config(config)
            (out / "config.json").write_text(json.dumps(config))
        return out

    return make


def run_cli(*args, input=None):
    result = CliRunner().invoke(main, list(args), input=input)
    assert "Traceback" not in result.output
    return result


def assert_one_line_error(result, *needles):
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-mtp: error:"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_mtp_tensor(broken):
    path = broken("deepseek_v3", lambda w: w.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(MissingHeadsError, match="missing layers.0.eh_proj.weight"):
        load(str(path))
    assert_one_line_error(
        run_cli("generate", "--model", str(path), "-p", "hi"), "missing"
    )


def test_mismatched_shape(broken):
    def shrink(w):
        w["model.mtp_layers.1.input_proj.weight"] = mx.zeros((64, 64))

    path = broken("mimo", shrink)
    with pytest.raises(
        MissingHeadsError, match=r"shape \(64, 64\), expected \(64, 128\)"
    ):
        load(str(path))


def test_heads_from_another_model(broken):
    def perturb(w):
        w["model.layers.2.shared_head.head.weight"] = w["lm_head.weight"] + 1

    with pytest.raises(MissingHeadsError, match="do not belong to this model"):
        load(str(broken("glm4_moe", perturb)))


def test_declared_heads_missing(broken):
    def drop_mtp(w):
        for k in [k for k in w if k.startswith("model.mtp_layers.")]:
            w.pop(k)

    path = broken("mimo", drop_mtp)
    with pytest.raises(MissingHeadsError, match="declares 2 MTP layer"):
        load(str(path))
    model, tokenizer = load(str(path), allow_missing_heads=True)
    assert model.num_mtp_layers == 0
    assert generate(model, tokenizer, "hi", max_tokens=4, num_draft_tokens=3)
    result = run_cli("generate", "--model", str(path), "-p", "hi", "-m", "4")
    assert_one_line_error(result, "--allow-missing-heads")
    ok = run_cli(
        "generate", "--model", str(path), "-p", "hi", "-m", "4", "--allow-missing-heads"
    )
    assert ok.exit_code == 0, ok.output


def test_unknown_model_type(broken):
    path = broken("mimo", edit_config=lambda c: c.update(model_type="mamba9"))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'mamba9'"):
        load(str(path))
    assert_one_line_error(
        run_cli("generate", "--model", str(path), "-p", "x"), "mamba9"
    )


def test_truncated_safetensors(checkpoint, tmp_path):
    out = tmp_path / "trunc"
    shutil.copytree(checkpoint("mimo"), out)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MTPError):
        load(str(out))
    assert_one_line_error(run_cli("generate", "--model", str(out), "-p", "x"))


def test_nonexistent_path(tmp_path):
    with pytest.raises(MTPError, match="does not exist"):
        load(str(tmp_path / "nope"))
    assert_one_line_error(
        run_cli("generate", "--model", str(tmp_path / "nope"), "-p", "x"),
        "does not exist",
    )


def test_empty_prompt(checkpoint, loaded):
    model, tokenizer = loaded("mimo")
    with pytest.raises(MTPError, match="empty"):
        generate(model, tokenizer, "", max_tokens=4)
    with pytest.raises(MTPError, match="empty"):
        generate(model, tokenizer, [], max_tokens=4)
    result = run_cli("generate", "--model", str(checkpoint("mimo")), "-p", "  ")
    assert_one_line_error(result, "empty")


def test_bad_flags(checkpoint):
    path = str(checkpoint("mimo"))
    assert run_cli("generate", "--model", path, "--top-p", "2").exit_code == 2
    assert run_cli("generate", "--model", path, "-k", "-1").exit_code == 2
    for bad in ("0", "-5"):  # refused before loading: -1 is "no limit"
        result = run_cli("generate", "--model", path, "-p", "x", "--max-tokens", bad)
        assert result.exit_code == 2 and "or -1 for no limit" in result.output


def test_context_overflow(loaded):
    model, tokenizer = loaded("mimo")
    limit = model.args.max_position_embeddings
    with pytest.raises(MTPError, match=f"context is {limit}"):
        generate(model, tokenizer, [5] * limit, max_tokens=4)
    responses = list(
        stream_generate(
            model, tokenizer, [5] * (limit - 3), max_tokens=-1, num_draft_tokens=2
        )
    )
    assert len(responses) <= 3

"""The memory guard: weights larger than what MLX can use here
(``MLX_MTP_MEMORY_LIMIT``, else Metal's working set or the available memory) are
refused in one line before anything loads, by the Python API, ``generate`` and
``serve``; ``--force`` loads them anyway."""

import pytest

from mlx_mtp import memory
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load

from .test_errors import assert_one_line_error, run_cli


@pytest.mark.parametrize(
    "text, size",
    [
        ("1000", 1000),
        ("24GB", 24 * 10**9),
        ("512 MiB", 512 * 2**20),
        ("1.5gb", 1_500_000_000),
        ("1e9", 10**9),
    ],
)
def test_sizes(text, size):
    assert memory.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-3GB"])
def test_bad_sizes_are_one_line(text):
    with pytest.raises(MTPError, match="is not a size"):
        memory.parse_size(text)


def test_the_limit_and_where_it_comes_from(monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, "3GB")
    assert memory.memory_limit() == (3 * 10**9, memory.LIMIT_ENV)
    monkeypatch.delenv(memory.LIMIT_ENV)
    limit, source = memory.memory_limit()
    assert limit > 0 and source != memory.LIMIT_ENV


def test_weights_over_the_limit_are_refused_unless_forced(checkpoint, monkeypatch):
    path = checkpoint("deepseek_v3")
    size = memory.weights_bytes([path])
    assert size > 0
    monkeypatch.setenv(memory.LIMIT_ENV, str(size - 1))
    with pytest.raises(MTPError, match=r"its weights take .* missing\).*--force"):
        load(str(path))
    model, _ = load(str(path), force=True)
    assert model.num_mtp_layers == 1
    monkeypatch.setenv(memory.LIMIT_ENV, str(2 * size))  # within two ranks' share
    memory.check_fits([path], ranks=1)
    monkeypatch.setenv(memory.LIMIT_ENV, str(size // 2 + 1))
    memory.check_fits([path], ranks=2)
    with pytest.raises(MTPError, match="per rank over 2"):
        monkeypatch.setenv(memory.LIMIT_ENV, str(size // 4))
        memory.check_fits([path], ranks=2)


def test_the_commands_refuse_in_one_line(checkpoint, monkeypatch):
    path = str(checkpoint("deepseek_v3"))
    monkeypatch.setenv(memory.LIMIT_ENV, "1kB")
    for command in ("generate", "serve"):
        extra = ["-p", "hi", "-m", "2"] if command == "generate" else ["--port", "0"]
        result = run_cli(command, "--model", path, *extra)
        assert_one_line_error(result, "its weights take", "MLX_MTP_MEMORY_LIMIT")
    result = run_cli("generate", "--model", path, "-p", "hi", "-m", "2", "--force")
    assert result.exit_code == 0, result.output


def test_convert_warns_before_downloading_what_will_not_fit(monkeypatch, caplog):
    """A hub checkpoint whose conversion will not fit the memory bound: a warning
    from the hub's file sizes before anything downloads (the conversion goes on:
    it may be for another machine); none when it fits or the hub cannot say."""
    import logging
    from types import SimpleNamespace

    import huggingface_hub

    from mlx_mtp.convert.hf import Options, converted_bytes, warn_if_too_big

    assert converted_bytes(54 * 10**9, Options(quantize=True, q_bits=4)) < 16 * 10**9
    files = [
        SimpleNamespace(rfilename=f"model-{i}.safetensors", size=10**10)
        for i in range(6)
    ]
    info = SimpleNamespace(siblings=files, tags=[])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: info)
    monkeypatch.setenv(memory.LIMIT_ENV, "24GB")
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        warn_if_too_big("org/big", None, Options())  # 60 GB as it is
        assert "converts to about 60.0 GB, more than the 24.0 GB" in caplog.text
        caplog.clear()
        warn_if_too_big("org/big", None, Options(quantize=True, q_bits=4))  # ~17 GB
        assert caplog.text == ""

    def offline(*a, **k):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", offline)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        warn_if_too_big("org/big", None, Options())
    assert caplog.text == ""

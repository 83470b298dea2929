"""Seeds and sampling settings out of range: a usage error naming the option in the
CLI (every command with ``--seed``), a one-line `MTPError` in the library; the
largest seed MLX takes works."""

import pytest
from click.testing import CliRunner

from mlx_mtp.cli import main
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import generate as mtp_generate
from mlx_mtp.sampling import SamplingError

LARGEST = str(2**64 - 1)


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
@pytest.mark.parametrize("command", ["generate", "chat", "train-heads"])
def test_a_seed_out_of_range_is_a_usage_error(command, seed, tmp_path):
    args = {"train-heads": ["--data", str(tmp_path), "--mlx-path", str(tmp_path)]}
    result = run(
        command, "--model", str(tmp_path), *args.get(command, []), "--seed", seed
    )
    assert result.exit_code == 2, result.output
    assert "--seed" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_largest_seed_and_bad_sampling_in_the_cli(checkpoint):
    path = str(checkpoint("mimo", predictable=True))
    args = ("generate", "--model", path, "-p", "hi", "-m", "4", "--temp", "0.8")
    assert run(*args, "--seed", LARGEST, "--quiet").exit_code == 0
    for bad in (["--temp", "inf"], ["--temp", "nan"], ["--min-p", "nan"]):
        result = run(*args, *bad)
        assert result.exit_code == 1, result.output
        assert result.output.startswith("mlx-mtp: error: ")
        assert result.output.count("\n") == 1, result.output


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_a_bad_seed_is_an_mtp_error_in_the_library(loaded, seed):
    model, tokenizer = loaded("mimo", True)
    with pytest.raises(MTPError, match="seed") as e:
        mtp_generate(model, tokenizer, "hi", max_tokens=2, temp=1.0, seed=seed)
    assert isinstance(e.value, SamplingError) and e.value.name == "seed"

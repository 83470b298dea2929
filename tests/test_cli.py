"""The CLI as a new user runs it, on a tiny checkpoint."""

import pytest
from click.testing import CliRunner

from mlx_mtp.cli import main


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


NOTE = "ranking the vocabulary for draft vocabularies (once for this model)...\n"


def test_generate_streams_text_and_stats(checkpoint, tmp_path, monkeypatch):
    path = str(checkpoint("deepseek_v3", predictable=True))
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))  # nothing ranked or cached yet
    args = ("generate", "--model", path, "--prompt", "def f(x):", "-m", "24")
    result = run(*args, "-k", "2")
    assert result.exit_code == 0, result.output
    note, *text, stats = result.output.rstrip("\n").splitlines()
    # first use: the vocabulary is ranked for draft vocabularies (then cached)
    assert note + "\n" == NOTE
    assert "tok/s" in stats and "by position [" in stats and "tok/pass" in stats
    again = run(*args, "-k", "2")
    assert again.output.splitlines()[:-1] == text  # same greedy text, no note
    plain = run(*args, "-k", "0")
    assert plain.output.splitlines()[:-1] == text
    assert plain.output.splitlines()[-1].endswith(" GB")  # -k 0: plain, no drafts


def test_quiet_prints_only_the_text(checkpoint, tmp_path, monkeypatch):
    path = str(checkpoint("deepseek_v3", predictable=True))
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))
    args = ("generate", "--model", path, "-p", "def f(x):", "-m", "24", "--quiet")
    result = run(*args)
    assert result.exit_code == 0 and NOTE not in result.output
    assert result.output == run(*args, "-k", "0").output
    assert list(tmp_path.glob("draft-vocab/*.safetensors"))  # ranked all the same


def test_prompt_from_stdin_and_sampling_seed(checkpoint):
    path = str(checkpoint("mimo", predictable=True))
    args = ("generate", "--model", path, "-m", "16", "--temp", "0.8", "--top-k", "20")
    a = run(*args, "--seed", "3", "--quiet", input="Hello there")
    b = run(*args, "--seed", "3", "--quiet", input="Hello there")
    assert a.exit_code == 0, a.output
    assert a.output == b.output


def test_chat_template_flags(checkpoint, monkeypatch):
    """The prompt decoded is the chat template's rendering of ``-p`` (with
    ``--system-prompt`` as a system message), or ``-p``'s own tokens with
    ``--ignore-chat-template``."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp import cli

    path = checkpoint("glm4_moe")
    tokenizer, build_prompt, prompts = load_tokenizer(path), cli.build_prompt, []

    def spy(*args, **kwargs):
        ids = build_prompt(*args, **kwargs)
        prompts.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(cli, "build_prompt", spy)
    user = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cases = {
        (): user,
        ("--system-prompt", "Be brief."): "<|im_start|>system\nBe brief.<|im_end|>\n"
        + user,
        ("--ignore-chat-template",): "hi",
    }
    for extra, prompt in cases.items():
        result = run("generate", "--model", str(path), "-p", "hi", "-m", "2", *extra)
        assert result.exit_code == 0, result.output
        assert prompts == [prompt], extra
        prompts.clear()


def test_help_and_module_entry():
    """``python -m mlx_mtp`` is the CLI: its help lists the commands, exit 0."""
    import subprocess
    import sys

    assert "--num-draft-tokens" in run("generate", "--help").output
    done = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: mlx-mtp [OPTIONS] COMMAND")
    for command in ("generate", "chat", "serve", "convert", "graft", "train-heads"):
        assert f"\n  {command} " in done.stdout, command


@pytest.mark.parametrize(
    "args, new",
    [
        (["train-heads", "--draft-vocab", "64"], "--draft-vocab-size"),
        (["convert", "--draft-vocab"], "--rank-vocab"),
        (["convert", "--no-draft-vocab"], "--no-rank-vocab"),
        (["graft", "--draft-vocab"], "--rank-vocab"),
        (["graft", "--no-draft-vocab"], "--no-rank-vocab"),
    ],
)
def test_old_spellings_of_renamed_flags_name_the_new_one(args, new):
    """``--draft-vocab`` is the decoding option; train-heads, convert and graft named
    other things so: their old spelling is a usage error naming the new flag."""
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1].startswith(f"Error: {args[1]} is now {new} (")


def test_ctrl_c_stops_cleanly(checkpoint):
    """SIGINT mid-generation: exit 130, stats line, no traceback."""
    import signal
    import subprocess
    import sys
    import time

    path = str(checkpoint("deepseek_v3", predictable=True))
    cmd = [sys.executable, "-m", "mlx_mtp", "generate", "--model", path]
    proc = subprocess.Popen(
        cmd + ["-p", "def f(x):", "-m", "-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not proc.stdout.read(1):
        pass  # wait for the first streamed text
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted" in err and "tok/s" in err


def test_kv_cache_flags(checkpoint):
    """--kv-bits works with drafting; --max-kv-size drafts exactly (the output is
    plain decoding's with the same window); the two together are refused."""
    path = str(checkpoint("mimo", predictable=True, num_attention_heads=2))
    args = ("generate", "--model", path, "-p", "def f(x):", "-m", "24")
    quantized = run(*args, "-k", "2", "--kv-bits", "4", "--kv-group-size", "32")
    assert quantized.exit_code == 0, quantized.output
    drafted = run(*args, "-k", "2", "--max-kv-size", "16", "--quiet")
    plain = run(*args, "-k", "0", "--max-kv-size", "16", "--quiet")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    assert drafted.output == plain.output
    both = run(*args, "-k", "0", "--max-kv-size", "16", "--kv-bits", "4")
    assert both.exit_code == 1 and "rotating" in both.output


def test_stats_line_shows_the_drafted_positions_only():
    from types import SimpleNamespace

    from mlx_mtp.generate import format_stats
    from mlx_mtp.stats import MTPStats

    def line(stats):
        r = SimpleNamespace(
            prompt_tokens=5, prompt_tps=1.0, generation_tokens=9, generation_tps=1.0
        )
        return format_stats(SimpleNamespace(**vars(r), peak_memory=0.1, mtp=stats))

    stats = MTPStats(3, 8)  # heads up to 3, lookup up to 8
    stats.record(0, 0)
    assert line(stats).endswith("| no drafts (plain decoding)")
    stats.record(2, 1)
    assert line(stats).endswith("by position [1.00 0.00]")

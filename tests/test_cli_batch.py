"""``mlx-mtp generate --prompts-file``: every prompt of a file, decoded in batches,
each result the text `mlx_mtp.generate` gives for that prompt alone."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_mtp.cli import build_prompt, main, render_chat
from mlx_mtp.generate import generate

FAMILY = "qwen3_5"
GOES_ON = "the same command goes on from there"  # an interrupted --output run's


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint(FAMILY, predictable=True))


@pytest.fixture(scope="module")
def model(loaded):
    return loaded(FAMILY, True)


def lone(model, ids, **options) -> str:
    """What `mlx_mtp.generate` gives for the prompt ids alone."""
    return generate(*model, ids, **options)


def results(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_plain_lines_give_each_prompt_its_lone_text(model_path, model, tmp_path):
    """One prompt a line (blank lines skipped, ``\\n`` kept as typed), the command
    line's options for all: each result is the prompt's lone greedy text, in the
    file's order, with its id (the line's 0-based index), counts and MTP stats."""
    lines = ["def f(x):", "", "hello\\nworld", "a b c"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    result = run(*args, "-m", "12", "-k", "2", "--max-batch", "2", "--output", str(out))
    assert result.exit_code == 0, result.output
    rows = results(out)
    assert [r["id"] for r in rows] == [0, 2, 3]
    assert [r["prompt"] for r in rows] == ["def f(x):", "hello\\nworld", "a b c"]
    tokenizer = model[1]
    for row in rows:
        ids = build_prompt(tokenizer, row["prompt"], None, False, escapes=False)
        assert row["text"] == lone(model, ids, max_tokens=12, num_draft_tokens=2)
        assert row["prompt_tokens"] == len(ids) and row["generation_tokens"] == 12
        assert row["finish_reason"] == "length"
        mtp = row["mtp"]
        assert mtp["drafted"] > 0 and 0 <= mtp["accepted"] <= mtp["drafted"]
        assert mtp["acceptance_rate"] == round(mtp["accepted"] / mtp["drafted"], 4)
        assert mtp["tokens_per_round"] >= 1
        assert set(mtp["batch_sizes"]) <= {"1", "2"} and mtp["batch_sizes"]
    # the stats line, on stderr; stdout got nothing (the results went to --output)
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("3 prompts | generated ")


def test_jsonl_with_per_prompt_options(model_path, model):
    """JSONL from stdin: each line's options (over the command line's) and its id;
    a chat's messages get the chat template as ``--prompt`` does; a seeded sampled
    prompt gives its lone seeded text; the results keep the input order though the
    short ones finish first."""
    lines = [
        {"id": "long", "prompt": "def f(x):", "max_tokens": 20},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"prompt": "a b c", "temp": 0.8, "seed": 7, "num_draft_tokens": 2},
        {"prompt": "x = 1", "num_draft_tokens": 0, "max_tokens": 6},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    args = ("generate", "--model", model_path, "--prompts-file", "-", "-k", "3")
    result = run(*args, "-m", "10", "--quiet", "--max-batch", "3", input=text)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in rows] == ["long", 1, 2, 3]
    assert rows[1]["prompt"] == lines[1]["messages"]
    tokenizer = model[1]
    ids = [build_prompt(tokenizer, p, None, False) for p in ("def f(x):", "hi")]
    ids += [build_prompt(tokenizer, p, None, False) for p in ("a b c", "x = 1")]
    chat = render_chat(tokenizer, lines[1]["messages"])
    assert tokenizer.encode(chat, add_special_tokens=False) == ids[1]
    alone = [
        lone(model, ids[0], max_tokens=20, num_draft_tokens=3),
        lone(model, ids[1], max_tokens=4, num_draft_tokens=3),
        lone(model, ids[2], max_tokens=10, num_draft_tokens=2, temp=0.8, seed=7),
        lone(model, ids[3], max_tokens=6, num_draft_tokens=0),
    ]
    assert [r["text"] for r in rows] == alone
    assert [r["generation_tokens"] for r in rows] == [20, 4, 10, 6]
    assert rows[3]["mtp"]["drafted"] == 0 and rows[0]["mtp"]["drafted"] > 0


def test_jsonl_lines_with_their_own_grammar_and_penalties(model_path, model):
    """A line's json_schema, regex and logit_bias (JSON keys): each result is its
    lone constrained, processed text."""
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}}
    lines = [
        {"prompt": "JSON:", "json_schema": schema, "max_tokens": 80},
        {"prompt": "Code:", "regex": "[A-Z]{3}", "max_tokens": 8},
        {"prompt": "a b c", "logit_bias": {"5": 3.0}, "frequency_penalty": 0.5},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    args = ("generate", "--model", model_path, "--prompts-file", "-", "-k", "2")
    result = run(*args, "-m", "10", "--quiet", input=text)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    tokenizer = model[1]
    ids = [build_prompt(tokenizer, x["prompt"], None, False) for x in lines]
    alone = [
        lone(model, ids[0], max_tokens=80, num_draft_tokens=2, json_schema=schema),
        lone(model, ids[1], max_tokens=8, num_draft_tokens=2, regex="[A-Z]{3}"),
        lone(
            model,
            ids[2],
            max_tokens=10,
            num_draft_tokens=2,
            logit_bias={5: 3.0},
            frequency_penalty=0.5,
        ),
    ]
    assert [r["text"] for r in rows] == alone
    assert isinstance(json.loads(rows[0]["text"]), dict) and len(rows[1]["text"]) == 3


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b", "tmep": 1}\n', "line 2: unknown key 'tmep'"),
        ('{"prompt": "a", "temp": -1}\n', "line 1: temp must be >= 0, got -1"),
        ('\n{"prompt": "a", "top_k": "x"}\n', "line 2: top_k must be an integer"),
        ('{"prompt": "a", "seed": true}\n', "line 1: seed must not be true"),
        ('{"prompt": "a", "regex": "x", "json_object": true}\n', "line 1: give one of"),
        ('{"prompt": "a", "logit_bias": {"x": 1}}\n', "line 1: logit_bias keys"),
        ('{"prompt": "a", "draft_vocab": "12"}\n', "line 1: draft_vocab must be"),
        ('{"prompt": "a"}\nplain text\n', "line 2: not a JSON object, but line 1"),
        ('{"id": 3}\n', "line 1: give either 'prompt' or 'messages'"),
        ('{"messages": "hi"}\n', "line 1: 'messages' must be a non-empty list"),
        (
            '{"prompt": "a", "max_tokens": 3\n{"prompt": "b"}\n',
            "line 1: not a JSON object (Expecting ',' delimiter at column 32), but "
            "line 2 is (a JSONL file has one object a line)",
        ),
        (
            '{"prompt": "a", "max_tokens": 3\n{"prompt": "b"\n',
            "line 1: not a JSON object (Expecting ',' delimiter at column 32); a file "
            "whose first line starts with '{' is JSONL",
        ),
        ("{x} to YAML\n", "line 1: not a JSON object (Expecting property name"),
        ('hello\n{"prompt": "b"}\n', "line 1: not a JSON object, but line 2 is"),
        ('{"prompt": ' * 50000 + "\n", "line 1: not a JSON object (it nests too"),
        (
            '{"messages": [{"role": "user", "content": 5}]}\n',
            "line 1: messages[0].content must be a string, null or a list of parts",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url", '
            '"image_url": {"url": "http://x/y.png"}}]}]}\n',
            "line 1: messages[0].content[0] is an image: this model takes no images",
        ),
        ('{"messages": [{"content": "hi"}]}\n', "line 1: messages[0].role must be"),
        (
            '{"messages": [{"role": "user", "content": "\\ud800"}]}\n',
            "line 1: messages holds a lone surrogate",
        ),
        ("", "has no prompts (it is empty)"),
        ("\n  \n\n", "has no prompts (it is empty)"),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(model_path, tmp_path, text, message):
    """Checked before anything loads: one line naming the line (and the key), exit
    2, no output file."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(text)
    result = run(
        "generate",
        *("--model", model_path, "--prompts-file", str(prompts), "--output", str(out)),
    )
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"mlx-mtp: error: {prompts}")
    assert message in result.output
    assert list(tmp_path.iterdir()) == [prompts]


def test_usage_errors(model_path, tmp_path):
    """--prompts-file with --prompt, or --output without --prompts-file: exit 2."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ("generate", "--model", model_path)
    both = run(*args, "--prompts-file", str(prompts), "-p", "hi")
    assert both.exit_code == 2
    assert "--prompts-file and --prompt cannot go together" in both.output
    alone = run(*args, "-p", "hi", "--output", str(tmp_path / "o"))
    assert alone.exit_code == 2 and "--output goes with --prompts-file" in alone.output


def test_a_chat_without_the_chat_template_is_refused(model_path, tmp_path):
    """A 'messages' line with --ignore-chat-template: one line naming the line,
    exit 2, nothing generated."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps(chat) + "\n")
    args = ("--prompts-file", str(prompts), "--output", str(out))
    result = run("generate", "--model", model_path, *args, "--ignore-chat-template")
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert result.output.startswith(f"mlx-mtp: error: {prompts} line 2: 'messages'")
    assert not out.exists()


def test_an_output_of_other_results_is_never_overwritten(
    model_path, tmp_path, monkeypatch
):
    """--output holding anything but results of these prompts (text, another prompts
    file's results) or the prompts file itself (a link to it too): one line naming
    it, exit 2, the file as it was. Ctrl-C while the finished file is put in order:
    exit 130, every result kept; the rerun then puts it in order without
    generating."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "hello", "max_tokens": 6}, {"prompt": "world", "max_tokens": 2}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = prompts.read_text()
    flags = ("generate", "--model", model_path, "-m", "4", "-k", "2")
    args = (*flags, "--prompts-file", str(prompts))
    out.write_text("old\n")
    result = run(*args, "--output", str(out))
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"mlx-mtp: error: --output {out} line 1 is not a result of {prompts} (it is "
        "not a result line of mlx-mtp); give another --output, or delete that file "
        "to start over\n"
    )
    assert out.read_text() == "old\n"
    other = tmp_path / "other.jsonl"
    other.write_text(text.replace("world", "there"))
    theirs = (*flags, "--prompts-file", str(other), "--output", str(out))
    assert run(*theirs).exit_code == 2
    out.unlink()
    assert run(*theirs).exit_code == 0
    theirs = out.read_text()
    result = run(*args, "--output", str(out))
    assert (
        result.exit_code == 2
        and "(the prompt or id of line 2 differs)" in result.output
    )
    assert out.read_text() == theirs
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    for same in (prompts, link):
        result = run(*args, "--output", str(same))
        assert result.exit_code == 2, result.output
        assert (
            result.output
            == f"mlx-mtp: error: --output {same} is the prompts file itself\n"
        )
        assert prompts.read_text() == text
    out.unlink()

    replace = os.replace

    def interrupted(src, dst):
        if str(dst) != str(out):  # another file (measured costs, ...)
            return replace(src, dst)
        assert [r["line"] for r in results(Path(src))] == [1, 2]  # in order, whole
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(os, "replace", interrupted)
        result = run(*args, "--output", str(out))  # line 2 is done first
    assert result.exit_code == 130, result.output
    assert result.stderr.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in result.output
    assert [r["line"] for r in results(out)] == [2, 1]
    names = ["link.jsonl", "other.jsonl", "out.jsonl", "p.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    result = run(*args, "--output", str(out))
    assert result.exit_code == 0, result.output
    assert (
        result.stderr == f"every prompt of {prompts} has its result in {out} already\n"
    )
    assert [r["line"] for r in results(out)] == [1, 2]


def test_ctrl_c_before_a_result_leaves_no_file(model_path, tmp_path, monkeypatch):
    """Ctrl-C while the prompts decode, before any is done (the progress line up):
    the progress line, then one line saying that no result was written, exit 130;
    no output file."""
    import importlib

    # the module (the package's ``generate`` attribute is the function)
    gen = importlib.import_module("mlx_mtp.generate")

    real = gen.batch_generate

    def stopped(*args, on_output=None, **kwargs):
        def once(out):
            on_output(out)
            raise KeyboardInterrupt

        return real(*args, on_output=once, **kwargs)

    monkeypatch.setattr(gen, "batch_generate", stopped)
    prompts, out = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("hello\nworld\n")
    args = ("--prompts-file", str(prompts), "--output", str(out), "--progress")
    result = run("generate", "--model", model_path, "-m", "4", *args)
    assert result.exit_code == 130, result.output
    progress, stop = result.stderr.rstrip("\n").split("\n")[-2:]
    assert progress.startswith("\r0/2 prompts | ") and "tok/s" in progress
    assert stop == f"interrupted: 0 of 2 results written to {out}; {GOES_ON}"
    assert "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [prompts]


def test_progress_line_and_help(model_path):
    """--progress: the updating line (prompts done / total, tokens, tok/s), ended
    before the summary line; --help documents the file's two forms."""
    args = ("generate", "--model", model_path, "--prompts-file", "-", "-m", "3")
    result = run(*args, "--progress", input="hello\nworld\n")
    assert result.exit_code == 0, result.output
    *_, progress, summary = result.stderr.rstrip("\n").split("\n")
    assert progress.split("\r")[-1].startswith("2/2 prompts | 6 tok | ")
    assert summary.startswith("2 prompts | generated 6 tok in ")
    assert "tok/s" in summary and ("accepted" in summary or "no drafts" in summary)
    assert len(result.stdout.splitlines()) == 2
    quiet = run(*args, "--progress", "--quiet", input="hello\n")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    usage = " ".join(run("generate", "--help").output.split())
    for words in ("--prompts-file", "--max-batch", "JSONL", '"messages"', "--output"):
        assert words in usage


@pytest.mark.parametrize(
    "line, message",
    [
        ({"logit_bias": {"600": 1}}, "line 2: logit_bias token 600 is outside the"),
        ({"regex": "(ab"}, "line 2: llguidance refuses the regex"),
        ({"kv_bits": 4}, "line 2: max_kv_size and kv_bits cannot be used on this"),
        (
            {"prompt": "word " * 5000},
            "line 2: the prompt has 15014 tokens but the model's context",
        ),
    ],
)
def test_what_the_model_refuses_names_the_line(model_path, tmp_path, line, message):
    """What only the loaded model tells (a logit_bias id past its vocabulary, a
    pattern the grammar engine refuses, a KV-cache setting a batch cannot take, a
    prompt over the context) is found before any decoding: one line naming the
    line, exit 2, no output file."""
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "a"}, {"prompt": "b", **line}, {"prompt": "c"}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    result = run(*args, "-m", "4", "--output", str(out))
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert result.output.startswith(f"mlx-mtp: error: {prompts} {message}")
    assert not out.exists()


def test_kv_flags_with_a_batched_prompts_file(model_path, tmp_path):
    """--kv-bits on the command line of a prompts file that decodes in batches: one
    line naming the flags, exit 2."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    result = run(*args, "--kv-bits", "4")
    assert result.exit_code == 2
    assert result.output == (
        "mlx-mtp: error: --max-kv-size and --kv-bits do not go with --prompts-file "
        "on this model (its prompts are decoded in batches)\n"
    )


def interrupt_once(args, out: Path):
    """``python -m mlx_mtp ARGS`` as a user runs it, sent SIGINT as soon as the file
    ``out`` holds a line: its exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_mtp", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and "\n" in out.read_text():
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def signal_after_a_result(monkeypatch, signum: int, after: int = 1) -> None:
    """Make `mlx_mtp.batch_generate` send this process ``signum`` once ``after``
    prompts are done (their results given to the writer)."""
    import importlib

    gen = importlib.import_module("mlx_mtp.generate")
    real = gen.batch_generate

    def signalled(*args, on_output=None, **kwargs):
        done = []

        def once(out):
            on_output(out)
            done.extend([out.uid] if out.finish_reason is not None else [])
            if len(done) == after:
                os.kill(os.getpid(), signum)

        return real(*args, on_output=once, **kwargs)

    monkeypatch.setattr(gen, "batch_generate", signalled)


@pytest.mark.slow
def test_an_interrupted_run_keeps_its_results_and_a_rerun_goes_on(
    model_path, tmp_path, monkeypatch
):
    """SIGINT once --output holds a result: exit 130 and one line saying how many
    results were written and where, each whole; SIGTERM in the rerun once it wrote
    one more: exit 143, likewise; the next rerun generates the rest, and the file is
    then the uninterrupted run's, byte for byte (one prompt at a time and a fixed k:
    the MTP stats are the same too)."""
    prompts, out, whole = (tmp_path / n for n in ("p.jsonl", "out.jsonl", "w.jsonl"))
    lines = [{"id": f"s{i}", "prompt": f"story {i}"} for i in range(6)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["generate", "--model", model_path, "--prompts-file", str(prompts)]
    args += ["-m", "40", "-k", "2", "--max-batch", "1", "--ignore-chat-template"]
    args += ["--quiet", "--output"]
    code, err = interrupt_once([*args, str(out)], out)
    n = len(results(out))
    assert code == 130 and 1 <= n < 6, (code, n, err)
    assert err == f"\ninterrupted: {n} of 6 results written to {out}; {GOES_ON}\n"
    with monkeypatch.context() as m:
        signal_after_a_result(m, signal.SIGTERM)
        result = run(*args, str(out))
    assert result.exit_code == 143, result.output
    assert len(results(out)) == n + 1
    stopped = f"stopped by SIGTERM: {n + 1} of 6 results written to {out}; {GOES_ON}"
    assert result.stderr == f"\n{stopped}\n"
    assert run(*args, str(out)).exit_code == 0
    assert run(*args, str(whole)).exit_code == 0
    assert [r["id"] for r in results(whole)] == [f"s{i}" for i in range(6)]
    assert out.read_text() == whole.read_text()


def test_stdout_gets_the_results_in_order_as_they_are_done(model_path, monkeypatch):
    """Without --output each result goes to stdout once it and those before it are
    done; Ctrl-C after prompts 1 and 3 are done (2 is not): prompt 1's result
    written, one line saying so and that prompt 3's waited, exit 130."""
    lines = [
        {"prompt": "a", "max_tokens": 2},
        {"prompt": "b", "max_tokens": 30},
        {"prompt": "c", "max_tokens": 3},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    args = ("generate", "--model", model_path, "--prompts-file", "-", "--quiet")
    with monkeypatch.context() as m:
        signal_after_a_result(m, signal.SIGINT, after=2)
        result = run(*args, input=text)
    assert result.exit_code == 130, result.output
    assert [json.loads(x)["line"] for x in result.stdout.splitlines()] == [1]
    assert result.stderr == (
        "\ninterrupted: 1 of 3 results written to stdout (1 more were done but wait "
        "for an earlier prompt; --output FILE keeps every result as it is done, and "
        "a rerun goes on)\n"
    )


def test_a_rerun_after_a_kill_mid_line_redoes_that_result(model_path, tmp_path):
    """A last line cut short (the run was killed while writing it) is dropped: the
    rerun generates that prompt again, and the file is whole and in order; a line
    whose result is an error is retried."""
    prompts, out = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("hello\nworld\nfoo\n")
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    args += ("-m", "4", "-k", "2", "--max-batch", "1", "--output", str(out))
    assert run(*args).exit_code == 0
    whole = out.read_text()
    first, second, third = whole.splitlines(keepends=True)
    failed = {**json.loads(first), "finish_reason": "error", "error": "it failed"}
    failed.pop("text")
    out.write_text(json.dumps(failed) + "\n" + second + third[:40])
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("2 prompts | generated 8 tok")
    assert out.read_text() == whole


def test_a_prompt_that_fails_while_decoding_fails_alone(model_path, model, tmp_path):
    """A line whose grammar llguidance compiles but fails on at its first token (an
    object of 600 optional properties: "Current row has ... items; max is 2000"):
    its result is an error naming the line, the other prompts get their lone texts,
    and one line says how many failed, exit 1."""
    properties = {f"p{i}": {"type": "string"} for i in range(600)}
    lines = [
        {"prompt": "a b c"},
        {"prompt": "x", "json_schema": {"type": "object", "properties": properties}},
        {"prompt": "def f(x):"},
    ]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    result = run(*args, "-m", "8", "-k", "2", "--output", str(out))
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        f"mlx-mtp: error: 1 of 3 prompts failed: their results in {out} hold the "
        "error"
    )
    rows = results(out)
    assert [r["line"] for r in rows] == [1, 2, 3]
    failed = rows[1]
    assert set(failed) == {"id", "line", "prompt", "finish_reason", "error"}
    assert failed["finish_reason"] == "error"
    assert failed["error"].startswith(f"{prompts} line 2: ")
    assert "Current row has" in failed["error"] and "\n" not in failed["error"]
    tokenizer = model[1]
    for row in (rows[0], rows[2]):
        ids = build_prompt(tokenizer, row["prompt"], None, False, escapes=False)
        assert row["text"] == lone(model, ids, max_tokens=8, num_draft_tokens=2)

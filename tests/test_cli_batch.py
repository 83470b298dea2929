"""``mlx-mtp generate --prompts-file``: every prompt of a file, decoded in batches,
each result the text `mlx_mtp.generate` gives for that prompt alone."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlx_mtp.cli import build_prompt, main, render_chat
from mlx_mtp.generate import generate

FAMILY = "qwen3_5"


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


def test_output_is_written_whole_or_not_at_all(model_path, tmp_path, monkeypatch):
    """Ctrl-C while the results are written: one line, exit 130, the old file as it
    was and no temporary file left; a full run then replaces it."""
    prompts, out = tmp_path / "p.txt", tmp_path / "out.jsonl"
    prompts.write_text("hello\nworld\n")
    out.write_text("old\n")
    args = ("generate", "--model", model_path, "--prompts-file", str(prompts))
    args += ("-m", "4", "-k", "2", "--output", str(out))

    replace = os.replace

    def interrupted(src, dst):
        if str(dst) != str(out):  # another file (measured costs, ...)
            return replace(src, dst)
        assert [r["id"] for r in results(Path(src))] == [0, 1]  # written in full
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(os, "replace", interrupted)
        result = run(*args)
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == "interrupted" and "Traceback" not in result.output
    assert out.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "p.txt"]
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert [r["id"] for r in results(out)] == [0, 1]


def test_ctrl_c_mid_generation_leaves_no_file(model_path, tmp_path, monkeypatch):
    """Ctrl-C while the prompts decode (the progress line up): the progress line,
    then one line, exit 130; no output file."""
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
    assert stop == "interrupted" and "Traceback" not in result.output
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

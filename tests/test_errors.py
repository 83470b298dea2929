"""Bad input gets one clear line and a non-zero exit, never a traceback."""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_mtp import MTPError, generate, load, stream_generate
from mlx_mtp.cli import main
from mlx_mtp.errors import MissingHeadsError, UnsupportedModelError
from mlx_mtp.testing.fixtures import FAMILIES


@pytest.fixture
def broken(checkpoint, tmp_path):
    """``broken(family, edit_weights=None, edit_config=None) -> path``: a damaged
    copy."""

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


def test_context_overflow(loaded, monkeypatch):
    model, tokenizer = loaded("mimo")
    limit = 256  # the fixture's 4096 would cost seconds of prefill
    monkeypatch.setattr(model.args, "max_position_embeddings", limit)
    with pytest.raises(MTPError, match=f"context is {limit}"):
        generate(model, tokenizer, [5] * limit, max_tokens=4)
    responses = list(
        stream_generate(
            model, tokenizer, [5] * (limit - 3), max_tokens=-1, num_draft_tokens=2
        )
    )
    assert len(responses) <= 3


# --- issue 10: bad input gets one line (items 6-9, 11-16) -----------------------------

MLX_MTP = [sys.executable, "-m", "mlx_mtp"]


def cli_process(args, input=None, timeout=120):
    """``python -m mlx_mtp ARGS`` as a user runs it (bytes in, text out)."""
    proc = subprocess.run(
        MLX_MTP + args, input=input, capture_output=True, timeout=timeout
    )
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(
        errors="replace"
    )
    assert "Traceback" not in err, err
    return proc.returncode, out, err


def test_prompt_that_is_not_utf8(checkpoint):
    path = str(checkpoint("mimo"))
    args = ["generate", "--model", path, "-m", "2"]
    code, _, err = cli_process([*args, "-p", b"hello \xff world"])
    assert code == 1 and err.strip() == (
        "mlx-mtp: error: the prompt is not valid UTF-8 (byte 0xff at character 6)"
    )
    code, _, err = cli_process(args, input=b"hello \xff world")
    assert code == 1 and "stdin is not valid UTF-8 (byte 0xff" in err
    code, out, err = cli_process(
        ["chat", "--model", path, "-m", "2", "--quiet"], input=b"hi \xff\nhello\n"
    )
    assert code == 0, err  # the bad line is reported; the chat goes on
    assert "that line is not valid UTF-8 (byte 0xff at character 3); ignored" in err
    assert out.count(">> ") == 3 and len(out.strip().splitlines()) == 2  # one reply


@pytest.mark.parametrize(
    "header",
    [[1, 2, 3], {"w": {"dtype": "F32", "shape": [1]}}, {"w": 1}],
    ids=["list", "no-offsets", "number"],
)
def test_safetensors_header_of_the_wrong_shape(header, checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("deepseek_v3"), src)
    raw = json.dumps(header).encode()
    (src / "model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + bytes(16)
    )
    conversion = convert_to(checkpoint("deepseek_v3"), tmp_path / "conv")
    for args in (
        ["convert", "--hf-path", src, "--mlx-path", tmp_path / "out"],
        ["graft", "--from", src, "--mlx-path", conversion, "--overwrite"],
        ["generate", "--model", src, "-p", "hi"],
    ):
        assert_one_line_error(run_cli(*map(str, args)), "model.safetensors")
    assert not (tmp_path / "out").exists()


def convert_to(src, out):
    from mlx_mtp.convert import convert

    return convert(str(src), out, progress=False)


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda c: [1, 2], "not a JSON object"),
        (lambda c: {**c, "num_hidden_layers": "three"}, "num_hidden_layers"),
        (lambda c: {**c, "rope_scaling": "yes"}, "wrong type"),
    ],
    ids=["list", "string-layers", "string-rope-scaling"],
)
def test_config_of_the_wrong_shape(edit, needle, checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint("deepseek_v3"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(edit(config)))
    for args in (
        ["convert", "--hf-path", src, "--mlx-path", tmp_path / "out"],
        ["generate", "--model", src, "-p", "hi"],
    ):
        assert_one_line_error(run_cli(*map(str, args)), needle)


def _set_template(folder, template):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "template,needle",
    [
        ("{% for m in messages %}{{ m.content }", "unexpected '}'"),
        (
            "{% if messages[0]['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "System role not supported",
        ),
    ],
    ids=["syntax", "raises"],
)
def test_chat_template_that_fails(template, needle, checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint("mimo"), tmp_path / "m")
    _set_template(folder, template)
    system = ["--system-prompt", "Be brief."]
    for command, extra in (("generate", ["-p", "hi"]), ("chat", [])):
        result = run_cli(command, "--model", str(folder), *extra, *system, input="hi\n")
        assert_one_line_error(result, "chat template failed", needle)


def test_ctrl_c_while_starting():
    """Ctrl-C at any moment after mlx-mtp's first line runs: exit 130 and the one line
    "interrupted", never a traceback, never death by the signal (rc -2, no word).

    The decision, for users: mlx-mtp answers every SIGINT it can receive. Its entry
    point installs its handler before importing anything heavy, and on a Linux CPU,
    where ``generate`` re-execs itself on OpenBLAS, SIGINT is held (blocked, pending)
    across the exec until the new process's handler is in place: an exec resets the
    handler, and a Ctrl-C in the new interpreter's start-up once ended the process
    silently (the failure on a fresh machine). Nor may a signal that lands in code
    that cannot raise (the import system's weakref callbacks) be dropped with an
    "Exception ignored" traceback. Only the interpreter's own start-up, before any
    mlx-mtp code (site imports, 20-80 ms), is out of reach of any program: a signal
    there ends it as it ends every Python program; no marker can precede it, so it
    is not tested.

    Deterministic: each signal is sent after a marker, not after a guess. The entry
    point's handler is in place once ``-X importtime`` reports ``mlx_mtp._entry``
    imported; the signal then comes at several delays (imports of click, MLX,
    transformers, the re-exec). The exec's window (Linux): the moment the new
    interpreter's environment says ``MLX_MTP_FAST_BLAS=1``, before it runs a line."""
    command = [sys.executable, "-X", "importtime", "-m", "mlx_mtp", "generate"]
    command += ["--model", "/nonexistent", "-p", "hi"]
    held = ("MLX_MTP_FAST_BLAS", "MLX_MTP_SIGINT_HELD")  # a fresh start: may re-exec
    env = {k: v for k, v in os.environ.items() if k not in held}

    def start():
        return subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )

    def outcome(proc, *head):
        """(rc, stderr without the import-time lines)."""
        err = b"".join(head) + proc.stderr.read()
        proc.wait(timeout=60)
        lines = err.decode(errors="replace").splitlines()
        return proc.returncode, "\n".join(
            x for x in lines if not x.startswith("import time:")
        )

    def assert_clean(rc, err, when):
        assert "Traceback" not in err, (when, err)
        if rc == 1 and "does not exist" in err:
            return False  # it had finished before the signal: nothing to interrupt
        assert rc == 130 and err.strip() == "interrupted", (when, rc, err)
        return True

    interrupted = 0
    for delay in (0.0, 0.1, 0.3):
        proc = start()
        head = []
        while not head or b"| mlx_mtp._entry" not in head[-1]:
            head.append(proc.stderr.readline())
            assert head[-1], b"".join(head)  # the marker comes before any end
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        interrupted += assert_clean(*outcome(proc, *head), delay)
    assert interrupted  # the imports take longer than the first delay

    if sys.platform != "linux":
        return
    proc, sent = start(), False
    environ = f"/proc/{proc.pid}/environ"
    while not sent and proc.poll() is None:  # the re-exec's interpreter, at its start
        try:
            with open(environ, "rb") as f:
                sent = b"MLX_MTP_FAST_BLAS=1\0" in f.read()
        except OSError:
            pass
        if sent:
            proc.send_signal(signal.SIGINT)
        time.sleep(0.001)
    assert_clean(*outcome(proc), "at the exec" if sent else "no re-exec here")


def test_check_takes_a_source_and_survives_a_moved_one(checkpoint, tmp_path):
    src = shutil.copytree(checkpoint("mimo", predictable=True), tmp_path / "src")
    out = convert_to(src, tmp_path / "out")
    for old_spelling in (False, True):
        args = ["convert", "--check"] if old_spelling else ["check"]
        result = run_cli(*args, str(out), "--hf-path", str(src))
        assert result.exit_code == 0, result.output
        assert f"agreement with {src}" in result.output and "ok" in result.output
        assert ("now `mlx-mtp check" in result.output) == old_spelling
    both = run_cli("convert", "--check", str(out), "--graft-heads-from", str(src))
    assert both.exit_code == 2
    src.rename(tmp_path / "moved")
    result = run_cli("check", str(out))
    assert result.exit_code == 0, result.output
    assert "is not there any more" in result.output
    assert "acceptance proxy" in result.output  # what needs no source is reported


def test_allow_missing_heads_without_the_heads_file(checkpoint, tmp_path):
    out = convert_to(checkpoint("deepseek_v3"), tmp_path / "out")
    (out / "mtp.safetensors").unlink()
    args = ["generate", "--model", str(out), "-p", "hi", "-m", "4"]
    assert_one_line_error(run_cli(*args), "--allow-missing-heads")
    ok = run_cli(*args, "--allow-missing-heads")
    assert ok.exit_code == 0, ok.output
    model, tokenizer = load(str(out), allow_missing_heads=True)
    assert model.num_mtp_layers == 0


def test_flags_out_of_range(checkpoint):
    path = str(checkpoint("mimo", predictable=True))
    args = ("generate", "--model", path, "-p", "hi", "-m", "8")
    for bad in (["-k", "100"], ["-k", "17"], ["--max-draft-tokens", "17"]):
        assert run_cli(*args, *bad).exit_code == 2
    assert run_cli(*args, "-k", "16").exit_code == 0
    result = run_cli(*args, "-k", "2", "--kv-bits", "3", "--quantized-kv-start", "0")
    assert_one_line_error(result, "--kv-group-size 64 does not divide", "--kv-bits")
    assert "prompt" not in result.output  # refused before any token
    chat = run_cli("chat", "--model", path, "-m", "0", input="hi\n")
    assert chat.exit_code == 2 and ">>" not in chat.output  # refused at start


def test_unknown_chat_command(checkpoint):
    path = str(checkpoint("mimo", predictable=True))
    result = run_cli(
        "chat", "--model", path, "-m", "3", "--quiet", input="/rest\n/help\n/exit\n"
    )
    assert result.exit_code == 0, result.output
    assert "unknown command /rest" in result.output
    assert result.output.count("/reset   start over") == 2
    # the banner, the unknown command, two lists of three commands: no reply
    assert result.output.count("\n") == 1 + 1 + 2 * 3


def test_messages_are_whole_on_one_line(checkpoint, tmp_path):
    extra = tmp_path / "extra"
    shutil.copytree(checkpoint("deepseek_v3"), extra)
    weights = mx.load(str(extra / "model.safetensors"))
    weights["model.layers.0.extra.weight"] = mx.zeros((2,))
    mx.save_safetensors(str(extra / "model.safetensors"), weights)
    result = run_cli("generate", "--model", str(extra), "-p", "hi")
    assert_one_line_error(result, "not in model: model.layers.0.extra.weight")
    junk = tmp_path / "model.gguf"
    junk.write_bytes(os.urandom(64))
    for args in (
        ["convert", "--hf-path", junk, "--mlx-path", tmp_path / "out"],
        ["generate", "--model", junk, "-p", "hi"],
    ):
        assert_one_line_error(run_cli(*map(str, args)), "not a GGUF file")


def test_bench_refuses_too_few_tokens_and_unwritable_output(checkpoint, tmp_path):
    path = str(checkpoint("mimo"))
    few = run_cli("bench", "--model", path, "--tokens", "4")
    assert few.exit_code == 2 and "16" in few.output
    start = time.time()
    result = run_cli(
        "bench", "--model", path, "--output", str(tmp_path / "no" / "such" / "r.json")
    )
    assert_one_line_error(result, "cannot write")
    assert time.time() - start < 5  # refused before the run


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_or_misshapen_fusion_projection(family, broken, checkpoint):
    """Every family: the MTP layer's fusion projection missing, or of the wrong
    shape, is one clear error at load."""
    from mlx_mtp.models import get_family

    config = json.loads((checkpoint(family) / "config.json").read_text())
    key = get_family(config).LAYOUT.key(config, 0, "eh_proj")
    path = broken(family, lambda w: w.pop(key))
    with pytest.raises(MissingHeadsError, match="missing layers.0.eh_proj.weight"):
        load(str(path))
    shutil.rmtree(path)
    bad, message = mx.zeros((64, 64)), r"shape \(64, 64\), expected \(64, 128\)"
    halves = get_family(config).LAYOUT.halves
    if halves:  # kept apart (DeepSeek-V4, Qwen3.8-Flash-Next): half the width
        bad = mx.zeros((64, 32))
        message = rf"{re.escape(key)} has shape \(64, 32\) but \S*{halves[1]}.weight's"
    path = broken(family, lambda w: w.update({key: bad}))
    with pytest.raises(MissingHeadsError, match=message):
        load(str(path))


# --- issue 40 item 10: token ids outside the vocabulary ------------------------------

BAD_IDS = """
import json, sys
import mlx.core as mx
import numpy as np
from mlx_mtp import MTPError, batch_generate, generate, load, stream_generate

model, tokenizer = load(sys.argv[1])
V = model.args.vocab_size
m, t = model, tokenizer
calls = {
    "generate": lambda p: generate(m, t, p, max_tokens=2),
    "stream_generate": lambda p: list(stream_generate(m, t, p, max_tokens=2)),
    "batch_generate": lambda p: batch_generate(m, t, [[1, 2], p], max_tokens=2),
}
bad = [[1, 99999], [1, V], [1, -1], [1, 2**40], [1, 2.0], [1, True], mx.array([1.5])]
out = {"V": V}
for name, call in calls.items():
    for ids in bad:
        try:
            call(ids)
            out[f"{name} {ids}"] = "accepted"
        except MTPError as e:
            out[f"{name} {ids}"] = str(e)
    call([np.int64(1), V - 1])  # numpy integers and the last id are token ids
    call(mx.array([1, V - 1]))
print(json.dumps(out))
"""


def test_token_ids_outside_the_vocabulary(checkpoint):
    """Ids past the vocabulary (which crashed the process), equal to its size,
    negative, huge, floats or bools: an `MTPError` naming the id and the vocabulary's
    size, from generate, stream_generate and batch_generate (whose message also
    names the prompt). In a subprocess: a native crash must not end the tests."""
    path = str(checkpoint("deepseek_v3"))
    proc = subprocess.run(
        [sys.executable, "-c", BAD_IDS, path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-300:], proc.stderr)
    out = json.loads(proc.stdout.splitlines()[-1])
    V = out.pop("V")
    tokens = ["99999", str(V), "-1", str(2**40), "2.0", "True", "1.5"]
    assert len(out) == 3 * len(tokens)
    for (case, message), token in zip(out.items(), tokens * 3):
        assert f"token id {token} " in message, (case, message)
        assert f"vocabulary has {V} tokens (ids 0 to {V - 1})" in message
        assert message.startswith("prompt 1: ") == case.startswith("batch_generate")


# --- issue 40 item 20: grammar flags whose file or pattern cannot be read -------------


def test_grammar_flags_that_cannot_be_read(tmp_path):
    """--json-schema FILE nested 100000 deep, not UTF-8, not JSON or not an object,
    and --regex bytes that are not UTF-8 (kept by Python as a lone surrogate): one
    line naming the flag, exit 2, before the model loads (the first two and the last
    were tracebacks)."""
    files = {
        "deep.json": b'{"items":' * 100000 + b"{}" + b"}" * 100000,
        "latin1.json": b'{"type": "string", "description": "caf\xe9"}',
        "cut.json": b'{"type":',
        "list.json": b"[1]",
    }
    messages = {
        "deep.json": "the JSON nests too deeply to read",
        "latin1.json": "not valid UTF-8 (byte 0xe9 at offset 38)",
        "cut.json": "not valid JSON: Expecting value: line 1 column 9",
        "list.json": "a JSON schema must be a JSON object, not list",
    }
    args = ["generate", "--model", str(tmp_path / "never-loaded"), "-p", "hi"]
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        result = run_cli(*args, "--json-schema", str(tmp_path / name))
        assert result.exit_code == 2, (name, result.output)
        where = f"--json-schema {tmp_path / name}: "
        assert_one_line_error(result, where + messages[name])
    result = run_cli(*args, "--regex", "a\udcffb")
    assert result.exit_code == 2
    assert result.output == (
        "mlx-mtp: error: --regex is not valid UTF-8 (byte 0xff at character 1)\n"
    )

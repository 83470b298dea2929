"""Writing folders never loses data: what ``--overwrite`` may replace, overlapping
sources and destinations, concurrent writers, leftovers, a full disk, code in a model
folder (issue 10, items 1-5 and 10)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlx_mtp.convert.graft as graft_module
import mlx_mtp.convert.hf as hf_module
import mlx_mtp.convert.output as output
from mlx_mtp.cli import main
from mlx_mtp.convert import convert, graft_heads
from mlx_mtp.convert.train_heads import TrainConfig, train_heads
from mlx_mtp.errors import DiskFullError, MTPError
from mlx_mtp.heads import HEADS_FILE

TINY = TrainConfig(
    depth=1, seq_len=16, batch_size=2, steps=2, draft_vocab_size=32, eval_every=2
)
ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, input=None):
    result = CliRunner().invoke(main, [str(a) for a in args], input=input)
    assert "Traceback" not in result.output, result.output
    return result


def one_line_error(result, *needles):
    """The command failed with one error line (after any progress bar)."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines and lines[-1].startswith("mlx-mtp: error:"), result.output
    assert sum("error" in line for line in lines) == 1, result.output
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


def tree(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes: what must not change."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def leftovers(folder: Path, name: str) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}."))


@pytest.fixture
def text(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for j in range(4):  # one is held out
        (data / f"{j}.txt").write_text(" ".join(f"word{i % 37}" for i in range(800)))
    return data


# --- 1. what --overwrite may replace ----------------------------------------------


def test_overwrite_never_deletes_a_folder_holding_the_source(checkpoint, tmp_path):
    outer = tmp_path / "outer"
    shutil.copytree(checkpoint("deepseek_v3"), outer / "src")
    before = tree(outer)
    result = run_cli(
        "convert", "--hf-path", outer / "src", "--mlx-path", outer, "--overwrite"
    )
    one_line_error(result, "contains the source")
    assert tree(outer) == before


def test_overwrite_never_deletes_a_users_folder(checkpoint, tmp_path, text):
    user = tmp_path / "userdir"
    (user / "sub").mkdir(parents=True)
    (user / "thesis.txt").write_text("x")
    (user / "sub" / "notes.md").write_text("y")
    before = tree(user)
    src = checkpoint("deepseek_v3")
    result = run_cli("convert", "--hf-path", src, "--mlx-path", user, "--overwrite")
    one_line_error(result, "not replacing", "sub/")
    (user / "sub" / "notes.md").unlink()
    (user / "sub").rmdir()
    before.pop("sub/notes.md")
    result = run_cli("convert", "--hf-path", src, "--mlx-path", user, "--overwrite")
    one_line_error(result, "not replacing", "thesis.txt")
    result = run_cli(
        "train-heads",
        "--model",
        src,
        "--data",
        text,
        "--mlx-path",
        user,
        "--overwrite",
        "--steps",
        "1",
    )
    one_line_error(result, "not replacing", "thesis.txt")
    assert tree(user) == before
    assert not (tmp_path / "userdir.train").exists()


def test_overwrite_refuses_cwd_home_and_root(checkpoint, tmp_path, monkeypatch):
    src = checkpoint("deepseek_v3")
    made = convert(str(src), tmp_path / "home", progress=False)  # a model folder...
    monkeypatch.setenv("HOME", str(made))  # ...that is the home folder
    result = run_cli("convert", "--hf-path", src, "--mlx-path", "~", "--overwrite")
    one_line_error(result, "home folder")
    here = convert(str(src), tmp_path / "here", progress=False)
    monkeypatch.chdir(here)
    result = run_cli("convert", "--hf-path", src, "--mlx-path", ".", "--overwrite")
    one_line_error(result, "working directory")
    monkeypatch.chdir(here.parent)
    result = run_cli("convert", "--hf-path", src, "--mlx-path", "..", "--overwrite")
    one_line_error(result, "working directory")
    with pytest.raises(MTPError, match="to /"):
        output.check_destination(Path("/"), overwrite=True)
    assert (made / "model.safetensors").is_file()
    assert (here / "model.safetensors").is_file()


def test_overwrite_replaces_model_folders_only(checkpoint, tmp_path):
    """A conversion (or an mlx-lm folder) is replaced; a Hugging Face checkpoint, a
    file or a symbolic link is not, and nothing is left beside them."""
    src = checkpoint("deepseek_v3", predictable=True)
    out = convert(str(src), tmp_path / "out", progress=False)
    (out / "README.md").write_text("card")
    (out / ".DS_Store").write_bytes(b"")
    again = convert(str(src), out, progress=False, overwrite=True, head_bits=8)
    assert json.loads((again / "config.json").read_text())["mtp"]["quantization"]
    hf_copy = shutil.copytree(checkpoint("mimo"), tmp_path / "hf")
    with pytest.raises(MTPError, match="not written by mlx-mtp or mlx-lm"):
        convert(str(src), hf_copy, progress=False, overwrite=True)
    (tmp_path / "file").write_text("data")
    (tmp_path / "link").symlink_to(out)
    for name, reason in (("file", "is a file"), ("link", "symbolic link")):
        with pytest.raises(MTPError, match=reason):
            convert(str(src), tmp_path / name, progress=False, overwrite=True)
    assert (tmp_path / "file").read_text() == "data" and (
        tmp_path / "link"
    ).is_symlink()
    assert not leftovers(tmp_path, "file") and not leftovers(tmp_path, "link")


# --- 2. concurrent writers ----------------------------------------------------------


def _slow_conversion(src, dst):
    """A conversion in another process that pauses after writing its first shard."""
    code = (
        "import time, mlx.core as mx, mlx_mtp.convert.output as o\n"
        "save = mx.save_safetensors\n"
        "def slow(*a, **k):\n"
        "    save(*a, **k); time.sleep(60)\n"
        "o.mx.save_safetensors = slow\n"
        "from mlx_mtp.convert import convert\n"
        f"convert({str(src)!r}, {str(dst)!r}, progress=False, shard_gb=1e-4)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.time() + 60
    pattern = f".{dst.name}.*.partial/*.safetensors"
    while time.time() < deadline and not list(dst.parent.glob(pattern)):
        time.sleep(0.2)
    assert list(dst.parent.glob(pattern)), "the conversion never started writing"
    return proc


def test_concurrent_conversions_and_stale_leftovers(checkpoint, tmp_path):
    """A second writer is refused while the first runs; the first, killed, leaves no
    destination, and its leftovers go with the next run."""
    src = checkpoint("qwen3_next", num_shards=2)
    dst = tmp_path / "out"
    proc = _slow_conversion(src, dst)
    try:
        with pytest.raises(MTPError, match=f"another mlx-mtp process .*{proc.pid}"):
            convert(str(src), dst, progress=False)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not dst.exists()
    assert leftovers(tmp_path, "out") == [f".out.{proc.pid}.partial", ".out.lock"]
    convert(str(src), dst, progress=False)  # the dead process's leftovers go
    assert leftovers(tmp_path, "out") == []
    assert (dst / "model.safetensors.index.json").is_file()


def test_final_rename_refuses_a_destination_made_meanwhile(
    checkpoint, tmp_path, monkeypatch
):
    dst = tmp_path / "out"
    save = hf_module.save_trunk

    def racing(folder, *args, **kwargs):
        dst.mkdir()
        (dst / "theirs.txt").write_text("another writer")
        return save(folder, *args, **kwargs)

    monkeypatch.setattr(hf_module, "save_trunk", racing)
    with pytest.raises(MTPError, match="already exists"):
        convert(str(checkpoint("mimo")), dst, progress=False)
    assert tree(dst) == {"theirs.txt": b"another writer"}
    assert leftovers(tmp_path, "out") == []


# --- 3. destinations inside the source ----------------------------------------------


def test_destination_inside_the_source_is_refused(checkpoint, tmp_path):
    src = shutil.copytree(checkpoint("mimo"), tmp_path / "src")
    before = tree(src)
    result = run_cli("convert", "--hf-path", src, "--mlx-path", src / "out")
    one_line_error(result, "inside the source")
    result = run_cli("convert", "--hf-path", src, "--mlx-path", src, "--overwrite")
    one_line_error(result, "is the source")
    with pytest.raises(MTPError, match="overlap"):
        graft_heads(str(src), str(src), overwrite=True)
    assert tree(src) == before


# --- 4. leftovers -------------------------------------------------------------------


def test_stale_partials_of_dead_processes_are_removed(checkpoint, tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    # (a dead process's .old folder is put back instead: tests/test_staging.py)
    stale = [f".out.{dead}.partial", f".out.{dead}.gguf", f".out.{dead}.trash"]
    for name in stale:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".out.lock").write_text(dead)
    mine = tmp_path / f".out.{os.getpid()}.keep"  # a live process's: kept
    mine.mkdir()
    convert(str(checkpoint("mimo")), tmp_path / "out", progress=False)
    assert leftovers(tmp_path, "out") == [mine.name]


def test_train_heads_leaves_nothing_when_the_data_is_too_short(checkpoint, tmp_path):
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("too short")
    result = run_cli(
        "train-heads",
        "--model",
        checkpoint("deepseek_v3"),
        "--data",
        short,
        "--mlx-path",
        tmp_path / "out",
        "--seq-len",
        "64",
    )
    one_line_error(result, "not enough text")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short"]


# --- 5. code in a model folder ------------------------------------------------------


@pytest.fixture
def evil(checkpoint, tmp_path):
    """A converted model whose tokenizer asks to run ``evil_tok.py`` (``auto_map``);
    running it writes ``PWNED`` next to the folder."""
    folder = convert(str(checkpoint("deepseek_v3")), tmp_path / "evil", progress=False)
    marker = tmp_path / "PWNED"
    (folder / "evil_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tok.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, marker


def test_model_folder_code_never_runs_unasked(evil):
    folder, marker = evil
    for command in (["generate", "-p", "hi"], ["chat"]):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_mtp", *command, "--model", str(folder)],
            input="y\nhello\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "--trust-remote-code" in proc.stderr and "[y/N]" not in proc.stdout
        assert not marker.exists()
    result = run_cli(
        "generate", "--model", folder, "-p", "hi", "-m", "2", "--trust-remote-code"
    )
    assert result.exit_code == 0, result.output
    assert marker.exists()  # asked for: it runs


def test_convert_copies_code_only_when_trusted(evil, tmp_path, caplog):
    folder, marker = evil
    plain = convert(str(folder), tmp_path / "plain", progress=False)
    assert not (plain / "evil_tok.py").exists() and "evil_tok.py" in caplog.text
    trusted = convert(str(folder), tmp_path / "trusted", progress=False, copy_code=True)
    assert (trusted / "evil_tok.py").is_file()
    assert not marker.exists()


# --- 10. a full disk ----------------------------------------------------------------


@contextlib.contextmanager
def small_disk(path: Path, size: int):
    """A tmpfs of ``size`` bytes at ``path``; skips where it cannot be mounted."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs Linux and root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _disk_full(*args, **kwargs):
    raise RuntimeError("[write] Unable to write 8 bytes to file.")  # MLX's message


def test_full_disk_in_convert_and_graft(checkpoint, tmp_path, monkeypatch):
    src = checkpoint("deepseek_v3")
    with small_disk(tmp_path / "fs", 256 << 10) as fs:
        result = run_cli("convert", "--hf-path", src, "--mlx-path", fs / "out")
        one_line_error(result, "no space left on", "nothing was written")
        assert list(fs.iterdir()) == []
    out = convert(str(src), tmp_path / "out", progress=False)
    before = tree(out)
    monkeypatch.setattr(graft_module, "save_heads", _disk_full)
    with pytest.raises(DiskFullError, match="no space left on"):
        graft_heads(str(src), str(out), overwrite=True)
    assert tree(out) == before  # heads and config untouched, no scratch files


def test_full_disk_in_train_heads_keeps_a_resumable_folder(
    checkpoint, tmp_path, text, monkeypatch
):
    src, out = checkpoint("mimo"), tmp_path / "out"
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(output.shutil, "disk_usage", lambda p: free._replace(free=1000))
    with pytest.raises(DiskFullError, match="rerun with --resume"):
        train_heads(str(src), [str(text)], str(out), TINY, progress=False)
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / "out.train").is_dir()
    train_heads(str(src), [str(text)], str(out), TINY, progress=False, resume=True)
    assert (out / HEADS_FILE).is_file()


def test_full_disk_in_train_heads_features_is_an_error_not_a_crash(
    checkpoint, tmp_path, text
):
    """Memory-mapped features on a full disk used to die of SIGBUS (run apart: a
    SIGBUS would end the test session)."""
    with small_disk(tmp_path / "fs", 160 << 10) as fs:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_mtp",
                "train-heads",
                "--model",
                str(checkpoint("mimo")),
                "--data",
                str(text),
                "--mlx-path",
                str(fs / "out"),
                "--seq-len",
                "16",
                "--steps",
                "2",
                "--draft-vocab-size",
                "32",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert (
            last.startswith("mlx-mtp: error: no space left on") and "--resume" in last
        )
        assert not (fs / "out").exists()

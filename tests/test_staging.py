"""How conversions write their output: every replacement is all-or-nothing.

Fault injection at every step of `staged_folder` (a folder replaced by another) and of
`replace_files` (``graft --overwrite``: several files of a folder): each call of
`mlx_mtp.convert.output` that changes the filesystem (and each file it has written)
is a step, and at step ``n`` the test either raises ``KeyboardInterrupt`` (Ctrl-C: the
``finally`` blocks run) or, in a forked child, ends the process on the spot as SIGKILL
would (``os._exit``: nothing more runs). Either way the destination then holds the
complete old or the complete new version, and nothing else is left once the next run
has settled what the dead one left. Also: SIGTERM and SIGHUP stop ``convert`` and
``graft`` cleanly, and ``graft`` refuses heads that are neither floating point nor
MLX-quantized.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlx_mtp.convert.output as output
from mlx_mtp.cli import main
from mlx_mtp.convert import convert, graft_heads
from mlx_mtp.errors import MTPError
from mlx_mtp.testing.fixtures import write_checkpoint

from .test_convert import strip_heads

OS_CALLS = ("open", "mkdir", "rename", "replace", "unlink", "remove", "rmdir", "link")
SHUTIL_CALLS = ("rmtree", "copy", "copy2", "copyfile", "copytree", "move")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class Steps:
    """Counts steps; at step ``at`` raises ``KeyboardInterrupt`` or, with ``kill``,
    ends the process on the spot."""

    def __init__(self, at=None, kill=False):
        self.n, self.at, self.kill = 0, at, kill

    def __call__(self, what):
        self.n += 1
        if self.n == self.at:
            if self.kill:
                os._exit(9)
            raise KeyboardInterrupt(f"step {self.n}: {what}")


class Counted:
    """``module``, whose functions ``names`` first take a step."""

    def __init__(self, module, names, steps):
        self._module, self._names, self._steps = module, names, steps

    def __getattr__(self, name):
        value = getattr(self._module, name)
        if name not in self._names:
            return value

        def counted(*args, **kwargs):
            self._steps(f"{self._module.__name__}.{name}")
            return value(*args, **kwargs)

        return counted


@contextlib.contextmanager
def faults(steps):
    """Route `output`'s ``os`` and ``shutil`` calls, and each file write of
    `replace_files`, through ``steps``."""
    real_writing = output.writing

    @contextlib.contextmanager
    def writing(*args, **kwargs):
        with real_writing(*args, **kwargs):
            yield
        steps("wrote a file")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(output, "os", Counted(os, OS_CALLS, steps))
        patch.setattr(output, "shutil", Counted(shutil, SHUTIL_CALLS, steps))
        patch.setattr(output, "writing", writing)
        yield steps


def in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit code (9: killed at a step)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def killed_at(at, run):
    """``run`` until step ``at``, which ends the process."""
    with faults(Steps(at, kill=True)) as steps:
        run(steps)


def every_step(run, check, kill=True):
    """Make ``run(steps)`` fail at each of its steps in turn, by ``KeyboardInterrupt``
    and (``kill``) by death in a forked child, with ``check(at, killed)`` after each,
    until a run takes no step that fails. Returns how many steps a run takes."""
    total = Steps()
    with faults(total):
        run(total)
    for at in range(1, total.n + 1):
        with pytest.raises(KeyboardInterrupt):
            with faults(Steps(at)) as steps:
                run(steps)
        check(at, False)
        if kill:
            assert in_child(lambda: killed_at(at, run)) == 9, f"step {at}"
            check(at, True)
    return total.n


def snapshot(folder):
    """Every file of ``folder``, hidden ones included (None: no folder)."""
    if not folder.exists():
        return None
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def settle(dst):
    """What the next run does first: take the lock, settle what dead runs left."""
    with output.locked(dst):
        output.remove_stale(dst)


def dead_pid() -> int:
    """A PID no process has (that of a child reaped just now)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


# --- staged_folder ------------------------------------------------------------------


def model_folder(path, version):
    """A folder `check_destination` lets ``overwrite`` replace."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"mtp": {}, "version": version}))
    (path / "model.safetensors").write_bytes(version.encode() * 1000)
    (path / f"{version}.json").write_text("{}")
    return path


@pytest.mark.parametrize("existing", [True, False])
def test_staged_folder_is_all_or_nothing_at_every_step(tmp_path, existing):
    dst = tmp_path / "out"
    old = snapshot(model_folder(dst, "old")) if existing else None
    new = snapshot(model_folder(tmp_path / "new", "new"))
    shutil.rmtree(tmp_path / "new")

    def run(steps):
        with output.staged_folder(dst, overwrite=True) as tmp:
            for name, data in new.items():
                (tmp / name).write_bytes(data)
                steps("wrote a file")

    def check(at, killed):
        where = f"step {at}, {'killed' if killed else 'interrupted'}"
        if killed:
            settle(dst)
        state = snapshot(dst)
        assert state in (old, new), f"{where}: {sorted(state or [])}"
        if killed:
            assert os.listdir(tmp_path) == (["out"] if state else []), where
        else:  # the next run in this process (a Ctrl-C may hit its cleanup)
            run(Steps())
            assert snapshot(dst) == new and os.listdir(tmp_path) == ["out"], where
        shutil.rmtree(dst, ignore_errors=True)
        if existing:
            model_folder(dst, "old")

    steps = every_step(run, check)
    assert steps >= (10 if existing else 7)  # lock, 3 writes, renames, deletes...


def test_a_dead_runs_old_folder_is_put_back_not_deleted(tmp_path):
    """The issue's case: killed between the two renames, ``.out.PID.old`` is all that
    is left; the next run puts it back, and so refuses to replace it without
    ``overwrite``."""
    dst = tmp_path / "out"
    old = snapshot(model_folder(dst, "old"))
    os.rename(dst, output.scratch_path(dst, "old", pid=dead_pid()))
    with pytest.raises(MTPError, match="already exists"):
        with output.staged_folder(dst) as tmp:
            (tmp / "config.json").write_text("{}")
    assert snapshot(dst) == old and os.listdir(tmp_path) == ["out"]


# --- replace_files (graft --overwrite) ----------------------------------------------


def test_replace_files_is_all_or_nothing_at_every_step(tmp_path):
    folder = model_folder(tmp_path / "model", "old")
    (folder / "mtp.safetensors").write_bytes(b"old 8-bit heads")
    old = snapshot(folder)
    files = {
        "config.json": b'{"mtp": {"quantization": {"bits": 4}}}',
        "mtp.safetensors": b"new 4-bit heads",
        "draft_vocab.safetensors": b"a file the folder had not",
    }
    new = {**old, **files}

    def run(steps):
        writers = {
            folder / k: (lambda p, d=v: p.write_bytes(d)) for k, v in files.items()
        }
        with output.locked(folder):
            output.replace_files(writers)

    def check(at, killed):
        where = f"step {at}, {'killed' if killed else 'interrupted'}"
        if killed:
            settle(folder)
        state = snapshot(folder)
        assert state in (old, new), f"{where}: {sorted(state)}"
        if not killed:
            run(Steps())
            assert snapshot(folder) == new, where
        assert os.listdir(tmp_path) == ["model"], where
        shutil.rmtree(folder)
        folder.mkdir()
        for name, data in old.items():
            (folder / name).write_bytes(data)

    assert every_step(run, check) >= 9


# --- graft --overwrite itself -------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A qwen3_5 checkpoint, and an MLX conversion of it without its heads."""
    root = tmp_path_factory.mktemp("graft")
    src = write_checkpoint("qwen3_5", root / "src", predictable=True)
    plain = strip_heads(src, root / "plain", "mtp.")
    return src, convert(str(plain), root / "bare", progress=False)


def written(writers, scratch):
    """``writers`` as writers of the bytes they write (run here, in ``scratch``)."""
    scratch.mkdir()
    files = {}
    for path, write in writers.items():
        write(scratch / path.name)
        files[path] = (scratch / path.name).read_bytes()
    shutil.rmtree(scratch)
    return {path: (lambda p, d=data: p.write_bytes(d)) for path, data in files.items()}


def test_graft_overwrite_is_all_or_nothing_at_every_step(sources, tmp_path):
    """8-bit heads replaced by 4-bit ones: whatever stops it, the heads and the config
    that describes them come from one graft. (The writes and renames run in the
    forked child, of bytes written in this process: MLX does not survive a fork.)"""
    src, bare = sources
    dst = tmp_path / "model"
    shutil.copytree(bare, dst)
    graft_heads(str(src), str(dst), head_bits=8, rank_vocab=False)
    original, old = tmp_path / "original", snapshot(dst)
    shutil.copytree(dst, original)

    def graft(steps=None):
        graft_heads(str(src), str(dst), head_bits=4, overwrite=True, rank_vocab=False)

    graft()
    new = snapshot(dst)
    assert json.loads(new["config.json"])["mtp"]["quantization"]["bits"] == 4
    assert new["mtp.safetensors"] != old["mtp.safetensors"]

    def check(at, killed):
        where = f"step {at}, {'killed' if killed else 'interrupted'}"
        if killed:
            settle(dst)
        state = snapshot(dst)
        assert state in (old, new), f"{where}: {sorted(state)}"
        if not killed:
            graft()
            assert snapshot(dst) == new, where
        assert sorted(os.listdir(tmp_path)) == ["model", "original"], where
        shutil.rmtree(dst)
        shutil.copytree(original, dst)

    check(0, False)
    assert every_step(graft, check, kill=False) >= 10
    real, at, codes = output.replace_files, 0, []
    while codes != [0]:  # until a child is not killed: it replaced them all
        at, codes = at + 1, []
        with pytest.MonkeyPatch.context() as patch:

            def forked(writers):
                files = written(writers, tmp_path / "written")
                codes.append(in_child(lambda: killed_at(at, lambda _: real(files))))

            patch.setattr("mlx_mtp.convert.graft.replace_files", forked)
            graft()
        assert codes in ([9], [0]), f"step {at}: {codes}"
        check(at, True)
    assert at >= 8


def test_a_killed_grafts_files_are_finished_before_the_next_graft(sources, tmp_path):
    """Killed after its commit, with the heads renamed into place but not yet the
    config: the next graft first finishes that one (then refuses to graft again
    without --overwrite), instead of taking the folder for one without heads."""
    src, bare = sources
    grafted, dst = tmp_path / "grafted", tmp_path / "model"
    shutil.copytree(bare, grafted)
    graft_heads(str(src), str(grafted), rank_vocab=False)
    shutil.copytree(bare, dst)
    pid = dead_pid()
    shutil.copy(grafted / "mtp.safetensors", dst / "mtp.safetensors")
    shutil.copy(grafted / "config.json", dst / f".config.json.{pid}.partial")
    names = ["mtp.safetensors", "config.json"]
    (dst / f".mlx-mtp.{pid}.journal").write_text(json.dumps(names))
    with pytest.raises(MTPError, match="already has MTP heads"):
        graft_heads(str(src), str(dst), rank_vocab=False)
    assert snapshot(dst) == snapshot(grafted)


def test_a_folder_mid_update_is_refused_until_the_update_is_finished(sources, tmp_path):
    """Loading a folder that a killed graft left halfway (its journal there, the
    heads renamed into place, not yet the config) is one line saying how to finish
    it, never a load of old and new files mixed; once a graft finished it, it loads."""
    from mlx_mtp import load

    src, bare = sources
    dst, pid = tmp_path / "model", dead_pid()
    shutil.copytree(bare, dst)
    graft_heads(str(src), str(dst), rank_vocab=False)
    config = (dst / "config.json").read_bytes()
    shutil.copy(bare / "config.json", dst / "config.json")
    (dst / f".config.json.{pid}.partial").write_bytes(config)
    journal = dst / f".mlx-mtp.{pid}.journal"
    journal.write_text(json.dumps(["mtp.safetensors", "config.json"]))
    with pytest.raises(MTPError, match="halfway through an update.*mlx-mtp graft"):
        load(str(dst))
    with pytest.raises(MTPError, match="already has MTP heads"):
        graft_heads(str(src), str(dst), rank_vocab=False)  # finishes it first
    assert not journal.exists()
    assert load(str(dst))[0].num_mtp_layers > 0


# --- SIGTERM and SIGHUP -------------------------------------------------------------

# The stand-in for a slow write sleeps in short steps, as real work runs bytecode
# between calls: the kernel may deliver the signal to one of MLX's or OpenBLAS's
# threads, and then Python runs the handler only when the main thread next leaves a C
# call, which one long sleep would delay for its whole length.
SLOW = """
import sys, time
import mlx_mtp.convert.{module} as module
real = module.{name}

def slow(*args, **kwargs):
    real(*args, **kwargs)
    print("written", flush=True)
    for _ in range(1200):
        time.sleep(0.1)

module.{name} = slow
from mlx_mtp.cli import run
run(sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["convert", "graft"])
def test_sigterm_and_sighup_stop_a_conversion_cleanly(command, sources, tmp_path):
    """Killed mid-write by SIGTERM (convert) or SIGHUP (graft --overwrite), nothing is
    left but what was there: no scratch folder, partial file or lock; one line, and
    exit 128 + the signal's number."""
    src, bare = sources
    if command == "convert":
        sig, where = signal.SIGTERM, ("hf", "save_trunk")
        args = ["convert", "--hf-path", src, "--mlx-path", tmp_path / "out"]
        before = []
    else:
        sig, where = signal.SIGHUP, ("graft", "save_heads")
        dst = tmp_path / "model"
        shutil.copytree(bare, dst)
        args = ["graft", "--from", src, "--mlx-path", dst, "--no-rank-vocab"]
        before = snapshot(dst)
    script = SLOW.format(module=where[0], name=where[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "written\n", proc.communicate()[1]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"stopped by {sig.name}", err
    if command == "convert":
        assert os.listdir(tmp_path) == []
    else:
        assert os.listdir(tmp_path) == ["model"] and snapshot(dst) == before


# --- what graft accepts as heads ----------------------------------------------------


def with_heads_as(src, dst, prefix, cast):
    """A copy of checkpoint ``src`` whose tensors under ``prefix`` go through
    ``cast``."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        weights = mx.load(str(f))
        weights = {
            k: cast(v) if k.startswith(prefix) else v for k, v in weights.items()
        }
        mx.save_safetensors(str(f), weights, {"format": "pt"})
    return dst


def test_heads_that_are_not_floating_point_are_one_line_errors(sources, tmp_path):
    """int32 heads were grafted as they were (16 bits) or a traceback (8 bits)."""
    src, bare = sources
    ints = with_heads_as(
        src, tmp_path / "ints", "mtp.", lambda v: (v * 1000).astype(mx.int32)
    )
    dst = tmp_path / "model"
    shutil.copytree(bare, dst)
    before = snapshot(dst)
    for bits in ("16", "8"):
        result = CliRunner().invoke(
            main,
            ["graft", "--from", ints, "--mlx-path", dst, "--head-bits", bits]
            + ["--no-rank-vocab"],
        )
        assert result.exit_code == 1, result.output
        assert (
            result.output.strip().splitlines()[-1].startswith("mlx-mtp: error: ")
            and "int32" in result.output
            and "floating point" in result.output
        )
        assert snapshot(dst) == before
    with pytest.raises(MTPError, match="int32.*floating point"):
        convert(str(ints), tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["ints", "model"]


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_heads_quantized_as_mlx_stores_them_are_heads(sources, mode):
    """uint32 weights beside their scales (uint8 in the mx* modes) pass; a uint32
    tensor without scales does not."""
    import mlx.nn as nn

    from mlx_mtp.convert.hf import check_head_dtypes
    from mlx_mtp.loading import load_model

    stack = load_model(str(sources[0]))[0].mtp
    check_head_dtypes(stack, "float")
    nn.quantize(stack, group_size=32, bits=4, mode=mode)
    check_head_dtypes(stack, "quantized")
    layer = stack.layers[0]
    layer.update({"hnorm": {"weight": layer.hnorm.weight.astype(mx.uint32)}})
    with pytest.raises(MTPError, match=r"hnorm\.weight is uint32"):
        check_head_dtypes(stack, "broken")


def test_float16_heads_onto_a_float32_trunk_pass_check(checkpoint, tmp_path):
    """graft casts the heads to the trunk's float dtype (as convert does), and check
    runs the source in it too: a float32 conversion of a float16 MoE checkpoint
    grafts and checks (MLX's CPU runs MoE layers in float32 only)."""
    from mlx_mtp.convert import check

    src = checkpoint("deepseek_v3", predictable=True, dtype="float16")
    plain = strip_heads(src, tmp_path / "plain", "model.layers.3.")
    bare = convert(str(plain), tmp_path / "bare", dtype="float32", progress=False)
    graft_heads(str(src), str(bare), head_bits=16, rank_vocab=False)
    heads = mx.load(str(bare / "mtp.safetensors"))
    assert {v.dtype for v in heads.values()} == {mx.float32}
    report = check(str(bare))
    assert report.source and report.passed, report.lines()

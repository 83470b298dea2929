"""Two ranks on 127.0.0.1 (``mlx.launch --backend ring -n 2``) decode a trunk sharded
with mlx-lm's own mechanisms: their tokens equal each other's and single-process
decoding's, and a rank that fails to load ends both with a clear error."""

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mlx_mtp import load
from mlx_mtp.testing.fixtures import write_checkpoint

from .distributed_worker import prompt_ids, runs

WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")
LAUNCH = pathlib.Path(sys.executable).with_name("mlx.launch")
TIMEOUT = 180


def launch(*args, timeout=TIMEOUT, input=None):
    """Run ``args`` on two ring ranks over loopback (a random base port, so that runs
    do not collide), ``input`` on stdin; returns the completed process."""
    command = [
        str(LAUNCH),
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(random.randrange(20000, 60000, 2)),
        "--python",
        sys.executable,
        *map(str, args),
    ]
    # Its own session, so that a timeout stops the ranks too, not only the launcher.
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE if input is not None else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def single_process(model, tokenizer):
    """What the worker decodes, on this process with the whole model."""
    return runs(model, prompt_ids(tokenizer))


SHARDED = {
    "deepseek_v3": "tensor",
    "deepseek_v4": "tensor",  # heads, output groups and experts split; mHC whole
    "glm4_moe": "tensor",
    "qwen3_5": "tensor",  # Gated-DeltaNet heads split over the ranks
    "qwen3_next": "pipeline",  # mlx-lm pipelines it (no tensor parallelism)
    "qwen3+dspark": "tensor",  # a DSpark drafter whole on each rank
    "deepseek_v41": "tensor",  # its own DSpark drafter whole on each rank
    "qwen3_next+dspark": "pipeline",  # the drafter's taps summed over the ranks
    "qwen3+dflash2": "tensor",  # a DFlash2 drafter whole on each rank
}
DRAFTERS = {"qwen3+dspark", "deepseek_v41", "qwen3_next+dspark", "qwen3+dflash2"}
GREEDY_SAMPLERS = {"qwen3+dspark", "deepseek_v41", "qwen3+dflash2"}  # sample as greedy


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    """``folders(family)``: the predictable checkpoint of a `SHARDED` family; for
    "qwen3+dspark" and "qwen3_next+dspark", a Qwen3 (tensor-parallel) or
    Qwen3-Next (pipelined) target with a DSpark drafter grafted beside it, and
    "qwen3+dflash2" a Qwen3 one with a DFlash2 drafter; V4.1's carries its own."""

    def get(family):
        if family == "deepseek_v41":
            from mlx_mtp.testing.fixtures_v41 import write_deepseek_v41

            root = tmp_path_factory.mktemp("v41-ranks")
            return write_deepseek_v41(root / "m", predictable=True, agree=0.8)
        if "+" not in family:
            return checkpoint(family, predictable=True)
        from mlx_mtp.convert.drafter import graft_drafter
        from mlx_mtp.testing.dspark import (
            write_dflash2,
            write_dspark,
            write_qwen3_target,
        )

        root = tmp_path_factory.mktemp("dspark-ranks")
        if family == "qwen3+dflash2":
            target = write_qwen3_target(root / "target", predictable=True)
            drafter = write_dflash2(root / "drafter", target, predictable=True)
        elif family == "qwen3+dspark":
            target = write_qwen3_target(root / "target", predictable=True)
            drafter = write_dspark(root / "drafter", target, predictable=True)
        else:  # a random drafter: the predictable one is built for a Qwen3 target
            target = write_checkpoint("qwen3_next", root / "target", predictable=True)
            drafter = write_dspark(root / "drafter", target)
        return graft_drafter(str(drafter), str(target))

    return get


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory):
    """Each family of `SHARDED` decoded on two ranks (one launch): ``{family: [rank 0's
    results, rank 1's]}``."""
    out = tmp_path_factory.mktemp("ranks") / "out"
    paths = [folders(family) for family in SHARDED]
    proc = launch(WORKER, out, *paths)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = [json.loads(pathlib.Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    return {family: [ranks[0][i], ranks[1][i]] for i, family in enumerate(SHARDED)}


@pytest.mark.parametrize("family", SHARDED)
def test_two_ranks_decode_as_one_process(family, two_ranks, folders):
    """Greedy k = 0..3 and auto, and sampled runs with a seed: both ranks emit the same
    tokens (every decision is rank 0's), and the same as one process with the whole
    model (the sharded sums round differently, which these fixtures do not feel);
    a DSpark drafter too, whole on each rank, drafting from the taps the sharded
    trunk gives every rank whole, or a pipelined one sums over its ranks (seeded
    sampling with the drafter reads its draft distribution: a tap off by a layer
    changes its tokens)."""
    rank0, rank1 = two_ranks[family]
    assert rank0 == rank1
    assert rank0.pop("sharding") == SHARDED[family] and rank0.pop("ranks") == 2
    assert rank0.pop("drafter") == (family in DRAFTERS)
    model, tokenizer = load(str(folders(family)))
    expected = single_process(model, tokenizer)
    assert rank0 == expected
    assert expected["accepted-3"] > 0  # drafts accepted, and rejected ones rolled back
    tokens = [v for name, v in expected.items() if not name.startswith("accepted")]
    if family not in GREEDY_SAMPLERS:
        assert len(set(map(tuple, tokens))) > 1  # greedy and sampled differ


def test_a_rank_that_fails_to_load_ends_both(checkpoint, tmp_path):
    """Rank 1's copy lacks a weight file: it says so, rank 0 says a rank failed, and
    both exit within seconds (no rank waits forever in a collective)."""
    path = checkpoint("deepseek_v3", predictable=True, num_shards=2)
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "model-00001-of-00002.safetensors").unlink()
    start = time.monotonic()
    proc = launch(WORKER, tmp_path / "out", path, "--rank-1", broken, timeout=60)
    assert time.monotonic() - start < 60
    assert "rank 1: mlx-mtp: error:" in proc.stderr
    assert "lacks model-00001-of-00002.safetensors" in proc.stderr
    assert "rank 0: mlx-mtp: error: 1 other rank(s) of 2 failed" in proc.stderr
    assert not list(tmp_path.glob("out.*"))


def test_cli_generate_under_mlx_launch(checkpoint, loaded):
    """The README's command, on two local ranks: rank 0 prints once, and the text is
    the single-process text."""
    path = checkpoint("glm4_moe", predictable=True)
    mlx_mtp = pathlib.Path(sys.executable).with_name("mlx-mtp")
    args = ["generate", "--model", path, "-p", "def f(x):", "-m", "12", "-k", "2"]
    proc = launch("--", mlx_mtp, *args, "--ignore-chat-template")
    assert proc.returncode == 0, proc.stderr[-2000:]
    single = subprocess.run(
        [str(mlx_mtp), *map(str, args), "--ignore-chat-template"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    assert proc.stdout == single.stdout and proc.stdout.strip()


def test_cli_chat_under_mlx_launch(checkpoint):
    """Chat on two ranks: rank 0 reads the lines (stdin) and prints the replies, the
    same as one process."""
    path = checkpoint("glm4_moe", predictable=True)
    mlx_mtp = pathlib.Path(sys.executable).with_name("mlx-mtp")
    args = [str(mlx_mtp), "chat", "--model", str(path), "-m", "8", "-k", "2", "--quiet"]
    lines = "hello there\nand again\n/exit\n"
    two = launch("--", *args, input=lines)
    one = subprocess.run(
        args, input=lines, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and two.stdout.count(">>") == 3


def test_images_under_mlx_launch(checkpoint, tmp_path):
    """A Qwen3.5 target with its vision tower on two ranks: ``generate --image`` and
    chat's ``/image`` print what one process prints (rank 0 reads and encodes the
    image; every rank takes its media). The file is rank 0's only: rank 1 never
    opens it."""
    from PIL import Image, ImageDraw

    path = checkpoint("qwen3_5", True, vision=True)
    page = tmp_path / "page.png"
    image = Image.new("RGB", (220, 60), "white")
    ImageDraw.Draw(image).text((6, 20), "The quick brown fox 1234", fill="black")
    image.save(page)
    mlx_mtp = pathlib.Path(sys.executable).with_name("mlx-mtp")
    generate = [str(mlx_mtp), "generate", "--model", str(path), "--image", str(page)]
    generate += ["-p", "Transcribe.", "-m", "12", "-k", "2"]
    chat = [str(mlx_mtp), "chat", "--model", str(path), "-m", "8", "-k", "2", "--quiet"]
    lines = f"/image {page}\nTranscribe.\nand again\n/image /no/such.png\n/exit\n"
    for args, given in ((generate, None), (chat, lines)):
        two = launch("--", *args, input=given)
        one = subprocess.run(
            args, input=given, capture_output=True, text=True, timeout=TIMEOUT
        )
        assert two.returncode == 0 and one.returncode == 0, two.stderr[-2000:]
        assert two.stdout == one.stdout and two.stdout.strip()
    assert "cannot read the image /no/such.png" in two.stderr

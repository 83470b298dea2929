"""``mlx-mtp train-heads``: a few steps on a tiny llama, resume, and the output
folder."""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mlx_mtp.cli import main
from mlx_mtp.convert import check
from mlx_mtp.convert.train_heads import TrainConfig, train_heads
from mlx_mtp.loading import load
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_llama

STDLIB = Path(json.__file__).parent.parent  # CPython's own sources: offline text
DATA = [
    str(STDLIB / n) for n in ("textwrap.py", "shlex.py", "fractions.py", "difflib.py")
]
CFG = TrainConfig(
    depth=2,
    seq_len=32,
    batch_size=4,
    steps=12,
    tokens=6000,
    draft_vocab_size=96,
    eval_every=6,
    save_every=4,
    warmup=2,
)

QUICK = TrainConfig(  # a couple of steps: enough to check what decodes exactly
    depth=2,
    seq_len=16,
    batch_size=2,
    steps=2,
    tokens=600,
    draft_vocab_size=32,
    eval_every=2,
    save_every=2,
    warmup=1,
)


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def straight(trunk, tmp_path_factory):
    """The heads of an uninterrupted `CFG` run (its output folder)."""
    out = tmp_path_factory.mktemp("straight") / "out"
    return train_heads(str(trunk), DATA, str(out), CFG, progress=False)


def assert_same_heads(a: Path, b: Path):
    a, b = mx.load(str(a / "mtp.safetensors")), mx.load(str(b / "mtp.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert mx.array_equal(a[k], b[k]).item(), k


def cli(*args):
    """``mlx-mtp ARGS`` in-process: (exit code, output); never an exception."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, (SystemExit, type(None))), result.exception
    return result.exit_code, result.output


def test_loss_goes_down_and_output_loads(trunk, tmp_path):
    seen = []
    out = train_heads(
        str(trunk),
        DATA,
        str(tmp_path / "out"),
        CFG,
        progress=False,
        on_eval=lambda step, agree: seen.append(agree),
    )
    progress = json.loads((tmp_path / "out.train" / "progress.json").read_text())
    history = progress["history"]
    assert [h["step"] for h in history] == [6, 12]
    assert history[-1]["agreement"][0] > history[0]["agreement"][0] > 0
    model, tokenizer = load(str(out))
    assert model.num_mtp_layers == 1 and model.mtp.draft_vocab.shape == (96,)
    ids = tokenizer.encode("def wrap(text, width):")
    outs = list(mtp_generate_step(ids, model, HEADS, num_draft_tokens=2, max_tokens=32))
    plain = list(
        mtp_generate_step(ids, model, HEADS, num_draft_tokens=0, max_tokens=32)
    )
    assert [o.token for o in outs] == [o.token for o in plain]  # exact, whatever heads
    vocab = np.array(model.mtp.draft_vocab)
    logits = np.array(model.draft_logits(model.hidden(mx.array(ids)[None])))[0, -1]
    assert np.isfinite(logits[vocab]).all()
    assert np.isinf(np.delete(logits, vocab)).all()  # drafts come from the shortlist
    full = np.array(model.logits(model.hidden(mx.array(ids)[None])))[0, -1]
    assert np.allclose(logits[vocab], full[vocab], atol=1e-4)  # only its rows computed
    report = check(str(out))
    assert report.num_heads == 1 and report.source is None and report.self_agreement


def test_loss_decreases(trunk, tmp_path):
    losses = []
    cfg = TrainConfig(
        **{**CFG.__dict__, "steps": 16, "eval_every": 1, "held_out": 0.25}
    )
    train_heads(str(trunk), DATA, str(tmp_path / "o"), cfg, progress=False)
    history = json.loads((tmp_path / "o.train" / "progress.json").read_text())[
        "history"
    ]
    losses = [h["loss"] for h in history]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])


@pytest.mark.slow
def test_resume_continues_with_identical_state(trunk, straight, tmp_path):
    class Interrupt(Exception):
        pass

    def stop(step, agree):
        raise Interrupt

    cut = TrainConfig(**{**CFG.__dict__, "eval_every": 8})
    with pytest.raises(Interrupt):  # dies at step 8, after the checkpoint of step 8
        train_heads(
            str(trunk), DATA, str(tmp_path / "b"), cut, progress=False, on_eval=stop
        )
    assert not (tmp_path / "b").exists()
    with pytest.raises(Exception, match="--resume"):
        train_heads(str(trunk), DATA, str(tmp_path / "b"), CFG, progress=False)
    resumed = train_heads(
        str(trunk), DATA, str(tmp_path / "b"), CFG, resume=True, progress=False
    )
    assert_same_heads(straight, resumed)


@pytest.mark.slow
def test_a_crash_while_checkpointing_resumes_from_the_checkpoint(
    trunk, straight, tmp_path
):
    """A checkpoint is one record: the head, the optimizer and the run's step and
    history, in one file renamed into place (issue 40, item 17). Whatever a crash
    leaves of ``progress.json`` (the previous step's, after a kill between the
    writes; torn; a temporary beside it), ``--resume`` goes on from the checkpoint's
    own step, as the uninterrupted run; as it does from a checkpoint an earlier
    mlx-mtp wrote (no record inside, ``progress.json`` one checkpoint behind). A
    damaged checkpoint is one line and exit 1."""
    import shutil

    class Interrupt(Exception):
        pass

    work, earlier = tmp_path / "run.train", {}

    def on_eval(step, agree):
        if step == 8:  # progress.json is step 4's until step 8's checkpoint
            earlier["progress"] = (work / "progress.json").read_bytes()
        if step == 12:  # dies before step 12's checkpoint: the state is step 8's
            raise Interrupt

    cut = TrainConfig(**{**CFG.__dict__, "eval_every": 4})
    with pytest.raises(Interrupt):
        run = str(tmp_path / "run")
        train_heads(str(trunk), DATA, run, cut, progress=False, on_eval=on_eval)
    assert json.loads(earlier["progress"])["step"] == 4

    def crashed(name, edit):
        folder = shutil.copytree(work, tmp_path / f"{name}.train")
        edit(folder)
        return folder

    state = mx.load(str(work / "state.safetensors"))

    def between(f):  # killed after the checkpoint, before progress.json
        (f / "progress.json").write_bytes(earlier["progress"])
        (f / ".state.safetensors").write_bytes(b"\0" * 100)  # and a torn temporary

    def torn(f):
        (f / "progress.json").write_text('{"step": 8, "hist')

    def by_an_earlier_mlx_mtp(f):  # no record in the checkpoint, killed between
        between(f)
        mx.save_safetensors(str(f / "state.safetensors"), state)

    folders = [crashed(e.__name__, e) for e in (between, torn, by_an_earlier_mlx_mtp)]
    for folder in folders:
        out = tmp_path / folder.name.replace(".train", "")
        resumed = train_heads(
            str(trunk), DATA, str(out), CFG, resume=True, progress=False
        )
        assert_same_heads(straight, resumed)

    damaged = crashed("damaged", lambda f: os.truncate(f / "state.safetensors", 4000))
    code, output = cli(
        "train-heads",
        "--model",
        trunk,
        "--data",
        DATA[0],
        "--resume",
        "--mlx-path",
        tmp_path / "damaged",
        "--work-dir",
        damaged,
    )
    assert code == 1 and output.count("\n") == 2, output  # the BLAS line, the error
    assert output.splitlines()[-1].startswith(
        f"mlx-mtp: error: cannot resume the run in {damaged}: "
        f"{damaged / 'state.safetensors'} is not a valid safetensors file"
    )
    state = damaged / "state.safetensors"
    assert f"remove {state} and resume to train again from step 0" in output


def test_cli(trunk, tmp_path):
    args = [
        "train-heads",
        "--model",
        str(trunk),
        "--mlx-path",
        str(tmp_path / "cli"),
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--tokens",
        "2000",
        "--draft-vocab-size",
        "64",
    ]
    result = CliRunner().invoke(
        main, args + [a for d in DATA[:2] for a in ("--data", d)]
    )
    assert result.exit_code == 0, result.output
    heads = mx.load(str(tmp_path / "cli" / "mtp.safetensors"))
    assert heads["draft_vocab"].shape == (64,)  # the heads draft from 64 tokens
    other = [a if a != str(tmp_path / "cli") else str(tmp_path / "other") for a in args]
    missing = CliRunner().invoke(main, other + ["--data", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no such data" in missing.output
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.train").exists()


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_draft_rows_of_quantized_heads(kind):
    """A draft vocabulary's rows of a quantized head give the head's own logits."""
    import mlx.nn as nn

    from mlx_mtp.models.base import RowsHead

    if kind == "linear":
        head = nn.QuantizedLinear(64, 300, bits=4, group_size=32)
        full_fn = head
    else:
        head = nn.QuantizedEmbedding(300, 64, bits=8, group_size=64)
        full_fn = head.as_linear
    h, rows = mx.random.normal((2, 3, 64)), mx.array([3, 7, 100, 299])
    assert mx.allclose(RowsHead(head, rows)(h), full_fn(h)[..., rows]).item()


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_trains_heads_for_other_families(family, checkpoint, tmp_path):
    """DeepSeek's MLA attention takes its causal mask as an array: training builds
    the mask as the runtime does (it used to fail after computing the features)."""
    out = train_heads(
        str(checkpoint(family)), DATA[:2], str(tmp_path / "out"), QUICK, progress=False
    )
    model, _ = load(str(out))
    prompt = [5, 77, 301, 12, 9]
    plain, drafted = (
        [
            o.token
            for o in mtp_generate_step(
                prompt, model, HEADS, num_draft_tokens=k, max_tokens=24
            )
        ]
        for k in (0, 2)
    )
    assert drafted == plain


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_training_computes_the_runtimes_chained_drafts(family, trunk, checkpoint):
    """Each depth of the training loss is the runtime's computation: depth j's row i
    equals the MTP layer run as the loop runs it (depth-1 rows 0..i into its cache,
    then chained on its own output at the next position, reading that cache), for
    every row i and depths 1..3."""
    from mlx_mtp.cache import make_caches
    from mlx_mtp.convert.train_heads import chained_outputs, init_head

    path = trunk if family == "llama" else checkpoint(family)
    model, _ = load(str(path), allow_missing_heads=True)
    mx.random.seed(0)
    model.mtp = init_head(model, model.family, np.arange(16, dtype=np.int32))
    depth, L = 3, 10
    x = mx.random.randint(0, model.args.vocab_size, (1, L))
    h = model.hidden(x)  # (1, L, H)
    rows = L - depth
    trained = chained_outputs(model.mtp, model, h, x, depth)
    for i in range(rows):
        mtp_cache = make_caches(model).mtp[0]
        out = model.mtp_forward(0, h[:, : i + 1], x[:, 1 : i + 2], mtp_cache)[:, -1:]
        for j in range(1, depth + 1):
            if j > 1:
                out = model.mtp_forward(0, out, x[:, i + j : i + j + 1], mtp_cache)
            want = trained[j - 1][:, i : i + 1]
            assert mx.allclose(out, want, atol=1e-4).item(), (family, i, j)


@pytest.mark.slow
def test_training_goes_on_from_heads_trained_earlier(trunk, tmp_path):
    """``init_heads``: a run starts from the heads an earlier one wrote (quantized or
    not), with their draft vocabulary, where that run stopped."""
    import shutil

    from mlx_mtp.convert.train_heads import warm_start
    from mlx_mtp.errors import MTPError
    from mlx_mtp.heads import HEADS_FILE, heads_section, quantize_heads, save_heads

    first = train_heads(str(trunk), DATA, str(tmp_path / "a"), CFG, progress=False)
    model, _ = load(str(trunk), allow_missing_heads=True)
    trained, _ = load(str(first))
    stack = warm_start(model, model.family, str(first))
    want = dict(tree_flatten(trained.mtp.parameters()))
    got = dict(tree_flatten(stack.parameters()))
    assert set(got) == set(want)
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)

    quantized = tmp_path / "q"  # the heads at 8 bits, as the demo heads ship
    shutil.copytree(first, quantized)
    q_stack = trained.mtp
    bits = quantize_heads(q_stack, 8)
    save_heads(quantized / HEADS_FILE, q_stack)
    config = json.loads((quantized / "config.json").read_text())
    config["mtp"] = heads_section(q_stack, bits, config["mtp"]["provenance"])
    (quantized / "config.json").write_text(json.dumps(config))
    thawed = dict(
        tree_flatten(warm_start(model, model.family, str(quantized)).parameters())
    )
    assert set(thawed) == set(want)
    for k in want:  # dequantized: within a quantization step of the float weights
        step = float(mx.abs(want[k]).max().item()) / 64 + 1e-6
        assert mx.allclose(thawed[k], want[k], atol=step).item(), k

    # the second run starts where the first stopped: same draft rows, same scores
    history = json.loads((tmp_path / "a.train" / "progress.json").read_text())
    again = TrainConfig(
        **{
            **CFG.__dict__,
            "init_heads": str(first),
            "lr": 1e-12,
            "steps": 1,
            "eval_every": 1,
            "draft_vocab_size": 50,
        }
    )
    out = train_heads(str(trunk), DATA, str(tmp_path / "b"), again, progress=False)
    second = json.loads((tmp_path / "b.train" / "progress.json").read_text())
    assert second["history"][0]["agreement"] == history["history"][-1]["agreement"]
    assert mx.array_equal(load(str(out))[0].mtp.draft_vocab, trained.mtp.draft_vocab)
    assert json.loads((out / "config.json").read_text())["mtp"]["provenance"][
        "training"
    ]["config"]["init_heads"] == str(first)
    lineage = json.loads((out / "config.json").read_text())["mtp"]["provenance"]
    assert lineage["training"]["started_from"]["history"] == history["history"][-1:]

    with pytest.raises(MTPError, match="no MTP heads"):
        warm_start(model, model.family, str(trunk))
    bad = TrainConfig(**{**CFG.__dict__, "init_heads": str(trunk)})
    with pytest.raises(MTPError, match="no MTP heads"):  # before any work is done
        train_heads(str(trunk), DATA, str(tmp_path / "c"), bad, progress=False)
    assert not (tmp_path / "c.train").exists()


def test_resume_refuses_other_options_in_one_line(trunk, tmp_path):
    """``--resume`` continues the run in the work folder with its own options (issue
    40, item 19): others are refused in one line naming them, before the model
    loads; fewer ``--steps`` than trained are refused; more train on."""
    work = tmp_path / "work"
    run = ["train-heads", "--model", trunk, "--work-dir", work, "--seq-len", "16"]
    run += ["--tokens", "600", "--batch-size", "2", "--draft-vocab-size", "32"]
    run += ["--save-every", "2", "--data", DATA[0], "--data", DATA[1]]
    code, output = cli(*run, "--steps", "4", "--mlx-path", tmp_path / "a")
    assert code == 0, output
    resume = [*run, "--resume", "--mlx-path", tmp_path / "b"]
    for extra, said in [
        (
            ["--depth", "3", "--seq-len", "32", "--lr", "0.01"],
            "it was started with --depth 2 --seq-len 16 --lr 0.001, not --depth 3 "
            "--seq-len 32 --lr 0.01 (give its options again, or remove",
        ),
        (
            ["--draft-vocab-size", "64"],
            "--draft-vocab-size 32, not --draft-vocab-size 64",
        ),
        (["--data", DATA[2]], f"{Path(DATA[1]).resolve()}, not --data "),
        (["--steps", "2"], "has trained 4 steps, more than --steps 2: give --steps 4"),
    ]:
        code, output = cli(*resume, *extra)
        assert code == 1 and output.count("mlx-mtp: error:") == 1, output
        assert said in output, output
        assert "Traceback" not in output and not (tmp_path / "b").exists()
    other = write_llama(tmp_path / "other", seed=1)  # same shapes, other weights
    code, output = cli(*resume, "--steps", "4", "--model", other)
    assert code == 1 and f"--model {trunk}, not --model {other}" in output, output

    code, output = cli(*resume, "--steps", "6", "--eval-every", "3")
    assert code == 0, output
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["mtp"]["provenance"]["training"]["config"]["steps"] == 6
    assert json.loads((work / "progress.json").read_text())["step"] == 6


def test_init_heads_of_another_trunk_are_refused(trunk, tmp_path):
    """``--init-heads`` takes heads trained for this trunk (issue 40, item 19): heads of
    another trunk of the same shapes are refused in one line, by the trunk's
    fingerprint the heads record (or, for heads written before it was recorded, that
    of the trunk files beside them), unless ``--any-trunk`` (a fine-tune's heads
    from its base's)."""
    heads = train_heads(
        str(trunk), DATA, str(tmp_path / "heads"), QUICK, progress=False
    )
    config = json.loads((heads / "config.json").read_text())
    assert config["mtp"]["provenance"]["trunk_fingerprint"]
    other = write_llama(tmp_path / "other", seed=1)  # same shapes, other weights
    run = ["train-heads", "--model", other, "--data", DATA[0], "--data", DATA[1]]
    run += ["--steps", "1"]
    run += ["--seq-len", "16", "--tokens", "600", "--batch-size", "2"]
    code, output = cli(*run, "--init-heads", heads, "--mlx-path", tmp_path / "a")
    assert code == 1 and output.count("mlx-mtp: error:") == 1, output
    assert (
        f"--init-heads {heads}: these heads were trained for another trunk " in output
    )
    assert f"({trunk}), not {other}" in output and "--any-trunk" in output
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.train").exists()

    del config["mtp"]["provenance"]["trunk_fingerprint"]  # as train-heads wrote them
    (heads / "config.json").write_text(json.dumps(config))
    code, output = cli(*run, "--init-heads", heads, "--mlx-path", tmp_path / "a")
    assert code == 1 and "trained for another trunk" in output, output

    code, output = cli(*run, "--any-trunk", "--mlx-path", tmp_path / "a")
    assert code == 2 and "--any-trunk goes with --init-heads" in output, output
    code, output = cli(
        *run, "--init-heads", heads, "--any-trunk", "--mlx-path", tmp_path / "a"
    )
    assert code == 0, output
    lineage = json.loads((tmp_path / "a" / "config.json").read_text())["mtp"]
    assert lineage["provenance"]["training"]["started_from_trunk"] == str(trunk)

"""DeepSeek-V4.1 drafting with its own DSpark drafter (``mtp.{0,1,2}``, loaded from
the main checkpoint): greedy decoding token for token as plain decoding at every
block length and ``auto``, sampling in distribution (with a negative control), the
trunk's caches and the drafter's context rolled back after a rejection at every
position of a block equal to fresh ones, ``mlx-mtp generate`` end to end, and
checkpoints whose ``mtp.*`` do not fit refused in one line."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step
from mlx_lm.models import deepseek_v41 as lm

from mlx_mtp.cache import block_context, make_caches, mtp_caches
from mlx_mtp.cli import main
from mlx_mtp.errors import MissingHeadsError
from mlx_mtp.loading import load_model
from mlx_mtp.models.deepseek_v4_quant import dequantize_fp8
from mlx_mtp.models.deepseek_v41_dspark import DSparkV41
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing.fixtures_v41 import write_deepseek_v41

from .test_dspark import (
    fails_with_q_without_the_markov_correction,
    rejections,
    sampling_fails,
)

PROMPTS = ([5, 17, 30], list(range(10, 40)))
GAMMA = 5  # dspark_block_size of the fixture
AGREE = 0.8  # predictable fixture: acceptance about 0.5 at k = 5


@pytest.fixture(scope="module")
def random_path(tmp_path_factory):
    return write_deepseek_v41(tmp_path_factory.mktemp("v41") / "random")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-predictable")
    path = write_deepseek_v41(root / "m", predictable=True, agree=AGREE)
    return load_model(str(path))[0]


def plain(model, prompt, n):
    steps = generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    return [int(t) for t, _ in steps]


def test_the_drafter_loads_from_the_main_checkpoint(random_path):
    """The stages' released tensors land in the drafter: stage 0's ``main_proj``,
    the last stage's Markov head (``embed`` is W1, ``head`` W2) and confidence
    head, a stage's experts stacked; no embedding or head of its own."""
    model = load_model(str(random_path))[0]
    d, w = model.drafter, mx.load(str(random_path / "model.safetensors"))
    assert isinstance(d, DSparkV41) and d.block_size == GAMMA
    assert d.spec.target_layer_ids == (2, 3, 4) and set(d.context_windows) == {8}
    assert len(d.layers) == 3 and "embed_tokens" not in d and "lm_head" not in d
    same = [
        (d.main_proj.weight, w["mtp.0.main_proj.weight"]),
        (d.markov_head.markov_w1.weight, w["mtp.2.markov_head.embed.weight"]),
        (d.markov_head.markov_w2.weight, w["mtp.2.markov_head.head.weight"]),
        (d.confidence_head.proj.weight, w["mtp.2.confidence_head.proj.weight"]),
        (d.norm.weight, w["mtp.2.norm.weight"]),
        (d.layers[1].self_attn.sinks, w["mtp.1.attn.attn_sink"]),
        (
            d.layers[1].mlp.experts.switch_mlp.up_proj.weight[3],
            w["mtp.1.ffn.experts.3.w3.weight"],
        ),
    ]
    assert all(mx.array_equal(a, b).item() for a, b in same)
    assert "bias" not in d.confidence_head.proj
    caches = make_caches(model)
    assert len(caches.mtp) == 3 and model.num_mtp_layers == 1
    assert model.hidden_width == 4 * model.args.hidden_size


def test_release_dtypes_load_packed(tmp_path):
    """The stages' FP8 projections (e4m3, ue8m0 per 32x32 block) and FP4 experts
    load packed as mxfp8 / mxfp4 with the values they encode, and the drafter
    drafts exactly."""
    from .test_window import greedy_identity

    path = write_deepseek_v41(tmp_path / "release", release=True)
    model = load_model(str(path))[0]
    d, stored = model.drafter, mx.load(str(path / "model.safetensors"))
    packed = {
        "mxfp8": [d.main_proj, d.layers[1].self_attn.q_a_proj],
        "mxfp4": [d.layers[2].mlp.experts.switch_mlp.down_proj],
    }
    for mode, layers in packed.items():
        assert all(layer.mode == mode for layer in layers), mode
    q = d.layers[1].self_attn.q_a_proj
    w = mx.dequantize(q.weight, q.scales, None, q.group_size, q.bits, mode=q.mode)
    name = "mtp.1.attn.wq_a"
    encoded = dequantize_fp8(
        stored[f"{name}.weight"], stored[f"{name}.scale"], (32, 32), mx.float32
    )
    assert mx.array_equal(w.astype(mx.float32), encoded).item()
    greedy_identity(model, PROMPTS[1:], n=20, ks=(GAMMA,))


def test_taps_are_the_target_layers_inputs_averaged_over_the_streams(
    random_path, monkeypatch
):
    """Tap i is the input streams of trunk layer i, averaged over the
    hyper-connection copies (the reference reads ``h.mean(dim=2)`` before block i),
    in ``dspark_target_layer_ids`` order, before the post-norm state."""
    model = load_model(str(random_path))[0]
    inputs, call = {}, lm.DecoderLayer.__call__

    def spy(self, streams, *args, **kwargs):
        inputs[self.layer_idx] = streams
        return call(self, streams, *args, **kwargs)

    monkeypatch.setattr(lm.DecoderLayer, "__call__", spy)
    h = model.hidden(mx.array([list(range(10, 30))]))  # (1, 20, 4 H)
    H = model.args.hidden_size
    for n, i in enumerate((2, 3, 4)):
        expected = inputs[i].astype(mx.float32).mean(axis=2)
        np.testing.assert_allclose(
            np.array(h[..., n * H : (n + 1) * H]), np.array(expected), atol=1e-6
        )


def test_a_block_matches_the_numpy_reference(random_path):
    """After a prompt longer than the window (the block sees its last 8 context
    rows), one block's base logits, Markov-corrected ones and confidence logits
    (of the collapses before ``norm``) equal the float64 reference of V4.1's DSpark
    stages (`tests/numpy_deepseek_v41_dspark.py`)."""
    from .numpy_deepseek_v41_dspark import dspark_block

    model = load_model(str(random_path))[0]
    prompt, anchor, drafts = list(range(10, 30)), 7, [3, 9, 11, 200]
    h = model.hidden(mx.array(prompt)[None])  # (1, 20, 4 H)
    taps = h[0, :, : model.drafter.tap_width]
    caches = mtp_caches(model)
    model.draft_context(h, caches)
    context = block_context(model.drafter, caches, [len(prompt)])
    z, x = model.draft_block(mx.array([anchor]), context, len(prompt))
    ref_z, ref_markov, ref_confidence = dspark_block(
        str(random_path), np.array(taps), anchor, drafts
    )
    np.testing.assert_allclose(np.array(z[0]), ref_z, rtol=1e-4, atol=1e-4)
    for k, prev in enumerate([anchor] + drafts):
        prev = mx.array([prev])
        bias, _ = model.drafter.markov(prev, x[:, k], None)  # a vanilla head
        corrected = z[0, k] + bias[0]
        np.testing.assert_allclose(
            np.array(corrected), ref_markov[k], rtol=1e-4, atol=1e-4
        )
        confidence = model.drafter.confidence(x[:, k], prev)[0]
        assert abs(confidence.item() - ref_confidence[k]) < 1e-4


@pytest.mark.slow  # about 30 s, as the other families' sweeps (tests/test_greedy.py)
def test_greedy_identity_at_every_block_length_and_auto(model):
    """k = 1..gamma, a random k per round and ``auto``; with k = gamma, rounds
    reject at every position of the block and accept it all."""
    from .test_window import greedy_identity

    hist = greedy_identity(
        model, PROMPTS, ks=tuple(range(1, GAMMA + 1)), policies=("auto",)
    )
    assert all(n > 0 for n in hist[GAMMA]), hist
    drafted = sum(k * sum(h) for k, h in hist.items())
    accepted = sum(a * n for h in hist.values() for a, n in enumerate(h))
    assert 0.2 < accepted / drafted < 0.9, hist


@pytest.mark.slow  # about 9 s: with -m slow (CI runs both)
def test_a_random_drafter_and_prompt_lookup_decode_exactly(random_path):
    """A random (rarely accepted) drafter at k = gamma, and prompt lookup (its drafts
    rolled back on the same caches) on a repetitive prompt."""
    from .test_window import greedy_identity

    model = load_model(str(random_path))[0]
    greedy_identity(model, PROMPTS[1:], n=40, ks=(GAMMA,))
    prompt = [7, 8, 9, 10, 11] * 6
    expected = plain(model, prompt, 40)
    steps = mtp_generate_step(
        prompt, model, draft_source="lookup", num_draft_tokens=4, max_tokens=40
    )
    outs = list(steps)
    assert [o.token for o in outs] == expected
    assert outs[-1].stats.rounds < 40  # lookup drafted


def state_of(cache, window: int) -> dict:
    """What a `V41Cache` holds that later positions read: the last ``window - 1``
    window rows, the compressed entries and index keys, the open group's
    projections."""
    rows = cache.window[:, -(window - 1) :] if cache.window is not None else None
    names = ("compress_kv", "index_k", "pending_kv", "pending_gate")
    return {"window": rows, **{n: getattr(cache, n) for n in names}}


def assert_same_state(ours, fresh, window):
    assert ours.offset == fresh.offset
    a, b = state_of(ours, window), state_of(fresh, window)
    for name in a:
        if a[name] is None or b[name] is None:
            assert (
                a[name] is None
                and b[name] is None
                or 0 in ((a[name] if a[name] is not None else b[name]).shape)
            ), name
            continue
        np.testing.assert_allclose(np.array(a[name]), np.array(b[name]), atol=2e-5)


def fresh_caches(model, tokens):
    """Trunk caches and drafter context rows of ``tokens`` from one pass each."""
    caches = make_caches(model)
    h = model.hidden(mx.array(tokens)[None], caches.trunk)
    model.draft_context(h, caches.mtp)
    return caches


def test_caches_after_a_rejection_at_every_position_equal_fresh_ones(model):
    """After each round that rejects at position j (every j of the block), the
    trunk's caches (window, compressed entries, index keys, the open group's
    projections) and the drafter's context rows equal those of fresh passes over
    the committed tokens."""
    rejected, window = set(), model.args.sliding_window
    for a, caches, state in rejections(model, PROMPTS[1], 200):
        rejected.add(a)
        n = len(state.tokens) - 1
        ref = fresh_caches(model, state.tokens[:n])
        for ours, theirs in zip(caches.trunk, ref.trunk):
            assert_same_state(ours, theirs, window)
        context = fresh_caches(model, state.tokens[: state.frontier]).mtp
        for ours, theirs in zip(caches.mtp, context):
            assert ours.offset == theirs.offset == state.frontier
            for x, y in zip(ours.committed_kv(window), theirs.committed_kv(window)):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=2e-5)
        if rejected == set(range(GAMMA)):
            break
    assert rejected == set(range(GAMMA)), rejected


# --- sampling ----------------------------------------------------------------------

V = 16


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-small")
    path = write_deepseek_v41(
        root / "s", predictable=True, walk=False, agree=0.5, vocab_size=V
    )
    return load_model(str(path))[0]


@pytest.mark.slow  # about 50 s: with -m slow (CI runs both)
def test_sampling_is_exact_with_the_markov_head(small):
    assert not sampling_fails(small, GAMMA)


@pytest.mark.slow  # about 35 s: with -m slow (CI runs both)
def test_sampling_test_catches_q_without_the_markov_correction(small, monkeypatch):
    """Negative control (`tests/test_dspark.py`'s): q from the block's logits alone
    fails the same test."""
    assert fails_with_q_without_the_markov_correction(small, monkeypatch)


# --- the CLI and checkpoints that do not fit -----------------------------------------


@pytest.mark.slow
def test_cli_generate_with_the_drafter_prints_the_plain_text(tmp_path):
    """``generate`` at k = gamma and auto prints what ``-k 0`` prints; a k above
    gamma is refused in one line."""
    path = write_deepseek_v41(tmp_path / "m", predictable=True, agree=AGREE)
    base = ["generate", "--model", str(path), "-p", "The quick brown fox", "-m", "30"]
    base += ["--quiet", "--ignore-chat-template"]
    runs = [CliRunner().invoke(main, base + k) for k in (["-k", "5"], [], ["-k", "0"])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].output == runs[1].output == runs[2].output
    assert len(runs[0].output) > 10
    bad = CliRunner().invoke(main, base + ["-k", "6"])
    assert bad.exit_code == 1 and bad.output.count("\n") == 1, bad.output


def edited(random_path, tmp_path, change):
    """A copy of the random checkpoint with its tensors changed by ``change``."""
    path = shutil.copytree(random_path, tmp_path / "edited")
    weights = dict(mx.load(str(path / "model.safetensors")))
    change(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda w: [w.pop(k) for k in list(w) if k.startswith("mtp.2.")],
            r"declares 3 DSpark stages .* has mtp\.\{0,1\}",
        ),
        (
            lambda w: w.pop("mtp.1.attn.wq_a.weight"),
            r"missing mtp\.1\.self_attn\.q_a_proj\.weight",
        ),
        (
            lambda w: w.update({"mtp.0.main_proj.weight": mx.zeros((64, 128))}),
            r"main_proj\.weight has shape \(64, 128\)",
        ),
        (
            lambda w: w.update({"mtp.2.hc_head_fn": mx.zeros((4, 256))}),
            r"unexpected mtp\.2\.hc_head",
        ),
    ],
)
def test_stages_that_do_not_fit_are_refused_in_one_line(
    random_path, tmp_path, change, match
):
    """Missing stages or tensors, a misshapen tensor, a V4-0731 name: one line naming
    the checkpoint's stage and the flag; with the flag, plain decoding."""
    path = edited(random_path, tmp_path, change)
    with pytest.raises(MissingHeadsError, match=match) as e:
        load_model(str(path))
    assert "\n" not in str(e.value) and "--allow-missing-heads" in str(e.value)
    model = load_model(str(path), allow_missing_heads=True)[0]
    assert model.drafter is None and model.num_mtp_layers == 0


@pytest.mark.slow  # about 9 s: with -m slow (CI runs both)
def test_batched_rows_decode_as_alone(model):
    """V4.1 rows decoded together, apart (`mlx_mtp.rows.Rows`: each row's trunk
    pass, context rows and block its own, at its own position), joining at
    different rounds, prefilled alone or together: greedy rows equal plain
    decoding, token for token and in their log-probabilities (the predictable
    fixture's tokens alone would miss a stale cache row), seeded sampled rows
    their lone runs; rounds accept drafts in one row while rejecting in
    another."""
    from mlx_mtp.batch import Batch
    from mlx_mtp.batch_cache import batch_support
    from mlx_mtp.options import DecodeOptions
    from mlx_mtp.rows import Rows

    from .test_batch import assert_together_exact

    assert batch_support(model) is None
    prompts = [[5, 17, 30], list(range(10, 40)), [9, 8], list(range(40, 51))]
    for opts in (
        DecodeOptions(num_draft_tokens=GAMMA, max_tokens=16),
        DecodeOptions(num_draft_tokens=3, max_tokens=12, temp=0.9, seed=7),
    ):
        batch = Batch(model, opts, max_batch=4)
        tokens, logprobs, accepted, rnd = {}, {}, [], 0
        while rnd == 0 or len(batch):
            if rnd in (0, 2):
                for i in (0, 1) if rnd == 0 else (2, 3):
                    batch.join(batch.admit(i, prompts[i], opts))
            outputs = batch.step()
            caches = batch.caches.trunk + batch.caches.mtp if len(batch) else []
            assert all(type(c) is Rows for c in caches)
            accepted.append([sum(o.from_draft) for o in outputs])
            for o in outputs:
                tokens.setdefault(o.uid, []).extend(o.tokens)
                logprobs.setdefault(o.uid, []).append(o.logprobs)
            rnd += 1
        for i, p in enumerate(prompts):
            steps = list(mtp_generate_step(p, model, opts))
            assert tokens[i] == [s.token for s in steps], (opts, i)
            if opts.temp:
                continue
            assert tokens[i] == plain(model, p, opts.max_tokens), i
            lone = mx.stack([s.logprobs for s in steps])
            mine = mx.concatenate(logprobs[i])
            assert mx.allclose(mine, lone, atol=1e-4).item(), (opts, i)
        if opts.num_draft_tokens == GAMMA:
            assert any(len(set(r)) > 1 and max(r) for r in accepted), accepted
    opts = DecodeOptions(num_draft_tokens=2, prefill_step_size=5)
    assert_together_exact(model, prompts[1:], opts, [9, 7, 8])


@pytest.mark.slow  # about 30 s: the batch costs are measured with the drafter first
def test_batched_auto_rows_decode_as_alone(model):
    """``-k auto`` rows batched apart (the batch's draft lengths from the costs it
    measures, `run_batch` joining rows as others finish) equal plain decoding."""
    from mlx_mtp.batch import run_batch
    from mlx_mtp.options import DecodeOptions

    prompts = [[5, 17, 30], list(range(10, 40)), [9, 8], list(range(40, 51))]
    opts = DecodeOptions(max_tokens=12)
    outs = {}
    for o in run_batch(model, prompts, [opts] * 4, max_batch=3):
        outs.setdefault(o.uid, []).extend(o.tokens)
    assert all(outs[i] == plain(model, p, 12) for i, p in enumerate(prompts))


def test_the_servers_cache_cost_bounds_v41_rows(model):
    """The server's memory budget of a V4.1 batch (it counted nothing for the
    trunk) bounds what the trunk's caches hold, within a factor of two: the
    window, the compressed entries and index keys, the open groups'
    projections."""
    from mlx_mtp.cache import make_caches
    from mlx_mtp.serving.budget import cache_cost
    from mlx_mtp.speculative import prefill

    cost = cache_cost(model, 1)
    for n in (40, 400):
        caches = make_caches(model)
        prefill(model, caches, [3 + i % 50 for i in range(n)], 1, 256)
        held = sum(c.nbytes for c in caches.trunk)
        assert held <= cost.bytes([n]) < 2 * held + 64 * 1024, (n, held)


@pytest.mark.parametrize("k", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_a_leaving_row_keeps_its_session(model, k):
    """A V4.1 row's session, taken as it leaves the batch (the short row first,
    while the other's rounds go on: with k = 0 a plain round is already launched,
    whose positions its caches drop), goes on single-stream exactly, in its
    log-probabilities too (the predictable fixture's tokens alone would miss a
    stale cache row)."""
    from mlx_mtp.batch import Batch
    from mlx_mtp.options import DecodeOptions

    from .test_batch import drive

    prompts = [[5, 17, 30], list(range(10, 40))]
    opts = [DecodeOptions(num_draft_tokens=k, max_tokens=n) for n in (5, 11)]
    batch = Batch(model, opts[1], keep_sessions=True)
    rows = [
        batch.join(batch.admit(i, p, o)) for i, (p, o) in enumerate(zip(prompts, opts))
    ]
    out, _ = drive(batch, {})
    more, then = [7, 8, 9], opts[1].replace(max_tokens=10)
    for row, p in zip(rows, prompts):
        assert row.session is not None
        steps = list(mtp_generate_step(more, model, then, session=row.session))
        whole = p + out[row.uid] + more
        assert [o.token for o in steps] == plain(model, whole, 10)
        lone = mx.stack([o.logprobs for o in mtp_generate_step(whole, model, then)])
        mine = mx.stack([o.logprobs for o in steps])
        assert mx.allclose(mine, lone, atol=1e-4).item(), row.uid

"""Qwen3 targets with DSpark block drafters (``--draft-model``): both folder spellings
load, the pair decodes exactly as plain decoding of the target (greedy token for
token at every block length and ``auto``, sampling in distribution), the drafter's
context cache rolls back with the round, and drafters that do not fit their target
are refused in one line."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import mlx_mtp.round as rounds
from mlx_mtp.cache import make_caches, mtp_caches, ops
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.options import DecodeOptions
from mlx_mtp.resolve import drafting
from mlx_mtp.speculative import Run, Session, mtp_generate_step, prefill
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.dspark import BLOCK_SIZE, write_dspark, write_qwen3_target

PROMPTS = ([5, 17, 30], list(range(10, 40)))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_qwen3_target(tmp_path_factory.mktemp("dspark") / "target")


def drafter(target, name, **options):
    return write_dspark(target.parent / name, target, **options)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A predictable pair: acceptance about 0.45 at k = 4."""
    root = tmp_path_factory.mktemp("dspark-predictable")
    target = write_qwen3_target(root / "target", predictable=True)
    path = write_dspark(root / "drafter", target, predictable=True)
    return load_model(str(target), draft_model=str(path))[0]


def plain(model, prompt, n):
    steps = generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("layout", ["deepspec", "nested"])
def test_both_spellings_load_with_the_targets_embedding_and_head(target, layout):
    """The DeepSpec folder's copies of the target's embedding and head are dropped
    for the target's own; the nested folder has none."""
    path = drafter(target, f"random-{layout}", layout=layout)
    model = load_model(str(target), draft_model=str(path))[0]
    d = model.drafter
    assert d.block_size == BLOCK_SIZE and d.spec.target_layer_ids == (0, 2)
    assert "embed_tokens" not in d and "lm_head" not in d
    assert "markov_head" in d and "confidence_head" in d
    assert len(make_caches(model).mtp) == 2 and model.num_mtp_layers == 1
    assert model.hidden_width == 3 * model.args.hidden_size


def test_a_head_that_differs_from_the_targets_stays_the_drafters(target):
    path = shutil.copytree(drafter(target, "random-deepspec"), target.parent / "own")
    weights = mx.load(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 2
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    d = load_model(str(target), draft_model=str(path))[0].drafter
    assert "lm_head" in d and "embed_tokens" not in d


def test_greedy_identity_at_every_block_length_and_auto(model):
    """k = 1..gamma, a random k per round and ``auto``; with k = gamma, rounds
    reject at every position of the block (each rolls the context back) and
    accept it all."""
    from .test_window import greedy_identity

    ks = tuple(range(1, BLOCK_SIZE + 1))
    hist = greedy_identity(model, PROMPTS, ks=ks, policies=("auto",))
    assert all(n > 0 for n in hist[BLOCK_SIZE]), hist


def test_random_drafters_decode_exactly(target):
    """Random (rarely accepted) drafters of both spellings, the nested one with the
    target's embedding and head."""
    from .test_window import greedy_identity

    for layout in ("deepspec", "nested"):
        path = drafter(target, f"random-{layout}", layout=layout)
        model = load_model(str(target), draft_model=str(path))[0]
        greedy_identity(model, PROMPTS[1:], n=40, ks=(BLOCK_SIZE,))


def fresh_context(model, tokens):
    """The drafter's context rows of ``tokens`` from one trunk pass."""
    caches = mtp_caches(model)
    model.draft_context(model.hidden(mx.array(tokens)[None]), caches)
    return caches


def rejections(model, prompt, rounds_at_most):
    """Greedy rounds of k = gamma after ``prompt`` (at most ``rounds_at_most``):
    after each that rejects a draft, yield the accepted count, the caches and the
    decode state."""
    gamma = model.drafter.block_size
    opts = HEADS.replace(num_draft_tokens=gamma, max_tokens=-1)
    caches = make_caches(model)
    state = prefill(model, caches, prompt, 1, 512)
    run = Run(
        model, Session(caches, state), drafting(model, opts), opts, mx.random.key(0)
    )
    run.begin()
    for _ in range(rounds_at_most):
        rnd = rounds.launch(model, caches, [run], rounds.plan([run]), state.depth)
        a = rnd.accepted.item()
        new = rnd.drafts[0, :a].tolist() + [rnd.next_tokens.item()]
        rounds.commit(caches, [run], rnd, [new], state.depth)
        if a < gamma:
            yield a, caches, state


def test_context_cache_equals_a_fresh_one_after_every_rejection(model):
    """After each round that rejects at position j (every j of the block), the
    drafter's context rows equal those of a fresh pass over the committed tokens."""
    rejected = set()
    for a, caches, state in rejections(model, PROMPTS[1], 60):
        rejected.add(a)
        ref = fresh_context(model, state.tokens[: state.frontier])
        for ours, theirs in zip(caches.mtp, ref):
            assert ours.offset == theirs.offset == state.frontier
            for x, y in zip(ours.keys_and_values(), theirs.keys_and_values()):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
    assert rejected == set(range(BLOCK_SIZE)), rejected


def refused(target, path, match):
    with pytest.raises(MTPError, match=match) as e:
        load_model(str(target), draft_model=str(path))
    assert "\n" not in str(e.value)


def edited(target, name, **changes):
    """A copy of a random drafter with config keys changed."""
    path = shutil.copytree(drafter(target, "random-deepspec"), target.parent / name)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_drafters_that_do_not_fit_are_refused_in_one_line(target, tmp_path):
    small = write_qwen3_target(tmp_path / "small", vocab_size=32)
    refused(target, write_dspark(tmp_path / "d32", small), "vocabulary of 32")
    refused(target, edited(target, "last", target_layer_ids=[0, 3]), "taps layer 3")
    refused(target, edited(target, "far", target_layer_ids=[9]), "taps layer 9")
    refused(target, edited(target, "wide", hidden_size=48), "hidden size of 48")
    refused(target, edited(target, "deep", num_target_layers=8), "of 8 layers")
    refused(target, edited(target, "gated", markov_head_type="gated"), "'gated'")
    with pytest.raises(MTPError, match="at most 4 tokens"):
        model = load_model(
            str(target), draft_model=str(drafter(target, "random-deepspec"))
        )[0]
        list(mtp_generate_step([1, 2], model, num_draft_tokens=5, max_tokens=2))


def test_taps_and_a_block_match_the_numpy_reference(target):
    """The packed taps of a prompt (outputs of target layers 0 and 2, before the
    final norm), then one block after them: base logits and Markov-corrected ones
    equal the float64 reference of the spec's math (`tests/numpy_dspark.py`)."""
    from .numpy_dspark import dspark_block, target_taps

    path = drafter(target, "random-deepspec")
    model = load_model(str(target), draft_model=str(path))[0]
    prompt, anchor, drafts = list(range(10, 30)), 7, [3, 9, 11]
    h = model.hidden(mx.array(prompt)[None])  # (1, 20, 3 H)
    taps = target_taps(str(target), prompt, [0, 2])
    width = model.drafter.tap_width
    np.testing.assert_allclose(np.array(h[0, :, :width]), taps, rtol=1e-4, atol=1e-4)
    caches = mtp_caches(model)
    model.draft_context(h, caches)
    context = [ops(c).read_kv([len(prompt)]) for c in caches]
    z, _ = model.draft_block(mx.array([anchor]), context, len(prompt))
    ref_z, ref_markov = dspark_block(str(path), taps, anchor, drafts)
    np.testing.assert_allclose(np.array(z[0]), ref_z, rtol=1e-4, atol=1e-4)
    for k, prev in enumerate([anchor] + drafts):
        corrected = z[0, k] + model.drafter.markov(mx.array([prev]))[0]
        np.testing.assert_allclose(
            np.array(corrected), ref_markov[k], rtol=1e-4, atol=1e-4
        )


# --- sampling exactness ------------------------------------------------------------

V = 16
SAMPLE_PROMPT = [3, 7, 1, 9, 4, 2]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark-small")
    small_target = write_qwen3_target(root / "t", vocab_size=V)
    path = write_dspark(root / "d", small_target, predictable=True, agree=0.5)
    return load_model(str(small_target), draft_model=str(path))[0]


def sampling_fails(model, k, n=600) -> bool:
    """The chi-square test of `tests/test_sampling.py` on the first three tokens."""
    from .test_sampling import sampling_after_prompt_fails

    return sampling_after_prompt_fails(model, SAMPLE_PROMPT, V, k, n)


def test_sampling_is_exact_with_the_markov_head(small):
    assert not sampling_fails(small, BLOCK_SIZE)


def test_sampling_test_catches_q_without_the_markov_correction(small, monkeypatch):
    assert fails_with_q_without_the_markov_correction(small, monkeypatch)


def fails_with_q_without_the_markov_correction(model, monkeypatch) -> bool:
    """Negative control: drafts drawn from the Markov-corrected logits but reported
    with q from the block's logits alone (ignoring the drawn prefix) must fail the
    same test. Returns whether it failed."""
    markov, pick, last = model.drafter.markov, rounds._pick, {}

    def recording(prev):
        last["bias"] = markov(prev)
        return last["bias"]

    def uncorrected(runs, logits, keys):
        tokens, q = pick(runs, logits, keys)
        z = logits - last["bias"]
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)  # (B, V)
        return tokens, [None if x is None else lp[b : b + 1] for b, x in enumerate(q)]

    monkeypatch.setattr(model.drafter, "markov", recording)
    monkeypatch.setattr(rounds, "_pick", uncorrected)
    return sampling_fails(model, model.drafter.block_size)


# --- batched rows ------------------------------------------------------------------


def test_batched_rows_decode_as_alone(model):
    """Rows joining at different rounds, with different pending context rows
    (left-padded into the context caches) and positions: greedy rows equal plain
    decoding, seeded sampled rows their lone runs, auto rows too."""
    from mlx_mtp.batch import Batch

    from .test_batch import drive

    prompts = [[5, 17, 30], list(range(10, 40)), [9, 8], list(range(40, 51))]
    for opts in (
        HEADS.replace(num_draft_tokens=BLOCK_SIZE, max_tokens=30),
        DecodeOptions(num_draft_tokens=3, max_tokens=20, temp=0.9, seed=7),
        DecodeOptions(max_tokens=20),  # auto: the batch costs timed with the drafter
    ):
        joins = {0: [(i, p, opts) for i, p in enumerate(prompts[:2])]}
        joins[2] = [(i + 2, p, opts) for i, p in enumerate(prompts[2:])]
        out, _ = drive(Batch(model, opts), joins)
        for i, p in enumerate(prompts):
            alone = [o.token for o in mtp_generate_step(p, model, opts)]
            assert out[i] == alone, (opts.temp, i)
            if not opts.temp:
                assert out[i] == plain(model, p, opts.max_tokens)


def test_rows_prefilled_together_decode_exactly(model):
    from .test_batch import assert_together_exact

    opts = HEADS.replace(num_draft_tokens=3, prefill_step_size=5)
    prompts = [list(range(10, 40)), [5, 17, 30], list(range(40, 51))]
    assert_together_exact(model, prompts, opts, [14, 9, 12])


def test_cli_generate_with_the_drafter_prints_the_plain_text(tmp_path):
    """``generate --model T --draft-model D`` (k = gamma and auto) prints what
    plain decoding prints; a k above gamma is refused in one line."""
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    t = write_qwen3_target(tmp_path / "t", vocab_size=512)
    d = write_dspark(tmp_path / "d", t, predictable=True)
    base = ["generate", "--model", str(t), "-p", "def f(x):", "-m", "40", "--quiet"]
    runs = [
        CliRunner().invoke(main, base + ["--draft-model", str(d), "-k", "4"]),
        CliRunner().invoke(main, base + ["--draft-model", str(d)]),
        CliRunner().invoke(main, base + ["-k", "0"]),
    ]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].output == runs[1].output == runs[2].output
    assert len(runs[0].output) > 10
    bad = CliRunner().invoke(main, base + ["--draft-model", str(d), "-k", "5"])
    assert bad.exit_code == 1 and bad.output.count("\n") == 1, bad.output


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A predictable pair with the fixtures' tokenizer."""
    from mlx_mtp.loading import load

    root = tmp_path_factory.mktemp("dspark-tokenizer")
    t = write_qwen3_target(root / "t", vocab_size=512, predictable=True)
    d = write_dspark(root / "d", t, predictable=True)
    return load(str(t), draft_model=str(d))


def test_grammars_cut_blocks_and_keep_plain_constrained_output(tokenized):
    """Under a JSON schema and a regex, drafting blocks (k = gamma and auto) gives
    plain constrained decoding's text."""
    import re

    from .test_structured import SCHEMAS, decode

    model, tokenizer = tokenized
    pattern = r"(yes|no), [0-9]{2,4}(\.[0-9])?"
    drafted = 0
    for grammar in ({"json_schema": SCHEMAS[0]}, {"regex": pattern}):
        plain_text, _ = decode(model, tokenizer, "A:", num_draft_tokens=0, **grammar)
        for k in (BLOCK_SIZE, "auto"):
            text, stats = decode(
                model,
                tokenizer,
                "A:",
                num_draft_tokens=k,
                draft_source="heads",
                **grammar,
            )
            assert text == plain_text, (grammar, k)
            drafted += stats.accepted
    assert re.fullmatch(pattern, plain_text)
    assert drafted > 0


def test_chunked_prefill_and_sessions(model):
    """A prompt prefilled in chunks of 3 (context rows written chunk by chunk), a
    generation stopped early and a session going on from it decode as plain
    decoding of the conversation."""
    first, second = list(range(10, 40)), [11, 12, 13]
    session = Session()
    steps = mtp_generate_step(
        first, model, HEADS, num_draft_tokens=3, session=session, prefill_step_size=3
    )
    got = [next(steps).token for _ in range(37)]
    steps.close()
    assert got == plain(model, first, 37)
    steps = mtp_generate_step(
        second, model, HEADS, num_draft_tokens=4, max_tokens=60, session=session
    )
    assert [o.token for o in steps] == plain(model, first + got + second, 60)


def test_serving_a_target_with_its_drafter(tmp_path):
    """``serve --model TARGET --draft-model DSPARK``: a request drafts, and its
    text is plain decoding's."""
    import openai

    from mlx_mtp import generate as mtp_generate
    from mlx_mtp.loading import load
    from mlx_mtp.server import Server, server_args

    t = write_qwen3_target(tmp_path / "t", vocab_size=512, predictable=True)
    d = write_dspark(tmp_path / "d", t, predictable=True)
    server = Server(server_args(model=str(t), draft_model=str(d), port=0)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        r = client.completions.create(
            model="default_model",
            prompt="def f(x):",
            max_tokens=12,
            extra_body={"num_draft_tokens": BLOCK_SIZE},
        )
    finally:
        server.close()
    model, tokenizer = load(str(t), draft_model=str(d))
    want = mtp_generate(
        model, tokenizer, "def f(x):", max_tokens=12, num_draft_tokens=0
    )
    assert r.choices[0].text == want
    assert r.model_extra["mtp"]["drafted"] > 0

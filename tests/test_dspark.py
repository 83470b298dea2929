"""Qwen3 targets with DSpark block drafters (``--draft-model``): both folder spellings
load, the pair decodes exactly as plain decoding of the target (greedy token for
token at every block length and ``auto``, sampling in distribution) with each of
DeepSpec's Markov heads (vanilla, gated, rnn) and with the confidence head cutting
blocks, the drafter's context cache rolls back with the round, ``auto`` prices a
block round as one pass, and drafters that do not fit their target are refused in
one line."""

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step

import mlx_mtp.round as rounds
from mlx_mtp.cache import block_context, make_caches, mtp_caches
from mlx_mtp.cli import main
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import _same_rows, load_model
from mlx_mtp.options import DecodeOptions
from mlx_mtp.resolve import drafting
from mlx_mtp.speculative import Run, Session, mtp_generate_step, prefill
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.dspark import BLOCK_SIZE, write_dspark, write_qwen3_target

PROMPTS = ([5, 17, 30], list(range(10, 40)))
MARKOV = ("vanilla", "gated", "rnn")
# the sampling tests of the gated and rnn heads (about 8 s each) run with ``-m slow``,
# so that the default suite stays a few minutes; the vanilla head's run by default
SAMPLED_MARKOV = ["vanilla"] + [
    pytest.param(m, marks=pytest.mark.slow) for m in MARKOV[1:]
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_qwen3_target(tmp_path_factory.mktemp("dspark") / "target")


def drafter(target, name, **options):
    return write_dspark(target.parent / name, target, **options)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(markov="vanilla", tau=None)``: a predictable pair with that Markov
    head and confidence threshold (None: the config has none), made once."""
    root = tmp_path_factory.mktemp("dspark-predictable")
    target = write_qwen3_target(root / "target", predictable=True)
    made = {}

    def get(markov="vanilla", tau=None):
        if (markov, tau) not in made:
            path = write_dspark(
                root / f"drafter-{markov}-{tau}",
                target,
                predictable=True,
                markov=markov,
                confidence_threshold=tau,
            )
            made[markov, tau] = load_model(str(target), draft_model=str(path))[0]
        return made[markov, tau]

    return get


@pytest.fixture(scope="module")
def model(pairs):
    """A predictable pair: acceptance about 0.45 at k = 4."""
    return pairs()


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


def test_a_converted_drafter_decodes_exactly_beside_a_quantized_target(
    target, tmp_path
):
    """``convert`` of a DSpark drafter alone: its layers quantized at 8 bits (the
    widths that allow it), the copies of the target's tables kept float; beside
    a quantized conversion of the target the loader takes those copies for the
    target's own tables (quantized alike, they pack to the same rows) and the pair
    decodes greedy exactly, drafts accepted. A copy that differs in one row stays
    the drafter's; a drafter converted with an assistant, or given as one, is
    refused in one line."""
    src = drafter(target, "to-convert", predictable=True)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = convert(str(src), tmp_path / "d8", quantize=True, progress=False)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    saved = mx.load(str(out / "model.safetensors"))
    assert "fc.scales" in saved and "layers.0.mlp.down_proj.scales" in saved
    assert "embed_tokens.scales" not in saved and "lm_head.scales" not in saved
    quantized = convert(
        str(target), tmp_path / "t4", quantize=True, q_group_size=32, progress=False
    )
    model = load_model(str(quantized), draft_model=str(out))[0]
    d = model.drafter
    assert "embed_tokens" not in d and "lm_head" not in d
    assert isinstance(d.fc, nn.QuantizedLinear) and d.fc.bits == 8
    tokens, stats = greedy_run(model, PROMPTS[1])
    assert tokens == plain(model, PROMPTS[1], 24) and stats.accepted > 0, stats
    table = model.trunk.model.embed_tokens
    rows = mx.arange(0, model.args.vocab_size, 1)
    copy = saved["embed_tokens.weight"]
    assert _same_rows(copy[rows], table, rows)
    assert not _same_rows(copy.at[3].add(1.0)[rows], table, rows)
    with pytest.raises(MTPError, match="DSpark drafter: convert it alone"):
        convert(str(target), tmp_path / "pair", draft_hf_path=str(src))
    with pytest.raises(MTPError, match="is a DSpark drafter: it takes no assistant"):
        convert(str(src), tmp_path / "x", draft_hf_path=str(src))


def greedy_run(model, prompt, n=24, k=4):
    """The greedy tokens of ``model`` at k and its statistics."""
    tokens, stats = [], None
    for step in mtp_generate_step(prompt, model, max_tokens=n, num_draft_tokens=k):
        tokens.append(step.token)
        stats = step.stats
    return tokens, stats


def test_a_grafted_drafter_runs_with_its_target_folder_alone(target, tmp_path):
    """``graft --from DRAFTER --mlx-path TARGET``: the drafter beside a quantized
    conversion of its target (its copies of the target's tables dropped, its
    layers at 8 bits), the folder alone decodes greedy exactly with drafts
    accepted; the drafter's folder is untouched. A second graft without
    --overwrite (spelt ``--drafter``), the folder given as a --draft-model, and
    a missing drafter file are refused in one line (decoded without under
    --allow-missing-heads)."""
    src = drafter(target, "to-graft", predictable=True)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    conv = convert(
        str(target), tmp_path / "t4", quantize=True, q_group_size=32, progress=False
    )
    args = ["graft", "--from", str(src), "--mlx-path", str(conv)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "DSpark drafter" in result.output, result.output
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    section = json.loads((conv / "config.json").read_text())["drafter"]
    assert section["quantization"]["bits"] == 8 and section["provenance"]["grafted"]
    saved = mx.load(str(conv / section["file"]))
    assert "fc.scales" in saved and "embed_tokens.weight" not in saved
    assert "lm_head.weight" not in saved
    model = load_model(str(conv))[0]
    tokens, stats = greedy_run(model, PROMPTS[1])
    assert tokens == plain(model, PROMPTS[1], 24) and stats.accepted > 0, stats
    again = CliRunner().invoke(main, ["graft", "--drafter", *args[2:]])
    assert again.exit_code == 1 and "already has a drafter" in again.output
    assert again.output.count("\n") == 1, again.output
    with pytest.raises(MTPError, match="is a target's conversion"):
        load_model(str(target), draft_model=str(conv))
    (conv / section["file"]).unlink()
    with pytest.raises(MTPError, match="drafter.safetensors is missing"):
        load_model(str(conv))
    bare = load_model(str(conv), allow_missing_heads=True)[0]
    assert bare.drafter is None


def test_greedy_identity_at_every_block_length_and_auto(model):
    """k = 1..gamma, a random k per round and ``auto``; with k = gamma, rounds
    reject at every position of the block (each rolls the context back) and
    accept it all."""
    from .test_window import greedy_identity

    ks = tuple(range(1, BLOCK_SIZE + 1))
    hist = greedy_identity(model, PROMPTS, ks=ks, policies=("auto",))
    assert all(n > 0 for n in hist[BLOCK_SIZE]), hist


@pytest.mark.parametrize(
    "markov", [MARKOV[1], pytest.param(MARKOV[2], marks=pytest.mark.slow)]
)
def test_gated_and_rnn_heads_decode_greedy_exactly(pairs, markov):
    """k = 1..gamma and ``auto`` give plain decoding's tokens with a gated or an
    rnn Markov head, which carries the target's bigram: blocks are accepted whole
    and rejected at their first slot."""
    from .test_window import greedy_identity

    ks = tuple(range(1, BLOCK_SIZE + 1))
    hist = greedy_identity(pairs(markov), PROMPTS, n=60, ks=ks, policies=("auto",))
    assert hist[BLOCK_SIZE][0] > 0 and hist[BLOCK_SIZE][-1] > 0, hist


def test_random_drafters_decode_exactly(target):
    """Random (rarely accepted) drafters of both spellings, the nested one with the
    target's embedding and head."""
    from .test_window import greedy_identity

    for layout in ("deepspec", "nested"):
        path = drafter(target, f"random-{layout}", layout=layout)
        model = load_model(str(target), draft_model=str(path))[0]
        greedy_identity(model, PROMPTS[1:], n=40, ks=(BLOCK_SIZE,))


def test_auto_prices_a_block_round_as_one_pass(model, monkeypatch):
    """``-k auto``'s costs with a block drafter: a round drafting any k > 0 pays
    one block pass (measured, stored and read back as such); an entry stored
    without a pass (before block costs) is measured again."""
    from mlx_mtp import draft_length
    from mlx_mtp.files import write_table

    costs = draft_length.model_costs(model, BLOCK_SIZE)
    assert costs.block > 0 and costs.draft == 0
    assert costs.round(0) == costs.verify[0]
    for k in range(1, BLOCK_SIZE + 1):
        assert costs.round(k) == costs.verify[k] + costs.block

    def reload():
        paths = str(model.source), str(model.drafter_source)
        return load_model(paths[0], draft_model=paths[1])[0]

    measured = []

    def measure(model, max_k, **kw):
        measured.append(max_k)
        return costs

    monkeypatch.setattr(draft_length, "measure_costs", measure)
    assert draft_length.model_costs(reload(), BLOCK_SIZE) == costs  # stored
    assert not measured
    again = reload()
    old = {"verify": costs.verify, "draft": costs.block / BLOCK_SIZE, "drafts": {}}
    write_table(draft_length._costs_file(), {draft_length._cost_key(again): old})
    assert draft_length.model_costs(again, BLOCK_SIZE) == costs
    assert measured


def test_auto_reaches_the_whole_block_by_default(target):
    """One pass proposes every k up to the block for the same cost, so ``-k auto``
    may pick any of them unless ``max_draft_tokens`` says otherwise; heads stay at
    `DEFAULT_MAX_DRAFT_TOKENS`, each of their steps a pass of its own. Greedy
    decoding with the whole block allowed is plain decoding's."""
    from mlx_mtp.defaults import DEFAULT_MAX_DRAFT_TOKENS
    from mlx_mtp.options import longest_draft
    from mlx_mtp.resolve import draft_policy

    from .test_window import greedy_identity

    wide = BLOCK_SIZE + 2
    path = drafter(target, "longer-block", block_size=wide)
    model = load_model(str(target), draft_model=str(path))[0]
    assert DecodeOptions().max_draft_tokens is None
    assert draft_policy(model, "auto", None).max_k == wide
    assert draft_policy(model, "auto", 3).max_k == 3
    assert longest_draft(load_model(str(target))[0], None) == DEFAULT_MAX_DRAFT_TOKENS
    greedy_identity(model, PROMPTS[1:], n=24, ks=(wide,), policies=("auto",))


def two_at_a_time():
    """An adaptive policy (one that judges drafts past k) drafting 2 every round."""
    from mlx_mtp.draft_length import AdaptiveLength, RoundCosts

    class TwoAtATime(AdaptiveLength):
        def next(self) -> int:
            return 2

    return TwoAtATime(
        RoundCosts([1.0] * (BLOCK_SIZE + 1), 0.0, block=0.1), range(BLOCK_SIZE + 1)
    )


def test_unverified_drafts_are_judged_as_a_whole_block_round_would(model, monkeypatch):
    """A greedy ``-k auto`` stream that drafts k = 2 still learns every position of
    the block: each round's drafts past k (the Markov head run over the pass's
    other slots) are judged against the tokens committed after them. Its policy's
    counts equal, position by position, those of rounds drafting the whole block,
    worked out from plain decoding's tokens; the output is plain decoding's."""
    blocks = []  # (n, the block) per drafting round

    def recording(model, caches, runs, rp, depth):
        out = draft_block(model, caches, runs, rp, depth)
        if rp.K:  # (the last rounds draft nothing: no room)
            assert out[2].shape == (1, BLOCK_SIZE)
            blocks.append((len(runs[0].state.tokens) - 1, out[2][0].tolist()))
        return out

    draft_block = rounds.draft_block
    monkeypatch.setattr(rounds, "draft_block", recording)
    for prompt in PROMPTS:
        blocks.clear()
        policy = two_at_a_time()
        steps = mtp_generate_step(prompt, model, HEADS, policy=policy, max_tokens=60)
        tokens = [o.token for o in steps]
        assert tokens == plain(model, prompt, 60)
        stream = prompt + tokens
        hits, reached = [0.0] * BLOCK_SIZE, [0.0] * BLOCK_SIZE
        for n, block in blocks:
            for j, d in enumerate(block):
                if n + 1 + j >= len(stream):
                    break  # committed after the generation ended: never judged
                reached[j] += 1
                if d != stream[n + 1 + j]:
                    break
                hits[j] += 1
        assert policy.seen.reached == reached and policy.seen.hits == hits
        assert sum(reached[2:]) > 10 and sum(hits[2:]) > 0, (reached, hits)


def test_only_greedy_streams_draft_past_k(model, monkeypatch):
    """Sampled rows, rows with a processor and fixed k draft no further than k
    (a sampled row's later tokens depend on its draws: nothing to judge), under a
    policy that would judge (two drafts every round, whatever the history says)."""
    proposed = []

    def recording(model, caches, runs, rp, depth):
        out = draft_block(model, caches, runs, rp, depth)
        if rp.K:
            proposed.append(out[2])
        return out

    draft_block = rounds.draft_block
    monkeypatch.setattr(rounds, "draft_block", recording)
    for options in (
        dict(num_draft_tokens=2),
        dict(temp=1.0, seed=1, policy=two_at_a_time()),
        dict(repetition_penalty=1.1, policy=two_at_a_time()),
    ):
        proposed.clear()
        list(mtp_generate_step(PROMPTS[1], model, HEADS, max_tokens=12, **options))
        assert proposed and all(p is None for p in proposed), options
    list(
        mtp_generate_step(
            PROMPTS[1], model, HEADS, max_tokens=12, policy=two_at_a_time()
        )
    )
    assert proposed[-1] is not None  # the control: greedy, it does


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
        if a < rnd.plan.ks[0]:  # a rejection (not a block the confidence head cut)
            yield a, caches, state


def test_context_cache_equals_a_fresh_one_after_every_rejection(model):
    assert_context_rolls_back(model)


def assert_context_rolls_back(model, prompts=PROMPTS[1:]):
    """After each round that rejects at position j (every j of the block, over
    ``prompts``), the drafter's context rows equal those of a fresh pass over the
    committed tokens."""
    rejected = set()
    for prompt in prompts:
        for a, caches, state in rejections(model, prompt, 60):
            rejected.add(a)
            n = state.frontier
            ref = fresh_context(model, state.tokens[:n])
            for ours, theirs in zip(caches.mtp, ref):
                assert ours.offset == theirs.offset == n
            seen = zip(
                *(block_context(model.drafter, c, [n]) for c in (caches.mtp, ref))
            )
            for ((k, v), _), ((rk, rv), _) in seen:  # what the next block reads
                np.testing.assert_allclose(np.array(k), np.array(rk), atol=1e-5)
                np.testing.assert_allclose(np.array(v), np.array(rv), atol=1e-5)
    assert rejected == set(range(model.drafter.block_size)), rejected


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
    refused(target, edited(target, "lstm", markov_head_type="lstm"), "'lstm'")
    refused(target, edited(target, "tau", confidence_threshold=2), "in \\[0, 1\\]")
    with pytest.raises(MTPError, match="at most 4 tokens"):
        model = load_model(
            str(target), draft_model=str(drafter(target, "random-deepspec"))
        )[0]
        list(mtp_generate_step([1, 2], model, num_draft_tokens=5, max_tokens=2))


@pytest.mark.parametrize("markov", MARKOV)
def test_taps_and_a_block_match_the_numpy_reference(target, markov):
    """The packed taps of a prompt (outputs of target layers 0 and 2, before the
    final norm), then one block after them: base logits, Markov-corrected ones
    slot by slot (each head's state carried along), confidence logits and the
    cut's block length equal the float64 reference of the spec's math
    (`tests/numpy_dspark.py`)."""
    from .numpy_dspark import block_length, dspark_block, target_taps

    path = drafter(target, f"random-{markov}", markov=markov)
    model = load_model(str(target), draft_model=str(path))[0]
    d = model.drafter
    prompt, anchor, drafts = list(range(10, 30)), 7, [3, 9, 11, 2]
    h = model.hidden(mx.array(prompt)[None])  # (1, 20, 3 H)
    taps = target_taps(str(target), prompt, [0, 2])
    np.testing.assert_allclose(
        np.array(h[0, :, : d.tap_width]), taps, rtol=1e-4, atol=1e-4
    )
    caches = mtp_caches(model)
    model.draft_context(h, caches)
    context = block_context(model.drafter, caches, [len(prompt)])
    z, g = model.draft_block(mx.array([anchor]), context, len(prompt))
    ref_z, ref_markov, ref_c = dspark_block(str(path), taps, anchor, drafts)
    np.testing.assert_allclose(np.array(z[0]), ref_z, rtol=1e-4, atol=1e-4)
    state = d.markov_start(1, g.dtype)
    for k, prev in enumerate([anchor] + drafts[:-1]):
        bias, state = d.markov(mx.array([prev]), g[:, k], state)
        np.testing.assert_allclose(
            np.array(z[0, k] + bias[0]), ref_markov[k], rtol=1e-4, atol=1e-4
        )
    prevs = mx.array([[anchor] + drafts[:-1]])
    np.testing.assert_allclose(np.array(d.confidence(g, prevs)[0]), ref_c, atol=1e-4)
    taus = [1 / (1 + np.exp(-c)) for c in ref_c]  # cut just above each slot's
    for tau in [0.0, 1.0] + [t + 1e-3 for t in taus]:
        d.spec = replace(d.spec, confidence_threshold=tau)
        length = d.cut(g, mx.array([anchor]), mx.array([drafts])).item()
        assert length == block_length(ref_c, tau), (tau, ref_c)


# --- sampling exactness ------------------------------------------------------------

V = 16
SAMPLE_PROMPT = [3, 7, 1, 9, 4, 2]


@pytest.fixture(scope="module")
def smalls(tmp_path_factory):
    """``smalls(markov="vanilla", tau=None, predictable=True)``: a 16-token pair."""
    root = tmp_path_factory.mktemp("dspark-small")
    small_target = write_qwen3_target(root / "t", vocab_size=V)
    made = {}

    def get(markov="vanilla", tau=None, predictable=True):
        key = (markov, tau, predictable)
        if key not in made:
            path = write_dspark(
                root / f"d-{markov}-{tau}-{predictable}",
                small_target,
                predictable=predictable,
                agree=0.5,
                markov=markov,
                confidence_threshold=tau,
            )
            made[key] = load_model(str(small_target), draft_model=str(path))[0]
        return made[key]

    return get


def sampling_fails(model, k, n=600, **options) -> bool:
    """The chi-square test of `tests/test_sampling.py` on the first three tokens
    (``options``: more `mtp_generate_step` arguments)."""
    from .test_sampling import sampling_after_prompt_fails

    return sampling_after_prompt_fails(model, SAMPLE_PROMPT, V, k, n, **options)


@pytest.mark.parametrize("markov", SAMPLED_MARKOV)
def test_sampling_is_exact_with_each_markov_head(smalls, markov):
    assert not sampling_fails(smalls(markov, tau=0.0), BLOCK_SIZE)


@pytest.mark.slow  # about 7 s per head: with -m slow (CI runs both)
@pytest.mark.parametrize("markov", MARKOV)
def test_sampling_test_catches_q_without_the_markov_correction(
    smalls, markov, monkeypatch
):
    assert fails_with_q_without_the_markov_correction(
        smalls(markov, tau=0.0), monkeypatch
    )


def fails_with_q_without_the_markov_correction(model, monkeypatch) -> bool:
    """Negative control: drafts drawn from the Markov-corrected logits but reported
    with q from the block's logits alone (ignoring the drawn prefix) must fail the
    same test. Returns whether it failed."""
    markov_bias, pick, last = model.drafter.markov, rounds._pick, {}

    def recording(prev, g, state, w2=None):
        last["bias"], state = markov_bias(prev, g, state, w2)
        return last["bias"], state

    def uncorrected(runs, logits, keys):
        tokens, q = pick(runs, logits, keys)
        z = logits - last["bias"]
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)  # (B, V)
        return tokens, [None if x is None else lp[b : b + 1] for b, x in enumerate(q)]

    monkeypatch.setattr(model.drafter, "markov", recording)
    monkeypatch.setattr(rounds, "_pick", uncorrected)
    return sampling_fails(model, model.drafter.block_size)


# --- draft vocabularies -------------------------------------------------------------


@pytest.fixture
def ranked(smalls):
    """The 16-token pair, its ranking set by hand (it has no tokenizer)."""
    yield from ranked_by_hand(smalls())


def ranked_by_hand(model):
    """Yield ``model`` with a draft-vocabulary ranking of random tokens (a pair
    without a tokenizer), then take it away."""
    from mlx_mtp import draft_vocab

    ids = np.random.default_rng(0).integers(0, V, 96).tolist()
    model.vocab_ranking = draft_vocab.rank_tokens(model, ids)
    yield model
    model.vocab_ranking = None
    model.__dict__.pop("_block_vocabs", None)


def test_a_block_drafts_from_a_draft_vocabulary(ranked):
    """A block's slots from a quarter of the vocabulary: its logits are the full
    head's at the ranking's first rows (Markov bias included) and -inf elsewhere;
    greedy decoding from it at k = 1, gamma and auto is plain decoding."""

    model, n = ranked, V // 4
    rows = np.array(model.vocab_ranking.rows(n))
    caches = mtp_caches(model)
    prompt = [3, 7, 5, 3, 7, 1]
    h = model.hidden(mx.array(prompt[:-1])[None])
    model.draft_context(h, caches)
    context = block_context(model.drafter, caches, [len(prompt) - 1])
    anchor, at = mx.array(prompt[-1:]), len(prompt) - 1
    full, g = model.draft_block(anchor, context, at)
    some, _ = model.draft_block(anchor, context, at, n)
    assert some.shape[-1] == n
    state = model.drafter.markov_start(1, g.dtype)
    whole, _ = model.slot_logits(full[:, 0], anchor, g[:, 0], state)
    part, _ = model.slot_logits(some[:, 0], anchor, g[:, 0], state, n)
    whole, part = np.array(whole)[0], np.array(part)[0]
    assert np.allclose(part[rows], whole[rows], atol=1e-5)
    assert np.isinf(np.delete(part, rows)).all()
    for k in (1, BLOCK_SIZE, "auto"):
        steps = list(
            mtp_generate_step(
                prompt, model, num_draft_tokens=k, max_tokens=24, draft_vocab=n
            )
        )
        assert [o.token for o in steps] == plain(model, prompt, 24), k
        drafted = set(steps[-1].stats.drafted_by_vocab)
        assert drafted == {str(n)} if k != "auto" else drafted <= {str(n)}, drafted


def test_batched_rows_with_different_draft_vocabularies(ranked):
    """Rows drafting from different draft vocabularies (a quarter, half, the whole
    head) verify together, each equal to its lone run: greedy, and seeded
    sampling."""
    from mlx_mtp.batch import Batch

    from .test_batch import drive

    prompts = [[3, 7, 5, 3], [1, 2, 3, 4, 5, 6], [9, 8]]
    for base in (
        HEADS.replace(num_draft_tokens=BLOCK_SIZE, max_tokens=16),
        DecodeOptions(num_draft_tokens=3, max_tokens=12, temp=0.9, seed=3),
    ):
        opts = [base.replace(draft_vocab=v) for v in (V // 4, V // 2, "full")]
        joins = {0: [(i, p, o) for i, (p, o) in enumerate(zip(prompts, opts))]}
        out, _ = drive(Batch(ranked, base), joins)
        for i, (p, o) in enumerate(zip(prompts, opts)):
            assert out[i] == [t.token for t in mtp_generate_step(p, ranked, o)], i


@pytest.mark.slow  # about 9 s: with -m slow (CI runs both)
def test_sampling_from_a_draft_vocabulary_is_exact(ranked):
    assert not sampling_fails(ranked, BLOCK_SIZE, draft_vocab=V // 4)


# --- the confidence cut ------------------------------------------------------------

TAU = 0.3


def recorded_cuts(model, monkeypatch) -> list:
    """Per block the drafter cuts, ``(K, lengths)``: the drafts asked of it and
    each row's block length under the cut."""
    seen, cut = [], model.drafter.cut

    def recording(g, anchor, drafts):
        lengths = cut(g, anchor, drafts)
        seen.append((drafts.shape[1], lengths.tolist()))
        return lengths

    monkeypatch.setattr(model.drafter, "cut", recording)
    return seen


def test_the_cut_shortens_blocks_and_decodes_greedy_exactly(pairs, monkeypatch):
    """With tau > 0 the confidence head cuts a share of the blocks and each round
    verifies its cut block (the drafts counted are the cut lengths); every k and
    ``auto`` still give plain decoding's tokens. tau = 0 cuts nothing: rounds
    draft k = gamma but for the last few (``max_tokens``' room)."""
    from .test_window import greedy_identity

    def stats(model):
        opts = HEADS.replace(num_draft_tokens=BLOCK_SIZE, max_tokens=120)
        return list(mtp_generate_step(PROMPTS[1], model, opts))[-1].stats

    model = pairs(tau=TAU)
    seen = recorded_cuts(model, monkeypatch)
    assert stats(model).drafted == sum(min(K, n) for K, ls in seen for n in ls)
    cut = sum(n < K for K, ls in seen for n in ls)
    assert 0.1 * len(seen) < cut < 0.9 * len(seen), seen
    ks = tuple(range(1, BLOCK_SIZE + 1))
    greedy_identity(model, PROMPTS, ks=ks, policies=("auto",))
    uncut = stats(pairs(tau=0.0))
    assert uncut.rounds - uncut.rounds_by_k[BLOCK_SIZE] <= BLOCK_SIZE, uncut


@pytest.mark.slow  # 16 s; the cut's greedy exactness stays in the default suite
def test_sampling_is_exact_with_the_cut(smalls, monkeypatch):
    model = smalls(tau=TAU)
    seen = recorded_cuts(model, monkeypatch)
    assert not sampling_fails(model, BLOCK_SIZE)
    cut = sum(n < K for K, ls in seen for n in ls)
    assert 0.1 * len(seen) < cut < 0.9 * len(seen)


def token_confidence(small_target, root):
    """A random (spread q) drafter whose confidence head reads the previous token
    only (its weights on g zeroed, on W1[prev] made 5 times larger, no bias), so
    that the cut depends strongly on the tokens drawn: half the vocabulary cuts."""
    path = write_dspark(root, small_target, confidence_threshold=0.5)
    model = load_model(str(small_target), draft_model=str(path))[0]
    proj, H = model.drafter.confidence_head.proj, model.args.hidden_size
    proj.weight = mx.concatenate([mx.zeros((1, H)), 5 * proj.weight[:, H:]], axis=1)
    proj.bias = mx.zeros((1,))
    return model


@pytest.mark.slow
def test_sampling_test_catches_a_cut_that_peeks_at_the_slot(tmp_path, monkeypatch):
    """Negative control: a cut that decides on slot k from the token drawn there
    (W1[d_k] instead of W1[d_(k-1)]: not a stopping time) must fail the test that
    the same drafter with the true cut passes."""
    model = token_confidence(
        write_qwen3_target(tmp_path / "t", vocab_size=V), tmp_path / "d"
    )
    d, tau = model.drafter, 0.5

    def peeking(g, anchor, drafts):
        K = drafts.shape[1]
        low = mx.sigmoid(d.confidence(g[:, :K], drafts)) < tau
        low = low.astype(mx.int32)
        return mx.where(low.max(axis=1) > 0, mx.argmax(low, axis=1), K)

    assert not sampling_fails(model, BLOCK_SIZE)
    monkeypatch.setattr(d, "cut", peeking)
    assert sampling_fails(model, BLOCK_SIZE)


@pytest.mark.parametrize("tau", [0.0, pytest.param(TAU, marks=pytest.mark.slow)])
def test_batched_rows_decode_as_alone(pairs, tau, monkeypatch):
    """Rows joining at different rounds, with different pending context rows
    (left-padded into the context caches) and positions: greedy rows equal plain
    decoding, seeded sampled rows their lone runs, auto rows too. With the cut,
    rows whose blocks were cut to different lengths verify together."""
    model = pairs(tau=tau)
    seen = recorded_cuts(model, monkeypatch) if tau else []
    assert_rows_decode_as_alone(model)
    assert not tau or any(len(set(ls)) > 1 for _, ls in seen), seen


def assert_rows_decode_as_alone(model):
    """Rows joining at different rounds: greedy rows (k = gamma) equal plain
    decoding, seeded sampled rows and auto rows their lone runs."""
    from mlx_mtp.batch import Batch

    from .test_batch import drive

    prompts = [[5, 17, 30], list(range(10, 40)), [9, 8], list(range(40, 51))]
    for opts in (
        HEADS.replace(num_draft_tokens=model.drafter.block_size, max_tokens=30),
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


@pytest.mark.slow
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
    t = write_qwen3_target(tmp_path / "t", vocab_size=512, predictable=True)
    assert_served_as_plain(t, write_dspark(tmp_path / "d", t, predictable=True))


def assert_served_as_plain(t, d):
    """``serve --model t --draft-model d``: a request drafts whole blocks, and its
    text is plain decoding's."""
    import openai

    from mlx_mtp.generate import generate as mtp_generate
    from mlx_mtp.loading import load
    from mlx_mtp.server import Server, server_args

    model, tokenizer = load(str(t), draft_model=str(d))
    server = Server(server_args(model=str(t), draft_model=str(d), port=0)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        r = client.completions.create(
            model="default_model",
            prompt="def f(x):",
            max_tokens=12,
            extra_body={"num_draft_tokens": model.drafter.block_size},
        )
    finally:
        server.close()
    want = mtp_generate(
        model, tokenizer, "def f(x):", max_tokens=12, num_draft_tokens=0
    )
    assert r.choices[0].text == want
    assert r.model_extra["mtp"]["drafted"] > 0

"""Draft vocabularies for native heads: the ranking, its storage and cache, the choice
`-k auto` makes, greedy identity on every fixture family, and sampling exactness."""

import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp.round as rounds
from mlx_mtp import draft_vocab
from mlx_mtp.draft_length import AdaptiveLength, Coverage, RoundCosts
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load, load_model
from mlx_mtp.sampling import filtered_logprobs
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing.fixtures import FAMILIES

from .test_greedy import PROMPTS, plain_greedy
from .test_lookup import REPEATING
from .test_sampling import VOCAB, sampling_after_prompt_fails


@pytest.fixture(autouse=True)
def _short_calibration(monkeypatch):
    """The first 512 calibration tokens: enough to rank a 512-token fixture."""
    monkeypatch.setattr(draft_vocab, "MAX_CALIBRATION_TOKENS", 512)


def numpy_ranking(model, ids, context):
    """Expected next-token counts in float64, window by window."""
    total = 0.0
    for start in range(0, len(ids), context):
        x = mx.array(ids[start : start + context])[None]
        logits = np.array(model.logits(model.hidden(x))[0], dtype=np.float64)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        total = total + (p / p.sum(axis=-1, keepdims=True)).sum(axis=0)
    return total / total.sum()


def test_ranking_is_the_expected_next_token_mass(loaded):
    model, tokenizer = loaded("deepseek_v3")
    ids = draft_vocab.calibration_ids(tokenizer)
    assert len(ids) == 512
    ranking = draft_vocab.rank_tokens(model, ids, context=200, rows=64)
    mass = numpy_ranking(model, ids, 200)
    assert np.allclose(ranking.mass, mass[ranking.order], atol=1e-6)
    assert np.all(np.diff(ranking.mass) <= 0)
    assert sorted(ranking.order.tolist()) == list(range(model.args.vocab_size))
    assert ranking.coverage(model.args.vocab_size) == pytest.approx(1.0, abs=1e-5)
    assert ranking.coverage(10) == pytest.approx(mass[ranking.order[:10]].sum())
    rows = np.array(ranking.rows(10))
    assert np.array_equal(rows, np.sort(ranking.order[:10]))


def test_equal_mass_keeps_id_order():
    class Flat:  # every token equally expected: the ranking is the id order
        class args:
            vocab_size = 8

        def make_trunk_cache(self):
            return None

        def hidden(self, x, cache=None):
            return mx.zeros((*x.shape, 2))

        def logits(self, h):
            return mx.zeros((*h.shape[:-1], 8))

    ranking = draft_vocab.rank_tokens(Flat(), [1, 2, 3, 4])
    assert ranking.order.tolist() == list(range(8))


def test_ranking_is_computed_once_and_cached(checkpoint, monkeypatch):
    path = checkpoint("glm4_moe", predictable=True)
    model = load_model(str(path))[0]
    first = draft_vocab.ranking_for(model)
    assert first is not None and model.vocab_ranking is first
    calls = []
    monkeypatch.setattr(
        draft_vocab, "rank_tokens", lambda *a, **k: calls.append(1) or first
    )
    again = load_model(str(path))[0]  # a new process would find it on disk
    second = draft_vocab.ranking_for(again)
    assert not calls and np.array_equal(second.order, first.order)


def test_bad_ranking_files_are_refused(tmp_path):
    ranking = draft_vocab.Ranking(np.arange(8, dtype=np.int32), np.full(8, 0.125))
    path = tmp_path / draft_vocab.FILE
    draft_vocab.save_ranking(path, ranking)
    assert draft_vocab.load_ranking(path, 8).order.tolist() == list(range(8))
    with pytest.raises(MTPError, match="not a draft vocabulary of this model's 16"):
        draft_vocab.load_ranking(path, 16)
    mx.save_safetensors(
        str(path), {"order": mx.array([0, 0, 1]), "mass": mx.ones((3,))}
    )
    with pytest.raises(MTPError, match="not a draft vocabulary"):
        draft_vocab.load_ranking(path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(MTPError):
        draft_vocab.load_ranking(path)


def test_draft_vocab_values():
    assert draft_vocab.parse("auto") == "auto" and draft_vocab.parse("full") == "full"
    assert draft_vocab.parse("4096") == 4096 and draft_vocab.parse(12) == 12
    for bad in ("0", "-3", "most", 2.5, None):
        with pytest.raises(MTPError, match="draft_vocab must be"):
            draft_vocab.parse(bad)
    assert draft_vocab.auto_sizes(32768) == [2048, 4096, 8192]


def test_drafts_come_from_the_rows(loaded):
    """Every draft token is among the n most expected; its logits are the head's."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    ranking = draft_vocab.ranking_for(model)
    h = model.hidden(mx.array(tokenizer.encode(PROMPTS[0]))[None])[:, -1]
    full = model.draft_logits(h)
    for n in (1, 17, 128):
        logits = np.array(model.draft_logits(h, n))[0]
        rows = np.array(ranking.rows(n))
        assert np.isfinite(logits[rows]).all()
        assert np.isinf(np.delete(logits, rows)).all()
        assert np.allclose(logits[rows], np.array(full)[0, rows], atol=1e-5)
    assert mx.array_equal(model.draft_logits(h, model.args.vocab_size), full).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_draft_vocabularies(family, loaded):
    """Drafts from an eighth of the vocabulary, with k fixed and k chosen each round,
    with lookup drafts too: the same tokens as plain decoding."""
    model, tokenizer = loaded(family, predictable=True)
    n = model.args.vocab_size // 8
    for prompt, k, source in ((PROMPTS[0], 3, "heads"), (REPEATING, "auto", "auto")):
        ids = tokenizer.encode(prompt)
        expected = plain_greedy(model, ids, 40)
        steps = list(
            mtp_generate_step(
                ids,
                model,
                num_draft_tokens=k,
                max_tokens=40,
                draft_vocab=n,
                draft_source=source,
            )
        )
        assert [o.token for o in steps] == expected, (family, k)
        stats = steps[-1].stats
        assert set(stats.drafted_by_vocab) <= {str(n)}, stats.drafted_by_vocab
    assert stats.drafted_by_vocab or stats.drafted_by_source.get("lookup")


def test_auto_vocab_drafts_from_a_cheap_vocabulary_that_covers_the_output(loaded):
    """With a ranking that covers what the model emits and draft steps that cost far
    less from few rows, auto drafts from them; the tokens stay exact."""
    model, tokenizer = loaded("deepseek_v3", predictable=True)
    ids = tokenizer.encode(PROMPTS[1])
    expected = plain_greedy(model, ids, 48)
    V = model.args.vocab_size
    mass = np.full(V, 1e-6)
    mass[np.unique(ids + expected)] = 1.0  # what this run emits, first
    order = np.lexsort((np.arange(V), -mass)).astype(np.int32)
    saved = model.vocab_ranking, model.round_costs
    try:
        model.vocab_ranking = draft_vocab.Ranking(order, (mass / mass.sum())[order])
        sizes = draft_vocab.auto_sizes(V)
        model.round_costs = RoundCosts(
            [1.0, 1.05, 1.1, 1.15, 1.2], 0.5, {n: 0.02 for n in sizes}
        )
        steps = list(
            mtp_generate_step(
                ids,
                model,
                num_draft_tokens=2,
                max_tokens=48,
                draft_vocab="auto",
                draft_source="heads",
            )
        )
    finally:
        model.vocab_ranking, model.round_costs = saved
    assert [o.token for o in steps] == expected
    used = steps[-1].stats.drafted_by_vocab
    assert "full" not in used and sum(used.values()) > 0, used


def test_auto_weighs_coverage_against_cost():
    ranking = draft_vocab.Ranking(
        np.arange(1000, dtype=np.int32), np.full(1000, 1e-3, dtype=np.float32)
    )
    costs = RoundCosts([1.0, 1.05, 1.1, 1.15], 0.3, {100: 0.05, 500: 0.1})
    cover = Coverage(ranking, [100, 500], prior=4.0)
    policy = AdaptiveLength(
        costs, [0, 1, 2, 3], vocabs=[None, 100, 500], coverage=cover
    )
    for _ in range(30):  # the heads are good; the output is all in the first 100
        cover.observe(list(range(10)))
        policy.observe(3, 3)
    assert policy.next() == 3 and policy.vocab == 100
    blamed = AdaptiveLength(costs, [0, 1, 2, 3])
    for _ in range(300):  # the output moves past the first 500 tokens
        cover.observe([900, 950])
        policy.observe(3, 0, missed=True)
        blamed.observe(3, 0)
    policy.next()
    assert policy.vocab is None  # only the full head still drafts the output
    # misses outside the rows do not count against the heads (the estimate fades
    # back to the prior), misses inside them do
    assert policy.alphas()[0] > 0.5 and blamed.alphas()[0] < 0.1


def test_refusals(loaded, small):
    model, _ = loaded("deepseek_v3")
    for bad, match in ((0, "draft_vocab must be"), ("some", "draft_vocab must be")):
        with pytest.raises(MTPError, match=match):
            list(
                mtp_generate_step(
                    [1, 2, 3],
                    model,
                    max_tokens=2,
                    draft_vocab=bad,
                    draft_source="heads",
                )
            )
    with pytest.raises(MTPError, match="no draft vocabulary and no tokenizer"):
        list(
            mtp_generate_step(
                [1, 2, 3], small, max_tokens=2, draft_vocab=4, draft_source="heads"
            )
        )


@pytest.fixture(scope="module")
def small(checkpoint):
    """A 16-token model without a tokenizer; its ranking set by hand."""
    path = checkpoint("mimo", vocab_size=VOCAB, tokenizer=False, seed=1)
    return load_model(str(path))[0]


@pytest.fixture
def ranked(small):
    ids = np.random.default_rng(0).integers(0, VOCAB, 96).tolist()
    small.vocab_ranking = draft_vocab.rank_tokens(small, ids)
    yield small
    small.vocab_ranking = None


PROMPT = [3, 7, 5, 3, 7]


@pytest.mark.parametrize("k, source", [(2, "heads"), (2, "auto")])
def test_sampling_with_a_draft_vocabulary_is_exact(ranked, k, source):
    assert not sampling_after_prompt_fails(
        ranked, PROMPT, VOCAB, k, draft_vocab=4, draft_source=source, lookup_tokens=3
    )


def test_sampling_test_catches_a_draft_reported_as_unrestricted(ranked, monkeypatch):
    """Negative control: drafts sampled from the rows but reported with the rows'
    restriction forgotten (the other tokens at logit 0) are accepted too often."""
    real = rounds._pick

    def forgetful(runs, logits, keys):
        tokens, q = real(runs, logits, keys)
        if q is None:
            return tokens, q
        whole = mx.where(mx.isinf(logits), 0.0, logits)  # (B, V)
        return tokens, [
            None if x is None else filtered_logprobs(whole[b : b + 1], r.params)
            for b, (x, r) in enumerate(zip(q, runs))
        ]

    monkeypatch.setattr(rounds, "_pick", forgetful)
    assert sampling_after_prompt_fails(ranked, PROMPT, VOCAB, 2, draft_vocab=4)


def test_convert_graft_and_quantization_keep_the_ranking(checkpoint, tmp_path):
    """convert (float, and 4-bit trunk with 8-bit heads) and graft store the ranking;
    loading reads it back (no ranking on first use); --no-rank-vocab stores none."""
    from mlx_mtp.convert import convert, graft_heads

    src = checkpoint("qwen3_5", predictable=True)
    for name, options in (
        ("float", {}),
        ("q4", {"quantize": True, "q_group_size": 32}),
    ):
        out = tmp_path / name
        convert(str(src), str(out), progress=False, **options)
        entry = json.loads((out / "config.json").read_text())["mtp"]["draft_vocab"]
        assert entry["file"] == draft_vocab.FILE and entry["calibration_tokens"] == 512
        model, tokenizer = load(str(out))
        stored = draft_vocab.load_ranking(out / draft_vocab.FILE)
        assert np.array_equal(model.vocab_ranking.order, stored.order)
        fresh = draft_vocab.rank_tokens(model, draft_vocab.calibration_ids(tokenizer))
        assert np.allclose(fresh.mass, stored.mass, atol=1e-6)
        ids = tokenizer.encode(PROMPTS[2])
        steps = mtp_generate_step(
            ids,
            model,
            num_draft_tokens=2,
            max_tokens=24,
            draft_vocab=64,
            draft_source="heads",
        )
        assert [o.token for o in steps] == plain_greedy(model, ids, 24)
    bare = tmp_path / "bare"
    convert(str(src), str(bare), progress=False, rank_vocab=False)
    assert "draft_vocab" not in json.loads((bare / "config.json").read_text())["mtp"]
    trunk_only = tmp_path / "trunk"
    convert(str(src), str(trunk_only), progress=False)
    config = json.loads((trunk_only / "config.json").read_text())
    for f in ("mtp.safetensors", draft_vocab.FILE):
        (trunk_only / f).unlink()
    del config["mtp"]
    (trunk_only / "config.json").write_text(json.dumps(config))
    graft_heads(str(src), str(trunk_only))
    entry = json.loads((trunk_only / "config.json").read_text())["mtp"]["draft_vocab"]
    assert (trunk_only / entry["file"]).is_file()
    assert load(str(trunk_only))[0].vocab_ranking is not None


def test_cli_and_server_options(checkpoint):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    path = str(checkpoint("deepseek_v3", predictable=True))
    args = ["generate", "--model", path, "-p", "The quick brown fox"]
    args += ["-m", "24", "--ignore-chat-template", "--temp", "0"]
    plain = CliRunner().invoke(main, args + ["-k", "0", "--quiet"])
    small = CliRunner().invoke(main, args + ["-k", "2", "--draft-vocab", "64"])
    assert plain.exit_code == 0 and small.exit_code == 0, small.output
    assert small.output.startswith(plain.output.strip())
    assert "draft vocab 64" in small.output
    bad = CliRunner().invoke(main, args + ["--draft-vocab", "lots"])
    assert bad.exit_code == 2 and "'lots' is not 'auto', 'full'" in bad.output

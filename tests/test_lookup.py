"""Drafts from the context (prompt lookup): the continuation finder, greedy identity on
every fixture family, and sampling exactness with a point-mass draft distribution."""

import mlx.core as mx
import pytest

import mlx_mtp.round as rounds
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.lookup import continuation
from mlx_mtp.rejection import accept_stochastic
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing.fixtures import FAMILIES

from .test_greedy import plain_greedy
from .test_sampling import VOCAB, sampling_after_prompt_fails

REPEATING = "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return"


def test_continuation_takes_the_latest_occurrence_of_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3]
    assert continuation(tokens, 4) == [8, 2, 3]  # "2 3" last seen at 5, then 8 2 3
    assert continuation(tokens, 1) == [8]
    assert continuation(tokens + [8], 3) == [2, 3, 8]  # "2 3 8" at 5, then 2 3 8
    assert continuation([1, 2, 3, 4], 3) == []  # no suffix seen before
    assert continuation([5, 5, 5, 5], 2) == [5]  # ends where the tokens end
    assert continuation([1, 2, 1, 2], 0) == []


def test_longer_suffixes_win():
    # "4 2 3" occurred once (then 7); "2 3" more recently (then 5)
    tokens = [4, 2, 3, 7, 0, 2, 3, 5, 0, 4, 2, 3]
    assert continuation(tokens, 2, max_ngram=3) == [7, 0]
    assert continuation(tokens, 2, max_ngram=2) == [5, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_lookup_drafts(family, loaded):
    """Lookup drafts alone (k = 0 for the heads) and mixed with the heads' drafts (the
    heads draft in rounds where the context has no continuation): the same tokens as
    plain decoding, and both sources were used."""
    model, tokenizer = loaded(family, predictable=True)
    ids = tokenizer.encode(REPEATING)
    expected = plain_greedy(model, ids, 40)
    used = {}
    for k in (0, 2):
        steps = list(
            mtp_generate_step(
                ids,
                model,
                num_draft_tokens=k,
                max_tokens=40,
                draft_source="lookup",
                draft_vocab=None,
            )
        )
        assert [o.token for o in steps] == expected, (family, k)
        for source, n in steps[-1].stats.drafted_by_source.items():
            used[source] = used.get(source, 0) + n
    assert used.get("lookup") and used.get("heads"), used


@pytest.fixture(scope="module")
def small(checkpoint):
    path = checkpoint("mimo", vocab_size=VOCAB, tokenizer=False, seed=1)
    return load_model(str(path))[0]


PROMPT = [3, 7, 5, 3, 7]  # "3 7" occurred before: a lookup drafts 5 3 7


@pytest.mark.parametrize("k", [0, 2])
def test_sampling_with_lookup_drafts_is_exact(small, k):
    assert not sampling_after_prompt_fails(
        small, PROMPT, VOCAB, k, draft_source="lookup", lookup_tokens=3
    )


def test_sampling_test_catches_a_lookup_draft_scored_as_uniform(small, monkeypatch):
    """Negative control: a lookup draft whose distribution is taken as uniform (not a
    point mass) is accepted too often, and the same test fails."""

    def uniform(tokens, target, key):
        V = target.shape[-1]
        q = mx.full((tokens.shape[0], V), -mx.log(mx.array(V)))
        return accept_stochastic(tokens, q, target, key)

    monkeypatch.setattr(rounds, "accept_point_mass", uniform)
    assert sampling_after_prompt_fails(
        small, PROMPT, VOCAB, 0, draft_source="lookup", lookup_tokens=3
    )


def test_bad_lookup_options_are_refused(small):
    with pytest.raises(MTPError, match="draft_source must be one of heads, lookup"):
        list(
            mtp_generate_step(
                [1, 2], small, draft_source="ngram", max_tokens=2, draft_vocab=None
            )
        )
    with pytest.raises(MTPError, match="lookup_tokens must be from 1 to 16"):
        list(
            mtp_generate_step(
                [1, 2], small, draft_source="lookup", lookup_tokens=0, draft_vocab=None
            )
        )


def test_cli_generate_with_lookup_drafts(checkpoint):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    path = str(checkpoint("deepseek_v3", predictable=True))
    args = ["generate", "--model", path, "-p", REPEATING.replace("\n", "\\n")]
    args += ["-m", "24", "--ignore-chat-template", "--temp", "0"]
    plain = CliRunner().invoke(main, args + ["-k", "0", "--quiet"])
    lookup = CliRunner().invoke(
        main, args + ["-k", "2", "--draft-source", "lookup", "--verbose"]
    )
    assert plain.exit_code == 0 and lookup.exit_code == 0, lookup.output
    assert lookup.output.startswith(plain.output.strip())
    assert "by source heads" in lookup.output and "lookup" in lookup.output


def test_auto_source_follows_measured_acceptance():
    """Lookup drafts while they are accepted, the heads (or nothing) once they are
    not; the lookup length grows with the acceptance seen."""
    from mlx_mtp.draft_length import RoundCosts, SourceChoice

    costs = RoundCosts([1.0 + 0.05 * n for n in range(9)], 0.1)
    choice = SourceChoice(costs, max_heads=2, max_lookup=8)
    for _ in range(20):
        choice.observe("lookup", 8, 8)  # every lookup draft accepted
        choice.observe("heads", 2, 0)
    assert choice.lookup_length(8, 2) == 8
    assert choice.lookup_length(3, 2) == 3
    for _ in range(40):
        choice.observe("lookup", 8, 0)  # none accepted
        choice.observe("heads", 2, 2)
    assert choice.lookup_length(8, 2) == 0


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "nemotron_h"])
def test_greedy_identity_with_auto_source(family, loaded):
    model, tokenizer = loaded(family, predictable=True)
    ids = tokenizer.encode(REPEATING)
    expected = plain_greedy(model, ids, 40)
    for k in (2, "auto"):
        steps = mtp_generate_step(
            ids,
            model,
            num_draft_tokens=k,
            max_tokens=40,
            draft_source="auto",
            draft_vocab=None,
        )
        assert [o.token for o in steps] == expected, (family, k)


def test_sampling_with_auto_source_is_exact(small):
    assert not sampling_after_prompt_fails(
        small, PROMPT, VOCAB, 2, draft_source="auto", lookup_tokens=3
    )

"""Logits processors under drafting: greedy MTP decoding with penalties and logit bias
emits exactly mlx-lm's ``generate_step`` with the same processors, from every draft
source; MTP sampling with them follows the processed target distribution (a
chi-square test whose negative control, processors blind to the drafts, fails)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.processors import Rules
from mlx_mtp.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from tests.test_sampling import VOCAB, chi_square_rejects

PENALTIES = dict(
    repetition_penalty=1.6,
    repetition_context_size=6,
    presence_penalty=0.8,
    frequency_penalty=0.5,
    frequency_context_size=12,
    logit_bias={5: 2.0, 17: -1.5, 40: 1.0},
)


def processors(options: dict):
    """mlx-lm's processors for ``options`` (the names `DecodeOptions` takes)."""
    return make_logits_processors(
        options.get("logit_bias"),
        options.get("repetition_penalty"),
        options.get("repetition_context_size", 20),
        options.get("presence_penalty"),
        options.get("presence_context_size", 20),
        options.get("frequency_penalty"),
        options.get("frequency_context_size", 20),
    )


def plain(model, ids, n, options):
    steps = generate_step(
        mx.array(ids), model.trunk, max_tokens=n, logits_processors=processors(options)
    )
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_greedy_with_penalties_equals_mlx_lm(family, loaded):
    """k = 0..4 from the heads, lookup drafts and a draft vocabulary: the tokens of
    mlx-lm's generate_step with the same processors (which differ from the
    unprocessed ones), and the drafts are accepted."""
    model, tokenizer = loaded(family, predictable=True)
    ids = tokenizer.encode("def forward(self, x): a b a b a b")
    expected = plain(model, ids, 40, PENALTIES)
    assert expected != plain(model, ids, 40, {})
    runs = [dict(num_draft_tokens=k, draft_source="heads") for k in range(5)]
    runs += [
        dict(num_draft_tokens=2, draft_source="lookup"),
        dict(num_draft_tokens=3, draft_source="heads", draft_vocab=64),
    ]
    for run in runs:
        outs = list(
            mtp_generate_step(ids, model, HEADS, max_tokens=40, **run, **PENALTIES)
        )
        assert [o.token for o in outs] == expected, run
        if run["num_draft_tokens"] > 1 and run["draft_source"] == "heads":
            assert outs[-1].stats.accepted > 0, run


def test_logprobs_are_the_processed_ones(loaded):
    """Each step's log-probabilities are the processed distribution's (as mlx-lm's
    generate_step yields them), drafted or not."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    ids = tokenizer.encode("The quick brown fox")
    steps = generate_step(
        mx.array(ids),
        model.trunk,
        max_tokens=12,
        logits_processors=processors(PENALTIES),
    )
    want = [lp for _, lp in steps]
    outs = list(
        mtp_generate_step(
            ids, model, HEADS, num_draft_tokens=3, max_tokens=12, **PENALTIES
        )
    )
    assert any(o.from_draft for o in outs)
    for o, lp in zip(outs, want):
        assert mx.allclose(o.logprobs, lp, atol=1e-4).item()


def test_bad_processor_options_are_refused(loaded):
    model, tokenizer = loaded("qwen3_5")
    bad = [
        dict(repetition_penalty=-1.0),
        dict(presence_penalty=float("nan")),
        dict(frequency_context_size=0),
        dict(logit_bias={"a": 1.0}),
        dict(logit_bias={1: "x"}),
        dict(logit_bias={10**6: 1.0}),
        dict(logits_processors=[3]),
    ]
    for options in bad:
        with pytest.raises(MTPError):
            list(mtp_generate_step([1, 2], model, max_tokens=2, **options))


PROMPT = [3, 3, 7]
SAMPLED = dict(repetition_penalty=3.0, presence_penalty=1.5, logit_bias={2: 1.5})


def exact_processed(model, params, options):
    """Exact distributions of plain sampling with the processors: (V, V) joint of
    the first two tokens and (V,) marginal of the third."""
    procs = processors(options)

    def probs(prefixes):
        logits = model(mx.array(prefixes))[:, -1]  # (N, V)
        rows = []
        for prefix, row in zip(prefixes, logits):
            row = row[None]
            for p in procs:
                row = p(mx.array(prefix), row)
            rows.append(row)
        return np.array(mx.exp(filtered_logprobs(mx.concatenate(rows), params)))

    p1 = probs([PROMPT])[0]
    p2 = probs([PROMPT + [a] for a in range(VOCAB)])  # (V, V)
    pairs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3 = probs(pairs).reshape(VOCAB, VOCAB, VOCAB)
    joint = p1[:, None] * p2
    return joint, (joint[..., None] * p3).sum(axis=(0, 1))


def sampling_fails(model, params, k, n=500) -> bool:
    joint, third = exact_processed(model, params, SAMPLED)
    tokens = np.zeros((n, 3), dtype=np.int64)
    for seed in range(n):
        steps = mtp_generate_step(
            PROMPT,
            model,
            HEADS,
            num_draft_tokens=k,
            draft_source="heads",
            temp=params.temp,
            top_k=params.top_k,
            max_tokens=3,
            seed=seed,
            **SAMPLED,
        )
        tokens[seed] = [o.token for o in steps]
    pairs = np.zeros((VOCAB, VOCAB))
    np.add.at(pairs, (tokens[:, 0], tokens[:, 1]), 1)
    thirds = np.bincount(tokens[:, 2], minlength=VOCAB)
    # and a repeat, what the penalties act on: two outcomes, a repeat or not
    repeats = (tokens[:, 0] == tokens[:, 1]).sum()
    p_repeat = np.trace(joint)
    return (
        chi_square_rejects(pairs, joint)
        or chi_square_rejects(thirds, third)
        or chi_square_rejects(
            np.array([repeats, n - repeats]), np.array([p_repeat, 1 - p_repeat])
        )
    )


@pytest.fixture(scope="module")
def tiny(checkpoint):
    return load_model(str(checkpoint("mimo", vocab_size=VOCAB, tokenizer=False)))[0]


def test_sampling_with_processors_matches_the_processed_target(tiny):
    assert not sampling_fails(tiny, SamplingParams(temp=1.0), 2)


@pytest.mark.slow
def test_processors_blind_to_the_drafts_fail_the_test(tiny, monkeypatch):
    """Negative control: rows processed with the committed tokens only (a second
    token repeats the first about 9% of the time instead of 1.5%)."""
    monkeypatch.setattr(Rules, "_prefix", lambda self, drafts: self.history)
    assert sampling_fails(tiny, SamplingParams(temp=1.0), 2)


def test_batched_rows_with_their_own_processors_equal_mlx_lm(loaded):
    """Rows with and without processors, from the heads and from lookups, decoded
    together: each row's tokens are mlx-lm's with its own processors."""
    from mlx_mtp.batch import run_batch
    from mlx_mtp.options import DecodeOptions

    model, tokenizer = loaded("qwen3_5", predictable=True)
    texts = ("def forward(self, x):", "The quick brown fox", "a b a b a b a b")
    prompts = [tokenizer.encode(t) for t in texts]
    settings = [
        dict(num_draft_tokens=3, draft_source="heads", **PENALTIES),
        dict(num_draft_tokens=2, draft_source="heads"),
        dict(num_draft_tokens=2, draft_source="lookup", **PENALTIES),
    ]
    options = [DecodeOptions(max_tokens=24, **s) for s in settings]
    got = {i: [] for i in range(len(prompts))}
    for out in run_batch(model, prompts, options):
        got[out.uid] += out.tokens
    for i, (ids, s) in enumerate(zip(prompts, settings)):
        assert got[i] == plain(model, ids, 24, s), i

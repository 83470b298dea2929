"""Sampling exactness of batched rows (`mlx_mtp.batch`): rows drafting different k,
accepting different numbers of drafts in the same round, emit the target's
distribution (the chi-square test of tests/test_sampling.py, with its negative
control)."""

from dataclasses import asdict

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp.round as rounds
from mlx_mtp.batch import Batch
from mlx_mtp.loading import load_model
from mlx_mtp.sampling import SamplingParams
from mlx_mtp.testing import HEADS
from tests.test_sampling import chi_square_rejects, exact_distributions

VOCAB = 16
PROMPT = [3, 7]


@pytest.fixture(scope="module")
def small_hybrid(checkpoint):
    path = checkpoint("qwen3_5", vocab_size=VOCAB, tokenizer=False, seed=1)
    return load_model(str(path))[0]


def batched_first_tokens(model, params, n, wrong=False, monkeypatch=None):
    """(n, 3) first three tokens of n seeded rows decoded in batches of 8, rows
    drafting k = 1, 2 or 3 (different k and acceptance in one round)."""
    out = np.zeros((n, 3), dtype=np.int64)
    for start in range(0, n, 8):
        batch = Batch(model, HEADS.replace(num_draft_tokens=3))
        for seed in range(start, min(n, start + 8)):
            o = HEADS.replace(
                num_draft_tokens=1 + seed % 3, max_tokens=3, seed=seed, **asdict(params)
            )
            batch.join(batch.admit(seed, PROMPT, o))
        got = {}
        while len(batch):
            for r in batch.step():
                got.setdefault(r.uid, []).extend(r.tokens)
        for seed, tokens in got.items():
            out[seed] = tokens[:3]
    return out


def batched_sampling_fails(model, params, n=600) -> bool:
    joint, third = exact_distributions(model, params)
    tokens = batched_first_tokens(model, params, n)
    pairs = np.zeros((VOCAB, VOCAB))
    np.add.at(pairs, (tokens[:, 0], tokens[:, 1]), 1)
    thirds = np.bincount(tokens[:, 2], minlength=VOCAB)
    return chi_square_rejects(pairs, joint) or chi_square_rejects(thirds, third)


def test_batched_sampling_matches_target(small_hybrid):
    assert not batched_sampling_fails(small_hybrid, SamplingParams(temp=1.0, top_k=8))


def test_a_wrong_rule_fails_the_batched_test(small_hybrid, monkeypatch):
    """Negative control: keeping every draft (the draft distribution) is caught."""
    from mlx_mtp.rejection import AcceptResult

    def accept_always(draft_tokens, draft_logprobs, target_logprobs, key):
        k = draft_tokens.shape[0]
        token = mx.random.categorical(target_logprobs[k], key=key)
        return AcceptResult(mx.array(k), token)

    monkeypatch.setattr(rounds, "accept_stochastic", accept_always)
    assert batched_sampling_fails(small_hybrid, SamplingParams(temp=1.0, top_k=8))

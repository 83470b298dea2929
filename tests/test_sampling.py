"""Sampling exactness: MTP sampling emits the target model's distribution.

The statistical test draws the first three tokens many times from a 16-token model and
compares the joint distribution of the first two, and the marginal of the third, with
the exact ones computed from the trunk, by chi-square tests at significance 1e-4.
Negative controls run the same test with wrong acceptance rules and require it to fail,
so the test has the power it claims.
"""

import math
from dataclasses import asdict

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp.round as rounds
from mlx_mtp.draft_length import DraftPolicy
from mlx_mtp.loading import load_model
from mlx_mtp.rejection import AcceptResult, accept_stochastic
from mlx_mtp.sampling import SamplingParams, filtered_logprobs, sample
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

VOCAB = 16
PROMPT = [3, 7]
ALPHA_Z = 3.719  # one-sided normal quantile for significance 1e-4


@pytest.fixture(scope="module")
def small_model(checkpoint):
    path = checkpoint("mimo", vocab_size=VOCAB, tokenizer=False, seed=1)
    return load_model(str(path))[0]


def exact_distributions(model, params):
    """Exact plain-sampling distributions: (V, V) joint of the first two tokens and
    (V,) marginal of the third."""
    logits = model(mx.array([PROMPT + [x] for x in range(VOCAB)]))  # (V, 3, V)
    p1 = np.array(mx.exp(filtered_logprobs(logits[0, -2], params)))
    p2 = np.array(mx.exp(filtered_logprobs(logits[:, -1], params)))  # (V, V)
    pairs = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    logits = model(mx.array(pairs))[:, -1]  # (V * V, V)
    p3 = np.array(mx.exp(filtered_logprobs(logits, params))).reshape(VOCAB, VOCAB, -1)
    joint = p1[:, None] * p2
    return joint, (joint[..., None] * p3).sum(axis=(0, 1))


class Cycle(DraftPolicy):
    """Draft-length policy drafting ks[0], ks[1], ... in turn (a fresh one per run)."""

    def __init__(self, *ks):
        self.ks, self.max_k, self.round = ks, max(ks), 0

    def next(self):
        self.round += 1
        return self.ks[(self.round - 1) % len(self.ks)]


def sample_tokens(model, params, k, n):
    """(n, 3) first three tokens of n seeded MTP runs; the first round drafts k (an
    int, or a tuple of ks drafted in turn)."""
    out = np.zeros((n, 3), dtype=np.int64)
    for seed in range(n):
        policy = Cycle(*k) if isinstance(k, tuple) else None
        steps = mtp_generate_step(
            PROMPT,
            model,
            HEADS,
            num_draft_tokens=policy.max_k if policy else k,
            policy=policy,
            **asdict(params),
            max_tokens=(max(k) if isinstance(k, tuple) else k) + 2,
            seed=seed,
        )
        out[seed] = [o.token for _, o in zip(range(3), steps)]
        steps.close()
    return out


def fails_exactness(model, params, k, n=600) -> bool:
    """True when the first tokens of MTP sampling do not follow the target model."""
    joint, third = exact_distributions(model, params)
    tokens = sample_tokens(model, params, k, n)
    pairs = np.zeros((VOCAB, VOCAB))
    np.add.at(pairs, (tokens[:, 0], tokens[:, 1]), 1)
    thirds = np.bincount(tokens[:, 2], minlength=VOCAB)
    return chi_square_rejects(pairs, joint) or chi_square_rejects(thirds, third)


def sampling_after_prompt_fails(model, prompt, vocab, k, n=600, **options) -> bool:
    """The chi-square test on the first three tokens sampled (temperature 1) after
    ``prompt``, against the model's exact distributions, over a ``vocab``-token
    vocabulary (``options``: more `mtp_generate_step` arguments; the heads draft
    unless they say otherwise)."""
    options = {"draft_source": "heads", "draft_vocab": None, **options}
    V, params = vocab, SamplingParams(temp=1.0)
    first = model(mx.array([prompt + [x] for x in range(V)]))  # (V, L + 1, V)
    p1 = np.array(mx.softmax(first[0, -2]))
    p2 = np.array(mx.softmax(first[:, -1], axis=-1))  # (V, V)
    pairs = [prompt + [a, b] for a in range(V) for b in range(V)]
    p3 = np.array(mx.softmax(model(mx.array(pairs))[:, -1], axis=-1))
    joint = p1[:, None] * p2
    third = (joint[..., None] * p3.reshape(V, V, V)).sum(axis=(0, 1))
    tokens = np.zeros((n, 3), dtype=np.int64)
    for seed in range(n):
        steps = mtp_generate_step(
            prompt,
            model,
            num_draft_tokens=k,
            **asdict(params),
            max_tokens=3,
            seed=seed,
            **options,
        )
        tokens[seed] = [o.token for o in steps]
    counts = np.zeros((V, V))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    thirds = np.bincount(tokens[:, 2], minlength=V)
    return chi_square_rejects(counts, joint) or chi_square_rejects(thirds, third)


def chi_square_rejects(counts, probs) -> bool:
    """Chi-square goodness of fit at 1e-4, pooling cells expected below 5."""
    n = counts.sum()
    expected, observed = probs.ravel() * n, counts.ravel().astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    keep = expected > 0
    if observed[~keep].sum() > 0:
        return True  # sampled a token of probability zero
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = keep.sum() - 1
    # Wilson-Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


CASES = [
    (1, SamplingParams(temp=1.0)),
    (2, SamplingParams(temp=1.0)),
    (3, SamplingParams(temp=0.8, top_p=0.9, top_k=8)),
    (2, SamplingParams(temp=0.7, min_p=0.05)),
    ((0, 2), SamplingParams(temp=1.0)),  # k changes between rounds
    ((0, 0, 2), SamplingParams(temp=1.0, top_k=8)),  # a plain round queued early
]


@pytest.mark.parametrize("k,params", CASES)
def test_mtp_sampling_matches_target(small_model, k, params):
    assert not fails_exactness(small_model, params, k)


@pytest.fixture(scope="module")
def small_hybrid(checkpoint):
    """A 16-token Qwen3.5 (Gated-DeltaNet) model: rejections roll recurrent state
    back."""
    path = checkpoint("qwen3_5", vocab_size=VOCAB, tokenizer=False, seed=1)
    return load_model(str(path))[0]


HYBRID_CASES = [(2, SamplingParams(temp=1.0, top_k=4)), CASES[2]]


@pytest.mark.parametrize("k,params", HYBRID_CASES)
def test_mtp_sampling_matches_target_on_hybrid(small_hybrid, k, params):
    assert not fails_exactness(small_hybrid, params, k)


def accept_always(draft_tokens, draft_logprobs, target_logprobs, key):
    """Wrong rule: keep every draft (emits the draft distribution q)."""
    k = draft_tokens.shape[0]
    return AcceptResult(mx.array(k), sample(target_logprobs[k], key))


def resample_from_target(draft_tokens, draft_logprobs, target_logprobs, key):
    """Wrong rule: correct acceptance, but recover from p instead of
    norm(max(0, p - q))."""
    result = accept_stochastic(draft_tokens, draft_logprobs, target_logprobs, key)
    token = sample(target_logprobs[result.num_accepted], mx.random.split(key)[1])
    return AcceptResult(result.num_accepted, token)


@pytest.mark.parametrize("wrong_rule", [accept_always, resample_from_target])
def test_wrong_rules_fail_the_test(small_model, monkeypatch, wrong_rule):
    monkeypatch.setattr(rounds, "accept_stochastic", wrong_rule)
    assert fails_exactness(small_model, SamplingParams(temp=1.0), 2)


def test_seed_reproducible(small_model):
    params = SamplingParams(temp=1.0, top_k=5)

    def run(seed):
        steps = mtp_generate_step(
            PROMPT,
            small_model,
            HEADS,
            num_draft_tokens=3,
            **asdict(params),
            max_tokens=24,
            seed=seed,
        )
        return [o.token for o in steps]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_rejection_step_on_hand_made_distributions():
    """One draft from q, accepted by the rule: the emitted token is distributed as p."""
    p = mx.array([0.5, 0.3, 0.15, 0.05])
    q = mx.array([0.1, 0.2, 0.3, 0.4])
    target = mx.log(mx.stack([p, mx.array([0.25] * 4)]))  # (k + 1, V), k = 1
    n, counts = 4000, np.zeros(4)
    keys = mx.random.split(mx.random.key(0), 2 * n)
    outs = []
    for i in range(n):
        d = sample(mx.log(q), keys[2 * i])[None]
        r = accept_stochastic(d, mx.log(q)[None], target, keys[2 * i + 1])
        outs.append(mx.where(r.num_accepted == 1, d[0], r.next_token))
    for t in np.array(mx.stack(outs)):
        counts[t] += 1
    assert not chi_square_rejects(counts, np.array(p))
    # Acceptance probability is sum(min(p, q)) = 0.1 + 0.2 + 0.15 + 0.05 = 0.5.


def test_rejection_residual_and_bonus():
    """Identical p and q always accept; the bonus token comes from the last row."""
    p = mx.log(mx.array([[0.7, 0.2, 0.1], [0.0, 0.0, 1.0]]))
    r = accept_stochastic(mx.array([0]), p[:1], p, mx.random.key(1))
    assert r.num_accepted.item() == 1 and r.next_token.item() == 2
    # q puts all mass on a token p never emits: always rejected, recovered from p
    q = mx.log(mx.array([[0.0, 0.0, 1.0]]))
    target = mx.log(mx.array([[0.5, 0.5, 0.0], [1 / 3] * 3]))
    for seed in range(20):
        r = accept_stochastic(mx.array([2]), q, target, mx.random.key(seed))
        assert r.num_accepted.item() == 0 and r.next_token.item() in (0, 1)


def test_broken_recurrent_rollback_fails_the_test(small_hybrid, monkeypatch):
    """Wrong rollback: recurrent states keep the rejected drafts."""
    from mlx_mtp import cache

    monkeypatch.setattr(cache.RecurrentCache, "mark", lambda self, record=True: None)
    monkeypatch.setattr(cache.RecurrentCache, "rewind", lambda self, mark, n: None)
    k, params = HYBRID_CASES[0]
    assert fails_exactness(small_hybrid, params, k)


@pytest.mark.parametrize(
    "family",
    [
        "glm4_moe_lite",
        "nemotron_h",
        "step3p5",
        "step3p7",
        "mimo_v2_flash",
        "deepseek_v32",
        "deepseek_v4",
        "hy_v4",
        "glm5_next",
        "qwen4_exp",
    ],
)
def test_mtp_sampling_matches_target_on_new_families(checkpoint, family):
    """Each family added after the first six: one sampled case (MLA + MoE heads for
    GLM-4.7-Flash; a two-sub-layer step on a Mamba-2 trunk for Nemotron-H; two layers,
    one sliding, for Step-3.5; sliding layers with attention sinks for MiMo-V2-Flash;
    compressed attention, hyper-connections and a packed MTP state for DeepSeek-V4;
    hyper-connections, gated MLA with sinks and shared indexers for Hy4; KDA, pooled
    indexers and hyper-connections for GLM-5.3-Flash; delta nets, an n-gram
    embedding, QSA and hyper-connection streams for Qwen3.8-Flash-Next).
    """
    path = checkpoint(family, vocab_size=VOCAB, tokenizer=False, seed=1)
    model = load_model(str(path))[0]
    assert not fails_exactness(model, SamplingParams(temp=1.0), 2)

"""Draft-length policies: the adaptive choice of k, and exactness whatever k each round
drafts (greedy token for token; sampling in test_sampling.py)."""

import random

import pytest

import mlx_mtp.draft_length as draft_length
from mlx_mtp.draft_length import (
    AdaptiveLength,
    DraftPolicy,
    RoundCosts,
    Unverified,
    model_costs,
)
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.resolve import draft_policy
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import NUM_TOKENS, PROMPTS, plain_greedy

# verify cost grows 10 % per token, a draft step costs 5 % of a decode step
CHEAP = RoundCosts([1.0, 1.1, 1.2, 1.3, 1.4], 0.05)


def test_expected_tokens_and_choice():
    policy = AdaptiveLength(CHEAP, range(5), prior=0.5)
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)
    for _ in range(200):
        policy.observe(4, 4)  # every draft accepted
    assert policy.alphas()[0] > 0.9 and policy.best() == 4
    for _ in range(200):
        policy.observe(4, 0)  # nothing accepted: forgotten, then k = 0
    assert policy.alphas()[0] < 0.1 and policy.best() == 0


def test_costly_verify_means_short_drafts():
    """A verify that costs as much as plain decoding per token never pays; with a cheap
    one, k grows with acceptance (E(k) / cost(k) worked out by hand)."""
    compute_bound = RoundCosts([1.0, 2.0, 3.0, 4.0, 5.0], 0.3)
    for costs, alpha, expected in (
        (compute_bound, 0.9, 0),
        (CHEAP, 0.3, 1),  # 1.3 / 1.15 = 1.13 > 1.39 / 1.3 = 1.07
        (CHEAP, 0.6, 2),  # 1.96 / 1.3 = 1.51 > 2.18 / 1.45 = 1.50
        (CHEAP, 0.8, 4),  # 3.36 / 1.6 = 2.10 > 2.95 / 1.45 = 2.03
    ):
        assert AdaptiveLength(costs, range(5), prior=alpha).best() == expected


def test_probes_when_drafting_does_not_pay():
    policy = AdaptiveLength(CHEAP, [0, 2, 3], probe_every=8)
    for _ in range(100):
        policy.observe(2, 0)
    ks = [policy.next() for _ in range(120)]
    assert set(ks) == {0, 2}
    # every 8, 16, 32, 64 rounds: each probe found that drafting still did not pay
    assert [i for i, k in enumerate(ks) if k] == [7, 23, 55, 119]


def test_probe_interval_is_reset_once_drafting_pays():
    policy = AdaptiveLength(CHEAP, [0, 2, 3], probe_every=8)
    for _ in range(100):
        policy.observe(2, 0)
    ks = [policy.next() for _ in range(24)]
    assert [i for i, k in enumerate(ks) if k] == [7, 23]
    for _ in range(100):
        policy.observe(2, 2)  # acceptance is back: drafting pays
    assert policy.next() > 0
    for _ in range(100):
        policy.observe(2, 0)  # and gone again: probes every 8 rounds at first
    ks = [policy.next() for _ in range(8)]
    assert [i for i, k in enumerate(ks) if k] == [7]


# a small model's costs (the synthetic 300M model's, measured): a draft step costs a
# fifth of a decode step, a verify pass little more per token
SMALL = RoundCosts([1.0, 1.02, 1.08, 1.05, 1.12], 0.21)


def simulate(policy, conditional, rounds: int, seed: int = 0):
    """Drive ``policy`` for ``rounds`` rounds against drafts accepted at position j
    with probability ``conditional[j]`` once the ones before were; its ks and its
    tokens per unit of cost (`SMALL`) over the second half."""
    rng, ks, tokens, cost = random.Random(seed), [], 0.0, 0.0
    for i in range(rounds):
        k = policy.next()
        accepted = 0
        while accepted < k and rng.random() < conditional[accepted]:
            accepted += 1
        policy.observe(k, accepted)
        ks.append(k)
        if i >= rounds // 2:
            tokens, cost = tokens + 1 + accepted, cost + SMALL.round(k)
    return ks, tokens / cost


def test_a_deeper_draft_that_pays_is_found(monkeypatch):
    """The second position is accepted far more often than the first (0.95 after
    0.45): k = 2 pays (1.88 / 1.50 = 1.25 against 1.45 / 1.23 = 1.18), but a
    policy that never drafts it leans on the first position's 0.45 and stays at
    k = 1. Probing one position deeper finds it."""
    conditional = [0.45, 0.95, 0.5, 0.5]
    prior = [0.45] * 4  # a history that never drafted past 1
    policy = AdaptiveLength(SMALL, range(5), prior=prior)
    found, rate = simulate(policy, conditional, 1000)
    assert sum(k >= 2 for k in found[500:]) > 150 and policy.alphas()[1] > 0.8
    monkeypatch.setattr(draft_length, "MIN_EVIDENCE", 0.0)  # never probes deeper
    stuck, stuck_rate = simulate(
        AdaptiveLength(SMALL, range(5), prior=prior), conditional, 1000
    )
    assert max(stuck[500:]) == 1
    assert rate > 1.03 * stuck_rate


def test_deeper_probes_stop_once_the_position_is_known():
    """A deeper position that does not pay is probed until it has enough judged
    drafts, then never again: the probes cost a few draft steps in all."""
    ks, _ = simulate(AdaptiveLength(SMALL, range(5), prior=0.6), [0.6, 0.1, 0.1], 600)
    assert 1 <= sum(k >= 2 for k in ks) <= 20
    assert set(ks[300:]) == {1}


def test_policy_for_each_setting(loaded, monkeypatch):
    model, _ = loaded("mimo", predictable=True)  # two MTP layers
    auto = draft_policy(model, "auto", 4)
    assert auto.allowed == [0, 2, 3, 4] and auto.max_k == 4
    costs = model_costs(model, 4)
    # measured up to the longest lookup draft too (what the default options need)
    assert len(costs.verify) == 9 and costs.verify[0] == 1.0 and costs.draft > 0
    assert model_costs(model, 2) is costs  # measured once per model
    again = load_model(str(model.source))[0]  # a new process, say
    monkeypatch.setattr(draft_length, "measure_costs", None)  # must not measure
    assert model_costs(again, 4) == costs
    assert draft_policy(model, 3, 4).next() == 3
    assert draft_policy(model, "auto", 0).max_k == 0
    for bad in (-1, "fast"):
        with pytest.raises(MTPError):
            draft_policy(model, bad, 4)


class RandomLength(DraftPolicy):
    """Test policy: a random allowed k every round."""

    def __init__(self, allowed, seed):
        self.allowed, self.max_k = allowed, max(allowed)
        self.rng = random.Random(seed)
        self.seen = set()

    def next(self):
        k = self.rng.choice(self.allowed)
        self.seen.add(k)
        return k


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "qwen3_5"])
def test_greedy_identity_when_k_changes_every_round(family, loaded):
    """Rounds alternate at random between no draft, the model's depth and more: the
    MTP caches and the trunk's (recurrent ones included) stay exact."""
    model, tokenizer = loaded(family, predictable=True)
    depth = model.num_mtp_layers
    allowed = [0, *range(depth, 5)]
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        policy = RandomLength(allowed, seed=i)
        outs = list(
            mtp_generate_step(ids, model, HEADS, policy=policy, max_tokens=NUM_TOKENS)
        )
        assert [o.token for o in outs] == plain_greedy(model, ids, NUM_TOKENS)
        assert policy.seen == set(allowed)
        stats = outs[-1].stats
        assert sum(stats.rounds_by_k) == stats.rounds and stats.accepted > 0


def test_greedy_identity_auto(loaded):
    model, tokenizer = loaded("deepseek_v3", predictable=True)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        outs = list(mtp_generate_step(ids, model, HEADS, max_tokens=NUM_TOKENS))
        assert [o.token for o in outs] == plain_greedy(model, ids, NUM_TOKENS)


def test_cli_draft_length(checkpoint, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    def cheap(model, max_k, reps=5, context=64, vocabs=()):
        """Costs that make drafting pay whatever the machine's load (a loaded CPU can
        time a verify pass so dear that "auto" rightly never drafts)."""
        return RoundCosts(
            [1.0 + 0.05 * n for n in range(max_k + 1)],
            0.05,
            dict.fromkeys(vocabs, 0.05),
        )

    monkeypatch.setattr(draft_length, "measure_costs", cheap)
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))  # no costs stored: measured
    path = str(checkpoint("deepseek_v3", predictable=True))
    args = ["generate", "--model", path, "-p", "def f(x):", "-m", "16"]
    auto = CliRunner().invoke(main, args)  # -k auto is the default
    assert auto.exit_code == 0, auto.output
    assert "/pass, accepted" in auto.output
    fixed = CliRunner().invoke(main, args + ["-k", "2"])

    def text(result):
        """The generated text: the stats line and the note on ranking the
        vocabulary (the first run's only) left out."""
        lines = result.output.splitlines()[:-1]
        return [line for line in lines if not line.startswith("ranking the vocab")]

    assert text(fixed) == text(auto)
    bad = CliRunner().invoke(main, args + ["-k", "fast"])
    assert bad.exit_code == 2 and "'fast' is not 'auto' or an integer" in bad.output


def test_a_new_measurement_keeps_what_the_stored_one_covered(tmp_path, monkeypatch):
    """Costs measured again for another k or draft vocabulary also cover what the
    stored entry did, so that runs with other options do not re-time each other's
    costs over and over (a server serving many)."""
    from mlx_mtp.testing.fixtures import write_checkpoint

    model = load_model(str(write_checkpoint("deepseek_v3", tmp_path / "m")))[0]
    calls = []

    def measure(model, max_k, reps=5, context=64, vocabs=()):
        calls.append((max_k, list(vocabs)))
        return RoundCosts([1.0] + [1.1] * max_k, 0.1, {v: 0.05 for v in vocabs})

    monkeypatch.setattr(draft_length, "measure_costs", measure)

    def costs(max_k, vocabs):
        model.round_costs = None  # a new process, say: only the file is kept
        return model_costs(model, max_k, vocabs)

    costs(4, [100])
    costs(4, [200])
    costs(12, [200])
    assert calls == [(8, [100]), (8, [100, 200]), (12, [100, 200])]
    assert set(costs(4, [100]).drafts) == {100, 200} and len(calls) == 3


def test_unverified_drafts_are_judged_against_later_tokens():
    """A block's drafts past k wait for the tokens committed after them, across
    rounds, up to their first miss; a token outside the rows drafted from stops a
    block unjudged."""
    everywhere = lambda token, vocab: True  # noqa: E731
    u = Unverified()
    assert u.judge([9, 9], everywhere) == []  # nothing pending
    u.add(2, [5, 6, 7, 8], None)  # k = 2 accepted: drafts 3..6 follow them
    assert u.judge([1, 2, 5], everywhere) == [(2, True)]  # 2 drafts + next token
    assert u.judge([6], everywhere) == [(3, True)]
    u.add(0, [4], None)  # a round that drafted nothing judged: the next one's
    assert u.judge([7, 0], everywhere) == [(4, True), (5, False), (0, False)]
    assert u.pending == []
    u.add(1, [3, 3], 10)  # from a 10-token draft vocabulary
    assert u.judge([1, 42, 3], lambda t, v: t < v) == []  # 42: outside, unjudged
    assert u.pending == []
    u.add(3, [1, 2], None)
    assert u.judge([0, 0, 0, 1], everywhere) == [(3, True)]
    assert u.pending == [(u.committed, 4, [2], None)]

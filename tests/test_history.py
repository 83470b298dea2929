"""The acceptance history `-k auto` starts from (`mlx_mtp.history`): learned from a
model's generations, read back as its prior, left out where it would change a seeded
text, and never a change to greedy output."""

import json

import numpy as np
import pytest

from mlx_mtp import history
from mlx_mtp.draft_length import AdaptiveLength, Coverage, RoundCosts
from mlx_mtp.draft_vocab import Ranking
from mlx_mtp.history import Counts, learn, model_key, parse, priors
from mlx_mtp.options import DecodeOptions
from mlx_mtp.resolve import drafting
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import plain_greedy

CHEAP = RoundCosts([1.0, 1.1, 1.2, 1.3, 1.4], 0.05)
PROMPT = [5, 17, 42, 9, 3, 11, 7, 2]


def run(model, n=24, **options):
    steps = mtp_generate_step(PROMPT, model, HEADS, max_tokens=n, **options)
    return [o.token for o in steps]


def test_counts_lean_cap_and_parse():
    c = Counts([10.0, 2.0], [20.0, 10.0])
    assert c.priors(0.6) == pytest.approx(
        [(10 + 1.2) / 22, (2 + 2 * (10 + 1.2) / 22) / 12]
    )
    big = Counts([300.0, 30.0, 9.0], [1000.0, 300.0, 10.0]).capped(256.0)
    assert big.reached[:2] == pytest.approx([256.0, 256.0])
    assert big.hits[1] / big.reached[1] == pytest.approx(0.1)
    assert (big.hits[2], big.reached[2]) == (9.0, 10.0)  # each position its own


def test_a_deeper_position_is_not_forgotten_through_the_first():
    """Generations that judge 30 drafts at the first position and 2 at the second
    (a probe now and then): the history keeps what the second position did, as its
    own drafts weigh, however many generations ran."""
    total = Counts.empty(2)
    for _ in range(200):
        total = total.add(Counts([15.0, 1.8], [30.0, 2.0])).capped()
    assert total.reached[0] == pytest.approx(256.0)
    assert total.reached[1] == pytest.approx(256.0)  # 400 judged, the last 256 kept
    assert total.priors()[1] == pytest.approx(0.9, abs=0.01)
    assert parse({"heads": {"hits": [1, 2], "reached": [3, 4]}}) is not None
    for bad in (
        [],
        {"heads": {"hits": [5], "reached": [3]}},  # more accepted than judged
        {"heads": {"hits": [1], "reached": [3, 4]}},
        {"heads": {"hits": [float("nan")], "reached": [3]}},
        {"nope": {"hits": [1], "reached": [3]}},
        {"heads": {"hits": [1], "reached": [3], "x": 1}},
    ):
        assert parse(bad) is None


def test_learn_and_read_back(tmp_path):
    learn("m", {"heads": Counts([1.0, 0.0], [10.0, 1.0])})
    learn("m", {"heads": Counts([1.0], [10.0]), "lookup": Counts([9.0], [10.0])})
    assert priors("m", "heads")[0] == pytest.approx((2 + 1.2) / 22)
    assert priors("m", "lookup")[0] == pytest.approx((9 + 1.2) / 12)
    assert priors("other", "heads") is None and priors(None, "heads") is None
    learn("m", {"heads": Counts.empty(3)})  # nothing judged: nothing written
    assert priors("m", "heads")[0] == pytest.approx((2 + 1.2) / 22)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"m": {"heads": 3}}'])
def test_unreadable_history_is_no_history(text):
    history._file().write_text(text)
    assert priors("m", "heads") is None
    learn("m", {"heads": Counts([1.0], [2.0])})  # and is replaced whole
    assert priors("m", "heads") is not None
    json.loads(history._file().read_text())


def test_a_learned_low_acceptance_starts_plain():
    """The constant prior drafts on the first round; the same costs with the history
    of a model whose drafts are rarely accepted decode plainly from the start."""
    assert AdaptiveLength(CHEAP, [0, 1, 2, 3]).next() > 0
    low = Counts([5.0, 0.0, 0.0], [100.0, 5.0, 1.0]).priors()
    assert AdaptiveLength(CHEAP, [0, 1, 2, 3], prior=low).next() == 0


def test_generations_teach_the_next_one(loaded):
    model, _ = loaded("qwen3_5")
    key = model_key(model)
    assert key is not None and priors(key, "heads") is None
    out = run(model, num_draft_tokens="auto")
    assert out == plain_greedy(model, PROMPT, 24)
    learned = priors(key, "heads")
    assert learned is not None
    plan = drafting(model, DecodeOptions(num_draft_tokens="auto"))
    assert plan.history == key and plan.policy.priors == pytest.approx(learned)
    # greedy output does not depend on what was learned
    assert run(model, num_draft_tokens="auto") == out


def test_seeded_sampling_keeps_the_constant_prior(loaded):
    """A seeded sampled text is the same whatever history the model has, as its draws
    depend on its draft lengths; an unseeded one learns."""
    model, _ = loaded("qwen3_5")
    key = model_key(model)
    seeded = dict(num_draft_tokens="auto", temp=1.0, seed=7)
    assert drafting(model, DecodeOptions(**seeded)).history is None
    assert drafting(model, DecodeOptions(temp=1.0)).history == key
    assert drafting(model, DecodeOptions(num_draft_tokens=2)).history is None
    before = run(model, **seeded)
    assert priors(key, "heads") is None  # a seeded run teaches nothing either
    learn(key, {"heads": Counts([0.0] * 3, [500.0, 1.0, 1.0])})
    assert AdaptiveLength(CHEAP, [0, 1], prior=priors(key, "heads")).next() == 0
    assert run(model, **seeded) == before


def test_coverage_starts_from_the_shares_learned():
    """The share of generated tokens inside each draft vocabulary is learned too: a
    model whose output the calibration misrepresents is priced by what it emitted."""
    ranking = Ranking(np.arange(1000, dtype=np.int32), np.ones(1000) / 1000)
    cover = Coverage(ranking, [100, 500])
    cover.observe([5, 50, 150, 600])
    assert cover.seen.hits == [2.0, 3.0] and cover.seen.reached == [4.0, 4.0]
    learn("m", {"vocab": cover.seen})
    assert history.shares("m", [100, 500]) == pytest.approx({100: 0.5, 500: 0.75})
    assert history.shares("m", [100, 500, 900]) is None  # kept for other sizes
    start = history.shares("m", [100, 500])
    assert Coverage(ranking, [100, 500], start=start).share(100) == pytest.approx(0.5)

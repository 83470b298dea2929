"""How close `-k auto` (`mlx_mtp.draft_length.AdaptiveLength`) comes to the best
fixed draft length, without timing noise: rounds are simulated from acceptance
probabilities by position and priced with round costs (in plain decode steps), and
each policy's tokens per unit of cost is compared with every fixed k's.

    python scripts/auto_policy_sim.py                # the built-in scenarios
    python scripts/auto_policy_sim.py --tokens 66    # short replies

A scenario is a model's measured costs (verify over n positions, one draft step)
and its acceptance at each position given the one before was accepted; a reply of
``--tokens`` tokens is decoded ``--replies`` times, each from the same start as a
new generation (the prior: the default, or the scenario's own acceptance as the
model's history would give it). Printed per scenario: each fixed k's rate over
plain decoding, auto's, and auto's share of the best fixed k's (its efficiency).
"""

import argparse
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

from mlx_mtp.draft_length import AdaptiveLength, RoundCosts
from mlx_mtp.history import DEFAULT_PRIOR


@dataclass
class Scenario:
    name: str
    verify: List[float]  # t(n) / t(1), n = 1..
    draft: float  # one draft step / t(1)
    alphas: List[float]  # acceptance at position j given j - 1 accepted


SCENARIOS = [
    # Qwen3.8-Flash-Next's layout, 312M synthetic (docs/benchmarks.md)
    Scenario(
        "qwen4_exp 312M", [1.0, 1.21, 1.41, 1.53, 1.70], 0.35, [0.8, 0.84, 0.63, 0.5]
    ),
    # Qwen3.5 layout, 300M synthetic, single stream (issue 41's analysis)
    Scenario(
        "qwen3_5 300M", [1.0, 1.08, 1.13, 1.17, 1.22], 0.20, [0.7, 0.8, 0.85, 0.85]
    ),
    # the demo's short replies: drafting does not pay
    Scenario(
        "low acceptance", [1.0, 1.08, 1.13, 1.17, 1.22], 0.20, [0.17, 0.3, 0.3, 0.3]
    ),
    # a Mac: verify nearly free, drafts cheap
    Scenario("Mac-like", [1.0, 1.02, 1.04, 1.06, 1.08], 0.06, [0.8, 0.75, 0.7, 0.65]),
    # drafting barely pays
    Scenario("marginal", [1.0, 1.15, 1.3, 1.45, 1.6], 0.3, [0.6, 0.5, 0.4, 0.4]),
]


def accepted(rng: random.Random, alphas: Sequence[float], k: int) -> int:
    a = 0
    while a < k and rng.random() < alphas[a]:
        a += 1
    return a


def run(policy, alphas, costs: RoundCosts, tokens: int, rng) -> float:
    """Tokens per unit of cost of one reply under ``policy``."""
    made, spent = 0, 0.0
    while made < tokens:
        k = min(policy.next(), tokens - made - 1)
        a = accepted(rng, alphas, k)
        policy.observe(k, a)
        made += a + 1
        spent += costs.round(k)
    return made / spent


def rate(s: Scenario, k: Optional[int], tokens: int, replies: int, prior, seed: int):
    rng = random.Random(seed)
    max_k = len(s.alphas)
    costs = RoundCosts(s.verify[: max_k + 1], s.draft)
    total = 0.0
    for _ in range(replies):
        allowed = list(range(max_k + 1)) if k is None else [k]
        policy = AdaptiveLength(costs, allowed, prior=prior)
        total += run(policy, s.alphas, costs, tokens, rng)
    return total / replies


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--replies", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"{args.tokens} tokens a reply, {args.replies} replies; rates over plain")
    worst = 1.0
    for s in SCENARIOS:
        fixed = [
            rate(s, k, args.tokens, args.replies, DEFAULT_PRIOR, args.seed)
            for k in range(len(s.alphas) + 1)
        ]
        best = max(fixed)
        learned = list(s.alphas)  # what the model's history would say
        auto = rate(s, None, args.tokens, args.replies, DEFAULT_PRIOR, args.seed)
        hist = rate(s, None, args.tokens, args.replies, learned, args.seed)
        worst = min(worst, auto / best, hist / best)
        print(
            f"{s.name:16} fixed k "
            + " ".join(f"{r:.3f}" for r in fixed)
            + f" | auto {auto:.3f} ({auto / best:.3f}), "
            f"with history {hist:.3f} ({hist / best:.3f})"
        )
    print(f"worst efficiency {worst:.3f}")


if __name__ == "__main__":
    main()

"""Measure MTP acceptance on the tiny predictable fixtures (not a speed benchmark).

    python scripts/fixture_acceptance.py [--tokens 64] [--temp 0.0] [--families a,b]

For each family and k = 1..4: acceptance rate, acceptance per draft position and tokens
per round, summed over three prompts; greedy runs are also checked token for token
against plain decoding. ``--sliding`` measures the sliding-window fixtures instead
(window 8: llama with a sliding layer, Gemma 3, gpt-oss; retrofitted heads);
``--gemma4`` the Gemma 4 pairs (E2B-shaped target with a centroid-head assistant,
31B-shaped target with a tied-head one; window 8).
"""

import argparse
import tempfile
from dataclasses import asdict

from mlx_mtp import load
from mlx_mtp.sampling import SamplingParams
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.stats import MTPStats
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import (
    FAMILIES,
    write_checkpoint,
    write_gemma3,
    write_gpt_oss,
    write_llama,
)

SLIDING = {
    "llama-swa": lambda out: write_llama(
        out, heads=True, predictable=True, sliding_window=8, weight_std=0.2
    ),
    "gemma3_text": lambda out: write_gemma3(out, predictable=True),
    "gpt_oss": lambda out: write_gpt_oss(out, predictable=True),
}


def gemma4(kind):
    def write(out):
        from pathlib import Path

        from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

        target = write_gemma4(Path(out) / "t", kind, predictable=True)
        assistant = write_gemma4_assistant(
            Path(out) / "a", target, centroids=kind == "e2b", predictable=True
        )
        return target, assistant

    return write


GEMMA4 = {"gemma4-e2b": gemma4("e2b"), "gemma4-dense": gemma4("dense")}

PROMPTS = ("def forward(self, x):", "The quick brown fox", "import numpy as np\n")


def run(model, ids, k, n, params, seed=0):
    outs = list(
        mtp_generate_step(
            ids,
            model,
            HEADS,
            num_draft_tokens=k,
            **asdict(params),
            max_tokens=n,
            seed=seed,
        )
    )
    return [o.token for o in outs], outs[-1].stats


def merge(total: MTPStats, s: MTPStats) -> MTPStats:
    total.rounds += s.rounds
    total.drafted += s.drafted
    total.accepted += s.accepted
    total.emitted += s.emitted
    for j in range(total.num_draft_tokens):
        total.drafted_per_position[j] += s.drafted_per_position[j]
        total.accepted_per_position[j] += s.accepted_per_position[j]
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--sliding", action="store_true")
    parser.add_argument("--gemma4", action="store_true")
    parser.add_argument(
        "--families", help="comma-separated fixture families (default: all)"
    )
    args = parser.parse_args()
    families = args.families.split(",") if args.families else FAMILIES
    writers = (
        SLIDING
        if args.sliding
        else (
            GEMMA4
            if args.gemma4
            else {
                f: lambda out, f=f: write_checkpoint(f, out, predictable=True)
                for f in families
            }
        )
    )
    params = SamplingParams(temp=args.temp)
    print(f"{'family':14} k  accept  per-position            tok/round  exact")
    for family, write in writers.items():
        with tempfile.TemporaryDirectory() as tmp:
            written = write(tmp)
            if isinstance(written, tuple):  # a target and its assistant
                model, tok = load(str(written[0]), draft_model=str(written[1]))
            else:
                model, tok = load(str(written))
        for k in range(1, 5):
            total, exact = MTPStats(k), True
            for prompt in PROMPTS:
                ids = tok.encode(prompt)
                tokens, stats = run(model, ids, k, args.tokens, params)
                if params.greedy:
                    exact &= tokens == run(model, ids, 0, args.tokens, params)[0]
                merge(total, stats)
            per_pos = " ".join(f"{x:.2f}" for x in total.acceptance_per_position)
            print(
                f"{family:14} {k}  {total.acceptance_rate:.3f}   {per_pos:22}  "
                f"{total.tokens_per_round:.2f}       {exact if params.greedy else '-'}"
            )


if __name__ == "__main__":
    main()

"""Summarize benchmark JSON files (scripts/bench.py --json) as one table.

    python scripts/bench_summary.py bench0.5.json bench0.7.json ...

Files written before the ideal speedup was stored get it recomputed from their costs.
"""

import json
import sys
from pathlib import Path


def main():
    print(
        f"{'file':22} {'workload':11} {'T':>3} {'k':>7} {'tok/s':>7} {'vs mlx-lm':>9} "
        f"{'ideal':>6} {'eff':>5} {'tok/round':>9}  acceptance"
    )
    for path in map(Path, sys.argv[1:]):
        data = json.loads(path.read_text())
        c = data["costs"]
        for r in data["rows"]:
            k = r["k"]
            ideal = eff = None
            if k is not None:
                ideal = r.get("ideal") or _ideal(r, k, c)
                eff = r["ratio"] / ideal
            who = "mlx-lm" if k is None else f"k={k}"
            acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
            print(
                f"{path.stem:22} {r['workload']:11} {r['temp']:>3} {who:>7} {r['tok_s']:7.2f} "
                f"{r['ratio']:8.2f}x {ideal or 0:6.2f} {eff or 0:5.2f} "
                f"{r['tokens_per_round']:9.2f}  [{acc}]"
            )


def _ideal(r: dict, k: int, c: dict) -> float:
    """The ideal speedup of a fixed-k row from a file that did not store it."""
    cost = c[f"verify_{k + 1}"] + k * c.get("draft", 0.0)
    return r["tokens_per_round"] * c["verify_1"] / cost if k else 1.0


if __name__ == "__main__":
    main()

"""Summarize benchmark JSON files (scripts/bench.py --json) as one table.

    python scripts/bench_summary.py bench0.5.json bench0.7.json ...

Files written before the ideal speedup was stored get it recomputed from their costs.
"""

import json
import sys
from pathlib import Path


def main():
    print(
        f"{'file':22} {'workload':11} {'T':>3} {'run':>18} {'tok/s':>7} "
        f"{'vs mlx-lm':>9} {'ideal':>6} {'eff':>5} {'tok/round':>9}  acceptance"
    )
    for path in map(Path, sys.argv[1:]):
        data = json.loads(path.read_text())
        c = data["costs"]
        for r in data["rows"]:
            k = r["k"]
            ideal = eff = None
            if k is not None and r.get("source", "heads") == "heads":
                ideal = r.get("ideal") or _ideal(r, k, c)
                eff = r["ratio"] / ideal
            acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
            print(
                f"{path.stem:22} {r['workload']:11} {r['temp']:>3} {_run(r):>18} "
                f"{r['tok_s']:7.2f} {r['ratio']:8.2f}x {ideal or 0:6.2f} "
                f"{eff or 0:5.2f} {r['tokens_per_round']:9.2f}  [{acc}]"
            )


def _run(r: dict) -> str:
    """``mlx-lm``, or k with the draft source and draft vocabulary when not the
    defaults of files written before they existed."""
    if r["k"] is None:
        return "mlx-lm"
    out = f"k={r['k']}"
    if r.get("source", "heads") != "heads":
        out += f" {r['source']}"
    if r.get("vocab") is not None:
        out += f" dv={r['vocab']}"
    return out


def _ideal(r: dict, k: int, c: dict) -> float:
    """The ideal speedup of a fixed-k row from a file that did not store it."""
    block = c.get("block", 0.0)  # a block drafter's pass, paid once a round
    cost = c[f"verify_{k + 1}"] + (block if block else k * c.get("draft", 0.0))
    return r["tokens_per_round"] * c["verify_1"] / cost if k else 1.0


if __name__ == "__main__":
    main()

"""Held-out agreement per draft depth against training tokens, from a train-heads run.

python scripts/train_curve.py OUT.train [--png curve.png]
"""

import argparse
import json
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path, help="the run's work folder (OUT.train)")
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args()
    info = json.loads((args.work / "progress.json").read_text())
    history = info["history"]
    print(f"step {info['step']}, draft-vocabulary coverage {info['coverage']:.3f}")
    kinds = list(history[0].get("by_kind", {"all": None})) if history else []
    print(
        f"{'step':>6} {'tokens':>10} {'loss':>7}  held-out agreement per depth: "
        + " | ".join(kinds)
    )
    for h in history:
        by_kind = h.get("by_kind", {"all": h["agreement"]})
        agree = " | ".join(
            " ".join(f"{a:.3f}" for a in by_kind[kind]) for kind in kinds
        )
        print(f"{h['step']:6d} {h['tokens']:10d} {h['loss']:7.3f}  {agree}")
    if args.png and history:
        import matplotlib.pyplot as plt  # optional; not a dependency

        for kind in kinds:
            for d in range(len(history[0]["agreement"])):
                plt.plot(
                    [h["tokens"] for h in history],
                    [
                        h.get("by_kind", {"all": h["agreement"]})[kind][d]
                        for h in history
                    ],
                    label=f"{kind}, depth {d + 1}",
                )
        plt.xlabel("training tokens")
        plt.ylabel("held-out agreement with the trunk")
        plt.legend()
        plt.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()

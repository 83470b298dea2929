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
    print(f"{'step':>6} {'tokens':>10} {'loss':>7}  agreement per depth")
    for h in history:
        agree = " ".join(f"{a:.3f}" for a in h["agreement"])
        print(f"{h['step']:6d} {h['tokens']:10d} {h['loss']:7.3f}  {agree}")
    if args.png and history:
        import matplotlib.pyplot as plt  # optional; not a dependency

        for d in range(len(history[0]["agreement"])):
            plt.plot(
                [h["tokens"] for h in history],
                [h["agreement"][d] for h in history],
                label=f"depth {d + 1}",
            )
        plt.xlabel("training tokens")
        plt.ylabel("held-out agreement with the trunk")
        plt.legend()
        plt.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()

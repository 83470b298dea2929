"""MTP decoding on a trunk sharded over several ranks, against plain decoding of the
same sharded trunk, measured in the same run; and the cost of the collectives MTP adds.

    python scripts/make_synthetic_model.py /tmp/syn --acceptance 0.7 --params 300e6
    python scripts/distributed_bench.py /tmp/syn                     # one process
    mlx.launch --backend ring -n 2 --python "$(which python)" \\
        scripts/distributed_bench.py /tmp/syn                        # two ranks

Rank 0 prints: t(1), the time per token of plain decoding (mlx-lm's ``generate_step``
on the trunk, sharded or not); tokens/s of MTP decoding at k = 1..3 and auto, and their
speedup over that plain decoding; and, on several ranks, the latency of one small
``all_sum`` (a round adds two: rank 0's drafts, and its accept decision) against t(1).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx.core as mx  # noqa: E402
from fast_blas import ensure_fast_blas  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from mlx_mtp import load  # noqa: E402
from mlx_mtp.distributed import Sync, world  # noqa: E402
from mlx_mtp.speculative import mtp_generate_step  # noqa: E402
from mlx_mtp.testing import HEADS

PROMPT = list(range(3, 67))  # 64 tokens


def seconds(fn, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after one warm-up."""
    times = []
    for _ in range(reps + 1):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[1:])


def plain(model, n: int):
    for _ in generate_step(mx.array(PROMPT), model.trunk, max_tokens=n):
        pass


def mtp(model, n: int, k):
    stats = None
    for out in mtp_generate_step(
        PROMPT, model, HEADS, num_draft_tokens=k, max_tokens=n
    ):
        stats = out.stats
    return stats


def collective_latency(group, reps: int = 200) -> float:
    """Seconds per small all_sum, as the loop's shares are (an int32 scalar)."""
    sync = Sync(group)
    x = mx.array(1, dtype=mx.int32)

    def run():
        for _ in range(reps):
            mx.eval(sync.share(x))

    return seconds(run, 3) / reps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    blas = ensure_fast_blas()
    group = world()
    rank, ranks = group.rank(), group.size()
    model, _ = load(args.model)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{args.model}: {ranks} rank(s), sharding {model.sharding or 'none'}; {blas}")
    t_plain = seconds(lambda: plain(model, args.tokens), args.reps) / args.tokens
    say(f"plain decoding (mlx-lm): t(1) = {1e3 * t_plain:.1f} ms/token")
    if ranks > 1:
        t_sum = collective_latency(group)
        say(
            f"one small all_sum: {1e6 * t_sum:.0f} us = {t_sum / t_plain:.3f} t(1); "
            f"two per round: {2 * t_sum / t_plain:.3f} t(1)"
        )
    for k in (1, 2, 3, "auto"):
        stats = mtp(model, args.tokens, k)
        t = seconds(lambda: mtp(model, args.tokens, k), args.reps) / stats.emitted
        say(
            f"k={k!s:4} {1 / t:7.1f} tok/s  speedup {t_plain / t:.2f}x  "
            f"acceptance {stats.acceptance_rate:.2f}  "
            f"{stats.tokens_per_round:.2f} tok/round"
        )


if __name__ == "__main__":
    main()

"""One stream through the batched loop against mlx-lm's ``generate_step``: plain
decoding (``-k 0``) speed and the host time per round, in one run.

    python scripts/loop_overhead.py [--model PATH] [--tokens 128] [--reps 5]

PATH defaults to the demo model. Three loops decode the same prompt greedily,
interleaved rep by rep (medians): mlx-lm's ``generate_step`` on the trunk, the
single-stream MTP loop (`mtp_generate_step`, ``num_draft_tokens=0``) and the batched
loop (`mlx_mtp.batch.Batch`, one row, ``num_draft_tokens=0``). Host time per round is
the time a round spends outside MLX's evaluation calls (``mx.eval``,
``mx.async_eval``, the one ``.item``/``.tolist`` sync excluded by construction): the
Python work of building the next graph and committing, measured by wrapping those
calls. On Linux CPUs it first switches MLX's float32 matmuls to OpenBLAS (one thread,
fast_blas.py).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime."


class EvalClock:
    """Seconds spent inside ``mx.eval`` and ``mx.async_eval`` while installed."""

    def __init__(self, mx):
        self.mx, self.seconds = mx, 0.0
        self.real = {n: getattr(mx, n) for n in ("eval", "async_eval")}

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(self.mx, name, self._timed(fn))
        return self

    def _timed(self, fn):
        def call(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tic

        return call

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(self.mx, name, fn)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    blas = ensure_fast_blas()

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from mlx_mtp import load
    from mlx_mtp.batch import Batch
    from mlx_mtp.demo import demo_model
    from mlx_mtp.options import DecodeOptions
    from mlx_mtp.speculative import mtp_generate_step

    model, tokenizer = load(args.model or str(demo_model()))
    ids = tokenizer.encode(PROMPT)
    N = args.tokens
    opts = DecodeOptions(num_draft_tokens=0, draft_source="heads", max_tokens=N)

    def lm():
        steps = generate_step(mx.array(ids), model.trunk, max_tokens=N)
        return [int(t) for t, _ in steps]

    def single():
        return [o.token for o in mtp_generate_step(ids, model, opts)]

    def batched():
        batch = Batch(model, opts)
        batch.join(batch.admit(0, ids, opts))
        out = []
        while len(batch):
            for o in batch.step():
                out += o.tokens
        return out

    loops = {
        "mlx-lm generate_step": lm,
        "mtp loop -k 0": single,
        "batch loop -k 0": batched,
    }
    times = {name: [] for name in loops}
    host = {name: [] for name in loops}
    tokens = {}
    for fn in loops.values():  # warm up
        fn()
    for _ in range(args.reps):
        for name, fn in loops.items():
            with EvalClock(mx) as clock:
                tic = time.perf_counter()
                tokens[name] = fn()
                wall = time.perf_counter() - tic
            times[name].append(wall / N)
            host[name].append((wall - clock.seconds) / N)
    base = statistics.median(times["mlx-lm generate_step"])
    print(f"{blas}; {N} tokens, median of {args.reps} interleaved reps")
    print(f"{'loop':24} {'ms/token':>9} {'vs mlx-lm':>10} {'host ms/round':>14}")
    for name in loops:
        t = statistics.median(times[name])
        h = statistics.median(host[name])
        print(f"{name:24} {1000 * t:9.2f} {base / t:9.3f}x {1000 * h:14.2f}")
    same = all(t == tokens["mlx-lm generate_step"] for t in tokens.values())
    print("tokens equal:", same)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

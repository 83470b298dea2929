"""Cost and memory of `WindowCache` next to mlx-lm's `RotatingKVCache` on one
sliding-window attention layer, at a long context.

For n = 1..5 it times a pass over n tokens (a one-token step, or a verify pass of
k = n - 1 drafts) through the layer with each cache, after ``--context`` tokens, and
prints the ratio. mlx-lm's cache is timed on the same n-token pass (its multi-token
path), though that path gives queries past a wrapped window with sinks other windows
than one-token decoding; `WindowCache` gives each query its own. Memory is the bytes
each cache holds after the context.

    python scripts/window_cost.py [--window 512 --context 4096 --reps 20]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache  # noqa: E402

from mlx_mtp.cache import WindowCache  # noqa: E402


class Layer(nn.Module):
    """One attention layer (GQA, 8 query / 2 KV heads of 128), as a trunk's."""

    def __init__(self, dim=1024, heads=8, kv_heads=2, head_dim=128):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def __call__(self, x, cache, window):
        B, L, _ = x.shape
        q = self.q(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        mask = cache.make_mask(L, window_size=window)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(
            q, k, v, cache=cache, scale=self.head_dim**-0.5, mask=mask
        )
        return self.o(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def timed(layer, cache, window, n, reps):
    """Median seconds of an n-token pass, each followed by a rollback of n - 1."""
    times = []
    for _ in range(reps + 1):
        x = mx.random.normal((1, n, 1024))
        mx.eval(x)
        tic = time.perf_counter()
        mx.eval(layer(x, cache, window))
        times.append(time.perf_counter() - tic)
        cache.trim(n - 1)
    return statistics.median(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    print(f"BLAS: {ensure_fast_blas()}")
    mx.random.seed(0)
    layer = Layer()
    mx.eval(layer.parameters())
    caches = {
        "mlx-lm RotatingKVCache": RotatingKVCache(max_size=args.window),
        "mlx-mtp WindowCache": WindowCache(args.window),
    }
    for cache in caches.values():
        for start in range(0, args.context, 256):  # a chunked prefill
            mx.eval(layer(mx.random.normal((1, 256, 1024)), cache, args.window))
    print(f"window {args.window}, context {args.context}")
    for name, cache in caches.items():
        print(f"  {name}: {cache.nbytes / 2**20:.2f} MiB held")
    for n in range(1, 6):
        t = {
            name: timed(layer, c, args.window, n, args.reps)
            for name, c in caches.items()
        }
        (a, ta), (b, tb) = t.items()
        print(
            f"  pass over {n} token(s): {ta * 1e3:.2f} ms / {tb * 1e3:.2f} ms = "
            f"{tb / ta:.2f}x"
        )


if __name__ == "__main__":
    main()

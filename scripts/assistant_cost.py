"""Cost of one Gemma 4 assistant draft step against t(1), one plain decode step of its
target, measured side by side (float32 on the benchmark's BLAS setting): with the
tied head over the whole vocabulary and with the centroid head (E2B/E4B), on a pair
folder such as make_synthetic_gemma4.py writes (built with --centroids, so both heads
can run on the same weights).

    python scripts/assistant_cost.py PAIR [--context 512] [--reps 20]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pair", type=Path)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--max-k", type=int, default=4)
    args = p.parse_args()
    blas = ensure_fast_blas()
    import mlx.core as mx

    from mlx_mtp.draft_length import time_round
    from mlx_mtp.loading import load_model

    model = load_model(str(args.pair))[0]
    if model.assistant is None or "masked_embedding" not in model.assistant:
        raise SystemExit(f"{args.pair} has no assistant with a centroid head")
    ids = mx.arange(args.context, dtype=mx.int32) % model.args.vocab_size
    centroid = model.assistant.masked_embedding
    results = {}
    for head in ("centroid", "dense", "centroid again"):
        if head == "dense":
            del model.assistant["masked_embedding"]
        else:
            model.assistant.masked_embedding = centroid
        t, draft, _ = time_round(model, ids, args.max_k, args.reps)
        results[head] = dict(t1_ms=1e3 * t[0], draft_ms=1e3 * draft, ratio=draft / t[0])
        verify = " ".join(f"{x / t[0]:.2f}" for x in t)
        print(
            f"{head:15s} t(1) {1e3 * t[0]:7.2f} ms   draft step {1e3 * draft:6.2f} ms"
            f" = {draft / t[0]:.3f} t(1)   t(n)/t(1), n = 1..{args.max_k + 1}: "
            f"{verify}",
            flush=True,
        )
    dense, sparse = results["dense"]["draft_ms"], results["centroid"]["draft_ms"]
    print(f"centroid head step / dense head step: {sparse / dense:.3f}")
    print(json.dumps(dict(blas=blas, context=args.context, **results)))


if __name__ == "__main__":
    main()

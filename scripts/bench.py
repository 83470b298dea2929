"""Benchmark mlx-mtp against mlx-lm plain decoding on any model folder (see
`mlx_mtp.bench`). On Linux CPUs it first switches MLX's float32 matmuls to OpenBLAS
(fast_blas.py) and says when it cannot: timing needs float32 weights and a fast BLAS.

    python scripts/bench.py --model PATH [--draft-model ASSISTANT] [--tokens 128]
        [--reps 5] [--k 0 1 2 3 4 auto] [--temp 0 0.7]
        [--workloads code code-request demo chat prose code-edit summarise adversarial]
        [--sources heads lookup auto] [--vocabs own full 4096 auto] [--json out.json]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def _draft_length(value: str):
    return value if value == "auto" else int(value)


def _draft_vocab(value: str):
    return (
        None if value == "own" else (value if value in ("auto", "full") else int(value))
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", default=None, help="a Gemma 4 assistant")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--k", type=_draft_length, nargs="+", default=[0, 1, 2, 3, 4, "auto"]
    )
    p.add_argument("--temp", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--workloads", nargs="+", default=None)
    p.add_argument(
        "--sources", nargs="+", default=["heads"], choices=["heads", "lookup", "auto"]
    )
    p.add_argument(
        "--vocabs",
        type=_draft_vocab,
        nargs="+",
        default=[None],
        help="draft vocabularies for heads drafts: own (the heads' own rows), full, "
        "a number of tokens, auto",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    blas = ensure_fast_blas()
    import mlx.core as mx

    from mlx_mtp import load
    from mlx_mtp.bench import bench

    print(f"BLAS: {blas}; device {mx.default_device()}; model {args.model}", flush=True)
    model, tokenizer = load(
        args.model, allow_missing_heads=True, draft_model=args.draft_model
    )
    result = bench(
        model,
        tokenizer,
        ks=args.k,
        temps=args.temp,
        tokens=args.tokens,
        reps=args.reps,
        workloads=args.workloads,
        sources=args.sources,
        vocabs=args.vocabs,
        log=lambda line: print(line, flush=True),
    )
    result.update(blas=blas, model=args.model, tokens=args.tokens, reps=args.reps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

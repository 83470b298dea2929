"""What one ``train-heads`` step costs, and why: BLAS, threads, compilation, the draft
vocabulary and soft targets, each timed on the real shapes in a fresh process.

    python scripts/train_step_cost.py --model SMOLLM2_FOLDER [--batch-size 8]
        [--seq-len 256] [--depth 3] [--steps 3] [--configs ref fast fast1 ...]

A config is BLAS (``ref``: the wheel's reference BLAS; ``fast``: OpenBLAS on every
core; ``fast1``: one thread) plus options (``+compile``, ``+soft``, ``+full`` for the
whole vocabulary instead of 8192 rows). The features are random (the cost does not
depend on them); each row prints seconds per step after one warm-up step.
"""

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT = ["ref", "fast1", "fast", "fast+compile", "fast+soft", "fast+full"]


def one(args) -> dict:
    """Time steps of one config in this process (its BLAS set by the parent)."""
    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np

    from mlx_mtp.convert.train_heads import compile_step, draft_weight, init_head
    from mlx_mtp.fast_blas import describe
    from mlx_mtp.loading import load

    opts = set(args.config.split("+")[1:])
    model, _ = load(args.model, allow_missing_heads=True)
    V = model.args.vocab_size if "full" in opts else 8192
    vocab = np.arange(V, dtype=np.int32)
    mx.random.seed(0)
    stack = init_head(model, model.family, vocab)
    stack.freeze(keys=["draft_vocab"], recurse=False)
    model.trunk.freeze()
    remap = mx.array(np.arange(model.args.vocab_size, dtype=np.int32) % V)
    W = draft_weight(model, mx.array(vocab))
    opt = optim.AdamW(learning_rate=1e-4)
    B, L, H = args.batch_size, args.seq_len, model.args.hidden_size
    batch = (
        mx.random.normal((B, L, H)).astype(mx.float16).astype(mx.float32),
        mx.random.randint(0, model.args.vocab_size, (B, L)),
        mx.random.randint(0, model.args.vocab_size, (B, L)),
        mx.ones((B, L), dtype=mx.uint8),
    )
    soft = 0.5 if "soft" in opts else 0.0
    step = compile_step(
        stack, opt, model, W, remap, args.depth, soft, "compile" in opts
    )
    times = []
    for i in range(args.steps + 1):
        t = time.perf_counter()
        loss = step(batch)
        mx.eval(stack.parameters(), opt.state, loss)
        times.append(time.perf_counter() - t)
    x = batch[1][:1]  # (1, L): the feature pass of one sequence, as compute_features
    feature = []
    for i in range(2):
        t = time.perf_counter()
        h = model.hidden(x)
        mx.eval(h, mx.argmax(model.logits(h), axis=-1))
        feature.append(time.perf_counter() - t)
    return {
        "config": args.config,
        "blas": describe(),
        "s_per_step": min(times[1:]),
        "s_per_feature_row": feature[-1],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=DEFAULT)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config:
        if args.config.startswith("fast"):
            from mlx_mtp.fast_blas import ensure_fast_blas

            ensure_fast_blas(1 if args.config.startswith("fast1") else os.cpu_count())
        print(json.dumps(one(args)))
        return
    print(
        f"one train-heads step: batch {args.batch_size} x {args.seq_len} tokens, "
        f"depth {args.depth}; best of {args.steps} after a warm-up"
    )
    base = None
    for config in args.configs:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.pop("MLX_MTP_FAST_BLAS", None)
        if config == "ref":
            env["MLX_MTP_FAST_BLAS"] = "0"
        cmd = [sys.executable, __file__, "--config", config, "--model", args.model]
        cmd += ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
        cmd += ["--depth", str(args.depth), "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{config}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r["s_per_step"]
        print(
            f"{config:>14}  {r['s_per_step']:7.2f} s/step  "
            f"{1 / r['s_per_step']:6.3f} steps/s  {base / r['s_per_step']:5.1f}x  "
            f"features {args.seq_len / r['s_per_feature_row']:6.0f} tok/s  "
            f"({r['blas']})",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Cost of exact recurrent-state rollback on a Qwen3.5-shaped hybrid trunk.

Measures, in one process and interleaved (medians of --reps runs), the verify pass of
k+1 tokens with mlx-lm's Gated-DeltaNet mixers as they are (no capture, no rollback
possible) and with mlx-mtp's per-position state capture, after a prefill of --context
tokens; prints the ratio, the added milliseconds, and the memory the capture holds per
Gated-DeltaNet layer. Random float32 weights in mlx-lm's own qwen3_5 classes; sizes
default to Qwen3.6-35B-A3B's per-layer attention and Gated-DeltaNet shapes with a dense
MLP and fewer layers. Run on OpenBLAS (see fast_blas.py) so a pass is memory-bound, as
on Apple Silicon:

    python scripts/rollback_cost.py            # defaults, about a minute
    python scripts/rollback_cost.py --json out.json
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def build(args):
    import mlx.core as mx
    from mlx_lm.models import qwen3_5

    from mlx_mtp.models.capture import install_capture

    text = dict(
        model_type="qwen3_5_text",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=args.value_heads,
        linear_num_key_heads=args.key_heads,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        vocab_size=args.vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
    )
    model = qwen3_5.Model(
        qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", **text})
    )
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    install_capture(model.layers)
    return model


def snapshot(caches):
    return [(list(c.cache) if hasattr(c, "cache") else c.offset) for c in caches]


def restore(caches, saved):
    for c, s in zip(caches, saved):
        if isinstance(s, list):
            c.cache = list(s)
        else:
            c.offset = s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5120)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--value-heads", type=int, default=32)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    blas = ensure_fast_blas()

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_mtp.cache import begin_verify, rewind, with_recurrent_caches

    model = build(args)
    inner = model.language_model.model
    plain = make_prompt_cache(model)
    capture = with_recurrent_caches(make_prompt_cache(model))
    prompt = mx.random.randint(0, args.vocab, (1, args.context))
    for caches in (plain, capture):
        mx.eval(inner(prompt, caches))
    saved = {id(plain): snapshot(plain), id(capture): snapshot(capture)}

    def run(caches, tokens, record):
        restore(caches, saved[id(caches)])
        tic = time.perf_counter()
        marks = begin_verify(caches) if record else None
        h = inner(tokens, caches)
        mx.eval(h, [c.state for c in caches])
        dt = time.perf_counter() - tic
        return dt, marks

    gdn = sum(1 for layer in model.layers if layer.is_linear)
    rows, times = [], {}
    for k in range(0, args.max_k + 1):
        tokens = mx.random.randint(0, args.vocab, (1, k + 1))
        run(plain, tokens, False), run(capture, tokens, True)  # warm up
        t_plain, t_cap = [], []
        for _ in range(args.reps):
            t_plain.append(run(plain, tokens, False)[0])
            dt, marks = run(capture, tokens, True)
            t_cap.append(dt)
        times[k] = (statistics.median(t_plain), statistics.median(t_cap))
        cap = next(m for m in marks if m is not None)
        held = sum(a.nbytes for step in cap.steps[:-1] for a in step)
        tic = time.perf_counter()
        rewind(capture, marks, k)  # the worst case: every draft rejected
        restore_ms = (time.perf_counter() - tic) * 1e3
        rows.append(
            dict(
                k=k,
                plain_ms=times[k][0] * 1e3,
                capture_ms=times[k][1] * 1e3,
                ratio=times[k][1] / times[k][0],
                extra_mib_per_layer=held / 2**20,
                restore_ms=restore_ms,
            )
        )

    t1 = times[0][0]
    print(f"BLAS: {blas}")
    print(
        f"trunk: {args.layers} layers ({gdn} Gated-DeltaNet), hidden {args.hidden}, "
        f"GDN heads {args.value_heads}v/{args.key_heads}k x {args.head_dim}, "
        f"context {args.context}, float32, median of {args.reps}"
    )
    state_mib = args.value_heads * args.head_dim**2 * 4 / 2**20
    print(f"recurrent state: {state_mib:.2f} MiB per layer per position (float32)")
    print(
        f"{'k':>2} {'verify ms':>10} {'+capture ms':>12} {'ratio':>7} "
        f"{'t(k+1)/t(1)':>12} {'held MiB/layer':>15} {'restore ms':>11}"
    )
    for r in rows:
        print(
            f"{r['k']:>2} {r['plain_ms']:>10.2f} {r['capture_ms']:>12.2f} "
            f"{r['ratio']:>7.3f} {r['plain_ms'] / (t1 * 1e3):>12.2f} "
            f"{r['extra_mib_per_layer']:>15.2f} {r['restore_ms']:>11.3f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(blas=blas, args=vars(args) | {"json": None}, rows=rows), indent=2
            )
        )


if __name__ == "__main__":
    main()

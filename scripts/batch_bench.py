"""`mlx_mtp.batch_generate` against mlx-lm's own `batch_generate` on the same prompts,
per batch size, in one process: greedy, interleaved, medians of several runs.

    python scripts/batch_bench.py --model PATH [--prompts 8] [--tokens 64]
        [--batch 1 2 4 8] [--reps 3] [--k auto 2] [--draft-source auto]
        [--draft-vocab auto] [--json out.json]

For each batch size B both decode all the prompts with at most B streams at once
(mlx-mtp: ``max_batch=B``; mlx-lm: ``completion_batch_size=prefill_batch_size=B``),
once per run for mlx-lm and for every k asked; the order within a run alternates. The
table gives, per B and k, the median tokens/s of each (generated tokens over the wall
time of the call, prefills included), their ratio, and mlx-mtp's acceptance and mean
draft length (drafted tokens per round, lookup drafts included: with the default
draft source they can be longer than k) over all its runs. Every run's tokens are
compared with mlx-lm's, prompt by prompt (greedy decoding is exact): the script says
whether all were equal and exits with status 1 if any was not.

Decoding alone (``decode``): the tokens/s after each side's first decoding step, to
its last (so prefill is left out when every prompt starts at once: ``--prompts B``),
as a ratio of mlx-mtp's to mlx-lm's. ``ideal``: the best such ratio the model's
measured batch costs t(B, n) allow at B (`mlx_mtp.batch_costs`, over k = 1..5, or 1
for plain), with the acceptance per position mlx-mtp measured; ``of ideal``: the
ratio measured over that one.

PATH: a model both load, e.g. one from make_synthetic_model.py (mlx-lm ignores the MTP
tensors; its trunk emits tokens spread evenly over the vocabulary, so give it
``--draft-vocab full`` to measure the heads as built: "auto" may draft from fewer
rows, at a lower acceptance) or the demo model's folder. mlx-lm's side loads its own
copy with ``mlx_lm.load``. On Linux CPUs it first switches MLX's float32 matmuls to
OpenBLAS with one thread (fast_blas.py), for both.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def _draft_length(value: str):
    return value if value == "auto" else int(value)


def _draft_vocab(value: str):
    return (
        None if value == "own" else value if value in ("auto", "full") else int(value)
    )


def make_prompts(tokenizer, n: int):
    """``n`` different prompts (token ids): the benchmark's workloads in turn, each
    numbered, chat ones through the chat template when the tokenizer has one."""
    from mlx_mtp.bench import CHAT_WORKLOADS, WORKLOADS

    names = list(WORKLOADS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        text = f"Request {i}. {WORKLOADS[name]}"
        if name in CHAT_WORKLOADS and tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
        out.append(tokenizer.encode(text))
    return out


def run_lm(model, tokenizer, prompts, tokens: int, B: int):
    """mlx-lm's batch_generate, as that function drives its ``BatchGenerator``;
    returns (seconds, token ids per prompt, `Decode` times)."""
    from mlx_lm.generate import BatchGenerator

    tic = time.perf_counter()
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=B,
        prefill_batch_size=B,
    )
    uids = gen.insert(prompts, [tokens] * len(prompts))
    results = {uid: [] for uid in uids}
    decode = Decode()
    while responses := gen.next_generated():
        decode.tick(len(responses))
        for r in responses:
            if r.finish_reason != "stop":
                results[r.uid].append(r.token)
    gen.close()
    return time.perf_counter() - tic, [results[u] for u in uids], decode


class Decode:
    """Decoding alone: the tokens after the first step that gave any, over the time
    from that step to the last (prefill excluded, for a batch that starts whole)."""

    def __init__(self):
        self.first = self.last = None
        self.tokens = 0

    def tick(self, tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.tokens += tokens
        self.last = now

    @property
    def rate(self) -> float:
        span = (self.last or 0) - (self.first or 0)
        return self.tokens / span if span > 0 else float("nan")


def run_mtp(model, tokenizer, prompts, tokens: int, B: int, k, args):
    """mlx_mtp.batch_generate, greedy; returns (seconds, token ids, stats, the rows'
    rounds per batch size, all rows together, `Decode` times)."""
    import mlx_mtp

    decode, seen = Decode(), set()

    def on_output(out):  # per row and round: the first round ends at a repeated row
        if out.uid in seen and decode.first is None:
            decode.first = calls[0]
        decode.tokens += len(out.tokens) if decode.first is not None else 0
        decode.last = time.perf_counter()
        calls.append(decode.last)
        seen.add(out.uid)

    calls = []
    tic = time.perf_counter()
    r = mlx_mtp.batch_generate(
        model,
        tokenizer,
        prompts,
        max_tokens=tokens,
        max_batch=B,
        on_output=on_output,
        num_draft_tokens=k,
        draft_source=args.draft_source,
        draft_vocab=args.draft_vocab,
        temp=0.0,
    )
    seconds = time.perf_counter() - tic
    stats = r.mtp[0]
    for s in r.mtp[1:]:
        stats = stats + s
    sizes = {}
    for per_prompt in r.batch_sizes:
        for b, n in per_prompt.items():
            sizes[b] = sizes.get(b, 0) + n
    return seconds, r.token_ids, stats, sizes, decode


def bench_batch(lm, ours, prompts, args, B: int, mismatches: list) -> dict:
    """Every run at batch size ``B``; the medians and mlx-mtp's statistics."""
    runs = ["mlx-lm"] + [f"k={k}" for k in args.k]
    seconds = {name: [] for name in runs}
    decoding = {name: [] for name in runs}  # tok/s after the first round
    stats, sizes, generated = {}, {}, {}
    for rep in range(args.reps):
        order = runs if rep % 2 == 0 else runs[::-1]
        results = {}
        for name in order:
            if name == "mlx-lm":
                t, ids, decode = run_lm(*lm, prompts, args.tokens, B)
            else:
                k = _draft_length(name[2:])
                t, ids, s, used, decode = run_mtp(
                    *ours, prompts, args.tokens, B, k, args
                )
                stats[name] = stats[name] + s if name in stats else s
                per_size = sizes.setdefault(name, {})
                for b, n in used.items():
                    per_size[b] = per_size.get(b, 0) + n
            seconds[name].append(t)
            decoding[name].append(decode.rate)
            results[name] = ids
            generated[name] = sum(len(x) for x in ids)
        for name in runs[1:]:
            for i, (a, b) in enumerate(zip(results["mlx-lm"], results[name])):
                if list(a) != list(b):
                    mismatches.append((B, name, rep, i))
    rate = {n: generated[n] / statistics.median(seconds[n]) for n in runs}
    dec = {n: statistics.median(decoding[n]) for n in runs}
    rows = []
    for name in runs[1:]:
        s = stats[name]
        best_k, ideal = ideal_speedup(ours[0], B, s)
        rows.append(
            {
                "B": B,
                "k": name[2:],
                "mlx_lm_tok_s": rate["mlx-lm"],
                "mlx_mtp_tok_s": rate[name],
                "ratio": rate[name] / rate["mlx-lm"],
                "mlx_lm_decode_tok_s": dec["mlx-lm"],
                "mlx_mtp_decode_tok_s": dec[name],
                "decode_ratio": dec[name] / dec["mlx-lm"],
                "ideal_k": best_k,
                "ideal_decode_ratio": ideal,
                "of_ideal": dec[name] / dec["mlx-lm"] / ideal,
                "acceptance": s.acceptance_rate,
                "mean_draft_length": s.mean_draft_length,
                "tokens_per_round": s.tokens_per_round,
                "row_rounds_by_batch_size": sizes[name],  # all runs and rows
                "seconds": {"mlx-lm": seconds["mlx-lm"], "mlx-mtp": seconds[name]},
            }
        )
    return rows


def ideal_speedup(model, B: int, stats) -> tuple:
    """The best decoding speedup over batched plain that the model's measured batch
    costs allow at batch size B, with the acceptance measured (conditional per
    position; a position never reached takes the last one measured): (k, ratio)."""
    from mlx_mtp.batch import filled_batch
    from mlx_mtp.batch_costs import model_batch_costs

    costs = model_batch_costs(model, max(B, 1), filled_batch)
    alphas, reached = [], stats.drafted_per_position[0] if stats.drafted else 0
    for hits in stats.accepted_per_position:
        if not reached:
            break
        alphas.append(hits / reached)
        reached = hits
    best = (0, 1.0)
    for k in range(1, 6):
        run, expected = 1.0, 1.0
        for j in range(k):
            run *= alphas[min(j, len(alphas) - 1)] if alphas else 0.0
            expected += run
        ratio = expected / costs.round(B, k) * costs.round(B, 0)
        best = max(best, (k, ratio), key=lambda x: x[1])
    return best


HEADER = (
    f"{'B':>3} {'k':>5} {'mlx-lm tok/s':>13} {'mlx-mtp tok/s':>14} {'ratio':>6} "
    f"{'decode':>7} {'ideal':>6} {'of ideal':>8} {'accept':>7} {'draft len':>9}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['B']:>3} {r['k']:>5} {r['mlx_lm_tok_s']:>13.1f} "
        f"{r['mlx_mtp_tok_s']:>14.1f} {r['ratio']:>6.2f} {r['decode_ratio']:>7.2f} "
        f"{r['ideal_decode_ratio']:>6.2f} {r['of_ideal']:>8.2f} "
        f"{r['acceptance']:>7.2f} {r['mean_draft_length']:>9.2f}"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--lm-model",
        default=None,
        help="the folder mlx-lm loads (default --model): the same trunk without the "
        "MTP tensors, for a layout whose sanitize keeps them",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per run")
    p.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--k",
        type=_draft_length,
        nargs="+",
        default=["auto"],
        help="mlx-mtp's draft lengths: auto and/or fixed numbers",
    )
    p.add_argument(
        "--draft-source",
        choices=["heads", "lookup", "auto"],
        default="auto",
        help="mlx-mtp's draft source (default auto, as the library's)",
    )
    p.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        default="auto",
        help="mlx-mtp's draft vocabulary: auto (the library's default), full, own "
        "(the heads' own rows) or a number of tokens",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.prompts < 1 or args.tokens < 1 or args.reps < 1:
        p.error("--prompts, --tokens and --reps must be at least 1")
    if min(args.batch) < 1:
        p.error("--batch sizes must be at least 1")
    blas = ensure_fast_blas()
    import mlx.core as mx
    import mlx_lm

    import mlx_mtp

    print(f"BLAS: {blas}; device {mx.default_device()}; model {args.model}", flush=True)
    ours = mlx_mtp.load(args.model)
    lm = mlx_lm.load(args.lm_model or args.model)
    prompts = make_prompts(ours[1], args.prompts)
    print(
        f"{args.prompts} prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, {args.tokens} tokens each, "
        f"{args.reps} runs; warming up (mlx-mtp's first batch measures the "
        "model's batch costs, once per model and machine)",
        flush=True,
    )
    from mlx_mtp.batch import warm_batch_costs

    warm_batch_costs(ours[0], max(args.batch))  # every size a run reaches
    for k in args.k:  # compilation, draft-length tables
        run_mtp(*ours, prompts[:2], 8, max(args.batch), k, args)
    run_lm(*lm, prompts[:2], 8, max(args.batch))
    print(HEADER, flush=True)
    rows, mismatches = [], []
    for B in args.batch:
        for r in bench_batch(lm, ours, prompts, args, B, mismatches):
            rows.append(r)
            print(format_row(r), flush=True)
    if mismatches:
        B, name, rep, i = mismatches[0]
        print(
            f"texts: {len(mismatches)} of {len(args.batch) * len(args.k) * args.reps}"
            f" x {args.prompts} not equal to mlx-lm's (first: B={B} {name} run {rep}"
            f" prompt {i})",
            flush=True,
        )
    else:
        print(
            f"texts: all equal to mlx-lm's (greedy; {args.prompts} prompts at every B "
            "and k, every run)",
            flush=True,
        )
    if args.json:
        result = dict(blas=blas, model=args.model, tokens=args.tokens, reps=args.reps)
        result.update(prompts=args.prompts, draft_source=args.draft_source)
        result.update(draft_vocab=args.draft_vocab)
        result.update(rows=rows, equal=not mismatches)
        args.json.write_text(json.dumps(result, indent=2))
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()

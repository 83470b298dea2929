"""Teacher-forced agreement of a model's heads against their acceptance in the
decoding loop, per draft depth, on held-out prompts.

    python scripts/head_acceptance.py --model MODEL_WITH_HEADS
        [--replies OUT.train/replies.eval.jsonl] [--k 3] [--max-tokens 160]

For every held-out prompt (the ``replies.eval.jsonl`` of a ``train-heads --distill``
run, else the built-in held-out split) the loop decodes greedily with ``k`` drafts
from the heads a round; then the same conversation is scored teacher-forced, as
``train-heads`` scores it (`mlx_mtp.convert.train_heads.evaluate`). Per kind of prompt
it prints the loop's acceptance at depth 1 and its conditional acceptance at depth j
(accepted at j, given accepted at j-1); the teacher-forced figures at the rows where
the loop's rounds started, which equal the loop's when training computes what the
loop computes (and how many rounds agree exactly: float rounding may flip a
near-tie); and the teacher-forced figures at every reply row, what ``train-heads``
reports (the loop's round starts are a sample of them).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def draft_rows(model):
    """The heads' draft-vocabulary weight and the map from token ids to its rows (-1
    where a token has none), as `train_heads.evaluate` takes them."""
    import mlx.core as mx
    import numpy as np

    from mlx_mtp.convert.train_heads import draft_weight

    vocab = np.array(model.mtp.draft_vocab)
    remap = np.full(model.args.vocab_size, -1, dtype=np.int32)
    remap[vocab] = np.arange(len(vocab), dtype=np.int32)
    return draft_weight(model, mx.array(vocab)), mx.array(remap)


def prompts_and_kinds(args, tokenizer):
    """``[(prompt ids, kind)]`` of the held-out prompts."""
    from mlx_mtp.convert.distill import encode, read_prompts, split_prompts

    if args.replies:
        lines = Path(args.replies).read_text().splitlines()
        return [
            (r["tokens"][: r["reply_start"]], r["kind"]) for r in map(json.loads, lines)
        ]
    _, held = split_prompts(read_prompts("builtin"), 0.05, 0)
    return [(encode(tokenizer, p), p.kind) for p in held]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--replies", default=None)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--limit", type=int, default=None, help="prompts per kind")
    args = p.parse_args()
    print(f"BLAS: {ensure_fast_blas()}")

    import mlx.core as mx
    import numpy as np

    from mlx_mtp.convert.distill import reply_weights
    from mlx_mtp.convert.train_heads import evaluate, losses
    from mlx_mtp.loading import load
    from mlx_mtp.speculative import mtp_generate_step
    from mlx_mtp.stats import MTPStats

    model, tokenizer = load(args.model)
    W, remap = draft_rows(model)
    by_kind = {}
    for prompt, kind in prompts_and_kinds(args, tokenizer):
        seen = by_kind.setdefault(kind, {"stats": MTPStats(args.k), "rows": []})
        if args.limit and len(seen["rows"]) >= args.limit:
            continue
        steps = mtp_generate_step(
            prompt,
            model,
            num_draft_tokens=args.k,
            draft_source="heads",  # the heads alone, not prompt lookup
            max_tokens=args.max_tokens,
        )
        reply, accepted = [], []
        for o in steps:  # as the text layer: the reply ends at an EOS
            reply.append(o.token)
            accepted.append(o.from_draft)
            if o.token in tokenizer.eos_token_ids:
                break
        seen["stats"] = seen["stats"] + o.stats.snapshot()
        seen["rows"].append((prompt, reply, accepted))
    print(f"k = {args.k}, greedy, up to {args.max_tokens} tokens a reply")
    print(
        f"{'kind':>6} {'replies':>7} {'':>26} "
        + " ".join(f"d{j + 1:<5}" for j in range(args.k))
    )
    for kind, seen in by_kind.items():
        rounds = np.zeros((2, args.k + 1))  # loop, teacher-forced: rounds by accepts
        same = total = 0
        rows = []
        for prompt, reply, accepted in seen["rows"]:
            t = prompt + reply
            x = mx.array(t + [0] * (args.k + 1))[None]  # (1, L)
            h = model.hidden(x)
            g = mx.argmax(model.logits(h), axis=-1)
            batch = (h, x, g, mx.ones(x.shape, dtype=mx.uint8))
            hits = [
                np.array(p[3][0])
                for p in losses(model.mtp, model, W, remap, batch, args.k)
            ]
            P = len(prompt)
            for q in range(P, len(t) - 1):  # a round starts after each verified token
                if accepted[q - P]:
                    continue
                loop_a = next(
                    (
                        n
                        for n in range(args.k)
                        if q + 1 + n >= len(t) or not accepted[q + 1 - P + n]
                    ),
                    args.k,
                )
                if q + args.k >= len(t):
                    continue  # the last round, cut by the end of the reply
                tf_a = next((n for n in range(args.k) if not hits[n][q - 1]), args.k)
                rounds[0, loop_a] += 1
                rounds[1, tf_a] += 1
                same += loop_a == tf_a
                total += 1
            rows.append((t, P))
        L = max(len(t) for t, _ in rows) + args.k + 1
        tokens = np.zeros((len(rows), L), dtype=np.int32)
        weight = np.zeros_like(tokens, dtype=np.uint8)
        for i, (t, P) in enumerate(rows):
            tokens[i, : len(t)] = t
            weight[i] = reply_weights(P, len(t), L)
        h = model.hidden(mx.array(tokens))  # (n, L, H)
        feats = {
            "tokens": tokens,
            "hidden": np.array(h.astype(mx.float16)),
            "greedy": np.array(mx.argmax(model.logits(h), axis=-1)),
            "weight": weight,
        }
        _, everywhere = evaluate(model.mtp, model, W, remap, feats, args.k)
        n = len(seen["rows"])
        for label, cond in (
            ("loop", _conditional(rounds[0])),
            ("teacher-forced, same rows", _conditional(rounds[1])),
            ("teacher-forced, every row", everywhere),
        ):
            print(
                f"{kind if label == 'loop' else '':>6} "
                f"{n if label == 'loop' else '':>7} {label:>26} "
                + " ".join(f"{a:.3f}" for a in cond)
            )
        s = seen["stats"]
        print(
            f"{'':>15}{same}/{total} rounds accept as many drafts as teacher forcing "
            f"predicts; {s.tokens_per_round:.2f} tok/round over {s.rounds} rounds"
        )


def _conditional(by_accepts):
    """Per depth j, the share of rounds accepting >= j drafts among those accepting
    >= j-1, from the count of rounds by drafts accepted."""
    at_least = [by_accepts[j:].sum() for j in range(len(by_accepts))]
    return [at_least[j + 1] / max(at_least[j], 1) for j in range(len(by_accepts) - 1)]


if __name__ == "__main__":
    main()

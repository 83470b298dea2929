"""Held-out agreement of a model's heads, split by whether prompt lookup would have
drafted the token too: what the heads add beyond copying from the context.

    python scripts/lookup_split.py --model MODEL_WITH_HEADS \
        --replies OUT.train/replies.eval.jsonl

For each kind of held-out reply (the ``replies.eval.jsonl`` of a ``train-heads
--distill`` run), every reply token is *repeated* when `mlx_mtp.lookup.continuation`
of the conversation before it predicts it (the longest earlier n-gram, as ``-k auto``'s
lookup drafts), else *novel*. It prints the share of repeated tokens and the heads'
teacher-forced agreement per depth (`mlx_mtp.convert.train_heads.evaluate`, as
``train-heads`` scores them) over all reply tokens, the repeated ones and the novel
ones. A model whose greedy replies loop is easy to draft for either way; its heads
matter where the tokens are novel.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402
from head_acceptance import draft_rows  # noqa: E402


def repeated(tokens, start: int, end: int):
    """``(len(tokens),)`` bools: position p is True when lookup over ``tokens[:p+1]``
    predicts ``tokens[p+1]`` (the target that a weight at p marks), for p in
    ``start..end-2``."""
    import numpy as np

    from mlx_mtp.lookup import continuation

    out = np.zeros(len(tokens), dtype=bool)
    for p in range(start, end - 1):
        found = continuation(tokens[: p + 1], 1)
        out[p] = bool(found) and found[0] == tokens[p + 1]
    return out


def features(model, rows, length: int, batch: int = 4) -> dict:
    """Hidden states and greedy tokens of the conversations ``rows`` as `evaluate`
    reads them, ``length`` tokens a row; with the masks of repeated positions."""
    import mlx.core as mx
    import numpy as np

    from mlx_mtp.convert.distill import reply_weights

    tokens = np.zeros((len(rows), length), dtype=np.int32)
    weight = np.zeros_like(tokens, dtype=np.uint8)
    rep = np.zeros_like(tokens, dtype=bool)
    for i, r in enumerate(rows):
        t = r["tokens"][:length]
        tokens[i, : len(t)] = t
        weight[i] = reply_weights(r["reply_start"], len(t), length)
        rep[i] = repeated(tokens[i], r["reply_start"], len(t))
    hidden, greedy = [], []
    for s in range(0, len(rows), batch):  # (b, L, H); the logits a batch at a time
        h = model.hidden(mx.array(tokens[s : s + batch]))
        g = mx.argmax(model.logits(h), axis=-1)
        hidden.append(np.array(h.astype(mx.float16)))
        greedy.append(np.array(g))
    feats = {"tokens": tokens, "hidden": np.concatenate(hidden)}
    feats["greedy"] = np.concatenate(greedy)
    return feats, weight, rep


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--replies", required=True)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="replies per kind")
    args = p.parse_args()
    if not Path(args.replies).is_file():
        p.error(f"no such replies file: {args.replies}")
    print(f"BLAS: {ensure_fast_blas()}")

    import numpy as np

    from mlx_mtp.convert.train_heads import evaluate
    from mlx_mtp.errors import MTPError
    from mlx_mtp.loading import load

    try:
        model, _ = load(args.model)
    except MTPError as e:
        p.error(str(e))
    W, remap = draft_rows(model)
    records = [json.loads(line) for line in Path(args.replies).read_text().splitlines()]
    length = max(len(r["tokens"]) for r in records) + args.depth + 1
    print(
        f"{'kind':>5} {'tokens':>7} {'repeated':>8}  "
        "agreement per depth: all | repeated | novel"
    )
    for kind in sorted({r["kind"] for r in records}):
        rows = [r for r in records if r["kind"] == kind][: args.limit]
        feats, weight, rep = features(model, rows, length)
        scores = []
        for mask in (np.ones_like(rep), rep, ~rep):
            feats["weight"] = (weight * mask).astype(np.uint8)
            agreement, _ = evaluate(model.mtp, model, W, remap, feats, args.depth)
            scores.append(" ".join(f"{a:.3f}" for a in agreement))
        n = int(weight.sum())
        share = (weight * rep).sum() / max(n, 1)
        print(f"{kind:>5} {n:7d} {share:8.3f}  " + " | ".join(scores))


if __name__ == "__main__":
    main()

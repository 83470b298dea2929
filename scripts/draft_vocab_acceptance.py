"""Expected acceptance of the first MTP head with each draft vocabulary, exactly.

A benchmark's acceptance comes from a few hundred sampled tokens and moves by several
points between runs; this measures what a draft vocabulary costs in acceptance without
that noise. It samples continuations of prompts cut from the built-in calibration text
from the trunk (temperature --temp), then, teacher-forced at every position, computes
the expected acceptance of a draft from the first head, sum_y min(p(y), q(y)) with p the
trunk's distribution and q the head's over the draft vocabulary (renormalised over its
rows; both at --temp); at --temp 0 the agreement of the argmaxes. It also prints the
share of the sampled tokens inside each draft vocabulary.

    python scripts/draft_vocab_acceptance.py --model M [--sizes 2048 4096 8192]
        [--temp 1.0] [--prompts 8] [--tokens 256]
"""

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402


def samples(model, prompts, tokens: int, temp: float, seed: int):
    """(seq (1, L), hidden (1, L, H), log p (1, L, V), prompt length) per prompt: the
    trunk's continuation sampled at ``temp`` (greedy at 0)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=temp)
    out = []
    for prompt in prompts:
        steps = generate_step(
            mx.array(prompt), model.trunk, max_tokens=tokens, sampler=sampler
        )
        seq = mx.array(prompt + [int(t) for t, _ in steps])[None]
        h = model.hidden(seq)
        logp = scaled_logp(model.logits(h), temp)
        mx.eval(h, logp)
        out.append((seq, h, logp, len(prompt)))
    return out


def scaled_logp(logits: mx.array, temp: float) -> mx.array:
    logits = logits / temp if temp > 0 else logits
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def acceptance(model, features, vocab, temp: float) -> float:
    """Mean over the generated positions of the expected acceptance of a first-head
    draft from ``vocab`` (None: the whole head)."""
    total = rows = 0
    for seq, h, logp, start in features:
        z = model.mtp_forward(0, h[:, :-1], seq[:, 1:])  # row i predicts token i + 2
        lq = scaled_logp(model.draft_logits(z, vocab), temp)[:, start - 2 :]
        lp = logp[:, start - 1 :]  # p at the positions of the generated tokens
        if temp > 0:
            total += mx.minimum(mx.exp(lp), mx.exp(lq)).sum().item()
        else:
            total += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        rows += lq.shape[1]
    return total / rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--temp", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(ensure_fast_blas())

    from mlx_mtp import draft_vocab
    from mlx_mtp.loading import load

    model, tokenizer = load(args.model)
    ranking = draft_vocab.ranking_for(model, tokenizer)
    if ranking is None:
        sys.exit("error: no ranking of the vocabulary for this model")
    V = model.args.vocab_size
    sizes = args.sizes or draft_vocab.auto_sizes(V)
    ids = draft_vocab.calibration_ids(tokenizer)
    n = args.prompt_tokens
    step = max(n, len(ids) // args.prompts)
    prompts = [ids[i : i + n] for i in range(0, step * args.prompts, step)]
    features = samples(model, prompts, args.tokens, args.temp, args.seed)
    emitted = np.concatenate([np.array(s[0, start:]) for s, _, _, start in features])
    print(f"{len(emitted)} positions, temperature {args.temp}, vocabulary {V}")
    full = acceptance(model, features, None, args.temp)
    print(f"{'full':>8}  acceptance {full:.4f}")
    for size in sizes:
        a = acceptance(model, features, size, args.temp)
        inside = np.isin(emitted, np.array(ranking.rows(size))).mean()
        print(
            f"{size:>8}  acceptance {a:.4f} ({a - full:+.4f})"
            f"  sampled tokens inside {inside:.3f}"
            f"  calibration coverage {ranking.coverage(size):.3f}"
        )


if __name__ == "__main__":
    main()

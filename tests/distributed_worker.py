"""One rank of a distributed test run (launched by `tests/test_distributed.py` through
``mlx.launch``): load each model (sharded over the ranks), decode, and write this
rank's tokens as JSON to ``OUT.<rank>``, a list with one entry per model.

    python distributed_worker.py OUT MODEL [MODEL ...]
    python distributed_worker.py OUT MODEL --rank-1 MODEL_OF_RANK_1
"""

import json
import sys

from mlx_mtp import load
from mlx_mtp.distributed import world
from mlx_mtp.errors import MTPError
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

PROMPT = "def forward(self, x):"
TOKENS = 16


def main():
    rank = world().rank()
    out, paths = sys.argv[1], sys.argv[2:]
    if "--rank-1" in paths:  # a different model folder on rank 1
        paths = [paths[0] if rank == 0 else paths[2]]
    results = []
    for path in paths:
        try:
            model, tokenizer = load(path)
        except MTPError as e:
            print(f"rank {rank}: mlx-mtp: error: {e}", file=sys.stderr)
            sys.exit(1)
        results.append(decode(model, tokenizer))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def prompt_ids(tokenizer) -> list:
    """`PROMPT`'s ids; ids 10..29 for a fixture whose tokenizer knows none of its
    text (the DSpark target's, whose 64 ids are all special)."""
    return tokenizer.encode(PROMPT) or list(range(10, 30))


def decode(model, tokenizer) -> dict:
    """This rank's sharding and drafter, and `runs`."""
    out = {"sharding": model.sharding, "ranks": world().size()}
    out["drafter"] = model.drafter is not None
    return {**out, **runs(model, prompt_ids(tokenizer))}


def runs(model, ids) -> dict:
    """The tokens of greedy runs at k = 0..3 and auto (and the drafts each fixed k
    accepted) and of seeded sampled runs at k = 0 and 2."""
    out = {}
    for k in (0, 1, 2, 3, "auto"):
        steps = list(
            mtp_generate_step(ids, model, HEADS, num_draft_tokens=k, max_tokens=TOKENS)
        )
        out[f"greedy-{k}"] = [o.token for o in steps]
        if k != "auto":  # auto's lengths follow the history, of this process only
            out[f"accepted-{k}"] = steps[-1].stats.accepted
    for k in (0, 2):
        steps = mtp_generate_step(
            ids, model, HEADS, num_draft_tokens=k, max_tokens=TOKENS, temp=1.0, seed=7
        )
        out[f"sampled-{k}"] = [o.token for o in steps]
    return out


if __name__ == "__main__":
    main()

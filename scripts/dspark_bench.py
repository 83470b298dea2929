"""DSpark block drafting measured against plain mlx-lm decoding, the same target with
a one-layer MTP head, and two peer runtimes' DSpark loops (mlx-dspark, mlx-vlm), on the
same files, interleaved in one process (one BLAS for all: scripts/fast_blas.py).

    python scripts/dspark_bench.py --target T --drafter D [--tokens 96] [--reps 3]
        [--trunk TRUNK] [--k auto 7] [--vlm VLM --vlmdeps VLMDEPS --dspark DSPARK]
        [--dspark-settings defaults auto full 4] [--vlm-settings defaults full 4]
        [--json out.json]

Made for the synthetic pair of ``make_synthetic_model.py --layout qwen3 --dspark D``
(a ~300M Qwen3 target with a DSpark drafter of 6% of its parameters and a one-layer
MTP head at ``model.layers.{L}``), but any Qwen3 target with a DeepSpec-layout drafter
folder runs. mlx-vlm reads the nested spelling (``dflash_config``), so the drafter is
copied into it in a temporary folder (the same tensors). A DFlash2 drafter
(``--drafter-kind dflash2``) is read by mlx-vlm as it is; mlx-dspark has no DFlash2
(run it with ``--dspark-settings`` and no setting). The peers are installed apart
(see peer_dspark.py) and driven by peer_decode.py; each runs a few settings (its
defaults, its adaptive policy, its whole block, a fixed length) so that its best one is
found in the same run.

Every engine decodes ``--tokens`` tokens greedily after each prompt, every repetition
runs every engine on every prompt in turn (the first repetition warms up and is not
timed), and each engine's tokens are checked against mlx-lm's. Reported per engine:

- tok/s end to end (prefill of the short prompt included, the same for all; the
  median over repetitions of tokens / seconds summed over the prompts) and its ratio
  to mlx-lm; decode tok/s (after the first token) beside it;
- tokens per target pass (the prefill's included for the peers, which take the first
  token from it, as mlx-mtp's first round verifies a block within it);
- for mlx-mtp, acceptance per position and the draft lengths ``-k auto`` picked;
- the costs: one verify of n tokens, the drafter's block pass and an MTP head's draft
  step, as shares of a plain step t(1) (`mlx_mtp.bench.costs`).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PEERS = "/work/peers"  # where this project's scripts install the peers by default


def _k(value: str):
    return value if value == "auto" else int(value)


def nested_copy(src: Path, dst: Path) -> Path:
    """``src`` (a DeepSpec drafter folder) in mlx-vlm's nested spelling: the
    drafter keys under ``dflash_config``, tensors under ``model.``, without the
    copies of the target's embedding and head (mlx-vlm binds the target's)."""
    import mlx.core as mx

    config = json.loads((src / "config.json").read_text())
    taps = {k: config.pop(k) for k in ("mask_token_id", "target_layer_ids")}
    config.pop("num_anchors", None)
    config["architectures"] = ["DSparkDraftModel"]
    config["dflash_config"] = {"projector_type": "dspark", **taps}
    weights = mx.load(str(src / "model.safetensors"))
    shared = ("embed_tokens.weight", "lm_head.weight")
    weights = {f"model.{k}": v for k, v in weights.items() if k not in shared}
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, {"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


class Ours:
    """mlx-mtp's `mtp_generate_step` on ``model`` at draft length ``k`` (greedy, the
    product's defaults otherwise), run as `stream_generate` runs it."""

    def __init__(self, name, model, k):
        self.name, self.model, self.k = name, model, k

    def generate(self, prompt, n):
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        from mlx_mtp.speculative import mtp_generate_step

        tokens, start, first, last = [], time.perf_counter(), None, None
        steps = mtp_generate_step(
            prompt, self.model, num_draft_tokens=self.k, max_tokens=n
        )
        with mx.stream(generation_stream):
            for out in steps:
                first = first or time.perf_counter()
                tokens.append(int(out.token))
                last = out
                if len(tokens) == n:
                    break
        steps.close()
        s = last.stats
        return {
            "tokens": tokens,
            "seconds": time.perf_counter() - start,
            "first": first - start,
            "passes": s.rounds,
            "stats": s,
        }


class Plain:
    """mlx-lm's ``generate_step`` on the trunk, argmax."""

    name = "mlx-lm"

    def __init__(self, trunk):
        self.trunk = trunk

    def generate(self, prompt, n):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        tokens, start, first = [], time.perf_counter(), None
        sampler = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
        for token, _ in generate_step(
            mx.array(prompt), self.trunk, max_tokens=n, sampler=sampler
        ):
            first = first or time.perf_counter()
            tokens.append(int(token))
        return {
            "tokens": tokens,
            "seconds": time.perf_counter() - start,
            "first": first - start,
            "passes": n,
        }


class Peer:
    """A peer_decode.py peer at one setting of its draft length."""

    def __init__(self, peer, label, **options):
        self.peer, self.options = peer, options
        self.name = f"{peer.name} {label}"

    def generate(self, prompt, n):
        r = self.peer.generate(prompt, n, **self.options)
        r["first"] = r["prefill_s"]
        return r


# each peer's settings (`Peer` options), by name: its defaults, its adaptive
# policy, its whole block and fixed lengths (4; mlx-vlm's 3 to 7)
DSPARK_SETTINGS = {
    "defaults": ("defaults (static cap, lookup)", dict(block=None)),
    "auto": ("auto cap", dict(block="auto")),
    "full": ("whole block", dict(block="full", lookup=False)),
    "4": ("cap 4", dict(block=4, lookup=False)),
}
VLM_SETTINGS = {
    "defaults": ("defaults (adaptive)", dict(block=None)),
    "full": ("whole block", dict(block="full", adaptive=False)),
    **{str(k): (f"k {k}", dict(block=k, adaptive=False)) for k in range(3, 8)},
}


def peer_engines(args, tmp: Path) -> list:
    """The peers at the settings ``args.dspark_settings`` and ``args.vlm_settings``
    ask for (none with ``--no-peers``)."""
    if args.no_peers:
        return []
    from peer_decode import DsparkPeer, VlmPeer

    from mlx_mtp.models import dflash

    trunk = args.trunk or args.target
    engines = []
    if args.dspark_settings:
        ds = DsparkPeer(trunk, args.drafter, calibration_dir=tmp)
        for name in args.dspark_settings:
            label, options = DSPARK_SETTINGS[name]
            engines.append(Peer(ds, label, **options))
    if args.vlm_settings:
        config = json.loads((args.drafter / "config.json").read_text())
        folder = args.drafter  # a DFlash-kin folder: mlx-vlm reads it as it is
        if not dflash.kind(config):
            folder = nested_copy(args.drafter, tmp / "nested")
        vlm = VlmPeer(trunk, folder)
        for name in args.vlm_settings:
            label, options = VLM_SETTINGS[name]
            engines.append(Peer(vlm, label, **options))
    return engines


def run(engines, prompts, n, reps, log):
    """{engine name: [per repetition: [per prompt: result]]}, interleaved; the
    first repetition is a warm-up and not kept."""
    out = {e.name: [] for e in engines}
    for rep in range(reps + 1):
        for e in engines:
            results = [e.generate(p, n) for p in prompts]
            if rep:
                out[e.name].append(results)
            secs = sum(r["seconds"] for r in results)
            tag = "warm-up" if not rep else f"rep {rep}"
            log(f"  {tag:8} {e.name:28} {len(prompts) * n / secs:6.2f} tok/s")
    return out


def summarise(name, reps, reference, n):
    """One engine's figures over its repetitions (see the module docstring)."""
    runs = [r for rep in reps for r in rep]
    rates = [
        sum(len(r["tokens"]) for r in rep) / sum(r["seconds"] for r in rep)
        for rep in reps
    ]
    decode = [
        sum(len(r["tokens"]) - 1 for r in rep)
        / sum(r["seconds"] - r["first"] for r in rep)
        for rep in reps
    ]
    same = all(r["tokens"] == reference[i % len(reference)] for i, r in enumerate(runs))
    row = {
        "engine": name,
        "tok_s": statistics.median(rates),
        "decode_tok_s": statistics.median(decode),
        "tok_s_reps": rates,
        "tokens_per_pass": sum(len(r["tokens"]) for r in runs)
        / sum(r["passes"] for r in runs),
        "identical": same,
    }
    stats = [r["stats"] for r in runs if "stats" in r]
    if stats:
        total = stats[0]
        for s in stats[1:]:
            total = total + s
        row["acceptance"] = [round(a, 3) for a in total.acceptance_per_position]
        row["draft_lengths"] = dict(
            sorted(
                Counter({k: c for k, c in enumerate(total.rounds_by_k) if c}).items()
            )
        )
        row["mean_draft_length"] = total.mean_draft_length
    settings = [r["settings"] for r in runs if "settings" in r]
    if settings:
        row["settings"] = settings[-1]
        row["drafts"] = Counter(b for r in runs for b in r["blocks"])
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument(
        "--trunk",
        type=Path,
        default=None,
        help="the target without its MTP head, for the peers (mlx-lm's qwen3 "
        "loader refuses the head's tensors; strip_mtp.py writes one)",
    )
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=_k, nargs="+", default=["auto"])
    p.add_argument("--vlm", default=f"{PEERS}/vlm")
    p.add_argument("--vlmdeps", default=f"{PEERS}/vlmdeps")
    p.add_argument("--dspark", default=f"{PEERS}/dspark")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument(
        "--dspark-settings",
        nargs="*",
        choices=sorted(DSPARK_SETTINGS),
        default=list(DSPARK_SETTINGS),
        help="mlx-dspark's settings to run",
    )
    p.add_argument(
        "--vlm-settings",
        nargs="*",
        choices=sorted(VLM_SETTINGS),
        default=list(VLM_SETTINGS),
        help="mlx-vlm's settings to run",
    )
    p.add_argument("--no-heads", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    blas = ensure_fast_blas()
    if not args.no_peers:
        sys.path[:0] = [args.vlm, args.vlmdeps, args.dspark]
    import mlx.core as mx
    import numpy as np

    from mlx_mtp import load
    from mlx_mtp.bench import WORKLOADS, costs

    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"BLAS: {blas}; device {mx.default_device()}")
    model, tokenizer = load(str(args.target), draft_model=str(args.drafter))
    prompts = [
        tokenizer.encode(WORKLOADS["code"]),
        np.random.default_rng(0).integers(0, 512, 32).tolist(),
    ]
    engines = [Plain(model.trunk)]
    engines += [Ours(f"mlx-mtp drafter k={k}", model, k) for k in args.k]
    heads = None
    if not args.no_heads:
        heads = load(str(args.target))[0]
        engines.append(Ours("mlx-mtp MTP head k=auto", heads, "auto"))
    with tempfile.TemporaryDirectory() as tmp:
        engines += peer_engines(args, Path(tmp))
        c = costs(model, prompts[0], model.drafter.block_size, args.reps)
        if heads is not None:
            c["draft"] = costs(heads, prompts[0], 1, args.reps)["draft"]
        shares = {k: v / c["verify_1"] for k, v in c.items()}
        log(
            "costs as shares of t(1): "
            + ", ".join(f"{k} {v:.2f}" for k, v in shares.items())
        )
        reference = [
            Plain(model.trunk).generate(q, args.tokens)["tokens"] for q in prompts
        ]
        results = run(engines, prompts, args.tokens, args.reps, log)
    rows = [summarise(e.name, results[e.name], reference, args.tokens) for e in engines]
    base = rows[0]["tok_s"]
    for r in rows:
        r["ratio"] = r["tok_s"] / base
        extra = ""
        if "acceptance" in r:
            extra = f" accept {r['acceptance']} k picked {r['draft_lengths']}"
        if "drafts" in r:
            extra = f" drafted per round {dict(sorted(r['drafts'].items()))}"
        log(
            f"{r['engine']:40} {r['tok_s']:6.2f} tok/s {r['ratio']:5.2f}x "
            f"(decode {r['decode_tok_s']:6.2f}) {r['tokens_per_pass']:4.2f} tok/pass "
            f"identical {r['identical']}{extra}"
        )
    if args.json:
        for r in rows:
            r.pop("drafts", None)
        out = {
            "blas": blas,
            "tokens": args.tokens,
            "reps": args.reps,
            "costs": c,
            "cost_shares": shares,
            "rows": rows,
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    from mlx_mtp.errors import MTPError

    try:
        main()
    except MTPError as e:  # a bad folder or option: one line, as the CLI says it
        sys.exit(f"dspark_bench.py: {e}")

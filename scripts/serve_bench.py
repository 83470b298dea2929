"""`mlx-mtp serve` measured: per-request overhead against a direct `generate` call and
time to first token, then aggregate tokens/s with 1, 2 and 4 concurrent clients
against `mlx_lm.server` on the same model, in one run (greedy, text completions,
every request a different prompt of about 40 tokens).

    python scripts/serve_bench.py --model PATH [--tokens 64] [--requests 4]
        [--clients 1 2 4]

PATH: a model both load, e.g. an MLX conversion with heads from
make_synthetic_model.py (mlx-lm ignores the heads file). On Linux CPUs it first
switches MLX's float32 matmuls to OpenBLAS (fast_blas.py), for both servers.
"""

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PROMPT = "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a)"


def prompt(i: int) -> str:
    return f"# task {i}\n{PROMPT}"


def complete(port: int, text: str, tokens: int, stream: bool = False):
    """One request; returns (seconds, seconds to the first token, completion tokens)."""
    body = {"prompt": text, "max_tokens": tokens, "temperature": 0.0}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    tic = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body).encode())
    r = conn.getresponse()
    first, n = None, 0
    if not stream:
        data = json.loads(r.read())
        n = data["usage"]["completion_tokens"]
        return time.perf_counter() - tic, None, n
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - tic
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
        if line.startswith(b"data: [DONE]"):
            break
    return time.perf_counter() - tic, first, n


def aggregate(port: int, clients: int, requests: int, tokens: int) -> float:
    """Completion tokens per second over ``clients`` threads of ``requests`` each."""
    counts = []

    def run(c):
        for r in range(requests):
            counts.append(complete(port, prompt(100 * c + r), tokens)[2])

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - tic)


def wait(port: int, proc=None, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("mlx_lm.server exited")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no server on port {port}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    args = p.parse_args()
    blas = ensure_fast_blas()
    from mlx_mtp import generate, load
    from mlx_mtp.server import Server, server_args

    print(f"BLAS: {blas}; model {args.model}", flush=True)
    ours = Server(server_args(model=args.model, port=free_port())).start()
    wait(ours.port)
    lm_port = free_port()
    lm = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm.server", "--model", args.model]
        + ["--port", str(lm_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    try:
        wait(lm_port, lm)
        model, tokenizer = load(args.model)
        for port in (ours.port, lm_port):  # warm up both (costs, compilation)
            complete(port, prompt(-1), args.tokens)

        direct, served, ttft = [], [], []
        for i in range(args.reps):
            text = prompt(1000 + i)
            ids = tokenizer.encode(text)
            tic = time.perf_counter()
            generate(model, tokenizer, ids, max_tokens=args.tokens)
            direct.append(time.perf_counter() - tic)
            served.append(complete(ours.port, text + " ", args.tokens)[0])
            ttft.append(complete(ours.port, text + "  ", args.tokens, True)[1])
        d, s = statistics.median(direct), statistics.median(served)
        print(
            f"one request of {args.tokens} tokens: generate {1e3 * d:.0f} ms, served "
            f"{1e3 * s:.0f} ms (overhead {1e3 * (s - d):+.0f} ms, {s / d:.3f}x); "
            f"time to first token {1e3 * statistics.median(ttft):.0f} ms",
            flush=True,
        )
        results = {}
        for clients in args.clients:
            rate = {}
            for name, port in (("mlx-mtp", ours.port), ("mlx_lm.server", lm_port)):
                rate[name] = aggregate(port, clients, args.requests, args.tokens)
            results[clients] = rate
            print(
                f"{clients} client(s) x {args.requests} requests: mlx-mtp "
                f"{rate['mlx-mtp']:.1f} tok/s, mlx_lm.server "
                f"{rate['mlx_lm.server']:.1f} tok/s "
                f"({rate['mlx-mtp'] / rate['mlx_lm.server']:.2f}x)",
                flush=True,
            )
        print(json.dumps(dict(blas=blas, overhead_s=s - d, results=results)))
    finally:
        lm.terminate()
        ours.close()


if __name__ == "__main__":
    main()

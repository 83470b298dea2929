"""`mlx-mtp serve` against `mlx_lm.server` on the same model, in one run: greedy text
completions, streamed, every request a different prompt of about 40 tokens.

    python scripts/serve_bench.py --model PATH [--tokens 64] [--requests 2]
        [--clients 1 2 4 8] [--reps 3] [--max-batch N] [--hol-tokens 500]
        [--serve-args "--draft-vocab full"] [--json out.json]

The script starts both servers (each its own process, on a free port) and measures:

1. one request alone: mlx-mtp serve's time against a direct `mlx_mtp.generate` call
   in this process (the server's own overhead; the call has the library's default
   options, which ``--serve-args`` may change for the server), and its time to first
   token;
2. per number of clients C: C threads, each sending ``--requests`` requests one after
   another, streamed; per server the aggregate tokens/s (completion tokens over the
   wall time), time to first token (p50 over the requests), the inter-token latency
   (the gaps between successive streamed chunks, p50 and p95 over every request's
   gaps: MTP sends a round's tokens together, so its p50 can be ~0 and its p95 is
   about a round) and the time per output token after the first (p50 over the
   requests); the two servers take turns, ``--reps`` times (medians of the rates);
3. head-of-line: one client streams a ``--hol-tokens`` reply; 1 s after it was sent
   (once it streams) a second request (a short prompt, 16 tokens) arrives. Reported
   per server: the second's time to first token, its prefill (its time to first
   token alone on the idle server, median of 3) and the first reply's median round
   time (its gaps between chunks of at least 2 ms: tokens of one round arrive
   together), and whether the first token came within the prefill plus two rounds.

PATH: a model both load, e.g. an MLX conversion with heads from
make_synthetic_model.py (mlx-lm ignores the MTP tensors of the Qwen3.5 layout; for
the llama layout give ``--lm-model`` the trunk alone: scripts/strip_mtp.py).
``--max-batch`` is passed to mlx-mtp serve (its rows at most); without it the
server's default applies;
``--serve-args`` adds options of its own (on the synthetic models, ``--draft-vocab
full`` measures the heads as built). On Linux CPUs it first switches MLX's float32
matmuls to OpenBLAS with one thread (fast_blas.py), for this process and both servers.
"""

import argparse
import http.client
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PROMPT = "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a)"
SHORT_TOKENS = 16  # the head-of-line test's second reply
ROUND_GAP = 0.002  # seconds: chunk gaps at least this long separate rounds


def prompt(i: int) -> str:
    return f"# task {i}\n{PROMPT}"


@dataclass
class Reply:
    """One request's timings (seconds from sending it) and completion tokens."""

    seconds: float
    first: Optional[float] = None
    tokens: int = 0
    chunks: List[float] = field(default_factory=list)  # arrival of each chunk

    @property
    def gaps(self) -> List[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def per_token(self) -> Optional[float]:
        """Seconds per completion token after the first."""
        if self.first is None or self.tokens < 2:
            return None
        return (self.seconds - self.first) / (self.tokens - 1)


def complete(port: int, text: str, tokens: int, stream: bool = True, on_first=None):
    """One greedy text completion (a `Reply`); ``on_first()`` is called when the
    first streamed token arrives."""
    body = {"prompt": text, "max_tokens": tokens, "temperature": 0.0}
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    tic = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
    if not stream:
        data = json.loads(r.read())
        return Reply(
            time.perf_counter() - tic, tokens=data["usage"]["completion_tokens"]
        )
    reply = Reply(0.0)
    while True:
        line = r.fp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            now = time.perf_counter() - tic
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices") or ()):
                reply.chunks.append(now)
                if reply.first is None:
                    reply.first = now
                    if on_first is not None:
                        on_first()
            if chunk.get("usage"):
                reply.tokens = chunk["usage"]["completion_tokens"]
    reply.seconds = time.perf_counter() - tic
    conn.close()
    return reply


def concurrent(port: int, clients: int, requests: int, tokens: int, base: int):
    """``clients`` threads of ``requests`` streamed requests each: (tokens/s over the
    wall time, the replies)."""
    replies = []

    def run(c):
        for r in range(requests):
            replies.append(complete(port, prompt(base + 100 * c + r), tokens))

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(r.tokens for r in replies) / (time.perf_counter() - tic), replies


def quantile(values: List[float], q: float) -> float:
    """The q-quantile (linear between order statistics); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    x = q * (len(s) - 1)
    i = int(x)
    return s[i] + (s[min(i + 1, len(s) - 1)] - s[i]) * (x - i)


def latency(replies: List[Reply]) -> dict:
    """Time to first token, inter-chunk gaps and time per token after the first."""
    gaps = [g for r in replies for g in r.gaps]
    per_token = [r.per_token for r in replies if r.per_token is not None]
    return {
        "ttft_p50": quantile([r.first for r in replies if r.first is not None], 0.5),
        "itl_p50": quantile(gaps, 0.5),
        "itl_p95": quantile(gaps, 0.95),
        "tpot_p50": quantile(per_token, 0.5),
    }


def first_token(reply: Reply) -> float:
    """Its time to first token; nan when no text came."""
    return float("nan") if reply.first is None else reply.first


def short_prompt(i: int) -> str:
    return prompt(i)[:40]


def head_of_line(port: int, long_tokens: int, base: int) -> dict:
    """A ``long_tokens`` reply streaming, and a short request 1 s after it was sent
    (or at its first token, if that comes later). Every prompt is a different one
    (no prompt cache serves it)."""
    alone = [
        first_token(complete(port, short_prompt(base + 1 + i), SHORT_TOKENS))
        for i in range(3)
    ]
    result, decoding = {}, threading.Event()

    def long_reply():
        result["long"] = complete(
            port, prompt(base), long_tokens, on_first=decoding.set
        )

    started = time.perf_counter()
    thread = threading.Thread(target=long_reply)
    thread.start()
    decoding.wait(900)
    time.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
    delay = time.perf_counter() - started
    second = complete(port, short_prompt(base + 4), SHORT_TOKENS)
    thread.join()
    long = result["long"]
    rounds = [g for g in long.gaps if g >= ROUND_GAP]
    prefill = statistics.median(alone)
    round_s = statistics.median(rounds) if rounds else float("nan")
    return {
        "long_tokens": long.tokens,
        "second_sent_after_s": delay,
        "second_ttft_s": first_token(second),
        "prefill_s": prefill,
        "round_s": round_s,
        "within_prefill_plus_two_rounds": first_token(second) <= prefill + 2 * round_s,
    }


def wait(port: int, proc, log: Path, timeout: float = 1800) -> None:
    """Until the server on ``port`` answers /health (it may time the model's rounds
    first); exit with its log's tail if it stops."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log.read_text(errors="replace")
        if proc.poll() is not None or "generation thread died" in text:
            proc.kill()  # mlx_lm.server answers 503 for ever once its thread died
            tail = [x for x in text.splitlines() if "GET /health" not in x][-8:]
            raise SystemExit(f"server on port {port} failed:\n" + "\n".join(tail))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no server on port {port} after {timeout:.0f} s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_max_batch() -> bool:
    """Whether this mlx-mtp serve takes --max-batch."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_mtp", "serve", "--help"],
        capture_output=True,
        text=True,
    )
    return "--max-batch" in out.stdout


def start(name: str, command: List[str], logs: Path):
    """Start a server process, its output to ``logs/name.log``; (process, port,
    log)."""
    port = free_port()
    log = logs / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            command + ["--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
    return proc, port, log


def servers(args, logs: Path):
    """The commands of both servers."""
    ours = [sys.executable, "-m", "mlx_mtp", "serve", "--model", args.model]
    if args.max_batch is not None:
        if not has_max_batch():
            raise SystemExit("this mlx-mtp serve has no --max-batch option")
        ours += ["--max-batch", str(args.max_batch)]
    ours += shlex.split(args.serve_args)
    lm = [sys.executable, "-m", "mlx_lm.server", "--model", args.lm_model or args.model]
    return {
        "mlx-mtp": start("mlx-mtp", ours, logs),
        "mlx-lm": start("mlx-lm", lm, logs),
    }


def one_request(port: int, args) -> dict:
    """A served request against a direct `generate` call in this process."""
    from mlx_mtp import generate, load

    model, tokenizer = load(args.model)
    generate(model, tokenizer, tokenizer.encode(prompt(999)), max_tokens=args.tokens)
    direct, served, ttft = [], [], []
    for i in range(args.reps):
        text = prompt(1000 + i)
        ids = tokenizer.encode(text)
        tic = time.perf_counter()
        generate(model, tokenizer, ids, max_tokens=args.tokens)
        direct.append(time.perf_counter() - tic)
        served.append(complete(port, text, args.tokens, stream=False).seconds)
        ttft.append(complete(port, prompt(2000 + i), args.tokens).first)
    d, s = statistics.median(direct), statistics.median(served)
    print(
        f"one request of {args.tokens} tokens: generate {1e3 * d:.0f} ms, served "
        f"{1e3 * s:.0f} ms (overhead {1e3 * (s - d):+.0f} ms, {s / d:.3f}x); "
        f"time to first token {1e3 * statistics.median(ttft):.0f} ms",
        flush=True,
    )
    return {"generate_s": d, "served_s": s, "ttft_s": statistics.median(ttft)}


def by_clients(ports: dict, args) -> dict:
    """Aggregate rates and latencies per number of clients, both servers in turn."""
    print(
        f"{'C':>2} {'server':>8} {'tok/s':>7} {'ratio':>6} {'ttft p50':>9} "
        f"{'itl p50':>8} {'itl p95':>8} {'tpot p50':>9}   (ms)",
        flush=True,
    )
    out = {}
    for clients in args.clients:
        rates = {n: [] for n in ports}
        replies = {n: [] for n in ports}
        for rep in range(args.reps):
            order = list(ports) if rep % 2 == 0 else list(ports)[::-1]
            for name in order:
                base = 10000 * (rep + 1) + 1000 * clients
                rate, got = concurrent(
                    ports[name], clients, args.requests, args.tokens, base
                )
                rates[name].append(rate)
                replies[name] += got
        rows = {}
        for name in ports:
            rows[name] = {"tok_s": statistics.median(rates[name]), "rates": rates[name]}
            rows[name].update(latency(replies[name]))
        ratio = rows["mlx-mtp"]["tok_s"] / rows["mlx-lm"]["tok_s"]
        for name, r in rows.items():
            shown = f"{ratio:6.2f}" if name == "mlx-mtp" else " " * 6
            print(
                f"{clients:>2} {name:>8} {r['tok_s']:7.1f} {shown} "
                f"{1e3 * r['ttft_p50']:9.0f} {1e3 * r['itl_p50']:8.1f} "
                f"{1e3 * r['itl_p95']:8.1f} {1e3 * r['tpot_p50']:9.1f}",
                flush=True,
            )
        out[clients] = {"ratio": ratio, **rows}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument(
        "--lm-model",
        default=None,
        help="the folder mlx_lm.server loads (default --model): the same trunk "
        "without the MTP tensors, for a layout whose sanitize keeps them",
    )
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument(
        "--serve-args",
        default="",
        help="more mlx-mtp serve options, e.g. '--draft-vocab full'",
    )
    p.add_argument(
        "--hol-tokens", type=int, default=500, help="head-of-line: the long reply"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if min(args.tokens, args.requests, args.reps, args.hol_tokens) < 1:
        p.error("--tokens, --requests, --reps and --hol-tokens must be at least 1")
    if min(args.clients) < 1 or (args.max_batch is not None and args.max_batch < 1):
        p.error("--clients and --max-batch must be at least 1")
    blas = ensure_fast_blas()
    print(f"BLAS: {blas}; model {args.model}", flush=True)
    with tempfile.TemporaryDirectory() as logs:
        started = servers(args, Path(logs))
        try:
            ports = {}
            for name, (proc, port, log) in started.items():
                wait(port, proc, log)
                ports[name] = port
            for port in ports.values():  # warm up both (compilation, batch shapes)
                concurrent(port, max(args.clients), 1, 8, -100000)
            result = dict(blas=blas, model=args.model, tokens=args.tokens)
            result.update(requests=args.requests, reps=args.reps)
            result.update(max_batch=args.max_batch, hol_tokens=args.hol_tokens)
            result.update(serve_args=args.serve_args)
            result["one_request"] = one_request(ports["mlx-mtp"], args)
            result["clients"] = by_clients(ports, args)
            result["head_of_line"] = {}
            for name, port in ports.items():
                h = head_of_line(port, args.hol_tokens, 900000)
                result["head_of_line"][name] = h
                print(
                    f"head-of-line, {name}: second request's first token "
                    f"{1e3 * h['second_ttft_s']:.0f} ms (its prefill alone "
                    f"{1e3 * h['prefill_s']:.0f} ms, round {1e3 * h['round_s']:.0f} "
                    f"ms; within prefill + 2 rounds: "
                    f"{'yes' if h['within_prefill_plus_two_rounds'] else 'no'}; "
                    f"the long reply: {h['long_tokens']} tokens)",
                    flush=True,
                )
            if args.json:
                args.json.write_text(json.dumps(result, indent=2))
        finally:
            for proc, _, _ in started.values():
                proc.terminate()
            for proc, _, _ in started.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()

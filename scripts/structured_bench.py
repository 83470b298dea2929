"""Structured output with MTP: speed on JSON-producing prompts against mlx-lm, and
the grammar's cost per round.

Per prompt (a JSON schema each), interleaved in one process, ``--reps`` times:
  mlx-lm          plain decoding, unconstrained (the reference of every ratio);
  mlx-lm+grammar  plain constrained decoding: mlx-lm's generate_step with a logits
                  processor over the same llguidance matcher;
  mtp k=...       mlx-mtp with the schema, for each ``--k``.
Every constrained run's tokens are checked equal to mlx-lm+grammar's (greedy), and
every output against the schema. The ``penalties`` workload has no schema: it runs
mlx-lm's penalties instead (mlx-lm+penalties: mlx-lm with those processors; mlx-mtp
runs with the same ones). The grammar's host time (masks, consumes, rollbacks) is
reported per round and per token. On Linux CPUs MLX's float32 matmuls
run on OpenBLAS, one thread (fast_blas.py).

    python scripts/structured_bench.py [--model PATH] [--tokens 160] [--reps 3]
        [--k 0 2 3 auto]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
    },
    "required": ["title", "author", "year"],
    "additionalProperties": False,
}
WORKLOADS = {
    "books": (
        "List three classic novels as a JSON array of objects with title, author "
        "and year.",
        {"type": "array", "items": BOOK, "minItems": 3, "maxItems": 3},
    ),
    "person": (
        "Give a JSON profile of a fictional software engineer: name, age, city, "
        "languages (a list) and whether they are remote.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "city": {"type": "string"},
                "languages": {
                    "type": "array",
                    "items": {"type": "string"},
                    "maxItems": 5,
                },
                "remote": {"type": "boolean"},
            },
            "required": ["name", "age", "city", "languages", "remote"],
            "additionalProperties": False,
        },
    ),
    "tool_call": (
        "Call the weather tool for Paris and Tokyo, in celsius, as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "cities": {"type": "array", "items": {"type": "string"}},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["cities", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ),
    "penalties": (
        "Write a short story about a robot who learns to paint.",
        None,
    ),
}
PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)


class Timed:
    """Host seconds spent in the grammar matcher's methods."""

    def __init__(self):
        from mlx_mtp import grammar

        self.seconds = 0.0
        self.calls = 0
        for name in ("mask", "consume", "rollback", "allows"):
            self._wrap(grammar.Matcher, name)

    def _wrap(self, cls, name):
        original = getattr(cls, name)

        def timed(*args, **kw):
            tic = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - tic
                self.calls += 1

        setattr(cls, name, timed)

    def take(self):
        out = self.seconds, self.calls
        self.seconds, self.calls = 0.0, 0
        return out


def mlx_lm_tokens(model, prompt, n, eos, procs=None):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    tic = time.perf_counter()
    for token, _ in generate_step(
        mx.array(prompt), model.trunk, max_tokens=n, logits_processors=procs
    ):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out, time.perf_counter() - tic


def grammar_processor(spec, tokenizer, vocab, prompt_len):
    """mlx-lm's processor view of plain constrained decoding: each call consumes
    the tokens generated since the last, then masks."""
    import mlx.core as mx

    from mlx_mtp.grammar import Matcher

    matcher, seen = Matcher(spec, tokenizer, vocab), [prompt_len]

    def process(tokens, logits):
        for t in tokens[seen[0] :].tolist():
            matcher.consume(t)
        seen[0] = len(tokens)
        return mx.where(matcher.mask(), logits, -mx.inf)

    return process


def penalty_processors():
    from mlx_lm.sample_utils import make_logits_processors

    p = PENALTIES
    return make_logits_processors(
        None,
        p["repetition_penalty"],
        20,
        p["presence_penalty"],
        20,
        p["frequency_penalty"],
        20,
    )


def mtp_tokens(model, tokenizer, prompt, n, spec, k):
    from mlx_mtp.speculative import mtp_generate_step

    out, stats = [], None
    rules = {"grammar": spec} if spec is not None else PENALTIES
    tic = time.perf_counter()
    steps = mtp_generate_step(
        prompt, model, num_draft_tokens=k, max_tokens=n, tokenizer=tokenizer, **rules
    )
    for step in steps:
        out.append(step.token)
        stats = step.stats
        if step.token in tokenizer.eos_token_ids:
            break
    steps.close()
    return out, time.perf_counter() - tic, stats


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the built-in demo model")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--k", nargs="+", default=["0", "2", "3", "auto"], help="draft lengths"
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = p.parse_args()
    blas = ensure_fast_blas()
    import jsonschema
    import mlx.core as mx

    from mlx_mtp import load
    from mlx_mtp.demo import demo_model
    from mlx_mtp.grammar import GrammarSpec, check_grammar

    path = args.model or str(demo_model())
    model, tokenizer = load(path)
    eos, vocab = set(tokenizer.eos_token_ids), model.args.vocab_size
    ks = [k if k == "auto" else int(k) for k in args.k]
    timer = Timed()
    print(f"BLAS: {blas}; device {mx.default_device()}; model {path}", flush=True)
    for name in args.workloads:
        text, schema = WORKLOADS[name]
        spec = GrammarSpec.json_schema(schema) if schema is not None else None
        if spec is not None:
            check_grammar(spec, tokenizer)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        rule = "mlx-lm+grammar" if spec is not None else "mlx-lm+penalties"
        times = {"mlx-lm": [], rule: [], **{f"mtp k={k}": [] for k in ks}}
        host, extra = {}, {}
        for rep in range(args.reps + 1):  # rep 0 warms up
            _, t = mlx_lm_tokens(model, prompt, args.tokens, eos)
            plain_n = len(_)
            if spec is not None:
                procs = [grammar_processor(spec, tokenizer, vocab, len(prompt))]
            else:
                procs = penalty_processors()
            ref, tg = mlx_lm_tokens(model, prompt, args.tokens, eos, procs)
            timer.take()
            if rep:
                times["mlx-lm"].append(plain_n / t)
                times[rule].append(len(ref) / tg)
            body = tokenizer.decode([t for t in ref if t not in eos])
            if schema is not None:
                jsonschema.validate(json.loads(body), schema)
            for k in ks:
                got, tm, stats = mtp_tokens(
                    model, tokenizer, prompt, args.tokens, spec, k
                )
                seconds, calls = timer.take()
                if got != ref:
                    raise SystemExit(f"{name} k={k}: tokens differ from plain decoding")
                if rep:
                    times[f"mtp k={k}"].append(len(got) / tm)
                    host.setdefault(k, []).append(
                        (seconds, stats.rounds, len(got), calls)
                    )
                    extra[k] = stats
        base = statistics.median(times["mlx-lm"])
        print(f"\n{name}: {len(ref)} tokens, {body[:70]!r}...")
        for label, values in times.items():
            med = statistics.median(values)
            line = f"  {label:16} {med:7.2f} tok/s  {med / base:5.2f}x mlx-lm"
            k = label[len("mtp k=") :] if label.startswith("mtp") else None
            if k is not None:
                k = k if k == "auto" else int(k)
                s, rounds, n, calls = (sum(x) / len(x) for x in zip(*host[k]))
                stats = extra[k]
                line += (
                    f"  | acc {stats.accepted}/{stats.drafted}"
                    f"  {n / rounds:.2f} tok/round"
                    f"  grammar {1e3 * s / rounds:.2f} ms/round"
                    f" ({1e3 * s / n:.3f} ms/token, {calls / rounds:.1f} calls/round)"
                )
            print(line, flush=True)


if __name__ == "__main__":
    main()

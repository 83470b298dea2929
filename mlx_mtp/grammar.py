"""Structured output: a grammar (JSON schema, any JSON object, regex, Lark) as a token
mask over the model's vocabulary, with llguidance as the engine.

This module owns the grammar's state over the generated tokens (consume, roll back,
mask). It knows nothing of models, caches or the decode loop. The engine is imported
when a grammar is first used, so that mlx-mtp without llguidance fails in one line.
"""

import functools
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .errors import MTPError, one_line

KINDS = ("json_schema", "json_object", "regex", "lark")

# JSON whitespace between tokens: at most 20 characters a gap (pretty-printed JSON
# fits; a model that falls into emitting spaces cannot run on until max_tokens).
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}
ANY_OBJECT = '{"type":"object"}'
# A forced tool call's JSON: written as the json_tools format's models write it.
TOOL_JSON = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(MTPError):
    """A schema, regex or grammar the engine refuses, or fails on while decoding (one
    of its limits reached: "Current row has 2407 items; max is 2000", "too many
    expressions constructed"); the message, one line, is its reason."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must follow; hashable (a field of `DecodeOptions`).

    ``kind`` is one of `KINDS`; ``source`` is the schema as compact JSON text (its
    keys in the schema's order: the order of ``properties`` is the order the
    object's keys are generated in), the regex or the Lark grammar ("" for
    ``json_object``).
    """

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected {KINDS}")
        if not isinstance(self.source, str):
            raise GrammarError(f"a {self.kind} grammar's source must be a string")

    @classmethod
    def json_schema(cls, schema: Union[dict, str]) -> "GrammarSpec":
        """A JSON schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(
                f"a JSON schema must be a JSON object, not {type(schema).__name__}"
            )
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"the JSON schema cannot be written as JSON: {e}")
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """The whole output matches ``pattern`` (Rust ``regex`` syntax)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regex grammar needs a non-empty pattern")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "GrammarSpec":
        """A Lark grammar in llguidance's dialect (rule ``start``)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("a Lark grammar needs a non-empty text")
        return cls("lark", grammar)


def grammar_fields(fields: dict) -> dict:
    """``fields`` with the shorthands ``json_schema`` (a dict or JSON text),
    ``json_object`` (True) and ``regex`` (a pattern) turned into the ``grammar``
    option (a `GrammarSpec`); more than one is a `GrammarError`."""
    given = {k: fields.pop(k, None) for k in ("json_schema", "json_object", "regex")}
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if len(given) + ("grammar" in fields and fields["grammar"] is not None) > 1:
        raise GrammarError("give one of json_schema, json_object, regex and grammar")
    if "json_schema" in given:
        fields["grammar"] = GrammarSpec.json_schema(given["json_schema"])
    elif "json_object" in given:
        fields["grammar"] = GrammarSpec.json_object()
    elif "regex" in given:
        fields["grammar"] = GrammarSpec.regex(given["regex"])
    return fields


def tool_calls(tools, tokenizer, name=None, parallel: bool = True) -> GrammarSpec:
    """A reply of tool calls only, in the model's JSON tool-call format (mlx-lm's
    ``json_tools`` parser: the template's start marker, ``{"name": ..., "arguments":
    {...}}``, its end marker): one call, or with ``parallel`` one or more, each to
    one of ``tools`` (OpenAI function tools) with arguments that follow its
    ``parameters``, or to the tool ``name`` alone. A tokenizer with another tool-call
    format is a `GrammarError` saying so."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    if parser is None or start is None:
        raise GrammarError("this model's chat template has no tool calls to force")
    if not module.endswith(".json_tools"):
        kind = module.rpartition(".")[2] or "its own"
        raise GrammarError(
            f"forcing a tool call needs a JSON tool-call format; this model's is "
            f"{kind} (mlx-lm's tool parser)"
        )
    calls = []
    for tool in tools or ():
        function = tool.get("function", {}) if isinstance(tool, dict) else {}
        if name is not None and function.get("name") != name:
            continue
        arguments = function.get("parameters") or {"type": "object"}
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function.get("name")},
                    "arguments": arguments,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not calls:
        wanted = f"a tool named {name!r}" if name is not None else "tools"
        raise GrammarError(f"a forced tool call needs {wanted} in the request's tools")
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": TOOL_JSON}
    call = f'{_marker(start, tokenizer)} "\\n"? body "\\n"? {_marker(end, tokenizer)}'
    repeat = ' ("\\n" call)*' if parallel else ""
    return GrammarSpec.lark(
        f"start: call{repeat}\ncall: {call}\nbody: %json "
        + json.dumps(schema, ensure_ascii=False)
    )


def _marker(text: str, tokenizer) -> str:
    """A tool-call marker in Lark: the token itself when the tokenizer has it as one
    special token (its text would not match it), else the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and engine_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text, ensure_ascii=False)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise MTPError(
            "structured output needs the llguidance package: pip install llguidance"
        ) from None
    return llguidance


def _eos_ids(tokenizer) -> Tuple[int, ...]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = [getattr(_hf(tokenizer), "eos_token_id", None)]
    return tuple(sorted(int(i) for i in ids if i is not None))


def _hf(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper``."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def engine_tokenizer(tokenizer):
    """llguidance's tokenizer for mlx-lm's ``TokenizerWrapper`` (built once per
    tokenizer and EOS set: about 0.25 s for 49k tokens)."""
    return _engine_tokenizer(_hf(tokenizer), _eos_ids(tokenizer))


@functools.lru_cache(maxsize=8)
def _engine_tokenizer(hf, eos: Tuple[int, ...]):
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise MTPError(
            "structured output needs a fast (tokenizers) tokenizer; "
            f"{type(hf).__name__} has none"
        )
    if not eos:
        raise MTPError("structured output needs the tokenizer's EOS token")
    try:
        return _llguidance().LLTokenizer(backend.to_str(), eos_token=list(eos))
    except (ValueError, RuntimeError) as e:
        raise MTPError(f"llguidance cannot read the tokenizer: {one_line(e)}") from None


def _grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (nothing is checked yet)."""
    matcher = _llguidance().LLMatcher
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return matcher.grammar_from_lark(spec.source)
    schema = spec.source if spec.kind == "json_schema" else ANY_OBJECT
    try:
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is refused: {one_line(e)}") from None


_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "lark": "Lark grammar",
}


# A compiled grammar's memory, estimated from its llguidance text (``len(text)``
# characters): ENTRY_BYTES + BYTES_PER_CHAR * len(text). Measured with RSS on
# llguidance 1.9.1 (JSON schemas of 200 to 5,000 string properties, 5 kB to 139 kB of
# text: 0.64 to 19 MB each, 100 to 170 bytes per character); the lexer states added
# while decoding were within that margin (200 tokens: under 1 MB).
ENTRY_BYTES = 64 * 1024
BYTES_PER_CHAR = 160
CACHE_ENTRIES = 64  # compiled grammars kept at most
CACHE_BYTES = 256 * 2**20  # their estimated bytes at most (MLX_MTP_GRAMMAR_CACHE_BYTES)
# llguidance's limits, its errors without the parser state (which would put the
# request's schema in the server's log)
_LIMITS = dict(verbose_errors=False)
_NOT_VERBOSE = "<non-verbose/>"


class CacheStats(NamedTuple):
    """The compiled-grammar cache (`cache_stats`): ``entries`` kept and their
    estimated ``bytes``, within ``max_entries`` and ``max_bytes``; lookups that found
    their grammar (``hits``) and that compiled it (``misses``)."""

    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    hits: int = 0
    misses: int = 0


class _Cache:
    """Compiled grammars by (spec, engine tokenizer), the least recently used
    dropped first so that at most ``max_entries`` are kept and their estimated bytes
    (see `ENTRY_BYTES`) stay within ``max_bytes``; one estimated larger than that is
    used and not kept. Thread-safe (the server compiles on its handler threads); a
    grammar compiled by two threads at once is compiled twice, and one kept."""

    def __init__(self, max_bytes: int, max_entries: int = CACHE_ENTRIES):
        self._lock = threading.Lock()
        self._entries: "OrderedDict[tuple, Tuple[object, int]]" = OrderedDict()
        self.bytes = self.hits = self.misses = 0
        self.max_bytes, self.max_entries = max_bytes, max_entries

    def get(self, key):
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key, matcher, nbytes: int) -> None:
        with self._lock:
            self._drop(key)
            if nbytes > self.max_bytes:
                return
            self._entries[key] = (matcher, nbytes)
            self.bytes += nbytes
            self._fit()

    def forget(self, key, matcher) -> None:
        """Drop ``key``'s entry if it is still ``matcher`` (not one rebuilt since)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None and found[0] is matcher:
                self._drop(key)

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._fit()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                len(self._entries),
                self.bytes,
                self.max_entries,
                self.max_bytes,
                self.hits,
                self.misses,
            )

    def _drop(self, key) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self.bytes -= found[1]

    def _fit(self) -> None:
        while self._entries and (
            self.bytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            self._drop(next(iter(self._entries)))


def _cache_bytes_from_env() -> int:
    """``MLX_MTP_GRAMMAR_CACHE_BYTES`` (a whole number >= 0), else `CACHE_BYTES`; a
    bad value is an `MTPError` when a grammar is first compiled."""
    raw = os.environ.get("MLX_MTP_GRAMMAR_CACHE_BYTES")
    if raw is None or not raw.strip():
        return CACHE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise MTPError(
            f"MLX_MTP_GRAMMAR_CACHE_BYTES must be a whole number of bytes >= 0, "
            f"not {raw!r}"
        )
    return value


_cache: Optional[_Cache] = None
_cache_guard = threading.Lock()


def _grammars() -> _Cache:
    global _cache
    with _cache_guard:
        if _cache is None:
            _cache = _Cache(_cache_bytes_from_env())
        return _cache


def set_cache_bytes(max_bytes: int) -> None:
    """Bound the compiled-grammar cache to ``max_bytes`` estimated bytes (0: keep
    none), dropping the least recently used grammars that no longer fit. The default
    is `CACHE_BYTES`, or ``MLX_MTP_GRAMMAR_CACHE_BYTES`` from the environment."""
    if type(max_bytes) is not int or max_bytes < 0:
        raise MTPError(f"the grammar cache bound must be bytes >= 0, not {max_bytes!r}")
    _grammars().resize(max_bytes)


def cache_stats() -> CacheStats:
    """The compiled grammars kept and their estimated bytes (`CacheStats`)."""
    return _grammars().stats()


def _engine_error(engine, spec: GrammarSpec, verb: str) -> GrammarError:
    """The engine's error state as a one-line `GrammarError`."""
    reason = one_line(engine.get_error().replace(_NOT_VERBOSE, "")) or "refused"
    return GrammarError(f"llguidance {verb} the {_WHAT[spec.kind]}: {reason}")


def _compiled(spec: GrammarSpec, llt):
    """A matcher in the grammar's start state, never advanced, from the cache (or
    compiled and kept there): each `Matcher` is a copy of it (a copy shares the
    compiled grammar and the lexer built so far)."""
    cache = _grammars()
    key = (spec, llt)
    matcher = cache.get(key)
    if matcher is None:
        matcher, text = _compile(spec, llt)
        cache.put(key, matcher, ENTRY_BYTES + BYTES_PER_CHAR * len(text))
    return matcher


def _compile(spec: GrammarSpec, llt):
    """``spec`` compiled for ``llt``: a matcher in its start state, and its
    llguidance text; `GrammarError` with the engine's reason if it refuses it."""
    llg = _llguidance()
    grammar = _grammar_text(spec)
    limits = llg.LLParserLimits(**_LIMITS)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        grammar, llt, limits=limits
    )
    if is_error:
        reason = one_line(messages[0] if messages else "refused")
        raise GrammarError(f"llguidance refuses the {_WHAT[spec.kind]}: {reason}")
    matcher = llg.LLMatcher(llt, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise _engine_error(matcher, spec, "refuses")
    return matcher, grammar


def check_grammar(spec: GrammarSpec, tokenizer) -> None:
    """Compile ``spec`` for ``tokenizer`` (cached); `GrammarError` with the engine's
    reason if it refuses it (an unsupported keyword, a bad regex...)."""
    _compiled(spec, engine_tokenizer(tokenizer))


class Matcher:
    """The grammar's state over the tokens generated so far (prompt not included).

    Masks are (V,) bool arrays over the model's logits width V: ids the tokenizer
    lacks (V larger than the tokenizer) are forbidden, ids past V are dropped. Once
    the grammar is complete only the EOS ids are allowed. The mask of each state
    on the current path is kept, so a state reached again after a rollback is not
    recomputed.

    An engine failure while decoding (one of llguidance's limits reached) is a
    `GrammarError`, raised by the call that met it; the matcher cannot go on after
    it. A copy shares the lexer its compiled grammar built so far with the other
    copies: the first failure drops the compiled grammar from the cache and the
    tokens so far are replayed once on a fresh compile, so that only a failure of
    this generation's own tokens is raised, and later generations start afresh.
    """

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int):
        llt = engine_tokenizer(tokenizer)
        self._llt, self.spec = llt, spec
        self._prototype = _compiled(spec, llt)
        self._engine = self._prototype.deep_copy()
        self._rebuilt = False  # replayed on a fresh compile already
        self.vocab_size = int(vocab_size)
        self._kept = min(self.vocab_size, llt.vocab_size)  # engine ids in the mask
        self._bitmask = np.zeros((1, (llt.vocab_size + 31) // 32), np.int32)
        self._eos = [i for i in _eos_ids(tokenizer) if i < self.vocab_size]
        self._eos_set = frozenset(self._eos)
        self._tokens: List[int] = []  # consumed (rollbacks undone)
        self._masks = [None]  # the mask at each depth 0..consumed, when computed

    def _call(self, method: str, *args):
        """The engine's ``method(*args)``; after a failure, once, the same on a
        fresh compile with the tokens so far replayed; `GrammarError` if it fails."""
        result = getattr(self._engine, method)(*args)
        if not self._engine.is_error():
            return result
        if not self._rebuilt:
            self._rebuild()
            result = getattr(self._engine, method)(*args)
            if not self._engine.is_error():
                return result
        _grammars().forget((self.spec, self._llt), self._prototype)
        raise _engine_error(self._engine, self.spec, "failed on")

    def _rebuild(self) -> None:
        """Drop the failed compiled grammar from the cache (its shared lexer may be
        what ran out), compile it afresh and replay the tokens so far on a copy."""
        self._rebuilt = True
        key = (self.spec, self._llt)
        _grammars().forget(key, self._prototype)
        self._prototype = _compiled(*key)
        self._engine = self._prototype.deep_copy()
        if self._tokens and not self._engine.consume_tokens(self._tokens):
            _grammars().forget(key, self._prototype)
            raise _engine_error(self._engine, self.spec, "failed on")

    def _compute(self) -> np.ndarray:
        """The current state's mask as a (V,) numpy bool array."""
        out = np.zeros(self.vocab_size, np.bool_)
        if self._call("is_stopped"):
            out[self._eos] = True
            return out
        self._call(
            "unsafe_compute_mask_ptr", self._bitmask.ctypes.data, self._bitmask.nbytes
        )
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        out[: self._kept] = bits[: self._kept]
        return out

    def _current(self) -> Tuple[np.ndarray, mx.array]:
        if self._masks[-1] is None:
            allowed = self._compute()
            self._masks[-1] = (allowed, mx.array(allowed))
        return self._masks[-1]

    def mask(self) -> mx.array:
        """(V,) bool, True where the next token is allowed."""
        return self._current()[1]

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""
        token = int(token)
        if not 0 <= token < self.vocab_size:
            return False
        if self._masks[-1] is not None:
            return bool(self._masks[-1][0][token])
        if token in self._eos_set:
            return self.accepting
        if self._call("is_stopped") or token >= self._kept:
            return False
        return self._call("validate_tokens", [token]) == 1

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False (the state unchanged) if it is forbidden."""
        if not self.allows(token):
            return False
        self._call("consume_token", int(token))
        self._tokens.append(int(token))
        self._masks.append(None)
        return True

    def consume_all(self, tokens: Sequence[int]) -> int:
        """Consume ``tokens`` in order up to the first forbidden one; the number
        consumed."""
        for n, token in enumerate(tokens):
            if not self.consume(token):
                return n
        return len(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n == 0:
            return
        if not 0 < n <= self.consumed:
            raise ValueError(f"cannot roll back {n} of {self.consumed} tokens")
        self._call("rollback", n)
        del self._tokens[-n:]
        del self._masks[-n:]

    @property
    def consumed(self) -> int:
        """Tokens consumed so far (rollbacks subtracted)."""
        return len(self._tokens)

    @property
    def accepting(self) -> bool:
        """The output may end here (EOS is allowed)."""
        return self._call("is_accepting") or self._call("is_stopped")

    @property
    def done(self) -> bool:
        """The grammar has consumed EOS or cannot go on (only EOS is allowed)."""
        return self._call("is_stopped")


def constrain(logits: mx.array, mask: mx.array) -> mx.array:
    """``logits`` with the entries ``mask`` forbids set to -inf; ``mask`` is (V,) or
    broadcasts against ``logits`` (..., V)."""
    return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))

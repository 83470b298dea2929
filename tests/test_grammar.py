"""The grammar layer (mlx_mtp.grammar): specs, the engine's refusals, masks checked
against an independent oracle, rollback, EOS, padding, and a plain greedy
constrained decode of the fixture model whose output validates with jsonschema."""

import json
import subprocess
import sys

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_mtp import grammar
from mlx_mtp.errors import MTPError
from mlx_mtp.grammar import (
    GrammarError,
    GrammarSpec,
    Matcher,
    check_grammar,
    constrain,
)

FAMILY = "qwen3_5"


@pytest.fixture(scope="module")
def model_and_tokenizer(loaded):
    return loaded(FAMILY, predictable=True)


@pytest.fixture(scope="module")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


def allowed(matcher):
    return [int(i) for i in np.nonzero(np.array(matcher.mask()))[0]]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_specs_canonicalize_and_hash():
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    spec = GrammarSpec.json_schema(schema)
    assert spec == GrammarSpec.json_schema(json.dumps(schema, indent=2))
    assert spec.kind == "json_schema" and "\n" not in spec.source
    assert json.loads(spec.source) == schema
    # keys keep the schema's order: it is the order the object's keys are generated in
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]
    assert len({spec, GrammarSpec.json_schema(dict(schema)), GrammarSpec.json_object()})
    assert {spec: 1}[GrammarSpec.json_schema(schema)] == 1
    assert GrammarSpec.json_object() == GrammarSpec("json_object", "")
    assert GrammarSpec.regex("[0-9]+") == GrammarSpec("regex", "[0-9]+")
    assert GrammarSpec.lark('start: "a"').kind == "lark"


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: GrammarSpec.json_schema("{nope"), "not valid JSON"),
        (lambda: GrammarSpec.json_schema("[1, 2]"), "must be a JSON object, not list"),
        (lambda: GrammarSpec.json_schema(3), "must be a JSON object, not int"),
        (lambda: GrammarSpec.regex(""), "non-empty pattern"),
        (lambda: GrammarSpec("ebnf", "x"), "unknown grammar kind 'ebnf'"),
    ],
)
def test_bad_specs(make, message):
    with pytest.raises(GrammarError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "spec,reason",
    [
        (GrammarSpec.json_schema({"type": "foo"}), "Invalid type: foo"),
        (
            GrammarSpec.json_schema({"type": "array", "uniqueItems": True}),
            r'Unimplemented keys: \["uniqueItems"\]',
        ),
        (
            GrammarSpec.json_schema({"type": "string", "pattern": "(ab"}),
            "unclosed group",
        ),
        (GrammarSpec.regex("[0-9"), "unclosed character class"),
        (GrammarSpec.lark("start: missing_rule"), "missing_rule"),
    ],
)
def test_engine_refusals_are_one_line(tokenizer, spec, reason):
    for attempt in (
        lambda: check_grammar(spec, tokenizer),
        lambda: Matcher(spec, tokenizer, 512),
    ):
        with pytest.raises(GrammarError, match=reason) as e:
            attempt()
        assert "\n" not in str(e.value) and str(e.value).startswith(
            "llguidance refuses"
        )


def _check_against_oracle(matcher, tokenizer, is_prefix, path, forced=None):
    """At every state along ``path``, every allowed token's text extends the text so
    far to a prefix of a valid output, and (where the grammar does not force the next
    byte) every such token is allowed. Where ``forced(text)`` says the next bytes are
    forced, llguidance allows only their canonical tokenization (its documented
    "forcing"), so only the first half holds there."""
    hf = tokenizer._tokenizer
    specials = set(hf.all_special_ids)
    texts = [hf.decode([i]) for i in range(len(hf))]
    text = ""
    for step in [None, *path]:
        if step is not None:
            assert matcher.consume(step)
            text += texts[step]
        expected = {
            i for i, t in enumerate(texts) if i not in specials and is_prefix(text + t)
        }
        got = set(allowed(matcher)) - set(tokenizer.eos_token_ids)
        if forced is not None and forced(text):
            assert got and got <= expected, (text, sorted(got - expected)[:10])
        else:
            assert got == expected, (text, sorted(got ^ expected)[:10])


def test_regex_mask_is_exactly_the_digit_tokens(tokenizer):
    matcher = Matcher(GrammarSpec.regex("[0-9]{3}"), tokenizer, 512)
    texts = {tokenizer._tokenizer.decode([t]) for t in allowed(matcher)}
    assert set("0123456789") <= texts and "10" in texts

    def is_prefix(s):
        return 0 < len(s) <= 3 and s.isascii() and s.isdigit()

    _check_against_oracle(matcher, tokenizer, is_prefix, encode(tokenizer, "123"))
    assert matcher.done and allowed(matcher) == sorted(tokenizer.eos_token_ids)


def test_json_enum_mask_is_exactly_the_valid_prefixes(tokenizer):
    words = ['"red"', '"green"', '"blue"']
    matcher = Matcher(
        GrammarSpec.json_schema({"enum": ["red", "green", "blue"]}), tokenizer, 512
    )

    def is_prefix(s):
        return len(s) > 0 and any(w.startswith(s) for w in words)

    def forced(s):  # one next character whichever word the text goes on to
        return len({w[len(s)] for w in words if w.startswith(s) and w != s}) == 1

    path = encode(tokenizer, '"green"')
    _check_against_oracle(matcher, tokenizer, is_prefix, path, forced)
    assert matcher.done


def test_lark_grammar(tokenizer):
    matcher = Matcher(GrammarSpec.lark('start: "yes" | "no"'), tokenizer, 512)
    assert {tokenizer._tokenizer.decode([t]) for t in allowed(matcher)} <= {
        "y",
        "ye",
        "yes",
        "n",
        "no",
    }
    assert matcher.consume_all(encode(tokenizer, "no")) == len(encode(tokenizer, "no"))
    assert matcher.done


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def test_consume_rollback_round_trip(tokenizer):
    tokens = encode(tokenizer, json.dumps({"name": "Ada", "tags": ["a", "b"]}))
    matcher = Matcher(GrammarSpec.json_schema(SCHEMA), tokenizer, 512)
    forward = []
    for t in tokens:
        forward.append(np.array(matcher.mask()))
        assert matcher.consume(t)
    assert matcher.done and matcher.consumed == len(tokens)
    for n in (1, 3, len(tokens)):
        matcher.rollback(n)
        assert matcher.consumed == len(tokens) - n and not matcher.done
        assert np.array_equal(np.array(matcher.mask()), forward[len(tokens) - n])
        for i, t in enumerate(tokens[len(tokens) - n :], len(tokens) - n):
            assert np.array_equal(np.array(matcher.mask()), forward[i])
            assert matcher.consume(t)
    # a fresh matcher (cached compile, deep copy) sees the same masks
    fresh = Matcher(GrammarSpec.json_schema(SCHEMA), tokenizer, 512)
    assert np.array_equal(np.array(fresh.mask()), forward[0])
    with pytest.raises(ValueError, match="cannot roll back"):
        fresh.rollback(1)


def test_forbidden_token_leaves_the_state(tokenizer):
    matcher = Matcher(GrammarSpec.json_schema(SCHEMA), tokenizer, 512)
    brace = encode(tokenizer, "{")
    assert matcher.consume(brace[0])
    before = np.array(matcher.mask())
    letter = encode(tokenizer, "x")[0]
    assert not matcher.allows(letter) and not matcher.consume(letter)
    assert matcher.consumed == 1 and np.array_equal(np.array(matcher.mask()), before)
    # the check before a mask is computed uses the engine's own validation
    other = Matcher(GrammarSpec.json_schema(SCHEMA), tokenizer, 512)
    assert not other.consume(letter) and other.consume(brace[0])
    assert not other.allows(-1) and not other.allows(10**6)
    rest = encode(tokenizer, '"name": "x", "tags": []}')
    assert other.consume_all(rest) == len(rest) and other.done


def test_done_and_eos(tokenizer, checkpoint):
    eos = sorted(tokenizer.eos_token_ids)
    matcher = Matcher(GrammarSpec.regex("[0-9]+"), tokenizer, 512)
    assert not matcher.allows(eos[0]) and not matcher.accepting
    assert matcher.consume(encode(tokenizer, "7")[0])
    assert matcher.accepting and not matcher.done and matcher.allows(eos[0])
    before = allowed(matcher)
    assert set(eos) < set(before)  # digits and EOS
    assert matcher.consume(eos[0]) and matcher.done
    assert allowed(matcher) == eos
    # a drafted EOS rolls back like any token (the engine's state, no cached mask)
    fresh = Matcher(GrammarSpec.regex("[0-9]+"), tokenizer, 512)
    assert fresh.consume(encode(tokenizer, "7")[0]) and fresh.consume(eos[0])
    fresh.rollback(1)
    assert not fresh.done and allowed(fresh) == before
    # several EOS ids: all of them are allowed once the grammar is complete
    two = load_tokenizer(checkpoint(FAMILY, predictable=True))
    two.add_eos_token("<|im_end|>")
    assert len(two.eos_token_ids) == 2
    matcher = Matcher(GrammarSpec.regex("[0-9]"), two, 512)
    assert matcher.consume(encode(two, "7")[0]) and matcher.done
    assert allowed(matcher) == sorted(two.eos_token_ids)
    assert all(matcher.allows(i) for i in two.eos_token_ids)


def test_vocab_padding_and_truncation(tokenizer):
    wide = Matcher(GrammarSpec.json_object(), tokenizer, 512 + 40)
    mask = wide.mask()
    assert mask.shape == (552,) and mask.dtype == mx.bool_
    assert not np.array(mask)[512:].any() and not wide.allows(530)
    narrow = Matcher(GrammarSpec.json_object(), tokenizer, 300)
    assert narrow.mask().shape == (300,)
    assert np.array_equal(np.array(narrow.mask()), np.array(mask)[:300])


def test_constrain():
    logits = mx.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=mx.bfloat16)
    mask = mx.array([True, False, True])
    out = constrain(logits, mask)
    assert out.dtype == mx.bfloat16 and out.shape == (2, 3)
    assert out.tolist() == [[1.0, -float("inf"), 3.0], [4.0, -float("inf"), 6.0]]
    rows = mx.array([[True, True, False], [False, False, True]])
    assert constrain(logits[None], rows).tolist()[0][1] == [-float("inf")] * 2 + [6.0]
    assert constrain(logits[0], mask).tolist() == [1.0, -float("inf"), 3.0]


def test_compiles_are_cached(tokenizer):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"q": {}}})
    check_grammar(spec, tokenizer)
    hits = grammar.cache_stats().hits
    Matcher(spec, tokenizer, 512)
    check_grammar(spec, tokenizer)
    assert grammar.cache_stats().hits == hits + 2
    assert grammar.engine_tokenizer(tokenizer) is grammar.engine_tokenizer(tokenizer)


def test_engine_is_imported_lazily(monkeypatch):
    code = "import sys, mlx_mtp.grammar; assert 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(MTPError, match="needs the llguidance package") as e:
        grammar._llguidance()
    assert "\n" not in str(e.value)


# --- plain greedy constrained decoding of the fixture model -------------------------

DECODE_SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"enum": [1, 2, 3]}, "c": {"type": "null"}},
                "required": ["b", "c"],
                "additionalProperties": False,
            },
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        },
        "required": ["a", "code"],
        "additionalProperties": False,
    },
]


def greedy_constrained(model, tokenizer, prompt, spec, max_tokens=160):
    """Plain greedy decoding of the trunk, each step's logits masked by the grammar
    (``spec`` None: unmasked); the tokens (EOS excluded) and whether the grammar
    finished."""
    trunk = model.trunk
    cache = make_prompt_cache(trunk)
    x, out, matcher = mx.array(tokenizer.encode(prompt))[None], [], None
    for _ in range(max_tokens):
        logits = trunk(x, cache=cache)[0, -1]  # (V,)
        if spec is not None:
            matcher = matcher or Matcher(spec, tokenizer, logits.shape[-1])
            logits = constrain(logits, matcher.mask())
        token = int(mx.argmax(logits))
        if token in tokenizer.eos_token_ids:
            break
        assert matcher is None or matcher.consume(token)
        out.append(token)
        x = mx.array([[token]])
    return out, matcher is not None and matcher.done


@pytest.mark.parametrize("schema", DECODE_SCHEMAS)
def test_greedy_constrained_decode_validates(model_and_tokenizer, schema):
    model, tokenizer = model_and_tokenizer
    spec = GrammarSpec.json_schema(schema)
    for prompt in ("def forward(self, x):", "The quick brown fox"):
        tokens, done = greedy_constrained(model, tokenizer, prompt, spec)
        text = tokenizer.decode(tokens)
        assert done, text
        jsonschema.validate(json.loads(text), schema)


def test_greedy_json_object_and_regex(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    tokens, done = greedy_constrained(
        model, tokenizer, "x", GrammarSpec.regex("[0-9]{3}")
    )
    assert done and len(tokenizer.decode(tokens)) == 3
    assert tokenizer.decode(tokens).isdigit()
    # without the grammar the fixture model writes no JSON: the mask does the work
    free, _ = greedy_constrained(model, tokenizer, "The quick brown fox", None, 40)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(free))
    tokens, done = greedy_constrained(
        model, tokenizer, "def forward(self, x):", GrammarSpec.json_object()
    )
    assert done and isinstance(json.loads(tokenizer.decode(tokens)), dict)

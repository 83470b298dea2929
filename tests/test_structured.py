"""Structured output with MTP: on many JSON schemas (nested objects, enums, arrays
with bounds, numbers with ranges, patterns) greedy output drafting from the heads,
from lookups and from a draft vocabulary equals plain constrained decoding token for
token, and always parses and validates (``jsonschema``); regexes too; rows of a batch
each follow their own grammar; a schema the engine refuses is one line."""

import json

import jsonschema
import pytest

from mlx_mtp import batch_generate
from mlx_mtp.generate import stream_generate
from mlx_mtp.grammar import GrammarError

NAME = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "role": {"enum": ["admin", "dev", "guest"]},
                },
                "required": ["id", "role"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["user", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "bb", "ccc"]},
                "minItems": 2,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["tags", "score"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": NAME, "v": {"type": ["integer", "null"]}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "kind": {"const": "event"},
            "level": {"anyOf": [{"type": "integer"}, {"enum": ["low", "high"]}]},
        },
        "required": ["date", "kind", "level"],
        "additionalProperties": False,
    },
]


def decode(model, tokenizer, prompt, **options):
    """The text and the run's statistics."""
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=160, **options))
    assert out[-1].finish_reason == "stop", "".join(r.text for r in out)
    return "".join(r.text for r in out), out[-1].mtp


DRAFTING = [
    dict(num_draft_tokens=3, draft_source="heads", draft_vocab="full"),
    dict(num_draft_tokens=2, draft_source="lookup"),
    dict(num_draft_tokens=2, draft_source="heads", draft_vocab=64),
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_schema_output_is_plain_constrained_decoding_and_valid(schema, loaded):
    model, tokenizer = loaded("qwen3_5", predictable=True)
    prompt = "Reply in JSON:"
    plain, _ = decode(model, tokenizer, prompt, num_draft_tokens=0, json_schema=schema)
    jsonschema.validate(json.loads(plain), schema)
    drafted = 0
    for drafting in DRAFTING:
        text, stats = decode(model, tokenizer, prompt, json_schema=schema, **drafting)
        assert text == plain, drafting
        drafted += stats.accepted
    assert drafted > 0


def test_regex_and_any_json_object(loaded):
    model, tokenizer = loaded("qwen3_5", predictable=True)
    pattern = r"(yes|no), [0-9]{2,4}(\.[0-9])?"
    plain, _ = decode(model, tokenizer, "Answer:", num_draft_tokens=0, regex=pattern)
    assert (
        decode(model, tokenizer, "Answer:", num_draft_tokens=3, regex=pattern)[0]
        == plain
    )
    import re

    assert re.fullmatch(pattern, plain)
    text, _ = decode(model, tokenizer, "JSON:", num_draft_tokens=3, json_object=True)
    assert isinstance(json.loads(text), dict)


def test_batched_rows_follow_their_own_grammars(loaded):
    """Rows with different schemas, one without, decoded together: each row's text
    is its lone constrained decode."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    prompts = ["Reply in JSON:", "JSON please:", "The quick brown fox"]
    grammars = [SCHEMAS[1], SCHEMAS[2], None]
    options = [
        dict(num_draft_tokens=3, draft_source="heads", max_tokens=160, json_schema=g)
        for g in grammars
    ]
    alone = [
        "".join(r.text for r in stream_generate(model, tokenizer, p, **o))
        for p, o in zip(prompts, options)
    ]
    from mlx_mtp.generate import grammar_fields
    from mlx_mtp.options import DecodeOptions

    per_row = [DecodeOptions(**grammar_fields(dict(o))) for o in options]
    together = batch_generate(model, tokenizer, prompts, options=per_row)
    assert together.texts == alone
    for text, schema in zip(together.texts[:2], grammars):
        jsonschema.validate(json.loads(text), schema)


def test_a_schema_the_engine_refuses_is_one_line(loaded):
    model, tokenizer = loaded("qwen3_5")
    for bad in ({"type": "wat"}, {"type": "string", "pattern": "("}, "not json"):
        with pytest.raises(GrammarError) as e:
            decode(model, tokenizer, "x", json_schema=bad)
        assert "\n" not in str(e.value) and str(e.value)


def test_a_grammar_outside_the_draft_vocabulary(loaded):
    """A regex whose tokens are outside an 8-token draft vocabulary: the heads draft
    from the whole head there, greedy equals plain, and sampled runs (no NaN from an
    all-forbidden draft row) match the pattern."""
    import re

    model, tokenizer = loaded("qwen3_5", predictable=True)
    pattern = "[QXZ]{3}-[0-9]{2}"
    small = dict(num_draft_tokens=2, draft_source="heads", draft_vocab=8)
    plain, _ = decode(model, tokenizer, "Code:", num_draft_tokens=0, regex=pattern)
    assert decode(model, tokenizer, "Code:", regex=pattern, **small)[0] == plain
    for seed in range(3):
        text, _ = decode(
            model, tokenizer, "Code:", regex=pattern, temp=1.0, seed=seed, **small
        )
        assert re.fullmatch(pattern, text), text


def _outcomes(model, tokenizer, prompt, spec):
    """Every complete token sequence the grammar allows after ``prompt`` (ending in
    EOS) with its exact probability under plain constrained sampling at
    temperature 1."""
    import mlx.core as mx

    from mlx_mtp.grammar import Matcher

    eos = set(tokenizer.eos_token_ids)
    matcher = Matcher(spec, tokenizer, model.args.vocab_size)
    found = {}

    def walk(seq, p):
        logits = model(mx.array([prompt + seq]))[0, -1]
        probs = mx.softmax(mx.where(matcher.mask(), logits, -mx.inf)).tolist()
        for t, q in enumerate(probs):
            if q == 0:
                continue
            if t in eos:
                found[tuple(seq + [t])] = found.get(tuple(seq + [t]), 0) + p * q
            elif matcher.consume(t):
                walk(seq + [t], p * q)
                matcher.rollback(1)

    walk([], 1.0)
    return found


def _sampling_fails(model, tokenizer, n=200) -> bool:
    import numpy as np

    from mlx_mtp.grammar import GrammarSpec
    from mlx_mtp.speculative import mtp_generate_step
    from tests.test_sampling import chi_square_rejects

    spec = GrammarSpec.regex("[ab]{2,3}")
    prompt = tokenizer.encode("ab ba")
    exact = _outcomes(model, tokenizer, prompt, spec)
    assert 4 <= len(exact) and abs(sum(exact.values()) - 1) < 1e-4
    index = {seq: i for i, seq in enumerate(exact)}
    counts = np.zeros(len(exact))
    eos = set(tokenizer.eos_token_ids)
    for seed in range(n):
        seq = []
        for step in mtp_generate_step(
            prompt,
            model,
            num_draft_tokens=2,
            draft_source="heads",
            draft_vocab="full",
            temp=1.0,
            seed=seed,
            max_tokens=8,
            grammar=spec,
            tokenizer=tokenizer,
        ):
            seq.append(step.token)
            if step.token in eos:
                break
        if tuple(seq) not in index:
            return True  # an output plain constrained sampling never gives
        counts[index[tuple(seq)]] += 1
    return chi_square_rejects(counts, np.array(list(exact.values())))


@pytest.mark.slow
def test_sampling_under_a_grammar_is_plain_constrained_sampling(loaded):
    """The complete outputs of a small regex, sampled with drafts, follow their exact
    probabilities under plain constrained sampling (chi-square at 1e-4)."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    assert not _sampling_fails(model, tokenizer)


@pytest.mark.slow
def test_stale_grammar_masks_fail_the_sampling_test(loaded, monkeypatch):
    """Negative control: every verified row masked with the first row's mask."""
    from mlx_mtp.processors import Rules

    process = Rules._process
    monkeypatch.setattr(
        Rules,
        "_process",
        lambda self, logits, prefix, j: process(self, logits, prefix, 0),
    )
    model, tokenizer = loaded("qwen3_5", predictable=True)
    assert _sampling_fails(model, tokenizer)

"""A grammar the engine fails on while decoding (one of llguidance's limits reached)
is that request's error, never a finished reply and never another request's: one
line from `generate` at every draft length, the same again on a second try (a cached
grammar is rebuilt after a failure), an "error" row of `batch_generate` beside rows
whose outputs are their lone ones, a 400 or an error event from the server while the
other streams go on. Compiled grammars are cached within a byte bound. A batched row
holds no second copy of its prompt's caches. Seeded rows under ``-k auto`` give their
lone text in company."""

import gc

import mlx.core as mx
import openai
import pytest
from mlx.utils import tree_flatten

from mlx_mtp import batch_generate, generate, grammar
from mlx_mtp.batch import Batch
from mlx_mtp.grammar import GrammarError, GrammarSpec
from mlx_mtp.options import DecodeOptions
from mlx_mtp.server import Server, server_args
from tests.test_server_batch import at_once, gathered

# An object of 600 optional properties: compiled, then refused at its first token
# ("Current row has 2407 items; max is 2000").
WIDE = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string"} for i in range(600)},
}
WIDE_ERROR = "Current row has"
# A regex whose lexer runs out of expressions some tokens into the reply.
REGEX = r"(\w{1,30}){1,30}x"
REGEX_ERROR = "too many expressions constructed"


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint("deepseek_v3", predictable=True))


@pytest.fixture(scope="module")
def local(loaded):
    return loaded("deepseek_v3", True)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_grammar_failure_raises_one_line_at_every_k(local, k):
    """The engine's failure is a `GrammarError` of one line whatever k is, not a
    "stop" with text that does not match; a second identical request fails the same
    way (not an empty reply from a grammar left exhausted in the cache)."""
    model, tokenizer = local
    for _ in range(2):
        with pytest.raises(GrammarError, match=REGEX_ERROR) as e:
            generate(
                model,
                tokenizer,
                "hello",
                max_tokens=100,
                regex=REGEX,
                num_draft_tokens=k,
            )
        assert "\n" not in str(e.value)
    with pytest.raises(GrammarError, match=WIDE_ERROR):
        generate(
            model, tokenizer, "x", max_tokens=8, json_schema=WIDE, num_draft_tokens=k
        )


def test_a_failing_prompt_fails_alone_in_batch_generate(local):
    """Two prompts whose grammars fail (at the first token; mid-reply, with drafts)
    and one over the model's context end with "error" and their one-line errors;
    the others' outputs are their lone `generate` outputs, token for token."""
    model, tokenizer = local
    wide, regex = GrammarSpec.json_schema(WIDE), GrammarSpec.regex(REGEX)
    too_long = "a " * (model.args.max_position_embeddings + 8)
    asks = [
        ("Write a function.", DecodeOptions(max_tokens=24, num_draft_tokens=2)),
        ("x", DecodeOptions(max_tokens=8, grammar=wide)),
        ("hello", DecodeOptions(max_tokens=60, grammar=regex, num_draft_tokens=2)),
        ("say a b c", DecodeOptions(max_tokens=30, num_draft_tokens=0)),
        (too_long, DecodeOptions(max_tokens=4)),
    ]
    last = {}
    got = batch_generate(
        model,
        tokenizer,
        [p for p, _ in asks],
        options=[o for _, o in asks],
        on_output=lambda out: last.__setitem__(out.uid, out),
    )
    assert got.finish_reasons[1:3] == ["error", "error"]
    assert got.finish_reasons[4] == "error" and "context" in got.errors[4]
    assert WIDE_ERROR in got.errors[1] and REGEX_ERROR in got.errors[2]
    assert got.token_ids[1] == [] and got.token_ids[2]  # made before the failure
    assert all("\n" not in got.errors[i] for i in (1, 2, 4))
    assert last[2].finish_reason == "error" and last[2].error == got.errors[2]
    for i in (0, 3):
        prompt, options = asks[i]
        assert got.errors[i] is None and got.finish_reasons[i] == "length"
        assert got.texts[i] == generate(model, tokenizer, prompt, options=options)


@pytest.fixture(scope="module")
def served(model_path):
    server = Server(server_args(model=model_path, port=0)).start()
    yield server
    server.close()


def _chat(server, prompt, stream=False, k=2, response_format=None, **fields):
    """A chat reply's text (greedy), through the ``openai`` client."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    extra = {"num_draft_tokens": k}
    if response_format is not None:
        extra["response_format"] = response_format
    reply = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": prompt}],
        stream=stream,
        temperature=0,
        extra_body=extra,
        **fields,
    )
    if not stream:
        return reply.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


WIDE_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": WIDE}}
REGEX_FORMAT = {"type": "regex", "regex": REGEX}


def test_a_failing_request_fails_alone_in_the_server(served, monkeypatch):
    """A victim's stream, a schema failing at its first token (not streamed: 400)
    and a regex failing mid-reply (streamed: an error event), in one batch: the
    victim's text is its lone text; each attacker gets its own one-line error."""
    victim = dict(max_tokens=48)
    alone = _chat(served, "Write a function.", stream=True, **victim)
    asks = [
        lambda: _chat(served, "Write a function.", stream=True, **victim),
        lambda: _chat(served, "x", max_tokens=8, response_format=WIDE_FORMAT),
        lambda: _chat(
            served, "hello", stream=True, max_tokens=60, response_format=REGEX_FORMAT
        ),
    ]

    def ask(i):
        try:
            return asks[i]()
        except openai.APIError as e:
            return e

    gathered(served.generator, 3, monkeypatch)
    got = at_once(ask, 3)
    assert got[0] == alone
    assert isinstance(got[1], openai.BadRequestError), got[1]
    assert WIDE_ERROR in got[1].message
    assert isinstance(got[2], openai.APIError) and REGEX_ERROR in got[2].message


@pytest.mark.parametrize("k", [0, 2])
def test_a_grammar_failure_is_a_400_every_time(served, k):
    """The same failing regex twice, alone: a 400 each time, not a 200 "stop"."""
    for _ in range(2):
        with pytest.raises(openai.BadRequestError, match=REGEX_ERROR):
            _chat(served, "hello", k=k, max_tokens=100, response_format=REGEX_FORMAT)


def test_the_cli_fails_in_one_line(model_path):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    for k in ("0", "2"):
        args = ["generate", "--model", model_path, "-p", "hello", "-m", "100"]
        result = CliRunner().invoke(main, args + ["--regex", REGEX, "-k", k])
        assert result.exit_code == 1, result.output
        last = result.output.rstrip("\n").splitlines()[-1]
        assert last.startswith("mlx-mtp: error: ") and REGEX_ERROR in last
        assert "Traceback" not in result.output


@pytest.fixture
def small_grammar_cache():
    before = grammar.cache_stats().max_bytes
    yield
    grammar.set_cache_bytes(before)


def test_compiled_grammars_stay_within_their_byte_bound(local, small_grammar_cache):
    """Many distinct large schemas: the cache's estimated bytes stay within the
    bound (the least recently used dropped), and one larger than it is not kept."""
    _, tokenizer = local
    bound = 2 * 2**20
    grammar.set_cache_bytes(bound)

    def schema(i, n):
        props = {f"s{i}_{j}": {"type": "string"} for j in range(n)}
        return GrammarSpec.json_schema({"type": "object", "properties": props})

    for i in range(8):
        grammar.check_grammar(schema(i, 150), tokenizer)  # ~0.7 MB each
        stats = grammar.cache_stats()
        assert 0 < stats.bytes <= bound and stats.entries <= stats.max_entries
    assert stats.entries < 8
    grammar.check_grammar(GrammarSpec.json_schema(WIDE), tokenizer)  # ~2.3 MB
    after = grammar.cache_stats()
    assert (after.entries, after.bytes) == (stats.entries, stats.bytes)
    assert after.misses == stats.misses + 1


def _active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def test_a_joined_row_holds_one_copy_of_its_prompt(local):
    """Rows that joined a batch hold their prompts' caches once (the batch's), not
    also the single-stream caches they were prefilled in."""
    model, _ = local
    V = model.args.vocab_size
    opts = DecodeOptions(num_draft_tokens=1, draft_source="heads", max_tokens=64)
    batch = Batch(model, opts, max_batch=4)
    base = _active()
    for uid in range(3):
        prompt = [(7 * uid + 3 * i + 1) % V for i in range(400)]
        batch.join(batch.admit(uid, prompt, opts))
        batch.step()
    held = _active() - base
    states = [c.state for c in batch.caches.trunk + batch.caches.mtp]
    caches = sum(a.nbytes for _, a in tree_flatten(states) if isinstance(a, mx.array))
    assert caches > 500_000
    assert held < 1.5 * caches, (held, caches)  # two copies: 2.15x


def test_seeded_rows_under_auto_give_their_lone_text(local):
    """Sampled rows with a seed and ``-k auto`` decoded together: each text is its
    prompt's lone `generate` text (the batch does not cap a seeded row's drafts)."""
    model, tokenizer = local
    prompts = ["Write a function.", "say a b c", "hello world", "x = 1", "tell me"]
    options = [DecodeOptions(temp=1.0, seed=10 + i, max_tokens=32) for i in range(5)]
    together = batch_generate(model, tokenizer, prompts, options=options)
    for prompt, o, text in zip(prompts, options, together.texts):
        assert text == generate(model, tokenizer, prompt, options=o)


def test_seeded_requests_under_auto_give_their_lone_text(served, monkeypatch):
    """The server's default ``-k auto``, four seeded sampled requests at once: each
    reply is its lone reply."""
    prompts = ["Write a function.", "say a b c", "hello world", "x = 1"]

    def ask(i):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        reply = client.completions.create(
            model="default_model",
            prompt=prompts[i],
            max_tokens=32,
            temperature=1.0,
            seed=10 + i,
        )
        return reply.choices[0].text

    alone = [ask(i) for i in range(4)]
    gathered(served.generator, 4, monkeypatch)
    assert at_once(ask, 4) == alone

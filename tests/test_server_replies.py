"""What ``mlx-mtp serve``'s replies hold, in both APIs, streamed or not: always a
whole reply (a tool call the model got wrong is content), stop strings that stop on
the text, valid JSON with top_logprobs likeliest first, and the bad tool and penalty
fields refused. One server for the module (a template that renders tools, mlx-lm's
JSON tool parser); the model's output is forced by a regex where a test needs a
given text."""

import http.client
import json
import math

import pytest
from click.testing import CliRunner

from mlx_mtp import generate as mtp_generate
from mlx_mtp.cli import main
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import stream_generate
from mlx_mtp.loading import load
from mlx_mtp.server import Server, server_args
from mlx_mtp.serving import generator, jobs, scheduler

from .test_server import scripted

USER = [{"role": "user", "content": "Write a function."}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def folder(tool_folder):
    return tool_folder


@pytest.fixture(scope="module")
def served(folder):
    server = Server(server_args(model=str(folder), port=0, max_batch=2)).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def local(folder):
    return load(str(folder))


def strict(text: str):
    """``text`` parsed as RFC 8259 JSON: NaN and infinities refused."""

    def refuse(name):
        raise AssertionError(f"{name} in a JSON reply")

    return json.loads(text, parse_constant=refuse)


def post(served, path, body):
    """A POST's status and body (None when the server sent no reply at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request(
        "POST",
        path,
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        r = conn.getresponse()
        return r.status, r.read().decode()
    except http.client.RemoteDisconnected:
        return None, ""
    finally:
        conn.close()


def chat(served, **body):
    """A whole chat reply: its status and its body, parsed strictly."""
    status, text = post(served, "/v1/chat/completions", {"messages": USER, **body})
    assert status is not None, "no reply"
    return status, strict(text)


def chat_stream(served, **body):
    """A streamed chat reply: its status, its chunks (parsed strictly) and its
    content, finish reason and tool calls put together; it must end with
    ``[DONE]``."""
    body = {"messages": USER, "stream": True, **body}
    status, text = post(served, "/v1/chat/completions", body)
    events = [e[len("data: ") :] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    chunks = [strict(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    deltas = [c["choices"][0] for c in chunks if c.get("choices")]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls") or ()]
    finish = [d["finish_reason"] for d in deltas if d["finish_reason"]]
    return status, content, finish, calls


def messages(served, **body):
    """A whole Messages reply (status, body parsed strictly)."""
    body = {"model": "default_model", "messages": USER, **body}
    status, text = post(served, "/v1/messages", body)
    assert status is not None, "no reply"
    return status, strict(text)


def messages_stream(served, **body):
    """A streamed Messages reply: its text and its message_delta's delta."""
    body = {"model": "default_model", "messages": USER, "stream": True, **body}
    status, text = post(served, "/v1/messages", body)
    assert status == 200, text
    events = [
        strict(line[len("data: ") :])
        for line in text.split("\n")
        if line.startswith("data: ")
    ]
    assert events[-1]["type"] == "message_stop", events[-3:]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    content = "".join(d.get("text", "") for d in deltas)
    (delta,) = [e["delta"] for e in events if e["type"] == "message_delta"]
    return content, delta


# --- tool calls the model got wrong -------------------------------------------------

MALFORMED = [
    '<tool_call>{"name": "get_weather"}</tool_call>',  # no arguments
    "<tool_call>5</tool_call>",  # not an object
    "<tool_call>[1, 2]</tool_call>",  # a list, not of calls
]


def regex(text: str) -> dict:
    """A response_format that makes the reply ``text`` exactly (then EOS)."""
    escaped = "".join("\\" + c if c in "\\{}[]()|.*+?^$" else c for c in text)
    return {"type": "regex", "regex": escaped}


@pytest.mark.parametrize("call", MALFORMED)
def test_a_tool_call_that_does_not_parse_is_content(served, call):
    """Tool text mlx-lm's parser cannot make calls of: a whole reply (not an empty
    one, nor a stream without ``[DONE]``) with the text, markers included, as
    content and finish "stop", no tool_calls; streamed or not, with drafts."""
    text = f"Let me see. {call}"
    ask = dict(tools=[WEATHER], max_tokens=80, response_format=regex(text))
    for k in (0, 2):
        status, r = chat(served, num_draft_tokens=k, **ask)
        assert status == 200, r
        choice = r["choices"][0]
        assert choice["message"]["content"] == text
        assert choice["finish_reason"] == "stop"
        assert not choice["message"].get("tool_calls")
        status, content, finish, calls = chat_stream(served, num_draft_tokens=k, **ask)
        assert (status, content, finish, calls) == (200, text, ["stop"], [])


def test_a_tool_call_that_does_not_parse_is_text_on_messages(served, monkeypatch):
    """The same on /v1/messages: a 200 whose text block holds the call's text, and
    stop_reason end_turn (not tool_use without a tool_use block), streamed or not;
    a well-formed call after it is still a tool_use block."""
    tokenizer = served.generator.model_provider.tokenizer
    bad = "<tool_call>5</tool_call>"
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for reply, blocks, stop in (
        (bad, ["text"], "end_turn"),
        (bad + good + "</tool_call>", ["text", "tool_use"], "tool_use"),
    ):
        tokens = tokenizer.encode(reply, add_special_tokens=False)
        with monkeypatch.context() as patch:
            scripted(tokens + [min(tokenizer.eos_token_ids)], tokenizer, patch)
            ask = dict(max_tokens=200, tools=[ANTHROPIC_WEATHER])
            status, r = messages(served, **ask)
            assert status == 200, r
            assert [b["type"] for b in r["content"]] == blocks, json.dumps(r)
            assert r["content"][0]["text"] == bad and r["stop_reason"] == stop
            content, delta = messages_stream(served, **ask)
            assert content == bad and delta["stop_reason"] == stop


def test_a_forced_call_to_a_tool_without_a_name_is_refused(served):
    """A tool without function.name: a 400 naming tools, forced or not (the
    template would render a call to nothing)."""
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    for choice in ("required", "auto"):
        status, r = chat(served, tools=[nameless], tool_choice=choice, max_tokens=4)
        assert status == 400 and r["error"]["param"] == "tools", r
        assert "tools[0].function.name" in r["error"]["message"]


# --- stop strings -------------------------------------------------------------------


def greedy_pieces(local, max_tokens):
    """The greedy reply to USER, as the text of each token."""
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    return [r.text for r in stream_generate(model, tokenizer, prompt, max_tokens)]


def inside_tokens(pieces):
    """A stop string that begins inside one token of ``pieces`` and ends inside
    the next (a span of clean text): its start, the token it ends in, the string."""
    for i in range(len(pieces) - 1):
        here, after = pieces[i], pieces[i + 1]
        if len(here) > 1 and len(after) > 1 and "\ufffd" not in here + after:
            return i, i + 1, here[1:] + after[:1]
    raise AssertionError(f"no two clean tokens to stop inside: {pieces}")


def test_a_stop_string_inside_tokens_stops_the_reply(served, local):
    """A stop string that neither begins nor ends on a token boundary ends the
    reply where it begins (finish stop; the token that completes it the last
    counted), streamed or not, with drafts; on /v1/messages stop_reason
    stop_sequence names it."""
    pieces = greedy_pieces(local, 16)
    start, last, stop = inside_tokens(pieces)
    want = "".join(pieces[:start]) + pieces[start][0]
    ask = dict(max_tokens=16, stop=["never there", stop])
    for k in (0, 2):
        status, r = chat(served, num_draft_tokens=k, **ask)
        choice = r["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (want, "stop")
        assert r["usage"]["completion_tokens"] == last + 1
        _, content, finish, _ = chat_stream(served, num_draft_tokens=k, **ask)
        assert (content, finish) == (want, ["stop"])
    anthropic = dict(max_tokens=16, stop_sequences=["never there", stop])
    status, r = messages(served, **anthropic)
    assert [b["text"] for b in r["content"]] == [want]
    assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", stop)
    content, delta = messages_stream(served, **anthropic)
    assert content == want
    assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", stop)


def test_text_held_as_a_possible_stop_string_is_sent(served, local):
    """A reply that ends (by length, or EOS) while its text ends like the start of
    a stop string sends all of its text, nothing stripped: finish length or stop,
    no stop_sequence."""
    pieces = greedy_pieces(local, 16)
    never = "".join(pieces)[-2:] + "\u0001never"  # how the reply ends, no more
    status, r = chat(served, max_tokens=16, stop=[never])
    choice = r["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        "".join(pieces),
        "length",
    )
    _, content, finish, _ = chat_stream(served, max_tokens=16, stop=[never])
    assert (content, finish) == ("".join(pieces), ["length"])
    forced = dict(max_tokens=16, response_format=regex("abc"), stop=["cd", "bcx"])
    status, r = chat(served, **forced)
    choice = r["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("abc", "stop")
    _, content, finish, _ = chat_stream(served, **forced)
    assert (content, finish) == ("abc", ["stop"])


# --- logprobs -----------------------------------------------------------------------


def test_top_logprobs_are_likeliest_first_and_valid_json(served):
    """top_logprobs: sorted likeliest first, the greedy token first, and only
    tokens that can be drawn (none at -inf under a grammar), so the reply is valid
    JSON (RFC 8259 has no -Infinity)."""
    for extra in ({}, {"response_format": regex("ab")}):
        status, r = chat(served, max_tokens=3, logprobs=True, top_logprobs=5, **extra)
        assert status == 200, r
        for position in r["choices"][0]["logprobs"]["content"]:
            values = [t["logprob"] for t in position["top_logprobs"]]
            assert values == sorted(values, reverse=True) and values
            assert all(math.isfinite(v) for v in values)
            assert len(values) == 5 or extra
            assert position["id"] == position["top_logprobs"][0]["id"]


# --- penalties ----------------------------------------------------------------------

PENALTIES = [
    ("frequency_penalty", -1e308),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -1e308),
    ("presence_penalty", -3),
    ("repetition_penalty", 1e-308),
    ("repetition_penalty", 1e308),
]


def test_penalties_that_overflow_are_refused_everywhere(served, local):
    """Penalties out of range (OpenAI's -2..2 for presence and frequency; 0.01 to
    100 for mlx-lm's repetition penalty, 0 off): a 400 naming the field on both
    APIs, an MTPError from the Python API, a usage error (exit 2) from the CLI.
    The bounds themselves are taken."""
    model, tokenizer = local
    for name, value in PENALTIES:
        status, r = chat(served, max_tokens=2, **{name: value})
        assert status == 400 and r["error"]["param"] == name, r
        status, r = messages(served, max_tokens=2, **{name: value})
        assert status == 400 and name in r["error"]["message"], r
        with pytest.raises(MTPError, match=name):
            mtp_generate(model, tokenizer, "hi", max_tokens=2, **{name: value})
        flag = "--" + name.replace("_", "-")
        done = CliRunner().invoke(main, ["generate", "-p", "hi", flag, str(value)])
        assert done.exit_code == 2 and f"'{flag}'" in done.output, done.output
    for name, value in [("frequency_penalty", -2), ("repetition_penalty", 0.01)]:
        status, r = chat(served, max_tokens=2, **{name: value})
        assert status == 200, r


def test_a_reply_that_would_not_be_json_is_a_whole_error(served, monkeypatch):
    """Should a NaN reach a reply (here a logprob, made so), the reply is refused
    as it would not be JSON: a whole 500 error reply (not an empty one, nor
    NaN in its body), and the server goes on."""
    real = jobs.top_logprobs

    def with_nan(logprobs, n, tokenizer):
        return tuple(dict(t, logprob=math.nan) for t in real(logprobs, n, tokenizer))

    for module in (scheduler, generator):  # batched, and alone
        monkeypatch.setattr(module, "top_logprobs", with_nan)
    ask = dict(max_tokens=3, logprobs=True, top_logprobs=2)
    status, r = chat(served, **ask)
    assert status == 500 and "JSON" in r["error"]["message"], r
    status, r = chat(served, max_tokens=3)  # the next is served
    assert status == 200, r

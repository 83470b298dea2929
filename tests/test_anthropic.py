"""``mlx-mtp serve``'s Messages API through the official ``anthropic`` client and raw
HTTP: replies equal `mlx_mtp.generate` (streamed or not, drafting), a continued
conversation reuses its cached prefix, stop sequences, both key headers, Anthropic's
error bodies, tool use both ways, and tool calls byte-identical with drafting on and
off, streamed or not, in both APIs. One server for the module (a template that renders
tools, tool calls and tool results), a few tokens per request."""

import http.client
import io
import json
import re
import shutil

import anthropic
import jsonschema
import openai
import pytest

from mlx_mtp import anthropic_api
from mlx_mtp.generate import generate as mtp_generate
from mlx_mtp.generate import stream_generate
from mlx_mtp.loading import load
from mlx_mtp.server import Server, server_args
from mlx_mtp.serving import scheduler
from mlx_mtp.testing.fixtures import write_checkpoint

from .test_server import scripted

KEY, TOOLS_KEY = "sekret", "tools"  # the tool tests' caches are their own
MODEL = "default_model"
USER = [{"role": "user", "content": "Write a function."}]
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}"
    "{{ t.function.name }}: {{ t.function.description }}\n{% endfor %}"
    'Call tools as <tool_call>{"name": .., "arguments": ..}</tool_call>'
    "{# tool_call.name #}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% if m.role == 'tool' %} [{{ m.name }}]{% endif %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def tool_checkpoint(out):
    """A predictable qwen3_5 checkpoint in ``out`` with the Hermes-style tool
    `TEMPLATE` as its chat template."""
    checkpoint = write_checkpoint("qwen3_5", out / "plain", predictable=True)
    folder = shutil.copytree(checkpoint, out / "tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folder(tool_folder):
    return tool_folder


@pytest.fixture(scope="module")
def served(folder):
    args = server_args(model=str(folder), port=0, api_key=[KEY, TOOLS_KEY], max_batch=1)
    server = Server(args).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def local(folder):
    return load(str(folder))


def expected(local, messages, max_tokens, **kw):
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mtp_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw)


def events_of(client, **kw):
    return list(client.messages.create(stream=True, **{"model": MODEL, **kw}))


def test_replies_equal_generate_streamed_or_not_with_drafts(client, local):
    """With drafts, each reply is plain decoding's. (Replies end by length: see
    test_server.)"""
    want = expected(local, USER, 12, num_draft_tokens=0)
    drafting = {"num_draft_tokens": 2}
    r = client.messages.create(
        model=MODEL, max_tokens=12, messages=USER, extra_body=drafting
    )
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert r.id.startswith("msg_") and r.role == "assistant"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    mtp = r.model_extra["mtp"]
    assert mtp["num_draft_tokens"] == 2 and mtp["drafted"] >= mtp["accepted"] > 0
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=USER, extra_body=drafting
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == want and final.stop_reason == "max_tokens"
    events = events_of(client, max_tokens=12, messages=USER, extra_body=drafting)
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert [e.type for e in events[-3:]] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == want
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 12
    assert delta.model_extra["mtp"]["drafted"] > 0


def test_structured_output_and_penalties_with_drafts(client, local):
    """``output_format`` (and ``output_config.format``): a schema-valid reply equal
    to plain constrained decoding, with drafts; the penalties and logit_bias fields
    act as on the chat endpoint; a schema the engine refuses is a 400."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    want = expected(local, USER, 120, num_draft_tokens=0, json_schema=schema)
    jsonschema.validate(json.loads(want), schema)
    fmt = {"type": "json_schema", "schema": schema}
    for extra in (
        {"num_draft_tokens": 3, "output_format": fmt},
        {"num_draft_tokens": 3, "output_config": {"format": fmt}},
    ):
        r = client.messages.create(
            model=MODEL, max_tokens=120, messages=USER, extra_body=extra
        )
        assert r.content[0].text == want and r.stop_reason == "end_turn"
        assert r.model_extra["mtp"]["accepted"] > 0
    penalties = {"frequency_penalty": 0.7, "logit_bias": {"5": 2.0}}
    want = expected(
        local, USER, 12, num_draft_tokens=0, frequency_penalty=0.7, logit_bias={5: 2.0}
    )
    r = client.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=USER,
        extra_body={"num_draft_tokens": 2, **penalties},
    )
    assert r.content[0].text == want
    bad = {"output_format": {"type": "json_schema", "schema": {"type": "wat"}}}
    with pytest.raises(anthropic.BadRequestError, match="wat"):
        client.messages.create(model=MODEL, max_tokens=8, messages=USER, extra_body=bad)


def test_system_and_a_continued_conversation_reuse_the_cached_prefix(client, local):
    """System blocks are joined by a blank line; turn 2 (the reply as a content
    block) runs only its new tokens and equals a fresh decode of it all."""
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Ok."}]
    first = [{"role": "user", "content": "Count with me."}]
    r1 = client.messages.create(
        model=MODEL, max_tokens=8, system=system, messages=first
    )
    chat = [{"role": "system", "content": "Be brief.\n\nOk."}, *first]
    assert r1.content[0].text == expected(local, chat, 8)
    reply = r1.content[0].text
    second = first + [
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": "Again."}]},
    ]
    r2 = client.messages.create(
        model=MODEL, max_tokens=8, system=system, messages=second
    )
    usage = r2.usage
    first_prompt = r1.usage.input_tokens + r1.usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens >= first_prompt
    assert usage.input_tokens > 0  # the new turn's tokens, not cached
    chat += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again."},
    ]
    assert r2.content[0].text == expected(local, chat, 8)


def test_stop_sequences(client, local):
    """A stop sequence in the greedy reply ends it before the sequence, with
    stop_reason stop_sequence naming it, streamed or not."""
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    responses = list(stream_generate(model, tokenizer, prompt, 12))
    tokens = [r.token for r in responses]
    for i in range(4, 11):  # a span of whole characters that encodes back
        texts = [r.text for r in responses[i - 1 : i + 2]]
        word = texts[1] + texts[2]
        clean = all(t and "\ufffd" not in t for t in texts)
        if clean and tokenizer.encode(word, add_special_tokens=False) == (
            tokens[i : i + 2]
        ):
            break
    else:
        raise AssertionError("no span of the reply to stop at")
    stops = ["never there", word]
    r = client.messages.create(
        model=MODEL, max_tokens=12, messages=USER, stop_sequences=stops
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert r.content[0].text == "".join(r.text for r in responses[:i])
    events = events_of(client, max_tokens=12, messages=USER, stop_sequences=stops)
    assert events[-2].delta.stop_sequence == word


def post(served, path, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    h = {"Content-Type": "application/json", **headers}
    conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_keys_either_header_and_anthropic_errors(served):
    body = {"model": MODEL, "max_tokens": 2, "messages": USER}
    bearer = anthropic.Anthropic(base_url=served.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**body).usage.output_tokens == 2
    status, _ = post(served, "/v1/messages?beta=true", body, {"x-api-key": KEY})
    assert status == 200
    wrong = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(**body)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    assert "x-api-key" in error["error"]["message"]
    chat = {"model": MODEL, "max_tokens": 2, "messages": USER}  # OpenAI's, by x-api-key
    assert post(served, "/v1/chat/completions", chat, {"x-api-key": KEY})[0] == 200
    status, error = post(served, "/v1/messages/count_tokens", body, {"x-api-key": KEY})
    assert status == 404 and error["error"]["type"] == "not_found_error"
    status, error = post(served, "/v1/messages", {**body, "model": "x"}, {})
    assert status == 401  # the key first
    status, error = post(
        served, "/v1/messages", {**body, "model": "x"}, {"x-api-key": KEY}
    )
    assert status == 404 and error["error"]["type"] == "not_found_error"


IMAGE = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": ""},
}
BAD = [
    ("no max_tokens", {"max_tokens": None}, "max_tokens is required"),
    ("max_tokens type", {"max_tokens": "many"}, "max_tokens"),
    ("bad block", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "type"),
    (
        "unknown block",
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "'video'",
    ),
    ("image", {"messages": [{"role": "user", "content": [IMAGE]}]}, "an image"),
    ("no blocks", {"messages": [{"role": "user", "content": []}]}, "non-empty"),
    ("system role", {"messages": [{"role": "system", "content": "x"}]}, "role"),
    (
        "prefill",
        {"messages": USER + [{"role": "assistant", "content": "Hi"}]},
        "prefill",
    ),
    ("OpenAI stop", {"stop": ["x"]}, "stop_sequences"),
    ("empty stop", {"stop_sequences": [""]}, "stop_sequences"),
    ("tools type", {"tools": {"name": "x"}}, "tools must be a list"),
    ("server tool", {"tools": [{"type": "bash_20250124", "name": "bash"}]}, "custom"),
    ("no schema", {"tools": [{"name": "f"}]}, "input_schema"),
    ("forced without tools", {"tool_choice": {"type": "any"}}, "needs tools"),
    (
        "forced unknown tool",
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "'nope'",
    ),
    (
        "one call with auto",
        {"tools": [WEATHER], "tool_choice": {"disable_parallel_tool_use": True}},
        "tool_choice",
    ),
    ("OpenAI parallel", {"parallel_tool_calls": False}, "disable_parallel"),
    ("bad tool_choice", {"tool_choice": "auto"}, "tool_choice"),
    (
        "unknown tool_use_id",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                }
            ]
        },
        "tool_use_id",
    ),
    ("sampling", {"temperature": -1}, "temperature"),
    ("mlx-mtp field", {"num_draft_tokens": "lots"}, "num_draft_tokens"),
]


@pytest.mark.parametrize("what,change,words", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_400s_in_anthropic_form(client, what, change, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": USER, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError, match=words) as caught:
        client.post("/v1/messages", body=body, cast_to=object)  # unchecked here
    error = caught.value.body
    assert (
        error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    )


def test_a_failure_mid_reply_is_an_anthropic_error(client, monkeypatch):
    """A round that fails: a 500 ``api_error`` for a reply not streamed, an
    ``error`` event for a stream that started; the server goes on."""
    step = scheduler.Batch.step
    rounds = []

    def failing(self):
        rounds.append(1)
        if len(rounds) % 3 == 0:
            raise RuntimeError("the round broke")
        return step(self)

    monkeypatch.setattr(scheduler.Batch, "step", failing)
    body = {"model": MODEL, "max_tokens": 12, "messages": USER}
    extra = {"num_draft_tokens": 0}
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(**body, extra_body=extra)
    assert caught.value.body["error"] == {
        "type": "api_error",
        "message": "the round broke",
    }
    rounds.clear()
    seen = []
    with pytest.raises(anthropic.APIStatusError, match="the round broke"):
        for event in client.messages.create(**body, stream=True, extra_body=extra):
            seen.append(event.type)
    assert seen[0] == "message_start"
    monkeypatch.setattr(scheduler.Batch, "step", step)
    assert client.messages.create(**body).stop_reason == "max_tokens"


# --- tools ---------------------------------------------------------------------------


def test_tool_use_and_tool_calls_stay_whole(served, monkeypatch):
    """A scripted reply that is text then a tool call (with a non-ASCII argument):
    a ``tool_use`` block with stop_reason tool_use, streamed (one input_json_delta)
    and not, and OpenAI ``tool_calls``. Drafting changes how the reply comes in
    rounds (fewer, of several tokens), never the call: its arguments are
    the same bytes in both APIs, streamed or not, k = 0 or 2. A follow-up turn's
    ``tool_result`` renders into the prompt."""
    tokenizer = served.generator.model_provider.tokenizer
    arguments = {"city": "Zürich", "n": 2}
    call = json.dumps(
        {"name": "get_weather", "arguments": arguments}, ensure_ascii=False
    )
    text = "One moment."
    reply = tokenizer.encode(
        f"{text}<tool_call>{call}</tool_call>", add_special_tokens=False
    )
    prompts = scripted(reply + [min(tokenizer.eos_token_ids)], tokenizer, monkeypatch)
    claude = anthropic.Anthropic(base_url=served.url, api_key=TOOLS_KEY, max_retries=0)
    gpt = openai.OpenAI(base_url=served.url + "/v1", api_key=TOOLS_KEY, max_retries=0)
    ask = {"model": MODEL, "max_tokens": 128, "messages": USER, "tools": [WEATHER]}
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    calls, rounds = {}, {}  # the call's arguments as text; rounds of the reply
    for k in (0, 2):
        extra = {"num_draft_tokens": k}
        r = claude.messages.create(**ask, extra_body=extra)
        assert [b.type for b in r.content] == ["text", "tool_use"]
        assert r.content[0].text == text and r.stop_reason == "tool_use"
        use = r.content[1]
        assert use.id.startswith("toolu_") and use.name == "get_weather"
        assert use.input == arguments
        calls["anthropic", k] = json.dumps(use.input, ensure_ascii=False)
        rounds[k] = r.model_extra["mtp"]["rounds"]
        with claude.messages.stream(**ask, extra_body=extra) as stream:
            events = list(stream)  # Anthropic's events and the client's own
            assert stream.get_final_message().content[1].input == arguments
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        pieces = [d.text for d in deltas if d.type == "text_delta"]
        (partial,) = [d.partial_json for d in deltas if d.type == "input_json_delta"]
        calls["anthropic stream", k] = partial
        assert "".join(pieces) == text
        assert events[-2].delta.stop_reason == "tool_use"
        chat = {"model": MODEL, "messages": USER, "tools": openai_tools}
        o = gpt.chat.completions.create(**chat, max_tokens=128, extra_body=extra)
        (tool_call,) = o.choices[0].message.tool_calls
        assert o.choices[0].finish_reason == "tool_calls"
        calls["openai", k] = tool_call.function.arguments
        stream = gpt.chat.completions.create(
            **chat, max_tokens=128, stream=True, extra_body=extra
        )
        calls["openai stream", k] = "".join(
            t.function.arguments
            for c in stream
            if c.choices
            for t in c.choices[0].delta.tool_calls or ()
        )
    assert rounds[2] < rounds[0] == len(reply) + 1  # drafts came in whole rounds
    assert len(set(calls.values())) == 1, calls
    assert json.loads(calls["openai", 0]) == arguments
    assert "get_weather: Weather in a city" in prompts[0]
    follow = USER + [
        {"role": "assistant", "content": r.content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "Sunny, 21 C"}],
                }
            ],
        },
    ]
    claude.messages.create(**{**ask, "messages": follow})
    assert "<|im_start|>tool\nSunny, 21 C [get_weather]<|im_end|>" in prompts[-1]
    assert '"city": "Zürich"' in prompts[-1]  # the call, rendered


def test_tool_choice_none_hides_the_tools(served, monkeypatch):
    """Anthropic's none and OpenAI's: the template does not show the tools."""
    tokenizer = served.generator.model_provider.tokenizer
    prompts = scripted([min(tokenizer.eos_token_ids)], tokenizer, monkeypatch)
    claude = anthropic.Anthropic(base_url=served.url, api_key=TOOLS_KEY, max_retries=0)
    for choice, shown in (({"type": "auto"}, True), ({"type": "none"}, False)):
        r = claude.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=USER,
            tools=[WEATHER],
            tool_choice=choice,
        )
        assert r.stop_reason == "end_turn" and r.content == []
        assert ("get_weather:" in prompts[-1]) is shown
    gpt = openai.OpenAI(base_url=served.url + "/v1", api_key=TOOLS_KEY, max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    for choice, shown in (("auto", True), ("none", False)):
        gpt.chat.completions.create(
            model=MODEL, max_tokens=4, messages=USER, tools=[tool], tool_choice=choice
        )
        assert ("get_weather:" in prompts[-1]) is shown


ADD = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
PLACE = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_forced_tool_calls_are_the_models_own_and_stay_whole(served):
    """tool_choice any / tool (Anthropic) and required / a function (OpenAI): the
    model's own reply, constrained to tool calls whose arguments follow the tool's
    schema, is the same call with drafts as without, in both APIs, streamed or
    not; disable_parallel_tool_use / parallel_tool_calls false give one call."""
    claude = anthropic.Anthropic(base_url=served.url, api_key=TOOLS_KEY, max_retries=0)
    gpt = openai.OpenAI(base_url=served.url + "/v1", api_key=TOOLS_KEY, max_retries=0)
    tools = [ADD, PLACE]
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in tools
    ]
    ask = {"model": MODEL, "max_tokens": 160, "messages": USER, "tools": tools}
    chat = {"model": MODEL, "max_tokens": 160, "messages": USER, "tools": openai_tools}
    cases = [
        ({"type": "any", "disable_parallel_tool_use": True}, "required", None),
        ({"type": "tool", "name": "get_weather"}, GET_WEATHER, "get_weather"),
    ]
    for anthropic_choice, openai_choice, name in cases:
        calls = {}
        for k in (0, 2):
            extra = {"num_draft_tokens": k, "draft_source": "heads"}
            r = claude.messages.create(
                **ask, tool_choice=anthropic_choice, extra_body=extra
            )
            assert r.stop_reason == "tool_use"
            uses = [b for b in r.content if b.type == "tool_use"]
            assert uses and all(b.type == "tool_use" for b in r.content)
            if name is not None:
                assert {u.name for u in uses} == {name}
            else:
                assert len(uses) == 1
            schema = {t["name"]: t["input_schema"] for t in tools}[uses[0].name]
            jsonschema.validate(uses[0].input, schema)
            if k:
                assert r.model_extra["mtp"]["drafted"] > 0
            calls["anthropic", k] = [(u.name, u.input) for u in uses]
            with claude.messages.stream(
                **ask, tool_choice=anthropic_choice, extra_body=extra
            ) as stream:
                final = stream.get_final_message()
            calls["anthropic stream", k] = [
                (b.name, b.input) for b in final.content if b.type == "tool_use"
            ]
            single = {"parallel_tool_calls": False} if name is None else {}
            o = gpt.chat.completions.create(
                **chat, tool_choice=openai_choice, extra_body=extra, **single
            )
            assert o.choices[0].finish_reason == "tool_calls"
            calls["openai", k] = [
                (t.function.name, json.loads(t.function.arguments))
                for t in o.choices[0].message.tool_calls
            ]
        assert all(c == calls["anthropic", 0] for c in calls.values()), calls


GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_forced_tool_calls_refused_where_they_cannot_be(served, client):
    """A model whose template has no JSON tool calls, a forced call with a
    response_format, an unknown tool: 400s naming tool_choice."""
    gpt = openai.OpenAI(base_url=served.url + "/v1", api_key=TOOLS_KEY, max_retries=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    bad = [
        dict(tool_choice="required"),
        dict(
            tool_choice="required", tools=tools, response_format={"type": "json_object"}
        ),
        dict(tool_choice={"type": "function", "function": {"name": "g"}}, tools=tools),
        dict(tool_choice="always", tools=tools),
    ]
    for fields in bad:
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            gpt.chat.completions.create(
                model=MODEL, max_tokens=4, messages=USER, **fields
            )


# --- the translation alone -----------------------------------------------------------


def test_chat_request_translates_turns_and_tools():
    body = {
        "model": "m",
        "max_tokens": 5,
        "metadata": {"user_id": "u"},
        "system": "S",
        "stop_sequences": ["END"],
        "num_draft_tokens": 3,
        "messages": [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "A"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "R"},
                    {"type": "text", "text": "B", "cache_control": {"type": "x"}},
                    {"type": "text", "text": "C"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    chat, stream = anthropic_api.chat_request(body)
    assert stream is False
    assert chat == {
        "model": "m",
        "max_tokens": 5,
        "num_draft_tokens": 3,
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": "A",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "name": "f", "content": "R"},
            {"role": "user", "content": "B\n\nC"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "",
                    "parameters": {"type": "object"},
                },
            }
        ],
        "stop": ["END"],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_reply_events_and_message():
    """Reasoning is a thinking block; a chunk's text continues the open text block;
    a tool call is a whole tool_use block; the message is the blocks streamed."""
    reply = anthropic_api.Reply("m", 10, 4, lambda finish: ("tool_use", None))
    assert reply.start()[0][1]["message"]["usage"]["input_tokens"] == 6
    chunks = [
        {"choices": [{"delta": {"reasoning": "think"}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {"id": "x-1", "function": {"name": "f", "arguments": "{}"}}
                        ]
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"completion_tokens": 7}, "mtp": {"drafted": 1}},
    ]
    names = [name for c in chunks for name, _ in reply.add(c)] + [
        name for name, _ in reply.end()
    ]
    assert names == [
        "content_block_start",  # thinking
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # text
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # tool_use
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = reply.message()
    assert message["content"] == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "ab"},
        {"type": "tool_use", "id": "toolu_x1", "name": "f", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use" and message["mtp"] == {"drafted": 1}
    assert message["usage"]["output_tokens"] == 7


def test_events_go_out_as_they_come_when_streamed_and_never_otherwise():
    """`Events` writes a streamed reply's events as each chunk comes (server-sent
    events, in order), and nothing of a reply not streamed: its message is whole."""
    chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}]}
    for stream in (True, False):
        out = io.BytesIO()
        events = anthropic_api.Events(out, stream)
        events.open(anthropic_api.Reply("m", 3, 0, anthropic_api.stop_reason))
        opened = out.getvalue()
        events.add(chunk)
        added = out.getvalue()[len(opened) :]
        events.close()
        if not stream:
            assert out.getvalue() == b""
            assert events.reply.message()["content"] == [{"type": "text", "text": "hi"}]
            continue
        assert opened.startswith(b"event: message_start\ndata: {")
        assert added.startswith(b"event: content_block_start\n")
        assert b'"text": "hi"' in added and added.endswith(b"\n\n")
        names = re.findall(rb"^event: (\w+)$", out.getvalue(), re.M)
        assert names[-2:] == [b"message_delta", b"message_stop"], names


def test_stop_reason():
    assert anthropic_api.stop_reason("length", "ab") == ("max_tokens", None)
    assert anthropic_api.stop_reason("tool_calls") == ("tool_use", None)
    assert anthropic_api.stop_reason("stop") == ("end_turn", None)
    assert anthropic_api.stop_reason("stop", "ab") == ("stop_sequence", "ab")

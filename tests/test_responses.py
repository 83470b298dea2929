"""``mlx-mtp serve``'s Responses API through the official ``openai`` client's
``responses`` methods: replies equal the chat endpoint's and `mlx_mtp.generate`
(streamed, with the client's own event accumulator, or not; drafting), usage with
``cached_tokens``, ``max_output_tokens`` as an incomplete response, a forced tool
call and a JSON schema equal to the chat endpoint's, ``previous_response_id`` going
on from a kept response (and ``store: false`` keeping none), function-call items
rendered into the prompt, and 400s naming the field. One server for the module."""

import json

import jsonschema
import openai
import pytest

from mlx_mtp import responses_api
from mlx_mtp.server import Server, server_args
from mlx_mtp.server_checks import RequestError

from .test_anthropic import ADD, MODEL, PLACE, USER
from .test_server import scripted

KEY, OTHER = "sekret", "other"


@pytest.fixture(scope="module")
def folder(tool_folder):
    return tool_folder


@pytest.fixture(scope="module")
def served(folder):
    args = server_args(model=str(folder), port=0, api_key=[KEY, OTHER], max_batch=1)
    server = Server(args).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def local(folder):
    from mlx_mtp.loading import load

    return load(str(folder))


def expected(local, messages, max_tokens, **kw):
    """Plain decoding's reply to ``messages`` (chat template, generation prompt)."""
    from mlx_mtp.generate import generate

    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw)


def function_tools(tools):
    """Anthropic-style tool specs as Responses function tools."""
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        }
        for t in tools
    ]


def test_replies_equal_chat_and_generate_streamed_or_not(client, local):
    """With drafts, the response's text is plain decoding's and the chat
    endpoint's; streamed, the events come in the documented order; usage counts the
    prompt and the reply; a reply cut by max_output_tokens is incomplete."""
    want = expected(local, USER, 12, num_draft_tokens=0)
    drafting = {"num_draft_tokens": 2}
    r = client.responses.create(
        model=MODEL,
        input="Write a function.",
        max_output_tokens=12,
        extra_body=drafting,
    )
    assert r.output_text == want and r.id.startswith("resp_")
    assert (
        r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    )
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    mtp = r.model_extra["mtp"]
    assert mtp["num_draft_tokens"] == 2 and mtp["drafted"] >= mtp["accepted"] > 0
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=12, extra_body=drafting
    )
    assert chat.choices[0].message.content == want

    events = list(
        client.responses.create(
            model=MODEL,
            input=USER,
            max_output_tokens=12,
            stream=True,
            extra_body=drafting,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == want and len(deltas) > 1
    assert events[-1].response.output[0].content[0].text == want


def test_instructions_and_previous_response_go_on_from_the_cache(client, local):
    """instructions are the system message; a request with previous_response_id
    continues the kept conversation (its cached prefix reused: cached_tokens) and
    equals a fresh decode of it all; store false keeps nothing; another key's
    response is not found."""
    first = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Count with me.",
        max_output_tokens=8,
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Count with me."},
    ]
    assert first.output_text == expected(local, chat, 8)
    second = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Again."}]}],
        max_output_tokens=8,
    )
    chat += [
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Again."},
    ]
    assert second.output_text == expected(local, chat, 8)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.previous_response_id == first.id

    unkept = client.responses.create(
        model=MODEL, input="Count with me.", max_output_tokens=4, store=False
    )
    with pytest.raises(openai.BadRequestError, match="is kept here") as refused:
        client.responses.create(
            model=MODEL,
            previous_response_id=unkept.id,
            input="Again.",
            max_output_tokens=4,
        )
    assert refused.value.param == "previous_response_id"
    other = openai.OpenAI(base_url=client.base_url, api_key=OTHER, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no response"):
        other.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="Again.",
            max_output_tokens=4,
        )


def test_a_schema_equals_the_chat_endpoints(client, local):
    """text.format json_schema: a schema-valid reply equal to plain constrained
    decoding, with drafts, streamed or not."""
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
    fmt = {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}
    r = client.responses.create(
        model=MODEL,
        input=USER,
        max_output_tokens=120,
        text={"format": fmt},
        extra_body={"num_draft_tokens": 3},
    )
    assert r.output_text == want and r.status == "completed"
    assert r.model_extra["mtp"]["accepted"] > 0
    with client.responses.stream(  # the client's own accumulator of the events
        model=MODEL,
        input=USER,
        max_output_tokens=120,
        text={"format": fmt},
        extra_body={"num_draft_tokens": 3},
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == want


def test_forced_tool_calls_equal_the_chat_endpoints(served, client):
    """tool_choice required / a named function: function_call items whose arguments
    follow the tool's schema, the chat endpoint's calls, with drafts or not,
    streamed (the client's accumulator) or not."""
    tools = function_tools([ADD, PLACE])
    chat_tools = [
        {"type": "function", "function": {k: t[k] for k in t if k != "type"}}
        for t in tools
    ]
    schemas = {t["name"]: t["parameters"] for t in tools}
    for choice, chat_choice in (
        ("required", "required"),
        (
            {"type": "function", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ):
        calls = {}
        for k in (0, 2):
            extra = {"num_draft_tokens": k, "draft_source": "heads"}
            r = client.responses.create(
                model=MODEL,
                input=USER,
                tools=tools,
                tool_choice=choice,
                max_output_tokens=160,
                extra_body=extra,
            )
            items = [item for item in r.output if item.type == "function_call"]
            assert items and all(item.type == "function_call" for item in r.output)
            for item in items:
                jsonschema.validate(json.loads(item.arguments), schemas[item.name])
                assert item.call_id and item.status == "completed"
            calls["responses", k] = [(i.name, json.loads(i.arguments)) for i in items]
            with client.responses.stream(
                model=MODEL,
                input=USER,
                tools=tools,
                tool_choice=choice,
                max_output_tokens=160,
                extra_body=extra,
            ) as stream:
                final = stream.get_final_response()
            calls["stream", k] = [
                (i.name, json.loads(i.arguments))
                for i in final.output
                if i.type == "function_call"
            ]
            o = client.chat.completions.create(
                model=MODEL,
                messages=USER,
                tools=chat_tools,
                tool_choice=chat_choice,
                max_tokens=160,
                extra_body=extra,
            )
            calls["chat", k] = [
                (t.function.name, json.loads(t.function.arguments))
                for t in o.choices[0].message.tool_calls
            ]
        assert all(c == calls["chat", 0] for c in calls.values()), calls


def test_function_call_items_render_into_the_prompt(served, client, monkeypatch):
    """An earlier turn's function_call and function_call_output items are the
    assistant's tool call and the tool's message in the chat template."""
    tokenizer = served.generator.model_provider.tokenizer
    prompts = scripted([min(tokenizer.eos_token_ids)], tokenizer, monkeypatch)
    arguments = json.dumps({"city": "Zürich"}, ensure_ascii=False)
    r = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        ],
        tools=function_tools([PLACE]),
        max_output_tokens=4,
    )
    assert r.status == "completed" and r.output == []
    assert '"city": "Zürich"' in prompts[-1]
    assert "<|im_start|>tool\nSunny" in prompts[-1]
    assert "get_weather: Weather in a city" in prompts[-1]


IMAGE_PART = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": USER}, "messages is not a Responses API field: send input"),
        ({"max_tokens": 4}, "send max_output_tokens"),
        ({"input": []}, "input must be a string or a non-empty list"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "image_url must be a data: URL",
        ),
        (
            {"input": [{"role": "user", "content": [IMAGE_PART]}]},
            "is an image: this model takes no images",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "text and image parts only",
        ),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"tool_choice": "required"}, "a forced tool call needs tools"),
        ({"previous_response_id": "resp_nope"}, "no response 'resp_nope'"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"background": True}, "background responses are not supported"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(client, fields, words):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError, match=words):
        client.post("/responses", body=body, cast_to=object)


def test_keys_are_checked(served):
    anonymous = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.responses.create(model=MODEL, input="hi", max_output_tokens=4)


# --- the translation alone -----------------------------------------------------------


def test_chat_request_translates_input_tools_and_format():
    body = {
        "model": "m",
        "instructions": "Sys.",
        "input": [
            {"type": "message", "role": "developer", "content": "Dev."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
        "max_output_tokens": 9,
        "reasoning": {"effort": "low"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "stream": True,
    }
    chat, stream, request = responses_api.chat_request(body, lambda _: None)
    assert stream is True and request.store is False
    assert chat["messages"] == [
        {"role": "system", "content": "Sys."},
        {"role": "system", "content": "Dev."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Yo",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}},
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {}},
    }
    assert chat["max_tokens"] == 9 and chat["stream"] is True
    for dropped in ("reasoning", "include", "store", "input", "instructions", "text"):
        assert dropped not in chat
    earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat, _, _ = responses_api.chat_request(
        {"input": "c", "previous_response_id": "r"}, {"r": earlier}.get
    )
    assert [m["content"] for m in chat["messages"]] == ["a", "b", "c"]
    chat, _, _ = responses_api.chat_request(
        {"input": "c", "tools": body["tools"], "tool_choice": "none"}, dict().get
    )
    assert "tools" not in chat and "tool_choice" not in chat


def test_reply_events_response_and_conversation():
    request = responses_api.Request({"store": True}, [{"role": "user", "content": "q"}])
    reply = responses_api.Reply("m", prompt_tokens=10, cached_tokens=4, request=request)
    events = reply.start()
    chunks = [
        {"choices": [{"delta": {"reasoning": "think"}}]},
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "id": "call_9",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ]
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        },
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}},
    ]
    for chunk in chunks:
        events += reply.add(chunk)
    events += reply.end()
    kinds = [name for name, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    response = events[-1][1]["response"]
    assert [item["type"] for item in response["output"]] == [
        "reasoning",
        "message",
        "function_call",
    ]
    assert response["output"][1]["content"][0]["text"] == "Hello"
    assert response["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }
    assert reply.conversation()[-1] == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": [
            {
                "id": "call_9",
                "type": "function",
                "function": {"name": "f", "arguments": "{}"},
            }
        ],
    }


def test_error_event_and_kept_bounds():
    event = responses_api.error_event(RequestError(400, "bad", "invalid_request_error"))
    name, data = event.decode().split("\n", 1)
    assert name == "event: error"
    assert json.loads(data[len("data: ") :])["message"] == "bad"
    kept = responses_api.Kept(size=2)
    for i in range(3):
        kept.put(f"r{i}", [{"role": "user", "content": str(i)}], owner=1)
    assert kept.get("r0", 1) is None and kept.get("r2", 1) is not None
    assert kept.get("r2", None) is None  # another owner's

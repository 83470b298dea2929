"""``mlx-mtp serve`` through the official ``openai`` client and raw HTTP: replies equal
`mlx_mtp.generate`, sessions run only new tokens, tools reach the template and tool
calls are parsed, bad requests get OpenAI-style errors, a client going away stops its
generation, and a burst of concurrent clients is answered as sequential runs are."""

import http.client
import json
import threading

import openai
import pytest

from mlx_mtp import generate as mtp_generate
from mlx_mtp.loading import load
from mlx_mtp.server import Server, server_args
from mlx_mtp.serving import provider, scheduler

KEY = "sekret"
MESSAGES = [{"role": "user", "content": "Write a function."}]


@pytest.fixture(scope="module")
def folder(checkpoint):
    # a hybrid trunk: sessions must keep its recurrent state exact (the session's
    # checkpoint, whose round costs and ranking each worker measures once)
    return checkpoint("qwen3_5", predictable=True)


@pytest.fixture(scope="module")
def served(folder):
    server = Server(server_args(model=str(folder), port=0, api_key=KEY)).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def local(folder):
    return load(str(folder))


def expected(local, messages, max_tokens, **kw):
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mtp_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw)


def test_chat_equals_generate_with_usage_and_mtp(client, local):
    """(Replies here end by length: at EOS mlx-lm's server drops the detokenizer's
    final flush, an incomplete UTF-8 tail, which `generate` returns.)"""
    r = client.chat.completions.create(
        model="default_model",
        messages=MESSAGES,
        max_tokens=12,
        extra_body={"num_draft_tokens": 3},  # auto's choice depends on timings
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == expected(local, MESSAGES, 12)
    usage, mtp = r.usage, r.model_extra["mtp"]
    assert r.choices[0].logprobs is None  # not asked for: not computed
    with_logprobs = client.chat.completions.create(
        model="default_model",
        messages=MESSAGES,
        max_tokens=12,
        logprobs=True,
        extra_body={"num_draft_tokens": 3},
    )
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == usage.completion_tokens
    assert all(c.logprob <= 0 and c.logprob > -50 for c in content)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert mtp["drafted"] >= mtp["accepted"] > 0
    assert mtp["rounds"] * mtp["tokens_per_round"] >= usage.completion_tokens
    assert mtp["num_draft_tokens"] == 3
    # per position up to the longest draft of any source (lookup drafts up to 8)
    assert len(mtp["acceptance_per_position"]) == mtp["positions"] == 8


def test_lookup_drafts_through_the_server(client, local):
    """``draft_source`` in the request: a lookup reply equals `generate` with lookup,
    which equals plain decoding; the mtp block counts drafts per source; an unknown
    source is a 400."""
    repeat = [{"role": "user", "content": "say a b c a b c a b c a b"}]
    r = client.chat.completions.create(
        model="default_model",
        messages=repeat,
        max_tokens=16,
        extra_body={"num_draft_tokens": 2, "draft_source": "lookup"},
    )
    text = r.choices[0].message.content
    assert text == expected(local, repeat, 16, num_draft_tokens=2)
    assert text == expected(local, repeat, 16, num_draft_tokens=0)
    mtp = r.model_extra["mtp"]
    assert sum(mtp["drafted_by_source"].values()) == mtp["drafted"]
    with pytest.raises(openai.BadRequestError, match="draft_source"):
        client.chat.completions.create(
            model="default_model",
            messages=repeat,
            max_tokens=4,
            extra_body={"draft_source": "ngrams"},
        )


def test_draft_vocab_through_the_server(client, local):
    """``draft_vocab`` in the request: the reply equals plain decoding and the mtp
    block counts the drafts from that vocabulary; a bad value is a 400."""
    r = client.chat.completions.create(
        model="default_model",
        messages=MESSAGES,
        max_tokens=12,
        extra_body={"num_draft_tokens": 2, "draft_vocab": 64, "draft_source": "heads"},
    )
    assert r.choices[0].message.content == expected(
        local, MESSAGES, 12, num_draft_tokens=0
    )
    mtp = r.model_extra["mtp"]
    assert mtp["drafted_by_vocab"] == {"64": mtp["drafted"]} and mtp["drafted"]
    with pytest.raises(openai.BadRequestError, match="draft_vocab"):
        client.chat.completions.create(
            model="default_model",
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"draft_vocab": "most"},
        )


def test_streaming_chat_and_text_completions(client, local):
    chunks = list(
        client.chat.completions.create(
            model="default_model",
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"num_draft_tokens": 2},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(local, MESSAGES, 12, num_draft_tokens=2)
    last = chunks[-1]
    assert last.usage.completion_tokens > 0
    assert last.model_extra["mtp"]["num_draft_tokens"] == 2
    model, tokenizer = local
    r = client.completions.create(
        model="default_model", prompt="def forward(self, x):", max_tokens=6
    )
    want = mtp_generate(model, tokenizer, "def forward(self, x):", max_tokens=6)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == want
    assert [m.id for m in client.models.list().data] == [
        provider.model_id(str(model.source))
    ]


def test_a_second_turn_runs_only_its_new_tokens(client, local):
    """Turn 2 extends turn 1's conversation: only the new tokens are run (usage's
    cached tokens), and the reply equals a fresh decode of the whole conversation."""
    first = [{"role": "user", "content": "Count with me."}]
    r1 = client.chat.completions.create(
        model="default_model", messages=first, max_tokens=12
    )
    reply = r1.choices[0].message.content
    second = first + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again."},
    ]
    r2 = client.chat.completions.create(
        model="default_model", messages=second, max_tokens=12
    )
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens  # the first prompt was not run again
    assert r2.choices[0].message.content == expected(local, second, 12)


def test_tools_reach_the_template_and_tool_calls_are_parsed(tool_folder, monkeypatch):
    """With a template that renders tools (Hermes/Qwen style, mlx-lm's json_tools
    parser), the prompt holds the tool, and a reply that is a tool call comes back as
    OpenAI ``tool_calls``."""
    folder = tool_folder
    _, tokenizer = load(str(folder))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    reply = tokenizer.encode(call + "</tool_call>", add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)
    server = Server(server_args(model=str(folder), port=0, max_batch=1)).start()
    served_tokenizer = server.generator.model_provider.tokenizer
    prompts = scripted(reply + [eos], served_tokenizer, monkeypatch)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather in a city",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]
        r = client.chat.completions.create(
            model="default_model", messages=MESSAGES, tools=tools, max_tokens=64
        )
    finally:
        server.close()
    assert "get_weather: Weather in a city" in prompts[0]
    (tool_call,) = r.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"


def scripted(tokens, tokenizer, monkeypatch) -> list:
    """Make the server's batch reply ``tokens`` (the last one EOS) to every request,
    as many a round as the real round gives (EOS made unreachable there); returns
    the prompts it is given, as text."""
    prompts, given = [], {}  # given: tokens replied so far, by row
    admit, step = scheduler.Batch.admit, scheduler.Batch.step

    def scripted_admit(self, uid, prompt, *args, **kw):
        prompts.append(tokenizer.decode(prompt))
        return admit(self, uid, prompt, *args, **kw)

    def scripted_step(self):
        outputs = step(self)
        for out in outputs:
            done = given.get(out.uid, 0)
            out.tokens = tokens[done : done + len(out.tokens)]
            given[out.uid] = done + len(out.tokens)
            if given[out.uid] == len(tokens):
                out.finish_reason = "stop"
        self.remove([out.uid for out in outputs if out.finish_reason])
        return outputs

    monkeypatch.setattr(tokenizer, "_eos_token_ids", {-1})
    monkeypatch.setattr(scheduler.Batch, "admit", scripted_admit)
    monkeypatch.setattr(scheduler.Batch, "step", scripted_step)
    return prompts


# --- bad requests ------------------------------------------------------------------


def post(served, path, body, key=KEY, raw=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=data, headers=h)
    r = conn.getresponse()
    return r.status, r.read()


BAD = [
    ("malformed JSON", {"raw": b"{not json"}, 400, None),
    ("not an object", {"raw": b"[1, 2]"}, 400, None),
    ("unknown model", {"model": "someone/else"}, 404, "model_not_found"),
    ("model path", {"model": "/etc"}, 404, "model_not_found"),
    ("temperature type", {"temperature": "hot"}, 400, None),
    ("max_tokens type", {"max_tokens": "many"}, 400, None),
    ("max_tokens bound", {"max_tokens": 10**9}, 400, None),
    ("num_draft_tokens", {"num_draft_tokens": "lots"}, 400, None),
    ("stop type", {"stop": 5}, 400, None),
    ("unsupported option", {"xtc_probability": 0.5}, 400, None),
    ("frequency_penalty type", {"frequency_penalty": "much"}, 400, None),
    ("n > 1", {"n": 3}, 400, None),
    ("no messages", {"messages": None}, 400, None),
    ("empty messages", {"messages": []}, 400, None),
    ("over-long prompt", {"long": True}, 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("what,change,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(served, what, change, status, code):
    body = {"messages": MESSAGES, "max_tokens": 4}
    raw = change.pop("raw", None) if "raw" in change else None
    if change.pop("long", False):
        body["messages"] = [{"role": "user", "content": "hello " * 3000}]
    for k, v in change.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    got, data = post(served, "/v1/chat/completions", body, raw=raw)
    assert got == status, data
    error = json.loads(data)["error"]
    assert isinstance(error["message"], str) and error["type"]
    if code:
        assert error["code"] == code
    ok, _ = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert ok == 200  # the server keeps serving


def test_auth_body_bound_and_endpoints(served):
    assert post(served, "/v1/chat/completions", {}, key=None)[0] == 401
    assert post(served, "/v1/chat/completions", {}, key="wrong")[0] == 401
    conn = http.client.HTTPConnection("127.0.0.1", served.port)
    conn.putrequest("POST", "/v1/chat/completions")  # announces 1 GB, sends none
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["message"]
    assert post(served, "/v1/nothing", {})[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", served.port)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200  # no key needed
    conn = http.client.HTTPConnection("127.0.0.1", served.port)
    conn.request("GET", "/v1/models")
    r = conn.getresponse()
    assert (
        r.status == 401 and json.loads(r.read())["error"]["code"] == "invalid_api_key"
    )


def test_a_client_going_away_stops_its_generation(folder):
    """A streaming client that disconnects after a few chunks: its generation stops
    within a round (EOS is made unreachable, so nothing else would stop it before
    5000 tokens), its conversation stays consistent, and the server goes on."""
    import socket

    server = Server(server_args(model=str(folder), port=0)).start()
    try:
        tokenizer = server.generator.model_provider.tokenizer
        tokenizer._eos_token_ids = {-1}
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 5000, "stream": True})
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body.encode()
        )
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(4096)
        sock.close()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        r = client.completions.create(model="default_model", prompt="Hi", max_tokens=3)
        assert r.choices[0].text is not None
        sessions = server.generator.sessions
        longest = max(len(s.tokens) for s in sessions._items.values())
        assert longest < 200, longest  # stopped soon after the client left
    finally:
        server.close()


def test_a_burst_of_concurrent_clients(served, local):
    """8 clients x 3 requests at once: all answered, no error, greedy replies equal
    to sequential ones."""
    prompts = [[{"role": "user", "content": f"Item {i}."}] for i in range(8)]
    want = [expected(local, p, 8) for p in prompts]
    errors, got = [], {}

    def client_run(i):
        c = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
        try:
            for j in range(3):
                r = c.chat.completions.create(
                    model="default_model", messages=prompts[i], max_tokens=8
                )
                got[(i, j)] = r.choices[0].message.content
        except Exception as e:  # collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=client_run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(got[(i, j)] == want[i] for i in range(8) for j in range(3))


def test_serve_command_bad_inputs_are_one_line(tmp_path, served):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    for args, words in (
        (["--model", str(tmp_path / "nothing")], "does not exist"),
        (["--model", "x", "--chat-template-args", "{oops"], "not JSON"),
        (["--model", "x", "--port", "70000"], "70000"),
    ):
        r = CliRunner().invoke(main, ["serve", *args])
        assert r.exit_code != 0 and words in r.output, r.output
        assert "Traceback" not in r.output
    busy = CliRunner().invoke(
        main, ["serve", "--model", str(served.args.model), "--port", str(served.port)]
    )
    assert busy.exit_code == 1 and "Traceback" not in busy.output
    assert busy.output.count("\n") == 1, busy.output


@pytest.mark.slow
def test_serving_a_gemma4_pair(tmp_path):
    """``serve --model TARGET --draft-model ASSISTANT``: the pair drafts, exactly."""
    from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

    target = write_gemma4(tmp_path / "t", "e2b", predictable=True)
    assistant = write_gemma4_assistant(
        tmp_path / "a", target, centroids=True, predictable=True
    )
    args = server_args(model=str(target), draft_model=str(assistant), port=0)
    server = Server(args).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        r = client.completions.create(
            model="default_model",
            prompt="def f(x):",
            max_tokens=12,
            extra_body={"num_draft_tokens": 3},
        )
    finally:
        server.close()
    model, tokenizer = load(str(target), draft_model=str(assistant))
    want = mtp_generate(model, tokenizer, "def f(x):", max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == want
    assert r.model_extra["mtp"]["drafted"] > 0

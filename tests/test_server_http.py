"""The HTTP layer of ``mlx-mtp serve`` under requests the ``openai`` client cannot
send, through raw sockets: bounded bodies and timeouts, a bound on connections, the
Origin, Host and Content-Type checks that keep web pages out, no URL ever fetched,
malformed JSON and messages answered 400 in OpenAI's error body, and prompts that
cannot fit refused before they are tokenized. After every bad request the server
serves a normal one."""

import json
import socket
import time

import pytest

from mlx_mtp.server import Server, prompt_bytes_per_token, server_args

TIMEOUT = 1.0  # the server's --timeout here: short, so idle sockets go quickly
MAX_CONNECTIONS = 6
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(checkpoint):
    args = server_args(
        model=str(checkpoint("qwen3_5", predictable=True)),
        port=0,
        request_timeout=TIMEOUT,
        max_connections=MAX_CONNECTIONS,
    )
    server = Server(args).start()
    yield server
    server.close()


def read_reply(sock):
    """(status, headers with lower-case names, body) of the reply on ``sock``, read
    until the server closes the connection; status None when it sent nothing."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head:
        return None, {}, b""
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(":", 1) for line in lines)
    headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
    return int(status.split()[1]), headers, body


def exchange(server, data: bytes, timeout: float = 10.0):
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        return read_reply(s)


def send(server, method="POST", path=CHAT, body=None, data=None, headers=None):
    """One request, raw: ``body`` as JSON (or ``data`` as bytes) with the headers a
    well-behaved client sends, overridden by ``headers`` (None drops one)."""
    if data is None:
        data = b"" if body is None else json.dumps(body).encode()
    h = {"Host": f"127.0.0.1:{server.port}"}
    if method == "POST":
        h.update({"Content-Type": "application/json", "Content-Length": len(data)})
    h.update(headers or {})
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items() if v]
    return exchange(server, ("\r\n".join(lines) + "\r\n\r\n").encode() + data)


def chat(server, **fields):
    return send(server, body={"messages": MESSAGES, "max_tokens": 2, **fields})


def assert_error(reply, status, code=None):
    got, headers, body = reply
    assert got == status, (got, body)
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_serves(server):
    status, _, body = chat(server)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] is not None


# --- bodies, timeouts, connections ---------------------------------------------------


def head(length_headers: str) -> bytes:
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\n{length_headers}\r\n"
    ).encode()


BODY = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
LENGTHS = [
    ("negative", "Content-Length: -1\r\n", 400),
    ("negative 5", "Content-Length: -5\r\n", 400),
    ("signed", f"Content-Length: +{len(BODY)}\r\n", 400),
    ("underscore", "Content-Length: 1_0\r\n", 400),
    ("not a number", "Content-Length: many\r\n", 400),
    ("two lengths", f"Content-Length: {len(BODY)}\r\nContent-Length: 5\r\n", 400),
    ("missing", "", 411),
    ("chunked", "Transfer-Encoding: chunked\r\n", 411),
    ("chunked and length", "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 411),
    ("too big", f"Content-Length: {9 << 20}\r\n", 413),
]


@pytest.mark.parametrize("what,lengths,status", LENGTHS, ids=[x[0] for x in LENGTHS])
def test_bad_body_lengths_are_refused(served, what, lengths, status):
    assert_error(exchange(served, head(lengths) + BODY), status)
    assert_serves(served)


def test_idle_and_incomplete_requests_time_out(served):
    """A request that announces 1000 bytes and sends 60 gets 408 after the timeout; a
    connection that sends nothing, or dribbles its headers a byte at a time, is closed
    once the request's time is up (the bytes keep coming, but the request never
    completes)."""
    start = time.monotonic()
    reply = exchange(served, head("Content-Length: 1000\r\n") + b"x" * 60)
    assert_error(reply, 408)
    assert time.monotonic() - start < TIMEOUT + 2
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        start = time.monotonic()
        assert read_reply(s) == (None, {}, b"")  # closed, nothing said
        assert time.monotonic() - start < TIMEOUT + 2
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        start = time.monotonic()
        try:
            for byte in head("Content-Length: 10\r\n"):
                s.sendall(bytes([byte]))
                time.sleep(TIMEOUT / 8)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed it: what is tested
        assert time.monotonic() - start < TIMEOUT + 2
        assert read_reply(s)[0] in (None, 408)
    assert_serves(served)


def test_connections_are_bounded(served):
    """Past ``max_connections`` open connections a new one gets 503 at once; when the
    idle ones time out the server serves again."""
    idle = [
        socket.create_connection(("127.0.0.1", served.port))
        for _ in range(MAX_CONNECTIONS)
    ]
    try:
        time.sleep(0.1)
        assert_error(chat(served), 503)
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert_serves(served)


# --- web pages: Origin, Host, Content-Type --------------------------------------------

LOCAL_ORIGINS = [
    "http://localhost",
    "http://localhost:3000",
    "https://localhost:8443",
    "http://127.0.0.1:5173",
    "http://[::1]:8000",
    "http://app.localhost:1234",
]
FOREIGN_ORIGINS = [
    "https://evil.example",
    "http://localhost.evil.example",
    "http://127.0.0.1.nip.io",
    "null",
    "file://",
    "http://localhost:3000/path",
]


@pytest.mark.parametrize("origin", LOCAL_ORIGINS)
def test_local_pages_may_call(served, origin):
    body = {"messages": MESSAGES, "max_tokens": 2}
    status, headers, _ = send(served, body=body, headers={"Origin": origin})
    assert status == 200
    assert headers["access-control-allow-origin"] == origin
    assert "Origin" in headers["vary"]
    for path in ("/health", "/v1/models"):
        status, headers, _ = send(served, "GET", path, headers={"Origin": origin})
        assert status == 200 and headers["access-control-allow-origin"] == origin
    status, headers, _ = send(
        served,
        "OPTIONS",
        CHAT,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert status == 204 and headers["access-control-allow-origin"] == origin
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    # an error for a local page carries CORS headers, so the page can read it
    error = send(served, data=b"{oops", headers={"Origin": origin})
    assert_error(error, 400)
    assert error[1]["access-control-allow-origin"] == origin
    assert_serves(served)


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
def test_other_pages_are_refused(served, origin):
    body = {"messages": MESSAGES, "max_tokens": 2}
    replies = [
        send(served, body=body, headers={"Origin": origin}),
        send(served, "GET", "/health", headers={"Origin": origin}),
        send(served, "GET", "/v1/models", headers={"Origin": origin}),
        send(
            served,
            "OPTIONS",
            CHAT,
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        ),
    ]
    for reply in replies:
        assert_error(reply, 403, "origin_not_allowed")
        assert not any(k.startswith("access-control-") for k in reply[1])
    assert_serves(served)


def test_allowed_origins_widen_the_default(served, monkeypatch):
    origins = {"https://app.example"}
    monkeypatch.setattr(served.httpd, "origins", frozenset(origins))
    status, headers, _ = send(
        served, "GET", "/v1/models", headers={"Origin": "https://app.example"}
    )
    assert status == 200
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert (
        send(served, "GET", "/health", headers={"Origin": "http://localhost:1"})[0]
        == 200
    )
    assert_error(
        send(served, "GET", "/health", headers={"Origin": "https://b.example"}), 403
    )
    monkeypatch.setattr(served.httpd, "origins", frozenset({"*"}))
    status, headers, _ = send(
        served, "GET", "/health", headers={"Origin": "https://b.example"}
    )
    assert status == 200 and headers["access-control-allow-origin"] == "*"


def test_the_serve_command_takes_allowed_origins(served, monkeypatch):
    from click.testing import CliRunner

    from mlx_mtp import server as server_module
    from mlx_mtp.cli import main

    seen = []

    class FakeServer:
        url = "http://127.0.0.1:1"

        def __init__(self, args):
            seen.append(args)
            server_module.check_origins(args.allowed_origins)

        def serve_forever(self):
            pass

    monkeypatch.setattr(server_module, "Server", FakeServer)
    model = str(served.args.model)
    r = CliRunner().invoke(
        main,
        ["serve", "--model", model, "--allowed-origins", "https://A.example/"]
        + ["--allowed-origins", "*", "--timeout", "5", "--max-connections", "9"],
    )
    assert r.exit_code == 0, r.output
    args = seen[-1]
    assert list(args.allowed_origins) == ["https://A.example/", "*"]
    assert args.request_timeout == 5 and args.max_connections == 9
    assert server_module.check_origins(args.allowed_origins) == frozenset(
        {"https://a.example", "*"}
    )
    r = CliRunner().invoke(
        main, ["serve", "--model", model, "--allowed-origins", "localhost:3000"]
    )
    assert r.exit_code != 0 and "localhost:3000" in r.output
    assert "Traceback" not in r.output and r.output.count("\n") == 1


HOSTS_OK = ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}"]
HOSTS_OK += ["app.localhost:{port}", "LOCALHOST."]
HOSTS_BAD = ["evil.example", "evil.example:{port}", "localhost.evil.example"]


@pytest.mark.parametrize("host", HOSTS_OK)
def test_local_host_names_are_served(served, host):
    host = host.format(port=served.port)
    assert chat_with_host(served, host)[0] == 200
    assert send(served, "GET", "/health", headers={"Host": host})[0] == 200


@pytest.mark.parametrize("host", HOSTS_BAD)
def test_other_host_names_are_refused(served, host):
    """DNS rebinding: a page on evil.example whose name now points to 127.0.0.1 is
    same-origin for the browser; its requests carry ``Host: evil.example``."""
    host = host.format(port=served.port)
    assert_error(chat_with_host(served, host), 403, "host_not_allowed")
    for path in ("/health", "/v1/models"):
        assert_error(send(served, "GET", path, headers={"Host": host}), 403)
    assert_serves(served)


def chat_with_host(served, host):
    body = {"messages": MESSAGES, "max_tokens": 2}
    return send(served, body=body, headers={"Host": host})


MEDIA = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"]
MEDIA += ["multipart/form-data; boundary=x", None]


@pytest.mark.parametrize("media", MEDIA)
def test_bodies_must_be_json(served, media):
    """A page can POST text/plain, a form or a blob without preflight; only
    application/json bodies are taken."""
    body = {"messages": MESSAGES, "max_tokens": 2}
    reply = send(served, body=body, headers={"Content-Type": media})
    assert_error(reply, 415)
    status, _, _ = send(
        served, body=body, headers={"Content-Type": "Application/JSON; charset=utf-8"}
    )
    assert status == 200


# --- no URL is fetched; JSON and messages are checked -------------------------------


@pytest.mark.parametrize("kind", ["image_url", "input_image", "image"])
def test_image_parts_are_refused_and_nothing_is_fetched(served, kind):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.3)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
        image = {"url": url} if kind == "image_url" else url
        parts = [{"type": "text", "text": "What is it?"}, {"type": kind, kind: image}]
        reply = send(
            served,
            body={"messages": [{"role": "user", "content": parts}], "max_tokens": 2},
        )
        error = assert_error(reply, 400)
        assert "takes no images" in error["message"]
        with pytest.raises(socket.timeout):
            listener.accept()  # no connection was made
    assert_serves(served)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


DEEP = [
    ("100000 deep body", b'{"messages": ' + nested(100000).encode() + b"}"),
    ("100000 deep array", nested(100000).encode()),
    (
        "200 deep field",
        b'{"messages": [{"role": "user", "content": "Hi"}], "x": '
        + nested(200).encode()
        + b"}",
    ),
]


@pytest.mark.parametrize("what,data", DEEP, ids=[d[0] for d in DEEP])
def test_deeply_nested_json_is_a_400(served, what, data):
    assert_error(send(served, data=data), 400)
    assert_serves(served)


def tool_call(arguments):
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "f", "arguments": arguments}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


MALFORMED = [
    ("lone surrogate", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("surrogate in a key", {"chat_template_kwargs": {"\udfff": 1}}),
    ("no role", {"messages": [{"content": "Hi"}]}),
    ("role not a string", {"messages": [{"role": 5, "content": "Hi"}]}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "Hi"}]}),
    ("message not an object", {"messages": ["hi"]}),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}),
    ("part without type", {"messages": [{"role": "user", "content": [{"text": "a"}]}]}),
    ("part not an object", {"messages": [{"role": "user", "content": ["a"]}]}),
    (
        "text not a string",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    ),
    (
        "audio part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_audio",
                            "input_audio": {"data": "", "format": "wav"},
                        }
                    ],
                }
            ]
        },
    ),
    ("tools a string", {"tools": "x"}),
    ("tools of strings", {"tools": ["x"]}),
    ("chat_template_kwargs a string", {"chat_template_kwargs": "x"}),
    ("chat_template_kwargs tokenize", {"chat_template_kwargs": {"tokenize": False}}),
    ("chat_template_kwargs template", {"chat_template_kwargs": {"chat_template": "x"}}),
    ("tool_calls a string", {"messages": [{"role": "assistant", "tool_calls": "x"}]}),
    ("arguments not JSON", {"messages": tool_call("{oops")}),
    ("arguments too deep", {"messages": tool_call(nested(5000))}),
    ("stream_options include_usage", {"stream_options": {"include_usage": "yes"}}),
]


@pytest.mark.parametrize("what,change", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_are_400(served, what, change):
    assert_error(chat(served, **change), 400)
    assert_serves(served)


def test_stream_options_may_be_empty(served):
    """As with OpenAI, ``stream_options: {}`` means no usage chunk; the stream ends
    with [DONE]."""
    status, _, body = chat(served, stream=True, stream_options={})
    assert status == 200
    events = [e for e in body.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert not any('"error"' in e for e in events)
    assert_serves(served)


# --- prompts that cannot fit -------------------------------------------------------


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
    served, monkeypatch
):
    """A 1 MiB prompt on a 4096-token model: 400 context_length_exceeded without the
    generation thread tokenizing it. A body as large whose prompt is short (a large
    field the prompt does not hold) is served."""
    generator = served.generator
    tokenized = []
    real = generator._tokenize

    def tokenize(*a, **kw):
        tokenized.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(generator, "_tokenize", tokenize)
    text = "hello world " * (1 << 17)
    for path, body in (
        (CHAT, {"messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {"prompt": text}),
    ):
        error = assert_error(
            send(served, path=path, body={**body, "max_tokens": 2}),
            400,
            "context_length_exceeded",
        )
        assert "at least" in error["message"]
    assert not tokenized
    status, _, body = chat(served, user=text)  # OpenAI's end-user id, unused here
    assert status == 200, body
    assert tokenized


def test_the_token_bound_is_a_lower_bound(served):
    """`prompt_bytes_per_token`: no text has fewer tokens than its bytes over the
    bound, for the served tokenizer (NFC, byte-level BPE): texts of its densest token,
    of Hangul jamo that NFC composes 3 to 1, of characters NFKC would shrink 4 to 1."""
    tokenizer = served.generator.model_provider.tokenizer
    per_token = prompt_bytes_per_token(tokenizer)
    assert per_token == served.httpd.bytes_per_token and per_token >= 4
    texts = [densest_text(tokenizer) * 64, "hello world " * 64]
    texts += ["\u1100\u1161\u11a8" * 64, "\U0001d400" * 64, "e\u0301" * 64]
    for text in texts:
        assert len(tokenizer.encode(text)) * per_token >= len(text.encode())


def test_no_token_bound_for_tokenizers_that_drop_or_fuse_text():
    """Pipelines where one token can stand for any length of text give no bound:
    the prompt is then only checked once tokenized."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2}

    def bound(tokenizer):
        return prompt_bytes_per_token(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        )

    plain = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    assert bound(plain) == 5  # "[UNK]"
    plain.normalizer = normalizers.NFKC()
    assert bound(plain) == 20
    dropping = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish
    fusing = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))
    stripping = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    stripping.add_special_tokens([AddedToken("<m>", lstrip=True)])
    words = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    trimmed = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    trimmed.normalizer = normalizers.Strip()  # strips each segment
    for tokenizer in (dropping, fusing, stripping, words, trimmed):
        assert bound(tokenizer) is None


def densest_text(tokenizer) -> str:
    """The text of the token with the most bytes that, repeated, tokenizes into
    itself repeated."""
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda t: -len(t[0])):
        text = tokenizer.decode([i])
        if len(tokenizer.encode(text * 8)) == 8:
            return text
    raise AssertionError("no such token")


# --- the rest of HTTP -----------------------------------------------------------------


def test_protocol_errors_get_openai_bodies(served):
    long_header = {"X-Long": "x" * 70000}
    assert_error(send(served, "GET", "/health", headers=long_header), 431)
    assert_error(send(served, "PUT", "/v1/models"), 501)
    assert_error(send(served, "GET", "/v1/nothing"), 404)
    assert_serves(served)

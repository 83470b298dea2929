"""``mlx-mtp serve``'s kept conversations and the life of a request: a follow-up
goes on from a kept conversation of its own MTP depth (batched, and one request at a
time); the kept conversations hold, measured, no more memory than
``--prompt-cache-bytes``; a client that leaves a reply not streamed frees its row; a
closing server loads no model and answers 503, to a request whose grammar is still
compiling too; the private members of mlx-lm's server in use are all declared."""

import ast
import gc
import http.client
import importlib
import inspect
import json
import pkgutil
import socket
import textwrap
import threading
import time

import mlx.core as mx
import pytest
from mlx_lm import server as lm_server

from mlx_mtp import generate as mtp_generate
from mlx_mtp import grammar
from mlx_mtp import server as server_module
from mlx_mtp.server import Server, server_args


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint("qwen3_5", predictable=True))  # one MTP layer


@pytest.fixture(scope="module")
def local(loaded):
    return loaded("qwen3_5", True)


@pytest.fixture(scope="module")
def served(model_path):
    server = Server(server_args(model=model_path, port=0, max_batch=1)).start()
    yield server
    server.close()


@pytest.fixture
def endless(served, monkeypatch):
    """EOS made unreachable for the served model: replies run to max_tokens."""
    tokenizer = served.generator.model_provider.tokenizer
    monkeypatch.setattr(tokenizer, "_eos_token_ids", {-1})
    monkeypatch.setattr(served.generator, "_state_machine_cache", {})


def post(server, path, body, timeout=60):
    """(status, parsed JSON body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def head(path: str, body: bytes) -> bytes:
    """A request's line and headers, for a body of ``body``'s length."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()


def until(condition, seconds=60, what="the condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.01)


def kept_texts(server) -> list:
    """The kept conversations' texts, decoded."""
    tokenizer, sessions = (
        server.generator.model_provider.tokenizer,
        server.generator.sessions,
    )
    with sessions._lock:  # the generation thread keeps sessions meanwhile
        items = list(sessions._items.values())
    return [(len(s.tokens), tokenizer.decode(s.tokens)) for s in items]


# --- a follow-up of another MTP depth (issue 40, item 1) ------------------------------


@pytest.mark.parametrize("path", ["batched", "alone"])
def test_a_follow_up_drafting_with_another_depth_is_served(
    path, served, local, monkeypatch
):
    """A conversation begun with ``num_draft_tokens: 0`` (its caches hold no MTP
    layer when served alone) goes on with the default drafting (one layer): served
    exactly, from the kept caches of its depth only; a third turn with k = 0 again
    goes on from a kept prompt. Batched (every row holds the batch's depth), and
    one request at a time (a model whose caches cannot batch, a trunk over several
    ranks)."""
    if path == "alone":
        monkeypatch.setattr(served.generator, "cannot_batch", "tested alone")
    model, tokenizer = local
    first = f"{path}: one two three four"
    second, third = first + " five six", first + " five six seven eight"
    turns = [(first, 0), (second, None), (third, 0)]
    replies = []
    for prompt, k in turns:
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        if k is not None:
            body["num_draft_tokens"] = k
        status, reply = post(served, "/v1/completions", body)
        assert status == 200, reply
        replies.append(reply)
    for (prompt, k), reply in zip(turns, replies):
        options = {} if k is None else {"num_draft_tokens": k}
        want = mtp_generate(model, tokenizer, prompt, max_tokens=4, **options)
        assert reply["choices"][0]["text"] == want
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    if path == "alone":  # the only kept caches were of depth 0
        assert cached[1] == 0, cached
    else:  # the batch's rows all hold its depth (1), any k
        assert cached[1] > 0, cached
    assert 0 < cached[2] <= len(tokenizer.encode(second)), cached


# --- the kept conversations' memory (item 4) ------------------------------------------


def test_the_kept_conversations_hold_at_most_prompt_cache_bytes(model_path):
    """``--prompt-cache-bytes`` bounds the memory the kept conversations hold, as
    measured by what dropping them frees: each is counted at every array it holds,
    at its size (a prompt's snapshot is a full copy), and holds nothing else once
    kept (no pending computation, no slice of a longer buffer, no state of a batch's
    other rows), after requests one at a time and two at once. MLX's buffer cache is
    off meanwhile: it hands a request a cached buffer up to twice its size, so what
    an array holds would depend on what was freed before it."""
    cache_limit = mx.set_cache_limit(0)
    server = Server(server_args(model=model_path, port=0, max_batch=2)).start()
    sessions = server.generator.sessions
    try:
        one = {"prompt": "one two three", "max_tokens": 8}
        assert post(server, "/v1/completions", one)[0] == 200
        settled(server)
        budget = int(4.5 * sessions.nbytes / len(sessions))  # about 4 conversations
        sessions.clear()
        sessions.max_bytes = budget  # as --prompt-cache-bytes sets it
        for i in range(3):
            body = {"prompt": f"request {i} " * (3 + 9 * i), "max_tokens": 20 + 40 * i}
            assert post(server, "/v1/completions", body)[0] == 200
        pair = [{"prompt": f"pair {i}", "max_tokens": 20 + 10 * i} for i in range(2)]
        assert at_once(server, pair) == [200, 200]  # one leaves the batch first
        settled(server)
        counted, kept = sessions.nbytes, len(sessions)
        with sessions._lock:
            rows = {a.shape[0] for s in sessions._items.values() for a in s.arrays()}
        freed = freed_by_dropping(sessions)
    finally:
        server.close()
        mx.set_cache_limit(cache_limit)
    assert kept >= 3 and counted <= budget, (kept, counted, budget)
    assert rows == {1}, rows  # a batch's rollback marks hold every row
    assert freed <= budget, (freed, budget)
    assert abs(freed - counted) <= 0.002 * counted, (freed, counted)


def at_once(server, bodies) -> list:
    """The statuses of text completions of ``bodies``, sent together."""
    statuses = [None] * len(bodies)

    def send(i):
        statuses[i] = post(server, "/v1/completions", bodies[i])[0]

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return statuses


def settled(server) -> None:
    """Until the generation loop is idle, its last sessions are kept and MLX's
    active memory holds still (a handler thread that is still finishing a reply
    the client already read frees its arrays late on a loaded machine)."""
    sessions, seen = server.generator.sessions, []
    while len(seen) < 5 or len(set(seen[-5:])) > 1:
        scheduler = server.generator.scheduler
        busy = scheduler is not None and scheduler.busy()
        gc.collect()
        seen.append((busy, len(sessions), sessions.nbytes, mx.get_active_memory()))
        time.sleep(0.05)
    assert not seen[-1][0]


def freed_by_dropping(sessions) -> int:
    """The bytes of MLX memory that dropping every kept conversation frees."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    sessions.clear()
    gc.collect()
    mx.clear_cache()
    return before - mx.get_active_memory()


# --- a client that leaves a reply not streamed (item 11) ------------------------------

LEFT = {
    "chat": ("/v1/chat/completions", lambda text: {"messages": user(text)}),
    "completions": ("/v1/completions", lambda text: {"prompt": text}),
    "messages": ("/v1/messages", lambda text: {"messages": user(text)}),
}


def user(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    "api,path",
    [("chat", "batched"), ("completions", "batched"), ("messages", "batched")]
    + [("chat", "alone")],
)
def test_a_client_leaving_a_reply_not_streamed_frees_its_row(
    api, path, served, endless, monkeypatch
):
    """A client that sends a request whose reply is not streamed (4000 tokens asked,
    EOS unreachable) and closes its connection once it decodes: its generation
    stops within a few rounds, freeing the server's one row (``--max-batch 1``), and
    the next request is served; in each API, and one request at a time."""
    if path == "alone":
        monkeypatch.setattr(served.generator, "cannot_batch", "tested alone")
    endpoint, make = LEFT[api]
    marker = f"left by {api} {path}"
    body = json.dumps({**make(marker), "max_tokens": 4000}).encode()
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(head(endpoint, body) + body)

    def decoding():  # its prompt is kept: it was prefilled, and it decodes
        return any(marker in text for _, text in kept_texts(served))

    until(decoding, what="the request's decoding")
    sock.close()
    start = time.monotonic()
    status, reply = post(served, "/v1/completions", {"prompt": "next", "max_tokens": 3})
    waited = time.monotonic() - start
    assert status == 200, reply
    longest = max(n for n, text in kept_texts(served) if marker in text)
    assert longest < 1000, (longest, waited)  # it stopped soon after its client left


# --- a server that closes (items 3 and 26) --------------------------------------------


def test_a_request_arriving_as_the_server_closes_gets_503_and_loads_nothing(
    model_path,
):
    """A request whose body arrives while `Server.close` runs, after the generation
    loop dropped the model: a 503, and the closed server holds no model (the request
    did not load it again)."""
    server = Server(server_args(model=model_path, port=0)).start()
    provider = server.generator.model_provider
    body = json.dumps({"prompt": "late", "max_tokens": 2}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head("/v1/completions", body))
    until(lambda: server._connections._count == 1, what="the connection's handler")
    closing = threading.Thread(target=server.close)
    closing.start()
    until(lambda: provider.model is None, what="the model's drop")
    sock.sendall(body)
    sock.settimeout(30)
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    sock.close()
    closing.join(30)
    assert reply.startswith(b"HTTP/1.0 503"), reply[:200]
    assert b"shutting down" in reply
    assert provider.model is None and provider.tokenizer is None


def test_a_request_whose_grammar_compiles_as_the_server_closes_gets_503(
    model_path, monkeypatch
):
    """A request whose grammar is still compiling (a large schema takes seconds;
    held here until the test ends) when the server closes (as Ctrl-C closes it):
    a 503 at once, as every request not started gets, not a dropped connection."""
    compiling, release = threading.Event(), threading.Event()
    compile_ = grammar._compiled

    def slow(spec, engine_tokenizer):
        compiling.set()
        release.wait(60)
        return compile_(spec, engine_tokenizer)

    monkeypatch.setattr(grammar, "_compiled", slow)
    server = Server(server_args(model=model_path, port=0)).start()
    try:
        out = {}
        body = {
            "messages": user("a grammar"),
            "max_tokens": 4,
            "response_format": {"type": "json_object"},
        }
        request = threading.Thread(
            target=lambda: out.update(reply=post(server, "/v1/chat/completions", body))
        )
        request.start()
        assert compiling.wait(60)
        server.close()
        request.join(30)
    finally:
        release.set()
        server.close()
    assert "reply" in out, "no reply"
    status, reply = out["reply"]
    assert status == 503 and "shutting down" in reply["error"]["message"], reply


# --- mlx-lm's private members (item 5) ------------------------------------------------


def mlx_lm_members(cls) -> set:
    """The private members of one of mlx-lm's server classes: its methods and class
    attributes, and the attributes its methods set."""
    names = set(vars(cls))
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_names(source: str) -> set:
    """The private names ``source`` reads, sets or defines as methods."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def server_modules() -> list:
    """mlx_mtp.server and the modules of mlx_mtp.serving: the server's code."""
    from mlx_mtp import serving

    found = pkgutil.iter_modules(serving.__path__, serving.__name__ + ".")
    return [server_module] + [importlib.import_module(m.name) for m in found]


def test_every_private_member_of_mlx_lms_server_in_use_is_declared():
    """Each private member of an mlx-lm server class the server subclasses that
    mlx_mtp/server.py or a module of mlx_mtp/serving reads, sets or overrides (by
    name: a name shared by accident would shadow mlx-lm's) is declared in
    `MLX_LM_PRIVATE`, which `check_mlx_lm` checks at import."""
    modules = server_modules()
    assert len(modules) > 8  # the server and its parts
    bases = {
        base
        for module in modules
        for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__ == module.__name__
        for base in cls.__mro__
        if base.__module__ == lm_server.__name__
    }
    used = set().union(*(private_names(inspect.getsource(m)) for m in modules))
    declared = {name for name, _ in server_module.MLX_LM_PRIVATE}
    missing = sorted(
        f"{base.__name__}.{name}"
        for base in bases
        for name in mlx_lm_members(base) & used
        if f"{base.__name__}.{name}" not in declared
    )
    assert {b.__name__ for b in bases} >= {"ResponseGenerator", "APIHandler"}
    assert not missing, f"used, not in MLX_LM_PRIVATE: {missing}"


def test_the_servers_parts_read_no_private_member_of_another_object():
    """A private member is read only by its own class (``self._x``), or, for an
    override of mlx-lm's, of the class it extends (``super()._x``, declared in
    `MLX_LM_PRIVATE`): the scheduler drives the generator through its public
    methods, and no part reaches into another's state. (A module's documented
    function, as ``os._exit``, is no member of an object.)"""
    reached = []
    for module in server_modules():
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            owner = ast.unparse(node.value)
            if node.attr.startswith("__") or owner in ("self", "super()"):
                continue
            if inspect.ismodule(getattr(module, owner, None)):
                continue
            reached.append(f"{module.__name__}: {ast.unparse(node)}")
    assert not reached, reached

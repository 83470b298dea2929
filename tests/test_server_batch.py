"""``mlx-mtp serve`` decodes overlapping requests together, with MTP (`mlx_mtp.batch`):
each reply equals its lone reply and `mlx_mtp.generate`'s (greedy), or its lone text
(seeded), with drafts in every ``mtp`` block and the batch sizes it ran at; a request
arriving mid-reply starts before that reply ends; a client that goes away frees its
row; ``max_batch`` and the cache memory bound the rows (a request that cannot fit even
alone is a 400); a model whose caches cannot batch serves its requests one at a
time."""

import json
import logging
import socket
import threading
import time

import openai
import pytest

from mlx_mtp import generate as mtp_generate
from mlx_mtp.batch import prefill_together
from mlx_mtp.errors import MTPError
from mlx_mtp.server import Server, server_args
from mlx_mtp.serving import budget
from mlx_mtp.serving import generator as generator_module
from mlx_mtp.serving import provider, scheduler

PROMPTS = ["Write a function.", "say a b c", "hello world", "x = 1"]  # no EOS soon
LENGTHS = [6, 9, 12, 15]  # rows leave the batch at different rounds


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint("qwen3_5", predictable=True))


@pytest.fixture(scope="module")
def served(model_path):
    server = Server(server_args(model=model_path, port=0)).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def local(loaded):
    return loaded("qwen3_5", True)


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def gathered(generator, n: int, monkeypatch) -> None:
    """The generation loop takes no request until ``n`` are queued, then all of them
    at once (clients that start together, deterministically)."""
    real, waited, entered = generator._next_request, [], threading.Event()

    def next_request(timeout=None):
        entered.set()
        deadline = time.monotonic() + 60
        while not waited and generator.requests.qsize() < n:
            assert time.monotonic() < deadline, "the requests never came"
            time.sleep(0.001)
        waited.append(True)
        return real(timeout)

    monkeypatch.setattr(generator, "_next_request", next_request)
    assert entered.wait(30)  # the loop is held here, not in a call begun before


def at_once(fn, n: int) -> list:
    """``fn(i)`` for i < n, each in its own thread; their results in order."""
    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def sizes_of(reply) -> dict:
    """The ``mtp`` block's batch sizes, as integers."""
    return {int(b): n for b, n in reply.model_extra["mtp"]["batch_sizes"].items()}


def ask(server, i, **extra):
    return client_of(server).completions.create(
        model="default_model",
        prompt=PROMPTS[i],
        max_tokens=LENGTHS[i],
        extra_body={"num_draft_tokens": 2, **extra},
    )


def test_four_requests_at_once_each_equal_its_lone_reply(served, local, monkeypatch):
    """Greedy: each of 4 concurrent replies equals its lone reply and `generate`'s,
    drafts in every ``mtp`` block; they ran together (batch size 4), their prompts
    prefilled in groups of about the same length."""
    model, tokenizer = local
    alone = [ask(served, i) for i in range(4)]
    groups = []

    def spy(admissions):
        groups.append(len(admissions))
        return prefill_together(admissions)

    monkeypatch.setattr(scheduler, "prefill_together", spy)
    served.generator.sessions.clear()  # else each repeated prompt goes on from its own
    gathered(served.generator, 4, monkeypatch)
    together = at_once(lambda i: ask(served, i), 4)
    assert groups and max(groups) >= 2, groups
    for i in range(4):
        want = mtp_generate(model, tokenizer, PROMPTS[i], max_tokens=LENGTHS[i])
        assert alone[i].choices[0].text == want
        assert together[i].choices[0].text == want, i
        for reply in alone[i], together[i]:
            mtp = reply.model_extra["mtp"]
            assert mtp["drafted"] > 0 and mtp["num_draft_tokens"] == 2, mtp
            assert sum(sizes_of(reply).values()) == mtp["rounds"]
            assert "batched" not in mtp
        assert sizes_of(alone[i]) == {1: alone[i].model_extra["mtp"]["rounds"]}
    assert 4 in sizes_of(together[0])


def test_seeded_requests_give_their_lone_text_in_a_batch(served, monkeypatch):
    """Sampling with a seed and a fixed num_draft_tokens: each reply is its lone
    reply's text, token for token, in a batch whose rows leave at different
    rounds (each row has its own key)."""
    seeded = [dict(temperature=1.0, seed=20 + i) for i in range(4)]
    alone = [ask(served, i, **seeded[i]) for i in range(4)]
    gathered(served.generator, 4, monkeypatch)
    together = at_once(lambda i: ask(served, i, **seeded[i]), 4)
    texts = [r.choices[0].text for r in alone]
    assert [r.choices[0].text for r in together] == texts
    assert all(r.model_extra["mtp"]["drafted"] > 0 for r in together)
    assert 4 in sizes_of(together[0])
    other = ask(served, 3, temperature=1.0, seed=99).choices[0].text
    assert other != texts[3]  # the seed does choose the text


@pytest.fixture
def endless(served, local, monkeypatch):
    """EOS made unreachable for the served model and the local one: replies run to
    max_tokens."""
    for tokenizer in (served.generator.model_provider.tokenizer, local[1]):
        monkeypatch.setattr(tokenizer, "_eos_token_ids", {-1})
    monkeypatch.setattr(served.generator, "_state_machine_cache", {})


def stream_text(server, prompt, max_tokens, first=None, **extra):
    """A streamed text completion's text and its last chunk's ``mtp`` block;
    ``first`` is set once a token arrived."""
    chunks = client_of(server).completions.create(
        model="default_model",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"num_draft_tokens": 2, **extra},
    )
    text, mtp = "", None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            if first is not None:
                first.set()
        mtp = (chunk.model_extra or {}).get("mtp", mtp)
    return text, mtp


def test_a_request_arriving_mid_reply_starts_before_that_reply_ends(
    served, local, endless
):
    """While a 300-token reply streams, a new request is admitted between rounds:
    its whole reply comes before the long one ends, and both are exact."""
    model, tokenizer = local
    started, long_done = threading.Event(), threading.Event()
    out = {}

    def long_reply():
        out["long"] = stream_text(served, PROMPTS[0], 300, started)
        long_done.set()

    thread = threading.Thread(target=long_reply)
    thread.start()
    assert started.wait(60)
    short, mtp = stream_text(served, PROMPTS[1], 4)
    assert not long_done.is_set()  # the short one did not wait for the long one
    thread.join(120)
    assert short == mtp_generate(model, tokenizer, PROMPTS[1], max_tokens=4)
    assert {int(b) for b in mtp["batch_sizes"]} == {2}
    assert out["long"][0] == mtp_generate(model, tokenizer, PROMPTS[0], max_tokens=300)


def test_a_client_going_away_frees_its_row(served, local, endless, monkeypatch):
    """A streaming client that disconnects mid-reply (5000 tokens asked, no EOS):
    its row leaves the batch within a few rounds, and the two requests decoding
    beside it finish exactly."""
    model, tokenizer = local
    gathered(served.generator, 3, monkeypatch)
    body = json.dumps({"prompt": "def g(x):", "max_tokens": 5000, "stream": True})
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body.encode()
    )
    others = at_once(lambda i: ask_late(served, i, sock), 2)
    for i, reply in enumerate(others):
        want = mtp_generate(model, tokenizer, PROMPTS[i], max_tokens=60)
        assert reply.choices[0].text == want
        assert 3 in sizes_of(reply)
    deadline = time.monotonic() + 30
    while len(served.generator.scheduler.batch):  # its handler saw the hang-up
        assert time.monotonic() < deadline, "the row never left the batch"
        time.sleep(0.01)
    start = tokenizer.encode("def g(x):")
    (left,) = [
        s.tokens
        for s in served.generator.sessions._items.values()
        if s.tokens[: len(start)] == start and len(s.tokens) > len(start)
    ]
    assert len(left) < 200, len(left)  # it left soon after its client did


def ask_late(server, i, sock):
    """Request i (60 tokens), the first one closing ``sock`` after reading a few of
    its chunks."""
    if i == 0:
        threading.Thread(target=_hang_up, args=(sock,)).start()
    return client_of(server).completions.create(
        model="default_model",
        prompt=PROMPTS[i],
        max_tokens=60,
        extra_body={"num_draft_tokens": 2},
    )


def _hang_up(sock):
    received = b""
    while received.count(b"data:") < 3:
        received += sock.recv(4096)
    sock.close()


def test_max_batch_and_the_cache_memory_bound_the_rows(model_path, local):
    """``max_batch=1`` serves requests one at a time (exactly); with a cache budget
    that holds one request's positions, two requests run one after the other, and a
    request that cannot fit even alone is a 400 saying why."""
    model, tokenizer = local
    cost = budget.cache_cost(model, 1)
    positions = len(tokenizer.encode(PROMPTS[3])) + LENGTHS[3]
    for options in ({"max_batch": 1}, {"batch_cache_bytes": cost.bytes([positions])}):
        server = Server(server_args(model=model_path, port=0, **options)).start()
        kept = server.generator.sessions.max_bytes  # the kept conversations: bounded
        assert kept == budget.default_budget(model) // 2 > 0
        try:
            replies = at_once(lambda i: ask(server, i), 4)
            if "batch_cache_bytes" in options:
                with pytest.raises(openai.BadRequestError, match="cache") as e:
                    client_of(server).completions.create(
                        model="default_model", prompt=PROMPTS[3], max_tokens=400
                    )
                assert "max_tokens" in str(e.value)
        finally:
            server.close()
        for i, reply in enumerate(replies):
            want = mtp_generate(model, tokenizer, PROMPTS[i], max_tokens=LENGTHS[i])
            assert reply.choices[0].text == want
            assert set(sizes_of(reply)) == {1}, options
    with pytest.raises(MTPError, match="max_batch"):
        server_args(max_batch=0)


def test_a_model_that_cannot_batch_serves_one_at_a_time(
    model_path, local, caplog, monkeypatch
):
    """A model whose caches cannot batch (every fixture family batches: one is
    made so here): the server says why once, at start, and serves overlapping
    requests one at a time through the single-stream loop, each exactly."""
    model, tokenizer = local
    why = "mlx-mtp has no batched cache for this model's TestCache"
    for module in (provider, generator_module):  # its round costs, and its loop
        monkeypatch.setattr(module, "batch_support", lambda model: why)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        server = Server(server_args(model=model_path, port=0)).start()
        try:
            gathered(server.generator, 3, monkeypatch)
            replies = at_once(lambda i: ask(server, i), 3)
        finally:
            server.close()
    said = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert said == [f"requests are decoded one at a time: {why}"], caplog.text
    for i, reply in enumerate(replies):
        want = mtp_generate(model, tokenizer, PROMPTS[i], max_tokens=LENGTHS[i])
        assert reply.choices[0].text == want
        assert sizes_of(reply) == {1: reply.model_extra["mtp"]["rounds"]}

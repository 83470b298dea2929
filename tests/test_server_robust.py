"""``mlx-mtp serve`` under bad requests, faults and signals: sampling settings are
checked alike on the batched path and the single-stream one (a model that cannot
batch); each request decodes with its own checked `DecodeOptions`; a request that
fails, a batched round that fails, or a generation loop that fails, costs only the
requests it touched, and the server serves the next one; SIGINT and SIGTERM end open
streams with ``[DONE]`` and exit cleanly; each API key has its own prompt cache;
round costs, alone and batched, are measured before serving; an mlx-lm whose server
changed is refused at start."""

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest

from mlx_mtp import generate as mtp_generate
from mlx_mtp import server as server_module
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load
from mlx_mtp.options import DecodeOptions
from mlx_mtp.server import Server, server_args
from mlx_mtp.serving import generator as generator_module
from mlx_mtp.serving import http_guard, provider, scheduler

MESSAGES = [{"role": "user", "content": "Write a function."}]
KEYS = ("alice-key", "bob-key")


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


@pytest.fixture
def endless(served, local, monkeypatch):
    """EOS made unreachable for the served model and the local one: replies run to
    max_tokens (and so outlast the requests a test sends meanwhile)."""
    for tokenizer in (served.generator.model_provider.tokenizer, local[1]):
        monkeypatch.setattr(tokenizer, "_eos_token_ids", {-1})
    monkeypatch.setattr(served.generator, "_state_machine_cache", {})


def expected(local, messages, max_tokens, **kw):
    model, tokenizer = local
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mtp_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw)


def post(server, body, key=None, path="/v1/chat/completions"):
    """(status, parsed JSON body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def stream(server, body, started=None, key=None):
    """The ``data:`` payloads of a streamed reply, in order (``[DONE]`` as is, the
    others parsed); ``started`` is set once the first token's chunk arrived."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps({**body, "stream": True}).encode()
    conn.request("POST", "/v1/chat/completions", body=data, headers=headers)
    r = conn.getresponse()
    assert r.status == 200, r.read()
    events = []
    for line in r:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        if started is not None and len(events) >= 2:
            started.set()
    return events


def text_of(events) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def healthy(server) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    return conn.getresponse().status == 200


class Background:
    """A call in a thread; ``result()`` joins it and returns or raises its outcome."""

    def __init__(self, fn, *args, **kw):
        self._out = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args, kw))
        self._thread.start()

    def _run(self, fn, args, kw):
        try:
            self._out["value"] = fn(*args, **kw)
        except BaseException as e:  # handed to the caller of result()
            self._out["error"] = e

    def result(self, timeout=120):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request never ended"
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def single(generator, monkeypatch):
    """Make every request go through the single-stream loop, one at a time (as for a
    model whose caches cannot batch); by default they decode in the batch."""
    monkeypatch.setattr(generator, "cannot_batch", "the single-stream path, tested")


def route(generator, path, monkeypatch):
    if path == "single":
        single(generator, monkeypatch)


def assert_serving(served):
    status, body = post(served, {"messages": MESSAGES, "max_tokens": 3})
    assert status == 200, body
    assert healthy(served)


# --- sampling settings ---------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
BAD_SAMPLING = [
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -1),
    ("temperature", "hot"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", NAN),
    ("top_p", 1.5),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_k", True),
    ("min_p", NAN),
    ("min_p", 1.5),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
]


def test_bad_sampling_settings_are_a_400_naming_the_field_under_load(
    served, local, endless, monkeypatch
):
    """While a request decodes in the batch, each bad setting gets a 400 with
    ``param``, and the request in flight is answered as if alone."""
    started = threading.Event()
    good = Background(stream, served, {"messages": MESSAGES, "max_tokens": 40}, started)
    assert started.wait(60)
    for field, value in BAD_SAMPLING:
        body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 1.0}
        status, reply = post(served, {**body, field: value})
        assert status == 400, (field, value, reply)
        error = reply["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] == field and error["code"] is None, error
    events = good.result()
    assert events[-1] == "[DONE]" and text_of(events) == expected(local, MESSAGES, 40)
    assert_serving(served)


def test_the_context_and_sampling_errors_are_told_apart(served, monkeypatch):
    """A prompt past the context is ``context_length_exceeded`` on both paths
    (mlx-lm's batched one used to run past the context); sampling errors are not."""
    long = [{"role": "user", "content": "hello " * 3000}]
    for path in ("single", "batched"):
        with monkeypatch.context() as m:
            route(served.generator, path, m)
            status, reply = post(served, {"messages": long, "max_tokens": 4})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    status, reply = post(served, {"messages": MESSAGES, "seed": -1})
    assert status == 400 and reply["error"]["code"] != "context_length_exceeded"


def test_top_k_of_the_vocabulary_or_more_keeps_every_token(served, endless):
    """top_k >= the vocabulary size is no filtering, as top_k = 0: the same seeded
    text, and no failure in a batch beside another request (mlx-lm's batch used to
    die of it, the generation thread with it, for good)."""
    vocab = served.generator.model_provider.model.args.vocab_size
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    body.update(num_draft_tokens=2, draft_source="heads", draft_vocab="full")
    texts = []
    for top_k in (0, vocab, 10**6):
        status, reply = post(served, {**body, "top_k": top_k})
        assert status == 200, reply
        texts.append(reply["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] == texts[2]
    started = threading.Event()
    good = Background(
        stream, served, {"messages": MESSAGES, "max_tokens": 300}, started
    )
    assert started.wait(60)
    status, reply = post(served, {**body, "top_k": vocab})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == texts[0]
    assert "2" in reply["mtp"]["batch_sizes"]  # it did go through the batch
    assert good.result()[-1] == "[DONE]"
    assert_serving(served)


# --- decode options ------------------------------------------------------------------


def test_the_server_defaults_are_decode_options():
    """`server_args` keeps the server's defaults as one checked `DecodeOptions`
    (DecodeOptions' own, but 512 tokens a reply), and gives mlx-lm's handler the
    names it reads from them."""
    assert server_args().decode == DecodeOptions(max_tokens=512)
    args = server_args(
        num_draft_tokens=3, draft_source="heads", lookup_tokens=5, temp=0.7, top_k=9
    )
    assert args.decode == DecodeOptions(
        max_tokens=512,
        num_draft_tokens=3,
        draft_source="heads",
        lookup_tokens=5,
        temp=0.7,
        top_k=9,
    )
    assert (args.temp, args.top_k, args.max_tokens) == (0.7, 9, 512)
    assert args.num_draft_tokens == 0  # mlx-lm's own field: an integer it checks
    with pytest.raises(MTPError, match="^lookup_tokens"):
        server_args(lookup_tokens=0)
    with pytest.raises(TypeError, match="kv_bits"):  # never applied: not taken
        server_args(kv_bits=4)


def recording(path, monkeypatch) -> list:
    """The `DecodeOptions` each request hands the loop of ``path`` (the batch's
    admission, or the single-stream loop), in order."""
    seen = []
    if path == "single":
        real = generator_module.stream_generate

        def record(model, tokenizer, prompt, **kw):
            seen.append(kw["options"])
            return real(model, tokenizer, prompt, **kw)

        monkeypatch.setattr(generator_module, "stream_generate", record)
        return seen
    admit = scheduler.Batch.admit

    def record_admitted(self, uid, prompt, options=None, *args, **kw):
        seen.append(options)
        return admit(self, uid, prompt, options, *args, **kw)

    monkeypatch.setattr(scheduler.Batch, "admit", record_admitted)
    return seen


@pytest.mark.parametrize("path", ["single", "batched"])
def test_each_request_decodes_with_its_own_options(path, served, monkeypatch):
    """One `DecodeOptions` per request, the server's then the request's fields, is
    what the loop decodes with; a bad field is a 400 naming it, before anything
    is queued."""
    route(served.generator, path, monkeypatch)
    seen = recording(path, monkeypatch)
    fields = dict(temperature=0.5, top_p=0.9, top_k=7, min_p=0.05, seed=3)
    fields.update(num_draft_tokens=2, draft_source="lookup", draft_vocab="64")
    body = {"messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 5}
    status, reply = post(served, {**body, **fields})
    assert status == 200, reply
    assert seen == [
        served.args.decode.replace(
            max_tokens=5,
            temp=0.5,
            top_p=0.9,
            top_k=7,
            min_p=0.05,
            seed=3,
            num_draft_tokens=2,
            draft_source="lookup",
            draft_vocab=64,
        )
    ]
    assert reply["mtp"]["num_draft_tokens"] == 2
    for field, value in (
        ("num_draft_tokens", 17),
        ("num_draft_tokens", "lots"),
        ("draft_source", "ngrams"),
        ("draft_vocab", 0),
        ("max_completion_tokens", "many"),
        ("max_completion_tokens", 0),
        ("max_tokens", -1),
    ):
        status, reply = post(served, {"messages": MESSAGES, field: value})
        error = reply["error"]
        assert status == 400 and error["param"] == field, (field, value, reply)
        assert error["message"].startswith(field), error
    assert len(seen) == 1  # none of them was queued


# --- faults --------------------------------------------------------------------------

FAULT = "injected fault"


def inject_fault(path, monkeypatch):
    """Make requests with temperature 0.5 fail after they started: in the
    single-stream loop after two tokens, in the batch on the way to their reply, at
    their second round."""
    if path == "single":
        real = generator_module.stream_generate

        def failing(model, tokenizer, prompt, **kw):
            with closing(real(model, tokenizer, prompt, **kw)) as steps:
                for i, step in enumerate(steps):
                    if kw["options"].temp == 0.5 and i == 2:
                        raise RuntimeError(FAULT)
                    yield step

        monkeypatch.setattr(generator_module, "stream_generate", failing)
        return
    emit, rounds = scheduler.Scheduler._emit, {}

    def failing_emit(self, s, out):
        rounds[s.uid] = rounds.get(s.uid, 0) + 1
        if s.job.options.temp == 0.5 and rounds[s.uid] == 2:
            raise RuntimeError(FAULT)
        return emit(self, s, out)

    monkeypatch.setattr(scheduler.Scheduler, "_emit", failing_emit)


@pytest.mark.parametrize("path", ["single", "batched"])
def test_a_failing_request_costs_only_itself(path, served, local, endless, monkeypatch):
    """Two requests fail mid-generation while another is in flight: the plain one
    gets a 500 in OpenAI's form, the streamed one an error event and ``[DONE]``; the
    other request's reply is whole and right, and the server serves the next one."""
    route(served.generator, path, monkeypatch)
    inject_fault(path, monkeypatch)
    started = threading.Event()
    good = Background(stream, served, {"messages": MESSAGES, "max_tokens": 40}, started)
    assert started.wait(60)
    bad = {"messages": MESSAGES, "max_tokens": 20, "temperature": 0.5}
    streamed = Background(stream, served, bad)
    status, reply = post(served, bad)
    assert status == 500 and reply["error"]["type"] == "server_error", reply
    assert FAULT in reply["error"]["message"]
    events = streamed.result()
    assert events[-1] == "[DONE]", events
    assert FAULT in events[-2]["error"]["message"]
    events = good.result()
    assert events[-1] == "[DONE]" and text_of(events) == expected(local, MESSAGES, 40)
    assert_serving(served)


@pytest.mark.parametrize(
    "where", [(scheduler.Batch, "step"), (scheduler.Scheduler, "round")]
)
def test_the_generation_loop_goes_on_after_a_failure(where, served, monkeypatch):
    """A failure of a batched round (not one request's: every row was in it), or of
    the scheduler loop itself: the requests it held get the error, and a new batch,
    or the loop started again, serves the next ones (``/health`` stays ok)."""
    owner, name = where
    real, calls = getattr(owner, name), []

    def failing(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(FAULT)
        return real(self)

    monkeypatch.setattr(owner, name, failing)
    events = stream(served, {"messages": MESSAGES, "max_tokens": 40})
    assert events[-1] == "[DONE]" and FAULT in events[-2]["error"]["message"]
    assert len(calls) >= 3
    assert healthy(served)
    assert_serving(served)


# --- API keys ------------------------------------------------------------------------


def test_several_api_keys_from_the_option_and_the_environment(monkeypatch):
    monkeypatch.setenv(http_guard.API_KEY_ENV, " alice-key, bob-key ,")
    assert server_args().api_key == KEYS
    assert server_args(api_key="carol").api_key == ("carol",)
    assert server_args(api_key=["a", "b"]).api_key == ("a", "b")
    monkeypatch.setenv(http_guard.API_KEY_ENV, "")
    assert server_args().api_key == ()
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    empty = CliRunner().invoke(
        main, ["serve", "--model", "x", "--api-key", "a", "--api-key", ""]
    )
    assert empty.exit_code == 1 and empty.output.count("\n") == 1, empty.output
    assert "API key must be a non-empty string" in empty.output


@pytest.fixture(scope="module")
def keyed(model_path):
    server = Server(server_args(model=model_path, port=0, api_key=KEYS)).start()
    yield server
    server.close()


def cached(server, key, messages):
    status, reply = post(server, {"messages": messages, "max_tokens": 2}, key=key)
    assert status == 200, reply
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["single", "batched"])
def test_each_api_key_has_its_own_prompt_cache(path, keyed, monkeypatch):
    """What one key's requests left in the prompt caches (the sessions of the
    batched and the single-stream paths) is never reused for another key's: usage's
    ``cached_tokens`` would tell that key what the other sent."""
    route(keyed.generator, path, monkeypatch)
    alice, bob = KEYS
    system = {"role": "system", "content": f"The {path} secret is 4711."}
    first = [system, {"role": "user", "content": "Hi."}]
    reply = post(keyed, {"messages": first, "max_tokens": 2}, key=alice)[1]
    said = reply["choices"][0]["message"]["content"]
    guess = first + [
        {"role": "assistant", "content": said},
        {"role": "user", "content": "And?"},
    ]
    assert cached(keyed, bob, guess) == 0
    assert cached(keyed, alice, guess) > 0  # each key's own cache still works
    assert post(keyed, {"messages": MESSAGES}, key="eve")[0] == 401


# --- startup and shutdown ------------------------------------------------------------


def test_round_costs_are_ready_before_serving(model_path, monkeypatch):
    """The costs "auto" drafts with are read or measured when the server starts, for
    every k and draft vocabulary a request may ask for and for batches of up to
    ``max_batch`` rows, never by a request on the generation thread: a request that
    would need others (a number of draft tokens not measured, with an "auto" k or
    source) is a 400 naming ``draft_vocab``."""
    from mlx_mtp import batch_costs, draft_length

    server = Server(server_args(model=model_path, port=0))
    try:
        model = server.generator.model_provider.model
        assert model.round_costs is not None
        sizes = batch_costs.grid(server.args.max_batch)
        assert set(sizes) <= set(model.batch_costs.sizes)
        unmeasured = DecodeOptions(draft_vocab=100)
        assert provider.times_costs(model, unmeasured)
        assert not provider.times_costs(model, unmeasured.replace(**FIXED_HEADS))
        timed = []

        def no_timing(*a, **kw):
            timed.append(a)
            raise AssertionError("round costs timed while serving")

        monkeypatch.setattr(draft_length, "measure_costs", no_timing)
        monkeypatch.setattr(batch_costs, "measure_batch_costs", no_timing)
        server.start()
        for extra in (
            {},
            {"num_draft_tokens": 12},  # draft_source "auto" weighs k = 12
            {"num_draft_tokens": 16, "draft_vocab": "full"},
            {"draft_vocab": "full"},
            {"draft_vocab": 64},  # one of "auto"'s
            {"draft_vocab": 100, **FIXED_HEADS},
            {"draft_vocab": 100, "num_draft_tokens": 3, "draft_source": "lookup"},
        ):
            body = {"messages": MESSAGES, "max_tokens": 4, **extra}
            status, reply = post(server, body)
            assert status == 200 and reply["mtp"]["rounds"], (extra, reply)
        status, reply = post(server, {"messages": MESSAGES, "draft_vocab": 100})
        assert status == 400 and reply["error"]["param"] == "draft_vocab", reply
        assert "--draft-vocab 100" in reply["error"]["message"]
        started = threading.Event()  # two "auto" rows: the batch caps their drafts
        tokenizer = server.generator.model_provider.tokenizer
        monkeypatch.setattr(tokenizer, "_eos_token_ids", {-1})  # replies run long
        body = {"messages": MESSAGES, "max_tokens": 200}
        other = Background(stream, server, body, started)
        assert started.wait(60)
        status, reply = post(server, {**body, "max_tokens": 4})
        assert status == 200 and "2" in reply["mtp"]["batch_sizes"], reply
        assert other.result()[-1] == "[DONE]"
        assert not timed
        assert_serving(server)
    finally:
        server.close()


FIXED_HEADS = {"num_draft_tokens": 2, "draft_source": "heads"}


def test_a_start_that_times_the_rounds_says_so(tmp_path, monkeypatch, capsys):
    """Timing every k at start takes a while on a slow machine: the server says why
    it is not serving yet, and only when it does time them."""
    from mlx_mtp import draft_length
    from mlx_mtp.testing.fixtures import write_checkpoint

    model = load(str(write_checkpoint("deepseek_v3", tmp_path / "m")))[0]

    def measure(model, max_k, reps=5, context=64, vocabs=()):
        drafts = {v: 0.05 for v in vocabs}
        return draft_length.RoundCosts([1.0] + [1.1] * max_k, 0.1, drafts)

    monkeypatch.setattr(draft_length, "measure_costs", measure)
    provider.warm_costs(model, DecodeOptions())
    assert "timing the model's rounds" in capsys.readouterr().err
    model.round_costs = None  # a new server: the costs file has them
    provider.warm_costs(model, DecodeOptions())
    assert capsys.readouterr().err == ""


def test_an_mlx_lm_whose_server_changed_is_refused_at_start(monkeypatch):
    """The private members of mlx_lm.server the server overrides or calls are
    checked at import: one whose parameters changed, or that is gone, makes ``serve``
    fail at start in one line, never a request."""
    import mlx_lm
    from click.testing import CliRunner
    from mlx_lm import server as lm_server

    from mlx_mtp.cli import main

    server_module.check_mlx_lm()  # the installed mlx-lm passes

    def tokenize(self, tokenizer, request):  # mlx-lm's, less a parameter
        raise AssertionError("never called")

    with monkeypatch.context() as m:
        m.setattr(lm_server.ResponseGenerator, "_tokenize", tokenize)
        with pytest.raises(MTPError) as e:
            server_module.check_mlx_lm()
        assert str(e.value) == (
            "mlx-mtp serve needs mlx-lm 0.32.x (0.32.2 or later): "
            "mlx_lm.server.ResponseGenerator._tokenize has changed (its parameters "
            "are (self, tokenizer, request), not (self, tokenizer, request, args)) "
            f"in the installed mlx-lm {mlx_lm.__version__}"
        )
        m.delitem(sys.modules, "mlx_mtp.server")  # `serve` imports it again
        r = CliRunner().invoke(main, ["serve", "--model", "x"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert "ResponseGenerator._tokenize has changed" in r.output
    with monkeypatch.context() as m:
        m.delattr(lm_server.ResponseGenerator, "_make_state_machine")
        with pytest.raises(
            MTPError, match=r"ResponseGenerator\._make_state_machine is"
        ):
            server_module.check_mlx_lm()


SERVE = """
import sys
from mlx_mtp import server
load = server.MTPModelProvider._load_served
def endless(self):  # EOS never comes: only a signal ends the reply
    load(self)
    self.tokenizer._eos_token_ids = {-1}
server.MTPModelProvider._load_served = endless
from mlx_mtp.cli import run
run(sys.argv[1:])
"""


class Process:
    """``mlx-mtp serve --port 0`` in a subprocess, its port read from its stderr."""

    def __init__(self, model_path):
        cmd = [sys.executable, "-c", SERVE, "serve", "--model", model_path]
        self.proc = subprocess.Popen(
            cmd + ["--port", "0"], stderr=subprocess.PIPE, text=True
        )
        found = None
        for line in self.proc.stderr:  # until it says where it serves
            found = re.search(r" at http://[\d.]+:(\d+) ", line)
            if found:
                break
        assert found, "mlx-mtp serve did not start"
        self.port = int(found.group(1))

    def finish(self, timeout=60):
        """(exit code, the rest of stderr less the access log)."""
        err = self.proc.stderr.read()
        lines = [x for x in err.splitlines() if x.strip() and '"POST ' not in x]
        return self.proc.wait(timeout), "\n".join(lines)


def streaming(process):
    """A streamed request in flight on ``process``: (reader, started)."""
    started = threading.Event()
    body = {"messages": MESSAGES, "max_tokens": 30000}
    return Background(stream, process, body, started), started


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM]])
def test_a_signal_ends_open_streams_and_exits(signals, model_path):
    """SIGINT (exit 130) or SIGTERM (exit 0) mid-stream: generation stops within a
    round, the open stream ends with a final chunk and ``[DONE]``, one line on
    stderr."""
    process = Process(model_path)
    reader, started = streaming(process)
    assert started.wait(60)
    t = time.monotonic()
    for s in signals:
        process.proc.send_signal(s)
    code, err = process.finish()
    assert time.monotonic() - t < 30
    assert code == (130 if signals[0] == signal.SIGINT else 0), err
    assert "Traceback" not in err and "terminate" not in err
    assert len(err.splitlines()) == 1, err
    events = reader.result()
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] is not None


def test_a_second_ctrl_c_quits_quietly(model_path):
    """Ctrl-C twice in a row, a stream open: exit 130, no abort, no traceback."""
    process = Process(model_path)
    reader, started = streaming(process)
    assert started.wait(60)
    process.proc.send_signal(signal.SIGINT)
    process.proc.send_signal(signal.SIGINT)
    code, err = process.finish()
    assert code == 130, err
    assert "Traceback" not in err and "terminate" not in err
    try:
        reader.result()
    except (http.client.HTTPException, OSError):
        pass  # a stream may be cut: the second Ctrl-C quits at once


@pytest.mark.parametrize(
    "field,value",
    [("stream", "yes"), ("logprobs", 1), ("top_logprobs", 50), ("model", 7)],
)
def test_mlx_lms_own_checks_name_the_field(served, field, value):
    """The fields mlx-lm's handler checks itself are refused naming them too."""
    status, reply = post(served, {"messages": MESSAGES, "max_tokens": 4, field: value})
    assert status == 400, reply
    assert reply["error"]["param"] == field, reply
    assert_serving(served)

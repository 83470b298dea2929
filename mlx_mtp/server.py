"""``mlx-mtp serve``: mlx-lm's OpenAI-compatible server, decoding with MTP.

mlx-lm's server (`mlx_lm.server`) is reused for everything around decoding: request
parsing and validation, chat templates with tools and ``chat_template_kwargs``, the
text state machine that splits reasoning and tool-call text, mlx-lm's tool parsers, stop
words, server-sent events, ``usage``. Three subclasses change what MTP needs:

- `MTPModelProvider` loads with `mlx_mtp.load` (heads, or a Gemma 4 assistant) and
  serves that one model only: a request never makes the server load another path;
- `MTPResponseGenerator` serves requests one at a time, first come first served, each
  through the MTP loop (`mlx_mtp.generate.stream_generate`), going on from the
  `Session` of an earlier conversation when the prompt extends its tokens (`Sessions`,
  an LRU bounded in count and bytes);
- `MTPHandler` adds a bearer-token check, a body-size bound, OpenAI-style error bodies
  with the right status codes, ``num_draft_tokens`` as an int or "auto", refusals of
  options the MTP loop does not implement, and an ``mtp`` block with the statistics.

A client that goes away mid-stream stops its generation within one round (mlx-lm's
handler stops the request's context; the loop checks it after every token), and the
session it used is left consistent (`mtp_generate_step`'s exit contract).
"""

import argparse
import io
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
from mlx_lm import server as lm_server

from . import draft_vocab
from .draft_vocab import parse as parse_draft_vocab
from .errors import MTPError, one_line
from .generate import stream_generate
from .loading import load
from .speculative import Session

log = logging.getLogger("mlx_mtp")

API_KEY_ENV = "MLX_MTP_API_KEY"
STICKY = 2.0  # seconds of batching after requests last overlapped
GRACE = 0.02  # seconds a lone request waits for company before it decodes alone
DEFAULT_MODEL = "default_model"  # mlx-lm's name for the served model
# Request fields of mlx_lm.server whose features the MTP loop does not implement:
# refused when set to anything but their neutral value.
UNSUPPORTED = {
    "repetition_penalty": (0, 0.0, 1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "logit_bias": ({},),
    "adapters": (),
    "draft_model": (),
    "n": (1,),
}


class RequestError(Exception):
    """An error for the client: HTTP status, OpenAI error type and code."""

    def __init__(self, status: int, message: str, kind: str, code=None, param=None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def body(self) -> bytes:
        error = {
            "message": str(self),
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}).encode()


def bad_request(message: str, param=None, code=None) -> RequestError:
    return RequestError(400, message, "invalid_request_error", code, param)


# --- sessions ------------------------------------------------------------------------


class Sessions:
    """Conversations whose caches can be gone on from: an LRU of `Session`s, at most
    ``size`` of them and ``max_bytes`` of cache memory.

    `take` hands out (and removes) the session whose tokens the prompt extends, the
    longest such; `put` returns a session after a generation. A session is used by
    one generation at a time, so no two requests share caches.
    """

    def __init__(self, size: int = 8, max_bytes: Optional[int] = None):
        self.size, self.max_bytes = size, max_bytes
        self._items: "OrderedDict[int, Session]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def take(self, prompt: List[int]) -> Optional[Session]:
        with self._lock:
            best, best_len = None, 0
            for key, s in self._items.items():
                tokens = s.tokens
                n = len(tokens)
                if best_len < n < len(prompt) and prompt[:n] == tokens:
                    best, best_len = key, n
            return self._items.pop(best) if best is not None else None

    def put(self, session: Session) -> None:
        if session.state is None:
            return
        with self._lock:
            self._items[id(session)] = session
            while len(self._items) > self.size or (
                self.max_bytes is not None
                and len(self._items) > 1
                and self.nbytes > self.max_bytes
            ):
                self._items.popitem(last=False)

    @property
    def nbytes(self) -> int:
        total = 0
        for s in self._items.values():
            for c in s.caches.trunk + s.caches.mtp:
                total += sum(a.nbytes for a in _arrays(c.state))
        return total


def _arrays(state):
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for x in state for a in _arrays(x)]
    return []


# --- model provider ------------------------------------------------------------------


class MTPModelProvider(lm_server.ModelProvider):
    """Loads the one served model with `mlx_mtp.load`; any other name is refused."""

    def __init__(self, cli_args: argparse.Namespace):
        super().__init__(cli_args)
        self.served = model_id(cli_args.model)
        self.aliases = {DEFAULT_MODEL, self.served, cli_args.model}

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self.reset()
        model, tokenizer = load(
            self.cli_args.model,
            allow_missing_heads=self.cli_args.allow_missing_heads,
            draft_model=self.cli_args.draft_model,
            trust_remote_code=self.cli_args.trust_remote_code,
            tokenizer_config=self._tokenizer_config,
        )
        if draft_vocab.wants_ranking(model):  # before serving, not in a request
            draft_vocab.ranking_for(model, tokenizer)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (self.cli_args.model, None, self.cli_args.draft_model)
        self.model, self.tokenizer = model, tokenizer
        self.processor = None
        self.draft_model = None
        self.is_batchable = all(
            hasattr(c, "merge") for c in lm_server.make_prompt_cache(model.trunk)
        )

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """The trunk (what mlx-lm's batched plain decoding runs) and the tokenizer;
        single requests decode with MTP through ``self.model``."""
        if model_path not in self.aliases:
            raise RequestError(
                404,
                f"the model {model_path!r} does not exist; this server serves "
                f"{self.served!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        if self.model is None:
            self._load(self.cli_args.model)
        return self.model.trunk, self.tokenizer


def model_id(path: str) -> str:
    """The id `/v1/models` lists for the served model: a hub id as given, a local
    folder by its absolute path."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


# --- generation ----------------------------------------------------------------------


class MTPResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's generation thread. A request alone is served through the MTP loop
    (MTP pays at batch 1), with `Sessions` for prompt reuse; while other requests
    are in flight, requests join mlx-lm's batched plain decoding of the trunk, which
    serves several at once faster than MTP serves them in turn (measured:
    scripts/serve_bench.py). Seeded requests are always served alone."""

    def __init__(self, model_provider: MTPModelProvider, sessions: Sessions):
        self.sessions = sessions
        self._in_flight, self._overlapped = 0, -STICKY
        self._count_lock = threading.Lock()
        super().__init__(model_provider, lm_server.LRUPromptCache(8))

    def _is_batchable(self, args) -> bool:
        """Batch while requests overlap, and for `STICKY` seconds after they last
        did (clients that take turns would otherwise flip between the two modes,
        each request waiting out another's MTP generation). A request arriving
        alone waits `GRACE` for others (clients that start together) first."""
        if not self.model_provider.is_batchable or args.seed is not None:
            return False
        if time.monotonic() - self._overlapped < STICKY:
            return True
        deadline = time.monotonic() + GRACE  # clients that start together
        while self._in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        return self._in_flight > 1

    def _count(self, n: int) -> None:
        with self._count_lock:
            self._in_flight += n
            if self._in_flight > 1:
                self._overlapped = time.monotonic()

    def _serve_single(self, request, stream):
        rqueue, request, args = request
        try:
            tokenizer = self.model_provider.tokenizer
            prompt, _, _, initial_state, _ = self._tokenize(tokenizer, request, args)
            stop_sequences, text_sm = self._make_state_machine(
                self.model_provider.model_key, tokenizer, args.stop_words
            )
            ctx = lm_server.GenerationContext(
                has_thinking=tokenizer.has_thinking,
                has_tool_calling=tokenizer.has_tool_calling,
                tool_parser=tokenizer.tool_parser,
                text_sm=text_sm,
                initial_state=initial_state,
                prompt=prompt,
            )
            session = self.sessions.take(prompt)
            done = len(session.tokens) if session is not None else 0
            ctx.prompt_cache_count = done
            ctx.mtp = None
            session = session or Session()
            self._decode(rqueue, ctx, session, prompt[done:], args, stop_sequences)
        except Exception as e:  # every failure goes back to its request
            rqueue.put(e)

    def _decode(self, rqueue, ctx, session, rest, args, stop_sequences):
        tokenizer = self.model_provider.tokenizer
        sampling = args.sampling
        steps = stream_generate(
            self.model_provider.model,
            tokenizer,
            rest,
            max_tokens=args.max_tokens,
            num_draft_tokens=args.num_draft_tokens,
            max_draft_tokens=self.cli_args.max_draft_tokens,
            draft_source=getattr(args, "draft_source", self.cli_args.draft_source),
            lookup_tokens=self.cli_args.lookup_tokens,
            draft_vocab=getattr(args, "draft_vocab", self.cli_args.draft_vocab),
            temp=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=args.seed,
            prefill_step_size=self.cli_args.prefill_step_size,
            session=session,
            on_prefill=lambda s: self.sessions.put(s.snapshot()),
        )
        matcher = stop_sequences.matcher()
        try:
            first = next(steps)  # the prefill: errors surface before any reply
        except MTPError as e:
            self.sessions.put(session)  # untouched: the prompt was refused first
            raise bad_request(one_line(e), code="context_length_exceeded") from None
        rqueue.put(ctx)
        try:
            for gen in _chain(first, steps):
                finish = gen.finish_reason
                if matcher.advance(gen.token):
                    finish = "stop"
                ctx.mtp = gen.mtp
                # the token's logprob only when asked: .item() is a sync per token
                logprob = gen.logprobs[gen.token].item() if args.logprobs else 0.0
                rqueue.put(
                    lm_server.Response(
                        gen.text,
                        gen.token,
                        logprob,
                        finish,
                        lm_server._format_top_logprobs(
                            gen.logprobs, args.top_logprobs, tokenizer
                        ),
                    )
                )
                if finish is not None or ctx._should_stop:
                    break
        finally:
            steps.close()  # the session now holds what was yielded
            self.sessions.put(session)
        rqueue.put(None)

    def generate(self, request, generation_args, progress_callback=None):
        """As mlx-lm's, but a request error raised before the reply starts keeps its
        own status (mlx-lm answers 404 to any)."""
        response_queue = lm_server.Queue()
        if not self.generation_available():
            raise RuntimeError("generation thread died")
        self._count(1)
        self.requests.put((response_queue, request, generation_args))
        try:
            first = self._await_response(response_queue)
            while isinstance(first, tuple):  # prompt progress
                first = self._await_response(response_queue)
            if isinstance(first, Exception):
                raise first
        except BaseException:
            self._count(-1)
            raise

        def responses():
            try:
                while True:
                    response = self._await_response(response_queue)
                    if response is None:
                        return
                    if isinstance(response, Exception):
                        raise response
                    if not isinstance(response, tuple):
                        yield response
            finally:
                self._count(-1)

        return first, responses()


def _chain(first, rest):
    yield first
    yield from rest


# --- HTTP ----------------------------------------------------------------------------


class MTPHandler(lm_server.APIHandler):
    """mlx-lm's handler with authentication, bounds, OpenAI-style errors, the
    ``num_draft_tokens`` field and an ``mtp`` block."""

    protocol_version = "HTTP/1.0"

    def _fail(self, error: RequestError) -> None:
        body = error.body()
        self.send_response(error.status)
        self.send_header("Content-type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if error.status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self._set_cors_headers()
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def _authorized(self) -> bool:
        key = self.response_generator.cli_args.api_key
        if not key or self.path == "/health":
            return True
        if self.headers.get("Authorization", "") == f"Bearer {key}":
            return True
        self._fail(
            RequestError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY')",
                "authentication_error",
                "invalid_api_key",
            )
        )
        return False

    def do_GET(self):
        if not self._authorized():
            return
        if self.path.startswith("/v1/models"):
            return self.handle_models_request()
        if self.path == "/health":
            return self.handle_health_check()
        self._fail(RequestError(404, f"no endpoint {self.path}", "not_found_error"))

    def handle_models_request(self):
        provider = self.response_generator.model_provider
        data = [{"id": provider.served, "object": "model", "created": self.created}]
        body = json.dumps({"object": "list", "data": data}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        try:
            if not self._authorized():
                return
            self._read_body()
            self._check_fields()
        except RequestError as e:
            return self._fail(e)
        self.rfile = _Replay(self._raw)  # the checked body, for mlx-lm to read
        self.headers.replace_header("Content-Length", str(len(self._raw)))
        wfile = self.wfile
        try:
            super().do_POST()
        finally:
            self.wfile = wfile

    def _read_body(self) -> None:
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            if self.path != "/chat/completions":
                raise RequestError(404, f"no endpoint {self.path}", "not_found_error")
        limit = self.response_generator.cli_args.max_body_bytes
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(
                411, "a Content-Length header is required", "invalid_request_error"
            ) from None
        if length > limit:
            raise RequestError(
                413,
                f"the request body has {length} bytes; this server takes {limit}",
                "invalid_request_error",
            )
        self._raw = self.rfile.read(length)
        try:
            body = json.loads(self._raw.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise bad_request(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self._body = body

    def _check_fields(self) -> None:
        body, args = self._body, self.response_generator.cli_args
        provider = self.response_generator.model_provider
        name = body.get("model", DEFAULT_MODEL)
        if not isinstance(name, str):
            raise bad_request("model must be a string", "model")
        provider.load(name)  # a RequestError for any other model
        body["model"] = provider.served  # replies name the served model
        for field, neutral in UNSUPPORTED.items():
            if field in body and body[field] not in neutral:
                raise bad_request(
                    f"{field} is not supported by mlx-mtp's decoding", field
                )
        chat = self.path != "/v1/completions"
        need = "messages" if chat else "prompt"
        if need not in body:
            raise bad_request(f"the request needs {need}", need)
        if chat and (not isinstance(body["messages"], list) or not body["messages"]):
            raise bad_request("messages must be a non-empty list", "messages")
        if not chat and (not isinstance(body["prompt"], str) or not body["prompt"]):
            raise bad_request("prompt must be a non-empty string", "prompt")
        k = body.pop("num_draft_tokens", args.draft_tokens)
        if k != "auto" and (type(k) is not int or not 0 <= k <= 16):
            raise bad_request(
                "num_draft_tokens must be 'auto' or an integer from 0 to 16",
                "num_draft_tokens",
            )
        self._num_draft_tokens = k
        source = body.pop("draft_source", args.draft_source)
        if source not in ("heads", "lookup", "auto"):
            raise bad_request(
                "draft_source must be 'heads', 'lookup' or 'auto'", "draft_source"
            )
        self._draft_source = source
        try:
            self._draft_vocab = parse_draft_vocab(
                body.pop("draft_vocab", args.draft_vocab)
            )
        except MTPError as e:
            raise bad_request(str(e), "draft_vocab") from None
        for key in ("max_tokens", "max_completion_tokens"):
            n = body.get(key)
            if n is not None and type(n) is int and n > args.max_tokens_limit:
                raise bad_request(
                    f"{key} is {n}; this server generates at most "
                    f"{args.max_tokens_limit} tokens per request",
                    key,
                )
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise bad_request("stop must be a string or a list of strings", "stop")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        self._raw = json.dumps(body).encode()

    # mlx-lm's handler calls the methods below. Where it would answer an error in its
    # own form, the error is answered here first, in OpenAI's, and what mlx-lm then
    # writes goes nowhere (`_refuse`).

    def _refuse(self, error: RequestError) -> None:
        self._fail(error)
        self.wfile = _Sink()

    def validate_model_parameters(self) -> None:
        try:
            super().validate_model_parameters()
        except ValueError as e:
            self._refuse(bad_request(str(e)))
            raise

    def handle_completion(self, request, stop_words):
        handler = self

        class Generator:
            def __getattr__(self, name):
                return getattr(handler._generator, name)

            def generate(self, request, args, progress_callback=None):
                args.num_draft_tokens = handler._num_draft_tokens
                args.draft_source = handler._draft_source
                args.draft_vocab = handler._draft_vocab
                try:
                    ctx, responses = handler._generator.generate(
                        request, args, progress_callback
                    )
                except RequestError as e:
                    handler._refuse(e)
                    raise
                except Exception as e:  # a failure of this request only
                    log.exception("request failed")
                    error = RequestError(500, one_line(e), "server_error")
                    handler._refuse(error)
                    raise error from None
                handler._ctx, handler._responses = ctx, responses
                return ctx, responses

        self._generator, self.response_generator = self.response_generator, Generator()
        try:
            super().handle_completion(request, stop_words)
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away; its generation stopped")
        except Exception as e:  # after the reply started: end it, keep serving
            log.exception("request failed mid-reply")
            if self.stream:
                error = RequestError(500, one_line(e), "server_error")
                self.wfile.write(b"data: " + error.body() + b"\n\n")
        finally:
            self.response_generator = self._generator
            responses = getattr(self, "_responses", None)
            if responses is not None:
                responses.close()  # counted out of the in-flight requests now

    def generate_response(self, text, finish_reason, *args, **kwargs):
        response = super().generate_response(text, finish_reason, *args, **kwargs)
        if finish_reason is not None:
            self._add_mtp(response)
        return response

    def completion_usage_response(self, *args, **kwargs):
        return self._add_mtp(super().completion_usage_response(*args, **kwargs))

    def _add_mtp(self, response: dict) -> dict:
        ctx = getattr(self, "_ctx", None)
        if ctx is None:
            return response
        if hasattr(ctx, "mtp"):
            if ctx.mtp is not None:
                response["mtp"] = mtp_block(ctx.mtp)
        else:  # served in mlx-lm's batch, plainly
            response["mtp"] = {"num_draft_tokens": 0, "batched": True}
        return response


def mtp_block(stats) -> dict:
    """The ``mtp`` block of a response: what was drafted and accepted."""
    return {
        "num_draft_tokens": stats.num_draft_tokens,
        "positions": stats.positions,
        "rounds": stats.rounds,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "acceptance_per_position": stats.acceptance_per_position,
        "tokens_per_round": stats.tokens_per_round,
        "drafted_by_source": dict(stats.drafted_by_source),
        "accepted_by_source": dict(stats.accepted_by_source),
        "drafted_by_vocab": dict(stats.drafted_by_vocab),
    }


class _Sink:
    """Where mlx-lm's own error replies go once an OpenAI-style one was sent."""

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


class _Replay:
    """The request body, already read, for mlx-lm's handler to read again."""

    def __init__(self, data: bytes):
        self._io = io.BytesIO(data)

    def read(self, n=-1):
        return self._io.read(n)

    def close(self) -> None:
        self._io.close()


# --- the server ----------------------------------------------------------------------


def server_args(**options) -> argparse.Namespace:
    """The namespace mlx-lm's server pieces read, from `serve`'s options."""
    defaults = dict(
        model=None,
        draft_model=None,
        adapter_path=None,
        host="127.0.0.1",
        port=8080,
        allowed_origins=["*"],
        num_draft_tokens="auto",  # the server's default; mlx-lm's field is 0
        max_draft_tokens=4,
        draft_source="auto",
        lookup_tokens=8,
        draft_vocab="auto",
        trust_remote_code=False,
        chat_template="",
        use_default_chat_template=False,
        temp=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=512,
        max_tokens_limit=32768,
        max_body_bytes=8 << 20,
        chat_template_args={},
        decode_concurrency=32,  # mlx-lm's batched decoding, when requests overlap
        prompt_concurrency=8,
        prefill_step_size=2048,
        prompt_cache_size=8,
        prompt_cache_bytes=None,
        allow_missing_heads=False,
        kv_bits=None,
        kv_group_size=64,
        quantized_kv_start=5000,
        pipeline=False,
        api_key=os.environ.get(API_KEY_ENV) or None,
    )
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unknown server options: {', '.join(sorted(unknown))}")
    args = {**defaults, **options}
    # mlx-lm's handler validates its own num_draft_tokens (an int): ours, "auto" or
    # an int, is read by `MTPHandler` from the request or this default.
    args["draft_tokens"], args["num_draft_tokens"] = args["num_draft_tokens"], 0
    return argparse.Namespace(**args)


class Server:
    """An `mlx-mtp serve` server; `start` runs it in a thread (tests, scripts),
    `serve_forever` in the caller's."""

    def __init__(self, args: argparse.Namespace):
        class HTTPServer(ThreadingHTTPServer):
            daemon_threads = True  # a slow client never holds the server up

        self.args = args
        provider = MTPModelProvider(args)
        provider.load(DEFAULT_MODEL)  # load errors now, before binding
        self.generator = None
        self.httpd = HTTPServer((args.host, args.port), self._handler())
        sessions = Sessions(args.prompt_cache_size, args.prompt_cache_bytes)
        self.generator = MTPResponseGenerator(provider, sessions)
        self.port = self.httpd.server_address[1]
        self._thread = None

    def _handler(self):
        fingerprint = lm_server.get_system_fingerprint()

        def make(*a, **kw):
            return MTPHandler(self.generator, *a, system_fingerprint=fingerprint, **kw)

        return make

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.port}"

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        self.httpd.shutdown() if self._thread else None
        self.httpd.server_close()
        self.generator.stop_and_join()


__all__ = ["Server", "Sessions", "server_args", "mtp_block"]

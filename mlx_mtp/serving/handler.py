"""A request's HTTP side: `MTPHandler`, mlx-lm's handler with bearer-token checks,
checks that keep web pages out (Origin, Host, Content-Type), bounds on bodies and
time (with `mlx_mtp.serving.http_guard`), the checks of `server_checks` (sampling
settings, the messages' shape: no image is taken, no URL fetched), OpenAI-style
error bodies with the right status codes (Anthropic's for the Messages API; the
Messages and Responses APIs served as the chat requests they translate to), one
`DecodeOptions` per request (the server's, then the request's fields:
``num_draft_tokens`` as an int or "auto", ``draft_source``, ``draft_vocab``,
sampling), refusals of options the MTP loop does not implement, and an ``mtp`` block
with the statistics (`mtp_block`)."""

import io
import json
import logging
import re
import threading
import time
import uuid
from http import HTTPStatus
from pathlib import Path
from typing import Dict, Optional, Tuple
from urllib.parse import urlsplit

from mlx_lm import server as lm_server

from .. import anthropic_api, responses_api
from ..errors import MTPError, one_line
from ..grammar import check_grammar
from ..images import reads_images
from ..options import DecodeOptions
from ..replies import Unparsed, finite
from ..server_checks import (
    MAX_DEPTH,
    RequestError,
    bad_request,
    check_chat_fields,
    check_json,
    check_sampling,
    host_allowed,
    key_owner,
    local_origin,
    request_options,
    take_images,
    tool_choice,
)
from .http_guard import Deadline, hung_up
from .jobs import WATCH_EVERY, Job, JobRequest, Refusal, shutting_down, with_job
from .provider import DEFAULT_MODEL, times_costs

log = logging.getLogger("mlx_mtp")


# Request fields of mlx_lm.server whose features the MTP loop does not implement:
# refused when set to anything but their neutral value.
UNSUPPORTED = {
    "xtc_probability": (0, 0.0),
    "adapters": (),
    "draft_model": (),
    "n": (1,),
}


# The chat page `GET /` answers with: a conversation that streams, its tokens coloured
# by where they came from (``mtp_sources``), live tok/s and tokens per pass; no
# resource from elsewhere (it works offline).
PAGE = Path(__file__).with_name("page.html")

# mlx-lm's handler attributes whose request field has another name
HANDLER_FIELDS = {"requested_model": "model"}


class MTPHandler(lm_server.APIHandler):
    """mlx-lm's handler with authentication, checks that keep web pages out (Origin,
    Host, Content-Type), bounded requests, OpenAI-style errors, the decode options
    of each request (`Job`) and an ``mtp`` block."""

    protocol_version = "HTTP/1.0"

    def __init__(self, response_generator, *args, kept=None, **kwargs):
        # the responses kept for previous_response_id (`responses_api.Kept`): the
        # server's, shared by its connections; None keeps none
        self.kept = kept
        super().__init__(response_generator, *args, **kwargs)

    def setup(self):
        self.timeout = self.response_generator.cli_args.request_timeout
        super().setup()
        self.rfile = Deadline(self.rfile, self.connection, self.timeout)
        self._pending = None  # the body's bytes not read yet, once known
        self._job = None  # a completion request's record, once its fields passed
        self._served = None  # the model and tokenizer its checks use (`Served`)
        self._watched = 0.0  # when `_client_left` last looked
        # the API a request translated to a chat request is of (`anthropic_api`,
        # `responses_api`; None: a chat or completion request), its reply's Events
        # while it is made, and a Responses request's `responses_api.Request`
        self._api = None
        self._messages = None
        self._asked = None
        self._owner = None

    def _received(self) -> None:
        """The request is read: from now on the timeout bounds each idle wait of the
        reply (a client that reads nothing of it for that long is dropped)."""
        self.connection.settimeout(self.timeout)

    def _client_left(self) -> bool:
        """Whether the client closed (or reset) its connection (`hung_up`); looked
        at once per `WATCH_EVERY` at most, else False. From the handler's thread
        only (it alone reads and writes the connection)."""
        now = time.monotonic()
        if now - self._watched < WATCH_EVERY:
            return False
        self._watched = now
        return hung_up(self.connection)

    def _fail(self, error: RequestError) -> None:
        self._drain()
        body = self._api.error_body(error) if self._api else error.body()
        try:
            self.send_response(error.status)
            self.send_header("Content-type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if error.status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self._set_cors_headers()
            self.end_headers()
            if getattr(self, "command", None) != "HEAD":
                self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            log.info("client went away before its error reply")

    def _drain(self) -> None:
        """Read what is left of a refused request's body (within the request's time,
        up to the body bound), so that closing the connection does not reset it
        before the client reads the reply."""
        if self._pending is None and getattr(self, "headers", None) is not None:
            try:
                self._content_length()
            except RequestError:
                self._pending = 0
        pending, self._pending = self._pending or 0, 0
        try:
            self.rfile.read(pending)
        except OSError:
            pass
        self._received()

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a malformed request line, headers too long, an
        unknown method) in OpenAI's error body."""
        self.close_connection = True
        kind = (
            "server_error" if code >= 500 and code != 501 else "invalid_request_error"
        )
        self._fail(RequestError(code, message or HTTPStatus(code).phrase, kind))

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.server.origins
        spelled = origin.lower()
        return "*" in allowed or spelled in allowed or local_origin(spelled)

    def _set_cors_headers(self):
        """CORS headers for an allowed Origin only (`_admit` refused the others)."""
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        if origin is None or not self._origin_allowed(origin):
            return
        star = "*" in self.server.origins
        self.send_header("Access-Control-Allow-Origin", "*" if star else origin)
        self.send_header("Vary", "Origin")

    def _admit(self) -> None:
        """403 for what a web page must not do: reach a server bound to a loopback
        address by a name of its own (DNS rebinding; `host_allowed`), or call from an
        Origin that is neither this machine's nor in ``--allowed-origins``."""
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1:
            raise bad_request("the request has more than one Host header")
        if self.server.loopback and not host_allowed(
            hosts[0] if hosts else None, self.server.name
        ):
            raise RequestError(
                403,
                f"the Host {hosts[0]!r} is not this machine's (the server is bound "
                "to a loopback address)",
                "invalid_request_error",
                "host_not_allowed",
            )
        origin = self.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            raise RequestError(
                403,
                f"pages from {origin!r} may not use this server (see "
                "--allowed-origins)",
                "invalid_request_error",
                "origin_not_allowed",
            )

    def _authorize(self) -> Optional[int]:
        """401 unless the request presents one of the API keys (``/health`` needs
        none); the index of the key it presented (None without keys)."""
        keys, headers = self.response_generator.cli_args.api_key, self.headers
        owner = key_owner(
            keys, headers.get("Authorization", ""), headers.get("x-api-key", "")
        )
        if keys and owner is None and self.path != "/health":
            raise RequestError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY')",
                "authentication_error",
                "invalid_api_key",
            )
        return owner

    def do_OPTIONS(self):
        """A CORS preflight: answered for allowed Origins only."""
        self._received()
        try:
            self._admit()
        except RequestError as e:
            return self._fail(e)
        self.send_response(204)
        if self.headers.get("Origin") is not None:
            self._set_cors_headers()
            asked = self.headers.get("Access-Control-Request-Headers")
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header(
                "Access-Control-Allow-Headers", asked or "Authorization, Content-Type"
            )
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._received()
        try:
            self._admit()
            if urlsplit(self.path).path in ("/", "/index.html"):
                return self._send_page()
            self._authorize()
        except RequestError as e:
            return self._fail(e)
        if self.path.startswith("/v1/models"):
            return self.handle_models_request()
        if self.path == "/health":
            return self.handle_health_check()
        self._fail(RequestError(404, f"no endpoint {self.path}", "not_found_error"))

    def _send_page(self) -> None:
        """The chat page (`PAGE`): static, no data of the server's, so no key is
        asked for it (the Host and Origin checks hold); its requests to the API
        send the key the page is given."""
        body = PAGE.read_bytes()
        self.send_response(200)
        self.send_header("Content-type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header(
            "Content-Security-Policy",
            "default-src 'none'; script-src 'unsafe-inline'; style-src "
            "'unsafe-inline'; connect-src 'self'; base-uri 'none'; form-action 'none'",
        )
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def handle_models_request(self):
        provider = self.response_generator.model_provider
        data = [{"id": provider.served, "object": "model", "created": self.created}]
        self._send_json({"object": "list", "data": data})

    def _send_json(self, value) -> None:
        """A 200 reply of ``value`` as JSON (a ValueError for NaN or infinite
        numbers, which JSON does not have)."""
        body = json.dumps(value, allow_nan=False).encode()
        self.send_response(200)
        self.send_header("Content-type", "application/json")
        self._set_cors_headers()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_POST(self):
        """A completion request, checked here before mlx-lm's handler serves it; a
        failure anywhere after is answered here too (`Refusal`). A Messages request
        (Anthropic's API) or a Responses request (OpenAI's) is served as the chat
        request it translates to."""
        self._api = _api_under(self.path)
        try:
            self._admit()
            owner = self._owner = self._authorize()
            self._route()
            length = self._content_length()
            self._check_media_type()
            self._read_body(length)
            stream = self._translate(owner)
            self._while_open(self._check_request, owner)
        except RequestError as e:
            return self._fail(e)
        if self._api:  # its chat reply streams: the API's `Reply` reads it
            self._job.stream, self.path = stream, "/v1/chat/completions"
        self.rfile = io.BytesIO(self._raw)  # the checked body, for mlx-lm's handler
        self.headers.replace_header("Content-Length", str(len(self._raw)))
        try:
            super().do_POST()
        except Refusal as refusal:
            self._answer(refusal)

    def _translate(self, owner: Optional[int]) -> Optional[bool]:
        """A Messages or Responses request's body as the chat request that serves
        it; whether its own reply streams (None for a chat request)."""
        if self._api is anthropic_api:
            self._body, stream = anthropic_api.chat_request(self._body)
            return stream
        if self._api is responses_api:

            def history(response_id):
                return self.kept.get(response_id, owner) if self.kept else None

            self._body, stream, self._asked = responses_api.chat_request(
                self._body, history
            )
            return stream
        return None

    def _answer(self, refusal: "Refusal") -> None:
        """A request's failure in its API's form: its error reply, or once its stream
        started, an error event (OpenAI's then ``[DONE]``)."""
        if not refusal.streaming:
            return self._fail(refusal.error)
        error = refusal.error
        try:
            if self._api:
                self.wfile.write(self._api.error_event(error))
            else:
                self.wfile.write(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            log.info("client went away before its error event")

    def _while_open(self, fn, *args) -> None:
        """``fn(*args)`` on a thread of its own, waited for here until it is done
        (its exception raised here), or until the server closes: then a 503 at
        once, as for any request not started (`shutting_down`), its thread left
        to finish on its own. The request's checks may take seconds (a large
        schema compiles), and a server that closes waits a little only
        (`mlx_mtp.server.CLOSE_WAIT`) for the connections it handles."""
        done, out = threading.Event(), {}

        def run():
            try:
                fn(*args)
            except BaseException as e:  # raised in the handler's thread
                out["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="request checks", daemon=True).start()
        while not done.wait(WATCH_EVERY):
            if self.response_generator.closing:
                raise shutting_down()
        if "error" in out:
            raise out["error"]

    def _check_request(self, owner: Optional[int]) -> None:
        """Everything checked of a request before it is queued."""
        self._check_fields(owner)
        self._check_room()

    def _route(self) -> None:
        if anthropic_api.is_messages(self.path) or responses_api.is_responses(
            self.path
        ):
            return
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            if self.path != "/chat/completions":
                raise RequestError(404, f"no endpoint {self.path}", "not_found_error")

    def _content_length(self) -> int:
        """The body's length: 411 without a Content-Length (a chunked body too: this
        server reads only bodies of a declared length, as OpenAI's clients send
        them, and 411 says how to resend), 400 for a malformed one, 413 over the
        bound."""
        if "Transfer-Encoding" in self.headers:
            raise RequestError(
                411,
                "chunked bodies are not supported: send a Content-Length",
                "invalid_request_error",
            )
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            raise RequestError(
                411, "a Content-Length header is required", "invalid_request_error"
            )
        value = values.pop()
        if values or not re.fullmatch("[0-9]{1,19}", value):
            raise bad_request(f"Content-Length {value!r} is not a length in bytes")
        length, limit = int(value), self.response_generator.cli_args.max_body_bytes
        if length > limit:
            raise RequestError(
                413,
                f"the request body has {length} bytes; this server takes {limit}",
                "invalid_request_error",
            )
        self._pending = length
        return length

    def _check_media_type(self) -> None:
        """415 unless the body is JSON: a web page can send text/plain, forms and
        untyped blobs without a CORS preflight, never application/json."""
        media = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise RequestError(
                415,
                "the request body must be JSON, sent as 'Content-Type: "
                "application/json'",
                "invalid_request_error",
            )

    def _read_body(self, length: int) -> None:
        try:
            self._raw = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(
                408,
                f"the request did not arrive within {self.timeout:g} s",
                "invalid_request_error",
            ) from None
        finally:
            self._pending = 0
        self._received()
        if len(self._raw) < length:
            raise bad_request("the request body is shorter than its Content-Length")
        try:
            body = json.loads(self._raw.decode())
        except RecursionError:
            raise bad_request(
                f"the request nests deeper than {MAX_DEPTH} levels"
            ) from None
        except (UnicodeDecodeError, ValueError) as e:
            raise bad_request(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        for key, value in body.items():
            check_json(key)
            check_json(value, key)
        self._body = body

    def _check_fields(self, owner: Optional[int]) -> None:
        """The request's fields, each checked before anything is queued (a
        `RequestError` naming the field); its `Job` made, with its decode options;
        the body left for mlx-lm's handler (``self._raw``)."""
        body, args = self._body, self.response_generator.cli_args
        provider = self.response_generator.model_provider
        name = body.get("model", DEFAULT_MODEL)
        if not isinstance(name, str):
            raise bad_request("model must be a string", "model")
        provider.check_name(name)  # a RequestError for any other model
        self._served = provider.held()  # a 503 once the server closed
        body["model"] = provider.served  # replies name the served model
        for name, neutral in UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                message = f"{name} is not supported by mlx-mtp's decoding"
                raise bad_request(message, name)
        check_sampling(body, args.decode, self._served.model.args.vocab_size)
        chat = self.path != "/v1/completions"
        need = "messages" if chat else "prompt"
        if need not in body:
            raise bad_request(f"the request needs {need}", need)
        if chat and (not isinstance(body["messages"], list) or not body["messages"]):
            raise bad_request("messages must be a non-empty list", "messages")
        if not chat and (not isinstance(body["prompt"], str) or not body["prompt"]):
            raise bad_request("prompt must be a non-empty string", "prompt")
        reads = reads_images(self._served.model)
        if chat:
            check_chat_fields(body, images=reads)
        pictures = take_images(body["messages"]) if chat and reads else []
        for key in ("max_tokens", "max_completion_tokens"):
            n = body.get(key)
            if type(n) is int and n < 1:
                raise bad_request(f"{key} must be at least 1, got {n}", key)
            if type(n) is int and n > args.max_tokens_limit:
                raise bad_request(
                    f"{key} is {n}; this server generates at most "
                    f"{args.max_tokens_limit} tokens per request",
                    key,
                )
        sources = body.pop("mtp_sources", False)
        if type(sources) is not bool:
            raise bad_request("mtp_sources must be true or false", "mtp_sources")
        options = self._decode_options(body)
        stops = self._check_reply_fields(body)
        self._job = Job(options, owner, body.get("stream") is True, stops=stops)
        self._job.images = pictures
        self._job.want_sources = sources
        self._job.responses.left = self._client_left
        self._raw = json.dumps(body).encode()

    def _decode_options(self, body: dict) -> DecodeOptions:
        """The request's decode options (`request_options`: the server's, then the
        request's fields); 400 for a grammar the engine refuses (compiled here, on
        the request's checks' thread, `_while_open`, and cached for the
        generation), and for options whose
        decoding would time round costs on the generation thread (`times_costs`)."""
        provider = self._served
        options = request_options(
            body,
            self.response_generator.cli_args.decode,
            provider.model.args.vocab_size,
        )
        if options.grammar is not None:
            try:
                check_grammar(options.grammar, provider.tokenizer)
            except MTPError as e:
                message = f"response_format: {one_line(e)}"
                raise bad_request(message, "response_format") from None
        forced = tool_choice(body, provider.tokenizer)
        if forced is not None:
            options = options.replace(grammar=forced)
        if times_costs(provider.model, options):
            n = options.draft_vocab
            raise bad_request(
                f"draft_vocab {n} with an 'auto' num_draft_tokens or draft_source "
                "needs round costs this server did not measure: serve with "
                f"--draft-vocab {n}, or send a fixed num_draft_tokens and "
                "draft_source 'heads' or 'lookup'",
                "draft_vocab",
            )
        return options

    def _check_reply_fields(self, body: dict) -> Tuple[str, ...]:
        """``stop`` and ``stream_options``; returns the stop strings (empty ones
        left out: they stop nothing)."""
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise bad_request("stop must be a string or a list of strings", "stop")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        options = body.get("stream_options")
        if options is not None:  # {} is valid, as with OpenAI: no usage chunk
            if not isinstance(options, dict):
                raise bad_request("stream_options must be an object", "stream_options")
            usage = options.get("include_usage")
            if usage is not None and type(usage) is not bool:
                raise bad_request(
                    "stream_options.include_usage must be true or false",
                    "stream_options",
                )
            options["include_usage"] = bool(usage)
        return tuple(s for s in stops if s)

    def _check_room(self) -> None:
        """400 ``context_length_exceeded``, before anything is tokenized, for a
        prompt that cannot fit: its text has at least bytes / `prompt_bytes_per_token`
        tokens. Exact: a prompt that could fit is never refused here (the generation
        checks those). Only a body large enough to hold such a prompt is looked at."""
        per_token, limit = self.server.bytes_per_token, self.server.context
        if per_token is None or not limit or len(self._raw) < limit * per_token:
            return
        chat = self.path != "/v1/completions"
        text = self._chat_text() if chat else self._body["prompt"]
        if text is None:
            return
        at_least = -(-len(text.encode("utf-8")) // per_token)
        if at_least >= limit:
            raise bad_request(
                f"the prompt has at least {at_least} tokens but the model's context "
                f"is {limit}",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )

    def _chat_text(self) -> Optional[str]:
        """The text mlx-lm's `_tokenize` tokenizes for this chat request (the
        template applied, not tokenized), or None when the template fails: the
        request is then served, or refused, as without this check. (It changes
        ``self._body``'s messages as mlx-lm does: ``self._raw`` is already set.)"""
        body, args = self._body, self.response_generator.cli_args
        tokenizer = self._served.tokenizer
        messages = body["messages"]
        try:
            lm_server.process_message_content(messages)
            if not tokenizer.has_chat_template:
                return lm_server.convert_chat(messages, body.get("role_mapping"))
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tools=body.get("tools") or None,
                tokenize=False,
                **{
                    **args.chat_template_args,
                    **(body.get("chat_template_kwargs") or {}),
                },
            )
        except Exception:  # a template's own error: the request's serving reports it
            return None

    # mlx-lm's handler calls the methods below. Where it would answer an error in its
    # own form, a `Refusal` is raised instead, which `do_POST` answers in OpenAI's.

    def validate_model_parameters(self) -> None:
        """mlx-lm's checks of the fields it reads, each refusal a 400 whose ``param``
        is the field (its messages start with the name it reads the field as)."""
        try:
            super().validate_model_parameters()
        except ValueError as e:
            message = str(e)
            name = message.split(" ", 1)[0]
            field = HANDLER_FIELDS.get(name, name)
            param = field if field in self.body else None
            raise Refusal(bad_request(message, param)) from None

    def handle_chat_completions(self):
        """mlx-lm's, less its fetching of image URLs: `check_messages` refused image
        parts, and this server fetches no URL for anyone."""
        self.request_id = f"chatcmpl-{uuid.uuid4()}"
        self.object_type = "chat.completion.chunk" if self.stream else "chat.completion"
        body = self.body
        return lm_server.CompletionRequest(
            "chat",
            "",
            body["messages"],
            body.get("tools") or None,
            body.get("role_mapping"),
        )

    def handle_completion(self, request, stop_words):
        """mlx-lm's, serving the request as a `JobRequest`, which carries its `Job` to
        the generator. A failure after the reply started ends the reply (a stream
        with an error event) and the server goes on; the request is counted out
        once its reply is over. A Messages or Responses request's reply is made of
        the chat reply's chunks (the API's ``Events``, fed by `generate_response`
        and `completion_usage_response`), what mlx-lm writes of the chat reply
        going nowhere (`end_headers`)."""
        job, self._calls = self._job, 0  # _calls: the reply's tool calls so far
        self._sourced = 0  # the job's sources already sent in chunks
        out = self.wfile
        if self._api:
            self._messages = self._api.Events(out, job.stream)
        messages = self._messages
        try:
            super().handle_completion(with_job(request, JobRequest, job), stop_words)
            if messages is not None:
                self._send_message(messages, out)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            log.info("client went away; its generation stopped")
        except Exception as e:  # after the reply started: end it, keep serving
            log.exception("request failed mid-reply")
            error = RequestError(500, one_line(e), "server_error")
            self._end_failed(error, messages, out)
        finally:
            self.wfile, self._messages = out, None
            self.response_generator.release(job.responses)

    def end_headers(self):
        """http.server's; for a Messages request, the headers of mlx-lm's chat reply
        start the Messages reply (`_open_message`)."""
        messages = self._messages
        if messages is None or messages.reply is not None:
            return super().end_headers()
        self._open_message(messages)

    def _open_message(self, messages) -> None:
        """A Messages or Responses reply starts, as mlx-lm's chat reply does (the
        request has its context): a stream's headers (mlx-lm's, an event stream)
        go out, then its first events; a reply not streamed sends nothing now (it
        goes whole, `_send_message`). From then on what mlx-lm writes of the chat
        reply goes nowhere (`_Unsent`): its chunks reach the reply as the handler
        makes them. A message's stop reason is that of the chat reply's finish and
        the stop sequence that ended it, if one did (`anthropic_api.stop_reason`)."""
        job = self._job

        def stop(finish):
            return anthropic_api.stop_reason(finish, job.stop_sequence)

        if not messages.stream:  # its headers too: the reply is sent whole
            self.wfile = _Unsent()
        super().end_headers()
        self.wfile = _Unsent()
        ctx, model = job.responses.ctx, self.requested_model
        prompt, cached = len(ctx.prompt), ctx.prompt_cache_count
        if self._api is responses_api:
            reply = responses_api.Reply(model, prompt, cached, self._asked)
        else:
            reply = anthropic_api.Reply(model, prompt, cached, stop)
        messages.open(reply)

    def _send_message(self, messages, out) -> None:
        """A Messages or Responses reply over: its last events, or the whole reply
        unless it streamed; a response is kept for ``previous_response_id`` unless
        its request said ``store: false``."""
        self.wfile, self._messages = out, None
        messages.close()
        reply = messages.reply
        if self._api is responses_api and self._asked.store and self.kept is not None:
            self.kept.put(reply.id, reply.conversation(), self._owner)
        if not messages.stream:
            self._send_json(reply.message())

    def _end_failed(self, error: RequestError, messages, out) -> None:
        """End a reply that failed after it started: a stream with an error event
        in its API's form (OpenAI's then ``[DONE]``); a reply not streamed, whose
        headers mlx-lm's handler keeps until its body is made (nothing sent yet),
        with its error reply."""
        self.wfile, self._messages = out, None
        if messages is None and self.stream:
            self.wfile.write(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        elif messages is not None and messages.stream:
            self.wfile.write(self._api.error_event(error))
        elif messages is not None or getattr(self, "_headers_buffer", None):
            self._headers_buffer = []  # the 200's, not sent
            self._fail(error)

    def generate_response(self, text, finish_reason, *args, tool_calls=(), **kw):
        """mlx-lm's chunk or reply, with the reply's content as this server makes it:
        tool text that did not parse as calls (`mlx_mtp.replies.Unparsed`) is
        content, with its markers (a call max_tokens cut short has no end marker),
        after the chunk's text; the finish is "tool_calls" only when the reply made
        calls (else "stop"), and "stop" when it ended by a stop string
        (``flushed_stop``: see `Replies`); the ``mtp`` block on the last chunk. A
        ValueError for a reply that would not be valid JSON (NaN, infinities)."""
        text, calls = self._parsed_calls(text or "", tool_calls or (), finish_reason)
        if finish_reason is not None:
            finish_reason = self._finish(finish_reason)
        response = super().generate_response(
            text, finish_reason, *args, tool_calls=calls, **kw
        )
        if finish_reason is not None:
            self._add_mtp(response)
        job = self._job
        if job is not None and job.want_sources and self.stream:
            # the sources of the tokens read since the last chunk
            response["mtp_sources"] = job.sources[self._sourced :]
            self._sourced = len(job.sources)
        return self._to_messages(finite(response))

    def _parsed_calls(self, text: str, calls, finish: Optional[str]):
        """``text`` with the tool text of ``calls`` that did not parse after it, and
        the calls that did (in a stream, numbered from the reply's first)."""
        tokenizer = self.response_generator.model_provider.tokenizer
        parsed = []
        for i, call in enumerate(calls):
            function = call["function"]
            if not isinstance(function, Unparsed):
                if self.stream:
                    call["index"] = self._calls
                parsed.append(call)
                self._calls += 1
                continue
            cut = finish == "length" and i == len(calls) - 1
            end = "" if cut else tokenizer.tool_call_end or ""
            text += f"{tokenizer.tool_call_start}{function.text}{end}"
        return text, parsed

    def _finish(self, finish: str) -> str:
        """The reply's finish reason, of mlx-lm's (see `generate_response`)."""
        if finish == "length" and self._job is not None and self._job.flushed_stop:
            finish = "stop"
        if finish in ("stop", "tool_calls"):
            return "tool_calls" if self._calls else "stop"
        return finish

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        return self._to_messages(self._add_mtp(response))

    def _to_messages(self, chunk: dict) -> dict:
        """``chunk``, also added to the Messages or Responses reply being made, if
        any."""
        if self._messages is not None:
            self._messages.add(chunk)
        return chunk

    def _add_mtp(self, response: dict) -> dict:
        job = self._job
        if job is None or job.responses.ctx is None or job.mtp is None:
            return response
        response["mtp"] = mtp_block(job.mtp, job.batch_sizes)
        return response


class _Unsent:
    """Where mlx-lm's handler writes a Messages or Responses request's chat reply:
    nowhere (that reply is made of its chunks, `MTPHandler._to_messages`)."""

    def write(self, data) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def mtp_block(stats, batch_sizes: Optional[Dict[int, int]] = None) -> dict:
    """The ``mtp`` block of a response: what was drafted and accepted, and the
    rounds it ran at each batch size (``batch_sizes``; default: all alone)."""
    if batch_sizes is None:
        batch_sizes = {1: stats.rounds}
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
        "batch_sizes": dict(batch_sizes),
    }


def _api_under(path: str):
    """The API whose requests a path is under, translated to chat requests
    (`anthropic_api`, `responses_api`), or None (OpenAI's chat and completions)."""
    if anthropic_api.under_messages(path):
        return anthropic_api
    if responses_api.under_responses(path):
        return responses_api
    return None

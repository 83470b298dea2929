"""``mlx-mtp serve``: mlx-lm's OpenAI-compatible server, decoding with MTP.

mlx-lm's server (`mlx_lm.server`) is reused for everything around decoding: request
parsing and validation, chat templates with tools and ``chat_template_kwargs``, the
text state machine that splits reasoning and tool-call text, mlx-lm's tool parsers,
server-sent events, ``usage``. What a reply holds is this server's
(`mlx_mtp.replies`): stop strings matched on the text, tool text that does not parse
returned as content, valid JSON only. The parts are in `mlx_mtp.serving`, one job
each: the served model (`MTPModelProvider`), the generation thread
(`MTPResponseGenerator`: the requests in flight decode together with MTP, its
`Scheduler` admitting them within ``max_batch`` rows and the cache memory), the kept
conversations (`Sessions`), a request's HTTP side (`MTPHandler`) and the bounds
around it (`mlx_mtp.serving.http_guard`). This module puts them together: `Server`,
its arguments (`server_args`), and the check of mlx-lm's private surface.

What the server keeps of a request is its own (`mlx_mtp.serving.jobs.Job`, carried by
subclasses of mlx-lm's request and argument dataclasses with declared fields).
mlx-lm's server has no public hooks for the rest: the private members the parts
override or call are listed in `MLX_LM_PRIVATE`, with the parameters they must have,
and checked at import (`check_mlx_lm`), so that an mlx-lm of another release fails
at start in one line.

A failure costs only the requests it touched, and the server serves the next one;
SIGINT and SIGTERM stop generation within a round, end open streams with ``[DONE]``
and answer a request not started (its grammar still compiling included) with a 503
(`Server.serve_forever`). With API keys, each key's prompt caches are its own.
"""

import argparse
import gc
import hashlib
import os
import signal
import threading
from typing import Optional

from mlx_lm import server as lm_server

from . import session_files
from .defaults import DEFAULT_MAX_BATCH, SERVER_MAX_TOKENS
from .errors import MTPError
from .options import DecodeOptions
from .private import check_private
from .responses_api import Kept
from .server_checks import check_origins, prompt_bytes_per_token
from .serving.budget import default_budget
from .serving.generator import MTPResponseGenerator
from .serving.handler import MTPHandler, mtp_block
from .serving.http_guard import Connections, HTTPServer, api_keys, env_keys
from .serving.provider import DEFAULT_MODEL, MTPModelProvider
from .serving.sessions import DiskTier, Sessions

# --- what the server needs of mlx-lm's server -----------------------------------------

# The private members of `mlx_lm.server` that `mlx_mtp.serving` overrides or calls,
# each with its parameters (as a def spells them): mlx-lm's server offers no public
# hook for these. `check_mlx_lm` compares them at import; pyproject.toml pins the
# mlx-lm releases whose server behaves as the server expects (0.32.0's `_tokenize`
# and `_serve_single` have these parameters, but another body).
MLX_LM_PRIVATE = (
    # the generation thread's loop: supervised (`MTPResponseGenerator._generate`)
    ("ResponseGenerator._generate", "self"),
    # how the loop takes the next request: overridden, to mark it taken
    ("ResponseGenerator._next_request", "self, timeout=None"),
    # the prompt's tokens (a tuple: prompt first, the initial state fourth):
    # overridden for the context check, and called by the loop
    ("ResponseGenerator._tokenize", "self, tokenizer, request, args"),
    # the stop sequences and text state machine, cached: called by the loop, and
    # overridden to leave stop words out (`Replies` matches them on the text)
    ("ResponseGenerator._make_state_machine", "self, model_key, tokenizer, stop_words"),
    # the CORS headers of every reply: overridden (`MTPHandler._set_cors_headers`)
    ("APIHandler._set_cors_headers", "self"),
)


def check_mlx_lm(server=lm_server) -> None:
    """Refuse, in one `MTPError` line, an mlx-lm whose ``server`` module lacks one of
    `MLX_LM_PRIVATE` or has it with other parameters."""
    check_private(
        server,
        MLX_LM_PRIVATE,
        "mlx_lm.server",
        "mlx-mtp serve needs mlx-lm 0.32.x (0.32.2 or later)",
    )


check_mlx_lm()

CLOSE_WAIT = 2.0  # seconds `Server.close` then waits for connections to be handled

# --- the server ----------------------------------------------------------------------


# The decode options `server_args` takes, as the server's defaults (a request may set
# its sampling, drafting and max_tokens fields, `request_options`); any other is
# `DecodeOptions`' default.
SERVER_DECODE = (
    "num_draft_tokens",
    "max_draft_tokens",
    "draft_source",
    "lookup_tokens",
    "draft_vocab",
    "temp",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "prefill_step_size",
)


def server_args(**options) -> argparse.Namespace:
    """The namespace mlx-lm's server pieces read, from `serve`'s options: the server's
    `SERVER_DECODE` options as ``decode``, a checked `DecodeOptions` (an `MTPError`
    naming a bad one), and the rest as they are."""
    defaults = dict(
        model=None,
        draft_model=None,
        adapter_path=None,
        host="127.0.0.1",
        port=8080,
        allowed_origins=[],  # besides pages of this machine (`local_origin`)
        trust_remote_code=False,
        force=False,  # load weights larger than the memory MLX can use here
        chat_template="",
        use_default_chat_template=False,
        max_tokens_limit=32768,
        max_body_bytes=8 << 20,
        request_timeout=30.0,  # seconds for a request to arrive, and idle in a reply
        max_connections=128,
        chat_template_args={},
        max_batch=DEFAULT_MAX_BATCH,  # requests decoded together at most
        batch_cache_bytes=None,  # their caches' memory (None: `default_budget`)
        prompt_cache_size=8,
        prompt_cache_bytes=None,
        prompt_cache_dir=None,  # kept sessions on disk too (`DiskTier`)
        prompt_cache_disk_bytes=10 * 10**9,
        allow_missing_heads=False,
        pipeline=False,
        api_key=env_keys(),  # a key, or a list of keys (one per client)
    )
    decode = {k: options.pop(k) for k in SERVER_DECODE if k in options}
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"unknown server options: {', '.join(sorted(unknown))}")
    args = argparse.Namespace(**{**defaults, **options})
    args.api_key = api_keys(args.api_key)
    _check_batch_bounds(args.max_batch, args.batch_cache_bytes)
    args.decode = DecodeOptions(max_tokens=SERVER_MAX_TOKENS).replace(**decode)
    _for_mlx_lm(args)
    return args


def _check_batch_bounds(max_batch, cache_bytes) -> None:
    """Refuse, in one `MTPError` line, a ``max_batch`` or ``batch_cache_bytes`` that
    is not a whole number >= 1 (None: the default budget)."""
    for name, value in (("max_batch", max_batch), ("batch_cache_bytes", cache_bytes)):
        if value is None and name == "batch_cache_bytes":
            continue
        if type(value) is not int or value < 1:
            raise MTPError(f"{name} must be a whole number >= 1, got {value!r}")


def _for_mlx_lm(args: argparse.Namespace) -> None:
    """The names mlx-lm's server reads from the namespace, from ``args.decode``: its
    handler the defaults of a request's sampling fields and max_tokens, and its own
    ``num_draft_tokens``, an integer it checks (0: this server's is the decode
    options'); its batch the prompt's chunk size."""
    decode = args.decode
    args.temp, args.top_p, args.top_k = decode.temp, decode.top_p, decode.top_k
    args.min_p, args.max_tokens = decode.min_p, decode.max_tokens
    args.prefill_step_size, args.num_draft_tokens = decode.prefill_step_size, 0


class Server:
    """An `mlx-mtp serve` server; `start` runs it in a thread (tests, scripts),
    `serve_forever` in the caller's."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        origins = check_origins(args.allowed_origins)  # before the model loads
        provider = MTPModelProvider(args)
        provider.load(DEFAULT_MODEL)  # load errors now, before binding
        self.generator = None
        self.httpd = HTTPServer(
            (args.host, args.port), self._handler(), origins, args.max_connections
        )
        self.httpd.bytes_per_token = prompt_bytes_per_token(provider.tokenizer)
        self.httpd.context = getattr(
            provider.model.args, "max_position_embeddings", None
        )
        kept = args.prompt_cache_bytes
        if kept is None:  # a quarter of what the weights leave (`default_budget`)
            kept = default_budget(provider.model) // 2
        sessions = Sessions(args.prompt_cache_size, kept, _disk_tier(args, provider))
        self.generator = MTPResponseGenerator(provider, sessions)
        self.port = self.httpd.server_address[1]
        self._thread = None

    def _handler(self):
        fingerprint = lm_server.get_system_fingerprint()
        self._connections = Connections()
        self.kept = Kept()  # responses kept for previous_response_id

        def make(*a, **kw):  # handles the connection, in its thread
            with self._connections:
                MTPHandler(
                    self.generator,
                    *a,
                    system_fingerprint=fingerprint,
                    kept=self.kept,
                    **kw,
                )

        return make

    @property
    def url(self) -> str:
        host = self.args.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> Optional[int]:
        """Serve in the caller's thread until SIGINT or SIGTERM (caught when called
        from the main thread), then `close`; returns the signal, or None when
        another thread closed the server. A second signal while closing quits the
        process at once and quietly, with exit status 128 + the signal (130 for
        Ctrl-C)."""
        caught = []

        def on_signal(signum, frame):
            if caught:
                os._exit(128 + signum)
            caught.append(signum)
            raise _Stopped

        previous = _catch_signals(on_signal)
        try:
            self.httpd.serve_forever()
        except _Stopped:
            pass
        finally:
            try:
                self.close()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)
        return caught[0] if caught else None

    def close(self) -> None:
        """Stop accepting connections, stop generation within a round, end the open
        replies cleanly and join the generation thread
        (`MTPResponseGenerator.shutdown`); connections still handled then are waited
        for `CLOSE_WAIT` seconds at most. Idempotent."""
        if self._thread is not None:
            self.httpd.shutdown()  # the accept loop of `start`
        self.httpd.socket.close()  # not server_close: it waits for idle connections
        self.generator.shutdown()
        self.generator.sessions.flush()  # to the disk tier, for the next start
        # The connections handled (their replies are over), what their requests
        # left in reference cycles is freed now, in this thread: a connection's
        # thread still freeing MLX arrays at the interpreter's exit, or a collection
        # of them then, can abort the process ("terminate called without an active
        # exception").
        self._connections.wait(CLOSE_WAIT)
        gc.collect()


def _disk_tier(args, provider) -> Optional[DiskTier]:
    """The kept sessions' disk tier, in ``--prompt-cache-dir`` (None without one):
    a folder per model, each session tagged with a hash of its API key."""
    if args.prompt_cache_dir is None:
        return None
    keys = list(args.api_key or ())

    def tag(owner) -> str:
        if owner is None:
            return "-"
        return hashlib.sha256(keys[owner].encode()).hexdigest()[:16]

    key = session_files.model_key(provider.model)
    return DiskTier(args.prompt_cache_dir, args.prompt_cache_disk_bytes, key, tag)


class _Stopped(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM, to stop serving."""


def _catch_signals(handler) -> dict:
    """Install ``handler`` for SIGINT and SIGTERM (from the main thread only: none
    elsewhere); returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        old = signal.signal(signum, handler)
        previous[signum] = signal.SIG_DFL if old is None else old
    return previous


__all__ = ["Server", "Sessions", "server_args", "mtp_block"]

"""``mlx-mtp serve``: mlx-lm's OpenAI-compatible server, decoding with MTP.

mlx-lm's server (`mlx_lm.server`) is reused for everything around decoding: request
parsing and validation, chat templates with tools and ``chat_template_kwargs``, the
text state machine that splits reasoning and tool-call text, mlx-lm's tool parsers,
server-sent events, ``usage``. What a reply holds is this server's
(`mlx_mtp.replies`): stop strings matched on the text, tool text that does not parse
returned as content, valid JSON only. Three subclasses change what MTP needs:

- `MTPModelProvider` loads with `mlx_mtp.load` (heads, or a Gemma 4 assistant) and
  serves that one model only: a request never makes the server load another path;
- `MTPResponseGenerator` decodes the requests in flight together, with MTP: one
  scheduler loop (`_Scheduler`) over a `mlx_mtp.batch.Batch`, which a request
  joins between rounds (its prompt prefilled a chunk per round) and leaves when it
  is done, each row going on from the `Session` of an earlier conversation when the
  prompt extends its tokens (`Sessions`, an LRU bounded in count and bytes); at most
  ``max_batch`` rows, and only as many as the cache memory allows (`CacheCost`). A
  model whose caches cannot batch (`mlx_mtp.batch_cache.batch_support`) serves its
  requests one at a time through the single-stream loop
  (`mlx_mtp.generate.stream_generate`);
- `MTPHandler` adds bearer-token checks, checks that keep web pages out (Origin,
  Host, Content-Type), bounds on bodies, time and connections (with `_HTTPServer`),
  the checks of `server_checks` (sampling settings, the messages' shape: no image
  is taken, no URL fetched), OpenAI-style error bodies with the right status codes,
  one `DecodeOptions` per request (the server's, then the request's fields:
  ``num_draft_tokens`` as an int or "auto", ``draft_source``, ``draft_vocab``,
  sampling), refusals of options the MTP loop does not implement, and an ``mtp``
  block with the statistics.

What the server keeps of a request is its own (`_Job`, carried by subclasses of
mlx-lm's request and argument dataclasses with declared fields). mlx-lm's server has
no public hooks for the rest: the private members it overrides or calls are listed in
`MLX_LM_PRIVATE`, with the parameters they must have, and checked at import
(`check_mlx_lm`), so that an mlx-lm of another release fails at start in one line.

A client that goes away stops its generation within a round (the request's context
is stopped: by mlx-lm's handler when a stream's write fails, and by the handler
waiting for a reply, which watches the connection, `_hung_up`; the loop checks it
after every round, and its row leaves the batch), and the session it used is left
consistent. A failure costs only the requests it touched, and the server serves
the next one; SIGINT and SIGTERM stop generation within a round, end open streams
with ``[DONE]`` and answer a request not started (its grammar still compiling
included) with a 503 (`Server.serve_forever`). With API keys, each key's prompt
caches are its own.
"""

import argparse
import dataclasses
import gc
import inspect
import io
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm import server as lm_server
from mlx_lm.generate import generation_stream, wired_limit

from . import anthropic_api, draft_vocab
from .batch import (
    Admission,
    Batch,
    Row,
    RowOutput,
    prefill_groups,
    prefill_together,
    warm_batch_costs,
)
from .batch_cache import batch_support
from .cache import batch_cost, make_caches
from .defaults import DEFAULT_MAX_BATCH, MAX_DRAFT_TOKENS, SERVER_MAX_TOKENS
from .draft_length import model_costs
from .errors import MTPError, one_line
from .generate import fit_context, stream_generate
from .grammar import GrammarError, check_grammar
from .loading import load
from .options import DecodeOptions
from .replies import StopText, Unparsed, checked_parser, finite
from .resolve import caches_without_rollback, draft_vocabs, drafting
from .sampling import SamplingError
from .server_checks import (
    MAX_DEPTH,
    RequestError,
    bad_request,
    check_chat_fields,
    check_json,
    check_origins,
    check_sampling,
    host_allowed,
    key_owner,
    local_origin,
    prompt_bytes_per_token,
    request_options,
    sampling_request_error,
    tool_choice,
)
from .speculative import Session, prefill
from .stats import MTPStats

log = logging.getLogger("mlx_mtp")

# --- what this module needs of mlx-lm's server ---------------------------------------

# The private members of `mlx_lm.server` this module overrides or calls, each with
# its parameters (as a def spells them): mlx-lm's server offers no public hook for
# these. `check_mlx_lm` compares them at import; pyproject.toml pins the mlx-lm
# releases whose server behaves as this module expects (0.32.0's `_tokenize` and
# `_serve_single` have these parameters, but another body).
MLX_LM_PRIVATE = (
    # the generation thread's loop: supervised (`MTPResponseGenerator._generate`)
    ("ResponseGenerator._generate", "self"),
    # how the loop takes the next request: overridden, to mark it taken
    ("ResponseGenerator._next_request", "self, timeout=None"),
    # the prompt's tokens (a tuple: prompt first, the initial state fourth):
    # overridden for the context check, and called by the loop
    ("ResponseGenerator._tokenize", "self, tokenizer, request, args"),
    # the stop sequences and text state machine, cached: called by the loop, and
    # overridden to leave stop words out (`_Replies` matches them on the text)
    ("ResponseGenerator._make_state_machine", "self, model_key, tokenizer, stop_words"),
    # the CORS headers of every reply: overridden (`MTPHandler._set_cors_headers`)
    ("APIHandler._set_cors_headers", "self"),
)


def _parameters(fn) -> str:
    """``fn``'s parameters as a def spells them, annotations left out."""
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    spelled = []
    for p in inspect.signature(fn).parameters.values():
        default = "" if p.default is p.empty else f"={p.default!r}"
        spelled.append(f"{stars.get(p.kind, '')}{p.name}{default}")
    return ", ".join(spelled)


def check_mlx_lm(server=lm_server) -> None:
    """Refuse, in one `MTPError` line, an mlx-lm whose ``server`` module lacks one of
    `MLX_LM_PRIVATE` or has it with other parameters."""
    version = getattr(mlx_lm, "__version__", "?")
    for name, expected in MLX_LM_PRIVATE:
        member = server
        for part in name.split("."):
            member = getattr(member, part, None)
        try:
            found = _parameters(member) if callable(member) else None
        except (TypeError, ValueError):  # no signature to read
            found = None
        if found == expected:
            continue
        change = (
            "is gone"
            if found is None
            else f"has changed (its parameters are ({found}), not ({expected}))"
        )
        raise MTPError(
            f"mlx-mtp serve needs mlx-lm 0.32.x (0.32.2 or later): "
            f"mlx_lm.server.{name} {change} in the installed mlx-lm {version}"
        )


check_mlx_lm()

API_KEY_ENV = "MLX_MTP_API_KEY"
DEFAULT_MODEL = "default_model"  # mlx-lm's name for the served model
# Request fields of mlx_lm.server whose features the MTP loop does not implement:
# refused when set to anything but their neutral value.
UNSUPPORTED = {
    "xtc_probability": (0, 0.0),
    "adapters": (),
    "draft_model": (),
    "n": (1,),
}


# --- sessions ------------------------------------------------------------------------


class Sessions:
    """Conversations whose caches can be gone on from: an LRU of `Session`s, at most
    ``size`` of them and ``max_bytes`` of memory, each counted at what it holds
    (`Session.nbytes`: every array, at its buffer's size; its pending computation
    is started when it is put, so that it soon holds nothing else). A session
    larger than ``max_bytes`` alone is not kept.

    `take` hands out (and removes) the session whose tokens the prompt extends, the
    longest such that drafts with the MTP depth asked for; `put` returns a session
    after a generation. A session is used by one generation at a time, so no two
    requests share caches. Each session belongs to an ``owner`` (the API key its
    requests presented; None without keys) and is handed out to that owner's
    requests only.
    """

    def __init__(self, size: int = 8, max_bytes: Optional[int] = None):
        self.size, self.max_bytes = size, max_bytes
        self._items: "OrderedDict[tuple, Session]" = OrderedDict()  # (owner, id)
        self._sizes: Dict[tuple, int] = {}  # their `Session.nbytes`, as put
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def take(
        self, prompt: List[int], owner=None, depth: Optional[int] = None
    ) -> Optional[Session]:
        """The longest kept session of ``owner`` whose tokens ``prompt`` extends and
        whose caches hold ``depth`` MTP layers (None: any depth; a session of
        another depth cannot go on with this one's drafts), removed; None if none."""
        with self._lock:
            best, best_len = None, 0
            for key, s in self._items.items():
                if key[0] != owner or depth not in (None, s.state.depth):
                    continue
                tokens = s.tokens
                n = len(tokens)
                if best_len < n < len(prompt) and prompt[:n] == tokens:
                    best, best_len = key, n
            if best is None:
                return None
            del self._sizes[best]
            return self._items.pop(best)

    def put(self, session: Session, owner=None) -> None:
        """Keep ``session`` (the generation thread's, which evaluates its arrays),
        the least recently kept ones dropped to stay within the bounds."""
        if session.state is None:
            return
        arrays = session.arrays()
        mx.async_eval(arrays)  # once computed, an array holds no other buffer
        size = sum(a.nbytes for a in arrays)
        if self.max_bytes is not None and size > self.max_bytes:
            return
        with self._lock:
            key = owner, id(session)
            self._items[key], self._sizes[key] = session, size
            while len(self._items) > self.size or (
                self.max_bytes is not None
                and sum(self._sizes.values()) > self.max_bytes
            ):
                dropped, _ = self._items.popitem(last=False)
                del self._sizes[dropped]

    @property
    def nbytes(self) -> int:
        """The bytes the kept sessions hold."""
        with self._lock:
            return sum(self._sizes.values())

    def clear(self) -> None:
        """Drop every kept session."""
        with self._lock:
            self._items.clear()
            self._sizes.clear()


# --- model provider ------------------------------------------------------------------


class MTPModelProvider(lm_server.ModelProvider):
    """Loads the one served model with `mlx_mtp.load`; any other name is refused."""

    def __init__(self, cli_args: argparse.Namespace):
        super().__init__(cli_args)
        self.served = model_id(cli_args.model)
        self.aliases = {DEFAULT_MODEL, self.served, cli_args.model}

    def _load_served(self) -> None:
        """Load the served model, and what its requests decode with (the draft
        vocabulary's ranking, the round costs, alone and batched), before serving,
        not in a request."""
        self.reset()
        args = self.cli_args
        tokenizer_config = {"trust_remote_code": args.trust_remote_code}
        if args.chat_template:
            tokenizer_config["chat_template"] = args.chat_template
        model, tokenizer = load(
            args.model,
            allow_missing_heads=args.allow_missing_heads,
            draft_model=args.draft_model,
            trust_remote_code=args.trust_remote_code,
            tokenizer_config=tokenizer_config,
        )
        if draft_vocab.wants_ranking(model):
            draft_vocab.ranking_for(model, tokenizer)
        warm_costs(model, args.decode)
        warm_costs_batched(model, args.max_batch)
        if args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (args.model, None, args.draft_model)
        self.model, self.tokenizer = model, tokenizer
        self.processor = None
        self.draft_model = None

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """The served model and its tokenizer, loaded on first need: by `Server`
        before it serves, or by the generation loop as it starts (never by a
        request: see `held`); a 404 for any other name."""
        self.check_name(model_path)
        if self.model is None:
            self._load_served()
        return self.model, self.tokenizer

    def check_name(self, name: str) -> None:
        """A 404 unless ``name`` is one of the served model's names (`aliases`);
        nothing is loaded."""
        if name not in self.aliases:
            raise RequestError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.served!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )

    def held(self) -> "Served":
        """The served model and its tokenizer, as held now, for a request's checks;
        never loaded here: a 503 once the server closed (the generation loop
        dropped them as it ended)."""
        model, tokenizer = self.model, self.tokenizer
        if model is None or tokenizer is None:
            raise _shutting_down()
        return Served(model, tokenizer)


class Served(NamedTuple):
    """The served model and its tokenizer, as a request's checks hold them: the
    generation loop may drop the provider's meanwhile (`MTPModelProvider.held`)."""

    model: Any
    tokenizer: Any


def warm_costs(model, defaults: DecodeOptions) -> None:
    """Read, or measure once, every round cost a request may decode with ("auto" draft
    lengths and sources weigh them), before serving: else a request would time them
    on the generation thread, every other request waiting. That is a trunk pass over
    up to `MAX_DRAFT_TOKENS` + 1 tokens (a request may ask for any k) and a draft step
    from each draft vocabulary that "auto", "full" and the server's ``draft_vocab``
    (``defaults``) draft from; a request that would need another is refused
    (`times_costs`)."""
    if caches_without_rollback(model):
        return  # no request drafts (`mlx_mtp.resolve.lookup_source`)
    sizes = set()
    for value in {"auto", "full", defaults.draft_vocab} - {None}:
        vocabs, _ = draft_vocabs(model, value)
        sizes.update(n for n in vocabs if n is not None)
    model_costs(model, MAX_DRAFT_TOKENS, sorted(sizes), on_measure=_say_timing)


def warm_costs_batched(model, max_batch: int) -> None:
    """Read, or measure once, what batched rounds of up to ``max_batch`` rows cost
    (`mlx_mtp.batch.warm_batch_costs`: the draft length of a batch's "auto" rows
    weighs them), before serving; nothing for a model that cannot batch, or one
    row."""
    if max_batch > 1 and batch_support(model) is None:
        warm_batch_costs(model, max_batch, on_measure=_say_batch_timing)


def _say_batch_timing() -> None:
    sys.stderr.write(
        "timing the model's batched rounds (once for this model and machine)...\n"
    )
    sys.stderr.flush()


def _say_timing() -> None:
    sys.stderr.write(
        f"timing the model's rounds for up to {MAX_DRAFT_TOKENS} drafts (once for "
        "this model and machine)...\n"
    )
    sys.stderr.flush()


def times_costs(model, options: DecodeOptions) -> bool:
    """Whether decoding with ``options`` would time round costs that `warm_costs` did
    not: an "auto" draft length or source weighing a number of draft tokens
    (``draft_vocab``) whose draft step was not measured, with native heads that draft
    from any rows (heads trained on their own rows refuse a number, in the loop)."""
    n, k = options.draft_vocab, options.num_draft_tokens
    weighs = k == "auto" or (options.draft_source == "auto" and k != 0)
    costs = model.round_costs
    return (
        weighs
        and isinstance(n, int)
        and n < model.args.vocab_size
        and model.num_mtp_layers > 0
        and model.assistant is None
        and "draft_vocab" not in model.mtp
        and (costs is None or n not in costs.drafts)
    )


def model_id(path: str) -> str:
    """The id `/v1/models` lists for the served model: a hub id as given, a local
    folder by its absolute path."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


# --- generation ----------------------------------------------------------------------

SHUTDOWN_WAIT = 10.0  # seconds `MTPResponseGenerator.shutdown` waits for open replies
CLOSE_WAIT = 2.0  # seconds `Server.close` then waits for connections to be handled
WATCH_EVERY = 0.05  # seconds between looks at a waiting request's client and server


def _shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", "server_error")


def _client_gone() -> RequestError:
    """A request whose client went away: nobody reads its reply."""
    return RequestError(499, "the client closed its connection", "client_gone")


def _as_request_error(e: Exception) -> RequestError:
    """A request's failure as its error reply: a `RequestError` as it is, any other
    a 500."""
    if isinstance(e, RequestError):
        return e
    return RequestError(500, one_line(e), "server_error")


def _options_error(e: MTPError) -> RequestError:
    """A request's decode options refused by the loop, as its 400."""
    if isinstance(e, SamplingError):
        return sampling_request_error(e)
    return bad_request(one_line(e))


class _Responses(Queue):
    """One request's response queue, which knows its request: ``ctx`` once the
    generation put it, ``taken`` once the generation loop took the request,
    ``ended`` once None (the end) or an exception was put (nothing is put after; a
    context put after is stopped at once), and ``left``, whether its client went away
    (the handler's look at its connection; `watch`)."""

    def __init__(self):
        super().__init__()
        self.ctx, self.taken, self.ended = None, False, False
        self.left: Callable[[], bool] = lambda: False
        self._guard = threading.Lock()

    def put(self, item, block=True, timeout=None):
        with self._guard:
            if self.ended:
                if isinstance(item, lm_server.GenerationContext):
                    item.stop()  # the request ended before it started
                return
            if isinstance(item, lm_server.GenerationContext):
                self.ctx = item
            self.ended = item is None or isinstance(item, BaseException)
            super().put(item, block, timeout)

    def fail(self, error: BaseException) -> None:
        """End the request with ``error`` and stop its generation."""
        self.put(error)
        if self.ctx is not None:
            self.ctx.stop()

    def watch(self) -> None:
        """End the request once its client went away (``left``): its generation
        stops within a round, as when a stream's client goes (its row leaves the
        batch), or before it starts."""
        if not self.ended and self.left():
            self.fail(_client_gone())


@dataclass
class _Job:
    """One request, as the server keeps it from its checks to the end of its reply:
    its decode options (the server's, then the request's fields; checked), its
    ``owner`` (the index of the API key it presented; None without keys), whether its
    reply streams, and its ``responses``. Once it decodes: ``mtp``, the loop's
    statistics (a snapshot, taken before its reply's last token is put), and
    ``batch_sizes``, the rounds it ran at each batch size (None: alone).

    Its reply's ``stops`` (its stop strings) are matched on the text (`_Replies`):
    ``stop_sequence`` is the one that ended the reply, if one did, and
    ``flushed_stop`` says that the reply ended by a stop (a stop string, or EOS
    after text held back as the possible start of one) although mlx-lm's handler
    was told "length", so that it sends every character before the stop."""

    options: DecodeOptions
    owner: Optional[int] = None
    stream: bool = False
    responses: _Responses = field(default_factory=_Responses)
    mtp: Optional[MTPStats] = None
    batch_sizes: Optional[Dict[int, int]] = None
    stops: Tuple[str, ...] = ()
    stop_sequence: Optional[str] = None
    flushed_stop: bool = False


@dataclass
class _Request(lm_server.CompletionRequest):
    """mlx-lm's request, carrying the server's record of it from `MTPHandler` to
    `MTPResponseGenerator.generate`."""

    job: Optional[_Job] = None


@dataclass
class _JobArgs(lm_server.GenerationArguments):
    """mlx-lm's generation arguments of a request, carrying the server's record of it
    from `MTPResponseGenerator.generate` to the generation loop."""

    job: Optional[_Job] = None


def _with_job(value, cls, job: _Job):
    """``value``, an instance of mlx-lm's dataclass that ``cls`` extends, as a
    ``cls`` carrying ``job``."""
    return cls(**{f.name: getattr(value, f.name) for f in fields(value)}, job=job)


@dataclass
class _Context(lm_server.GenerationContext):
    """mlx-lm's context of a request the MTP loop serves; ``stopped`` once `stop` was
    called (by mlx-lm's handler when the reply ends, so early when the client went
    away, and by a failure or `MTPResponseGenerator.shutdown`). Its tool parser is
    `mlx_mtp.replies.checked_parser`'s: tool text it cannot parse is returned as
    content (`MTPHandler.generate_response`), never a failure of the reply."""

    stopped: bool = False

    def __post_init__(self):
        self.tool_parser = checked_parser(self.tool_parser)

    def stop(self):
        super().stop()
        self.stopped = True


class _Refusal(BaseException):
    """A request's failure, for `MTPHandler` to answer in OpenAI's form: raised
    through mlx-lm's handler, which catches Exception only, and so writes nothing of
    its own after it. ``streaming``: the reply's stream had started."""

    def __init__(self, error: RequestError, streaming: bool = False):
        super().__init__(str(error))
        self.error, self.streaming = error, streaming


class _Replies:
    """The responses of a request whose reply started, as an iterator, prompt
    progress left out: until None, or an exception put, which it raises.

    The job's stop strings are matched on the text, as OpenAI and Anthropic do
    (`StopText`): a response's text leaves out what could begin a stop string until
    the next says; at a stop string the reply ends there (its generation is
    stopped, what it still puts is dropped) and the job records which. mlx-lm's
    handler drops the text of a response that ends "stop" (the EOS token's); a
    reply that ends by a stop after text held back or cut before a stop string ends
    "length" instead, so that the handler sends that text, and the job says it is a
    stop (``flushed_stop``)."""

    def __init__(self, generator: "MTPResponseGenerator", job: _Job):
        self._generator, self._job, self._responses = generator, job, job.responses
        self._text = StopText(job.stops)
        self._over = False  # stopped at a stop string: the rest is dropped

    def __iter__(self):
        return self

    def __next__(self):
        if self._over:
            self._drain()
            raise StopIteration
        while True:
            response = self._generator._wait(self._responses)
            if response is None:
                raise StopIteration
            if isinstance(response, Exception):
                raise response
            if not isinstance(response, tuple):  # prompt progress
                return self._cut(response)

    def _cut(self, response):
        """``response`` with its text as `StopText` lets it be sent."""
        text, finish = self._text.add(response.text), response.finish_reason
        if self._text.stop is not None:
            self._over = True
            self._responses.ctx.stop()  # its generation stops within a round
            self._job.stop_sequence = self._text.stop
            self._job.flushed_stop, finish = True, "length"
        elif finish == "length":
            text += self._text.flush()
        elif finish == "stop":  # EOS: no text of its own
            text = self._text.flush()
            if text:
                self._job.flushed_stop, finish = True, "length"
        return dataclasses.replace(response, text=text, finish_reason=finish)

    def _drain(self) -> None:
        """What the generation puts after the stop, until its end."""
        while True:
            response = self._generator._wait(self._responses)
            if response is None or isinstance(response, BaseException):
                return


def _streamed(replies: _Replies):
    """A stream's responses; a failure mid-stream raised as a `_Refusal`."""
    try:
        yield from replies
    except Exception as e:
        log.info("request failed mid-reply: %s", one_line(e))
        raise _Refusal(_as_request_error(e), streaming=True) from None


def _top_logprobs(logprobs: mx.array, n: int, tokenizer) -> tuple:
    """The ``n`` likeliest tokens of ``logprobs`` as mlx-lm's handler reports them,
    ``{"id", "token", "logprob"}`` each, likeliest first; none for n <= 0. Tokens
    that cannot be drawn (a logprob of -inf: masked by a grammar) are left out, as
    OpenAI lists only candidates: there may be fewer than ``n``."""
    if n <= 0:
        return ()
    ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
    ids = ids[mx.argsort(-logprobs[ids])]
    pairs = [(i, v) for i, v in zip(ids.tolist(), logprobs[ids].tolist())]
    pairs = [(i, v) for i, v in pairs if math.isfinite(v)]
    tokens = tokenizer.convert_ids_to_tokens([i for i, _ in pairs])
    return tuple(
        {"id": i, "token": t, "logprob": v} for (i, v), t in zip(pairs, tokens)
    )


# --- the batch's memory --------------------------------------------------------------


@dataclass(frozen=True)
class CacheCost:
    """The bytes a batch's caches take: ``per_token`` for each position a row holds
    in the full attention caches (the trunk's and the MTP layers'), ``windows`` the
    bytes per position and the most positions a row keeps of each sliding-window
    cache, and ``per_row`` a row's recurrent states and the room its caches leave
    for rejected drafts (`COMPACT_SLACK` positions)."""

    per_token: float
    windows: Tuple[Tuple[float, int], ...]
    per_row: float

    def bytes(self, positions: Sequence[int]) -> int:
        """The caches of a batch whose rows hold ``positions[b]`` positions: every
        row is as wide as the longest (the caches keep rows left-padded)."""
        if not positions:
            return 0
        longest = max(positions)
        row = longest * self.per_token + self.per_row
        row += sum(size * min(longest, n) for size, n in self.windows)
        return int(len(positions) * row)


def cache_cost(model, depth: int) -> CacheCost:
    """The `CacheCost` of ``model``'s batches (``depth`` MTP layers in use), read off
    its caches after a prefill of a few tokens (each cache's ``cost``, the cache
    protocol of `mlx_mtp.cache`)."""
    caches = make_caches(model)
    prefill(model, caches, [0] * (depth + 2), depth, 256)
    return CacheCost(*batch_cost(caches.trunk + caches.mtp))


def device_memory() -> int:
    """The bytes MLX may use: Metal's recommended working set, else the RAM."""
    info = getattr(mx, "device_info", None) or mx.metal.device_info
    try:
        found = info()
    except RuntimeError:  # no Metal
        found = {}
    size = found.get("max_recommended_working_set_size") or found.get("memory_size")
    return int(size or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget(model) -> int:
    """The cache memory of the batch unless ``batch_cache_bytes`` says: half of what
    `device_memory` leaves after the weights. Of the other half, the kept
    conversations take up to half (`Server`'s default ``prompt_cache_bytes``); each
    is counted at its arrays' full size, the snapshot of a prompt's caches that a
    join keeps too (a full copy: `Session.snapshot`). The rest is for what the
    budgets do not count: an admission's caches while they are copied into the
    batch (the budget counts them once), and the rounds' activations."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return max(0, (device_memory() - weights) // 2)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


# --- the scheduler -------------------------------------------------------------------


@dataclass
class _Stream:
    """A request of the batched loop, from taken to the end of its reply: its queue
    and mlx-lm's arguments (which carry its `_Job`), its prompt, what makes its text
    (mlx-lm's cached stop sequences and text state machine; once it decodes, its own
    detokenizer and stop-sequence matcher), the cache positions it may hold
    (``positions``: its prompt and max_tokens), and its `Admission`, prompt tokens
    still to prefill (``left``), context and `Row` once it has them."""

    uid: int
    responses: _Responses
    args: _JobArgs
    prompt: List[int]
    initial_state: str
    stop_sequences: Any
    text_sm: Any
    positions: int
    admission: Optional[Admission] = None
    left: int = 0
    ctx: Optional[_Context] = None
    row: Optional[Row] = None
    detokenizer: Any = None
    matcher: Any = None

    @property
    def job(self) -> _Job:
        return self.args.job


class _Scheduler:
    """The batched decoding of the generation loop, in its thread only.

    A request taken (`take`) is tokenized and checked at once (the context; a 400
    when its prompt and max_tokens cannot fit in ``budget`` even alone), then waits,
    first come first served, until a row is free (``max_batch`` rows at most) and its
    positions fit in ``budget`` beside the others' (`CacheCost`). It is then
    prefilled alone (`Admission`), going on from the session of its conversation if
    `Sessions` keeps one: while rows decode, one chunk of prompt
    (``prefill_step_size`` tokens) per round at most, shared by prompts shorter than
    that; all at once while none does. Requests taken together whose prompts are
    about as long are prefilled together, in one padded pass (`prefill_groups`).
    Prefilled, it joins the `Batch` between rounds, and its reply starts. A round's
    tokens of a row go through the row's own detokenizer and stop sequences to its
    reply, as `MTPResponseGenerator._decode` does alone. A row leaves the batch when
    it is done, its stop sequence matched, its client went away or it failed; its
    caches then go to `Sessions` (not after a failure)."""

    def __init__(self, generator: "MTPResponseGenerator"):
        self.gen = generator
        provider, args = generator.model_provider, generator.cli_args
        self.model, self.tokenizer = provider.model, provider.tokenizer
        self.chunk, self.max_batch = args.decode.prefill_step_size, args.max_batch
        self.batch = self._new_batch()
        self.cost = cache_cost(self.model, self.batch.depth)
        self.budget = args.batch_cache_bytes or default_budget(self.model)
        self.waiting: deque = deque()  # of `_Stream`
        self.admitting: List[_Stream] = []
        self.rows: Dict[int, _Stream] = {}  # by uid, in the batch
        self._uids = itertools.count()

    def _new_batch(self) -> Batch:
        args = self.gen.cli_args
        return Batch(
            self.model,
            args.decode,
            keep_sessions=True,
            max_batch=args.max_batch,
            tokenizer=self.gen.model_provider.tokenizer,
        )

    def busy(self) -> bool:
        return bool(self.waiting or self.admitting or self.rows)

    def take(self, item) -> None:
        """A request from the generator's queue: waiting, or refused at once."""
        responses, request, args = item
        if responses.ended:  # its client went away while it was queued
            return
        try:
            self.waiting.append(self._open(responses, request, args))
        except Exception as e:  # this request's failure only
            _fail(responses, e)

    def _open(self, responses: _Responses, request, args: _JobArgs) -> _Stream:
        prompt, _, _, initial_state, _ = self.gen._tokenize(
            self.tokenizer, request, args
        )
        positions = len(prompt) + args.max_tokens
        need = self.cost.bytes([positions])
        if need > self.budget:
            raise bad_request(
                f"the request's {positions} tokens (its prompt and max_tokens) need "
                f"{_size(need)} of cache; this server decodes within "
                f"{_size(self.budget)} (--batch-cache-bytes): ask for fewer "
                "max_tokens, or send a shorter prompt",
                "max_tokens",
            )
        stop_sequences, text_sm = self.gen._make_state_machine(
            self.gen.model_provider.model_key, self.tokenizer, args.stop_words
        )
        uid = next(self._uids)
        return _Stream(
            uid,
            responses,
            args,
            prompt,
            initial_state,
            stop_sequences,
            text_sm,
            positions,
        )

    def round(self) -> None:
        """Admissions advanced (and joined once prefilled), then one round of the
        batch, each row's tokens put on its reply."""
        self._admit()
        if self.rows:
            self._step()

    # admission

    def _fits(self, s: _Stream) -> bool:
        held = [t.positions for t in self.admitting + list(self.rows.values())]
        if len(held) >= self.max_batch:
            return False
        return self.cost.bytes(held + [s.positions]) <= self.budget

    def _admit(self) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            self._start(self.waiting.popleft())
        done = self._prefill_together()  # prompt tokens prefilled this round
        for s in list(self.admitting):
            if self.rows and done >= self.chunk:
                break
            done += self._prefill(s, self.chunk - done if self.rows else None)
            if s.admission is not None and s.admission.ready:
                self._join(s)

    def _prefill_together(self) -> int:
        """Prefill the fresh admissions (not begun, no session) in groups
        (`prefill_groups`: prompts of about the same length, in one padded pass per
        chunk), those that fit in this round's chunk of prompt while rows decode,
        and join them; returns the prompt tokens that ran. A failure is the
        group's only."""
        by_admission = {id(s.admission): s for s in self.admitting}
        fresh = [s.admission for s in self.admitting if s.admission.fresh]
        done = 0
        for group in prefill_groups(fresh) if len(fresh) > 1 else []:
            tokens = sum(len(a.todo) for a in group)
            if len(group) < 2 or self.gen._closing:
                continue
            if self.rows and done + tokens > self.chunk:
                continue
            streams = [by_admission[id(a)] for a in group]
            try:
                prefill_together(group)
            except Exception as e:
                for s in streams:
                    self.admitting.remove(s)
                    s.admission = None
                    _fail(s.responses, e)
                continue
            done += tokens
            for s in streams:
                s.left = 0
                self._join(s)
        return done

    def _prefill(self, s: _Stream, room: Optional[int]) -> int:
        """Prefill ``s`` a chunk at a time while fewer than ``room`` prompt tokens
        ran (None: until it is done), and not past `shutdown`; returns the tokens
        that ran. A failure is ``s``'s only."""
        ran = 0
        while not s.admission.ready and (room is None or ran < room):
            if self.gen._closing:
                break
            try:
                s.admission.advance()
            except Exception as e:
                self.admitting.remove(s)
                s.admission = None
                _fail(s.responses, e)
                break
            chunk = min(self.chunk, s.left)
            ran, s.left = ran + chunk, s.left - chunk
        return ran

    def _start(self, s: _Stream) -> None:
        """Begin ``s``'s admission, from its conversation's session if one is kept
        (made by a batch: one of another loop is left in `Sessions`)."""
        sessions, owner = self.gen.sessions, s.job.owner
        session = sessions.take(s.prompt, owner, self.batch.depth)
        done = len(session.tokens) if session is not None else 0
        options = s.job.options.replace(max_tokens=s.args.max_tokens)
        try:
            s.admission = self.batch.admit(s.uid, s.prompt[done:], options, session)
        except MTPError as e:  # the request's options: refused before any prefill
            if session is not None:
                sessions.put(session, owner)
            return _fail(s.responses, _options_error(e))
        except Exception as e:
            return _fail(s.responses, e)
        tokenizer = self.tokenizer
        s.left = len(s.prompt) - done
        s.ctx = _Context(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=s.text_sm,
            initial_state=s.initial_state,
            prompt=s.prompt,
            prompt_cache_count=done,
        )
        self.admitting.append(s)

    def _join(self, s: _Stream) -> None:
        """``s``, prefilled, into the batch, and its reply started; its prompt's
        caches kept in `Sessions` too (for requests that start alike)."""
        self.admitting.remove(s)
        admission, s.admission = s.admission, None
        try:
            self.gen.sessions.put(admission.session.snapshot(), s.job.owner)
        except Exception as e:  # this request's failure only
            return _fail(s.responses, e)
        self.batch.eos = frozenset(self.tokenizer.eos_token_ids)  # as of now
        try:
            s.row = self.batch.join(admission)
        except Exception as e:  # its rules (a grammar): the batch is as it was
            return _fail(s.responses, _decoding_error(e))
        self.rows[s.uid] = s
        s.detokenizer = self.tokenizer.detokenizer  # its own: a copy per request
        s.detokenizer.reset()
        s.matcher = s.stop_sequences.matcher()
        s.responses.put(s.ctx)

    # decoding

    def _step(self) -> None:
        try:
            outputs = self.batch.step()
        except Exception as e:  # every row was in the round
            log.exception("a batched round failed")
            return self._reset(e)
        over, failed = [], []
        for out in outputs:
            s = self.rows[out.uid]
            if out.finish_reason == "error":  # its rules failed: it alone
                _fail(s.responses, _decoding_error(s.row.failure))
                failed.append(s)
                continue
            try:
                if self._emit(s, out):
                    over.append(s)
            except Exception as e:  # this request's failure only
                _fail(s.responses, e)
                failed.append(s)
        if over or failed:
            self._leave(over, failed)

    def _emit(self, s: _Stream, out: RowOutput) -> bool:
        """Put ``out``'s tokens on ``s``'s reply, as `MTPResponseGenerator._decode`
        does (an EOS adds no text; a stop sequence ends the reply at its last
        token). True once the reply is over (None put): it finished, or its client
        went away, or the server is closing."""
        args, detokenizer = s.args, s.detokenizer
        last = len(out.tokens) - 1
        for i, token in enumerate(out.tokens):
            finish = out.finish_reason if i == last else None
            if finish != "stop":  # "stop" from the batch: the EOS token
                detokenizer.add_token(token)
            if finish is not None:
                detokenizer.finalize()
            if s.matcher.advance(token):
                finish = "stop"
            logprob, top = 0.0, ()  # only when asked: .item() is a sync per token
            if args.logprobs:
                logprob = out.logprobs[i, token].item()
            if args.top_logprobs > 0:
                top = _top_logprobs(out.logprobs[i], args.top_logprobs, self.tokenizer)
            if finish is not None:
                self._record(s)
            response = lm_server.Response(
                detokenizer.last_segment, token, logprob, finish, top
            )
            s.responses.put(response)
            if finish is not None:
                break
        else:
            stopped = s.ctx.stopped or self.gen._closing
            if out.finish_reason is None and not stopped:
                return False
            self._record(s)
        s.responses.put(None)
        return True

    @staticmethod
    def _record(s: _Stream) -> None:
        """The statistics of ``s``'s reply so far, for its ``mtp`` block."""
        s.job.mtp = s.row.stats.snapshot()
        s.job.batch_sizes = dict(s.row.batch_sizes)

    def _leave(self, over: List[_Stream], failed: List[_Stream]) -> None:
        """The rows of ``over`` and ``failed`` out of the batch (those that did not
        leave it already), and the caches of ``over`` kept in `Sessions`."""
        self.batch.remove([s.uid for s in over + failed])
        for s in over + failed:
            del self.rows[s.uid]
        for s in over:
            if s.row.session is not None:
                self.gen.sessions.put(s.row.session, s.job.owner)

    def _reset(self, error: Exception) -> None:
        """After a failure that may have left the batch's caches inconsistent: the
        request of every row fails with ``error``, and a new batch takes over (the
        admissions go on: their caches are their own)."""
        for s in self.rows.values():
            _fail(s.responses, error)
        self.rows.clear()
        self.batch = self._new_batch()

    def close(self) -> None:
        """The loop ends (`MTPResponseGenerator.shutdown` ends the replies): the
        decoding requests' statistics recorded for their last chunk."""
        for s in self.rows.values():
            self._record(s)


def _decoding_error(e: BaseException) -> BaseException:
    """A request's failure while it decodes, as its error reply: a grammar the engine
    refused or failed on is the request's own (a 400: its grammar is past the
    engine's limits), anything else as it is (`_as_request_error`)."""
    if isinstance(e, GrammarError):
        return bad_request(one_line(e))
    return e


def _fail(responses: _Responses, error: Exception) -> None:
    """A request's failure: its reply gets ``error`` (logged unless a
    `RequestError`), and its generation stops."""
    if not isinstance(error, RequestError):
        log.error("a request failed", exc_info=error)
    responses.fail(error)


class MTPResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's generation thread, with a loop of its own (`_serve`): the requests
    in flight decode together with MTP (`_Scheduler`), or, for a model whose caches
    cannot batch (``cannot_batch``: why, logged once at start), one at a time
    through the single-stream loop; either way with `Sessions` for prompt reuse.

    A failure costs only the requests it touched: one request's goes to that
    request, a batched round's to the rows in it (`_Scheduler`, `_serve_one`); a
    failure of the loop itself goes to the requests it had taken, and the loop
    starts again (`_generate`). `shutdown` stops generation within a round and ends
    every open reply cleanly."""

    def __init__(self, model_provider: MTPModelProvider, sessions: Sessions):
        self.sessions = sessions
        self._lock = threading.Condition()
        self._live = set()  # the `_Responses` of requests whose reply is not over
        self._fresh = True
        self._closing = False  # `shutdown` was called
        self.scheduler: Optional[_Scheduler] = None
        self.cannot_batch = batch_support(model_provider.model)
        if self.cannot_batch is not None:
            log.warning("requests are decoded one at a time: %s", self.cannot_batch)
        super().__init__(model_provider, None)  # mlx-lm's prompt cache: not used

    # the loop, supervised

    def _generate(self):
        """The generation loop (`_serve`), supervised: when it raises, each request
        it had taken gets the error (its reply ends with it), the failure is logged
        once, and the loop starts again for the next requests. A loop that fails
        before taking any request, or while the server shuts down, is given up: the
        generation thread ends (``/health`` then says so)."""
        while True:
            self._fresh = True
            try:
                return self._serve()
            except Exception as e:
                log.exception("the generation loop failed; restarting it")
                self._fail_live(e, taken_only=True)
                if self._closing or self._fresh:
                    self._fail_live(e)
                    return

    def _fail_live(self, error: BaseException, taken_only=False) -> None:
        with self._lock:
            live = list(self._live)
        for responses in live:
            if responses.taken or not taken_only:
                responses.fail(error)

    def _serve(self) -> None:
        """Serve until `shutdown`; then the model is dropped in this thread (as
        mlx-lm's loop does: its arrays freed where they were made)."""
        self.model_provider.load_default()
        model = self.model_provider.model
        with wired_limit(model, [generation_stream]), mx.stream(generation_stream):
            self.scheduler = _Scheduler(self) if self.cannot_batch is None else None
            while not self._closing:
                self._turn()
        if self.scheduler is not None:
            self.scheduler.close()
        self.scheduler = None
        self.model_provider.reset()
        gc.collect()

    def _turn(self) -> None:
        """Take the requests queued (waiting a little for one while nothing is in
        flight), then decode a round; a request alone when the model cannot batch
        (once the batch is empty, if it had rows)."""
        scheduler = self.scheduler
        busy = scheduler is not None and scheduler.busy()
        request = self._next_request(timeout=None if busy else 0.1)
        if self.cannot_batch is not None and not busy:
            if request is not None:
                self._serve_one(request)
            return
        if scheduler is None:
            scheduler = self.scheduler = _Scheduler(self)
        while request is not None:
            scheduler.take(request)
            request = self._next_request()  # without waiting
        if scheduler.busy():
            scheduler.round()

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is not None:
            request[0].taken = True  # an `_Responses`: `generate` queued it
            self._fresh = False
        return request

    def _make_state_machine(self, model_key, tokenizer, stop_words):
        """mlx-lm's stop sequences (EOS) and text state machine, without
        ``stop_words``: mlx-lm matches them on token ids, and a stop string that
        begins or ends inside a token would never stop the reply; `_Replies` matches
        them on the text."""
        return super()._make_state_machine(model_key, tokenizer, ())

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's, and the context check: 400 ``context_length_exceeded`` for a
        prompt that leaves no room, ``max_tokens`` capped at the room left
        (`fit_context`)."""
        tokenized = super()._tokenize(tokenizer, request, args)
        model = self.model_provider.model
        try:
            args.max_tokens = fit_context(model, len(tokenized[0]), args.max_tokens)
        except MTPError as e:
            raise bad_request(one_line(e), code="context_length_exceeded") from None
        return tokenized

    # a request alone, through the single-stream loop

    def _serve_one(self, item) -> None:
        responses, request, args = item
        if responses.ended:  # its client went away while it was queued
            return
        try:
            self._serve_alone(request, args)
        except Exception as e:  # every failure goes back to its request
            e = _decoding_error(e)
            if not isinstance(e, RequestError):
                log.exception("a request failed")
            responses.put(e)

    def _serve_alone(self, request, args: _JobArgs) -> None:
        job, tokenizer = args.job, self.model_provider.tokenizer
        tokenized = self._tokenize(tokenizer, request, args)
        prompt, initial_state = tokenized[0], tokenized[3]
        stop_sequences, text_sm = self._make_state_machine(
            self.model_provider.model_key, tokenizer, args.stop_words
        )
        depth = _depth(self.model_provider.model, job.options)
        session = self.sessions.take(prompt, job.owner, depth)
        done = len(session.tokens) if session is not None else 0
        ctx = _Context(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=initial_state,
            prompt=prompt,
            prompt_cache_count=done,
        )
        self._decode(
            job, ctx, session or Session(), prompt[done:], args, stop_sequences
        )

    def _decode(self, job: _Job, ctx, session, rest, args, stop_sequences):
        """Decode ``rest`` with the MTP loop from ``session`` and the job's options
        (``max_tokens`` capped to the context by `_tokenize`), putting on the job's
        queue its context once the prefill went well, a `Response` per token, then
        None."""
        tokenizer, owner = self.model_provider.tokenizer, job.owner
        rqueue = job.responses
        steps = stream_generate(
            self.model_provider.model,
            tokenizer,
            rest,
            options=job.options.replace(max_tokens=args.max_tokens),
            session=session,
            on_prefill=lambda s: self.sessions.put(s.snapshot(), owner),
        )
        matcher = stop_sequences.matcher()
        try:
            first = next(steps)  # the prefill: errors surface before any reply
        except MTPError as e:
            self.sessions.put(session, owner)  # untouched: refused before the prefill
            raise _options_error(e) from None
        rqueue.put(ctx)
        whole = False
        try:
            for gen in _chain(first, steps):
                finish = gen.finish_reason
                if matcher.advance(gen.token):
                    finish = "stop"
                job.mtp = gen.mtp
                # the token's logprob only when asked: .item() is a sync per token
                logprob = gen.logprobs[gen.token].item() if args.logprobs else 0.0
                top = _top_logprobs(gen.logprobs, args.top_logprobs, tokenizer)
                rqueue.put(
                    lm_server.Response(gen.text, gen.token, logprob, finish, top)
                )
                if finish is not None or ctx.stopped or self._closing:
                    break
            whole = True
        finally:
            steps.close()  # the session now holds what was yielded
            if whole:  # after a failure its caches may be half updated: dropped
                self.sessions.put(session, owner)
        rqueue.put(None)

    # the handlers' side

    def generate(self, request: _Request, generation_args, progress_callback=None):
        """Queue a request (mlx-lm's handler calls this; ``request`` carries its
        `_Job`), and return its context and its responses once the generation
        started it. A plain reply's responses are all read here first, so that a
        failure mid-generation still gets an error reply; a stream's as they come.
        A failure is raised as a `_Refusal` for `MTPHandler` to answer (mlx-lm would
        answer a 404): a request error keeps its status, a server that is shutting
        down answers 503, anything else is a 500. The request counts as in flight
        until `release`."""
        job = request.job
        args = _with_job(generation_args, _JobArgs, job)
        try:
            ctx = self._start(job, request, args)
        except Exception as e:
            if not isinstance(e, RequestError):
                log.exception("request failed")
            raise _Refusal(_as_request_error(e)) from None
        replies = _Replies(self, job)
        if job.stream:
            return ctx, _streamed(replies)
        try:
            return ctx, iter(list(replies))
        except Exception as e:
            log.info("request failed mid-reply: %s", one_line(e))
            raise _Refusal(_as_request_error(e)) from None

    def _start(self, job: _Job, request: _Request, args: _JobArgs):
        """Queue the request: its context once the generation started it."""
        self._enter(job.responses)
        self.requests.put((job.responses, request, args))
        first = self._wait(job.responses)
        while isinstance(first, tuple):  # prompt progress
            first = self._wait(job.responses)
        if first is None:  # ended before it started: the server is stopping
            raise _shutting_down()
        if isinstance(first, Exception):
            raise first
        return first

    def _wait(self, responses: _Responses):
        """What the generation puts next for a request, its client watched
        meanwhile (`_Responses.watch`: a reply not streamed writes nothing until it
        is over, so only this notices a client that went away); RuntimeError once
        the generation thread died, as nothing more will come."""
        while True:
            responses.watch()
            try:
                return responses.get(timeout=WATCH_EVERY)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None

    def _enter(self, responses: _Responses) -> None:
        with self._lock:
            if self._closing:
                raise _shutting_down()
            if not self.generation_available():
                raise RuntimeError("generation thread died")
            self._live.add(responses)

    def release(self, responses: _Responses) -> None:
        """Count a request out of those in flight, once its reply is over (read or
        not). Idempotent."""
        with self._lock:
            self._live.discard(responses)
            self._lock.notify_all()

    def shutdown(self, wait: float = SHUTDOWN_WAIT) -> None:
        """Stop generation within a round and end every open reply cleanly: the
        loop stops at its next check (after the current round, or prefill chunk)
        and is joined; then a request not started gets a 503, a started one ends as
        if it had finished (a final chunk and ``[DONE]`` when streamed). Waits
        ``wait`` seconds at most for the replies to be written. Idempotent."""
        with self._lock:
            self._closing = True
            live = list(self._live)
        for responses in live:
            if responses.ctx is not None:
                responses.ctx.stop()
        self.join()  # the loop stops at its next check
        for responses in live:
            responses.put(None)  # a request that ended already ignores it
        with self._lock:
            self._lock.wait_for(lambda: not self._live, wait)

    def stop_and_join(self):
        self.shutdown()

    @property
    def closing(self) -> bool:
        """`shutdown` was called: no request starts any more."""
        return self._closing


def _depth(model, options: DecodeOptions) -> int:
    """The MTP layers whose caches a request decoding alone with ``options`` goes
    on from (a kept session must hold as many); -1, which no session holds, for
    options the loop refuses (before it touches a session)."""
    try:
        return drafting(model, options).depth(model)
    except MTPError:
        return -1


def _chain(first, rest):
    yield first
    yield from rest


# --- HTTP ----------------------------------------------------------------------------


class _Deadline:
    """A connection's request stream, read within a deadline: every read waits until
    then at most (TimeoutError after), so a client that sends its request a byte at a
    time is cut off as one that sends nothing."""

    def __init__(self, raw, sock, seconds: float):
        self._raw, self._sock = raw, sock
        self._deadline = time.monotonic() + seconds

    def _wait(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)

    def readline(self, limit: int = -1) -> bytes:
        parts, size = [], 0
        while limit < 0 or size < limit:
            self._wait()
            ahead = self._raw.peek(1)  # one read of the socket at most
            if not ahead:
                break
            n = ahead.find(b"\n") + 1 or len(ahead)
            part = self._raw.read(n if limit < 0 else min(n, limit - size))
            parts.append(part)
            size += len(part)
            if part.endswith(b"\n"):
                break
        return b"".join(parts)

    def read(self, n: int = -1) -> bytes:
        parts, size = [], 0
        while n < 0 or size < n:
            self._wait()
            part = self._raw.read1(1 << 20 if n < 0 else n - size)
            if not part:
                break
            parts.append(part)
            size += len(part)
        return b"".join(parts)

    def close(self) -> None:
        self._raw.close()


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed or reset the connection: a read that does
    not wait finds its end (bytes sent ahead are left unread). A client that shut
    down only its sending side looks gone too."""
    timeout = sock.gettimeout()
    try:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        finally:
            sock.settimeout(timeout)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


# mlx-lm's handler attributes whose request field has another name
HANDLER_FIELDS = {"requested_model": "model"}


class MTPHandler(lm_server.APIHandler):
    """mlx-lm's handler with authentication, checks that keep web pages out (Origin,
    Host, Content-Type), bounded requests, OpenAI-style errors, the decode options
    of each request (`_Job`) and an ``mtp`` block."""

    protocol_version = "HTTP/1.0"

    def setup(self):
        self.timeout = self.response_generator.cli_args.request_timeout
        super().setup()
        self.rfile = _Deadline(self.rfile, self.connection, self.timeout)
        self._pending = None  # the body's bytes not read yet, once known
        self._job = None  # a completion request's record, once its fields passed
        self._served = None  # the model and tokenizer its checks use (`Served`)
        self._watched = 0.0  # when `_client_left` last looked
        self._anthropic = False  # a request of Anthropic's Messages API

    def _received(self) -> None:
        """The request is read: from now on the timeout bounds each idle wait of the
        reply (a client that reads nothing of it for that long is dropped)."""
        self.connection.settimeout(self.timeout)

    def _client_left(self) -> bool:
        """Whether the client closed (or reset) its connection (`_hung_up`); looked
        at once per `WATCH_EVERY` at most, else False. From the handler's thread
        only (it alone reads and writes the connection)."""
        now = time.monotonic()
        if now - self._watched < WATCH_EVERY:
            return False
        self._watched = now
        return _hung_up(self.connection)

    def _fail(self, error: RequestError) -> None:
        self._drain()
        body = anthropic_api.error_body(error) if self._anthropic else error.body()
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
            self._authorize()
        except RequestError as e:
            return self._fail(e)
        if self.path.startswith("/v1/models"):
            return self.handle_models_request()
        if self.path == "/health":
            return self.handle_health_check()
        self._fail(RequestError(404, f"no endpoint {self.path}", "not_found_error"))

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
        failure anywhere after is answered here too (`_Refusal`). A Messages request
        (Anthropic's API) is served as the chat request it translates to."""
        self._anthropic = anthropic_api.under_messages(self.path)
        try:
            self._admit()
            owner = self._authorize()
            self._route()
            length = self._content_length()
            self._check_media_type()
            self._read_body(length)
            if self._anthropic:
                self._body, stream = anthropic_api.chat_request(self._body)
            self._while_open(self._check_request, owner)
        except RequestError as e:
            return self._fail(e)
        if self._anthropic:  # its chat reply streams, for `anthropic_api.Wire`
            self._job.stream, self.path = stream, "/v1/chat/completions"
        self.rfile = io.BytesIO(self._raw)  # the checked body, for mlx-lm's handler
        self.headers.replace_header("Content-Length", str(len(self._raw)))
        try:
            super().do_POST()
        except _Refusal as refusal:
            self._answer(refusal)

    def _answer(self, refusal: "_Refusal") -> None:
        """A request's failure in its API's form: its error reply, or once its stream
        started, an error event (OpenAI's then ``[DONE]``)."""
        if not refusal.streaming:
            return self._fail(refusal.error)
        error = refusal.error
        try:
            if self._anthropic:
                self.wfile.write(anthropic_api.error_event(error))
            else:
                self.wfile.write(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            log.info("client went away before its error event")

    def _while_open(self, fn, *args) -> None:
        """``fn(*args)`` on a thread of its own, waited for here until it is done
        (its exception raised here), or until the server closes: then a 503 at
        once, as for any request not started (`_shutting_down`), its thread left
        to finish on its own. The request's checks may take seconds (a large
        schema compiles), and a server that closes waits a little only
        (`CLOSE_WAIT`) for the connections it handles."""
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
                raise _shutting_down()
        if "error" in out:
            raise out["error"]

    def _check_request(self, owner: Optional[int]) -> None:
        """Everything checked of a request before it is queued."""
        self._check_fields(owner)
        self._check_room()

    def _route(self) -> None:
        if anthropic_api.is_messages(self.path):
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
        `RequestError` naming the field); its `_Job` made, with its decode options;
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
        if chat:
            check_chat_fields(body)
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
        options = self._decode_options(body)
        stops = self._check_reply_fields(body)
        self._job = _Job(options, owner, body.get("stream") is True, stops=stops)
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
    # own form, a `_Refusal` is raised instead, which `do_POST` answers in OpenAI's.

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
            raise _Refusal(bad_request(message, param)) from None

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
        """mlx-lm's, serving the request as a `_Request`, which carries its `_Job` to
        the generator. A failure after the reply started ends the reply (a stream
        with an error event) and the server goes on; the request is counted out
        once its reply is over. A Messages request's reply goes through an
        `anthropic_api.Wire` (`_wire`)."""
        job, self._calls = self._job, 0  # _calls: the reply's tool calls so far
        wire = self._wire() if self._anthropic else None
        try:
            super().handle_completion(_with_job(request, _Request, job), stop_words)
            if wire is not None:
                self._send_message(wire)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            log.info("client went away; its generation stopped")
        except Exception as e:  # after the reply started: end it, keep serving
            log.exception("request failed mid-reply")
            self._end_failed(RequestError(500, one_line(e), "server_error"), wire)
        finally:
            if wire is not None:
                self.wfile = wire.out
            self.response_generator.release(job.responses)

    def _wire(self) -> anthropic_api.Wire:
        """``self.wfile`` as an `anthropic_api.Wire` for a Messages request's reply,
        its stop reason that of the chat reply's finish and the stop sequence that
        ended it, if one did (`anthropic_api.stop_reason`)."""
        job = self._job

        def stop(finish):
            return anthropic_api.stop_reason(finish, job.stop_sequence)

        def reply():  # at the reply's headers: the request has its context
            ctx, model = job.responses.ctx, self.requested_model
            prompt, cached = len(ctx.prompt), ctx.prompt_cache_count
            return anthropic_api.Reply(model, prompt, cached, stop)

        self.wfile = anthropic_api.Wire(self.wfile, reply, job.stream)
        return self.wfile

    def _send_message(self, wire: anthropic_api.Wire) -> None:
        """A Messages reply over: sent whole unless it streamed."""
        self.wfile = wire.out
        if not wire.stream:
            self._send_json(wire.reply.message())

    def _end_failed(self, error: RequestError, wire) -> None:
        """End a reply that failed after it started: a stream with an error event
        in its API's form (OpenAI's then ``[DONE]``); a reply not streamed, whose
        headers mlx-lm's handler keeps until its body is made (nothing sent yet),
        with its error reply."""
        if wire is not None:
            self.wfile = wire.out
        if wire is None and self.stream:
            self.wfile.write(b"data: " + error.body() + b"\n\ndata: [DONE]\n\n")
        elif wire is not None and wire.stream:
            self.wfile.write(anthropic_api.error_event(error))
        elif wire is not None or getattr(self, "_headers_buffer", None):
            self._headers_buffer = []  # the 200's, not sent
            self._fail(error)

    def generate_response(self, text, finish_reason, *args, tool_calls=(), **kw):
        """mlx-lm's chunk or reply, with the reply's content as this server makes it:
        tool text that did not parse as calls (`mlx_mtp.replies.Unparsed`) is
        content, with its markers (a call max_tokens cut short has no end marker),
        after the chunk's text; the finish is "tool_calls" only when the reply made
        calls (else "stop"), and "stop" when it ended by a stop string
        (``flushed_stop``: see `_Replies`); the ``mtp`` block on the last chunk. A
        ValueError for a reply that would not be valid JSON (NaN, infinities)."""
        text, calls = self._parsed_calls(text or "", tool_calls or (), finish_reason)
        if finish_reason is not None:
            finish_reason = self._finish(finish_reason)
        response = super().generate_response(
            text, finish_reason, *args, tool_calls=calls, **kw
        )
        if finish_reason is not None:
            self._add_mtp(response)
        return finite(response)

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
        return self._add_mtp(super().completion_usage_response(*args, **kwargs))

    def _add_mtp(self, response: dict) -> dict:
        job = self._job
        if job is None or job.responses.ctx is None or job.mtp is None:
            return response
        response["mtp"] = mtp_block(job.mtp, job.batch_sizes)
        return response


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


def env_keys() -> tuple:
    """The API keys of `API_KEY_ENV`, a comma-separated list (empty entries skipped)."""
    value = os.environ.get(API_KEY_ENV, "")
    return tuple(k.strip() for k in value.split(",") if k.strip())


def api_keys(value) -> tuple:
    """``api_key`` as a tuple of keys: None or () for none, one key, or several;
    each client that presents its own key has prompt caches of its own."""
    keys = () if value is None else (value,) if isinstance(value, str) else value
    keys = tuple(keys)
    if not all(isinstance(k, str) and k for k in keys):
        raise MTPError("an API key must be a non-empty string")
    return keys


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, ``max_connections`` at most (one more gets a 503 at
    once), and what `MTPHandler` checks requests against: whether the server is
    bound to a loopback address (then `host_allowed` guards against DNS
    rebinding), under which name, the allowed Origins, and for `_check_room` the
    model's context and `prompt_bytes_per_token`."""

    daemon_threads = True  # a slow client never holds the server up

    def __init__(self, address, handler, origins: frozenset, max_connections: int):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.origins, self.max_connections = origins, max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.bytes_per_token = self.context = None
        super().__init__(address, handler)
        self.loopback = ipaddress.ip_address(self.server_address[0]).is_loopback
        self.name = address[0]

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            return self._refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        """503 at once, from the accepting thread: a reply this short fits in the
        socket's empty send buffer, so sending it never waits."""
        error = RequestError(
            503,
            f"the server has {self.max_connections} connections open, its most; "
            "try again later",
            "server_error",
        )
        body = error.body()
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\n\r\n"
        )
        try:
            request.setblocking(False)
            request.send(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)


class Server:
    """An `mlx-mtp serve` server; `start` runs it in a thread (tests, scripts),
    `serve_forever` in the caller's."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        origins = check_origins(args.allowed_origins)  # before the model loads
        provider = MTPModelProvider(args)
        provider.load(DEFAULT_MODEL)  # load errors now, before binding
        self.generator = None
        self.httpd = _HTTPServer(
            (args.host, args.port), self._handler(), origins, args.max_connections
        )
        self.httpd.bytes_per_token = prompt_bytes_per_token(provider.tokenizer)
        self.httpd.context = getattr(
            provider.model.args, "max_position_embeddings", None
        )
        kept = args.prompt_cache_bytes
        if kept is None:  # a quarter of what the weights leave (`default_budget`)
            kept = default_budget(provider.model) // 2
        sessions = Sessions(args.prompt_cache_size, kept)
        self.generator = MTPResponseGenerator(provider, sessions)
        self.port = self.httpd.server_address[1]
        self._thread = None

    def _handler(self):
        fingerprint = lm_server.get_system_fingerprint()
        self._connections = _Connections()

        def make(*a, **kw):  # handles the connection, in its thread
            with self._connections:
                MTPHandler(self.generator, *a, system_fingerprint=fingerprint, **kw)

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
        # The connections handled (their replies are over), what their requests
        # left in reference cycles is freed now, in this thread: a connection's
        # thread still freeing MLX arrays at the interpreter's exit, or a collection
        # of them then, can abort the process ("terminate called without an active
        # exception").
        self._connections.wait(CLOSE_WAIT)
        gc.collect()


class _Connections:
    """The connections being handled, counted, so that `Server.close` can wait for
    them."""

    def __init__(self):
        self._count, self._changed = 0, threading.Condition()

    def __enter__(self):
        with self._changed:
            self._count += 1

    def __exit__(self, *exc):
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Until none is handled, ``timeout`` seconds at most."""
        with self._changed:
            self._changed.wait_for(lambda: not self._count, timeout)


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

"""A request as the server keeps it, from its checks to the end of its reply.

`Job` holds what is the server's own (its decode options, owner, stop strings,
statistics); it rides on subclasses of mlx-lm's request and argument dataclasses
(`JobRequest`, `JobArgs`) with declared fields. The generation puts the request's
context, its responses and its end on its queue (`Responses`); `Replies` reads them
as the reply's iterator, its stop strings matched on the text. A failure becomes the
request's error reply (`as_request_error`, `decoding_error`, `options_error`,
`fail_request`), raised through mlx-lm's handler as a `Refusal`.
"""

import dataclasses
import logging
import math
import threading
from dataclasses import dataclass, field, fields
from queue import Queue
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm import server as lm_server

from ..errors import MTPError, one_line
from ..grammar import GrammarError
from ..options import DecodeOptions
from ..replies import StopText, checked_parser
from ..sampling import SamplingError
from ..server_checks import RequestError, bad_request, sampling_request_error
from ..stats import MTPStats

log = logging.getLogger("mlx_mtp")


WATCH_EVERY = 0.05  # seconds between looks at a waiting request's client and server


def shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", "server_error")


def _client_gone() -> RequestError:
    """A request whose client went away: nobody reads its reply."""
    return RequestError(499, "the client closed its connection", "client_gone")


def as_request_error(e: Exception) -> RequestError:
    """A request's failure as its error reply: a `RequestError` as it is, any other
    a 500."""
    if isinstance(e, RequestError):
        return e
    return RequestError(500, one_line(e), "server_error")


def options_error(e: MTPError) -> RequestError:
    """A request's decode options refused by the loop, as its 400."""
    if isinstance(e, SamplingError):
        return sampling_request_error(e)
    return bad_request(one_line(e))


class Responses(Queue):
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
class Job:
    """One request, as the server keeps it from its checks to the end of its reply:
    its decode options (the server's, then the request's fields; checked), its
    ``owner`` (the index of the API key it presented; None without keys), whether its
    reply streams, and its ``responses``. Once it decodes: ``mtp``, the loop's
    statistics (a snapshot, taken before its reply's last token is put), and
    ``batch_sizes``, the rounds it ran at each batch size (None: alone).

    Its reply's ``stops`` (its stop strings) are matched on the text (`Replies`):
    ``stop_sequence`` is the one that ended the reply, if one did, and
    ``flushed_stop`` says that the reply ended by a stop (a stop string, or EOS
    after text held back as the possible start of one) although mlx-lm's handler
    was told "length", so that it sends every character before the stop."""

    options: DecodeOptions
    owner: Optional[int] = None
    stream: bool = False
    responses: Responses = field(default_factory=Responses)
    mtp: Optional[MTPStats] = None
    batch_sizes: Optional[Dict[int, int]] = None
    stops: Tuple[str, ...] = ()
    stop_sequence: Optional[str] = None
    flushed_stop: bool = False
    # ``mtp_sources``: its stream's chunks say where their tokens came from
    # (`Sourced.source`, gathered in ``sources`` as the reply is read)
    want_sources: bool = False
    sources: List[Optional[str]] = field(default_factory=list)
    # a model that reads images: the request's (read, in order), and once its
    # prompt is made, its `mlx_mtp.media.Media`
    images: list = field(default_factory=list)
    media: Any = None


@dataclass
class Sourced(lm_server.Response):
    """mlx-lm's response with where its token came from: "heads" or "lookup" for an
    accepted draft, None for a token the verify pass gave
    (`mlx_mtp.generate.GenerationResponse.source`)."""

    source: Optional[str] = None


@dataclass
class JobRequest(lm_server.CompletionRequest):
    """mlx-lm's request, carrying the server's record of it from `MTPHandler` to
    `MTPResponseGenerator.generate`."""

    job: Optional[Job] = None


@dataclass
class JobArgs(lm_server.GenerationArguments):
    """mlx-lm's generation arguments of a request, carrying the server's record of it
    from `MTPResponseGenerator.generate` to the generation loop."""

    job: Optional[Job] = None


def with_job(value, cls, job: Job):
    """``value``, an instance of mlx-lm's dataclass that ``cls`` extends, as a
    ``cls`` carrying ``job``."""
    return cls(**{f.name: getattr(value, f.name) for f in fields(value)}, job=job)


@dataclass
class Context(lm_server.GenerationContext):
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


class Refusal(BaseException):
    """A request's failure, for `MTPHandler` to answer in OpenAI's form: raised
    through mlx-lm's handler, which catches Exception only, and so writes nothing of
    its own after it. ``streaming``: the reply's stream had started."""

    def __init__(self, error: RequestError, streaming: bool = False):
        super().__init__(str(error))
        self.error, self.streaming = error, streaming


class Replies:
    """The responses of a request whose reply started, as an iterator, prompt
    progress left out: until None, or an exception put, which it raises.

    The job's stop strings are matched on the text, as OpenAI and Anthropic do
    (`StopText`): a response's text leaves out what could begin a stop string until
    the next says; at a stop string the reply ends there (its generation is
    stopped, what it still puts is dropped) and the job records which. mlx-lm's
    handler drops the text of a response that ends "stop" (the EOS token's); a
    reply that ends by a stop after text held back or cut before a stop string ends
    "length" instead, so that the handler sends that text, and the job says it is a
    stop (``flushed_stop``). ``next_response(responses)`` waits for what the
    generation puts next (`MTPResponseGenerator.next_response`)."""

    def __init__(self, next_response: Callable[[Responses], Any], job: Job):
        self._next, self._job, self._responses = next_response, job, job.responses
        self._text = StopText(job.stops)
        self._over = False  # stopped at a stop string: the rest is dropped

    def __iter__(self):
        return self

    def __next__(self):
        if self._over:
            self._drain()
            raise StopIteration
        while True:
            response = self._next(self._responses)
            if response is None:
                raise StopIteration
            if isinstance(response, Exception):
                raise response
            if not isinstance(response, tuple):  # prompt progress
                return self._cut(response)

    def _cut(self, response):
        """``response`` with its text as `StopText` lets it be sent (its token's
        source noted on the job)."""
        self._job.sources.append(getattr(response, "source", None))
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
            response = self._next(self._responses)
            if response is None or isinstance(response, BaseException):
                return


def streamed(replies: Replies):
    """A stream's responses; a failure mid-stream raised as a `Refusal`."""
    try:
        yield from replies
    except Exception as e:
        log.info("request failed mid-reply: %s", one_line(e))
        raise Refusal(as_request_error(e), streaming=True) from None


def top_logprobs(logprobs: mx.array, n: int, tokenizer) -> tuple:
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


def decoding_error(e: BaseException) -> BaseException:
    """A request's failure while it decodes, as its error reply: a grammar the engine
    refused or failed on is the request's own (a 400: its grammar is past the
    engine's limits), anything else as it is (`as_request_error`)."""
    if isinstance(e, GrammarError):
        return bad_request(one_line(e))
    return e


def fail_request(responses: Responses, error: Exception) -> None:
    """A request's failure: its reply gets ``error`` (logged unless a
    `RequestError`), and its generation stops."""
    if not isinstance(error, RequestError):
        log.error("a request failed", exc_info=error)
    responses.fail(error)

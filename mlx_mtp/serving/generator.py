"""mlx-lm's generation thread with a loop of its own (`MTPResponseGenerator`): the
requests in flight decode together with MTP (`mlx_mtp.serving.scheduler`), or, for a
model whose caches cannot batch, one at a time through the single-stream loop
(`mlx_mtp.generate.stream_generate`); either way going on from the `Session` of an
earlier conversation when the prompt extends its tokens (`Sessions`).

A client that goes away stops its generation within a round (the request's context
is stopped: by mlx-lm's handler when a stream's write fails, and by the handler
waiting for a reply, which watches the connection; the loop checks it after every
round, and its row leaves the batch), and the session it used is left consistent. A
failure costs only the requests it touched, and the loop serves the next one.
"""

import gc
import logging
import threading
from queue import Empty
from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm import server as lm_server
from mlx_lm.generate import generation_stream, wired_limit

from ..batch_cache import batch_support
from ..errors import MTPError, one_line
from ..generate import fit_context, stream_generate
from ..images import prompt_media
from ..media import keyed
from ..options import DecodeOptions
from ..resolve import drafting
from ..server_checks import RequestError, bad_request
from ..speculative import Session, fill
from .jobs import (
    WATCH_EVERY,
    Context,
    Job,
    JobArgs,
    JobRequest,
    Refusal,
    Replies,
    Responses,
    Sourced,
    as_request_error,
    decoding_error,
    options_error,
    shutting_down,
    streamed,
    top_logprobs,
    with_job,
)
from .provider import MTPModelProvider
from .scheduler import Scheduler
from .sessions import Sessions

log = logging.getLogger("mlx_mtp")


SHUTDOWN_WAIT = 10.0  # seconds `MTPResponseGenerator.shutdown` waits for open replies


class MTPResponseGenerator(lm_server.ResponseGenerator):
    """mlx-lm's generation thread, with a loop of its own (`_serve`): the requests
    in flight decode together with MTP (`Scheduler`), or, for a model whose caches
    cannot batch (``cannot_batch``: why, logged once at start), one at a time
    through the single-stream loop; either way with `Sessions` for prompt reuse.

    A failure costs only the requests it touched: one request's goes to that
    request, a batched round's to the rows in it (`Scheduler`, `_serve_one`); a
    failure of the loop itself goes to the requests it had taken, and the loop
    starts again (`_generate`). `shutdown` stops generation within a round and ends
    every open reply cleanly."""

    def __init__(self, model_provider: MTPModelProvider, sessions: Sessions):
        self.sessions = sessions
        self._lock = threading.Condition()
        self._live = set()  # the `Responses` of requests whose reply is not over
        self._fresh = True
        self._closing = False  # `shutdown` was called
        self.scheduler: Optional[Scheduler] = None
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
            self.scheduler = Scheduler(self) if self.cannot_batch is None else None
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
            scheduler = self.scheduler = Scheduler(self)
        while request is not None:
            scheduler.take(request)
            request = self._next_request()  # without waiting
        if scheduler.busy():
            scheduler.round()

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is not None:
            request[0].taken = True  # a `Responses`: `generate` queued it
            self._fresh = False
        return request

    def _make_state_machine(self, model_key, tokenizer, stop_words):
        """mlx-lm's stop sequences (EOS) and text state machine, without
        ``stop_words``: mlx-lm matches them on token ids, and a stop string that
        begins or ends inside a token would never stop the reply; `Replies` matches
        them on the text."""
        return super()._make_state_machine(model_key, tokenizer, ())

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's, and the context check: 400 ``context_length_exceeded`` for a
        prompt that leaves no room, ``max_tokens`` capped at the room left
        (`fit_context`)."""
        if args.job.images:
            tokenized = self._tokenize_images(tokenizer, request, args)
        else:
            tokenized = super()._tokenize(tokenizer, request, args)
        model = self.model_provider.model
        try:
            args.max_tokens = fit_context(model, len(tokenized[0]), args.max_tokens)
        except MTPError as e:
            raise bad_request(one_line(e), code="context_length_exceeded") from None
        return tokenized

    def _tokenize_images(self, tokenizer, request, args):
        """A chat request with images (`mlx_mtp.server_checks.take_images`: its
        image parts are ``{"type": "image"}``) as mlx-lm's ``_tokenize`` makes a
        prompt with images, one segment: rendered by the chat template, then each
        placeholder repeated for its image and the prompt's media made (the vision
        tower runs here, in the generation thread), kept on the job."""
        messages = [dict(m) for m in request.messages]
        for message in messages:  # text lists joined, tool arguments parsed
            content = message.get("content")
            with_images = isinstance(content, list) and any(
                p.get("type") == "image" for p in content
            )
            if with_images:
                message["content"] = ""
            lm_server.process_message_content([message])
            if with_images:
                message["content"] = content
        template = dict(self.model_provider.cli_args.chat_template_args)
        template.update(args.chat_template_kwargs or {})
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=request.tools,
                add_generation_prompt=True,
                tokenize=False,
                **template,
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids, args.job.media = prompt_media(
                self.model_provider.model, ids, args.job.images
            )
        except MTPError as e:
            raise bad_request(one_line(e), "messages") from None
        state = "normal"
        if tokenizer.has_thinking:
            start, end = tokenizer.rfind_think_start(ids), tokenizer.rfind_think_end(
                ids
            )
            state = "reasoning" if start > end else state
        return (
            ids,
            [ids],
            ["assistant"],
            tokenizer.response_initial_state or state,
            None,
        )

    def prompt_of(self, request, args: JobArgs) -> Tuple[List[int], str, Optional[int]]:
        """A request's prompt tokens, its text state machine's initial state
        (`_tokenize`: the context checked, ``args.max_tokens`` capped) and where its
        system prompt ends (mlx-lm's "system" segment), when that is long enough
        to be worth keeping apart (`system_mark`)."""
        tokenized = self._tokenize(self.model_provider.tokenizer, request, args)
        prompt, segments, kinds = tokenized[0], tokenized[1], tokenized[2]
        return prompt, tokenized[3], system_mark(prompt, segments, kinds)

    def text_machines(self, stop_words) -> tuple:
        """A request's stop sequences and text state machine
        (`_make_state_machine`: ``stop_words`` are matched on the text)."""
        provider = self.model_provider
        return self._make_state_machine(
            provider.model_key, provider.tokenizer, stop_words
        )

    # a request alone, through the single-stream loop

    def _serve_one(self, item) -> None:
        responses, request, args = item
        if responses.ended:  # its client went away while it was queued
            return
        try:
            self._serve_alone(request, args)
        except Exception as e:  # every failure goes back to its request
            e = decoding_error(e)
            if not isinstance(e, RequestError):
                log.exception("a request failed")
            responses.put(e)

    def _serve_alone(self, request, args: JobArgs) -> None:
        job, tokenizer = args.job, self.model_provider.tokenizer
        prompt, initial_state, mark = self.prompt_of(request, args)
        stop_sequences, text_sm = self.text_machines(args.stop_words)
        depth = _depth(self.model_provider.model, job.options)
        session = self.sessions.take(keyed(prompt, job.media), job.owner, depth)
        done = len(session.tokens) if session is not None else 0
        kept = done  # what the request reuses (its cached_tokens)
        if session is not None and done == mark:  # a shared system prompt: kept too
            self.sessions.put(session.snapshot(), job.owner)
        if mark is not None and mark > done and depth >= 0:
            # the system prompt's caches, kept apart for requests that share it
            session = session or Session()
            options = job.options.replace(max_tokens=args.max_tokens)
            fill(self.model_provider.model, session, prompt[done:mark], options)
            self.sessions.put(session.snapshot(), job.owner)
            done = mark
        ctx = Context(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=initial_state,
            prompt=prompt,
            prompt_cache_count=kept,
        )
        self._decode(
            job, ctx, session or Session(), prompt[done:], args, stop_sequences
        )

    def _decode(self, job: Job, ctx, session, rest, args, stop_sequences):
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
            media=job.media,
        )
        matcher = stop_sequences.matcher()
        try:
            first = next(steps)  # the prefill: errors surface before any reply
        except MTPError as e:
            self.sessions.put(session, owner)  # untouched: refused before the prefill
            raise options_error(e) from None
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
                top = top_logprobs(gen.logprobs, args.top_logprobs, tokenizer)
                rqueue.put(
                    Sourced(gen.text, gen.token, logprob, finish, top, gen.source)
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

    def generate(self, request: JobRequest, generation_args, progress_callback=None):
        """Queue a request (mlx-lm's handler calls this; ``request`` carries its
        `Job`), and return its context and its responses once the generation
        started it. A plain reply's responses are all read here first, so that a
        failure mid-generation still gets an error reply; a stream's as they come.
        A failure is raised as a `Refusal` for `MTPHandler` to answer (mlx-lm would
        answer a 404): a request error keeps its status, a server that is shutting
        down answers 503, anything else is a 500. The request counts as in flight
        until `release`."""
        job = request.job
        args = with_job(generation_args, JobArgs, job)
        try:
            ctx = self._start(job, request, args)
        except Exception as e:
            if not isinstance(e, RequestError):
                log.exception("request failed")
            raise Refusal(as_request_error(e)) from None
        replies = Replies(self.next_response, job)
        if job.stream:
            return ctx, streamed(replies)
        try:
            return ctx, iter(list(replies))
        except Exception as e:
            log.info("request failed mid-reply: %s", one_line(e))
            raise Refusal(as_request_error(e)) from None

    def _start(self, job: Job, request: JobRequest, args: JobArgs):
        """Queue the request: its context once the generation started it."""
        self._enter(job.responses)
        self.requests.put((job.responses, request, args))
        first = self.next_response(job.responses)
        while isinstance(first, tuple):  # prompt progress
            first = self.next_response(job.responses)
        if first is None:  # ended before it started: the server is stopping
            raise shutting_down()
        if isinstance(first, Exception):
            raise first
        return first

    def next_response(self, responses: Responses):
        """What the generation puts next for a request, its client watched
        meanwhile (`Responses.watch`: a reply not streamed writes nothing until it
        is over, so only this notices a client that went away); RuntimeError once
        the generation thread died, as nothing more will come."""
        while True:
            responses.watch()
            try:
                return responses.get(timeout=WATCH_EVERY)
            except Empty:
                if not self.generation_available():
                    raise RuntimeError("generation thread died") from None

    def _enter(self, responses: Responses) -> None:
        with self._lock:
            if self._closing:
                raise shutting_down()
            if not self.generation_available():
                raise RuntimeError("generation thread died")
            self._live.add(responses)

    def release(self, responses: Responses) -> None:
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


# A system prompt this long or longer is prefilled apart and its caches kept, so
# that requests sharing it and asking something else go on from it.
SYSTEM_MARK_TOKENS = 64


def system_mark(prompt, segments, kinds) -> Optional[int]:
    """The end of the prompt's system prompt (mlx-lm's first segment, of kind
    "system"), when it holds at least `SYSTEM_MARK_TOKENS` and the prompt goes on
    after it; else None."""
    if not kinds or kinds[0] != "system":
        return None
    end = len(segments[0])
    return end if SYSTEM_MARK_TOKENS <= end < len(prompt) else None


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

"""The batched decoding of the generation loop (`Scheduler`): requests join a
`mlx_mtp.batch.Batch` between rounds, their prompts prefilled a chunk per round, and
leave it when done, within ``max_batch`` rows and the cache memory (`CacheCost`)."""

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..batch import Admission, Batch, Row, RowOutput, prefill_groups, prefill_together
from ..errors import MTPError
from ..media import keyed
from ..memory import readable_size
from ..server_checks import bad_request
from .budget import cache_cost, default_budget
from .jobs import (
    Context,
    Job,
    JobArgs,
    Responses,
    Sourced,
    decoding_error,
    fail_request,
    options_error,
    top_logprobs,
)

log = logging.getLogger("mlx_mtp")


@dataclass
class _Stream:
    """A request of the batched loop, from taken to the end of its reply: its queue
    and mlx-lm's arguments (which carry its `Job`), its prompt, what makes its text
    (mlx-lm's cached stop sequences and text state machine; once it decodes, its own
    detokenizer and stop-sequence matcher), the cache positions it may hold
    (``positions``: its prompt and max_tokens), and its `Admission`, prompt tokens
    still to prefill (``left``), context and `Row` once it has them."""

    uid: int
    responses: Responses
    args: JobArgs
    prompt: List[int]
    initial_state: str
    stop_sequences: Any
    text_sm: Any
    positions: int
    admission: Optional[Admission] = None
    left: int = 0
    ctx: Optional[Context] = None
    row: Optional[Row] = None
    detokenizer: Any = None
    matcher: Any = None
    mark: Optional[int] = None  # where its system prompt ends (`system_mark`)

    @property
    def job(self) -> Job:
        return self.args.job


class Scheduler:
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
    caches then go to `Sessions` (not after a failure).

    ``generator`` is the `MTPResponseGenerator` whose loop runs it: the scheduler
    reads its provider, arguments and sessions, whether it is `closing`, and each
    request's prompt (`prompt_of`) and text machines (`text_machines`)."""

    def __init__(self, generator):
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
            fail_request(responses, e)

    def _open(self, responses: Responses, request, args: JobArgs) -> _Stream:
        prompt, initial_state, mark = self.gen.prompt_of(request, args)
        positions = len(prompt) + args.max_tokens
        need = self.cost.bytes([positions])
        if need > self.budget:
            raise bad_request(
                f"the request's {positions} tokens (its prompt and max_tokens) need "
                f"{readable_size(need)} of cache; this server decodes within "
                f"{readable_size(self.budget)} (--batch-cache-bytes): ask for fewer "
                "max_tokens, or send a shorter prompt",
                "max_tokens",
            )
        stop_sequences, text_sm = self.gen.text_machines(args.stop_words)
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
            mark=mark,
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
            if len(group) < 2 or self.gen.closing:
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
                    fail_request(s.responses, e)
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
            if self.gen.closing:
                break
            try:
                n = s.admission.advance()
            except Exception as e:
                self.admitting.remove(s)
                s.admission = None
                fail_request(s.responses, e)
                break
            ran, s.left = ran + n, s.left - n
        return ran

    def _start(self, s: _Stream) -> None:
        """Begin ``s``'s admission, from its conversation's session if one is kept
        (made by a batch: one of another loop is left in `Sessions`)."""
        sessions, owner = self.gen.sessions, s.job.owner
        session = sessions.take(keyed(s.prompt, s.job.media), owner, self.batch.depth)
        done = len(session.tokens) if session is not None else 0
        if session is not None and done == s.mark:  # a shared system prompt: kept too
            sessions.put(session.snapshot(), owner)
        options = s.job.options.replace(max_tokens=s.args.max_tokens)
        try:
            s.admission = self.batch.admit(
                s.uid, s.prompt[done:], options, session, media=s.job.media
            )
            if s.mark is not None and s.mark > done:  # its system prompt kept apart
                s.admission.mark = s.mark - done
                s.admission.on_mark = lambda snapshot: sessions.put(snapshot, owner)
                s.admission.fresh = False  # prefilled alone, to stop at the mark
        except MTPError as e:  # the request's options: refused before any prefill
            if session is not None:
                sessions.put(session, owner)
            return fail_request(s.responses, options_error(e))
        except Exception as e:
            return fail_request(s.responses, e)
        tokenizer = self.tokenizer
        s.left = len(s.prompt) - done
        s.ctx = Context(
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
            return fail_request(s.responses, e)
        try:  # the end tokens as of now (a tokenizer's may be added to)
            s.row = self.batch.join(admission, self.tokenizer.eos_token_ids)
        except Exception as e:  # its rules (a grammar): the batch is as it was
            return fail_request(s.responses, decoding_error(e))
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
                fail_request(s.responses, decoding_error(s.row.failure))
                failed.append(s)
                continue
            try:
                if self._emit(s, out):
                    over.append(s)
            except Exception as e:  # this request's failure only
                fail_request(s.responses, e)
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
                top = top_logprobs(out.logprobs[i], args.top_logprobs, self.tokenizer)
            if finish is not None:
                self._record(s)
            source = out.source if out.from_draft[i] else None
            response = Sourced(
                detokenizer.last_segment, token, logprob, finish, top, source
            )
            s.responses.put(response)
            if finish is not None:
                break
        else:
            stopped = s.ctx.stopped or self.gen.closing
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
            fail_request(s.responses, error)
        self.rows.clear()
        self.batch = self._new_batch()

    def close(self) -> None:
        """The loop ends (`MTPResponseGenerator.shutdown` ends the replies): the
        decoding requests' statistics recorded for their last chunk."""
        for s in self.rows.values():
            self._record(s)

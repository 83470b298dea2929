"""Several streams decoded together: one draft and one verify pass per round for all.

Each stream is a `Row` with its own committed tokens, MTP frontier, pending hidden
states, sampling settings, random key, draft policy and statistics, exactly as the
single-stream loop (`mlx_mtp.speculative`) keeps them for its one stream; the caches
hold every row (`mlx_mtp.batch_cache`). A round reads as there:

  draft   the MTP layers over every row's pending rows (left-padded to the longest),
          then chained: K draft tokens per row, each row's from its own settings;
  verify  one trunk pass over ``(B, K + 1)`` tokens;
  accept  per row: greedy matching or speculative sampling over its own k_b <= K
          drafts, so rows accept different numbers of drafts;
  commit  every cache drops each row's own rejected positions; each row appends its
          tokens (up to its first EOS and its ``max_tokens``).

A row decodes exactly as it would alone: its tokens depend only on its own prompt,
settings and key (greedy output is token for token the single-stream and mlx-lm's;
under sampling each row is exact speculative sampling). K is chosen per round for the
whole batch (`mlx_mtp.draft_length.BatchLength`), 0 when drafting does not pay: then
the round is batched plain decoding through the same loop.

A stream is prefilled in chunks (`Admission`), alone or with streams arriving with it
whose prompts are about as long (`prefill_together`: one padded pass per chunk), then
joins between rounds; a finished or removed stream leaves between rounds
(`Batch.remove`).

A row whose logits processors or grammar raise (the grammar engine reaching one of its
limits, say) fails alone: its rules are left out for the rest of the round, which goes
on for every row as it would have (each row's tokens depend on its own inputs only),
and at commit the row gets a last `RowOutput` with ``finish_reason`` "error" and the
``error``, and leaves the batch.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import mlx.core as mx

from . import batch_cache
from .batch_cache import batch_support, to_batch
from .batch_costs import BatchLength, model_batch_costs
from .cache import Caches, check_rollback, keep_below, make_caches
from .defaults import DEFAULT_MAX_BATCH
from .errors import MTPError, one_line
from .media import attach as attach_media
from .media import of_caches
from .options import DecodeOptions, longest_draft
from .resolve import drafting
from .round import DecodeState, Round, commit, draft, launch, plan
from .speculative import (
    Run,
    Session,
    append,
    chunk_stop,
    extend_mtp,
    kept_state,
    prefill,
)
from .stats import MTPStats


@dataclass
class Row:
    """One stream of a batch: ``run`` holds its decode state, settings, key, draft
    policies, statistics and rules (a row of `mlx_mtp.round`'s phases)."""

    uid: Any
    run: Run
    eos: frozenset = frozenset()
    batch_sizes: Dict[int, int] = field(default_factory=dict)  # rounds per batch size
    session: Optional[Session] = None  # set on leaving (`Batch.keep_sessions`)

    @property
    def state(self) -> DecodeState:
        return self.run.state

    @property
    def stats(self) -> MTPStats:
        return self.run.stats

    @property
    def params(self):
        return self.run.params

    @property
    def vocab(self) -> Optional[int]:
        """The draft vocabulary of the row's next heads draft."""
        return self.run.policy.vocab

    @property
    def failure(self) -> Optional[Exception]:
        """What its rules raised (it leaves at the next commit), or None."""
        return self.run.failure


@dataclass
class RowOutput:
    """What a round gave one row: its new tokens (up to EOS and ``max_tokens``),
    their target log-probabilities ``(n, V)``, which were accepted drafts, and
    ``finish_reason`` ("stop", "length") when the row is done. A row that failed (its
    grammar or logits processors raised) gets one last output with no tokens,
    ``finish_reason`` "error" and ``error``, the failure in one line; the tokens of
    its earlier outputs stand."""

    uid: Any
    tokens: List[int]
    logprobs: mx.array
    from_draft: List[bool]
    finish_reason: Optional[str]
    stats: MTPStats
    batch_sizes: Dict[int, int] = field(default_factory=dict)  # the row's, live
    error: Optional[str] = None  # why the row failed (finish_reason "error")
    source: Optional[str] = None  # its accepted drafts' source ("heads", "lookup")


def failed_output(uid, failure: BaseException, stats, vocab_size: int, sizes=None):
    """The last `RowOutput` of a row that failed with ``failure``."""
    return RowOutput(
        uid,
        [],
        mx.zeros((0, vocab_size)),
        [],
        "error",
        stats if stats is not None else MTPStats(0),
        sizes if sizes is not None else {},
        one_line(failure),
    )


class Admission:
    """A stream being prefilled alone, one chunk per `advance`, before it joins.

    ``session``: go on from a `Session` (its caches and state are filled in, and the
    prompt is what follows its tokens); ``policy``: a `DraftPolicy` for its heads'
    drafts instead of the options' (`mtp_generate_step`); ``media``: the prompt's
    `mlx_mtp.media.Media` (images), for a model that reads them."""

    def __init__(
        self,
        batch: "Batch",
        uid,
        prompt,
        options,
        session=None,
        policy=None,
        media=None,
    ):
        prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        if not prompt and (session is None or session.state is None):
            raise MTPError("the prompt is empty")
        self.uid, self.options, self.batch = uid, options, batch
        model = batch.model
        plan = drafting(model, options, policy)
        if session is not None and session.state is not None:
            if session.state.depth != batch.depth:
                raise MTPError(
                    f"this session drafts with {session.state.depth} MTP layer(s); "
                    f"the batch with {batch.depth}"
                )
        session = session if session is not None else Session()
        self.fresh = session.caches is None  # nothing prefilled: `prefill_together`
        session.caches = session.caches or make_caches(model)
        attach_media(session.caches, media, len(session.tokens))
        if plan.policy.max_k or plan.lookup_tokens:
            check_rollback(session.caches.trunk)
        seed = options.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        key = mx.random.key(seed)
        self.run = Run(model, session, plan, options, key, batch.tokenizer)
        self.todo = prompt
        self.held = len(session.tokens)  # the token index of prompt[0]
        self.step = options.prefill_step_size
        # after ``mark`` tokens of ``prompt``, ``on_mark(snapshot)`` (the server
        # keeps a system prompt's caches apart); a marked admission prefills alone
        self.mark: Optional[int] = None
        self.on_mark: Optional[Callable[[Session], None]] = None
        self.ran = 0

    @property
    def ready(self) -> bool:
        return not self.todo

    @property
    def session(self) -> Session:
        """The `Session` being filled (its state is None before the first chunk)."""
        return self.run.session

    def advance(self) -> int:
        """Run the trunk over the next chunk of the prompt (one that ends at
        ``mark``, if the chunk would pass it); returns its tokens."""
        self.batch.interrupted()
        self.fresh = False
        size = self.step
        if self.mark is not None and self.ran < self.mark:
            size = min(size, self.mark - self.ran)
        size = self._whole_images(size)
        chunk, self.todo = self.todo[:size], self.todo[size:]
        model, s, kv = self.batch.model, self.run.session, self.options.kv
        if s.state is None:
            s.state = prefill(model, s.caches, chunk, self.batch.depth, self.step, kv)
        else:
            s.state = append(model, s.caches, s.state, chunk, self.step, kv)
        self.ran += len(chunk)
        if self.ran == self.mark and self.on_mark is not None:
            self.on_mark(s.snapshot())
        return len(chunk)

    def _whole_images(self, size: int) -> int:
        """``size`` tokens of the prompt next, or as many as end the chunk's trunk
        pass (which leaves its last token pending) off the inside of an image
        (`mlx_mtp.speculative.chunk_stop`)."""
        done = self.held + self.ran  # committed before this chunk
        if not done:  # the first pass holds no pending token
            return chunk_stop(self.batch.model, self.session.caches, 0, 0, size - 1) + 1
        end = chunk_stop(
            self.batch.model, self.session.caches, 0, done - 1, done + size - 1
        )
        return end + 1 - done

    @property
    def whole_images(self) -> bool:
        """Whether its prompt has images that must each be in one pass: it is then
        prefilled alone (`prefill_together` pads and cuts prompts together)."""
        return bool(getattr(self.batch.model.trunk, "images_whole", False)) and (
            of_caches(self.session.caches) is not None
        )

    def row(self, eos: Iterable[int]) -> Row:
        self.run.begin()
        return Row(self.uid, self.run, frozenset(eos))


PAD_WASTE = 1.25  # prompts prefilled together: padded tokens over real ones, at most


def prefill_groups(admissions: Sequence[Admission]) -> List[List[Admission]]:
    """The fresh ``admissions`` in groups to prefill together (`prefill_together`):
    longest prompt first, each group padded to its longest with at most
    `PAD_WASTE` times its tokens; the others (going on from a session, or begun)
    alone, in order."""
    fresh = sorted(
        (a for a in admissions if a.fresh), key=lambda a: len(a.todo), reverse=True
    )
    groups: List[List[Admission]] = []
    for a in fresh:
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * len(g[0].todo) <= PAD_WASTE * (
            sum(len(x.todo) for x in g) + len(a.todo)
        ):
            g.append(a)
        else:
            groups.append([a])
    return groups + [[a] for a in admissions if not a.fresh]


def prefill_together(admissions: Sequence[Admission]) -> None:
    """Prefill fresh admissions of one batch in one trunk pass per chunk: their
    prompts left-padded to the longest, in one-off batch caches (padded entries
    hidden, recurrent layers masked as mlx-lm's batched prefill masks them). Each is
    then ready, its session as its own `Admission.advance` calls would leave it."""
    alone = [a for a in admissions if not a.fresh or len(a.todo) < 2 or a.whole_images]
    if len(admissions) - len(alone) < 2:
        alone = admissions
    for a in alone:  # a one-token prompt runs no trunk pass
        while not a.ready:
            a.advance()
    admissions = [a for a in admissions if not a.ready]
    if not admissions:
        return
    batch = admissions[0].batch
    batch.interrupted()
    model, depth = batch.model, batch.depth
    todos = [a.todo[:-1] for a in admissions]  # the last token is left pending
    step = min(a.step for a in admissions)
    group = to_batch(admissions[0].session.caches)
    for a in admissions[1:]:
        group = batch_cache.join(group, to_batch(a.session.caches))
    longest = max(map(len, todos))
    padded = [[0] * (longest - len(t)) + t for t in todos]
    hidden: List[list] = [[] for _ in admissions]
    for start in range(0, longest, step):
        width = min(step, longest - start)
        pads = [min(max(longest - len(t) - start, 0), width) for t in todos]
        ids = mx.array([p[start : start + width] for p in padded], dtype=mx.int32)
        batch_cache.pad_pass(group.trunk, pads)
        h = model.hidden(ids, group.trunk)  # (B, width, H)
        batch_cache.pad_pass(group.trunk, None)
        if depth:
            for i, pad in enumerate(pads):
                hidden[i].append(h[i : i + 1, pad:])
        mx.eval([c.state for c in group.trunk], [x[-1:] for x in hidden if x])
        mx.clear_cache()
    for i, a in enumerate(admissions):
        session = a.run.session
        session.caches = batch_cache.to_single(group, i)
        session.state = DecodeState(list(a.todo), None, 0, depth)
        if depth:
            rows = hidden[i] or [mx.zeros((1, 0, model.hidden_width))]
            session.state.hidden = mx.concatenate(rows, axis=1)
            extend_mtp(model, session.caches.mtp, session.state, step)
        a.todo, a.fresh = [], False


class Batch:
    """The streams decoded together and their caches.

    Args:
        model: An `mlx_mtp.models.base.Model` whose caches can batch
            (`mlx_mtp.batch_cache.batch_support`).
        options: The batch's `DecodeOptions`: the longest draft they allow sets the
            MTP layers in use (`depth_for`), the same for every row.
        eos: Token ids that end a row's stream.
        length: Caps the drafts of the rows whose options say ``-k auto`` (a
            `mlx_mtp.batch_costs.BatchLength`; default: one from the model's batch
            costs, measured on first need for batches up to ``max_batch``).
        max_batch: The most rows the caller puts in the batch (the batch sizes
            whose costs are measured).
        keep_sessions: A row leaving the batch (finished or removed) gets
            ``row.session``, a `Session` of its caches to go on from later (a
            server's prompt cache of the conversation).
        tokenizer: The model's tokenizer, for rows whose options have a grammar.

    Every method is called from one thread (the generation loop's).
    """

    def __init__(
        self,
        model,
        options=None,
        eos: Iterable[int] = (),
        length=None,
        keep_sessions: bool = False,
        max_batch: int = DEFAULT_MAX_BATCH,
        tokenizer=None,
    ):
        reason = batch_support(model)
        if reason is not None:
            raise MTPError(reason)
        self.options = DecodeOptions.build(options)
        self.depth = depth_for(model, self.options)
        self.model, self.eos = model, frozenset(eos)
        self.length, self.keep_sessions = length, keep_sessions
        self.max_batch, self.tokenizer = max_batch, tokenizer
        self.rows: List[Row] = []  # the rows of the rounds launched
        self.joining: List[Row] = []  # joined, in the rounds launched from now on
        self.caches: Optional[Caches] = None
        self.queued: List[Round] = []  # launched, not committed (oldest first)
        self._next = None  # the next round's `RoundPlan`, made ahead (`step`)
        self._done_at: Optional[float] = None  # the last round's results (`_time`)
        self._last_K: Optional[int] = None  # and its drafts

    def __len__(self) -> int:
        """The streams in the batch (those joining included)."""
        return len(self.rows) + len(self.joining)

    def admit(
        self, uid, prompt, options=None, session=None, policy=None, media=None
    ) -> Admission:
        """A new stream to prefill (`Admission.advance`) and then `join` (``media``:
        its prompt's images, `mlx_mtp.media.Media`)."""
        options = DecodeOptions.build(options)
        if options.max_kv_size is not None or options.kv.bits is not None:
            raise MTPError("a batched stream cannot use max_kv_size or kv_bits")
        if options.grammar is not None and self.tokenizer is None:
            raise MTPError("a grammar (json_schema, regex) needs the model's tokenizer")
        return Admission(self, uid, prompt, options, session, policy, media)

    def join(self, admission: Admission, eos: Optional[Iterable[int]] = None) -> Row:
        """Add an admitted stream to the batch (its prefill is finished first). It
        is in the rounds launched from the next `step` on; ``eos``: the tokens that
        end it (default: the batch's). Its rules (a grammar, compiled if the cache
        lacks it) are made first: if that raises, the batch is as it was."""
        while not admission.ready:
            admission.advance()
        row = admission.row(self.eos if eos is None else eos)
        self.joining.append(row)
        return row

    def remove(self, uids: Iterable[Any]) -> List[Row]:
        """Drop the rows of ``uids`` now (rounds already launched go on for the
        others); returns them. With ``keep_sessions``, each gets ``row.session``."""
        uids = set(uids)
        gone = [r for r in self.rows + self.joining if r.uid in uids]
        for row in gone:
            row.run.drafting.remember()
        if self.keep_sessions:
            for row in gone:
                if row.failure is None:  # a failed row's state is not kept
                    row.session = self.session_of(row)
        self.joining = [r for r in self.joining if r.uid not in uids]
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        if len(keep) < len(self.rows):
            self.interrupted()
            self.rows = [self.rows[i] for i in keep]
            if keep:
                batch_cache.select(self.caches, keep)
                self.queued = [rnd.select(keep) for rnd in self.queued]
                self._next = self._next and self._next.select(keep)
            else:
                self.caches, self.queued, self._next = None, [], None
        return gone

    def session_of(self, row: Row) -> Session:
        """A `Session` holding ``row``'s committed caches and state (to go on from
        later), whatever rounds are launched: only that row's arrays, each in a
        buffer of its own (no rollback marks of the batch's rounds, no slice of a
        longer hidden buffer), as `Session.nbytes` counts them."""
        if row in self.joining:
            return Session(row.run.caches, row.state)
        b = self.rows.index(row)
        bases = self.queued[0].marks if self.queued else None
        limits = (len(row.state.tokens) - 1, row.state.frontier)
        caches = batch_cache.to_single(self.caches, b, limits, bases)
        return Session(caches, kept_state(row.state))

    def step(self) -> List[RowOutput]:
        """Commit one round of every row (launching it first if none is): their
        outputs; finished rows leave the batch. The next round is launched before
        this one's outputs are returned (while a plain round runs, the plain round
        after it is launched too: one host sync per round, the device kept busy)."""
        if not self.queued:
            self._admit_joining()
            if not self.rows:
                return []
            self.queued.append(self._launch())
        rnd = self.queued[0]
        if len(self.queued) == 1 and self._can_queue_behind(rnd):
            self._next = plan(self.runs, ahead=1, cap=self._cap)
            if self._next.K == 0:
                self.queued.append(self._launch(pending=rnd.next_tokens))
        mx.eval(rnd.accepted, rnd.next_tokens, rnd.drafts)
        self._time(rnd)
        outputs = self._commit(rnd)
        self.queued.pop(0)
        done = [o.uid for o in outputs if o.finish_reason is not None]
        if done:
            self.remove(done)
        if not self.queued:
            self._admit_joining()
            if self.rows:
                self.queued.append(self._launch())
        return outputs

    @property
    def runs(self) -> List[Run]:
        """The rows' streams, in the batch's order."""
        return [r.run for r in self.rows]

    def draft_once(self) -> None:
        """Draft one token for every row and undo it (to time a draft step:
        `mlx_mtp.batch_costs`); no round may be launched."""
        rp = plan(self.runs)
        rp.ks, rp.lookups = [1] * len(self.rows), [None] * len(self.rows)
        drafts, _, _ = draft(self.model, self.caches, self.runs, rp, self.depth)
        mx.eval(drafts)
        keep_below(self.caches.mtp, [r.state.frontier for r in self.rows])

    def _can_queue_behind(self, rnd: Round) -> bool:
        """Whether the round after ``rnd`` may be planned before ``rnd`` is
        committed: as for one stream (`Run.pipelined`), for every row, and nobody
        waits to join."""
        return not self.joining and all(r.run.pipelined(rnd) for r in self.rows)

    def _admit_joining(self) -> None:
        """Put the joining rows' caches into the batch (no round is launched); their
        single-stream caches are dropped (the batch holds their only copy)."""
        if self.joining:
            self.interrupted()
        for row in self.joining:
            caches = to_batch(row.run.caches)
            row.run.session.caches = None
            if self.caches is None:
                self.caches = caches
            else:
                self.caches = batch_cache.join(self.caches, caches)
            self.rows.append(row)
        self.joining = []

    def _time(self, rnd: Round) -> None:
        """Tell `BatchLength` how long ``rnd`` took: from the last round's results
        to its own (host work, launch and device time: what a round costs in a
        steady run), if nothing else ran between them (no prefill, no row joined
        or left: they unset ``_done_at``), its drafts, if any, are the heads' and,
        if it is plain, so was the round before (plain rounds run two deep)."""
        now, last, after = time.perf_counter(), self._done_at, self._last_K
        self._done_at, self._last_K = now, rnd.K
        ks = rnd.plan.ks
        if last is None or self.length is None or len(ks) < 2:
            return
        if rnd.K == 0 and after != 0:  # timed behind a plain round only
            return
        if any(k and rnd.plan.source(b) != "heads" for b, k in enumerate(ks)):
            return
        self.length.observe(len(ks), rnd.K, now - last)

    def interrupted(self) -> None:
        """Work other than rounds ran on the device (a prefill, a join): the next
        round is not timed."""
        self._done_at = None

    def _cap(self, asks: List[int], auto: List[bool]) -> Optional[int]:
        """The cap `BatchLength` puts on the auto rows' drafts (its costs measured
        on first need), or None."""
        if len(self.rows) == 1 or not any(auto):
            return None
        if self.length is None:
            costs = model_batch_costs(self.model, self.max_batch, filled_batch)
            self.length = BatchLength(costs, max(self.depth, 1))
        return self.length.cap(self.rows, asks, auto)

    def _launch(self, pending: Optional[mx.array] = None) -> Round:
        """Build a round (draft, verify, accept) lazily and start evaluating it,
        from the plan made ahead (`step`) or a new one; ``pending``: the rows'
        pending tokens when not committed yet (a plain round launched behind a plain
        round)."""
        rp, self._next = self._next, None
        if rp is None:
            rp = plan(self.runs, cap=self._cap)
        elif len(rp.ks) < len(self.rows):  # rows joined since: plain this round
            rp = rp.extended(self.runs[len(rp.ks) :])
        return launch(self.model, self.caches, self.runs, rp, self.depth, pending)

    def _commit(self, rnd: Round) -> List[RowOutput]:
        """Commit a round: each row's accepted drafts and next token, up to its
        first EOS and its ``max_tokens``; every cache keeps exactly those. A row
        that failed gets its error output instead (its caches keep the round's
        tokens, as any row's, until it leaves)."""
        accepted, nexts = rnd.accepted.tolist(), rnd.next_tokens.tolist()
        drafts = rnd.drafts.tolist()
        outputs, committed = [], []
        for b, row in enumerate(self.rows):
            a = accepted[b]
            new, finish = drafts[b][:a] + [nexts[b]], None
            if row.failure is None:
                new, finish = self._commit_tokens(rnd, b, a, new)
            committed.append(new)
            outputs.append(self._output(rnd, b, a, new, finish))
        commit(self.caches, self.runs, rnd, committed, self.depth)
        return outputs

    def _commit_tokens(self, rnd: Round, b: int, a: int, made: List[int]):
        """Row b's tokens of ``rnd`` (``made``: its ``a`` accepted drafts and next
        token) cut at its first EOS and its ``max_tokens``, and its finish reason:
        its statistics, policies and rules move on over them."""
        row, rp = self.rows[b], rnd.plan
        new, finish = self._cut(row, made)
        k, source, vocab = rp.ks[b], rp.source(b), rp.vocab(b)
        row.stats.record(k, a, source, vocab)
        row.stats.emitted += len(new) - len(made)
        row.run.observe(k, a, source, vocab, made, rnd.tail(b, a))
        if row.run.rules is not None:
            row.run.rule("commit", new)
        B = len(self.rows)
        row.batch_sizes[B] = row.batch_sizes.get(B, 0) + 1
        return new, finish

    def _output(self, rnd: Round, b: int, a: int, new, finish) -> RowOutput:
        """Row b's output of ``rnd``: its new tokens, or its error if it failed."""
        row = self.rows[b]
        if row.failure is not None:
            V = rnd.logprobs.shape[-1]
            return failed_output(row.uid, row.failure, row.stats, V, row.batch_sizes)
        return RowOutput(
            row.uid,
            new,
            rnd.logprobs[b, : len(new)],
            [i < a for i in range(len(new))],
            finish,
            row.stats,
            row.batch_sizes,
            source=rnd.plan.source(b) if a else None,
        )

    @staticmethod
    def _cut(row: Row, made: List[int]):
        """A row's new tokens up to its first EOS and its ``max_tokens``, and its
        finish reason (None: it goes on)."""
        for i, t in enumerate(made):
            if t in row.eos:
                return made[: i + 1], "stop"
        limit = row.run.max_tokens
        if limit >= 0 and row.stats.emitted + len(made) >= limit:
            return made[: limit - row.stats.emitted], "length"
        return made, None


def warm_batch_costs(model, max_batch: int = DEFAULT_MAX_BATCH, on_measure=None):
    """Read, or measure once, the model's batch costs for batches of up to
    ``max_batch`` rows (`mlx_mtp.batch_costs.model_batch_costs`), so that no round
    waits for them later; ``on_measure`` is called before a measurement."""
    if model.num_mtp_layers:
        model_batch_costs(model, max_batch, filled_batch, on_measure)


def filled_batch(model, rows: int, context: int) -> "Batch":
    """A batch of ``rows`` streams of ``context`` tokens each (to time its passes:
    `mlx_mtp.batch_costs.measure_batch_costs`)."""
    k = 1 if model.num_mtp_layers else 0
    opts = DecodeOptions(num_draft_tokens=k, draft_source="heads")
    batch = Batch(model, opts)
    V = model.args.vocab_size
    for b in range(rows):
        ids = [(7 * b + 3 * i + 1) % V for i in range(context)]
        batch.join(batch.admit(b, ids, opts.replace(max_tokens=-1)))
    batch._admit_joining()
    return batch


def depth_for(model, options: DecodeOptions) -> int:
    """MTP layers in use for ``options``: as many as their longest draft needs."""
    k = options.num_draft_tokens
    longest = longest_draft(model, options.max_draft_tokens) if k == "auto" else k
    return min(longest, model.num_mtp_layers)


def run_batch(
    model,
    prompts: Sequence[List[int]],
    options: Sequence[DecodeOptions],
    eos: Iterable[int] = (),
    max_batch: int = DEFAULT_MAX_BATCH,
    tokenizer=None,
    media: Optional[Sequence] = None,
) -> Iterator[RowOutput]:
    """Decode ``prompts`` (token ids), prompt i with ``options[i]`` (and its images'
    ``media[i]``: a `mlx_mtp.media.Media`, a `mlx_mtp.images.PendingMedia`, made
    when the prompt joins, or None), at most
    ``max_batch`` at a time: a prompt joins as soon as a row is free. Yields each
    round's `RowOutput` per row (``uid``: the prompt's index), in round order. A
    prompt that fails alone (its rules raise: see the module's docstring; or, one
    at a time, its decoding raises) ends with an output whose ``finish_reason`` is
    "error"; the others go on.

    The batch's MTP layers are set by the options allowing the longest draft. A model
    whose caches cannot batch (`batch_support`) decodes the prompts one at a time
    through the single-stream loop, with the same outputs. ``tokenizer``: for
    options with a grammar.
    """
    if len(options) != len(prompts):
        raise MTPError(f"{len(prompts)} prompts but {len(options)} sets of options")
    if type(max_batch) is not int or max_batch < 1:
        raise MTPError(f"max_batch must be a whole number >= 1, got {max_batch!r}")
    if batch_support(model) is not None:
        yield from _one_at_a_time(
            model, prompts, options, frozenset(eos), tokenizer, media
        )
        return
    widest = max(options, key=lambda o: depth_for(model, o))
    # the batch sizes it reaches: the costs of larger ones are not measured
    rows = min(max_batch, len(prompts))
    batch = Batch(model, widest, eos, max_batch=rows, tokenizer=tokenizer)
    waiting = list(range(len(prompts)))
    while waiting or len(batch):
        new = []  # prompts arriving together are prefilled together
        while waiting and len(batch) + len(new) < max_batch:
            i = waiting.pop(0)
            try:
                images = _media_of(media, i)
            except MTPError as e:  # its images, read now: this prompt's failure
                yield failed_output(i, e, None, model.args.vocab_size)
                continue
            new.append(batch.admit(i, prompts[i], options[i], media=images))
        for group in prefill_groups(new):
            prefill_together(group)
        for admission in new:
            try:
                batch.join(admission)  # its grammar may be refused
            except Exception as e:
                stats = admission.run.stats
                yield failed_output(admission.uid, e, stats, model.args.vocab_size)
        yield from batch.step()


def _media_of(media: Optional[Sequence], i: int):
    """Prompt i's `mlx_mtp.media.Media` (None: none), made now if it is a
    `mlx_mtp.images.PendingMedia`."""
    found = media[i] if media else None
    return found() if callable(found) else found


def _one_at_a_time(
    model, prompts, options, eos, tokenizer, media=None
) -> Iterator[RowOutput]:
    from .speculative import mtp_generate_step

    for i, (prompt, opts) in enumerate(zip(prompts, options)):
        try:
            images = _media_of(media, i)
        except MTPError as e:
            yield failed_output(i, e, None, model.args.vocab_size)
            continue
        steps = mtp_generate_step(
            prompt, model, opts, tokenizer=tokenizer, media=images
        )
        n, stats = 0, None
        try:
            for step in steps:
                n, stats = n + 1, step.stats
                stop = step.token in eos
                last = stop or n == opts.max_tokens
                finish = ("stop" if stop else "length") if last else None
                yield RowOutput(
                    i,
                    [step.token],
                    step.logprobs[None],
                    [step.from_draft],
                    finish,
                    step.stats,
                    {1: step.stats.rounds},
                    source=step.source,
                )
                if last:
                    steps.close()
                    break
        except Exception as e:  # this prompt's failure only
            sizes = {1: stats.rounds} if stats is not None else {}
            yield failed_output(i, e, stats, model.args.vocab_size, sizes)

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
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence

import mlx.core as mx

from . import batch_cache
from .batch_cache import batch_support, rewind_rows, to_batch
from .batch_costs import BatchLength, model_batch_costs
from .cache import (
    Caches,
    Capture,
    RecurrentCache,
    begin_verify,
    check_rollback,
    make_caches,
)
from .defaults import DEFAULT_MAX_BATCH
from .errors import MTPError, one_line
from .options import DecodeOptions
from .rejection import accept_stochastic
from .resolve import drafting
from .sampling import SamplingParams, filtered_logprobs, log_softmax, sample
from .speculative import (
    DecodeState,
    Draft,
    Round,
    Run,
    Session,
    append,
    draft_lookup,
    extend_mtp,
    prefill,
)
from .stats import MTPStats


@dataclass
class Row:
    """One stream of a batch: ``run`` holds its decode state, settings, key, draft
    policies and statistics, as the single-stream loop keeps them (`Run`)."""

    uid: Any
    run: Run
    eos: frozenset = frozenset()
    batch_sizes: Dict[int, int] = field(default_factory=dict)  # rounds per batch size
    session: Optional[Session] = None  # set on leaving (`Batch.keep_sessions`)
    # the round being built: drafts asked for, a lookup draft, the round's keys
    k: int = 0
    lookup: Optional[List[int]] = None
    draft_key: Optional[mx.array] = None
    accept_key: Optional[mx.array] = None
    failure: Optional[Exception] = None  # its rules raised: it leaves at commit

    @property
    def state(self) -> DecodeState:
        return self.run.state

    @property
    def stats(self) -> MTPStats:
        return self.run.stats

    @property
    def params(self) -> SamplingParams:
        return self.run.params

    @property
    def vocab(self) -> Optional[int]:
        """The draft vocabulary of the row's next heads draft."""
        return self.run.policy.vocab

    def room(self) -> int:
        """The most drafts this row may make without passing ``max_tokens``."""
        return self.run.room(self.stats.emitted)

    @property
    def ruled(self) -> bool:
        """Whether the row has rules (`mlx_mtp.processors.Rules`) that did not fail."""
        return self.run.rules is not None and self.failure is None

    def rule(self, method: str, *args):
        """``self.run.rules.<method>(*args)``; None if it raises, the exception then
        the row's ``failure`` (its rules are left out from then on)."""
        try:
            return getattr(self.run.rules, method)(*args)
        except Exception as e:
            self.failure = e
            return None


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


@dataclass
class BatchRound:
    """One launched round: row b drafted ``ks[b]`` of the ``K`` (its ``lookups[b]``
    tokens, or the heads' from draft vocabulary ``vocabs[b]``); ``heads``: whether
    the MTP layers ran (every row's frontier then moves)."""

    ks: List[int]
    lookups: List[Optional[List[int]]]
    vocabs: List[Optional[int]]
    heads: bool
    drafts: mx.array  # (B, K)
    hidden: mx.array  # (B, K + 1, H)
    logprobs: mx.array  # (B, K + 1, V)
    accepted: mx.array  # (B,)
    next_tokens: mx.array  # (B,)
    marks: list  # `mlx_mtp.cache.begin_verify`'s, per trunk cache

    @property
    def K(self) -> int:
        return self.drafts.shape[1]

    def select(self, rows: List[int]) -> "BatchRound":
        """The round of ``rows`` only (rows that left the batch dropped)."""
        idx = mx.array(rows, dtype=mx.int32)
        return BatchRound(
            [self.ks[i] for i in rows],
            [self.lookups[i] for i in rows],
            [self.vocabs[i] for i in rows],
            self.heads,
            self.drafts[idx],
            self.hidden[idx],
            self.logprobs[idx],
            self.accepted[idx],
            self.next_tokens[idx],
            [batch_cache.select_mark(m, idx) for m in self.marks],
        )


class Admission:
    """A stream being prefilled alone, one chunk per `advance`, before it joins.

    ``session``: go on from a `Session` (its caches and state are filled in, and the
    prompt is what follows its tokens); ``policy``: a `DraftPolicy` for its heads'
    drafts instead of the options' (`mtp_generate_step`)."""

    def __init__(self, batch: "Batch", uid, prompt, options, session=None, policy=None):
        prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        if not prompt:
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
        if plan.policy.max_k or plan.lookup_tokens:
            check_rollback(session.caches.trunk)
        seed = options.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        key = mx.random.key(seed)
        self.run = Run(model, session, plan, options, key, batch.tokenizer)
        self.todo = prompt
        self.step = options.prefill_step_size

    @property
    def ready(self) -> bool:
        return not self.todo

    @property
    def session(self) -> Session:
        """The `Session` being filled (its state is None before the first chunk)."""
        return self.run.session

    def advance(self) -> None:
        """Run the trunk over the next chunk of the prompt."""
        self.fresh = False
        chunk, self.todo = self.todo[: self.step], self.todo[self.step :]
        model, s, kv = self.batch.model, self.run.session, self.options.kv
        if s.state is None:
            s.state = prefill(model, s.caches, chunk, self.batch.depth, self.step, kv)
        else:
            s.state = append(model, s.caches, s.state, chunk, self.step, kv)

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
    alone = [a for a in admissions if not a.fresh or len(a.todo) < 2]
    if len(admissions) - len(alone) < 2:
        alone = admissions
    for a in alone:  # a one-token prompt runs no trunk pass
        while not a.ready:
            a.advance()
    admissions = [a for a in admissions if not a.ready]
    if not admissions:
        return
    batch = admissions[0].batch
    model, depth = batch.model, batch.depth
    todos = [a.todo[:-1] for a in admissions]  # the last token is left pending
    step = min(a.step for a in admissions)
    group = to_batch(admissions[0].session.caches)
    for i, a in enumerate(admissions[1:], 1):
        group = batch_cache.join(group, to_batch(a.session.caches), [i, 1])
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
        session.caches = batch_cache.to_single(group, i, make_caches(model))
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
        self.options = DecodeOptions.build(options).check()
        self.depth = depth_for(model, self.options)
        self.model, self.eos = model, frozenset(eos)
        self.length, self.keep_sessions = length, keep_sessions
        self.max_batch, self.tokenizer = max_batch, tokenizer
        self.rows: List[Row] = []  # the rows of the rounds launched
        self.joining: List[Row] = []  # joined, in the rounds launched from now on
        self.caches: Optional[Caches] = None
        self.queued: List[BatchRound] = []  # launched, not committed (oldest first)
        self._planned = False  # the rows' next drafts are planned already

    def __len__(self) -> int:
        """The streams in the batch (those joining included)."""
        return len(self.rows) + len(self.joining)

    def admit(self, uid, prompt, options=None, session=None, policy=None) -> Admission:
        """A new stream to prefill (`Admission.advance`) and then `join`."""
        options = DecodeOptions.build(options).check()
        if options.max_kv_size is not None or options.kv.bits is not None:
            raise MTPError("a batched stream cannot use max_kv_size or kv_bits")
        if options.grammar is not None and self.tokenizer is None:
            raise MTPError("a grammar (json_schema, regex) needs the model's tokenizer")
        return Admission(self, uid, prompt, options, session, policy)

    def join(self, admission: Admission) -> Row:
        """Add an admitted stream to the batch (its prefill is finished first). It
        is in the rounds launched from the next `step` on. Its rules (a grammar,
        compiled if the cache lacks it) are made first: if that raises, the batch
        is as it was."""
        while not admission.ready:
            admission.advance()
        row = admission.row(self.eos)
        self.joining.append(row)
        return row

    def remove(self, uids: Iterable[Any]) -> List[Row]:
        """Drop the rows of ``uids`` now (rounds already launched go on for the
        others); returns them. With ``keep_sessions``, each gets ``row.session``."""
        uids = set(uids)
        gone = [r for r in self.rows + self.joining if r.uid in uids]
        if self.keep_sessions:
            for row in gone:
                if row.failure is None:  # a failed row's state is not kept
                    row.session = self.session_of(row)
        self.joining = [r for r in self.joining if r.uid not in uids]
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            if keep:
                batch_cache.select(self.caches, keep)
                self.queued = [rnd.select(keep) for rnd in self.queued]
            else:
                self.caches, self.queued = None, []
        return gone

    def session_of(self, row: Row) -> Session:
        """A `Session` holding ``row``'s committed caches and state (to go on from
        later), whatever rounds are launched."""
        like = make_caches(self.model)
        if row in self.joining:
            return Session(row.run.caches, row.state)
        b = self.rows.index(row)
        bases = self.queued[0].marks if self.queued else None
        limits = (len(row.state.tokens) - 1, row.state.frontier)
        caches = batch_cache.to_single(self.caches, b, like, limits, bases)
        return Session(caches, row.state)

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
            self._plan(ahead=1)
            if all(r.k == 0 for r in self.rows):
                self.queued.append(self._launch(pending=rnd.next_tokens))
            else:
                self._planned = True
        mx.eval(rnd.accepted, rnd.next_tokens, rnd.drafts)
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

    def draft_once(self) -> None:
        """Draft one token for every row and undo it (to time a draft step:
        `mlx_mtp.batch_costs`); no round may be launched."""
        for r in self.rows:
            r.draft_key = mx.random.key(0)
        ks = [1] * len(self.rows)
        drafts, _ = draft_rows(self.model, self.caches, self.rows, ks, self.depth)
        mx.eval(drafts)
        for c in self.caches.mtp:
            c.keep_below([r.state.frontier for r in self.rows])

    def _can_queue_behind(self, rnd: BatchRound) -> bool:
        """Whether the round after ``rnd`` may be planned before ``rnd`` is
        committed: ``rnd`` drafts nothing (its commit takes its one token whatever
        its value), nobody waits to join, and no row drafts from lookups (which
        need the tokens' values)."""
        return (
            rnd.K == 0
            and not self.joining
            and not any(r.run.drafting.lookup_tokens for r in self.rows)
            and not any(r.run.rules and r.run.rules.needs_tokens for r in self.rows)
            and not any(r.failure for r in self.rows)  # it leaves at this commit
        )

    def _bases(self) -> list:
        """Marks for a plain round, which never rolls back: the recurrent caches'
        contents before it (what a session taken meanwhile holds), and no
        per-position recording."""
        return [
            Capture(list(c.cache)) if isinstance(c, RecurrentCache) else None
            for c in self.caches.trunk
        ]

    def _admit_joining(self) -> None:
        """Put the joining rows' caches into the batch (no round is launched); their
        single-stream caches are dropped (the batch holds their only copy)."""
        for row in self.joining:
            caches = to_batch(row.run.caches)
            row.run.session.caches = None
            if self.caches is None:
                self.caches = caches
            else:
                rows = [len(self.rows), 1]
                self.caches = batch_cache.join(self.caches, caches, rows)
            self.rows.append(row)
        self.joining = []

    def _plan(self, ahead: int = 0) -> None:
        """Set each row's drafts for the next round: ``row.k`` from its policy (its
        heads) or its lookup draft (``row.lookup``), capped by its room (``ahead``:
        tokens it yields before that round) and, for the rows whose text does not
        depend on it (`_cappable`), by `_cap`. A heads round runs every MTP layer in
        use, however few drafts its rows ask for (`draft_rows`), so that every
        layer's frontier moves (see `Run.plan`)."""
        for r in self.rows:
            room = r.run.room(r.stats.emitted + ahead)
            r.k = min(r.run.policy.next(), room)
            if len(r.state.tokens) - 1 + ahead <= r.state.frontier:
                r.k = 0  # no hidden state to draft from yet (a one-token prompt)
            r.lookup = None
            if r.run.drafting.lookup_tokens and r.failure is None:
                try:
                    r.lookup = r.run.lookup_draft(r.k)  # its grammar may raise
                except Exception as e:
                    r.failure, r.k = e, 0
                r.k = len(r.lookup) if r.lookup else r.k
        auto = [_cappable(r) for r in self.rows]
        cap = self._cap([r.k for r in self.rows], auto)
        if cap is not None:
            for r, free in zip(self.rows, auto):
                if free and r.lookup:
                    r.lookup = r.lookup[:cap] or None
                    r.k = len(r.lookup or ())
                elif free:
                    r.k = min(r.k, cap)

    def _cap(self, asks: List[int], auto: List[bool]) -> Optional[int]:
        """The cap `BatchLength` puts on the auto rows' drafts (its costs measured
        on first need), or None."""
        if len(self.rows) == 1 or not any(auto):
            return None
        if self.length is None:
            costs = model_batch_costs(self.model, self.max_batch, filled_batch)
            self.length = BatchLength(costs, max(self.depth, 1))
        return self.length.cap(self.rows, asks, auto)

    def _launch(self, pending: Optional[mx.array] = None) -> BatchRound:
        """Build a round (draft, verify, accept) lazily and start evaluating it;
        ``pending``: the rows' pending tokens when not committed yet (a plain round
        launched behind a plain round)."""
        if not self._planned:
            self._plan()
        self._planned = False
        rows = self.rows
        for r in rows:
            r.run.key, sub = mx.random.split(r.run.key)
            r.draft_key, r.accept_key = mx.random.split(sub)
        for b, r in enumerate(rows):
            if r.ruled:
                r.rule("begin", None if pending is None else pending[b])
        heads = [0 if r.lookup else r.k for r in rows]
        drafts, q = draft_rows(self.model, self.caches, rows, heads, self.depth)
        drafts, q = _with_lookups(rows, drafts, q, self.model.args.vocab_size)
        ks = [r.k for r in rows]
        for r in rows:
            for token in r.lookup or ():
                if r.ruled:
                    r.rule("push", token)
            if r.ruled:
                r.rule("end_draft")
        if pending is None:
            pending = mx.array([r.state.tokens[-1] for r in rows], dtype=mx.int32)
        ids = mx.concatenate([pending[:, None], drafts], axis=1)  # (B, K + 1)
        marks = begin_verify(self.caches.trunk) if ks and max(ks) else self._bases()
        hidden = self.model.hidden(ids, self.caches.trunk)  # (B, K + 1, H)
        logits = _verify_logits(rows, self.model.logits(hidden), drafts)
        logprobs = log_softmax(logits)  # (B, K + 1, V)
        accepted, next_tokens = accept_rows(rows, ks, drafts, q, logprobs)
        mx.async_eval(accepted, next_tokens, drafts, hidden, logprobs)
        lookups = [r.lookup for r in rows]
        vocabs = [None if r.lookup else r.vocab for r in rows]
        return BatchRound(
            ks,
            lookups,
            vocabs,
            max(heads) > 0,
            drafts,
            hidden,
            logprobs,
            accepted,
            next_tokens,
            marks,
        )

    def _commit(self, rnd: BatchRound) -> List[RowOutput]:
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
        kept = [len(new) for new in committed]
        drop = [rnd.K + 1 - m for m in kept]
        if any(drop):  # never behind a queued round: a plain round drops nothing
            rewind_rows(self.caches.trunk, rnd.marks, drop)
        for b, row in enumerate(self.rows):
            hidden = rnd.hidden[b : b + 1, : kept[b]]
            _commit_row(row.state, hidden, rnd.heads, self.depth, committed[b])
        if rnd.heads:
            for c in self.caches.mtp:
                c.keep_below([r.state.frontier for r in self.rows])
        return outputs

    def _commit_tokens(self, rnd: BatchRound, b: int, a: int, made: List[int]):
        """Row b's tokens of ``rnd`` (``made``: its ``a`` accepted drafts and next
        token) cut at its first EOS and its ``max_tokens``, and its finish reason:
        its statistics, policies and rules move on over them."""
        row = self.rows[b]
        new, finish = self._cut(row, made)
        source = "lookup" if rnd.lookups[b] else "heads"
        row.stats.record(rnd.ks[b], a, source, rnd.vocabs[b])
        row.stats.emitted += len(new) - len(made)
        draft = Draft(mx.zeros((rnd.ks[b],)), None, 0, source, rnd.vocabs[b])
        row.run.observe(Round(draft, None, None), a, made)
        if row.run.rules is not None:
            row.rule("commit", new)
        B = len(self.rows)
        row.batch_sizes[B] = row.batch_sizes.get(B, 0) + 1
        return new, finish

    def _output(self, rnd: BatchRound, b: int, a: int, new, finish) -> RowOutput:
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


def _cappable(row: Row) -> bool:
    """Whether the batch may cap ``row``'s drafts (`BatchLength`): its options say
    ``-k auto`` and its text does not depend on its draft lengths (greedy, or
    sampled without a seed). A seeded sampled row drafts what its policy asks, as
    alone, so that its random draws, and so its text, are its lone ones."""
    options = row.run.options
    if options.num_draft_tokens != "auto":
        return False
    return row.params.greedy or options.seed is None


def _commit_row(state: DecodeState, hidden, heads: bool, depth: int, tokens) -> None:
    """Append a row's committed tokens and their trunk hidden states ``(1, m, H)``;
    after a heads round, MTP rows up to n - depth stay in the MTP caches (as
    `mlx_mtp.speculative.commit` keeps them) and the rest is recomputed."""
    if state.hidden is not None:
        n = len(state.tokens) - 1
        frontier = max(state.frontier, n - depth + 1) if heads else state.frontier
        kept = state.hidden[:, frontier - state.frontier :]
        state.hidden = mx.concatenate([kept, hidden], axis=1)
        state.frontier = frontier
    state.tokens.extend(tokens)


def _with_lookups(rows: List[Row], drafts: mx.array, q, vocab_size: int):
    """The heads' ``(B, K_heads)`` drafts with every lookup row's own tokens in its
    row, padded to the longest draft of the round; ``q`` per row (a point mass on
    each lookup token, as `mlx_mtp.speculative.draft_lookup`)."""
    K = max(r.k for r in rows)
    B = len(rows)
    if drafts.shape[1] < K:
        fill = mx.zeros((B, K - drafts.shape[1]), dtype=mx.int32)
        drafts = mx.concatenate([drafts, fill], axis=1)
    if not any(r.lookup for r in rows):
        return drafts, q
    q = list(q) if q is not None else [None] * B
    found = []
    for b, r in enumerate(rows):
        if r.lookup:
            found.append(r.lookup + [0] * (K - len(r.lookup)))
            if not r.params.greedy:
                q[b] = draft_lookup(r.lookup, r.params, vocab_size).logprobs
        else:
            found.append([0] * K)
    is_lookup = mx.array([bool(r.lookup) for r in rows])[:, None]
    return mx.where(is_lookup, mx.array(found, dtype=mx.int32), drafts), q


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
    longest = options.max_draft_tokens if k == "auto" else k
    return min(longest, model.num_mtp_layers)


def _draft_logits(model, rows: List[Row], h: mx.array) -> mx.array:
    """``(B, V)`` draft logits of ``h`` ``(B, H)``, each row's from its own draft
    vocabulary (`Model.draft_logits`)."""
    vocabs = [r.vocab for r in rows]
    first = vocabs[0]
    logits = model.draft_logits(h, first)
    for v in set(vocabs) - {first}:
        mine = mx.array([x == v for x in vocabs])[:, None]
        logits = mx.where(mine, model.draft_logits(h, v), logits)
    return logits


def _ruled_logits(model, rows: List[Row], logits, h, drafts, ks: List[int]):
    """``(B, V)`` draft logits, each row with rules processed as its target row
    after its drafts so far will be (`mlx_mtp.processors.Rules`); a row past its
    ``ks[b]`` drafts, whose drafts are never accepted, is left as it is. A grammar
    that allows none of a draft vocabulary's rows drafts from the whole head (of
    the trunk's hidden states ``h``; None for an assistant's)."""
    j = len(drafts)
    ruled = [b for b, r in enumerate(rows) if r.ruled and j < ks[b]]
    if not ruled:
        return logits
    out = [logits[b : b + 1] for b in range(len(rows))]
    for b in ruled:
        row, mine = rows[b], [d[b : b + 1] for d in drafts]
        processed = row.rule("draft_logits", out[b], mine)
        if processed is None:  # it failed: left as it is
            continue
        out[b] = processed
        if h is None or not row.run.rules.needs_tokens:
            continue
        if not mx.isfinite(out[b]).any().item():
            full = row.rule("draft_logits", model.logits(h[b : b + 1]), mine)
            out[b] = out[b] if full is None else full
    return mx.concatenate(out)


def _push_rows(rows: List[Row], token: mx.array, ks: List[int], j: int) -> None:
    """Give each grammar row its draft j (read to the host), up to its ``ks[b]``."""
    ruled = [
        b
        for b, r in enumerate(rows)
        if r.ruled and r.run.rules.needs_tokens and j < ks[b]
    ]
    if ruled:
        host = token.tolist()
        for b in ruled:
            rows[b].rule("push", host[b])


def _verify_logits(rows: List[Row], logits: mx.array, drafts: mx.array) -> mx.array:
    """``(B, K + 1, V)`` target logits, each row with rules processed row by row
    with its own prefixes (`mlx_mtp.processors.Rules.verify_logits`); a row whose
    rules failed as they are."""
    if not any(r.ruled for r in rows):
        return logits
    out = []
    for b, (r, d) in enumerate(zip(rows, drafts)):
        processed = r.rule("verify_logits", logits[b], d) if r.ruled else None
        out.append(logits[b] if processed is None else processed)
    return mx.stack(out)


def _pick_rows(rows: List[Row], logits: mx.array, keys: List[mx.array]):
    """One draft token per row from ``(B, V)`` logits: argmax for greedy rows, a
    sample from the row's filtered distribution otherwise. Returns ``(B,)`` tokens
    and, when any row samples, each row's ``(1, V)`` draft log-probabilities (None
    for greedy rows)."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)  # (B,)
    if all(r.params.greedy for r in rows):
        return tokens, None
    picked, q = [], []
    for b, r in enumerate(rows):
        if r.params.greedy:
            picked.append(tokens[b])
            q.append(None)
            continue
        lp = filtered_logprobs(logits[b : b + 1], r.params)  # (1, V)
        # drawn as (1, V), as the single-stream loop does: the same key then gives
        # the same token (a key's draw depends on the shape)
        picked.append(sample(lp, keys[b])[0].astype(mx.int32))
        q.append(lp)
    return mx.stack(picked), q


def _layer_ids(rows: List[Row], drafts: List[mx.array], j: int, width: int):
    """Tokens of MTP layer j for every row's pending rows, left-padded to ``width``:
    row b's t_{i+j+1} for i in frontier..n-1, drafts past t_n. (B, width)"""
    host = []
    for r in rows:
        s = r.state
        committed = s.tokens[s.frontier + j + 1 :]
        host.append([0] * (width - len(committed)) + committed)
    ids = mx.array(host, dtype=mx.int32)  # (B, width)
    if j:
        ids = mx.concatenate([ids, mx.stack(drafts[:j], axis=1)], axis=1)
    return ids[:, -width:]


def draft_rows(model, caches: Caches, rows: List[Row], ks: List[int], depth: int):
    """K = max(ks) draft tokens per row from the heads (row b uses its first
    ``ks[b]``): the MTP layers in use over every row's pending rows
    (frontier..n-1), then the last layer chained, or a separate assistant
    (`draft_assisted_rows`). Returns ``(B, K)`` tokens and per row its ``(K, V)``
    draft log-probabilities (None for a greedy row; None for all when every row is
    greedy)."""
    mtp_caches, trunk_caches = caches.mtp, caches.trunk
    B, K = len(rows), max(ks)
    if K == 0 or depth == 0:
        return mx.zeros((B, 0), dtype=mx.int32), None
    if model.assistant is not None:
        return draft_assisted_rows(model, trunk_caches, rows, ks)
    steps = max(K, depth)  # every layer in use runs, so every frontier may move
    counts = [len(r.state.tokens) - 1 - r.state.frontier for r in rows]
    width = max(counts)
    pads = [width - c for c in counts]
    h = mx.concatenate(
        [mx.pad(r.state.hidden, [(0, 0), (p, 0), (0, 0)]) for r, p in zip(rows, pads)]
    )  # (B, width, H)
    # each row's keys as alone: one per draft it makes (k_b of the K), none for a
    # row drafting nothing (its extra drafts are never accepted, any key does)
    keys = [mx.random.split(r.draft_key, max(k, 1)) for r, k in zip(rows, ks)]
    keys = [[rk[min(j, rk.shape[0] - 1)] for j in range(steps)] for rk in keys]
    tokens, logprobs = [], []
    for j in range(steps):
        if j < depth:
            layer, ids = j, _layer_ids(rows, tokens, j, width)
            mtp_caches[layer].pad(pads)
        else:
            layer, h, ids = depth - 1, h[:, -1:], tokens[-1][:, None]
        h = model.mtp_forward(layer, h, ids, mtp_caches[layer])  # (B, width, H)
        logits = _draft_logits(model, rows, h[:, -1])
        logits = _ruled_logits(model, rows, logits, h[:, -1], tokens, ks)
        token, lp = _pick_rows(rows, logits, [k[j] for k in keys])
        _push_rows(rows, token, ks, j)
        tokens.append(token)
        logprobs.append(lp)
    tokens, logprobs = tokens[:K], logprobs[:K]  # the deeper layers' ran for caches
    q = None
    if logprobs[0] is not None:
        q = [None if lps[0] is None else mx.concatenate(lps) for lps in zip(*logprobs)]
    return mx.stack(tokens, axis=1), q


def draft_assisted_rows(model, trunk_caches, rows: List[Row], ks: List[int]):
    """K draft tokens per row from an assistant (as
    `mlx_mtp.speculative.draft_assisted` drafts for one stream): every step at row
    b's position n_b of its pending token, from (t_n, h_{n-1}) and then (its last
    draft, its own h'), reading the trunk's K/V in place with a mask per row (its
    committed positions; the last W + 1 of them in a sliding layer). Nothing is
    written to any cache."""
    K = max(ks)
    n = mx.array([len(r.state.tokens) - 1 for r in rows], dtype=mx.int32)[:, None]
    kv, masks = {}, {}
    for kind, i in model.reads.items():
        c = trunk_caches[i]
        pos = c.pos[:, : c._idx]  # (B, T)
        seen = (pos >= 0) & (pos < n)
        if kind == "sliding_attention":
            seen = seen & (pos >= n - model.assistant.window)
        kv[kind] = (c.keys[..., : c._idx, :], c.values[..., : c._idx, :])
        masks[kind] = seen[:, None, None, :]  # (B, 1, 1, T)
    keys = [mx.random.split(r.draft_key, max(k, 1)) for r, k in zip(rows, ks)]
    token = mx.array([r.state.tokens[-1] for r in rows], dtype=mx.int32)  # (B,)
    last = [r.state.hidden[:, -1:] for r in rows]  # h_{n-1}
    like = next(x for x in last if x.shape[1])  # a row that drafts has one
    h = mx.concatenate(  # zeros for a row without (a one-token prompt: no draft)
        [x if x.shape[1] else mx.zeros_like(like) for x in last]
    )  # (B, 1, H)
    tokens, logprobs = [], []
    for j in range(K):
        logits, h = model.assist(token[:, None], h, kv, n[:, 0], masks)
        step_keys = [rk[min(j, rk.shape[0] - 1)] for rk in keys]
        ruled = _ruled_logits(model, rows, logits[:, -1], None, tokens, ks)
        token, lp = _pick_rows(rows, ruled, step_keys)
        _push_rows(rows, token, ks, j)
        tokens.append(token)
        logprobs.append(lp)
    q = None
    if logprobs[0] is not None:
        q = [None if lps[0] is None else mx.concatenate(lps) for lps in zip(*logprobs)]
    return mx.stack(tokens, axis=1), q


def accept_rows(rows: List[Row], ks: List[int], drafts, q, logprobs):
    """Per row, the number of its first ``ks[b]`` drafts accepted and the token that
    follows them: greedy matching for greedy rows, speculative sampling otherwise
    (``q[b]``: the row's draft log-probabilities). Returns ``(B,)`` arrays."""
    K = drafts.shape[1]
    target = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # (B, K + 1)
    limit = mx.arange(K)[None] < mx.array(ks)[:, None]
    match = (target[:, :K] == drafts) & limit
    accepted = mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)  # (B,)
    nexts = mx.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    if all(r.params.greedy for r in rows):
        return accepted, nexts
    a_rows, n_rows = [], []
    for b, r in enumerate(rows):
        if r.params.greedy:
            a_rows.append(accepted[b])
            n_rows.append(nexts[b])
            continue
        k = ks[b]
        p = filtered_logprobs(logprobs[b, : k + 1], r.params)  # (k + 1, V)
        if k == 0:
            a_rows.append(mx.array(0, dtype=mx.int32))
            n_rows.append(sample(p[0], r.accept_key).astype(mx.int32))
            continue
        res = accept_stochastic(drafts[b, :k], q[b][:k], p, r.accept_key)
        a_rows.append(res.num_accepted.astype(mx.int32))
        n_rows.append(res.next_token.astype(mx.int32))
    return mx.stack(a_rows), mx.stack(n_rows)


def run_batch(
    model,
    prompts: Sequence[List[int]],
    options: Sequence[DecodeOptions],
    eos: Iterable[int] = (),
    max_batch: int = DEFAULT_MAX_BATCH,
    tokenizer=None,
) -> Iterator[RowOutput]:
    """Decode ``prompts`` (token ids), prompt i with ``options[i]``, at most
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
        yield from _one_at_a_time(model, prompts, options, frozenset(eos), tokenizer)
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
            new.append(batch.admit(i, prompts[i], options[i]))
        for group in prefill_groups(new):
            prefill_together(group)
        for admission in new:
            try:
                batch.join(admission)  # its grammar may be refused
            except Exception as e:
                stats = admission.run.stats
                yield failed_output(admission.uid, e, stats, model.args.vocab_size)
        yield from batch.step()


def _one_at_a_time(model, prompts, options, eos, tokenizer) -> Iterator[RowOutput]:
    from .speculative import mtp_generate_step

    for i, (prompt, opts) in enumerate(zip(prompts, options)):
        steps = mtp_generate_step(prompt, model, opts, tokenizer=tokenizer)
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
                )
                if last:
                    steps.close()
                    break
        except Exception as e:  # this prompt's failure only
            sizes = {1: stats.rounds} if stats is not None else {}
            yield failed_output(i, e, stats, model.args.vocab_size, sizes)

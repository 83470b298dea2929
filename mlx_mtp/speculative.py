"""The MTP decode loop for one stream: a generator of per-token records.

A stream is a batch of one: each round is `mlx_mtp.round`'s (plan, draft, verify,
accept, commit) over its one row and its single-stream caches, the same phases a
batch runs over several rows (`mlx_mtp.batch`). On a trunk sharded over several
ranks (`mlx_mtp.distributed`), the drafts and the accept decision are rank 0's on
every rank. The next round is queued (``mx.async_eval``) before this round's tokens
are yielded, so there is one host sync per round.

What a generation drafts with is resolved once from its `DecodeOptions`
(`mlx_mtp.resolve`); its statistics are `mlx_mtp.stats.MTPStats`.
"""

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Generator, List, Optional

import mlx.core as mx

from .cache import (
    Caches,
    KVQuantization,
    check_rollback,
    make_caches,
    rewind,
    snapshot,
    trim_to,
)
from .defaults import MAX_DRAFT_TOKENS
from .distributed import Sync
from .draft_length import DraftPolicy, Unverified
from .errors import MTPError
from .lookup import continuation
from .media import attach as attach_media
from .media import chunk_end, keyed, of_caches
from .options import DecodeOptions
from .processors import Rules, make_rules
from .resolve import Drafting, drafting
from .round import DecodeState, Round, RoundPlan, commit, launch, plan
from .stats import MTPStats


@dataclass
class StepOutput:
    token: int
    logprobs: mx.array  # (V,)
    from_draft: bool
    stats: MTPStats  # the generation's live statistics
    source: Optional[str] = None  # an accepted draft's: "heads" or "lookup"


def extend_mtp(model, mtp_caches, state: DecodeState, step: int) -> None:
    """Write the MTP rows that need no draft token and whose hidden state is known.

    Row n-1 is always left to `draft`, whose first token comes from its output. An
    assistant keeps no rows: only h_{n-1} is kept for it. A block drafter's rows are
    its context rows (the taps of position i; no token needed).
    """
    end = min(
        state.frontier + state.hidden.shape[1],  # rows with a trunk hidden state
        len(state.tokens) - state.depth,  # rows whose tokens are all committed
        len(state.tokens) - 2,  # row n - 1
    )
    if model.drafter is not None:
        for start in range(state.frontier, end, step):
            stop = min(start + step, end)
            h = state.hidden[:, start - state.frontier : stop - state.frontier]
            model.draft_context(h, mtp_caches)
            mx.eval([c.keys for c in mtp_caches])
    elif model.assistant is None:
        for start in range(state.frontier, end, step):
            stop = min(start + step, end)
            h = state.hidden[:, start - state.frontier : stop - state.frontier]
            for j in range(state.depth):
                ids = state.tokens[start + j + 1 : stop + j + 1]
                ids = mx.array(ids, dtype=mx.int32)[None]
                h = model.mtp_forward(j, h, ids, mtp_caches[j])
            mx.eval([c.state for c in mtp_caches[: state.depth]])
    if end > state.frontier:
        state.hidden = state.hidden[:, end - state.frontier :]
        state.frontier = end


def prefill(
    model,
    caches: Caches,
    prompt: List[int],
    depth: int,
    step: int,
    kv: KVQuantization = KVQuantization(),
):
    """Run the trunk over all prompt tokens but the last, in chunks of ``step``."""
    state = DecodeState([], None, 0, depth)
    if depth:
        state.hidden = mx.zeros((1, 0, model.hidden_width))
    return append(model, caches, state, prompt, step, kv)


def chunk_stop(model, caches: Caches, first: int, start: int, stop: int) -> int:
    """Where a prefill chunk ``[start, stop)`` of tokens whose first is at index
    ``first`` ends: at ``stop``, or off the inside of an image for a trunk whose
    images attend within themselves both ways (``images_whole``: Gemma 4's)."""
    if not getattr(model.trunk, "images_whole", False):
        return stop
    media = of_caches(caches)
    return chunk_end(media, first + start, first + stop) - first


def append(
    model,
    caches: Caches,
    state: DecodeState,
    tokens: List[int],
    step: int,
    kv: KVQuantization = KVQuantization(),
) -> DecodeState:
    """Commit ``tokens`` after ``state`` (a fresh one, or one a finished generation
    left): the trunk runs over the pending token and all new ones but the last, which
    becomes the pending token."""
    first = max(len(state.tokens) - 1, 0)  # the token index of todo[0]
    todo = state.tokens[-1:] + list(tokens[:-1])
    state.tokens.extend(tokens)
    start = 0
    while start < len(todo):
        stop = chunk_stop(model, caches, first, start, min(start + step, len(todo)))
        ids = mx.array(todo[start:stop])[None]
        start = stop
        h = model.hidden(ids, caches.trunk)  # (1, L, H)
        kv.apply(caches.trunk)
        if state.depth:
            state.hidden = mx.concatenate([state.hidden, h], axis=1)
            extend_mtp(model, caches.mtp, state, step)
        mx.eval([c.state for c in caches.trunk], state.hidden)
        mx.clear_cache()
    return state


def fill(model, session: "Session", tokens: List[int], options: DecodeOptions):
    """Run ``tokens`` into ``session`` as a generation with ``options`` would before
    its first round: its prompt's prefill, or what follows the tokens it holds (the
    last of them then pending). A generation can go on from it."""
    depth = drafting(model, options).depth(model)
    session.caches = session.caches or make_caches(model, options.max_kv_size)
    step, kv = options.prefill_step_size, options.kv
    if session.state is None:
        session.state = prefill(model, session.caches, tokens, depth, step, kv)
    else:
        session.state = append(model, session.caches, session.state, tokens, step, kv)


def _settle(caches: Caches, state: DecodeState, queued: List[Round], seen: int):
    """On exit: drop queued rounds and tokens never yielded. The trunk caches then hold
    the prompt and every yielded token but the last (which stays pending, as inside
    the loop); ``seen`` is that length, and ``state`` describes exactly that, so a
    `Session` can go on from it. Caches without an exact rollback (allowed in plain
    decoding only: mlx-lm's own rotating cache, say) keep the queued token."""
    for rnd in reversed(queued):
        rewind(caches.trunk, rnd.marks, rnd.K + 1, strict=False)
    held = len(state.tokens) - 1  # committed positions
    rewind(caches.trunk, state.marks, max(held - seen, 0), strict=False)
    frontier = min(state.frontier, seen)
    for c in caches.mtp:
        trim_to(c, frontier)
    if state.hidden is not None:
        start = frontier - state.frontier
        state.hidden = own_rows(state.hidden[:, start : start + seen - frontier])
    del state.tokens[seen + 1 :]
    state.frontier, state.marks = frontier, None


@dataclass
class Session:
    """Caches and decode state kept across generations (a multi-turn chat).

    Pass the same session to successive `mtp_generate_step` calls: each call's prompt
    is then the tokens that follow everything the previous calls committed (their
    prompts and the tokens they yielded), and only those are run through the trunk.
    """

    caches: Optional[Caches] = None
    state: Optional[DecodeState] = None

    @property
    def tokens(self) -> List[int]:
        """Every token so far: prompts and yielded tokens."""
        return list(self.state.tokens) if self.state else []

    @property
    def key(self) -> list:
        """`tokens` as kept sessions are matched by (`mlx_mtp.media.keyed`: each
        image placeholder the digest of its image)."""
        return keyed(self.tokens, of_caches(self.caches))

    def snapshot(self) -> "Session":
        """An independent copy to go on from later: the same caches and state as new
        array objects, no rollback record kept. Not copy-on-write: once evaluated,
        each array is a full copy (a snapshot takes about the session's `nbytes`
        again)."""
        state = kept_state(self.state)
        caches = Caches(
            [snapshot(c) for c in self.caches.trunk],
            [snapshot(c) for c in self.caches.mtp],
        )
        return Session(caches, state)

    def arrays(self) -> List[mx.array]:
        """Every array the session holds, each once: its caches' (found as
        `snapshot` finds them: buffers at their allocated size, rollback records
        included) and its decode state's."""
        found: Dict[int, Any] = {}
        _collect([self.caches, self.state], found)
        return [a for a in found.values() if isinstance(a, mx.array)]

    @property
    def nbytes(self) -> int:
        """The bytes of `arrays`: what the session holds once they are evaluated
        (an array whose computation is pending may hold its inputs too)."""
        return sum(a.nbytes for a in self.arrays())


def kept_state(state: DecodeState) -> DecodeState:
    """``state`` as a `Session` keeps it: a token list of its own, no rollback marks
    (a batch's hold every row), and its hidden rows gathered into a buffer of their
    own (a slice, or a copy of one that may take over its buffer, holds the whole
    buffer it was cut from)."""
    hidden = None if state.hidden is None else own_rows(state.hidden)
    return replace(state, tokens=list(state.tokens), marks=None, hidden=hidden)


def own_rows(hidden: mx.array) -> mx.array:
    """``hidden`` ``(1, n, H)`` gathered into a buffer of its own."""
    return mx.take(hidden, mx.arange(hidden.shape[1]), axis=1)


def _collect(value, found: Dict[int, Any]) -> None:
    """``value``'s arrays, and the objects walked, into ``found`` (by id, each
    once): in lists, tuples and the attributes of objects, as
    `mlx_mtp.kv_cache.copy_arrays` walks them."""
    if id(value) in found:
        return
    if isinstance(value, mx.array):
        found[id(value)] = value
    elif isinstance(value, (list, tuple)):
        for x in value:
            _collect(x, found)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        found[id(value)] = value
        for x in vars(value).values():
            _collect(x, found)


def mtp_generate_step(
    prompt,
    model,
    options: Optional[DecodeOptions] = None,
    *,
    caches: Optional[Caches] = None,
    session: Optional["Session"] = None,
    on_prefill: Optional[Callable[["Session"], None]] = None,
    policy: Optional[DraftPolicy] = None,
    tokenizer=None,
    media=None,
    **fields,
) -> Generator[StepOutput, None, None]:
    """Generate tokens with MTP drafting and exact verification.

    Args:
        prompt: Prompt token ids (list or 1-D ``mx.array``), not empty.
        model: An `mlx_mtp.models.base.Model`.
        options: The `DecodeOptions` (default: its defaults; its docstring says
            what each option does); ``fields``, option names as keywords, override
            some of them.
        caches: Fresh caches to fill (default: new ones).
        session: Go on from earlier calls with this `Session` (``prompt`` is then what
            follows them); a new one is filled in.
        on_prefill: Called with the session once the prompt is in its caches, before
            the first round (a server keeps a `Session.snapshot` of the prompt).
        policy: A `DraftPolicy` to size the heads' drafts instead of the one
            ``num_draft_tokens`` asks for.
        tokenizer: The model's tokenizer (mlx-lm's wrapper), which a ``grammar``
            option needs.
        media: The prompt's `mlx_mtp.media.Media` (its image features and
            positions, from `mlx_mtp.images.prompt_media`), for a model that reads
            images; the session's caches keep them for what follows.

    Yields:
        `StepOutput` per token; its ``stats`` is the live `MTPStats` of the run.
        When the generator ends or is closed, the trunk caches hold the prompt and all
        yielded tokens but the last, and the MTP caches only entries that agree with
        them.

    Raises:
        `mlx_mtp.grammar.GrammarError` (one line) when the grammar engine fails
        on the tokens (one of its limits reached), whatever the draft length:
        the tokens before the round it failed in are yielded first. The session
        is then not fit to go on from.
    """
    options = DecodeOptions.build(options, **fields)
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt and (session is None or session.state is None):
        raise MTPError("the prompt is empty")
    if session is not None and options.max_kv_size is not None:
        raise MTPError("a session cannot use a rotating KV window")
    plan = drafting(model, options, policy)
    session = session if session is not None else Session(caches)
    depth = plan.depth(model)
    if session.state is not None and session.state.depth != depth:
        raise MTPError(
            f"this session drafts with {session.state.depth} MTP layer(s); "
            f"num_draft_tokens asks for {depth}"
        )
    session.caches = session.caches or make_caches(model, options.max_kv_size)
    attach_media(session.caches, media, len(session.tokens))
    if plan.policy.max_k:
        check_rollback(session.caches.trunk)
    seed = options.seed
    if seed is None:  # drawn on rank 0: the same keys on every rank
        seed = Sync(model.group).share_int(int.from_bytes(os.urandom(4), "little") >> 1)
    if options.grammar is not None and tokenizer is None:
        raise MTPError("a grammar (json_schema, regex) needs the model's tokenizer")
    run = Run(model, session, plan, options, mx.random.key(seed), tokenizer)
    return _generate(run, prompt, on_prefill)


@dataclass
class Run:
    """One stream as the round drives it: what it decodes with, and how far it is
    (a row of `mlx_mtp.round`'s phases, alone or in a batch).

    The caches and decode state are the session's (`start` fills them). ``queued``
    holds the rounds launched but not committed: the next round, or two plain rounds
    (see `queue_plain_behind`). ``seen`` is the number of positions to keep in the
    caches on exit: the prompt and every yielded token but the last. ``failure``:
    what its rules (processors, grammar) raised; they are left out from then on.
    """

    model: Any
    session: "Session"
    drafting: Drafting
    options: DecodeOptions
    key: mx.array
    tokenizer: Any = None  # for a grammar (`mlx_mtp.grammar.Matcher`)
    stats: Optional[MTPStats] = None
    queued: List[Round] = field(default_factory=list)
    seen: int = 0
    rules: Optional[Rules] = None  # processors and grammar; None: there are none
    failure: Optional[Exception] = None
    planned: Optional[RoundPlan] = None  # the next round's, planned ahead
    unverified: Optional[Unverified] = None  # drafts no round verified, to judge

    def __post_init__(self):
        self.params = self.options.sampling
        self.kv = self.options.kv
        self.max_tokens = self.options.max_tokens
        self.policy = self.drafting.policy

    @property
    def caches(self) -> Caches:
        return self.session.caches

    @property
    def state(self) -> DecodeState:
        return self.session.state

    @property
    def ruled(self) -> bool:
        """Whether the stream has rules that did not fail."""
        return self.rules is not None and self.failure is None

    def rule(self, method: str, *args):
        """``self.rules.<method>(*args)``; None if it raises, the exception then
        the stream's ``failure`` (its rules are left out from then on)."""
        try:
            return getattr(self.rules, method)(*args)
        except Exception as e:
            self.failure = e
            return None

    def start(self, prompt: List[int]) -> None:
        """Prefill ``prompt`` into the session's caches, or append it to the tokens
        an earlier generation of the session left, in chunks of the prefill step."""
        model, s, step = self.model, self.session, self.options.prefill_step_size
        if s.state is not None:
            if prompt:  # none: the session holds the whole prompt, its last pending
                s.state = append(model, s.caches, s.state, prompt, step, self.kv)
        else:
            depth = self.drafting.depth(model)
            s.state = prefill(model, s.caches, prompt, depth, step, self.kv)
        self.begin()

    def begin(self) -> None:
        """Once the prompt is in the caches: the statistics, the positions seen and
        the processors and grammar start."""
        self.stats = MTPStats(self.policy.max_k, self.drafting.lookup_tokens)
        self.seen = len(self.state.tokens) - 1
        vocab_size = self.model.args.vocab_size
        self.rules = make_rules(self.options, vocab_size, self.tokenizer)
        if self.rules is not None:
            self.rules.observe(self.state.tokens)
        self.unverified = Unverified() if self.judges_tail else None

    @property
    def judges_tail(self) -> bool:
        """Whether its block drafter's slots past k are drafted too and judged
        later (`mlx_mtp.draft_length.Unverified`): a greedy stream without rules
        (its tokens then do not depend on what was drafted, and no processor or
        grammar shapes the drafts) whose policy chooses among draft lengths, on one
        rank (several ranks pick their ks from rank 0's shared values only)."""
        return (
            self.model.drafter is not None
            and self.model.group is None
            and self.params.greedy
            and self.rules is None
            and self.policy.judges
        )

    def wanted(self, emitted: int) -> bool:
        """Whether a round after ``emitted`` tokens is still wanted."""
        return self.max_tokens < 0 or emitted < self.max_tokens

    def room(self, emitted: int) -> int:
        """The most drafts a round after ``emitted`` tokens may make without
        yielding past ``max_tokens`` (a round yields up to k + 1 tokens)."""
        if self.max_tokens < 0:
            return MAX_DRAFT_TOKENS
        return max(0, self.max_tokens - emitted - 1)

    def lookup_draft(self, k: int) -> Optional[List[int]]:
        """The tokens a lookup round would draft instead of k from the heads (None:
        no lookup, or the heads are expected to do better)."""
        room = min(self.drafting.lookup_tokens, self.room(self.stats.emitted))
        found = continuation(self.state.tokens, room) if room > 0 else None
        if found and self.drafting.sources is not None:
            found = found[: self.drafting.sources.lookup_length(len(found), k)]
        if found and self.rules is not None:
            found = self.rules.allowed_prefix(found)
        return found or None

    def launch(self, pending: Optional[mx.array] = None) -> None:
        """Queue the next round (planned now, or by `queue_plain_behind`);
        ``pending``: its pending token, lazy (a plain round behind a plain round)."""
        rp, self.planned = self.planned or plan([self]), None
        rnd = launch(
            self.model, self.caches, [self], rp, self.state.depth, pending, True
        )
        self.queued.append(rnd)

    def observe(
        self, k: int, a: int, source: str, vocab, new: List[int], tail=()
    ) -> None:
        """Tell the policies how a committed round went: k drafts from ``source``
        (draft vocabulary ``vocab``), a accepted, ``new`` its tokens; ``tail``: the
        drafts its block drafter proposed past k (`Round.tail`), judged against
        ``new`` and the tokens committed later."""
        cov = self.drafting.coverage
        missed = cov is not None and a < k and not cov.contains(new[a], vocab)
        if source == "heads":  # the policy sizes the heads' drafts
            self.policy.observe(k, a, missed)
        if self.drafting.sources is not None and k:
            self.drafting.sources.observe(source, k, a, missed)
        if self.unverified is not None:
            self.unverified.add(k, tail, vocab)
            inside = cov.contains if cov is not None else lambda t, v: True
            sources = self.drafting.sources
            for j, hit in self.unverified.judge(new, inside):
                self.policy.judge(j, hit)
                if sources is not None:
                    sources.heads.judge(j, hit)
        if cov is not None:
            cov.observe(new)

    def pipelined(self, rnd: Round) -> bool:
        """Whether the round after ``rnd`` may be planned before ``rnd`` is
        committed: ``rnd`` drafts nothing (its commit takes its one token whatever
        its value) and ran no drafter (a block drafter whose confidence cut left it
        no draft still moves the frontier), no lookup or grammar needs that
        token's value, and KV quantization (which runs between rounds) is off."""
        return not (
            rnd.K
            or rnd.heads
            or self.kv.bits is not None
            or self.drafting.lookup_tokens
            or (self.rules is not None and self.rules.needs_tokens)
            or self.failure is not None
        )

    def queue_plain_behind(self, rnd: Round) -> None:
        """Before waiting for a plain round, plan the round after it and, if that one
        is plain too, queue it now on the round's lazy token (as mlx-lm pipelines its
        steps); otherwise keep the plan for `launch`.

        Planning before the plain round is observed is the same as planning after:
        a plain round drafts nothing, so observing it tells the policy nothing.
        """
        if not self.pipelined(rnd) or not self.wanted(self.stats.emitted + 1):
            return
        self.planned = plan([self], ahead=1)
        if self.planned.K == 0:
            self.launch(pending=rnd.next_tokens)


def _generate(run: Run, prompt: List[int], on_prefill=None):
    """The generator behind `mtp_generate_step` (its arguments checked): prefill, then
    per round wait for the oldest queued round, commit it and queue the next before
    yielding (one host sync per round); on exit leave the caches as the exit contract
    of `mtp_generate_step` says. A failure of the rules raises once the tokens of
    the rounds before the one it happened in are yielded."""
    run.start(prompt)
    if on_prefill is not None:
        on_prefill(run.session)
    stats = run.stats
    try:
        run.launch()
        if run.failure is not None:
            raise run.failure
        while run.queued:
            rnd = run.queued[0]
            run.queue_plain_behind(rnd)
            mx.eval(rnd.accepted, rnd.next_tokens, rnd.drafts)
            a = rnd.accepted.item()
            new = rnd.drafts[0, :a].tolist() + [rnd.next_tokens.item()]
            commit(run.caches, [run], rnd, [new], run.state.depth)
            run.queued.pop(0)
            if run.ruled:
                run.rule("commit", new)
            if run.failure is not None:
                raise run.failure
            run.kv.apply(run.caches.trunk)
            k, source, vocab = rnd.plan.ks[0], rnd.plan.source(0), rnd.plan.vocab(0)
            stats.record(k, a, source, vocab)
            run.observe(k, a, source, vocab, new, rnd.tail(0, a))
            if not run.queued and run.wanted(stats.emitted):
                run.launch()
            for i, token in enumerate(new):
                run.seen += 1
                source = rnd.plan.source(0) if i < a else None
                yield StepOutput(token, rnd.logprobs[0, i], i < a, stats, source)
            if run.failure is not None:
                raise run.failure
            if stats.rounds % 64 == 0:
                mx.clear_cache()
    finally:
        _settle(run.caches, run.state, run.queued, run.seen)
        run.drafting.remember()

"""The MTP decode loop: a generator of per-token records, one round at a time.

Bookkeeping. ``state.tokens`` holds the committed tokens t_0..t_n; the trunk's cache
holds t_0..t_{n-1} and t_n is *pending* (the input of the next verify). MTP row i pairs
the trunk's post-norm hidden state h_i with token t_{i+1} at position i; layer j's row i
takes layer j-1's output instead of h_i and token t_{i+j+1}, and predicts t_{i+j+2}.
Rows below ``state.frontier`` are in every MTP cache, computed from true trunk hidden
states and committed tokens only (as vLLM keeps them); ``state.hidden`` holds h for rows
frontier..n-1.

Each round reads as four phases:
  draft   MTP layers over rows frontier..n-1, then chained, give k draft tokens;
  verify  one trunk pass over [t_n, d_1..d_k] gives k+1 target distributions;
  accept  greedy matching or speculative sampling gives a accepted drafts + 1 token;
  commit  roll every cache back to the accepted length, append the tokens.
On a trunk sharded over several ranks (`mlx_mtp.distributed`), the drafts and the accept
decision are rank 0's on every rank. The next round is queued (``mx.async_eval``) before
this round's tokens are yielded, so there is one host sync per round.

What a generation drafts with is resolved once from its `DecodeOptions`
(`mlx_mtp.resolve`); its statistics are `mlx_mtp.stats.MTPStats`.
"""

import copy
import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Generator, List, Optional, Union

import mlx.core as mx

from .cache import (
    Caches,
    KVQuantization,
    assistant_kv,
    begin_verify,
    check_rollback,
    make_caches,
    rewind,
    trim_to,
)
from .defaults import MAX_DRAFT_TOKENS
from .distributed import Sync
from .draft_length import DraftPolicy
from .errors import MTPError
from .lookup import continuation
from .options import DecodeOptions
from .processors import Rules, make_rules
from .rejection import AcceptResult, accept_greedy, accept_stochastic
from .resolve import Drafting, drafting
from .sampling import SamplingParams, filtered_logprobs, log_softmax, sample
from .stats import MTPStats


@dataclass
class StepOutput:
    token: int
    logprobs: mx.array  # (V,)
    from_draft: bool
    stats: MTPStats  # the generation's live statistics


@dataclass
class DecodeState:
    tokens: List[int]  # committed t_0..t_n; t_n is pending
    hidden: Optional[mx.array]  # (1, n - frontier, H), None without MTP
    frontier: int = 0
    depth: int = 0  # MTP layers in use: min(k, number of layers)
    marks: Optional[list] = None  # rollback marks of the last committed verify


@dataclass
class Draft:
    tokens: mx.array  # (k,) int32
    logprobs: Optional[mx.array]  # (k, V) filtered q; None when greedy
    depth: int  # MTP layers that processed the rows this round (0: no draft)
    source: str = "heads"  # "heads" (MTP heads or an assistant) or "lookup"
    vocab: Optional[int] = None  # the heads' draft vocabulary (None: their own rows)

    @property
    def k(self) -> int:
        return self.tokens.shape[0]


@dataclass
class Verified:
    hidden: mx.array  # (1, k + 1, H)
    logprobs: mx.array  # (k + 1, V) log-softmax of the target logits
    marks: list  # rollback marks of the trunk caches


@dataclass
class Round:
    draft: Draft
    verified: Verified
    result: AcceptResult


def _pick(logits: mx.array, params: SamplingParams, key) -> tuple:
    """One draft token from ``(1, V)`` logits, and its filtered distribution."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    logprobs = filtered_logprobs(logits, params)  # (1, V)
    return sample(logprobs, key).astype(mx.int32), logprobs


def _pick_ruled(logits, params: SamplingParams, key, rules, drafts=(), full=None):
    """`_pick` with `Rules`: the logits processed first as the target's row after
    ``drafts`` will be, and the token given to the grammar. ``full``: the whole
    head's logits (a thunk), drafted from instead when the grammar allows none of
    the rows of a draft vocabulary's ``logits`` (known with the token: a grammar
    syncs anyway)."""
    if rules is None:
        return _pick(logits, params, key)
    ruled = rules.draft_logits(logits, drafts)
    token, lp = _pick(ruled, params, key)
    if full is not None and rules.needs_tokens:
        some = mx.isfinite(ruled).any()
        mx.eval(token, some)
        if not some.item():
            token, lp = _pick(rules.draft_logits(full(), drafts), params, key)
    rules.push(token)
    return token, lp


def _row_tokens(state: DecodeState, drafts: List[mx.array], j: int) -> mx.array:
    """Tokens of layer j for rows frontier..n-1: t_{i+j+1}, drafts past t_n. (1, R)"""
    rows = len(state.tokens) - 1 - state.frontier
    committed = mx.array(state.tokens[state.frontier + j + 1 :], dtype=mx.int32)
    # rows [e, n-1], j = 1: [t_{e+2} .. t_n, d_1]
    return mx.concatenate([committed, *drafts[:j]])[-rows:][None]


def draft(
    model,
    caches: Caches,
    state: DecodeState,
    k: int,
    params,
    key,
    vocab: Optional[int] = None,
    rules=None,
) -> Draft:
    """Draft k tokens: MTP layers in order over the pending rows, then chain the last,
    each token from the rows of the draft vocabulary ``vocab`` (`Model.draft_logits`)
    processed by ``rules`` (`mlx_mtp.processors.Rules`) as its target row will be;
    a grammar that allows none of the vocabulary's rows drafts from the whole head.

    Layer j < depth runs on every row from the frontier to the newest; a layer used past
    its own depth (k > number of layers) runs on its own output at the next position.
    A model with an assistant drafts with it (`draft_assisted`).
    """
    rows = len(state.tokens) - 1 - state.frontier
    if k == 0 or state.depth == 0 or rows <= 0:
        return Draft(mx.zeros((0,), dtype=mx.int32), None, 0)
    if model.assistant is not None:
        return draft_assisted(model, caches.trunk, state, k, params, key, rules)
    mtp_caches = caches.mtp
    keys = mx.random.split(key, k)
    h, tokens, logprobs = state.hidden, [], []
    for j in range(k):
        if j < state.depth:
            layer, ids = j, _row_tokens(state, tokens, j)
        else:
            layer, h, ids = state.depth - 1, h[:, -1:], tokens[-1][None]
        h = model.mtp_forward(layer, h, ids, mtp_caches[layer])  # (1, R, H)
        logits = model.draft_logits(h[:, -1], vocab)
        full = None
        if vocab is not None or "draft_vocab" in model.mtp:
            full = functools.partial(model.logits, h[:, -1])
        token, lp = _pick_ruled(logits, params, keys[j], rules, tokens, full)
        tokens.append(token)
        logprobs.append(lp)
    q = None if params.greedy else mx.concatenate(logprobs)
    return Draft(mx.concatenate(tokens), q, min(k, state.depth), vocab=vocab)


def draft_assisted(
    model, trunk_caches, state: DecodeState, k: int, params, key, rules=None
):
    """Draft k tokens with an assistant: every step at the position n of the pending
    token t_n, from (t_n, h_{n-1}) and then (its last draft, its own h'), reading the
    trunk's K/V of positions < n; nothing is written to any cache."""
    keys = mx.random.split(key, k)
    n = len(state.tokens) - 1
    kv = assistant_kv(model, trunk_caches)
    token = mx.array(state.tokens[-1:], dtype=mx.int32)
    h, tokens, logprobs = state.hidden[:, -1:], [], []  # h_{n-1}: (1, 1, H)
    for j in range(k):
        logits, h = model.assist(token[None], h, kv, n)  # (1, 1, V), (1, 1, H)
        token, lp = _pick_ruled(logits[:, -1], params, keys[j], rules, tokens)
        tokens.append(token)
        logprobs.append(lp)
    q = None if params.greedy else mx.concatenate(logprobs)
    return Draft(mx.concatenate(tokens), q, 1)


def draft_lookup(tokens: List[int], params, vocab_size: int) -> Draft:
    """A draft of ``tokens`` found in the context (`mlx_mtp.lookup`): no MTP row is
    computed (the next heads draft catches up from the frontier), and under sampling
    its distribution is a point mass on each token."""
    ids = mx.array(tokens, dtype=mx.int32)
    q = None
    if not params.greedy:
        q = mx.where(mx.arange(vocab_size)[None] == ids[:, None], 0.0, -mx.inf)
    return Draft(ids, q, 0, "lookup")


def verify(
    model, trunk_cache, pending: Union[int, mx.array], d: Draft, rules=None
) -> Verified:
    """One trunk pass over [t_n, d_1..d_k] (t_n may still be lazy); with ``rules``,
    row j's logits processed with the prefix that ends in d_1..d_j."""
    t_n = mx.array(pending, dtype=mx.int32).reshape(1)
    ids = mx.concatenate([t_n, d.tokens])[None]
    marks = begin_verify(trunk_cache)
    hidden = model.hidden(ids, trunk_cache)  # (1, k + 1, H)
    logits = model.logits(hidden)[0]  # (k + 1, V)
    if rules is not None:
        logits = rules.verify_logits(logits, d.tokens)
    return Verified(hidden, log_softmax(logits), marks)


def accept(d: Draft, v: Verified, params: SamplingParams, key) -> AcceptResult:
    if params.greedy:
        return accept_greedy(d.tokens, v.logprobs)
    target = filtered_logprobs(v.logprobs, params)  # (k + 1, V)
    if d.k == 0:
        return AcceptResult(mx.array(0), sample(target[0], key))
    return accept_stochastic(d.tokens, d.logprobs, target, key)


def commit(
    caches: Caches, state: DecodeState, rnd: Round, a: int, new_tokens: List[int]
) -> None:
    """Keep t_n and the a accepted drafts in every cache; append the round's tokens.

    MTP caches keep only rows whose inputs were all committed before this round (rows
    up to n - depth), so every kept entry comes from true trunk hidden states; the
    dropped rows are recomputed from ``state.hidden`` by the next draft.
    """
    rewind(caches.trunk, rnd.verified.marks, rnd.draft.k - a)
    state.marks = rnd.verified.marks
    if state.hidden is not None:
        n = len(state.tokens) - 1
        frontier = state.frontier
        if rnd.draft.depth:
            frontier = max(state.frontier, n - rnd.draft.depth + 1)
        for c in caches.mtp:
            trim_to(c, frontier)
        kept = state.hidden[:, frontier - state.frontier :]
        state.hidden = mx.concatenate([kept, rnd.verified.hidden[:, : a + 1]], axis=1)
        state.frontier = frontier
    state.tokens.extend(new_tokens)


def extend_mtp(model, mtp_caches, state: DecodeState, step: int) -> None:
    """Write the MTP rows that need no draft token and whose hidden state is known.

    Row n-1 is always left to `draft`, whose first token comes from its output. An
    assistant keeps no rows: only h_{n-1} is kept for it.
    """
    end = min(
        state.frontier + state.hidden.shape[1],  # rows with a trunk hidden state
        len(state.tokens) - state.depth,  # rows whose tokens are all committed
        len(state.tokens) - 2,  # row n - 1
    )
    if model.assistant is None:
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
    todo = state.tokens[-1:] + list(tokens[:-1])
    state.tokens.extend(tokens)
    for start in range(0, len(todo), step):
        ids = mx.array(todo[start : start + step])[None]
        h = model.hidden(ids, caches.trunk)  # (1, L, H)
        kv.apply(caches.trunk)
        if state.depth:
            state.hidden = mx.concatenate([state.hidden, h], axis=1)
            extend_mtp(model, caches.mtp, state, step)
        mx.eval([c.state for c in caches.trunk], state.hidden)
        mx.clear_cache()
    return state


def build_round(
    model,
    caches: Caches,
    state: DecodeState,
    k: int,
    params: SamplingParams,
    key: mx.array,
    *,
    pending: Optional[mx.array] = None,
    lookup: Optional[List[int]] = None,
    vocab: Optional[int] = None,
    rules=None,
) -> Round:
    """Build one round (draft, verify, accept) lazily and start evaluating it.

    A heads round drafts k = 0 or k >= ``state.depth`` tokens: fewer would leave the
    deeper MTP layers' caches behind the frontier that `commit` moves (`Run.plan`
    keeps to this). ``pending`` (a lazy token) launches a plain round (k = 0) behind a
    plain round whose token is not known yet: its commit cannot depend on that token's
    value. ``lookup`` (tokens found in the context) drafts them instead of the heads;
    ``vocab`` is the heads' draft vocabulary; ``rules`` the generation's logits
    processors and grammar (`mlx_mtp.processors.Rules`).
    """
    assert lookup or k == 0 or k >= state.depth, f"k = {k} < depth {state.depth}"
    draft_key, accept_key = mx.random.split(key)
    sync = Sync(model.group)  # on several ranks: rank 0's drafts and decision
    if rules is not None:
        rules.begin(pending)
    if lookup:
        d = draft_lookup(lookup, params, model.args.vocab_size)
        if rules is not None:
            for token in d.tokens:
                rules.push(token)
    else:
        d = draft(model, caches, state, k, params, draft_key, vocab, rules)
    if rules is not None:
        rules.end_draft()
    if d.k and sync.group is not None:
        d = replace(d, tokens=sync.share(d.tokens))
        # Submitted now, so that every rank runs this collective before the verify
        # pass's: a pipeline stage's receive does not wait on the tokens in the graph.
        mx.async_eval(d.tokens)
    t_n = state.tokens[-1] if pending is None else pending
    v = verify(model, caches.trunk, t_n, d, rules)
    result = accept(d, v, params, accept_key)
    if sync.group is not None:
        result = AcceptResult(
            sync.share(result.num_accepted), sync.share(result.next_token)
        )
    mx.async_eval(
        result.num_accepted, result.next_token, d.tokens, v.hidden, v.logprobs
    )
    return Round(d, v, result)


def _settle(caches: Caches, state: DecodeState, queued: List[Round], seen: int):
    """On exit: drop queued rounds and tokens never yielded. The trunk caches then hold
    the prompt and every yielded token but the last (which stays pending, as inside
    the loop); ``seen`` is that length, and ``state`` describes exactly that, so a
    `Session` can go on from it. Caches without an exact rollback (allowed in plain
    decoding only: mlx-lm's own rotating cache, say) keep the queued token."""
    for rnd in reversed(queued):
        rewind(caches.trunk, rnd.verified.marks, rnd.draft.k + 1, strict=False)
    held = len(state.tokens) - 1  # committed positions
    rewind(caches.trunk, state.marks, max(held - seen, 0), strict=False)
    frontier = min(state.frontier, seen)
    for c in caches.mtp:
        trim_to(c, frontier)
    if state.hidden is not None:
        start = frontier - state.frontier
        state.hidden = state.hidden[:, start : start + seen - frontier]
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

    def snapshot(self) -> "Session":
        """An independent copy to go on from later: the same caches and state as new
        array objects, no rollback record kept. Not copy-on-write: once evaluated,
        each array is a full copy (a snapshot takes about the session's `nbytes`
        again)."""
        state = replace(self.state, tokens=list(self.state.tokens), marks=None)
        if state.hidden is not None:
            state.hidden = mx.array(state.hidden)
        caches = Caches(
            [_copy_cache(c) for c in self.caches.trunk],
            [_copy_cache(c) for c in self.caches.mtp],
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


def _collect(value, found: Dict[int, Any]) -> None:
    """``value``'s arrays, and the objects walked, into ``found`` (by id, each
    once): in lists, tuples and the attributes of objects, as `_copy_cache` walks
    them."""
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


def _copy_cache(cache):
    """A cache object whose arrays are new array objects (their writes, in place on
    the array objects, then stay apart), and so are its parts' (a layer's several
    caches, DeepSeek-V4's compressor states); no rollback record is kept."""

    def fresh(v):
        if isinstance(v, mx.array):
            return mx.array(v)
        if isinstance(v, (list, tuple)):
            return type(v)(fresh(x) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return _copy_cache(v)
        return v

    out = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(out, name, None if name == "capture" else fresh(value))
    return out


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
    options = DecodeOptions.build(options, **fields).check()
    prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
    if not prompt:
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
    """One generation as the loop drives it: what it decodes with, and how far it is.

    The caches and decode state are the session's (`start` fills them). ``queued``
    holds the rounds launched but not committed: the next round, or two plain rounds
    (see `queue_plain_behind`). ``seen`` is the number of positions to keep in the
    caches on exit: the prompt and every yielded token but the last.
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

    def start(self, prompt: List[int]) -> None:
        """Prefill ``prompt`` into the session's caches, or append it to the tokens
        an earlier generation of the session left, in chunks of the prefill step."""
        model, s, step = self.model, self.session, self.options.prefill_step_size
        if s.state is not None:
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

    def wanted(self, emitted: int) -> bool:
        """Whether a round after ``emitted`` tokens is still wanted."""
        return self.max_tokens < 0 or emitted < self.max_tokens

    def room(self, emitted: int) -> int:
        """The most drafts a round after ``emitted`` tokens may make without
        yielding past ``max_tokens`` (a round yields up to k + 1 tokens)."""
        if self.max_tokens < 0:
            return MAX_DRAFT_TOKENS
        return max(0, self.max_tokens - emitted - 1)

    def plan(self, emitted: int) -> int:
        """The next heads round's k: the policy's, capped by `room`, and 0 when that
        leaves fewer drafts than the MTP layers in use (a round drafting k tokens
        runs the first k layers only, and its commit moves every layer's frontier:
        0 < k < depth would leave the deeper layers behind for the rest of the
        session)."""
        k = min(self.policy.next(), self.room(emitted))
        return k if k >= self.state.depth else 0

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

    def launch(self, k: int, pending: Optional[mx.array] = None) -> None:
        """Queue a round of k drafts from the heads, or of a lookup draft when lookup
        is on and the context has one (see `build_round`)."""
        self.key, sub = mx.random.split(self.key)
        lookup = None
        if self.drafting.lookup_tokens and pending is None:
            lookup = self.lookup_draft(k)
        rnd = build_round(
            self.model,
            self.caches,
            self.state,
            k,
            self.params,
            sub,
            pending=pending,
            lookup=lookup,
            vocab=self.policy.vocab,
            rules=self.rules,
        )
        self.queued.append(rnd)

    def observe(self, rnd: Round, a: int, new: List[int]) -> None:
        """Tell the policies how a committed round went (``new``: its tokens)."""
        d, cov = rnd.draft, self.drafting.coverage
        missed = cov is not None and a < d.k and not cov.contains(new[a], d.vocab)
        if d.source == "heads":  # the policy sizes the heads' drafts
            self.policy.observe(d.k, a, missed)
        if self.drafting.sources is not None and d.k:
            self.drafting.sources.observe(d.source, d.k, a, missed)
        if cov is not None:
            cov.observe(new)

    def queue_plain_behind(self, rnd: Round) -> Optional[int]:
        """Before waiting for a plain round, plan the round after it and, if that one
        is plain too, queue it now on the round's lazy token (as mlx-lm pipelines its
        steps). Returns the k planned, or None when nothing was planned.

        Planning before the plain round is observed is the same as planning after:
        a plain round drafts nothing, so observing it tells the policy nothing. And a
        plain round commits its one token whatever its value, so the next round's
        inputs are known (lazily) before it is evaluated. KV quantization runs between
        rounds, so it turns the pipelining off.
        """
        if (
            self.kv.bits is not None
            or self.drafting.lookup_tokens  # a lookup needs the token before it
            or (self.rules is not None and self.rules.needs_tokens)
            or rnd.draft.k
            or not self.wanted(self.stats.emitted + 1)
        ):
            return None
        k = self.plan(self.stats.emitted + 1)
        if k == 0:
            self.launch(0, pending=rnd.result.next_token)
        return k


def _launched(run: Run, k: int) -> Optional[Exception]:
    """`Run.launch` a round of k drafts; what it raised (a grammar that failed on
    the next token, say), to raise once the committed tokens are yielded (as a
    batch yields them: `mlx_mtp.batch`)."""
    try:
        run.launch(k)
    except Exception as e:
        return e
    return None


def _generate(run: Run, prompt: List[int], on_prefill=None):
    """The generator behind `mtp_generate_step` (its arguments checked): prefill, then
    per round wait for the oldest queued round, commit it and queue the next before
    yielding (one host sync per round); on exit leave the caches as the exit contract
    of `mtp_generate_step` says."""
    run.start(prompt)
    if on_prefill is not None:
        on_prefill(run.session)
    stats = run.stats
    try:
        run.launch(run.plan(0))
        while run.queued:
            rnd = run.queued[0]
            planned = run.queue_plain_behind(rnd)
            mx.eval(rnd.result.num_accepted, rnd.result.next_token, rnd.draft.tokens)
            a = rnd.result.num_accepted.item()
            new = rnd.draft.tokens[:a].tolist() + [rnd.result.next_token.item()]
            commit(run.caches, run.state, rnd, a, new)
            run.queued.pop(0)
            if run.rules is not None:
                run.rules.commit(new)
            run.kv.apply(run.caches.trunk)
            stats.record(rnd.draft.k, a, rnd.draft.source, rnd.draft.vocab)
            run.observe(rnd, a, new)
            failure = None
            if not run.queued and run.wanted(stats.emitted):
                k = planned if planned is not None else run.plan(stats.emitted)
                failure = _launched(run, k)
            for i, token in enumerate(new):
                run.seen += 1
                yield StepOutput(token, rnd.verified.logprobs[i], i < a, stats)
            if failure is not None:
                raise failure
            if stats.rounds % 64 == 0:
                mx.clear_cache()
    finally:
        _settle(run.caches, run.state, run.queued, run.seen)

"""One speculative round over B rows: plan, draft, verify, accept, commit.

A single stream is a batch of one: `mlx_mtp.speculative` drives these phases over its
one row (single-stream caches), `mlx_mtp.batch` over several (batch caches); both
call the same functions, so a row decodes the same way alone or in company.

Bookkeeping, per row. ``state.tokens`` holds the committed tokens t_0..t_n; the
trunk's cache holds t_0..t_{n-1} and t_n is *pending* (the input of the next verify).
MTP row i pairs the trunk's post-norm hidden state h_i with token t_{i+1} at position
i; layer j's row i takes layer j-1's output instead of h_i and token t_{i+j+1}, and
predicts t_{i+j+2}. Rows below ``state.frontier`` are in every MTP cache, computed
from true trunk hidden states and committed tokens only (as vLLM keeps them);
``state.hidden`` holds h for rows frontier..n-1.

A round:
  plan    per row its draft count k_b, source (heads or a lookup draft), draft
          vocabulary and keys: a `RoundPlan`, the round's one flat description;
  draft   the MTP layers in use over every row's pending rows (left-padded to the
          longest), then the last layer chained (or an assistant), K = max k_b
          tokens per row, each from its own settings; lookup rows' tokens as found;
  verify  one trunk pass over ``(B, K + 1)`` tokens: [t_n, d_1..d_K] per row;
  accept  per row: greedy matching or speculative sampling over its own k_b drafts;
  commit  every cache drops each row's rejected positions; each row's state appends
          its tokens.

One rule for k against the MTP depth: a heads round runs every MTP layer in use
over every row, whatever k is (a row drafting fewer uses its first k_b tokens), so
every layer's frontier moves together.

The rows are the streams' `mlx_mtp.speculative.Run` objects: each gives its
``state`` (`DecodeState`), ``params``, ``key``, ``policy``, ``drafting``, ``rules``
and their failure (``ruled``, ``rule``; a row whose rules raise fails alone, its
rules left out for the rest of the round).
"""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx

from .cache import (
    assistant_view,
    begin_verify,
    block_context,
    filter_mark,
    keep_below,
    prepare,
    rewind_rows,
)
from .distributed import Sync
from .rejection import AcceptResult, accept_point_mass, accept_stochastic
from .sampling import filtered_logprobs, log_softmax, sample


@dataclass
class DecodeState:
    tokens: List[int]  # committed t_0..t_n; t_n is pending
    hidden: Optional[mx.array]  # (1, n - frontier, H), None without MTP
    frontier: int = 0
    depth: int = 0  # MTP layers in use
    marks: Optional[list] = None  # rollback marks of the last committed verify


@dataclass
class RoundPlan:
    """What one round drafts, flat over its rows (the role of vLLM's
    ``SpecDecodeMetadata``): row b drafts ``ks[b]`` tokens, its lookup draft
    ``lookups[b]`` when it has one (no draft distribution: a point mass), else
    from the heads with draft vocabulary ``vocabs[b]``; ``draft_keys`` and
    ``accept_keys`` are its random keys for this round."""

    ks: List[int]
    lookups: List[Optional[List[int]]]
    vocabs: List[Optional[int]]
    draft_keys: List[Optional[mx.array]]  # None for a greedy row
    accept_keys: List[Optional[mx.array]]

    @property
    def K(self) -> int:
        """The round's width: the longest draft."""
        return max(self.ks, default=0)

    @property
    def heads(self) -> List[int]:
        """Per row, the drafts asked of the heads (0 for a lookup row)."""
        return [0 if look else k for k, look in zip(self.ks, self.lookups)]

    def source(self, b: int) -> str:
        return "lookup" if self.lookups[b] else "heads"

    def vocab(self, b: int) -> Optional[int]:
        """Row b's draft vocabulary (None for a lookup draft)."""
        return None if self.lookups[b] else self.vocabs[b]

    def extended(self, runs: Sequence[Any]) -> "RoundPlan":
        """This plan and, after its rows, ``runs`` drafting nothing."""
        keys = [_keys(r) for r in runs]
        return RoundPlan(
            self.ks + [0] * len(runs),
            self.lookups + [None] * len(runs),
            self.vocabs + [r.policy.vocab for r in runs],
            self.draft_keys + [d for d, _ in keys],
            self.accept_keys + [a for _, a in keys],
        )

    def select(self, rows: Sequence[int]) -> "RoundPlan":
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return RoundPlan(
            pick(self.ks),
            pick(self.lookups),
            pick(self.vocabs),
            pick(self.draft_keys),
            pick(self.accept_keys),
        )


@dataclass
class Round:
    """A launched round: its plan and lazy results. ``heads``: whether the MTP
    layers ran (every row's frontier then moves); ``marks``: the trunk caches'
    rollback marks (`mlx_mtp.cache.begin_verify`)."""

    plan: RoundPlan
    heads: bool
    drafts: mx.array  # (B, K)
    hidden: mx.array  # (B, K + 1, H)
    logprobs: mx.array  # (B, K + 1, V) target log-probabilities
    accepted: mx.array  # (B,)
    next_tokens: mx.array  # (B,)
    marks: list
    # (B, gamma): a block drafter's whole block when rows judge their unverified
    # drafts (`tail`), else None
    proposed: Optional[mx.array] = None

    @property
    def K(self) -> int:
        return self.drafts.shape[1]

    def tail(self, b: int, a: int) -> List[int]:
        """Row b's drafts past its k that its drafter proposed (`draft_block`), when
        its k drafts were all accepted (``a == k``; else none: its block missed)."""
        k = self.plan.ks[b]
        if self.proposed is None or a < k or self.plan.lookups[b] or not k:
            return []
        return self.proposed[b, k:].tolist()

    def select(self, rows: List[int]) -> "Round":
        """The round of ``rows`` only (rows that left the batch dropped)."""
        idx = mx.array(rows, dtype=mx.int32)
        return Round(
            self.plan.select(rows),
            self.heads,
            self.drafts[idx],
            self.hidden[idx],
            self.logprobs[idx],
            self.accepted[idx],
            self.next_tokens[idx],
            [filter_mark(m, idx) for m in self.marks],
            None if self.proposed is None else self.proposed[idx],
        )


def plan(
    runs: Sequence[Any],
    ahead: int = 0,
    cap: Optional[Callable[[List[int], List[bool]], Optional[int]]] = None,
) -> RoundPlan:
    """Each row's drafts for the next round, and its keys (each row's key moves on).

    Row b's k is its policy's, capped by its room (``ahead``: tokens it yields
    before that round), 0 without a hidden state to draft from (a one-token prompt);
    a row drafting from lookups takes its lookup draft when the context has one.
    ``cap(asks, auto)``: a cap on the drafts of the rows its ``auto`` marks (those
    whose text does not depend on their draft lengths), or None.
    """
    ks, lookups = [], []
    for r in runs:
        s = r.state
        k = min(r.policy.next(), r.room(r.stats.emitted + ahead))
        k = min(k, r.model.max_draft or k)  # a block drafter proposes gamma at most
        if s.depth == 0 or len(s.tokens) - 1 + ahead <= s.frontier:
            k = 0  # no heads, or no hidden state to draft from (a one-token prompt)
        found = None
        if r.drafting.lookup_tokens and r.failure is None:
            try:
                found = r.lookup_draft(k)  # its grammar may raise
            except Exception as e:
                r.failure, k = e, 0
        ks.append(len(found) if found else k)
        lookups.append(found)
    auto = [cappable(r) for r in runs]
    limit = cap(ks, auto) if cap is not None else None
    if limit is not None:
        for b, free in enumerate(auto):
            if free and lookups[b]:
                lookups[b] = lookups[b][:limit] or None
                ks[b] = len(lookups[b] or ())
            elif free:
                ks[b] = min(ks[b], limit)
    keys = [_keys(r) for r in runs]
    vocabs = [r.policy.vocab for r in runs]
    return RoundPlan(ks, lookups, vocabs, [d for d, _ in keys], [a for _, a in keys])


def _keys(run) -> tuple:
    """A round's draft and accept keys for ``run`` (its key moves on); none for a
    greedy row, which draws nothing."""
    if run.params.greedy:
        return None, None
    run.key, sub = mx.random.split(run.key)
    return tuple(mx.random.split(sub))


def cappable(run) -> bool:
    """Whether a batch may cap ``run``'s drafts: its options say ``-k auto`` and its
    text does not depend on its draft lengths (greedy, or sampled without a seed).
    A seeded sampled row drafts what its policy asks, as alone, so that its random
    draws, and so its text, are its lone ones."""
    options = run.options
    if options.num_draft_tokens != "auto":
        return False
    return run.params.greedy or options.seed is None


def launch(
    model,
    caches,
    runs: Sequence[Any],
    rp: RoundPlan,
    depth: int,
    pending: Optional[mx.array] = None,
    record: bool = False,
) -> Round:
    """Build one round lazily (draft, verify, accept) and start evaluating it.

    ``pending``: the rows' pending tokens ``(B,)`` when not committed yet (a plain
    round launched behind a plain round); ``record``: make rollback marks even for
    a plain round (a single stream's exit rolls its queued rounds back). On a trunk
    sharded over several ranks (one row), the drafts and the accept decision are
    rank 0's on every rank.
    """
    sync = Sync(model.group)
    for b, r in enumerate(runs):
        if r.ruled:
            r.rule("begin", None if pending is None else pending[b])
    # whether the drafter runs (every row's frontier then moves), decided before a
    # block drafter's confidence cut may leave no row any draft
    heads = max(rp.heads, default=0) > 0 and depth > 0
    drafts, q, proposed = draft(model, caches, runs, rp, depth)
    for b, r in enumerate(runs):
        for token in rp.lookups[b] or ():
            if r.ruled:
                r.rule("push", token)
        if r.ruled:
            r.rule("end_draft")
    if rp.K and sync.group is not None:
        drafts = sync.share(drafts)
        # Submitted now, so that every rank runs this collective before the verify
        # pass's: a pipeline stage's receive does not wait on the tokens in the graph.
        mx.async_eval(drafts)
    if pending is None:
        pending = mx.array([r.state.tokens[-1] for r in runs], dtype=mx.int32)
    hidden, logprobs, marks = verify(
        model, caches.trunk, runs, pending, drafts, record or rp.K > 0
    )
    accepted, next_tokens = accept(runs, rp, drafts, q, logprobs)
    if sync.group is not None:
        accepted, next_tokens = sync.share(accepted), sync.share(next_tokens)
    mx.async_eval(accepted, next_tokens, drafts, hidden, logprobs)
    rnd = Round(rp, heads, drafts, hidden, logprobs, accepted, next_tokens, marks)
    if proposed is not None:
        rnd.proposed = proposed
        mx.async_eval(proposed)
    return rnd


def draft(model, caches, runs: Sequence[Any], rp: RoundPlan, depth: int):
    """``(B, K)`` drafts: the heads' (or an assistant's, or a block drafter's) for
    heads rows, each lookup row's own tokens, zeros past a row's k_b. Returns them
    and per row its ``(K, V)`` draft log-probabilities (None for a greedy or lookup
    row; None for all when no row has any), and a block drafter's whole block
    ``(B, gamma)`` when rows judge their unverified drafts (`draft_block`; else
    None). A block drafter's confidence cut may lower the heads rows' ``rp.ks`` (K
    is the longest after it)."""
    proposed = None
    if model.drafter is None:
        tokens, q = draft_heads(model, caches, runs, rp, depth)
    else:
        tokens, q, proposed = draft_block(model, caches, runs, rp, depth)
    B, K = len(runs), rp.K
    if tokens.shape[1] < K:
        fill = mx.zeros((B, K - tokens.shape[1]), dtype=mx.int32)
        tokens = mx.concatenate([tokens, fill], axis=1)
    if not any(rp.lookups):
        return tokens, q, proposed
    found = [(look or []) + [0] * (K - len(look or ())) for look in rp.lookups]
    is_lookup = mx.array([bool(look) for look in rp.lookups])[:, None]
    tokens = mx.where(is_lookup, mx.array(found, dtype=mx.int32), tokens)
    if q is not None:
        q = [None if rp.lookups[b] else x for b, x in enumerate(q)]
    return tokens, q, proposed


def draft_heads(model, caches, runs: Sequence[Any], rp: RoundPlan, depth: int):
    """Up to K drafts per row from the heads (row b uses its first ``rp.heads[b]``):
    the MTP layers in use over every row's pending rows (frontier..n-1), then the
    last layer chained; or a separate assistant (`draft_assisted`)."""
    ks = rp.heads
    B, K = len(runs), max(ks, default=0)
    if K == 0 or depth == 0:
        return mx.zeros((B, 0), dtype=mx.int32), None
    if model.assistant is not None:
        return draft_assisted(model, caches.trunk, runs, rp)
    mtp_caches = caches.mtp
    steps = max(K, depth)  # every layer in use runs, so every frontier may move
    counts = [len(r.state.tokens) - 1 - r.state.frontier for r in runs]
    width = max(counts)
    pads = [width - c for c in counts]
    h = _padded_hidden(runs, pads)  # (B, width, H)
    keys = _step_keys(rp, ks, steps)
    tokens, logprobs = [], []
    for j in range(steps):
        if j < depth:
            layer, ids = j, _layer_ids(runs, tokens, j, width)
            if any(pads):
                prepare([mtp_caches[layer]], pads)
        else:
            layer, h, ids = depth - 1, h[:, -1:], tokens[-1][:, None]
        h = model.mtp_forward(layer, h, ids, mtp_caches[layer])  # (B, width, H)
        logits = _draft_logits(model, rp, h[:, -1])
        logits = _ruled_logits(model, runs, logits, h[:, -1], tokens, ks)
        token, lp = _pick(runs, logits, keys[j])
        _push(runs, token, ks, j)
        tokens.append(token)
        logprobs.append(lp)
    return mx.stack(tokens[:K], axis=1), _stack_q(logprobs[:K])


def draft_assisted(model, trunk_caches, runs: Sequence[Any], rp: RoundPlan):
    """K draft tokens per row from an assistant: every step at row b's position
    n_b of its pending token, from (t_n, h_{n-1}) and then (its last draft, its own
    h'), reading the trunk's K/V in place (committed positions; the last W + 1 in
    a sliding layer). Nothing is written to any cache."""
    ks = rp.heads
    K = max(ks)
    n = [len(r.state.tokens) - 1 for r in runs]
    kv, masks, position = assistant_view(model, trunk_caches, n)
    keys = _step_keys(rp, ks, K)
    token = mx.array([r.state.tokens[-1] for r in runs], dtype=mx.int32)  # (B,)
    last = [r.state.hidden[:, -1:] for r in runs]  # h_{n-1}
    like = next(x for x in last if x.shape[1])  # a row that drafts has one
    h = mx.concatenate(  # zeros for a row without (a one-token prompt: no draft)
        [x if x.shape[1] else mx.zeros_like(like) for x in last]
    )  # (B, 1, H)
    tokens, logprobs = [], []
    for j in range(K):
        logits, h = model.assist(token[:, None], h, kv, position, masks)
        ruled = _ruled_logits(model, runs, logits[:, -1], None, tokens, ks)
        token, lp = _pick(runs, ruled, keys[j])
        _push(runs, token, ks, j)
        tokens.append(token)
        logprobs.append(lp)
    return mx.stack(tokens, axis=1), _stack_q(logprobs)


def draft_block(model, caches, runs: Sequence[Any], rp: RoundPlan, depth: int):
    """Up to K <= gamma drafts per row from a block drafter (DSpark): every row's
    pending taps (positions frontier..n-1, left-padded to the longest) join its
    context caches, one block pass after each row's anchor t_n at position n gives
    every slot's logits z_k and normed outputs g_k, and slot k is drawn from
    ``z_k + markov(prev_k, g_k, state)``, prev_0 = t_n and prev_k the token drawn at
    slot k-1, so q_k is the distribution of the token actually drawn
    (``/work/notes/dspark_spec.md`` §3); the confidence head cuts each row's
    block (`_cut`). Afterwards the context caches hold positions 0..n-1 of each
    row, as `commit` expects of a round with heads (frontier n).

    When a row judges its unverified drafts (``run.judges_tail``: greedy, see
    `mlx_mtp.draft_length.Unverified`), the Markov head also runs over the slots
    past K (a few ``(B, r) x (r, V)`` products; the pass already made them), and
    the whole block ``(B, gamma)`` is returned too (else None)."""
    ks = rp.heads
    K = max(ks, default=0)
    if K == 0 or depth == 0:
        return mx.zeros((len(runs), 0), dtype=mx.int32), None, None
    _write_context(model, caches.mtp, runs)
    n = [len(r.state.tokens) - 1 for r in runs]
    context = block_context(model.drafter, caches.mtp, n)
    position = n[0] if len(runs) == 1 else mx.array(n, dtype=mx.int32)
    anchor = mx.array([r.state.tokens[-1] for r in runs], dtype=mx.int32)  # (B,)
    vocabs = [v for v, k in zip(rp.vocabs, ks) if k] or [None]
    z, g = model.draft_block(anchor, context, position, vocabs[0])  # (B, gamma, H) g
    z = {vocabs[0]: z}  # per draft vocabulary, (B, gamma, V or its size)
    for v in set(vocabs) - {vocabs[0]}:
        z[v] = model.block_logits(g, v)
    d = model.drafter
    keys = _step_keys(rp, ks, K)
    tokens, logprobs, prev = [], [], anchor
    state = d.markov_start(len(runs), g.dtype)
    judged = any(getattr(r, "judges_tail", False) for r in runs)
    for j in range(g.shape[1] if judged else K):
        logits, state = _slot_logits(model, rp.vocabs, z, prev, g[:, j], state, j)
        if j >= K:  # unverified: for the greedy rows' policies only
            prev = mx.argmax(logits, axis=-1).astype(mx.int32)
            tokens.append(prev)
            continue
        logits = _ruled_logits(model, runs, logits, None, tokens, ks)
        prev, lp = _pick(runs, logits, keys[j])
        _push(runs, prev, ks, j)
        tokens.append(prev)
        logprobs.append(lp)
    block = mx.stack(tokens, axis=1)  # (B, K), or (B, gamma) when judged
    drafts = _cut(model, rp, g, anchor, block[:, :K])
    return drafts, _stack_q(logprobs), block if judged else None


def _slot_logits(model, vocabs, z: dict, prev, g, state, j: int):
    """``(B, V)`` logits of block slot j after the tokens ``prev`` ``(B,)``: each
    row's slot logits from its draft vocabulary (``z``: `Model.block_logits` by
    vocabulary) plus the Markov bias over the same rows, -inf outside them; and the
    Markov head's state after the slot (the same whatever the rows)."""
    out = None
    for v, zv in z.items():
        logits, after = model.slot_logits(zv[:, j], prev, g, state, v)
        if out is None:
            out = logits
        else:
            mine = mx.array([x == v for x in vocabs])[:, None]
            out = mx.where(mine, logits, out)
    return out, after


def _cut(model, rp: RoundPlan, g, anchor, drafts: mx.array) -> mx.array:
    """Cut every heads row's block where the drafter's confidence head stops it
    (`mlx_mtp.models.dspark.DSpark.cut`: a stopping time, so acceptance stays
    exact): row b's ``rp.ks[b]`` becomes ``min(k_b, L_b)``, and the drafts
    ``(B, K)`` are trimmed to the longest heads row. The lengths are read to the
    host (the verify pass's width depends on them), rank 0's on every rank."""
    if not model.drafter.cuts:
        return drafts
    lengths = Sync(model.group).share(model.drafter.cut(g, anchor, drafts))
    for b, length in enumerate(lengths.tolist()):
        if not rp.lookups[b]:
            rp.ks[b] = min(rp.ks[b], length)
    return drafts[:, : max(rp.heads, default=0)]


def _write_context(model, drafter_caches, runs) -> None:
    """Append every row's drafter context rows of positions frontier..n-1 (their
    packed hidden states ``state.hidden``, left-padded to the longest) to the
    drafter's caches, which hold each row's 0..frontier-1."""
    counts = [len(r.state.tokens) - 1 - r.state.frontier for r in runs]
    width = max(counts)
    if width == 0:
        return
    pads = [width - c for c in counts]
    if any(pads):
        prepare(drafter_caches, pads)
    model.draft_context(_padded_hidden(runs, pads), drafter_caches)


def verify(model, trunk_caches, runs, pending: mx.array, drafts: mx.array, mark):
    """One trunk pass over ``(B, K + 1)`` tokens [t_n, d_1..d_K]: the hidden states
    ``(B, K + 1, H)``, the target log-probabilities ``(B, K + 1, V)`` (each row's
    logits processed by its rules with its own prefixes) and the trunk caches'
    rollback marks (``mark`` False: a plain round that will not be rolled back,
    whose marks only hold the recurrent states before it)."""
    ids = mx.concatenate([pending[:, None], drafts], axis=1)  # (B, K + 1)
    marks = begin_verify(trunk_caches, record=mark)
    hidden = model.hidden(ids, trunk_caches)  # (B, K + 1, H)
    logits = model.logits(hidden)  # (B, K + 1, V)
    if any(r.ruled for r in runs):
        out = []
        for b, (r, d) in enumerate(zip(runs, drafts)):
            processed = r.rule("verify_logits", logits[b], d) if r.ruled else None
            out.append(logits[b] if processed is None else processed)
        logits = mx.stack(out)
    return hidden, log_softmax(logits), marks


def accept(runs, rp: RoundPlan, drafts: mx.array, q, logprobs: mx.array):
    """Per row, how many of its first k_b drafts are accepted and the token that
    follows them: greedy matching for greedy rows; for sampled rows exact
    speculative sampling against the row's draft distribution, or against a point
    mass for a lookup draft. Returns ``(B,)`` arrays."""
    K = drafts.shape[1]
    target = mx.argmax(logprobs, axis=-1).astype(mx.int32)  # (B, K + 1)
    if K:
        limit = mx.arange(K)[None] < mx.array(rp.ks)[:, None]
        match = (target[:, :K] == drafts) & limit
        accepted = mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)  # (B,)
        nexts = mx.take_along_axis(target, accepted[:, None], axis=1)[:, 0]
    else:
        accepted, nexts = mx.zeros((len(runs),), dtype=mx.int32), target[:, 0]
    if all(r.params.greedy for r in runs):
        return accepted, nexts
    a_rows, n_rows = [], []
    for b, r in enumerate(runs):
        if r.params.greedy:
            a_rows.append(accepted[b])
            n_rows.append(nexts[b])
            continue
        k, key = rp.ks[b], rp.accept_keys[b]
        p = filtered_logprobs(logprobs[b, : k + 1], r.params)  # (k + 1, V)
        if k == 0:
            res = AcceptResult(mx.array(0, dtype=mx.int32), sample(p[0], key))
        elif rp.lookups[b]:
            res = accept_point_mass(drafts[b, :k], p, key)
        else:
            res = accept_stochastic(drafts[b, :k], q[b][:k], p, key)
        a_rows.append(res.num_accepted.astype(mx.int32))
        n_rows.append(res.next_token.astype(mx.int32))
    return mx.stack(a_rows), mx.stack(n_rows)


def commit(caches, runs, rnd: Round, committed: List[List[int]], depth: int) -> None:
    """Keep in every cache, and append to every row's state, row b's tokens
    ``committed[b]`` (t_n's successors: its accepted drafts and next token, or a
    prefix of them). MTP caches keep only rows whose inputs were all committed
    before this round (rows up to n - depth after a heads round), so every kept
    entry comes from true trunk hidden states; the dropped rows are recomputed
    from ``state.hidden`` by the next draft."""
    kept = [len(new) for new in committed]
    drop = [rnd.K + 1 - m for m in kept]
    if any(drop):
        rewind_rows(caches.trunk, rnd.marks, drop)
    for b, r in enumerate(runs):
        s = r.state
        s.marks = rnd.marks
        if s.hidden is not None:
            n = len(s.tokens) - 1
            frontier = max(s.frontier, n - depth + 1) if rnd.heads else s.frontier
            old = s.hidden[:, frontier - s.frontier :]
            s.hidden = mx.concatenate([old, rnd.hidden[b : b + 1, : kept[b]]], axis=1)
            s.frontier = frontier
        s.tokens.extend(committed[b])
    if rnd.heads:
        keep_below(caches.mtp, [r.state.frontier for r in runs])


def _padded_hidden(runs, pads: List[int]) -> mx.array:
    """Every row's pending hidden states, left-padded to one width. (B, width, H)"""
    if len(runs) == 1:
        return runs[0].state.hidden
    return mx.concatenate(
        [mx.pad(r.state.hidden, [(0, 0), (p, 0), (0, 0)]) for r, p in zip(runs, pads)]
    )


def _step_keys(rp: RoundPlan, ks: List[int], steps: int) -> List[List[mx.array]]:
    """``keys[j][b]``: row b's key for draft step j, as alone: one per draft it
    makes (none for a row drafting nothing: its extra drafts are never accepted,
    any key does); None for a greedy row."""
    rows = [
        None if key is None else mx.random.split(key, max(k, 1))
        for key, k in zip(rp.draft_keys, ks)
    ]
    return [
        [None if rk is None else rk[min(j, rk.shape[0] - 1)] for rk in rows]
        for j in range(steps)
    ]


def _stack_q(logprobs: List[Optional[List]]):
    """Per row its ``(K, V)`` draft log-probabilities from per-step lists."""
    if not logprobs or logprobs[0] is None:
        return None
    return [None if lps[0] is None else mx.concatenate(lps) for lps in zip(*logprobs)]


def _layer_ids(runs, drafts: List[mx.array], j: int, width: int) -> mx.array:
    """Tokens of MTP layer j for every row's pending rows, left-padded to ``width``:
    row b's t_{i+j+1} for i in frontier..n-1, drafts past t_n. (B, width)"""
    host = []
    for r in runs:
        s = r.state
        committed = s.tokens[s.frontier + j + 1 :]
        host.append([0] * (width - len(committed)) + committed)
    ids = mx.array(host, dtype=mx.int32)  # (B, width)
    if j:
        ids = mx.concatenate([ids, mx.stack(drafts[:j], axis=1)], axis=1)
    return ids[:, -width:]


def _draft_logits(model, rp: RoundPlan, h: mx.array) -> mx.array:
    """``(B, V)`` draft logits of ``h`` ``(B, H)``, each row's from its own draft
    vocabulary (`Model.draft_logits`)."""
    vocabs = rp.vocabs
    first = vocabs[0]
    logits = model.draft_logits(h, first)
    for v in set(vocabs) - {first}:
        mine = mx.array([x == v for x in vocabs])[:, None]
        logits = mx.where(mine, model.draft_logits(h, v), logits)
    return logits


def _ruled_logits(model, runs, logits, h, drafts, ks: List[int]):
    """``(B, V)`` draft logits, each row with rules processed as its target row
    after its drafts so far will be (`mlx_mtp.processors.Rules`); a row past its
    ``ks[b]`` drafts, whose drafts are never accepted, is left as it is. A grammar
    that allows none of a draft vocabulary's rows drafts from the whole head (of
    the hidden states ``h``; None for an assistant's)."""
    j = len(drafts)
    ruled = [b for b, r in enumerate(runs) if r.ruled and j < ks[b]]
    if not ruled:
        return logits
    out = [logits[b : b + 1] for b in range(len(runs))]
    for b in ruled:
        run, mine = runs[b], [d[b : b + 1] for d in drafts]
        processed = run.rule("draft_logits", out[b], mine)
        if processed is None:  # it failed: left as it is
            continue
        out[b] = processed
        if h is None or not run.rules.needs_tokens:
            continue
        if not mx.isfinite(out[b]).any().item():
            full = run.rule("draft_logits", model.logits(h[b : b + 1]), mine)
            out[b] = out[b] if full is None else full
    return mx.concatenate(out)


def _push(runs, token: mx.array, ks: List[int], j: int) -> None:
    """Give each grammar row its draft j (read to the host), up to its ``ks[b]``."""
    ruled = [
        b for b, r in enumerate(runs) if r.ruled and r.rules.needs_tokens and j < ks[b]
    ]
    if ruled:
        host = token.tolist()
        for b in ruled:
            runs[b].rule("push", host[b])


def _pick(runs, logits: mx.array, keys: List[mx.array]):
    """One draft token per row from ``(B, V)`` logits: argmax for greedy rows, a
    sample from the row's filtered distribution otherwise. Returns ``(B,)`` tokens
    and, when any row samples, each row's ``(1, V)`` draft log-probabilities (None
    for greedy rows)."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)  # (B,)
    if all(r.params.greedy for r in runs):
        return tokens, None
    picked, q = [], []
    for b, r in enumerate(runs):
        if r.params.greedy:
            picked.append(tokens[b])
            q.append(None)
            continue
        lp = filtered_logprobs(logits[b : b + 1], r.params)  # (1, V)
        # drawn as (1, V) whatever the batch: the same key then gives the same
        # token (a key's draw depends on the shape)
        picked.append(sample(lp, keys[b])[0].astype(mx.int32))
        q.append(lp)
    return mx.stack(picked), q

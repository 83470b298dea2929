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

A stream is prefilled alone, in chunks (`Admission`), then joins between rounds; a
finished or removed stream leaves between rounds (`Batch.remove`).
"""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import mlx.core as mx

from . import batch_cache
from .batch_cache import batch_support, rewind_rows, to_batch
from .cache import Caches, begin_verify, check_rollback, make_caches
from .draft_length import DraftPolicy
from .errors import MTPError
from .options import DecodeOptions
from .rejection import accept_stochastic
from .resolve import drafting
from .sampling import SamplingParams, filtered_logprobs, log_softmax, sample
from .speculative import DecodeState, Session, append, prefill
from .stats import MTPStats


@dataclass
class Row:
    """One stream of a batch (see the module docstring)."""

    uid: Any
    options: DecodeOptions
    params: SamplingParams
    policy: DraftPolicy
    key: mx.array
    stats: MTPStats
    state: DecodeState
    max_tokens: int  # -1: until EOS
    eos: frozenset = frozenset()
    batch_sizes: Dict[int, int] = field(default_factory=dict)  # rounds per batch size
    session: Optional[Session] = None  # set on leaving (`Batch.keep_sessions`)

    def room(self) -> int:
        """The most drafts this row may accept without passing ``max_tokens``."""
        if self.max_tokens < 0:
            return 1 << 30
        return max(0, self.max_tokens - self.stats.emitted - 1)


@dataclass
class RowOutput:
    """What a round gave one row: its new tokens (up to EOS and ``max_tokens``),
    their target log-probabilities ``(n, V)``, which were accepted drafts, and
    ``finish_reason`` ("stop", "length") when the row is done."""

    uid: Any
    tokens: List[int]
    logprobs: mx.array
    from_draft: List[bool]
    finish_reason: Optional[str]
    stats: MTPStats


@dataclass
class BatchRound:
    """One launched round: ``K`` drafts per row (row b uses its first ``ks[b]``)."""

    K: int
    ks: List[int]
    drafts: mx.array  # (B, K)
    hidden: mx.array  # (B, K + 1, H)
    logprobs: mx.array  # (B, K + 1, V)
    accepted: mx.array  # (B,)
    next_tokens: mx.array  # (B,)
    marks: list
    vocab: Optional[int] = None


class Admission:
    """A stream being prefilled alone, one chunk per `advance`, before it joins.

    ``session``: go on from a `Session` (its caches and state are filled in, and the
    prompt is what follows its tokens)."""

    def __init__(self, batch: "Batch", uid, prompt, options, session=None, policy=None):
        prompt = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        if not prompt:
            raise MTPError("the prompt is empty")
        self.uid, self.options, self.batch = uid, options, batch
        model = batch.model
        self.drafting = drafting(model, options, policy)
        if self.drafting.lookup_tokens:
            self.drafting = drafting(
                model, options.replace(draft_source="heads"), policy
            )
        if session is not None and session.state is not None:
            if session.state.depth != batch.depth:
                raise MTPError(
                    f"this session drafts with {session.state.depth} MTP layer(s); "
                    f"the batch with {batch.depth}"
                )
        self.session = session if session is not None else Session()
        self.session.caches = self.session.caches or make_caches(model)
        self.todo = prompt
        self.step = options.prefill_step_size

    @property
    def ready(self) -> bool:
        return not self.todo

    def advance(self) -> None:
        """Run the trunk over the next chunk of the prompt."""
        chunk, self.todo = self.todo[: self.step], self.todo[self.step :]
        model, s, kv = self.batch.model, self.session, self.options.kv
        if s.state is None:
            s.state = prefill(model, s.caches, chunk, self.batch.depth, self.step, kv)
        else:
            s.state = append(model, s.caches, s.state, chunk, self.step, kv)

    def row(self, eos: Iterable[int]) -> Row:
        seed = self.options.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") >> 1
        policy = self.drafting.policy
        return Row(
            self.uid,
            self.options,
            self.options.sampling,
            policy,
            mx.random.key(seed),
            MTPStats(policy.max_k),
            self.session.state,
            self.options.max_tokens,
            frozenset(eos),
        )


class Batch:
    """The streams decoded together and their caches.

    Args:
        model: An `mlx_mtp.models.base.Model` whose caches can batch
            (`mlx_mtp.batch_cache.batch_support`).
        options: The batch's `DecodeOptions`: the longest draft they allow sets the
            MTP layers in use (`depth_for`), the same for every row.
        eos: Token ids that end a row's stream.
        length: Picks each round's K from the rows (default: the largest k a row's
            own policy asks for).
        keep_sessions: A row leaving the batch (finished or removed) gets
            ``row.session``, a `Session` of its caches to go on from later (a
            server's prompt cache of the conversation).

    Every method is called from one thread (the generation loop's).
    """

    def __init__(
        self,
        model,
        options=None,
        eos: Iterable[int] = (),
        length=None,
        keep_sessions: bool = False,
    ):
        reason = batch_support(model)
        if reason is not None:
            raise MTPError(reason)
        self.options = DecodeOptions.build(options).check()
        self.depth = depth_for(model, self.options)
        self.model, self.eos = model, frozenset(eos)
        self.length, self.keep_sessions = length, keep_sessions
        self.rows: List[Row] = []
        self.caches: Optional[Caches] = None
        self.queued: Optional[BatchRound] = None

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, uid, prompt, options=None, session=None, policy=None) -> Admission:
        """A new stream to prefill (`Admission.advance`) and then `join`."""
        options = DecodeOptions.build(options).check()
        if options.max_kv_size is not None or options.kv.bits is not None:
            raise MTPError("a batched stream cannot use max_kv_size or kv_bits")
        return Admission(self, uid, prompt, options, session, policy)

    def join(self, admission: Admission) -> Row:
        """Add an admitted stream (prefilled) to the batch, between rounds."""
        while not admission.ready:
            admission.advance()
        self._cancel()
        row = admission.row(self.eos)
        if row.policy.max_k:
            check_rollback(admission.session.caches.trunk)
        caches = to_batch(admission.session.caches)
        if self.caches is None:
            self.caches = caches
        else:
            self.caches = batch_cache.join(self.caches, caches, [len(self.rows), 1])
        self.rows.append(row)
        return row

    def remove(self, uids: Iterable[Any]) -> List[Row]:
        """Drop the rows of ``uids`` (between rounds); returns them."""
        uids = set(uids)
        gone = [r for r in self.rows if r.uid in uids]
        if not gone:
            return []
        self._cancel()
        if self.keep_sessions:
            for row in gone:
                row.session = self.session_of(row)
        keep = [i for i, r in enumerate(self.rows) if r.uid not in uids]
        self.rows = [self.rows[i] for i in keep]
        if keep:
            batch_cache.select(self.caches, keep)
        else:
            self.caches = None
        return gone

    def session_of(self, row: Row) -> Session:
        """A `Session` holding ``row``'s caches and state (to go on from later)."""
        b = self.rows.index(row)
        like = make_caches(self.model)
        caches = batch_cache.to_single(self.caches, b, like)
        return Session(caches, row.state)

    def step(self) -> List[RowOutput]:
        """Run one round over every row; finished rows leave the batch."""
        if not self.rows:
            return []
        rnd = self.queued or self._launch()
        self.queued = None
        mx.eval(rnd.accepted, rnd.next_tokens, rnd.drafts)
        outputs = self._commit(rnd)
        done = [o.uid for o in outputs if o.finish_reason is not None]
        if done:
            self.remove(done)
        if self.rows:
            self.queued = self._launch()
        return outputs

    def _cancel(self) -> None:
        """Undo a launched round that was not committed (membership changes)."""
        rnd, self.queued = self.queued, None
        if rnd is None:
            return
        mx.eval(rnd.accepted)
        rewind_rows(self.caches.trunk, rnd.marks, [rnd.K + 1] * len(self.rows))
        if rnd.K:
            for c in self.caches.mtp:
                c.keep_below([r.state.frontier for r in self.rows])

    def _plan(self) -> List[int]:
        """Each row's k for the next round (0 for all, or every row's k <= K with
        K >= depth: a round runs all MTP layers in use or none)."""
        asked = [min(r.policy.next(), r.room()) for r in self.rows]
        K = max(asked) if self.length is None else self.length.next(self.rows, asked)
        if K < max(self.depth, 1):
            return [0] * len(self.rows)
        return [min(K, r.room()) if r.policy.max_k else 0 for r in self.rows]

    def _launch(self) -> BatchRound:
        ks = self._plan()
        K = max(ks)
        for r in self.rows:
            r.key, sub = mx.random.split(r.key)
            r.draft_key, r.accept_key = mx.random.split(sub)
        vocabs = {r.policy.vocab for r in self.rows}
        vocab = vocabs.pop() if len(vocabs) == 1 else None
        drafts, q = draft_rows(
            self.model, self.caches.mtp, self.rows, K, self.depth, vocab
        )
        pending = mx.array([r.state.tokens[-1] for r in self.rows], dtype=mx.int32)
        ids = mx.concatenate([pending[:, None], drafts], axis=1)  # (B, K + 1)
        marks = begin_verify(self.caches.trunk)
        hidden = self.model.hidden(ids, self.caches.trunk)  # (B, K + 1, H)
        logprobs = log_softmax(self.model.logits(hidden))  # (B, K + 1, V)
        accepted, next_tokens = accept_rows(self.rows, ks, drafts, q, logprobs)
        mx.async_eval(accepted, next_tokens, drafts, hidden, logprobs)
        return BatchRound(
            K, ks, drafts, hidden, logprobs, accepted, next_tokens, marks, vocab
        )

    def _commit(self, rnd: BatchRound) -> List[RowOutput]:
        accepted = rnd.accepted.tolist()
        nexts = rnd.next_tokens.tolist()
        drafts = rnd.drafts.tolist()
        B = len(self.rows)
        outputs, kept = [], []
        for b, row in enumerate(self.rows):
            a = accepted[b]
            new = drafts[b][:a] + [nexts[b]]
            finish = None
            for i, t in enumerate(new):
                if t in row.eos:
                    new, finish = new[: i + 1], "stop"
                    break
            if row.max_tokens >= 0 and row.stats.emitted + len(new) >= row.max_tokens:
                new = new[: row.max_tokens - row.stats.emitted]
                finish = finish or "length"
            kept.append(len(new))
            row.stats.record(rnd.ks[b], a, "heads", rnd.vocab)
            row.stats.emitted += len(new) - (a + 1)
            row.policy.observe(rnd.ks[b], a)
            row.batch_sizes[B] = row.batch_sizes.get(B, 0) + 1
            outputs.append(
                RowOutput(
                    row.uid,
                    new,
                    rnd.logprobs[b, : len(new)],
                    [i < a for i in range(len(new))],
                    finish,
                    row.stats,
                )
            )
        rewind_rows(self.caches.trunk, rnd.marks, [rnd.K + 1 - m for m in kept])
        for b, row in enumerate(self.rows):
            s, m = row.state, kept[b]
            if s.hidden is not None:
                n = len(s.tokens) - 1
                frontier = s.frontier
                if rnd.K:
                    frontier = max(s.frontier, n - self.depth + 1)
                s.hidden = mx.concatenate(
                    [s.hidden[:, frontier - s.frontier :], rnd.hidden[b : b + 1, :m]],
                    axis=1,
                )
                s.frontier = frontier
            s.tokens.extend(outputs[b].tokens)
        if self.depth:
            for c in self.caches.mtp:
                c.keep_below([r.state.frontier for r in self.rows])
        return outputs


def depth_for(model, options: DecodeOptions) -> int:
    """MTP layers in use for ``options``: as many as their longest draft needs."""
    k = options.num_draft_tokens
    longest = options.max_draft_tokens if k == "auto" else k
    return min(longest, model.num_mtp_layers)


def _pick_rows(rows: List[Row], logits: mx.array, keys: List[mx.array]):
    """One draft token per row from ``(B, V)`` logits: argmax for greedy rows, a
    sample from the row's filtered distribution otherwise. Returns ``(B,)`` tokens
    and, when any row samples, the ``(B, V)`` draft log-probabilities (None rows of
    greedy rows are zeros: unused)."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)  # (B,)
    if all(r.params.greedy for r in rows):
        return tokens, None
    picked, q = [], []
    for b, r in enumerate(rows):
        if r.params.greedy:
            picked.append(tokens[b])
            q.append(mx.zeros(logits.shape[-1:]))
            continue
        lp = filtered_logprobs(logits[b], r.params)  # (V,)
        picked.append(sample(lp, keys[b]).astype(mx.int32))
        q.append(lp)
    return mx.stack(picked), mx.stack(q)


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


def draft_rows(model, mtp_caches, rows: List[Row], K: int, depth: int, vocab=None):
    """K draft tokens per row: the MTP layers in use over every row's pending rows
    (frontier..n-1), then the last layer chained. Returns ``(B, K)`` tokens and the
    per-row ``(B, K, V)`` draft log-probabilities (None when every row is greedy)."""
    B = len(rows)
    if K == 0:
        return mx.zeros((B, 0), dtype=mx.int32), None
    counts = [len(r.state.tokens) - 1 - r.state.frontier for r in rows]
    width = max(counts)
    pads = [width - c for c in counts]
    h = mx.concatenate(
        [mx.pad(r.state.hidden, [(0, 0), (p, 0), (0, 0)]) for r, p in zip(rows, pads)]
    )  # (B, width, H)
    keys = [mx.random.split(r.draft_key, K) for r in rows]
    tokens, logprobs = [], []
    for j in range(K):
        if j < depth:
            layer, ids = j, _layer_ids(rows, tokens, j, width)
            mtp_caches[layer].pad(pads)
        else:
            layer, h, ids = depth - 1, h[:, -1:], tokens[-1][:, None]
        h = model.mtp_forward(layer, h, ids, mtp_caches[layer])  # (B, width, H)
        token, lp = _pick_rows(
            rows, model.draft_logits(h[:, -1], vocab), [k[j] for k in keys]
        )
        tokens.append(token)
        logprobs.append(lp)
    q = None if logprobs[0] is None else mx.stack(logprobs, axis=1)
    return mx.stack(tokens, axis=1), q


def accept_rows(rows: List[Row], ks: List[int], drafts, q, logprobs):
    """Per row, the number of its first ``ks[b]`` drafts accepted and the token that
    follows them: greedy matching for greedy rows, speculative sampling otherwise.
    Returns ``(B,)`` arrays."""
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
            a_rows.append(mx.array(0))
            n_rows.append(sample(p[0], r.accept_key).astype(mx.int32))
            continue
        res = accept_stochastic(drafts[b, :k], q[b, :k], p, r.accept_key)
        a_rows.append(res.num_accepted.astype(mx.int32))
        n_rows.append(res.next_token.astype(mx.int32))
    return mx.stack(a_rows).astype(mx.int32), mx.stack(n_rows).astype(mx.int32)

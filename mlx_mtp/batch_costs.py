"""What a batched round costs, and the longest draft that pays at each batch size.

A round over B rows drafting K tokens costs ``verify(B, K + 1) + K * draft(B)``: one
trunk pass over B x (K + 1) tokens and K draft steps at batch B (a block drafter's
one pass instead, whatever K). Decoding is memory
bound while B x (K + 1) is small, so verifying K + 1 tokens costs little more than
one; as B grows the pass turns compute bound and each draft costs nearly its share.
`BatchCosts` holds these costs, relative to one plain decode step of one row, measured
once per model files, device and MLX version on a grid of batch sizes (interpolated
between them), and kept in ``$MLX_MTP_HOME/batch_costs.json``.

`BatchLength` caps the drafts of the rows that let the loop choose (``-k auto``) at the
K that maximises the whole batch's expected tokens per unit of time, each row's
expected tokens from its own measured acceptance; K = 0 (batched plain decoding)
wherever drafting does not pay, so a batch is never slower than plain decoding by the
costs measured. Rows that asked for a fixed k keep it. Nothing here changes the
output: every round is verified exactly.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .defaults import DEFAULT_MAX_DRAFT_TOKENS, MAX_PROBE_INTERVAL
from .draft_length import (
    MAX_COST,
    AdaptiveLength,
    FixedLength,
    _cost_key,
    least_times,
    median_time,
)
from .errors import MTPError
from .files import read_table, write_table
from .paths import home

VERIFY_WIDTHS = DEFAULT_MAX_DRAFT_TOKENS + 1  # tokens per row measured: 1..5
DRAFT_FLOOR = 0.02  # a draft costs at least this share of a plain round
VERSION = "rounds-4"  # how the costs are measured (older entries are measured anew)
MAX_GRID = 16  # batch sizes one stored entry may hold
SEEN_ROUNDS = 16  # round times kept per (batch size, K), the latest
MIN_SEEN = 4  # round times of both a K and a plain round before they correct the costs
PLAIN_EVERY = 32  # drafting rounds at a batch size between plain ones that time it


@dataclass
class BatchCosts:
    """``verify[B][n - 1]``: a trunk pass over B rows of n tokens, and ``draft[B]``:
    one draft step at batch B, both relative to one row's plain decode step; for
    the batch sizes measured (JSON keys are strings)."""

    verify: Dict[int, List[float]]
    draft: Dict[int, float]
    block: bool = False  # ``draft[B]`` is a block drafter's pass, paid once a round

    def __post_init__(self):
        self.verify = {int(b): list(v) for b, v in self.verify.items()}
        self.draft = {int(b): float(v) for b, v in self.draft.items()}

    @property
    def sizes(self) -> List[int]:
        return sorted(self.verify)

    def _at(self, table: Dict[int, float], B: int) -> float:
        """``table`` at batch B: linear between the sizes measured, and beyond the
        largest along its last segment."""
        sizes = self.sizes
        if B in table:
            return table[B]
        lo = max([s for s in sizes if s < B], default=sizes[0])
        hi = min([s for s in sizes if s > B], default=None)
        if hi is None:
            if len(sizes) == 1:
                return table[lo] * B / lo
            lo, hi = sizes[-2], sizes[-1]
        return table[lo] + (table[hi] - table[lo]) * (B - lo) / (hi - lo)

    def verify_cost(self, B: int, n: int) -> float:
        """A pass over B rows of n tokens (beyond the widths measured: along the
        last step's slope)."""
        return self._at({b: _width(v, n) for b, v in self.verify.items()}, B)

    def round(self, B: int, K: int, scale: float = 1.0) -> float:
        """A round over B rows drafting K tokens each, a draft step costing
        ``scale`` of one from the heads' own rows (`draft_scale`); a block
        drafter's round pays its pass once, whatever K (as
        `mlx_mtp.draft_length.RoundCosts` prices one stream's)."""
        steps = min(K, 1) if self.block else K
        return self.verify_cost(B, K + 1) + steps * scale * self._at(self.draft, B)

    def pays(self, B: int, longest: int, scale: float = 1.0) -> bool:
        """Whether drafting at most ``longest`` tokens (a draft step costing
        ``scale``, as in `round`) could beat plain decoding at batch B, every draft
        accepted: false past the crossover, where the pass turns compute bound and
        no acceptance makes drafting pay."""
        plain = self.round(B, 0)
        return any(
            (K + 1) * plain > self.round(B, K, scale) for K in range(1, longest + 1)
        )


def _width(costs: List[float], n: int) -> float:
    if n <= len(costs):
        return costs[n - 1]
    slope = costs[-1] - costs[-2] if len(costs) > 1 else costs[-1]
    return costs[-1] + slope * (n - len(costs))


def grid(max_batch: int) -> List[int]:
    """The batch sizes measured for batches of up to ``max_batch`` rows: powers of
    two, and ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def measure_batch_costs(
    model, sizes: Sequence[int], filled, reps: int = 3, context: int = 64, passes=3
) -> BatchCosts:
    """`BatchCosts` for ``sizes``, timed on ``filled(model, B, context)``, a
    `mlx_mtp.batch.Batch` of B rows of ``context`` tokens drafting one token each,
    from the heads. A plain round (``verify[B][0]``) and a round drafting one token
    are timed whole, as the loop runs them (`Batch.step`: drafts, verify, accept,
    commit; plain rounds launched ahead, no states recorded); wider verify passes
    as a round runs them (rollback marks, the pass, its rewind). ``draft[B]`` is
    all that the round drafting one token costs beyond its verify pass (the draft
    step, sampling, acceptance, rollback, the MTP caches' upkeep), counted for
    every draft of a longer round, which errs towards drafting less; and at least
    the draft step timed alone (a difference of two medians can come out near 0).

    Every time is the least of ``passes`` medians of ``reps`` (`least_times`), the
    passes going over every batch size in turn, so that other work on the machine
    skews no batch size's costs against another's."""
    if sizes[0] != 1:
        raise MTPError("batch costs are measured from a batch of one row")
    heads = model.num_mtp_layers > 0
    timers = []
    for B in sizes:
        still, stepped = filled(model, B, context), filled(model, B, context)
        timers += [
            partial(_time_verify, still, n, reps) for n in range(2, VERIFY_WIDTHS + 1)
        ]
        timers += [partial(_time_rounds, stepped, k, reps) for k in range(1 + heads)]
        if heads:
            timers.append(partial(_time_draft, still, reps))
    per = VERIFY_WIDTHS + 2 * heads
    times = least_times(timers, passes)
    verify, drafts = {}, {}
    for i, B in enumerate(sizes):
        t = times[i * per : (i + 1) * per]
        wide, plain = t[: VERIFY_WIDTHS - 1], t[VERIFY_WIDTHS - 1]
        verify[B] = [plain] + wide
        drafts[B] = 0.0
        if heads:
            one, step = t[VERIFY_WIDTHS:]
            drafts[B] = max(one - max(wide[0], plain), step, DRAFT_FLOOR * plain)
    unit = verify[1][0]
    return BatchCosts(
        _monotone(verify), _rising({B: d / unit for B, d in drafts.items()})
    )


def _time_rounds(batch, k: int, reps: int) -> float:
    """The median time of one `Batch.step` with every row drafting ``k`` tokens
    (after two rounds that settle what was planned before); the batch keeps a
    launched round afterwards."""
    for row in batch.rows:
        row.run.policy = FixedLength(k)
    batch.step()
    batch.step()
    return median_time(batch.step, reps)


def _monotone(times: Dict[int, List[float]]) -> Dict[int, List[float]]:
    """Verify times relative to one row's one-token pass, made non-decreasing in
    tokens and in rows (a wider pass never costs less: a smaller median is timing
    noise, which would make the policy's choice flicker)."""
    unit, out, below = times[1][0], {}, None
    for B in sorted(times):
        row, best = [], 0.0
        for n, t in enumerate(times[B]):
            best = max(best, t / unit, below[n] if below else 0.0)
            row.append(best)
        out[B], below = row, row
    out[1][0] = 1.0
    return out


def _rising(drafts: Dict[int, float]) -> Dict[int, float]:
    """Draft costs made non-decreasing in rows (a draft step over more rows never
    costs less; a smaller measurement is noise that would make drafting look cheap
    at one batch size)."""
    out, best = {}, 0.0
    for B in sorted(drafts):
        best = max(best, drafts[B])
        out[B] = best
    return out


def _time_verify(batch, n: int, reps: int) -> float:
    from .cache import begin_verify, rewind_rows

    model, caches = batch.model, batch.caches
    B = len(batch)
    ids = mx.zeros((B, n), dtype=mx.int32) + 5

    def verify():
        marks = begin_verify(caches.trunk)
        mx.eval(model.logits(model.hidden(ids, caches.trunk)))
        rewind_rows(caches.trunk, marks, [n] * B)

    return median_time(verify, reps)


def _time_draft(batch, reps: int) -> float:
    """One draft step of every row, as a round drafts it (`Batch.draft_once`)."""
    return median_time(batch.draft_once, reps)


def _costs_file():
    return home() / "batch_costs.json"


def parse_batch_costs(entry) -> Optional[BatchCosts]:
    """The `BatchCosts` of a stored entry, or None unless it is exactly what
    `measure_batch_costs` gives: ``verify`` and ``draft`` over the same batch sizes
    (1 among them, at most `MAX_GRID`), `VERIFY_WIDTHS` finite positive costs each,
    ``verify["1"][0] == 1``."""
    if not (isinstance(entry, dict) and set(entry) == {"verify", "draft"}):
        return None
    verify, draft = entry["verify"], entry["draft"]
    ok = (
        isinstance(verify, dict)
        and isinstance(draft, dict)
        and set(verify) == set(draft)
        and "1" in verify
        and len(verify) <= MAX_GRID
        and all(b.isdigit() and 0 < int(b) <= 4096 for b in verify)
        and all(
            isinstance(v, list)
            and len(v) == VERIFY_WIDTHS
            and all(_is_cost(c) for c in v)
            for v in verify.values()
        )
        and all(_is_cost(d) or d == 0 for d in draft.values())
        and verify["1"][0] == 1
    )
    return BatchCosts(verify, draft) if ok else None


def _is_cost(x) -> bool:
    return type(x) in (int, float) and 0 < x <= MAX_COST and math.isfinite(x)


def model_batch_costs(model, max_batch: int, filled, on_measure=None) -> BatchCosts:
    """The model's `BatchCosts` on `grid` (``max_batch``): measured once per model
    files, device and MLX version (``on_measure`` is called first; ``filled``: see
    `measure_batch_costs`), then read back from ``$MLX_MTP_HOME/batch_costs.json``."""
    sizes = grid(max_batch)
    costs = getattr(model, "batch_costs", None)
    if costs is not None and set(sizes) <= set(costs.sizes):
        return costs
    key = _cost_key(model)
    key = f"{VERSION}:{key}" if key else key
    table = _stored()
    stored = parse_batch_costs(table.get(key)) if key else None
    if stored is None or not set(sizes) <= set(stored.sizes):
        if on_measure is not None:
            on_measure()
        if stored is not None:
            sizes = sorted(set(sizes) | set(stored.sizes))[:MAX_GRID]
        stored = measure_batch_costs(model, sizes, filled)
        if key:
            table = {k: v for k, v in table.items() if parse_batch_costs(v)}
            table[key] = {
                "verify": {str(b): v for b, v in stored.verify.items()},
                "draft": {str(b): v for b, v in stored.draft.items()},
            }
            write_table(_costs_file(), table)
    stored.block = getattr(model, "drafter", None) is not None
    model.batch_costs = stored
    return stored


def _stored() -> dict:
    return read_table(_costs_file())


def expected_tokens(row, k: int) -> float:
    """A row's expected tokens from a round drafting k: its adaptive policy's
    estimate, else one from its statistics (conditional acceptance per position,
    leaning on the position before, 0.6 before anything was drafted)."""
    policy = row.run.policy
    if isinstance(policy, AdaptiveLength):
        return policy.expected_tokens(k, row.vocab)
    acc, drafted = row.stats.accepted_per_position, row.stats.drafted_per_position
    total, run, alpha = 1.0, 1.0, 0.6
    for j in range(k):
        hits = acc[j] if j < len(acc) else 0
        reached = (drafted[0] if j == 0 else acc[j - 1]) if j < len(acc) else 0
        alpha = (hits + 2.0 * alpha) / (reached + 2.0)
        run *= alpha
        total += run
    return total


def draft_scale(rows) -> float:
    """What a draft step over ``rows`` costs against one from the heads' own rows
    (what ``BatchCosts.draft`` measured): each draft vocabulary in use runs its own
    head over every row (`mlx_mtp.round`), so the single-stream costs of the
    vocabularies in use, summed (the MTP layer counted with each, which errs
    towards drafting less), at most 1."""
    costs = rows[0].run.model.round_costs if rows else None
    if costs is None or not costs.draft > 0:
        return 1.0
    vocabs = {r.vocab for r in rows}
    if None in vocabs:
        return 1.0
    steps = [costs.drafts.get(v, costs.draft) for v in vocabs]
    return min(1.0, sum(steps) / costs.draft)


def _unseen(rows, asks: List[int], auto: List[bool]) -> bool:
    """Whether an auto row asks for drafts, has never drafted and knows nothing of
    its model's acceptance (no history, `mlx_mtp.history`): its first round drafts,
    so that its acceptance is measured (and its reply shows drafts)."""
    return any(
        free and a > 0 and r.stats.drafted == 0 and not _learned(r)
        for r, a, free in zip(rows, asks, auto)
    )


def _learned(row) -> bool:
    policy = row.run.policy
    return isinstance(policy, AdaptiveLength) and policy.learned


@dataclass
class BatchLength:
    """The longest draft that pays for the batch, from its `BatchCosts` (see the
    module docstring); ``depth``: the MTP layers in use. With drafting off, every
    ``probe_every``-th round still lets the rows draft ``depth`` tokens, so that a
    change of acceptance is noticed (as `AdaptiveLength` probes alone), and so does
    the first round of a row that has not drafted yet (its acceptance unknown). The
    interval doubles after each probe while drafting still does not pay (up to
    `MAX_PROBE_INTERVAL` rounds: a probe costs a drafting round where one does not
    pay), and is ``probe_every`` again once it pays: an acceptance that falls below
    what pays switches drafting off for good but for those rare probes (the kill
    switch). Past the crossover (`BatchCosts.pays`: no acceptance would pay at this
    batch size) the auto rows never draft beyond the fixed rows, and nothing
    probes."""

    costs: BatchCosts
    depth: int = 1
    probe_every: int = 16  # with drafting off, let the rows draft this often at first
    idle: int = 0  # rounds since drafting was last let through
    interval: int = 0  # the rounds between probes now (0: ``probe_every``)
    seen: Dict[Tuple[int, int], Deque[float]] = field(default_factory=dict)
    unplain: Dict[int, int] = field(default_factory=dict)  # drafting rounds per B
    plain_left: Dict[int, int] = field(default_factory=dict)  # plain rounds to run
    pairs: Dict[int, int] = field(default_factory=dict)  # plain pairs run per B

    def observe(self, B: int, K: int, seconds: float) -> None:
        """A round over B rows drafting (at most) K tokens from the heads took
        ``seconds``, from the previous round's results to its own (nothing else
        run between them; a plain one after a plain one, as plain rounds run)."""
        seen = self.seen.setdefault((B, K), deque(maxlen=SEEN_ROUNDS))
        seen.append(seconds)

    def correction(self, B: int, K: int, scale: float = 1.0) -> float:
        """How much dearer a round drafting K at batch B is against a plain one
        than the measured costs say, as the batch's own rounds went (the medians
        of the latest of each; a K not timed yet takes the nearest K timed); 1
        until a drafting and a plain round were each timed `MIN_SEEN` times. It
        catches costs measured on a busier machine, or rounds the table
        misprices."""
        plain = self.seen.get((B, 0), ())
        timed = [
            j for (b, j), t in self.seen.items() if b == B and j and len(t) >= MIN_SEEN
        ]
        if K == 0 or not timed or len(plain) < MIN_SEEN:
            return 1.0
        j = min(timed, key=lambda j: (abs(j - K), j))
        seen = statistics.median(self.seen[B, j]) / statistics.median(plain)
        return seen / (self.costs.round(B, j, scale) / self.costs.round(B, 0))

    def round_cost(self, B: int, K: int, scale: float = 1.0) -> float:
        """`BatchCosts.round` as corrected by the rounds seen (`correction`)."""
        return self.costs.round(B, K, scale) * self.correction(B, K, scale)

    def rate(self, rows, asks: List[int], auto: List[bool], K: int) -> float:
        """Expected tokens of all rows per unit of cost with drafts capped at K."""
        tokens = sum(
            expected_tokens(r, min(K, a) if free else a)
            for r, a, free in zip(rows, asks, auto)
        )
        return tokens / self.round_cost(len(rows), K, draft_scale(rows))

    def cap(self, rows, asks: List[int], auto: List[bool]) -> Optional[int]:
        """The cap on the ``auto`` rows' drafts (None: none needed); ``asks``: each
        row's k as its own policy planned it."""
        fixed = max((a for a, free in zip(asks, auto) if not free), default=0)
        longest = max((a for a, free in zip(asks, auto) if free), default=0)
        if longest <= fixed or len(rows) == 1:
            return None
        if not self.costs.pays(len(rows), longest, draft_scale(rows)):
            return fixed  # past the crossover: no probe, no first draft either
        options = [fixed] + [k for k in range(max(fixed + 1, self.depth), longest + 1)]
        best = max(options, key=lambda K: self.rate(rows, asks, auto, K))
        interval = self.interval or self.probe_every
        if best == 0 and not _unseen(rows, asks, auto):
            self.idle += 1  # a probe now and then, so that acceptance is seen
            if self.idle < interval:
                return 0
            self.interval = min(2 * interval, MAX_PROBE_INTERVAL)  # none paid
        elif best > 0:
            self.interval = 0
        if best == 0:
            best = min(longest, max(self.depth, 1))
        self.idle = 0
        if fixed == 0 and self._times_plain(len(rows)):
            return 0
        return None if best >= longest else best

    def _times_plain(self, B: int) -> bool:
        """Whether this round, which would draft, is plain instead, so that
        `correction` has plain rounds at batch B to weigh the drafting ones
        against: two in a row (the second is timed: a plain round runs behind a
        plain one) after `PLAIN_EVERY` drafting rounds (`MIN_SEEN` while fewer
        than `MIN_SEEN` pairs ran)."""
        if self.plain_left.get(B):
            self.plain_left[B] -= 1
            return True
        pairs = self.pairs.get(B, 0)
        every = PLAIN_EVERY if pairs >= MIN_SEEN else MIN_SEEN
        self.unplain[B] = self.unplain.get(B, 0) + 1
        if self.unplain[B] <= every:
            return False
        self.unplain[B], self.plain_left[B], self.pairs[B] = 0, 1, pairs + 1
        return True

    def describe(self, sizes: Sequence[int], alpha: float, k: int) -> Dict[int, dict]:
        """Per batch size: the speedup over plain of drafting k with acceptance
        ``alpha`` at every position (what the policy weighs; for reports)."""
        out = {}
        expected = sum(alpha**j for j in range(k + 1))
        for B in sizes:
            ratio = expected / self.costs.round(B, k) * self.costs.round(B, 0)
            out[B] = {"k": k, "speedup": ratio, "drafts": ratio > 1.0}
        return out

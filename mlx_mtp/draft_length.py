"""How many tokens to draft next round: a fixed k, or the k that maximises expected
tokens per unit of time on the machine at hand.

A round that drafts k tokens costs ``verify(k + 1) + k * draft`` (in units of one plain
decode step, measured once per model and machine by `measure_costs`), or with a block
drafter ``verify(k + 1) + block``: one block pass proposes every k up to gamma at
about the same cost (its per-slot Markov steps, rank r, are small beside it), and emits
``1 + sum_{i<=k} prod_{j<=i} alpha_j`` tokens on average, with ``alpha_j`` the
probability that draft j is accepted given that draft j-1 was. `AdaptiveLength`
estimates the alphas from recent rounds (exponentially forgotten, so a change of
workload inside one generation is followed) and picks the k with the best ratio. When
drafting does not pay (k = 0), it still drafts every ``probe_every``-th round so that it
notices when acceptance comes back; the interval doubles while the probes find that it
still does not pay (a probe costs a drafting round), as the batched loop's does.

The choice of k never changes the output: every round is verified exactly.
"""

import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .cache import assistant_kv, begin_verify, make_caches, mtp_caches, ops, rewind
from .defaults import (
    DEFAULT_LOOKUP_TOKENS,
    DEFAULT_MAX_DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
    MAX_PROBE_INTERVAL,
)
from .distributed import Sync
from .draft_vocab import auto_sizes
from .files import model_stamps, read_table, write_table
from .history import DEFAULT_PRIOR, Counts
from .paths import home

# The most a stored cost may be, in plain decode steps: more is no measurement.
MAX_COST = 1000.0
MAX_DRAFT_VOCABS = 64  # draft vocabulary sizes one stored entry may describe
MIN_EVIDENCE = 4.0  # judged drafts at a position before its estimate is trusted


@dataclass
class RoundCosts:
    """Round costs relative to one plain decode step t(1).

    ``verify[n - 1]`` is t(n) / t(1), a trunk pass over n tokens (as measured: it
    need not rise with n, a matrix kernel may run 8 rows faster than 7, and a
    round then drafts the longer k at the lower cost); ``draft`` one MTP
    step; ``drafts[n]`` one MTP step drafting from a draft vocabulary of n tokens
    (`mlx_mtp.draft_vocab`), or a block drafter's pass drafting from one; ``block``
    a block drafter's pass (0: none), which a round drafting any k > 0 pays once,
    whatever k.
    """

    verify: List[float]
    draft: float
    drafts: Dict[int, float] = field(default_factory=dict)
    block: float = 0.0

    def __post_init__(self):
        self.drafts = {int(n): c for n, c in self.drafts.items()}  # JSON keys

    def round(self, k: int, vocab: Optional[int] = None) -> float:
        """A round drafting k tokens (from ``vocab`` tokens; None: the heads' own)."""
        if self.block:
            block = self.block if vocab is None else self.drafts.get(vocab, self.block)
            return self.verify[k] + (block if k else 0.0)
        step = self.draft if vocab is None else self.drafts.get(vocab, self.draft)
        return self.verify[k] + k * step


def measure_costs(
    model, max_k: int, reps: int = 3, context: int = 64, vocabs: Sequence[int] = ()
) -> RoundCosts:
    """Round costs relative to t(1), from `time_round` after ``context`` tokens (a
    block drafter's pass as ``block``)."""
    ids = mx.arange(context, dtype=mx.int32) % model.args.vocab_size
    t, draft, drafts = time_round(model, ids, max_k, reps, vocabs)
    verify, drafts = [x / t[0] for x in t], {n: d / t[0] for n, d in drafts.items()}
    if model.drafter is not None:
        return RoundCosts(verify, 0.0, drafts, block=draft / t[0])
    return RoundCosts(verify, draft / t[0], drafts)


def time_round(
    model,
    ids: mx.array,
    max_k: int,
    reps: int,
    vocabs: Sequence[int] = (),
    passes: int = 3,
) -> Tuple[List[float], float, Dict[int, float]]:
    """Seconds (`least_times`: the least of ``passes`` interleaved medians of
    ``reps`` calls), after the tokens ``ids`` (1-D) are in the caches, of a verify
    pass over n = 1..max_k+1 tokens (as a round verifies: rollback marks, pass,
    rewind), of one draft step (0.0 for a model without heads; a block drafter's
    whole pass), and of one draft step from each draft vocabulary size in
    ``vocabs``."""
    caches = make_caches(model)
    mx.eval(model.hidden(ids[None], caches.trunk))

    def verify(n: int):
        marks = begin_verify(caches.trunk)
        mx.eval(model.logits(model.hidden(ids[None, :n], caches.trunk)))
        rewind(caches.trunk, marks, n)

    timers = [
        partial(median_time, partial(verify, n), reps) for n in range(1, max_k + 2)
    ]
    steps = _draft_steps(model, caches, ids, vocabs)
    times = least_times(timers + [partial(median_time, s, reps) for s in steps], passes)
    t, rest = times[: max_k + 1], times[max_k + 1 :]
    draft = rest[0] if rest else 0.0
    return t, draft, dict(zip(vocabs, rest[1:]))


def _draft_steps(model, caches, ids: mx.array, vocabs: Sequence[int]) -> list:
    """The draft steps to time after the context ``ids``: the drafter's one (a block
    drafter's whole block, an assistant's step, or the first MTP layer's, from the
    whole head), then the first MTP layer's from each draft vocabulary in ``vocabs``
    (none for a model without heads)."""
    if model.drafter is not None:
        return [_block_step(model, ids)] + [_block_step(model, ids, n) for n in vocabs]
    if model.assistant is not None:
        h = model.hidden(ids[None, -1:])
        kv = assistant_kv(model, caches.trunk)
        mx.eval(h, kv)

        def assist():
            logits, _ = model.assist(ids[None, -1:], h, kv, len(ids))
            mx.eval(mx.argmax(logits, axis=-1))

        return [assist]
    if not model.num_mtp_layers:
        return []
    h = model.hidden(ids[None, -1:])
    mx.eval(h)

    def step(vocab=None):
        z = model.mtp_forward(0, h, ids[None, -1:])
        mx.eval(mx.argmax(model.draft_logits(z, vocab), axis=-1))

    return [step] + [partial(step, n) for n in vocabs]


def _block_step(model, ids: mx.array, vocab: Optional[int] = None):
    """A block drafter's pass after the context ``ids`` (its gamma slots' logits,
    from the draft vocabulary ``vocab``), which a round pays once whatever its k
    (`RoundCosts.block`, ``drafts[vocab]``)."""
    drafter_caches = mtp_caches(model)
    h = model.hidden(ids[None, :-1], make_caches(model).trunk)
    model.draft_context(h, drafter_caches)
    context = [ops(c).read_kv([len(ids) - 1]) for c in drafter_caches]
    mx.eval([kv for kv, _ in context])
    anchor = ids[-1:]

    def step():
        z, _ = model.draft_block(anchor, context, len(ids) - 1, vocab)
        mx.eval(mx.argmax(z, axis=-1))

    return step


def median_time(fn, reps: int) -> float:
    """The median seconds of ``reps`` calls of ``fn`` (after one that warms up)."""
    times = []
    for _ in range(reps + 1):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times[1:])


def least_times(timers: Sequence[Callable[[], float]], passes: int) -> List[float]:
    """Each timer's least result over ``passes`` passes that call every timer in
    turn. Interleaved, a burst of other work on the machine slows one pass of
    several timers rather than every measurement of one, and the least drops the
    passes it slowed: the costs are those of the machine when it is not shared,
    and their ratios are not skewed by when each was measured."""
    times = [[] for _ in timers]
    for _ in range(passes):
        for out, timer in zip(times, timers):
            out.append(timer())
    return [min(t) for t in times]


def model_costs(
    model, max_k: int, vocabs: Sequence[int] = (), on_measure=None
) -> RoundCosts:
    """The model's round costs for k up to ``max_k`` (and draft steps from each draft
    vocabulary size in ``vocabs``): measured once per model files, device and MLX
    version, and kept in ``$MLX_MTP_HOME/costs.json``, so that a seeded sampled run
    drafts the same ks, and so gives the same text, every time. ``on_measure`` is
    called before a measurement (a server says why its start takes a while)."""

    def enough(c) -> bool:
        return len(c.verify) > max_k and set(vocabs) <= set(c.drafts)

    costs = model.round_costs
    if costs is not None and enough(costs):
        return costs
    sync = Sync(model.group)
    key = _cost_key(model)
    stored = previous = parse_costs(_stored_costs().get(key)) if key else None
    has_heads = model.assistant is not None or model.num_mtp_layers > 0
    if not (stored and enough(stored)) or (has_heads and not _drafts(model, stored)):
        stored = None
    if sync.share_int(int(stored is not None)):  # rank 0 decides: read or measure
        zeros = RoundCosts([0.0] * (max_k + 1), 0.0, dict.fromkeys(vocabs, 0.0))
        costs = stored or zeros
    else:  # every rank times the same passes (a sharded trunk's collectives match)
        reach, sizes = _to_measure(model, max_k, vocabs, previous)
        if on_measure is not None:
            on_measure()
        costs = measure_costs(model, reach, vocabs=sizes)
        if key and sync.rank == 0:
            _store_costs(key, costs)
    if sync.group is not None:  # rank 0's costs, so that every rank picks the same k
        sizes, n = sorted(vocabs), max_k + 1  # the same shape on every rank
        shared = sync.share_values(
            [*costs.verify[:n], costs.draft, costs.block]
            + [costs.drafts[v] for v in sizes]
        )
        drafts = dict(zip(sizes, shared[n + 2 :]))
        costs = RoundCosts(shared[:n], shared[n], drafts, shared[n + 1])
    model.round_costs = costs
    return costs


def _drafts(model, costs: RoundCosts) -> bool:
    """Whether ``costs`` price the model's drafting: a block drafter's pass, or
    another drafter's step (an entry from before block costs has no pass)."""
    return (costs.block if model.drafter is not None else costs.draft) > 0


def _to_measure(model, max_k: int, vocabs, previous: Optional[RoundCosts]):
    """The longest k and the draft vocabulary sizes a new measurement covers: what is
    asked, what the default options need, and what the stored entry it replaces held
    (so that a later run with other options, or an earlier one's, finds the same
    costs: a seeded run then drafts the same ks), within `MAX_DRAFT_VOCABS` sizes."""
    reach = max(max_k, DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_LOOKUP_TOKENS)
    sizes = set(vocabs)
    if model.vocab_ranking is not None:
        sizes.update(auto_sizes(model.args.vocab_size))
    if previous is not None:
        reach = max(reach, len(previous.verify) - 1)
        kept = sorted(set(previous.drafts) - sizes)
        sizes.update(kept[: max(0, MAX_DRAFT_VOCABS - len(sizes))])
    return reach, sorted(sizes)


def _costs_file() -> Path:
    return home() / "costs.json"


def _cost_key(model) -> Optional[str]:
    """Model folder (and a separate assistant's) and their files' sizes and times,
    device, MLX version, and preloaded libraries (a BLAS swapped in changes the
    costs)."""
    stamps = model_stamps(model)
    if stamps is None:
        return None
    ranks = model.group.size() if model.group is not None else 1
    machine = [
        str(mx.default_device()),
        mx.__version__,
        os.environ.get("LD_PRELOAD"),
        ranks,
    ]
    return json.dumps([*stamps, *machine])


def parse_costs(entry) -> Optional[RoundCosts]:
    """The `RoundCosts` of an entry of the costs file, or None unless it is exactly
    what `measure_costs` gives (as `_store_costs` writes it): the fields
    ``verify``, ``draft`` and ``drafts``, and ``block`` for a block drafter only;
    1 to ``MAX_DRAFT_TOKENS + 1`` verify costs, the first 1; ``draft`` 0 (a model
    without heads, or a block drafter) or a cost; ``drafts`` at most
    `MAX_DRAFT_VOCABS` costs keyed by positive whole numbers (JSON strings);
    ``block`` a cost. A cost is a finite number in (0, `MAX_COST`]."""
    fields = {"verify", "draft", "drafts"}
    if not (isinstance(entry, dict) and set(entry) in (fields, fields | {"block"})):
        return None
    verify, draft, drafts = entry["verify"], entry["draft"], entry["drafts"]
    block = entry.get("block")
    if block is not None and not _is_cost(block):
        return None
    if not (
        isinstance(verify, list)
        and 1 <= len(verify) <= MAX_DRAFT_TOKENS + 1
        and all(_is_cost(c) for c in verify)
        and verify[0] == 1
        and (_is_cost(draft) or (type(draft) in (int, float) and draft == 0))
        and isinstance(drafts, dict)
        and len(drafts) <= MAX_DRAFT_VOCABS
        and all(re.fullmatch(r"[1-9][0-9]{0,9}", n) for n in drafts)
        and all(_is_cost(c) for c in drafts.values())
    ):
        return None
    return RoundCosts(
        [float(c) for c in verify], float(draft), drafts, float(block or 0.0)
    )


def _is_cost(x) -> bool:
    return type(x) in (int, float) and 0 < x <= MAX_COST and math.isfinite(x)


def _stored_costs() -> dict:
    """The costs file's table (its entries are checked by `parse_costs`)."""
    return read_table(_costs_file())


def _store_costs(key: str, costs: RoundCosts) -> None:
    """Add one entry, dropping every entry `parse_costs` refuses, and write the file
    whole: to a temporary file, then renamed over it (concurrent writers: the last
    one wins, and the file is always one complete table). A cache that cannot be
    written is skipped."""
    table = {k: v for k, v in _stored_costs().items() if parse_costs(v) is not None}
    entry = asdict(costs)
    if not costs.block:
        del entry["block"]
    table[key] = entry
    write_table(_costs_file(), table)


class DraftPolicy:
    """How many tokens the heads draft each round, and from which draft vocabulary:
    the protocol the loop drives (fixed, adaptive and the tests' scripted policies).

    ``max_k`` is the longest draft it may ask for (it sets the MTP layers in use);
    ``vocab`` the draft vocabulary of the round ``next`` just planned (None: the heads'
    own rows). The loop calls ``next`` before each heads round and ``observe`` after
    it is committed.
    """

    max_k: int = 0
    vocab: Optional[int] = None
    judges: bool = False  # whether it learns from `judge` (it chooses among ks)

    def next(self) -> int:
        """The next round's k, from 0 to ``max_k``."""
        raise NotImplementedError

    def observe(self, k: int, accepted: int, missed: bool = False) -> None:
        """A round drafted k and ``accepted`` were accepted; ``missed``: the target's
        token at the first rejected draft was outside the rows drafted from."""

    def judge(self, j: int, accepted: bool) -> None:
        """A draft at position j (0-based) that no round verified was judged later
        (`Unverified`): ``accepted``, whether a round would have accepted it."""


class FixedLength(DraftPolicy):
    """Draft k tokens every round (from the draft vocabulary ``vocab``)."""

    def __init__(self, k: int, vocab: Optional[int] = None):
        self.max_k = k
        self.vocab = vocab

    def next(self) -> int:
        return self.max_k


class Coverage:
    """The share of the target's tokens inside each draft vocabulary of ``sizes``
    tokens (`mlx_mtp.draft_vocab`): the calibration's share at first, then the
    generated tokens' (exponentially forgotten).

    Args:
        ranking: The model's `mlx_mtp.draft_vocab.Ranking`.
        sizes: Draft vocabulary sizes, ascending.
        prior: How many tokens the share to start from counts for.
        memory: Tokens over which the generated tokens' share is averaged.
        start: The share to start from per size (the model's history), instead of
            the calibration's.
    """

    def __init__(
        self,
        ranking,
        sizes: Sequence[int],
        prior=64.0,
        memory=512.0,
        start: Optional[Dict[int, float]] = None,
    ):
        self.rank = ranking.rank
        self.sizes = list(sizes)
        self.decay = 1.0 - 1.0 / memory
        self.total = prior
        start = start or {n: ranking.coverage(n) for n in self.sizes}
        self.inside = {n: prior * start[n] for n in self.sizes}
        self.seen = Counts.empty(len(self.sizes))  # this generation's tokens, by size

    def contains(self, token: int, vocab: Optional[int]) -> bool:
        """Whether ``token`` is among the ``vocab`` most expected (None: all)."""
        return vocab is None or int(self.rank[token]) < vocab

    def share(self, vocab: Optional[int]) -> float:
        return 1.0 if vocab is None else self.inside[vocab] / self.total

    def observe(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.total = self.total * self.decay + 1.0
            r = int(self.rank[t])
            for i, n in enumerate(self.sizes):
                self.inside[n] = self.inside[n] * self.decay + float(r < n)
                self.seen.reached[i] += 1.0
                self.seen.hits[i] += float(r < n)


class AdaptiveLength(DraftPolicy):
    """Pick k in ``allowed`` (and the draft vocabulary among ``vocabs``) maximising
    expected tokens per unit of cost.

    With several vocabularies, acceptance at position j drafting from ``n`` tokens is
    modelled as ``beta_j * share(n)``: ``beta_j`` the heads' acceptance when the
    target's token is among the rows drafted from (rounds whose first rejected token
    fell outside them are not counted against it), ``share(n)`` the `Coverage` of
    ``n``. A smaller vocabulary costs less per draft step and loses that share.

    Args:
        costs: Round costs for k = 0..max(allowed) (and ``costs.drafts`` for each
            vocabulary size).
        allowed: Draft lengths to choose from (include 0 to allow plain rounds).
        memory: Rounds over which acceptance is averaged (exponential forgetting).
        prior: Acceptance assumed before any draft at a position is seen: one
            value (for the first position; the others lean on the one before), or
            one per position (the model's history, `mlx_mtp.history`).
        probe_every: With k = 0 chosen, draft the smallest allowed k > 0 this often at
            first; the interval doubles after each probe after which drafting still
            does not pay (up to `MAX_PROBE_INTERVAL` rounds), and is ``probe_every``
            again once it pays. With k > 0 chosen, draft one position deeper this
            often while that position has fewer than `MIN_EVIDENCE` judged drafts,
            so that a deeper draft that would pay is found (an estimate leaning on
            the position before never learns otherwise).
        vocabs: Draft vocabularies to choose from: None (the heads' own rows) and/or
            numbers of tokens.
        coverage: Their `Coverage` (needed with more than one vocabulary).
    """

    def __init__(
        self,
        costs: RoundCosts,
        allowed: Sequence[int],
        memory: float = 16.0,
        prior: Union[float, Sequence[float]] = DEFAULT_PRIOR,
        probe_every: int = 16,
        vocabs: Sequence[Optional[int]] = (None,),
        coverage: Optional[Coverage] = None,
    ):
        self.costs = costs
        self.allowed = sorted(set(allowed))
        self.max_k = self.allowed[-1]
        self.decay = 1.0 - 1.0 / memory
        self.learned = not isinstance(prior, (int, float))  # from the history
        self.priors = list(prior) if self.learned else [prior]
        self.probe_every = probe_every
        self.vocabs = list(vocabs)
        self.coverage = coverage if len(self.vocabs) > 1 else None
        self.vocab = self.vocabs[0]  # the next round's draft vocabulary
        self.reached = [0.0] * self.max_k  # drafts at position j that were judged
        self.hits = [0.0] * self.max_k  # ... and accepted
        self.seen = Counts.empty(self.max_k)  # the same, never forgotten
        self.idle = 0  # rounds since the last draft
        self.interval = probe_every  # rounds between probes now
        self.shallow = 0  # drafting rounds since the last one drafted deeper
        self.judges = len(self.allowed) > 1

    def alphas(self) -> List[float]:
        """Acceptance at each position given the previous one was accepted (with the
        target's token among the rows drafted from); positions with little evidence
        lean on their prior, or where there is none on the position before."""
        out, prev = [], self.priors[0]
        for j, (hits, reached) in enumerate(zip(self.hits, self.reached)):
            start = self.priors[j] if j < len(self.priors) else prev
            prev = (hits + 2.0 * start) / (reached + 2.0)
            out.append(prev)
        return out

    def expected_tokens(self, k: int, vocab: Optional[int] = None) -> float:
        share = self.coverage.share(vocab) if self.coverage else 1.0
        total, run = 1.0, 1.0
        for a in self.alphas()[:k]:
            run *= a * share
            total += run
        return total

    def rate(self, k: int, vocab: Optional[int] = None) -> float:
        """Expected tokens per unit of cost of a round drafting k from ``vocab``."""
        return self.expected_tokens(k, vocab) / self.costs.round(k, vocab)

    def best_vocab(self, k: int) -> Optional[int]:
        return max(self.vocabs, key=lambda n: self.rate(k, n)) if k else self.vocab

    def best(self) -> int:
        return max(self.allowed, key=lambda k: self.rate(k, self.best_vocab(k)))

    def next(self) -> int:
        k = self.best()
        if k:
            self.interval = self.probe_every  # drafting pays again
            k = self._deeper(k)
        elif self.idle + 1 >= self.interval and self.max_k:
            k = self.allowed[1]  # a probe: drafting has not paid since the last one
            self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        self.idle = 0 if k else self.idle + 1
        self.vocab = self.best_vocab(k)
        return k

    def _deeper(self, k: int) -> int:
        """``k``, or a longer allowed length when it is time to probe the position
        after k: every ``probe_every`` drafting rounds while it has fewer than
        `MIN_EVIDENCE` judged drafts. Heads probe one position deeper (each costs
        a draft step); a block drafter the longest (its pass proposed them all)."""
        longer = [x for x in self.allowed if x > k]
        self.shallow += 1
        if not longer or self.reached[k] >= MIN_EVIDENCE:
            return k
        if self.shallow < self.probe_every:
            return k
        self.shallow = 0
        return longer[-1] if self.costs.block else longer[0]

    def observe(self, k: int, accepted: int, missed: bool = False) -> None:
        """Each position's acceptance is forgotten over its own judged drafts (a
        position seldom drafted keeps what its rare drafts showed)."""
        for j in range(min(k, accepted + int(not missed))):
            self.judge(j, j < accepted)

    def judge(self, j: int, accepted: bool) -> None:
        self.reached[j] = self.reached[j] * self.decay + 1.0
        self.hits[j] = self.hits[j] * self.decay + float(accepted)
        self.seen.reached[j] += 1.0
        self.seen.hits[j] += float(accepted)


class Unverified:
    """A greedy stream's drafts that no round verified: a block drafter's slots past
    a round's k, which its one pass proposes anyway (`mlx_mtp.round.draft_block`).

    Greedy, the token committed at a position is the target's whatever later rounds
    draft, so each such draft is judged against the tokens committed after it, up to
    its block's first miss, as a round drafting the whole block would have judged
    it: the policy learns the acceptance of positions it seldom drafts at no verify
    cost (probing them costs a wider verify pass). A token outside the rows drafted
    from stops its block unjudged, as it does a round (``missed``).
    """

    def __init__(self):
        self.committed = 0  # tokens committed since the stream began
        # per block: stream index of its next draft, its position, drafts, vocabulary
        self.pending: List[Tuple[int, int, List[int], Optional[int]]] = []

    def add(self, k: int, tail: Sequence[int], vocab: Optional[int]) -> None:
        """The drafts past k of a round whose k drafts were all accepted (its
        committed tokens, next to `judge`, follow them)."""
        if tail:
            self.pending.append((self.committed + k, k, list(tail), vocab))

    def judge(
        self, new: Sequence[int], inside: Callable[[int, Optional[int]], bool]
    ) -> List[Tuple[int, bool]]:
        """``(position, accepted)`` of each pending draft the committed tokens
        ``new`` reach; ``inside(token, vocab)``: whether ``token`` is among the
        rows of the draft vocabulary ``vocab``."""
        judged, kept, end = [], [], self.committed + len(new)
        for at, j, tokens, vocab in self.pending:
            i, go = 0, True
            while go and i < len(tokens) and at + i < end:
                token = new[at + i - self.committed]
                counted = inside(token, vocab)  # else unjudged, as a round's miss
                go = counted and token == tokens[i]
                if counted:
                    judged.append((j + i, go))
                i += 1
            if go and i < len(tokens):
                kept.append((at + i, j + i, tokens[i:], vocab))
        self.committed, self.pending = end, kept
        return judged


class SourceChoice:
    """Draft from the context or from the heads, round by round (``draft_source``
    "auto"): the source, and the lookup draft's length, with the best expected tokens
    per unit of cost, plain decoding included.

    Each source's acceptance per position is estimated from its own rounds (as
    `AdaptiveLength` does, exponentially forgotten); a lookup draft costs its verify
    pass only, a heads draft its verify pass and its draft steps.

    Args:
        costs: Round costs covering the longest draft of either source.
        max_heads: The heads' longest draft.
        max_lookup: The longest lookup draft.
        priors: Each source's acceptance per position to start from ("heads",
            "lookup"; the model's history); a source not in it starts from the
            constant prior.
    """

    def __init__(
        self,
        costs: RoundCosts,
        max_heads: int,
        max_lookup: int,
        vocabs: Sequence[Optional[int]] = (None,),
        coverage: Optional[Coverage] = None,
        priors: Optional[Dict[str, Sequence[float]]] = None,
    ):
        self.costs = costs
        priors = priors or {}
        self.heads = AdaptiveLength(
            costs,
            range(max_heads + 1),
            prior=priors.get("heads", DEFAULT_PRIOR),
            vocabs=vocabs,
            coverage=coverage,
        )
        self.lookup = AdaptiveLength(
            costs, range(max_lookup + 1), prior=priors.get("lookup", DEFAULT_PRIOR)
        )

    def rate(self, source: str, k: int) -> float:
        """Expected tokens per unit of cost of a round drafting k from ``source``."""
        if source == "lookup":
            return self.lookup.expected_tokens(k) / self.costs.verify[k]
        return self.heads.rate(k, self.heads.best_vocab(k))

    def lookup_length(self, found: int, heads_k: int) -> int:
        """How many of the ``found`` lookup tokens to draft this round (0: draft
        ``heads_k`` from the heads instead)."""
        best = max(self.rate("heads", heads_k), self.rate("heads", 0))
        m = max(range(1, found + 1), key=lambda m: self.rate("lookup", m), default=0)
        return m if m and self.rate("lookup", m) >= best else 0

    def observe(self, source: str, k: int, accepted: int, missed=False) -> None:
        if source == "lookup":
            self.lookup.observe(k, accepted)
        else:
            self.heads.observe(k, accepted, missed)

"""How many tokens to draft next round: a fixed k, or the k that maximises expected
tokens per unit of time on the machine at hand.

A round that drafts k tokens costs ``verify(k + 1) + k * draft`` (in units of one plain
decode step, measured once per model and machine by `measure_costs`) and emits
``1 + sum_{i<=k} prod_{j<=i} alpha_j`` tokens on average, with ``alpha_j`` the
probability that draft j is accepted given that draft j-1 was. `AdaptiveLength`
estimates the alphas from recent rounds (exponentially forgotten, so a change of
workload inside one generation is followed) and picks the k with the best ratio. When
drafting does not pay (k = 0), it still drafts every ``probe_every``-th round so that it
notices when acceptance comes back.

The choice of k never changes the output: every round is verified exactly.
"""

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache import assistant_kv, begin_verify, make_caches, rewind
from .distributed import Sync
from .paths import home


@dataclass
class RoundCosts:
    """Round costs relative to one plain decode step t(1).

    ``verify[n - 1]`` is t(n) / t(1), a trunk pass over n tokens; ``draft`` one MTP step.
    """

    verify: List[float]
    draft: float

    def round(self, k: int) -> float:
        return self.verify[k] + k * self.draft


def measure_costs(model, max_k: int, reps: int = 5, context: int = 64) -> RoundCosts:
    """Round costs relative to t(1), from `time_round` after ``context`` tokens."""
    ids = mx.arange(context, dtype=mx.int32) % model.args.vocab_size
    t, draft = time_round(model, ids, max_k, reps)
    return RoundCosts([x / t[0] for x in t], draft / t[0])


def time_round(
    model, ids: mx.array, max_k: int, reps: int
) -> Tuple[List[float], float]:
    """Median seconds, after the tokens ``ids`` (1-D) are in the caches, of a verify
    pass over n = 1..max_k+1 tokens (as a round verifies: rollback marks, pass,
    rewind) and of one draft step (0.0 for a model without heads)."""
    caches = make_caches(model)
    mx.eval(model.hidden(ids[None], caches.trunk))

    def median_time(fn) -> float:
        times = []
        for _ in range(reps + 1):  # the first call warms up
            tic = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tic)
        return statistics.median(times[1:])

    def verify(n: int):
        marks = begin_verify(caches.trunk)
        mx.eval(model.logits(model.hidden(ids[None, :n], caches.trunk)))
        rewind(caches.trunk, marks, n)

    t = [median_time(lambda: verify(n)) for n in range(1, max_k + 2)]
    draft = 0.0
    if model.assistant is not None:
        h = model.hidden(ids[None, -1:])
        kv = assistant_kv(model, caches.trunk)
        mx.eval(h, kv)

        def step():
            logits, _ = model.assist(ids[None, -1:], h, kv, len(ids))
            mx.eval(mx.argmax(logits, axis=-1))

        draft = median_time(step)
    elif model.num_mtp_layers:
        h = model.hidden(ids[None, -1:])
        mx.eval(h)

        def step():
            z = model.mtp_forward(0, h, ids[None, -1:])
            mx.eval(mx.argmax(model.draft_logits(z), axis=-1))

        draft = median_time(step)
    return t, draft


def model_costs(model, max_k: int) -> RoundCosts:
    """The model's round costs for k up to ``max_k``: measured once per model files,
    device and MLX version, and kept in ``$MLX_MTP_HOME/costs.json``, so that a seeded
    sampled run drafts the same ks, and so gives the same text, every time."""
    costs = model.round_costs
    if costs is not None and len(costs.verify) > max_k:
        return costs
    sync = Sync(model.group)
    key = _cost_key(model)
    stored = _stored_costs().get(key) if key else None
    if not (stored and len(stored["verify"]) > max_k):
        stored = None
    if sync.share_int(int(stored is not None)):  # rank 0 decides: read or measure
        costs = RoundCosts(**stored) if stored else RoundCosts([0.0] * (max_k + 1), 0.0)
    else:  # every rank times the same passes (a sharded trunk's collectives match)
        costs = measure_costs(model, max_k)
        if key and sync.rank == 0:
            _store_costs(key, costs)
    if sync.group is not None:  # rank 0's costs, so that every rank picks the same k
        shared = sync.share_values([*costs.verify, costs.draft])
        costs = RoundCosts(shared[:-1], shared[-1])
    model.round_costs = costs
    return costs


def _costs_file() -> Path:
    return home() / "costs.json"


def _cost_key(model) -> Optional[str]:
    """Model folder (and a separate assistant's) and their files' sizes and times,
    device, MLX version, and preloaded libraries (a BLAS swapped in changes the
    costs)."""
    if model.source is None:
        return None
    folders = [model.source]
    if model.assistant is not None and model.assistant_source not in (
        None,
        model.source,
    ):
        folders.append(model.assistant_source)
    stamps = []
    for folder in folders:
        files = sorted(Path(folder).glob("*.safetensors")) + [
            Path(folder, "config.json")
        ]
        stamp = [
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in files
            if f.exists()
        ]
        stamps += [str(folder), stamp]
    ranks = model.group.size() if model.group is not None else 1
    machine = [
        str(mx.default_device()),
        mx.__version__,
        os.environ.get("LD_PRELOAD"),
        ranks,
    ]
    return json.dumps([*stamps, *machine])


def _stored_costs() -> dict:
    try:
        return json.loads(_costs_file().read_text())
    except (OSError, ValueError):
        return {}


def _store_costs(key: str, costs: RoundCosts) -> None:
    """Add one entry; a cache that cannot be written is skipped."""
    path = _costs_file()
    table = _stored_costs()
    table[key] = asdict(costs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(table))
        tmp.replace(path)
    except OSError:
        pass


class FixedLength:
    """Draft k tokens every round."""

    def __init__(self, k: int):
        self.max_k = k

    def next(self) -> int:
        return self.max_k

    def observe(self, k: int, accepted: int) -> None:
        pass


class AdaptiveLength:
    """Pick k in ``allowed`` maximising expected tokens per unit of cost.

    Args:
        costs: Round costs for k = 0..max(allowed).
        allowed: Draft lengths to choose from (0 included).
        memory: Rounds over which acceptance is averaged (exponential forgetting).
        prior: Acceptance assumed before any draft at a position is seen.
        probe_every: With k = 0 chosen, draft the smallest allowed k > 0 this often.
    """

    def __init__(
        self,
        costs: RoundCosts,
        allowed: Sequence[int],
        memory: float = 16.0,
        prior: float = 0.6,
        probe_every: int = 16,
    ):
        self.costs = costs
        self.allowed = sorted(set(allowed) | {0})
        self.max_k = self.allowed[-1]
        self.decay = 1.0 - 1.0 / memory
        self.prior = prior
        self.probe_every = probe_every
        self.reached = [0.0] * self.max_k  # drafts at position j that were judged
        self.hits = [0.0] * self.max_k  # ... and accepted
        self.idle = 0  # rounds since the last draft

    def alphas(self) -> List[float]:
        """Acceptance at each position given the previous one was accepted; positions
        with little evidence lean on the one before (the prior for the first)."""
        out, prev = [], self.prior
        for hits, reached in zip(self.hits, self.reached):
            prev = (hits + 2.0 * prev) / (reached + 2.0)
            out.append(prev)
        return out

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.alphas()[:k]:
            run *= a
            total += run
        return total

    def best(self) -> int:
        return max(
            self.allowed, key=lambda k: self.expected_tokens(k) / self.costs.round(k)
        )

    def next(self) -> int:
        k = self.best()
        if k == 0 and self.idle + 1 >= self.probe_every and self.max_k:
            k = self.allowed[1]
        self.idle = 0 if k else self.idle + 1
        return k

    def observe(self, k: int, accepted: int) -> None:
        if k == 0:
            return
        for j in range(self.max_k):
            self.reached[j] *= self.decay
            self.hits[j] *= self.decay
        for j in range(min(k, accepted + 1)):
            self.reached[j] += 1.0
            self.hits[j] += float(j < accepted)


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
    """

    def __init__(self, costs: RoundCosts, max_heads: int, max_lookup: int):
        self.costs = costs
        self.heads = AdaptiveLength(costs, range(max_heads + 1))
        self.lookup = AdaptiveLength(costs, range(max_lookup + 1))

    def rate(self, source: str, k: int) -> float:
        """Expected tokens per unit of cost of a round drafting k from ``source``."""
        if source == "lookup":
            return self.lookup.expected_tokens(k) / self.costs.verify[k]
        return self.heads.expected_tokens(k) / self.costs.round(k)

    def lookup_length(self, found: int, heads_k: int) -> int:
        """How many of the ``found`` lookup tokens to draft this round (0: draft
        ``heads_k`` from the heads instead)."""
        best = max(self.rate("heads", heads_k), self.rate("heads", 0))
        m = max(range(1, found + 1), key=lambda m: self.rate("lookup", m), default=0)
        return m if m and self.rate("lookup", m) >= best else 0

    def observe(self, source: str, k: int, accepted: int) -> None:
        (self.lookup if source == "lookup" else self.heads).observe(k, accepted)

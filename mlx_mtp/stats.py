"""Running statistics of a speculative generation: drafts and acceptance per round,
per draft position, per source and per draft vocabulary."""

import copy
from dataclasses import dataclass, field, fields
from typing import List


@dataclass
class MTPStats:
    """Running speculative-decoding statistics of one generation."""

    num_draft_tokens: int  # the heads' longest draft
    positions: int = 0  # the longest draft of any source (default: the heads')
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    drafted_per_position: List[int] = field(default_factory=list)
    accepted_per_position: List[int] = field(default_factory=list)
    # rounds that drafted all k tokens, by number accepted (0..k)
    accepted_histogram: List[int] = field(default_factory=list)
    rounds_by_k: List[int] = field(default_factory=list)  # rounds that drafted k
    # drafts and accepted drafts by source ("heads", "lookup")
    drafted_by_source: dict = field(default_factory=dict)
    accepted_by_source: dict = field(default_factory=dict)
    # heads' drafts by draft vocabulary: its size, or "full" for the whole head
    drafted_by_vocab: dict = field(default_factory=dict)

    def __post_init__(self):
        """Size the per-position lists (given values are kept, zeros appended)."""
        self.positions = max(self.positions, self.num_draft_tokens)
        for name, size in (
            ("drafted_per_position", self.positions),
            ("accepted_per_position", self.positions),
            ("accepted_histogram", self.num_draft_tokens + 1),
            ("rounds_by_k", self.positions + 1),
        ):
            counts = getattr(self, name)
            setattr(self, name, list(counts) + [0] * (size - len(counts)))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> List[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position)
        ]

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def __add__(self, other: "MTPStats") -> "MTPStats":
        """The statistics of both generations together (runs of one benchmark)."""
        out = MTPStats(
            max(self.num_draft_tokens, other.num_draft_tokens),
            max(self.positions, other.positions),
        )
        for f in fields(out):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                a, b = a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b))
                value = [x + y for x, y in zip(a, b)]
            elif isinstance(a, dict):
                value = {key: a.get(key, 0) + b.get(key, 0) for key in {**a, **b}}
            elif f.name in ("num_draft_tokens", "positions"):
                continue
            else:
                value = a + b
            setattr(out, f.name, value)
        return out

    def record(self, k: int, a: int, source: str = "heads", vocab=None) -> None:
        if k:
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + k
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + a
        if k and source == "heads":
            label = "full" if vocab is None else str(vocab)
            self.drafted_by_vocab[label] = self.drafted_by_vocab.get(label, 0) + k
        self.rounds += 1
        self.drafted += k
        self.accepted += a
        self.emitted += a + 1
        for j in range(k):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < a)
        if k == self.num_draft_tokens:
            self.accepted_histogram[a] += 1
        self.rounds_by_k[k] += 1

    @property
    def mean_draft_length(self) -> float:
        return self.drafted / self.rounds if self.rounds else 0.0

    def snapshot(self) -> "MTPStats":
        """An independent copy (the loop goes on updating the live statistics)."""
        return copy.deepcopy(self)

"""Each model's acceptance, remembered across generations: where ``-k auto`` starts.

A reply's first rounds are sized before it has drafted anything, so they are priced
with a prior. A constant one (0.6 per position) keeps a model whose drafts are rarely
accepted drafting through most of a short reply. Instead, each generation adds what
its drafts did (per draft source and position: drafts judged, drafts accepted) to the
model's history, and the next generation starts from it. The history is kept beside
the measured round costs, in ``$MLX_MTP_HOME/acceptance.json``, keyed by the model's
files (and a separate assistant's); it weighs about the last `MEMORY` drafts judged
at each position.

Only ``-k auto`` generations use and add to it. A seeded sampled one keeps the
constant prior (its draws, and so its text, must not depend on what ran before it);
so does a trunk sharded over several ranks (the ranks must pick the same draft
lengths). Nothing here changes the output.
"""

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

from .files import model_stamps, read_table, write_table
from .paths import home

DEFAULT_PRIOR = 0.6  # acceptance assumed at a position nothing is known about
MEMORY = 256.0  # drafts judged at a position the stored history weighs, at most
MAX_POSITIONS = 16
MAX_ENTRIES = 64  # models the file remembers (the oldest written is dropped)
SOURCES = ("heads", "lookup", "vocab")  # "vocab": `shares` of the draft vocabularies


@dataclass
class Counts:
    """Drafts judged (``reached[j]``) and accepted (``hits[j]``) at each position j
    (judged: a draft whose position a round's acceptance got to); for the kind
    "vocab", tokens generated (``reached[j]``) and those among the ``sizes[j]`` most
    expected (``hits[j]``), one per draft vocabulary size."""

    hits: List[float]
    reached: List[float]

    @classmethod
    def empty(cls, positions: int) -> "Counts":
        return cls([0.0] * positions, [0.0] * positions)

    def add(self, other: "Counts") -> "Counts":
        return Counts(_sum(self.hits, other.hits), _sum(self.reached, other.reached))

    def capped(self, memory: float = MEMORY) -> "Counts":
        """Each position scaled down to hold at most ``memory`` drafts judged (its
        older drafts weigh less, as exponential forgetting over that position's own
        drafts does: a deeper position, judged only when a round gets that far, is
        not forgotten through the first position's volume)."""
        hits, reached = [], []
        for h, r in zip(self.hits, self.reached):
            s = memory / r if r > memory else 1.0
            hits.append(h * s)
            reached.append(r * s)
        return Counts(hits, reached)

    def priors(self, prior: float = DEFAULT_PRIOR) -> List[float]:
        """Acceptance per position, each leaning on the one before (``prior`` for
        the first) where it has little evidence."""
        out, prev = [], prior
        for hits, reached in zip(self.hits, self.reached):
            prev = (hits + 2.0 * prev) / (reached + 2.0)
            out.append(prev)
        return out


def _sum(a: List[float], b: List[float]) -> List[float]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0.0] * (n - len(a)), b + [0.0] * (n - len(b)))]


def parse(entry) -> Optional[Dict[str, Counts]]:
    """A stored entry's counts by source, or None unless it is exactly what `learn`
    writes: for known sources, two lists of equal length (at most `MAX_POSITIONS`)
    of finite counts with ``0 <= hits[j] <= reached[j]``."""
    if not (isinstance(entry, dict) and set(entry) <= set(SOURCES)):
        return None
    out = {}
    for source, counts in entry.items():
        if not (isinstance(counts, dict) and set(counts) == {"hits", "reached"}):
            return None
        hits, reached = counts["hits"], counts["reached"]
        if not (
            isinstance(hits, list)
            and isinstance(reached, list)
            and len(hits) == len(reached) <= MAX_POSITIONS
            and all(_count(x) for x in hits + reached)
            and all(h <= r for h, r in zip(hits, reached))
        ):
            return None
        out[source] = Counts([float(h) for h in hits], [float(r) for r in reached])
    return out


def _count(x) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and 0 <= x <= 1e9


def _file():
    return home() / "acceptance.json"


_read: dict = {}  # the table last read, and its file's (path, inode, size, time)


def _stored() -> dict:
    """The history's table (not to be changed in place), read again only when its
    file changed: a generation's policies look it up several times."""
    path = _file()
    try:
        st = path.stat()
    except OSError:
        return {}
    stamp = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if _read.get("stamp") != stamp:
        _read.update(stamp=stamp, table=read_table(path))
    return _read["table"]


def shares(key: Optional[str], sizes: List[int]) -> Optional[Dict[int, float]]:
    """The share of the model's generated tokens inside each draft vocabulary of
    ``sizes`` (sorted) tokens, as generations of the model behind ``key`` saw it;
    None when none is known (or it was kept for other sizes)."""
    entry = parse(_stored().get(key)) if key is not None else None
    counts = entry.get("vocab") if entry else None
    if counts is None or len(counts.reached) != len(sizes) or counts.reached[0] <= 0:
        return None
    return {n: h / r for n, h, r in zip(sizes, counts.hits, counts.reached)}


def priors(key: Optional[str], source: str) -> Optional[List[float]]:
    """The acceptance per position that generations of the model behind ``key``
    (`model_key`) saw drafting from ``source``; None when none is known."""
    if key is None:
        return None
    entry = parse(_stored().get(key))
    counts = entry.get(source) if entry else None
    if counts is None or not counts.reached or counts.reached[0] <= 0:
        return None
    return counts.priors()


def learn(key: Optional[str], seen: Dict[str, Counts]) -> None:
    """Add one generation's counts by source to the history of ``key``'s model and
    write the file whole (to a temporary file renamed over it); a history that cannot
    be written is skipped."""
    seen = {s: c for s, c in seen.items() if c.reached and c.reached[0] > 0}
    if key is None or not seen:
        return
    table = {k: v for k, v in _stored().items() if parse(v) is not None}
    old = parse(table.pop(key, None)) or {}
    for source, counts in seen.items():
        total = old.get(source, Counts.empty(0)).add(counts).capped()
        n = min(len(total.hits), MAX_POSITIONS)
        old[source] = Counts(total.hits[:n], total.reached[:n])
    table[key] = {s: {"hits": c.hits, "reached": c.reached} for s, c in old.items()}
    write_table(_file(), dict(list(table.items())[-MAX_ENTRIES:]))  # the newest


def model_key(model) -> Optional[str]:
    """The model's files (and a separate assistant's): what its acceptance depends
    on (not the machine, unlike its costs); None for a model built in memory."""
    stamps = model_stamps(model)
    return None if stamps is None else json.dumps(stamps)


def learns(model, options) -> bool:
    """Whether a generation with ``options`` starts from (and adds to) the model's
    history: one with ``-k auto``, not seeded and sampled, not on a trunk sharded
    over ranks (a fixed k drafts what it was told, and its lookups are sized as
    before: its statistics do not depend on what ran earlier)."""
    seeded = options.seed is not None and not options.sampling.greedy
    auto = options.num_draft_tokens == "auto"
    return auto and not seeded and model.group is None

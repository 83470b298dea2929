"""An honest speed benchmark: mlx-lm plain decoding against mlx-mtp at k = 0..K, in one
process, interleaved, medians of several runs.

For every workload (code, code requests among them the demo's, chat, prose, and an
adversarial prompt of random tokens) and temperature it reports decode tokens/s (the
first token, i.e. the prompt, excluded),
the ratio to mlx-lm, acceptance per draft position and tokens per round (over all the
timed runs together), peak memory, and the **ideal** speedup the measured acceptance
allows given the measured costs:

    ideal(k) = tokens_per_round(k) / (t(k + 1) / t(1) + k * t_draft / t(1))

with t(n) one trunk pass over n new tokens (logits included) and t_draft one MTP step
(a block drafter's round pays its pass t_block once instead of k steps), all timed here
the same way (one call, evaluated); measured / ideal is the runtime's own
efficiency: its bookkeeping, host syncs and Python overhead. With ``k = "auto"`` the
round cost is averaged over the k actually drafted in each round.
"""

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from . import draft_vocab
from .draft_length import time_round
from .errors import MTPError
from .options import longest_draft
from .speculative import mtp_generate_step

EDITED_FUNCTION = '''def merge_intervals(intervals):
    """Merge overlapping intervals."""
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
'''
ARTICLE = (
    "The printing press, developed by Johannes Gutenberg around 1440, combined "
    "movable metal type, oil-based ink and a screw press adapted from wine making. "
    "Before it, books were copied by hand, which made them rare and expensive. "
    "Within fifty years presses were working in more than two hundred cities across "
    "Europe, and millions of books had been printed. Cheaper books spread literacy, "
    "helped the Reformation and the scientific revolution, and standardised "
    "spelling and grammar in many languages."
)
WORKLOADS = {
    "code": 'def merge_intervals(intervals):\n    """Merge overlapping intervals."""\n',
    # a code request through the chat template, as the demo's first command
    "code-request": "Write a Python function that merges overlapping intervals.",
    # the README's first command: the demo's prompt
    "demo": "Write a Python function that checks whether a number is prime.",
    "chat": "Explain in a few sentences how a hash table handles collisions.",
    "prose": "The history of the printing press begins in the fifteenth century, when",
    # the prompt holds a function, the request changes one line of it
    "code-edit": EDITED_FUNCTION
    + "\nRewrite this function so that it sorts by the end of each interval "
    "instead of the start. Give the whole function.\n",
    "summarise": ARTICLE + "\n\nSummarise this text in two sentences.\n",
}
CHAT_WORKLOADS = ("code-request", "demo", "chat", "code-edit", "summarise")


@dataclass
class Row:
    workload: str
    temp: float
    k: Union[int, str, None]  # None: mlx-lm plain decoding; "auto"
    tok_s: float
    source: str = "heads"  # the draft source (`mtp_generate_step`'s draft_source)
    vocab: Union[int, str, None] = None  # its draft_vocab (None: the heads' own)
    ratio: float = 1.0
    acceptance: List[float] = field(default_factory=list)
    tokens_per_round: float = 1.0
    mean_k: float = 0.0  # drafts per round
    ideal: Optional[float] = None
    efficiency: Optional[float] = None
    peak_gb: float = 0.0
    # drafts by source and, for heads drafts, by draft vocabulary ("full" or its size)
    drafted_by_source: Dict[str, int] = field(default_factory=dict)
    drafted_by_vocab: Dict[str, int] = field(default_factory=dict)


def prompts(tokenizer, model, seed: int) -> Dict[str, List[int]]:
    out = {}
    for name, text in WORKLOADS.items():
        if name in CHAT_WORKLOADS and tokenizer.has_chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
        out[name] = tokenizer.encode(text)
    vocab = min(model.args.vocab_size, len(tokenizer.get_vocab()))
    out["adversarial"] = np.random.default_rng(seed).integers(0, vocab, 64).tolist()
    return out


def _decode_time(steps, n: int) -> float:
    """Seconds from the first yielded token to the n-th."""
    tic = None
    for i, _ in zip(range(n), steps):
        if i == 0:
            tic = time.perf_counter()
    return time.perf_counter() - tic


def run_plain(model, prompt, n: int, temp: float, seed: int) -> float:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    steps = generate_step(
        mx.array(prompt), model.trunk, max_tokens=n, sampler=make_sampler(temp)
    )
    return (n - 1) / _decode_time(steps, n)


def run_mtp(
    model, prompt, n: int, temp: float, k: int, seed: int, source="heads", vocab=None
):
    steps = mtp_generate_step(
        prompt,
        model,
        num_draft_tokens=k,
        temp=temp,
        max_tokens=n,
        seed=seed,
        draft_source=source,
        draft_vocab=vocab,
    )
    tic, last = None, None
    with mx.stream(generation_stream):  # as stream_generate (and mlx-lm) run it
        for i, out in enumerate(steps):
            if i == 0:
                tic = time.perf_counter()
            last = out
    return (n - 1) / (time.perf_counter() - tic), last.stats


def costs(model, prompt, max_k: int, reps: int, vocabs=()) -> Dict[str, float]:
    """t_verify(n) for n = 1..max_k+1, one draft step (``block``: a block drafter's
    pass) and one draft step from each draft vocabulary size in ``vocabs``
    (``draft_N``), in seconds, after ``prompt`` (`mlx_mtp.draft_length.time_round`:
    the least of interleaved medians)."""
    ids = mx.array(prompt, dtype=mx.int32)
    t, draft, drafts = time_round(model, ids, max_k, reps, vocabs)
    out = {f"verify_{n}": x for n, x in enumerate(t, start=1)}
    if model.num_mtp_layers:
        out["block" if model.drafter is not None else "draft"] = draft
        out.update({f"draft_{n}": d for n, d in drafts.items()})
    return out


def bench(
    model,
    tokenizer,
    *,
    ks=(0, 1, 2, 3, 4, "auto"),
    temps=(0.0, 0.7),
    tokens: int = 128,
    reps: int = 5,
    workloads: Optional[Sequence[str]] = None,
    seed: int = 0,
    log=print,
    sources: Sequence[str] = ("heads",),
    vocabs: Sequence[Union[int, str, None]] = (None,),
) -> dict:
    """Run the benchmark; returns {"rows": [...], "costs": {...}} (see the module's
    docstring). ``sources``: the draft sources to run each k with ("heads", "lookup",
    "auto"); the ideal speedup is reported for heads drafts only. ``vocabs``: the draft
    vocabularies to run heads drafts with (None: the heads' own rows; "full", a
    number of tokens, "auto": see `mlx_mtp.draft_vocab`)."""
    ks = [k for k in ks if k == 0 or model.num_mtp_layers]
    all_prompts = prompts(tokenizer, model, seed)
    names = list(workloads or all_prompts)
    max_k = max(longest_draft(model, None) if k == "auto" else k for k in ks)
    sizes = _sizes(model, vocabs)
    if sizes and draft_vocab.ranking_for(model, tokenizer) is None:
        raise MTPError("no ranking of the vocabulary for draft vocabularies")
    c = costs(model, all_prompts["code"], max_k, reps, sizes)
    rows = []
    for name in names:
        prompt = all_prompts[name]
        for temp in temps:
            runs_of = [(None, "heads", None)] + [
                (k, src, v)
                for src in sources
                for k in ks
                for v in (vocabs if k != 0 else vocabs[:1])
                if k != 0 or src == "heads"
            ]
            samples = {run: [] for run in runs_of}
            stats = {}
            for rep in range(reps + 1):  # the first round warms up
                for k, src, v in samples:
                    mx.reset_peak_memory()
                    if k is None:
                        rate = run_plain(model, prompt, tokens, temp, seed + rep)
                    else:
                        rate, s = run_mtp(
                            model, prompt, tokens, temp, k, seed + rep, src, v
                        )
                        if rep:  # acceptance over every timed run
                            stats[k, src, v] = stats[k, src, v] + s if rep > 1 else s
                    if rep:
                        samples[k, src, v].append((rate, mx.get_peak_memory() / 1e9))
            base = statistics.median(r for r, _ in samples[None, "heads", None])
            for (k, src, v), runs in samples.items():
                rate = statistics.median(r for r, _ in runs)
                row = Row(
                    name,
                    temp,
                    k,
                    rate,
                    src,
                    v,
                    rate / base,
                    peak_gb=max(p for _, p in runs),
                )
                if k is not None:
                    s = stats[k, src, v]
                    row.acceptance = s.acceptance_per_position
                    row.tokens_per_round = s.tokens_per_round
                    row.mean_k = s.mean_draft_length
                    row.drafted_by_source = dict(s.drafted_by_source)
                    row.drafted_by_vocab = dict(s.drafted_by_vocab)
                    if src == "heads":
                        row.ideal = ideal_speedup(s, c)
                        row.efficiency = row.ratio / row.ideal
                rows.append(row)
                log(format_row(row))
    return {"rows": [asdict(r) for r in rows], "costs": c}


def _sizes(model, vocabs) -> List[int]:
    """The draft vocabulary sizes whose draft steps the runs of ``vocabs`` time."""
    V = model.args.vocab_size
    out = set()
    for v in vocabs:
        if v == "auto":
            out.update(draft_vocab.auto_sizes(V))
        elif isinstance(v, int) and v < V:
            out.add(v)
    heads = model.assistant is None and (model.drafter is None or model.block_vocab_ok)
    return sorted(out) if model.num_mtp_layers and heads else []


def ideal_speedup(stats, c: Dict[str, float]) -> float:
    """Tokens per round over the mean round cost, in plain decode steps (a draft step
    costs the mean over the draft vocabularies the run drafted from; a block
    drafter's round its one pass)."""
    by_vocab = stats.drafted_by_vocab
    drafted = sum(by_vocab.values())
    step = c.get("draft", 0.0)
    if drafted:
        step = (
            sum(
                n * c.get("draft" if v == "full" else f"draft_{v}", c.get("draft", 0.0))
                for v, n in by_vocab.items()
            )
            / drafted
        )
    block = c.get("block", 0.0)
    cost = sum(
        n * (c[f"verify_{k + 1}"] + (block * bool(k) if block else k * step))
        for k, n in enumerate(stats.rounds_by_k)
    )
    return stats.emitted * c["verify_1"] / cost if cost else 1.0


def format_row(r: Row) -> str:
    who = "mlx-lm" if r.k is None else f"mtp k={r.k}"
    if r.k == "auto":
        who += f"~{r.mean_k:.1f}"
    if r.k is not None and r.source != "heads":
        who += f" {r.source}"
    if r.k is not None and r.vocab is not None:
        who += f" dv={r.vocab}"
    acc = " ".join(f"{a:.2f}" for a in r.acceptance)
    ideal = f"{r.ideal:5.2f}x" if r.ideal is not None else "     -"
    eff = f"{r.efficiency:5.2f}" if r.efficiency is not None else "    -"
    return (
        f"{r.workload:11} T={r.temp:<3} {who:21} {r.tok_s:8.1f} tok/s {r.ratio:5.2f}x "
        f"ideal {ideal} eff {eff} tok/round {r.tokens_per_round:4.2f} "
        f"peak {r.peak_gb:5.2f} GB  accept [{acc}]"
    )

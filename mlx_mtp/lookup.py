"""Drafts from the context (prompt lookup): when the last few tokens occurred earlier,
draft what followed them there.

Editing code, answering about a document, rewriting text: the continuation often
repeats a span of the prompt or of the text already generated. `continuation` finds
the latest earlier occurrence of the longest suffix n-gram of the tokens (``max_ngram``
down to ``min_ngram`` tokens) and returns the tokens that followed it, as llama.cpp's
lookup decoding and transformers' prompt lookup do. A lookup draft is deterministic: as
a draft distribution it is a point mass, so the rejection rule stays exact (accept
with probability p(d), else sample from p with d removed).
"""

from typing import List, Sequence

import numpy as np


def continuation(
    tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 2
) -> List[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
    suffix n-gram of ``tokens``; [] when no suffix of ``min_ngram`` tokens or more
    occurred before."""
    ids = np.asarray(tokens, dtype=np.int64)
    n_total = ids.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_total - 1), min_ngram - 1, -1):
        suffix = ids[n_total - n :]
        # starts s < n_total - n whose n tokens equal the suffix (not the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(ids[: n_total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + k].tolist()
    return []

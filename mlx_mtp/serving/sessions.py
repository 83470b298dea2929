"""Conversations whose caches a request can go on from: `Sessions`, an LRU bounded
in count and bytes, each session its owner's (the API key its requests presented)."""

import threading
from collections import OrderedDict
from typing import Dict, List, Optional

import mlx.core as mx

from ..speculative import Session


class Sessions:
    """Conversations whose caches can be gone on from: an LRU of `Session`s, at most
    ``size`` of them and ``max_bytes`` of memory, each counted at what it holds
    (`Session.nbytes`: every array, at its buffer's size; its pending computation
    is started when it is put, so that it soon holds nothing else). A session
    larger than ``max_bytes`` alone is not kept.

    `take` hands out (and removes) the session whose tokens the prompt extends, the
    longest such that drafts with the MTP depth asked for; `put` returns a session
    after a generation. A session is used by one generation at a time, so no two
    requests share caches. Each session belongs to an ``owner`` (the API key its
    requests presented; None without keys) and is handed out to that owner's
    requests only.
    """

    def __init__(self, size: int = 8, max_bytes: Optional[int] = None):
        self.size, self.max_bytes = size, max_bytes
        self._items: "OrderedDict[tuple, Session]" = OrderedDict()  # (owner, id)
        self._sizes: Dict[tuple, int] = {}  # their `Session.nbytes`, as put
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def take(
        self, prompt: List[int], owner=None, depth: Optional[int] = None
    ) -> Optional[Session]:
        """The longest kept session of ``owner`` whose tokens ``prompt`` extends and
        whose caches hold ``depth`` MTP layers (None: any depth; a session of
        another depth cannot go on with this one's drafts), removed; None if none."""
        with self._lock:
            best, best_len = None, 0
            for key, s in self._items.items():
                if key[0] != owner or depth not in (None, s.state.depth):
                    continue
                tokens = s.tokens
                n = len(tokens)
                if best_len < n < len(prompt) and prompt[:n] == tokens:
                    best, best_len = key, n
            if best is None:
                return None
            del self._sizes[best]
            return self._items.pop(best)

    def put(self, session: Session, owner=None) -> None:
        """Keep ``session`` (the generation thread's, which evaluates its arrays),
        the least recently kept ones dropped to stay within the bounds."""
        if session.state is None:
            return
        arrays = session.arrays()
        mx.async_eval(arrays)  # once computed, an array holds no other buffer
        size = sum(a.nbytes for a in arrays)
        if self.max_bytes is not None and size > self.max_bytes:
            return
        with self._lock:
            key = owner, id(session)
            self._items[key], self._sizes[key] = session, size
            while len(self._items) > self.size or (
                self.max_bytes is not None
                and sum(self._sizes.values()) > self.max_bytes
            ):
                dropped, _ = self._items.popitem(last=False)
                del self._sizes[dropped]

    @property
    def nbytes(self) -> int:
        """The bytes the kept sessions hold."""
        with self._lock:
            return sum(self._sizes.values())

    def clear(self) -> None:
        """Drop every kept session."""
        with self._lock:
            self._items.clear()
            self._sizes.clear()

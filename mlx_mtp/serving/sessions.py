"""Conversations whose caches a request can go on from: `Sessions`, an LRU bounded
in count and bytes, each session its owner's (the API key its requests presented),
and below it, when the server has a folder for it, `DiskTier`: the sessions the LRU
drops (and all it holds when the server closes) as files, bounded in bytes, which a
restarted server finds again."""

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from .. import session_files
from ..speculative import Session

log = logging.getLogger("mlx_mtp")


class DiskTier:
    """Kept sessions as files in ``folder``/<model key>, at most ``max_bytes`` of
    them (the least recently used removed first), for `Sessions`. Each file holds
    one session (`mlx_mtp.session_files`) with its owner's tag (``tag(owner)``: a
    hash of the API key, which survives a restart, as the key's index need not) and
    its MTP depth. The files of the model's folder are listed at start from their
    headers; one that cannot be read, or of another model, is skipped with a
    warning and never loaded."""

    def __init__(self, folder, max_bytes: int, key: str, tag: Callable = str):
        self.folder = Path(folder) / key
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.key, self.tag = max_bytes, key, tag
        self._lock = threading.Lock()
        # path -> (owner tag, depth, tokens, bytes), oldest use first
        self._index: "OrderedDict[Path, Tuple[str, int, List[int], int]]" = (
            OrderedDict()
        )
        files = sorted(
            self.folder.glob("*.safetensors"), key=lambda f: f.stat().st_mtime
        )
        for f in files:
            if f.name.startswith("."):
                continue
            try:
                tokens, fields = session_files.read_meta(f, key)
            except session_files.SessionFileError as e:
                log.warning("prompt cache: %s; skipped", e)
                continue
            self._index[f] = (
                fields.get("owner"),
                fields.get("depth"),
                fields.get("key", tokens),  # images by their digests
                f.stat().st_size,
            )

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry[3] for entry in self._index.values())

    def put(self, session: Session, owner=None) -> None:
        """Write ``session`` (unless a file holds its tokens already), then remove
        the least recently used files past ``max_bytes``."""
        tag, tokens = self.tag(owner), session.key
        name = hashlib.sha256(f"{tag}|{tokens}".encode()).hexdigest()[:32]
        path = self.folder / f"{name}.safetensors"
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)
                return
        fields = {"owner": tag, "depth": session.state.depth, "key": tokens}
        try:
            size = session_files.save(session, path, self.key, fields)
        except (session_files.SessionFileError, OSError) as e:
            log.warning("prompt cache: cannot write a session to disk: %s", e)
            return
        with self._lock:
            self._index[path] = (tag, session.state.depth, tokens, size)
            while sum(e[3] for e in self._index.values()) > self.max_bytes:
                oldest, _ = self._index.popitem(last=False)
                oldest.unlink(missing_ok=True)

    def best(
        self, prompt: List[int], owner=None, depth=None
    ) -> Tuple[int, Optional[Path]]:
        """The longest of ``owner``'s files whose tokens ``prompt`` begins with, for
        ``depth`` MTP layers: its token count and path (0, None if none). Tokens
        are compared as `Session.key`s (images by their digests)."""
        tag, best = self.tag(owner), (0, None)
        with self._lock:
            for path, (owner_tag, held_depth, tokens, _) in self._index.items():
                if owner_tag != tag or depth not in (None, held_depth):
                    continue
                n = len(tokens)
                if best[0] < n <= len(prompt) and prompt[:n] == tokens:
                    best = (n, path)
        return best

    def load(self, path: Path) -> Optional[Session]:
        """The session of ``path`` (marked used), or None (with a warning) when it
        cannot be read any more."""
        try:
            session = session_files.load(path, self.key)
        except session_files.SessionFileError as e:
            log.warning("prompt cache: %s; dropped", e)
            with self._lock:
                self._index.pop(path, None)
            return None
        with self._lock:
            if path in self._index:
                self._index.move_to_end(path)
        os.utime(path)
        return session


class Sessions:
    """Conversations whose caches can be gone on from: an LRU of `Session`s, at most
    ``size`` of them and ``max_bytes`` of memory, each counted at what it holds
    (`Session.nbytes`: every array, at its buffer's size; its pending computation
    is started when it is put, so that it soon holds nothing else). A session
    larger than ``max_bytes`` alone is not kept.

    `take` hands out (and removes) the session whose tokens the prompt begins with
    (all of them, for a repeated prompt: its last token is pending), the
    longest such that drafts with the MTP depth asked for; `put` returns a session
    after a generation. A session is used by one generation at a time, so no two
    requests share caches. Each session belongs to an ``owner`` (the API key its
    requests presented; None without keys) and is handed out to that owner's
    requests only.
    """

    def __init__(
        self,
        size: int = 8,
        max_bytes: Optional[int] = None,
        disk: Optional[DiskTier] = None,
    ):
        self.size, self.max_bytes, self.disk = size, max_bytes, disk
        self._items: "OrderedDict[tuple, Session]" = OrderedDict()  # (owner, id)
        self._sizes: Dict[tuple, int] = {}  # their `Session.nbytes`, as put
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def take(
        self, prompt: List[int], owner=None, depth: Optional[int] = None
    ) -> Optional[Session]:
        """The longest kept session of ``owner`` whose tokens ``prompt`` begins with and
        whose caches hold ``depth`` MTP layers (None: any depth; a session of
        another depth cannot go on with this one's drafts), removed; None if none.
        ``prompt`` is compared as a `Session.key` (`mlx_mtp.media.keyed`: a prompt
        with images, by their digests), so a session is gone on from only with the
        images it holds."""
        with self._lock:
            best, best_len = None, 0
            for key, s in self._items.items():
                if key[0] != owner or depth not in (None, s.state.depth):
                    continue
                tokens = s.key
                n = len(tokens)
                if best_len < n <= len(prompt) and prompt[:n] == tokens:
                    best, best_len = key, n
            if self.disk is None or self.disk.best(prompt, owner, depth)[0] <= best_len:
                if best is None:
                    return None
                del self._sizes[best]
                return self._items.pop(best)
        _, path = self.disk.best(prompt, owner, depth)
        found = self.disk.load(path) if path is not None else None
        if found is None:  # unreadable now: the memory's, if any
            with self._lock:
                if best is None or best not in self._items:
                    return None
                del self._sizes[best]
                return self._items.pop(best)
        return found

    def put(self, session: Session, owner=None) -> None:
        """Keep ``session`` (the generation thread's, which evaluates its arrays),
        the least recently kept ones dropped to stay within the bounds."""
        if session.state is None:
            return
        arrays = session.arrays()
        mx.async_eval(arrays)  # once computed, an array holds no other buffer
        size = sum(a.nbytes for a in arrays)
        if self.max_bytes is not None and size > self.max_bytes:
            self._spill([(owner, session)])
            return
        spilled = []
        with self._lock:
            key = owner, id(session)
            self._items[key], self._sizes[key] = session, size
            while len(self._items) > self.size or (
                self.max_bytes is not None
                and sum(self._sizes.values()) > self.max_bytes
            ):
                dropped, out = self._items.popitem(last=False)
                del self._sizes[dropped]
                spilled.append((dropped[0], out))
        self._spill(spilled)

    def _spill(self, sessions) -> None:
        """``(owner, session)`` pairs the memory does not keep, to the disk tier."""
        if self.disk is not None:
            for owner, session in sessions:
                self.disk.put(session, owner)

    def flush(self) -> None:
        """Every kept session to the disk tier too (the server closes)."""
        with self._lock:
            held = [(key[0], s) for key, s in self._items.items()]
        self._spill(held)

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

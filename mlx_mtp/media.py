"""What a prompt's images put in a row: token embeddings that are not the tokens'
own (the vision tower's features at the image placeholders) and multimodal RoPE
positions (M-RoPE: temporal, height and width ids) that are not the token indices.

A `Media` is the prompt's: its first ``P`` tokens have the positions of
``positions`` ``(3, P)``, and every later token (the rest of the conversation,
drafted and verified alike) sits at its index plus ``delta``, on all three axes,
as the references place the text after an image (transformers' ``get_rope_index``,
vLLM's and SGLang's M-RoPE deltas). Both are functions of the token index, so a
rollback changes nothing here: a row's caches hold indices, and a `MediaCache`
beside them maps an index to its position and embedding.

The trunk's caches end with a `MediaCache`, and the MTP layers of a family that
reads images each keep one beside their KV cache (a `mlx_mtp.cache.ListCache`), so
the media travel with the caches wherever the round, the batch and the server move
them: batched (``merge``, ``filter``, ``extend``, ``extract``), snapshotted, and to
disk (`mlx_mtp.session_files`: the arrays and a description). A row without images
holds None: its positions are its indices.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .errors import MTPError

Offsets = Union[int, mx.array]


@dataclass
class Media:
    """A prompt's image features and M-RoPE positions.

    Attributes:
        positions: ``(3, P)`` int32, the positions of the prompt's first P tokens.
        delta: position minus index of every token from P on.
        index: ``(N,)`` int32, the token indices whose embeddings are image features.
        features: ``(N, H)``, those embeddings (the vision tower's, merged).
        key: A digest of the images and where they sit.
        spans: Per image, ``[start, end, digest]``: its placeholders' token indices
            and a digest of its pixels (what a kept conversation is matched by:
            `keyed`).
    """

    positions: mx.array
    delta: int
    index: mx.array
    features: mx.array
    key: str
    spans: List[list]

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def below(self, n: int) -> Optional["Media"]:
        """What the first ``n`` tokens hold of these media (None: no image): the
        tokens after them continue from the highest position held, as a prompt
        ending there would."""
        if not self.spans or self.spans[0][0] >= n:
            return None
        if n >= self.length:
            return self
        positions = self.positions[:, :n]
        keep = self.index < n
        count = int(keep.sum().item())
        return Media(
            positions=positions,
            delta=int(positions.max().item()) + 1 - n,
            index=self.index[:count],
            features=self.features[:count],
            key=self.key + f"/{n}",
            spans=[[a, min(b, n), d] for a, b, d in self.spans if a < n],
        )

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.index.nbytes + self.features.nbytes


class MediaCache:
    """The `Media` of each row of a pass (None: a text row), under the cache protocol
    (`mlx_mtp.cache`). It holds nothing per position, so rollback is nothing to do
    and it costs no memory per token."""

    def __init__(self, rows: Optional[List[Optional[Media]]] = None):
        self.rows = [None] if rows is None else list(rows)

    def set(self, media: Optional[Media]) -> None:
        """Give this one-row cache's stream ``media`` (a prompt's, replacing any)."""
        if len(self.rows) != 1:
            raise ValueError("media are set on a single stream's caches")
        self.rows = [media]

    @property
    def any(self) -> bool:
        return any(m is not None for m in self.rows)

    # -- what a pass reads --------------------------------------------------------

    def position_ids(self, offsets: Offsets, n: int) -> mx.array:
        """``(3, B, n)`` int32 positions of the pass's inputs: row b's input i at
        index ``offsets[b] + i`` (``offsets``: an int, or ``(B,)``)."""
        idx = _indices(offsets, n, len(self.rows))  # (B, n)
        if not self.any:
            return mx.broadcast_to(idx[None], (3, *idx.shape))
        rows = [self._row_positions(m, idx[b]) for b, m in enumerate(self.rows)]
        return mx.stack(rows, axis=1)

    @staticmethod
    def _row_positions(media: Optional[Media], idx: mx.array) -> mx.array:
        if media is None:
            return mx.broadcast_to(idx[None], (3, idx.shape[0]))
        table = media.positions[:, mx.clip(idx, 0, media.length - 1)]  # (3, n)
        return mx.where(idx[None] < media.length, table, idx[None] + media.delta)

    def embeddings(self, e: mx.array, offsets: Offsets, shift: int = 0) -> mx.array:
        """``e`` ``(B, n, H)``, the pass's token embeddings, with row b's input i
        replaced by its image feature when index ``offsets[b] + i + shift`` holds
        one (``shift`` 1: an MTP layer's input i is the token after index i)."""
        if not self.any:
            return e
        idx = _indices(offsets, e.shape[1], len(self.rows)) + shift  # (B, n)
        return mx.stack(
            [self._row_embeddings(m, e[b], idx[b]) for b, m in enumerate(self.rows)]
        )

    @staticmethod
    def _row_embeddings(media: Optional[Media], e: mx.array, idx: mx.array):
        if media is None or media.index.size == 0:
            return e
        hit = idx[:, None] == media.index[None, :]  # (n, N)
        found = hit.any(axis=1, keepdims=True)
        feature = media.features[mx.argmax(hit, axis=1)].astype(e.dtype)  # (n, H)
        return mx.where(found, feature, e)

    def images(self, offsets: Offsets, n: int) -> mx.array:
        """``(B, n)`` bool: which of the pass's inputs are image features."""
        idx = _indices(offsets, n, len(self.rows))  # (B, n)
        return mx.stack([_row_images(m, idx[b]) for b, m in enumerate(self.rows)])

    def same_image(self, offsets: Offsets, n: int) -> mx.array:
        """``(B, n, n)`` bool: whether a row's inputs i and j are features of one
        image."""
        idx = _indices(offsets, n, len(self.rows))  # (B, n)
        blocks = mx.stack([_row_blocks(m, idx[b]) for b, m in enumerate(self.rows)])
        return (blocks[:, :, None] == blocks[:, None, :]) & (blocks >= 0)[:, :, None]

    # -- the cache protocol -------------------------------------------------------

    def can_roll_back(self) -> bool:
        return True

    def mark(self, record: bool = True) -> None:
        return None

    def rewind(self, mark, n: int) -> None:
        return None

    def rewind_rows(self, drop: Sequence[int], mark=None) -> None:
        return None

    def keep_below(self, limits: Sequence[int]) -> None:
        return None

    def prepare(self, **kwargs) -> None:
        return None

    def finalize(self) -> None:
        return None

    def batch_refusal(self) -> Optional[str]:
        return None

    @classmethod
    def merge(cls, caches: Sequence["MediaCache"]) -> "MediaCache":
        return cls([m for c in caches for m in c.rows])

    def extend(self, other: "MediaCache") -> None:
        self.rows = self.rows + other.rows

    def filter(self, rows: Sequence[int]) -> None:
        rows = rows.tolist() if isinstance(rows, mx.array) else rows
        self.rows = [self.rows[b] for b in rows]

    def extract(self, b: int, below: Optional[int] = None, mark=None) -> "MediaCache":
        return MediaCache([self.rows[b]])

    def cost(self) -> Tuple[float, tuple, float]:
        return 0.0, (), 0.0  # nothing per position or per row (`kv_cache.NO_COST`)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.rows if m is not None)

    @property
    def state(self) -> List[mx.array]:
        return []

    def snapshot(self) -> "MediaCache":
        return MediaCache(self.rows)  # its arrays are never written in place

    def read_kv(self, positions: Sequence[int], window: Optional[int] = None):
        raise ValueError("a MediaCache holds no keys or values")


def _row_images(media: Optional[Media], idx: mx.array) -> mx.array:
    if media is None or media.index.size == 0:
        return mx.zeros(idx.shape, dtype=mx.bool_)
    return (idx[:, None] == media.index[None, :]).any(axis=1)


def _row_blocks(media: Optional[Media], idx: mx.array) -> mx.array:
    """``(n,)`` int32: the image (its number in the prompt) each index is a feature
    of, -1 for none."""
    if media is None or not media.spans:
        return mx.full(idx.shape, -1, dtype=mx.int32)
    starts = mx.array([a for a, _, _ in media.spans], dtype=mx.int32)
    ends = mx.array([b for _, b, _ in media.spans], dtype=mx.int32)
    inside = (idx[:, None] >= starts[None]) & (idx[:, None] < ends[None])  # (n, S)
    first = mx.argmax(inside.astype(mx.int32), axis=1).astype(mx.int32)
    return mx.where(inside.any(axis=1), first, -1)


def _indices(offsets: Offsets, n: int, rows: int) -> mx.array:
    """``(B, n)`` int32 token indices of a pass's inputs."""
    steps = mx.arange(n, dtype=mx.int32)[None]
    if isinstance(offsets, mx.array):
        return offsets.astype(mx.int32)[:, None] + steps
    return mx.broadcast_to(offsets + steps, (rows, n))


def keyed(tokens: Sequence[int], media: Optional[Media]) -> list:
    """``tokens`` as kept conversations are matched: each image placeholder of
    ``media`` (those below ``len(tokens)``) replaced by its image's digest, so that
    two prompts whose tokens are the same but whose images differ do not match
    (the same image at the same place does)."""
    out = list(tokens)
    for start, end, digest in media.spans if media is not None else ():
        for i in range(start, min(end, len(out))):
            out[i] = f"image:{digest}"
    return out


def share(sync, media: Optional[Media]) -> Optional[Media]:
    """Rank 0's ``media`` on every rank of ``sync`` (a `mlx_mtp.distributed.Sync`):
    images are read and encoded on rank 0 only, so that the files need be on its
    machine only; the others' ``media`` are ignored. Exact: a sum with zeros."""
    import json

    if sync.group is None:
        return media
    header = None
    if sync.rank == 0 and media is not None:
        header = json.dumps(
            {
                "features": [list(media.features.shape), str(media.features.dtype)],
                "length": media.length,
                "delta": media.delta,
                "key": media.key,
                "spans": media.spans,
            }
        )
    header = sync.share_text(header if sync.rank == 0 else None)
    if header is None:
        return None
    about = json.loads(header)
    (shape, dtype), n = about["features"], about["length"]
    if sync.rank != 0:
        dtype = getattr(mx, dtype.split(".")[-1])
        media = Media(
            positions=mx.zeros((3, n), mx.int32),
            delta=0,
            index=mx.zeros((shape[0],), mx.int32),
            features=mx.zeros(shape, dtype),
            key="",
            spans=[],
        )
    arrays = [sync.share(a) for a in (media.positions, media.index, media.features)]
    mx.eval(arrays)
    positions, index, features = arrays
    return Media(
        positions, about["delta"], index, features, about["key"], about["spans"]
    )


def of_caches(caches) -> Optional[Media]:
    """The `Media` a stream's caches hold (None: none, or a text model)."""
    found = media_caches(caches) if caches is not None else []
    return found[0].rows[0] if found and len(found[0].rows) == 1 else None


def media_caches(caches) -> List[MediaCache]:
    """The `MediaCache`s of a stream's `mlx_mtp.cache.Caches` (the trunk's last
    entry, and one inside each MTP layer's cache), empty for a model that reads no
    images."""
    found = []
    for c in [*caches.trunk, *caches.mtp]:
        parts = getattr(c, "caches", (c,))
        found.extend(p for p in parts if isinstance(p, MediaCache))
    return found


def split(cache):
    """(the text model's caches, the `MediaCache` or None) of a vision trunk's
    per-pass ``cache`` list, whose last entry is its `MediaCache` when it has a
    tower."""
    if cache is not None and cache and isinstance(cache[-1], MediaCache):
        return cache[:-1], cache[-1]
    return cache, None


def attach(caches, media: Optional[Media], held: int = 0) -> None:
    """Give a stream's caches, holding ``held`` tokens, the prompt's ``media``.

    None keeps what the caches hold of the images below ``held`` (a conversation
    going on about the same images, or none): images a kept prompt had past them
    (a session kept at its system prompt) are forgotten (`Media.below`).

    Raises:
        MTPError: ``media`` for a model that reads no images.
    """
    found = media_caches(caches)
    if media is None:
        for c in found:
            if len(c.rows) == 1 and c.rows[0] is not None:
                c.set(c.rows[0].below(held))
        return
    if not found:
        raise MTPError("this model reads no images")
    for c in found:
        c.set(media)


class Placeholder(NamedTuple):
    """How a family's prompt holds an image: the chat template writes ``token``
    once per image; the model reads it repeated once per feature (an image of
    t x h x w patches merged ``merge`` x ``merge`` has t*h*w / merge**2), between
    ``before`` and ``after`` (Gemma 4's begin- and end-of-image tokens)."""

    token: int
    merge: int
    before: Tuple[int, ...] = ()
    after: Tuple[int, ...] = ()


def expand(
    ids: Sequence[int], placeholder: Placeholder, grid_thw: Sequence[Sequence[int]]
) -> Tuple[List[int], List[Tuple[int, int]]]:
    """``ids`` with each image placeholder expanded as the model reads it
    (`Placeholder`), and where each image's features go (``[start, end)``).

    Raises:
        MTPError: the placeholders are not one per image.
    """
    token, merge, before, after = placeholder
    if list(ids).count(token) != len(grid_thw):
        raise MTPError(
            f"the prompt has {list(ids).count(token)} image placeholders for "
            f"{len(grid_thw)} images"
        )
    counts, places, out = [t * h * w // merge**2 for t, h, w in grid_thw], [], []
    for t in ids:
        if t == token:
            out += before
            places.append((len(out), len(out) + counts[len(places)]))
            out += [t] * counts[len(places) - 1]
            out += after
        else:
            out.append(t)
    return out, places


def build(
    ids: Sequence[int],
    placeholder: Placeholder,
    pixel_values,
    grid_thw: Sequence[Sequence[int]],
    features,
    rope_index=None,
) -> Tuple[List[int], Media]:
    """A prompt's ids as the model reads them, and its `Media`.

    Args:
        ids: The prompt, with one image placeholder per image, in order (as a chat
            template writes them), expanded as `expand` does.
        pixel_values: The images' pixels, in order: ``(patches, C*T*P*P)``, each
            image ``t*h*w`` rows of it, or a list of one array per image.
        grid_thw: Per image its (t, h, w) patches.
        features: ``features(grid, digests) -> (N, H)``, the tower's features of all
            the images (``grid`` ``(images, 3)`` int32; ``digests`` one per image).
        rope_index: ``rope_index(ids (1, P), grid) -> (positions (3, 1, P), delta)``,
            the family's M-RoPE positions of the expanded prompt (None: a family
            whose positions are the token indices).

    Raises:
        MTPError: the placeholders are not one per image.
    """
    import hashlib

    import numpy as np

    out, places = expand(ids, placeholder, grid_thw)
    if isinstance(pixel_values, (list, tuple)):
        per_image = [np.asarray(p, dtype=np.float32) for p in pixel_values]
    else:
        patches, per_image, row = np.asarray(pixel_values, dtype=np.float32), [], 0
        for t, h, w in grid_thw:
            per_image.append(patches[row : row + t * h * w])
            row += t * h * w
    spans = []
    for thw, (start, end), image in zip(grid_thw, places, per_image):
        digest = hashlib.sha256(repr(tuple(thw)).encode() + image.tobytes())
        spans.append([start, end, digest.hexdigest()[:32]])
    grid = mx.array(grid_thw, dtype=mx.int32)
    found = features(grid, tuple(d for *_, d in spans))
    if rope_index is None:
        positions, delta = (
            mx.broadcast_to(mx.arange(len(out))[None, None], (3, 1, len(out))),
            0,
        )
    else:
        positions, delta = rope_index(mx.array([out]), grid)
    key = hashlib.sha256(repr(spans).encode()).hexdigest()[:32]
    return out, Media(
        positions=positions[:, 0].astype(mx.int32),  # (3, P)
        delta=int(mx.array(delta).reshape(-1)[0].item()),
        index=mx.array([i for a, b, _ in spans for i in range(a, b)], dtype=mx.int32),
        features=found,
        key=key,
        spans=spans,
    )


def chunk_end(media: Optional[Media], start: int, end: int) -> int:
    """The end of a prefill chunk of token indices ``[start, end)`` moved off the
    inside of an image (for a trunk whose images attend within themselves both
    ways, each must be in one pass): to the image's start when the chunk holds
    tokens before it, else to its end."""
    for a, b, _ in media.spans if media is not None else ():
        if a < end < b:
            return a if a > start else b
    return end


# The vision tower's features of the last few sets of images (a conversation's
# turns send the same ones again), by their digests.
FEATURES_KEPT = 4


def kept_features(owner, digests: tuple, compute) -> mx.array:
    """``compute()``, the features of the images of ``digests``, evaluated and
    kept on ``owner`` (a trunk) for the next `FEATURES_KEPT` - 1 other sets: the
    same images again take the kept features."""
    from collections import OrderedDict

    kept = owner.__dict__.setdefault("_features_kept", OrderedDict())
    if digests in kept:
        kept.move_to_end(digests)
        return kept[digests]
    features = compute()
    mx.eval(features)
    kept[digests] = features
    while len(kept) > FEATURES_KEPT:
        kept.popitem(last=False)
    return features

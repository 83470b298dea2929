"""Draft vocabularies for native MTP heads and block drafters: draft from the rows of
the shared head that the model's next token is most likely to be in.

A native head's draft step ends with the full output projection (V rows), often the
largest part of its cost; a block drafter's pass (DSpark) projects every slot with it
and adds a Markov bias per slot through its own ``(V, r)`` projection. Restricted to
the N rows of the tokens the model emits most, a step or a pass reads N rows of each;
a draft is then never a token outside them, so acceptance drops by about the share of
the target's tokens outside them. The target distribution is never restricted: the
output stays exact whatever the rows.

The rows come from a ranking of the whole vocabulary, measured once per model
(`rank_tokens`): each token's expected count as the model's next token over a
built-in calibration text (prose, chat answers, code, math, several languages),
teacher-forced: the sum over positions of the model's next-token probabilities. Tokens
of equal mass keep id order (merge order for BPE tokenizers: frequent first). A
conversion stores the ranking (``draft_vocab.safetensors``, named in the config's
``"mtp"`` section); for any other model it is computed on first use and kept in
``$MLX_MTP_HOME/draft-vocab/`` (`ranking_for`).
"""

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from .errors import MTPError, one_line
from .paths import home

CALIBRATION = Path(__file__).with_name("calibration.txt")
FILE = "draft_vocab.safetensors"
CRITERION = "expected next-token count, teacher-forced on mlx_mtp/calibration.txt"
MAX_CALIBRATION_TOKENS = 4096


@dataclass
class Ranking:
    """Every token id, most expected first, and each one's share of the calibration's
    next-token mass.

    Attributes:
        order: ``(V,)`` int32 token ids.
        mass: ``(V,)`` float32, non-increasing, summing to 1.
    """

    order: np.ndarray
    mass: np.ndarray

    def __post_init__(self):
        self.rank = np.empty_like(self.order)  # token id -> its place in ``order``
        self.rank[self.order] = np.arange(len(self.order), dtype=self.order.dtype)
        self._cumulative = np.concatenate(
            [[0.0], np.cumsum(self.mass, dtype=np.float64)]
        )

    @property
    def vocab_size(self) -> int:
        return len(self.order)

    def rows(self, n: int) -> mx.array:
        """The ``n`` most expected token ids, sorted: ``(n,)`` int32."""
        return mx.array(np.sort(self.order[:n]), dtype=mx.int32)

    def coverage(self, n: int) -> float:
        """The calibration's next-token mass inside the ``n`` most expected tokens."""
        return float(min(1.0, self._cumulative[min(n, self.vocab_size)]))


def rank_tokens(model, ids: Sequence[int], context: int = 512, rows: int = 128):
    """Rank the vocabulary by the model's expected next-token counts over ``ids``,
    teacher-forced in independent windows of ``context`` tokens (the calibration
    text's sections are independent; each window starts afresh), ``rows`` positions'
    probabilities at a time so that the ``(rows, V)`` block stays small.

    Returns:
        A `Ranking`.
    """
    if len(ids) < 2:
        raise MTPError("the calibration text is too short to rank the vocabulary")
    total = mx.zeros((model.args.vocab_size,), dtype=mx.float32)
    for start in range(0, len(ids), context):
        x = mx.array(ids[start : start + context], dtype=mx.int32)[None]  # (1, L)
        h = model.hidden(x, model.make_trunk_cache())[0]  # (L, H)
        for r in range(0, h.shape[0], rows):
            logits = model.logits(h[r : r + rows]).astype(mx.float32)  # (rows, V)
            total = total + mx.softmax(logits, axis=-1).sum(axis=0)
            mx.eval(total)
    mass = np.array(total, dtype=np.float64)
    mass = mass / mass.sum()
    order = np.lexsort((np.arange(len(mass)), -mass)).astype(np.int32)
    return Ranking(order, mass[order].astype(np.float32))


def calibration_ids(tokenizer, limit: Optional[int] = None) -> List[int]:
    """The built-in calibration text as token ids, section by section (sections are
    separated by blank lines), at most ``limit`` (default `MAX_CALIBRATION_TOKENS`)."""
    limit = limit or MAX_CALIBRATION_TOKENS
    ids: List[int] = []
    for section in CALIBRATION.read_text(encoding="utf-8").split("\n\n"):
        if len(ids) >= limit:
            break
        ids.extend(tokenizer.encode(section + "\n\n", add_special_tokens=False))
    return ids[:limit]


def save_ranking(path: Path, ranking: Ranking, info: Optional[dict] = None) -> None:
    """Write a ranking to the safetensors file ``path`` (``order``, ``mass``)."""
    path = Path(path)
    metadata = {
        "criterion": CRITERION,
        **{k: json.dumps(v) for k, v in (info or {}).items()},
    }
    # A temporary name unique to this writer, renamed over ``path``: concurrent
    # writers never share a file, and ``path`` is always a whole file.
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp.safetensors", dir=path.parent
    )
    os.close(fd)
    try:
        mx.save_safetensors(
            tmp,
            {"order": mx.array(ranking.order), "mass": mx.array(ranking.mass)},
            metadata=metadata,
        )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_ranking(path: Path, vocab_size: Optional[int] = None) -> Ranking:
    """Read a ranking `save_ranking` wrote, checked whole: exactly the tensors
    ``order``, a permutation of the ``vocab_size`` token ids (integers), and
    ``mass``, as many finite, non-negative, non-increasing floats summing to 1.

    Raises:
        MTPError: one line naming the file, for any other file.
    """
    order, mass = _read_ranking(Path(path))
    n = order.size
    if (
        order.ndim != 1
        or not n
        or mass.shape != order.shape
        or (vocab_size is not None and n != vocab_size)
        or not np.array_equal(np.sort(order), np.arange(n))
    ):
        raise MTPError(
            f"{path} is not a draft vocabulary of this model's "
            f"{vocab_size or n} tokens (convert or graft again)"
        )
    if not _is_mass(mass):
        raise MTPError(
            f"{path} is not a draft vocabulary: its mass is not finite, "
            "non-negative, non-increasing and summing to 1"
        )
    return Ranking(order.astype(np.int32), mass)


def _read_ranking(path: Path) -> Tuple[np.ndarray, np.ndarray]:
    """The tensors of a ranking file: ``order`` (int64) and ``mass`` (float32),
    exactly these two, of an integer and a floating type."""
    from .files import safetensors_header

    def unreadable(e: Exception) -> MTPError:
        return MTPError(f"cannot read the draft vocabulary {path}: {one_line(e)}")

    try:
        header = safetensors_header(path)
    except OSError as e:
        raise unreadable(e) from None
    if set(header) != {"order", "mass"}:
        raise MTPError(f"{path} is not a draft vocabulary (tensors order, mass)")
    try:
        tensors = mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise unreadable(e) from None
    order, mass = tensors["order"], tensors["mass"]
    if not (
        mx.issubdtype(order.dtype, mx.integer)
        and mx.issubdtype(mass.dtype, mx.floating)
    ):
        raise MTPError(f"{path} is not a draft vocabulary (tensors of the wrong type)")
    return np.array(order).astype(np.int64), np.array(mass.astype(mx.float32))


def _is_mass(mass: np.ndarray) -> bool:
    return bool(
        np.isfinite(mass).all()
        and (mass >= 0).all()
        and (np.diff(mass) <= 0).all()
        and abs(mass.sum(dtype=np.float64) - 1.0) <= 1e-3
    )


def _cache_path(model) -> Optional[Path]:
    """Where a ranking computed for ``model`` is kept: keyed by its folder and its
    weight files' names, sizes and times."""
    if model.source is None:
        return None
    folder = Path(model.source)
    files = sorted(folder.glob("*.safetensors")) + [folder / "config.json"]
    stamp = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()
    ]
    key = hashlib.sha256(json.dumps([str(folder.resolve()), stamp]).encode())
    return home() / "draft-vocab" / f"{key.hexdigest()[:32]}.safetensors"


def wants_ranking(model) -> bool:
    """Whether the model's heads can draft from a draft vocabulary of a ranking:
    native MTP heads (not an assistant, not heads trained with their own draft
    vocabulary) or a block drafter, on a trunk that is not sharded, whose head is a
    plain projection."""
    return (
        model.num_mtp_layers > 0
        and model.assistant is None
        and (model.drafter is None or model.block_vocab_ok)
        and "draft_vocab" not in model.mtp
        and model.group is None
        and not (model.family.head is None and model.family.own_logits)
    )


def has_ranking(model) -> bool:
    """Whether the ranking is known without computing it (stored or cached)."""
    path = _cache_path(model)
    return model.vocab_ranking is not None or (path is not None and path.is_file())


def ranking_for(model, tokenizer=None) -> Optional[Ranking]:
    """The model's ranking: the one its conversion stores, else the one computed for
    it earlier, else computed now from the calibration text (with ``tokenizer``, or
    the one in the model's folder) and kept. None when it cannot be had (no tokenizer,
    or one that reads the calibration text as less than two tokens, or a trunk
    sharded over several ranks, whose head is not whole on each)."""
    ranking = getattr(model, "vocab_ranking", None)
    if ranking is not None or model.group is not None:
        return ranking
    path = _cache_path(model)
    if path is not None and path.is_file():
        try:
            ranking = load_ranking(path, model.args.vocab_size)
        except MTPError:
            ranking = None
    if ranking is None:
        if tokenizer is None and model.source is not None:
            tokenizer = _tokenizer_of(model.source)
        ids = [] if tokenizer is None else calibration_ids(tokenizer)
        if len(ids) < 2:  # no tokenizer, or one that does not read the text
            return None
        ranking = rank_tokens(model, ids)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_ranking(path, ranking, {"source": str(model.source)})
            except (OSError, RuntimeError):  # not kept (MLX's write errors included)
                pass
    model.vocab_ranking = ranking
    return ranking


def auto_sizes(vocab_size: int) -> List[int]:
    """The draft vocabulary sizes "auto" weighs against the full head: V/16, V/8 and
    V/4 (FR-Spec found a quarter of Llama 3's 128k tokens enough)."""
    return sorted({max(1, vocab_size // d) for d in (16, 8, 4)})


DraftVocab = Union[int, str]


def parse(value: Union[int, str]) -> DraftVocab:
    """A ``--draft-vocab`` value: "auto", "full" or a positive number of tokens."""
    if isinstance(value, str) and value in ("auto", "full"):
        return value
    try:
        n = 0 if isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, float) and value != n):
        raise MTPError(
            f"draft_vocab must be 'auto', 'full' or a positive number of tokens, "
            f"got {value!r}"
        )
    return n


def rank_folder(folder: Path, model):
    """Rank the vocabulary of ``model``, loaded from ``folder`` (the ranking reads
    only the trunk's logits, so it may be the trunk alone, wrapped in a
    `mlx_mtp.models.base.Model`), with the folder's tokenizer.

    Returns:
        ``(ranking, entry)``, entry being the ``"draft_vocab"`` entry of the config's
        ``"mtp"`` section once the ranking is saved as ``FILE``; None when the folder
        has no tokenizer to read the calibration text with.
    """
    tokenizer = _tokenizer_of(folder)
    if tokenizer is None:
        return None
    ids = calibration_ids(tokenizer)
    entry = {"file": FILE, "criterion": CRITERION, "calibration_tokens": len(ids)}
    return rank_tokens(model, ids), entry


def _tokenizer_of(folder: Path):
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(Path(folder))
    except Exception:  # no usable tokenizer in the folder
        return None


def load_stored(model_path: Path, section: dict, vocab_size: int) -> Optional[Ranking]:
    """The ranking a conversion's ``"mtp"`` section names, if any."""
    entry = section.get("draft_vocab")
    if not isinstance(entry, dict):
        return None
    name = entry.get("file", FILE)
    if not (
        isinstance(name, str) and name not in ("", "..") and Path(name).name == name
    ):
        raise MTPError(
            f"the config's draft_vocab file {name!r} in {model_path} is not a file "
            "name in the model folder"
        )
    return load_ranking(Path(model_path) / name, vocab_size)

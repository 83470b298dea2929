"""Decode options: one frozen object whose fields are every setting of a generation.

The CLI builds one from its flags, the server one per request (its own defaults, then
the request's fields), and the Python API one from keyword arguments; the loop reads
it and never re-spells a default. A new option is one field here. This module imports
nothing heavy (the CLI reads the defaults before MLX is loaded); `check` imports the
sampling rules when it runs.
"""

import math
from dataclasses import asdict, dataclass, fields, replace
from numbers import Integral, Real
from typing import Any, Optional, Tuple, Union

from .defaults import DEFAULT_LOOKUP_TOKENS, DEFAULT_MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from .errors import MTPError

DRAFT_SOURCES = ("heads", "lookup", "auto")
# The penalties' ranges: OpenAI's for the presence and frequency penalties (a bound
# on what they add to a logit: at most 2 for each of the last tokens); for mlx-lm's
# repetition penalty, which divides logits (multiplies the negative ones), factors
# far past any useful one whose float32 logits cannot overflow (0 is off, as in
# mlx-lm).
ADDED_PENALTY = 2.0
REPETITION_PENALTY = (0.01, 100.0)


@dataclass(frozen=True)
class DecodeOptions:
    """Everything a generation is decoded with. Every instance is checked when it is
    made (`build`, `replace` and the constructor alike): a value out of its range, or
    two that cannot go together, raise an `MTPError` naming the option there, so an
    options object that exists is valid and nothing downstream checks it again.

    - ``num_draft_tokens``: drafts per round, k (0 runs plain decoding, the
      baseline); "auto" picks k in 0..``max_draft_tokens`` each round from
      the measured costs and the recent acceptance (`mlx_mtp.draft_length`);
      ``max_draft_tokens`` is the largest k "auto" picks (None: `longest_draft`,
      a block drafter's whole block, else `DEFAULT_MAX_DRAFT_TOKENS`).
    - ``temp``, ``top_p``, ``top_k``, ``min_p``, ``min_tokens_to_keep``:
      sampling, as in mlx-lm; ``temp == 0`` is greedy. ``seed``: the seed of
      the sampling keys (None draws one at random).
    - ``max_tokens``: tokens to generate; -1 for no limit.
    - ``prefill_step_size``: the prompt's chunk size.
    - ``max_kv_size``: a rotating KV window for new caches (wrapped windows
      roll back exactly, `mlx_mtp.cache.WindowCache`); not with a session.
    - ``kv_bits``, ``kv_group_size``, ``quantized_kv_start``: the trunk's
      KV-cache quantization, as in mlx-lm.
    - ``draft_source``: "heads" drafts with the MTP heads (or an
      assistant); "lookup" drafts, each round where the context has one,
      the continuation of the latest earlier occurrence of its last tokens
      (`mlx_mtp.lookup`), up to ``lookup_tokens`` tokens, and falls back to
      the heads otherwise (it works for a model without heads too); "auto"
      drafts from whichever source (and lookup length) its measured
      acceptance and the round costs say is fastest
      (`mlx_mtp.draft_length.SourceChoice`). With ``num_draft_tokens=0``
      "auto" decodes plainly and "lookup" drafts from the context only.
    - ``draft_vocab``: the rows of the shared head the MTP heads draft from
      (`mlx_mtp.draft_vocab`): None, their own (the whole head, or the draft
      vocabulary heads were trained with); "full", the whole head; a number
      n of tokens, the n the model is most expected to emit; or "auto", the
      heads' own rows or one of a few sizes, round by round, whichever the
      measured costs, acceptance and share of generated tokens inside say
      is fastest. The target distribution is never restricted.
    - ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` (each
      over its last ``*_context_size`` tokens) and ``logit_bias`` (token id to
      bias, given as a dict or pairs): mlx-lm's logits processors, with its names
      and meanings (None or 0: off), the presence and frequency penalties from -2
      to 2 (OpenAI's range), the repetition penalty from 0.01 to 100
      (`REPETITION_PENALTY`); ``logits_processors``: more of them, mlx-lm's
      ``f(tokens, logits)`` callables. Each applies at every position with that
      position's own prefix, drafts included (`mlx_mtp.processors`).
    - ``grammar``: a `mlx_mtp.grammar.GrammarSpec` (a JSON schema, any JSON
      object, a regex) the output must follow: every target position and every
      draft is masked by it.
    """

    max_tokens: int = 256
    num_draft_tokens: Union[int, str] = "auto"
    max_draft_tokens: Optional[int] = None
    draft_source: str = "auto"
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS
    draft_vocab: Union[int, str, None] = "auto"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: Optional[int] = None
    prefill_step_size: int = 2048
    max_kv_size: Optional[int] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None
    logits_processors: Tuple[Any, ...] = ()
    grammar: Any = None

    def __post_init__(self):
        """``logit_bias`` as sorted (token, bias) pairs, ``logits_processors`` as a
        tuple: the options stay comparable."""
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted(bias.items(), key=lambda kv: repr(kv[0]))) or None
        elif isinstance(bias, list):
            try:
                bias = tuple(tuple(kv) for kv in bias) or None
            except TypeError:  # not pairs: `check` says so
                pass
        object.__setattr__(self, "logit_bias", bias)
        procs = self.logits_processors
        if isinstance(procs, list) or procs is None:
            object.__setattr__(self, "logits_processors", tuple(procs or ()))
        self._check()

    @classmethod
    def names(cls) -> tuple:
        """The option names, in field order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def build(
        cls, base: Optional["DecodeOptions"] = None, **changes
    ) -> "DecodeOptions":
        """``base`` (default: the defaults) with ``changes``; an unknown name is an
        `MTPError` naming it, as is any value `DecodeOptions` refuses."""
        unknown = sorted(set(changes) - set(cls.names()))
        if unknown:
            raise MTPError(f"unknown decode option(s): {', '.join(unknown)}")
        return replace(base if base is not None else cls(), **changes)

    def replace(self, **changes) -> "DecodeOptions":
        """A copy with ``changes`` (`build`'s rules)."""
        return self.build(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def sampling(self):
        """The sampling settings as a `mlx_mtp.sampling.SamplingParams` (checked)."""
        from .sampling import SamplingParams

        return SamplingParams(
            self.temp, self.top_p, self.top_k, self.min_p, self.min_tokens_to_keep
        )

    @property
    def kv(self):
        """mlx-lm's KV quantization settings as a `mlx_mtp.cache.KVQuantization`."""
        from .cache import KVQuantization

        return KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    def _check(self) -> None:
        """Refuse, with an `MTPError` naming the option, any value out of its range or
        any two that cannot go together. The model-dependent checks (draft
        vocabularies, the context length) are the loop's. The checks that live beside
        MLX code (sampling, draft vocabularies, the KV window) run only for values
        other than the defaults, which are valid: the defaults load no MLX."""
        _check_max_tokens(self.max_tokens)
        check_draft_count("num_draft_tokens", self.num_draft_tokens, auto=True)
        if self.max_draft_tokens is not None:
            check_draft_count("max_draft_tokens", self.max_draft_tokens)
        if self.draft_source not in DRAFT_SOURCES:
            raise MTPError(
                f"draft_source must be one of {', '.join(DRAFT_SOURCES)}, got "
                f"{self.draft_source!r}"
            )
        check_draft_count("lookup_tokens", self.lookup_tokens, low=1)
        if self.draft_vocab is not None and not self._default("draft_vocab"):
            from .draft_vocab import parse

            parse(self.draft_vocab)
        if not self._default("temp", "top_p", "top_k", "min_p", "min_tokens_to_keep"):
            self.sampling  # noqa: B018 -- SamplingParams checks its fields
        if self.seed is not None:
            from .sampling import check_seed

            check_seed(self.seed)
        _check_int("prefill_step_size", self.prefill_step_size, 1)
        if self.max_kv_size is not None:
            from .cache import check_max_kv_size

            check_max_kv_size(self.max_kv_size)
        self._check_kv()
        self._check_processors()

    def _check_processors(self) -> None:
        repetition = self.repetition_penalty
        low, high = REPETITION_PENALTY
        if repetition is not None and repetition != 0:
            if _real(repetition) is None or not low <= repetition <= high:
                raise MTPError(
                    f"repetition_penalty must be 0 (off) or from {low:g} to "
                    f"{high:g}, got {repetition!r}"
                )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is None:
                continue
            if _real(value) is None or not -ADDED_PENALTY <= value <= ADDED_PENALTY:
                raise MTPError(
                    f"{name} must be a number from {-ADDED_PENALTY:g} to "
                    f"{ADDED_PENALTY:g}, got {value!r}"
                )
        for kind in ("repetition", "presence", "frequency"):
            _check_int(f"{kind}_context_size", getattr(self, f"{kind}_context_size"), 1)
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, tuple) or not all(
                isinstance(kv, tuple) and len(kv) == 2 for kv in bias
            ):
                raise MTPError("logit_bias must map token ids to numbers")
            for token, value in bias:
                if isinstance(token, bool) or not isinstance(token, Integral):
                    raise MTPError(f"logit_bias keys must be token ids, got {token!r}")
                if _real(value) is None:
                    raise MTPError(
                        f"logit_bias of token {token} must be a finite number, got "
                        f"{value!r}"
                    )
        if not all(callable(p) for p in self.logits_processors):
            raise MTPError("logits_processors must be callables f(tokens, logits)")
        if self.grammar is not None:
            from .grammar import GrammarSpec

            if not isinstance(self.grammar, GrammarSpec):
                raise MTPError(
                    f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}"
                )

    def _default(self, *names: str) -> bool:
        """Whether the options ``names`` hold their defaults (of the same type: a
        ``False`` for ``0.0`` is checked)."""
        defaults = {f.name: f.default for f in fields(self)}
        return all(
            type(getattr(self, n)) is type(defaults[n])
            and getattr(self, n) == defaults[n]
            for n in names
        )

    def _check_kv(self) -> None:
        if self.kv_bits is not None:
            _check_int("kv_bits", self.kv_bits, 1)
            if self.max_kv_size is not None:
                raise MTPError(
                    "KV quantization cannot be combined with a rotating KV window"
                )
        _check_int("kv_group_size", self.kv_group_size, 1)
        _check_int("quantized_kv_start", self.quantized_kv_start, 0)


def _real(value) -> Optional[float]:
    """``value`` as a finite float, or None when it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MTPError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_max_tokens(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MTPError(f"max_tokens must be an integer, got {value!r}")
    if value == 0 or value < -1:
        raise MTPError(f"max_tokens must be positive, or -1 for no limit (got {value})")


def longest_draft(model, max_draft_tokens: Optional[int]) -> int:
    """The largest k "auto" picks for ``model``: ``max_draft_tokens``, or when it is
    None a block drafter's whole block (its one pass proposes every k up to it, so
    a longer draft costs only a wider verify), else `DEFAULT_MAX_DRAFT_TOKENS`
    (each further head step costs a pass of its own)."""
    if max_draft_tokens is not None:
        return max_draft_tokens
    return model.max_draft or DEFAULT_MAX_DRAFT_TOKENS


def check_draft_count(name: str, value, low: int = 0, auto: bool = False) -> None:
    """Refuse a draft count other than an integer from ``low`` to `MAX_DRAFT_TOKENS`
    (or "auto" with ``auto``)."""
    if auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kinds = "an integer or 'auto'" if auto else "an integer"
        raise MTPError(f"{name} must be {kinds}, got {value!r}")
    if not low <= value <= MAX_DRAFT_TOKENS:
        raise MTPError(f"{name} must be from {low} to {MAX_DRAFT_TOKENS}, got {value}")

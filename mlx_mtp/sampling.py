"""Sampling as pure functions: logits in, log-probabilities or tokens out.

`filtered_logprobs` gives the exact distribution that mlx-lm's `make_sampler` samples
from (top-p, then min-p, then top-k on the log-probabilities, then temperature), so the
draft distribution q and the target distribution p go through the same filters. The
filters themselves are mlx-lm's. Randomness is an explicit key.
"""

import math
from dataclasses import dataclass
from numbers import Integral, Real

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import MTPError

SEED_LIMIT = 2**64  # seeds are MLX's: unsigned 64-bit integers


class SamplingError(MTPError):
    """A sampling setting out of its range; ``name`` is the setting's (``temp``,
    ``top_p``, ``top_k``, ``min_p``, ``min_tokens_to_keep`` or ``seed``)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def _shown(value) -> str:
    """``value`` for a message: its repr, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(name: str, value) -> float:
    """``value`` as a float: a real number (not a bool), finite."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise SamplingError(name, f"{name} must be a number, got {_shown(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise SamplingError(
            name, f"{name} must be a finite number, got {_shown(value)}"
        )
    return x


def _integer(name: str, value, low: int, high=None) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SamplingError(name, f"{name} must be an integer, got {_shown(value)}")
    if value < low or (high is not None and value >= high):
        bound = f"from {low} to {high - 1}" if high is not None else f">= {low}"
        raise SamplingError(name, f"{name} must be {bound}, got {_shown(value)}")


def check_seed(seed) -> None:
    """Refuse a seed that is not None or an integer in [0, 2^64) (`SamplingError`)."""
    if seed is not None:
        _integer("seed", seed, 0, SEED_LIMIT)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, with mlx-lm's names and meanings (``temp == 0``: greedy)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        """The rules every path applies (the CLI, the MTP loop, each server request):
        a `SamplingError` naming the setting for anything else. A ``top_k`` of at
        least the vocabulary size keeps every token, as 0 does."""
        if not _number("temp", self.temp) >= 0:
            raise SamplingError("temp", f"temp must be >= 0, got {self.temp}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, 0)
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise SamplingError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _integer("min_tokens_to_keep", self.min_tokens_to_keep, 1)

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution to sample from, ``(..., V) -> (..., V)``.

    Filtered-out tokens get ``-inf``. Requires ``params.temp > 0``.
    """
    logprobs = log_softmax(logits.astype(mx.float32))
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if 0 < params.top_k < logits.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return log_softmax(logprobs * (1.0 / params.temp))


def sample(logprobs: mx.array, key: mx.array) -> mx.array:
    """Draw one token per row from log-probabilities ``(..., V) -> (...)``."""
    return mx.random.categorical(logprobs, key=key)

"""Sampling as pure functions: logits in, log-probabilities or tokens out.

`filtered_logprobs` gives the exact distribution that mlx-lm's `make_sampler` samples
from (top-p, then min-p, then top-k on the log-probabilities, then temperature), so the
draft distribution q and the target distribution p go through the same filters. The
filters themselves are mlx-lm's. Randomness is an explicit key.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import MTPError


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, with mlx-lm's names and meanings (``temp == 0``: greedy)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        if not self.temp >= 0:
            raise MTPError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise MTPError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise MTPError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise MTPError(f"min_p must be in [0, 1], got {self.min_p}")

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

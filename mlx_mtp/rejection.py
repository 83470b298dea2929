"""Acceptance of drafted tokens: greedy matching and exact speculative sampling.

Speculative sampling follows Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding" (arXiv:2211.17192), with the names vLLM's rejection sampler
uses: draft token x_j ~ q_j is *accepted* with probability min(1, p_j(x_j) / q_j(x_j));
at the first rejection a *recovered* token is drawn from norm(max(0, p_j - q_j)); when
all k drafts are accepted a *bonus* token is drawn from p_k. The emitted tokens are
then distributed exactly as plain sampling from p.

Both functions are model-free and lazy: they return arrays, and the caller evaluates
them together with the rest of the round (one host sync per round).
"""

from dataclasses import dataclass

import mlx.core as mx

from .sampling import sample


@dataclass
class AcceptResult:
    """``num_accepted``: scalar count of leading drafts kept; ``next_token``: the
    recovered (rejection) or bonus (all accepted) token that follows them."""

    num_accepted: mx.array
    next_token: mx.array


def _leading_true(mask: mx.array) -> mx.array:
    """Length of the run of True at the start of a 1-D bool array."""
    return mx.cumprod(mask.astype(mx.int32)).sum()


def accept_greedy(draft_tokens: mx.array, target_logprobs: mx.array) -> AcceptResult:
    """Greedy acceptance: keep drafts while they equal the target's argmax.

    Args:
        draft_tokens: ``(k,)`` drafted tokens.
        target_logprobs: ``(k + 1, V)``; row j scores the token after draft j
            (row 0 the token after the last committed one).
    """
    target = mx.argmax(target_logprobs, axis=-1)  # (k + 1,)
    k = draft_tokens.shape[0]
    # [t, d1, d2] with target [d1, x, y] -> 1 accepted, next token x
    a = _leading_true(target[:k] == draft_tokens) if k else mx.array(0)
    return AcceptResult(a, target[a])


def accept_stochastic(
    draft_tokens: mx.array,
    draft_logprobs: mx.array,
    target_logprobs: mx.array,
    key: mx.array,
) -> AcceptResult:
    """Speculative sampling (rejection sampling against the draft distribution).

    Args:
        draft_tokens: ``(k,)`` tokens, draft j sampled from ``exp(draft_logprobs[j])``.
        draft_logprobs: ``(k, V)`` filtered draft log-probabilities q.
        target_logprobs: ``(k + 1, V)`` filtered target log-probabilities p.
        key: PRNG key for this round.
    """
    k = draft_tokens.shape[0]
    accept_key, token_key = mx.random.split(key)
    p = mx.exp(target_logprobs)  # (k + 1, V)
    q = mx.exp(draft_logprobs)  # (k, V)
    idx = draft_tokens[:, None]
    p_draft = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]  # (k,)
    q_draft = mx.take_along_axis(q, idx, axis=-1)[:, 0]  # (k,)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    a = _leading_true(u * q_draft < p_draft)  # u < p/q, without dividing by q
    # Row a of p against row a of q (zero past the drafts: bonus token from p_k).
    q_pad = mx.concatenate([q, mx.zeros((1, q.shape[-1]), dtype=q.dtype)])
    p_a, q_a = p[a], q_pad[a]
    residual = mx.maximum(p_a - q_a, 0)
    residual = mx.where(residual.sum() > 0, residual, p_a)  # p == q: never rejects
    next_token = sample(mx.log(residual), token_key)
    return AcceptResult(a, next_token)


def accept_point_mass(
    draft_tokens: mx.array, target_logprobs: mx.array, key: mx.array
) -> AcceptResult:
    """Speculative sampling of a draft with no distribution (tokens found in the
    context): q is a point mass on each draft, so draft j is accepted with
    probability p_j(x_j), and a rejection draws from p_j with x_j removed. The same
    draws as `accept_stochastic` with the dense point-mass q, without building it.

    Args:
        draft_tokens: ``(k,)`` tokens, k >= 1.
        target_logprobs: ``(k + 1, V)`` filtered target log-probabilities p.
        key: PRNG key for this round.
    """
    k = draft_tokens.shape[0]
    accept_key, token_key = mx.random.split(key)
    p = mx.exp(target_logprobs)  # (k + 1, V)
    p_draft = mx.take_along_axis(p[:k], draft_tokens[:, None], axis=-1)[:, 0]  # (k,)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    a = _leading_true(u < p_draft)
    # Row a of p without its draft token (none past the drafts: bonus from p_k).
    drafted = mx.concatenate([draft_tokens, mx.array([-1], draft_tokens.dtype)])
    p_a = p[a]
    residual = mx.where(mx.arange(p.shape[-1]) == drafted[a], 0.0, p_a)
    residual = mx.where(residual.sum() > 0, residual, p_a)
    next_token = sample(mx.log(residual), token_key)
    return AcceptResult(a, next_token)

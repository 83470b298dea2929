"""Logits processors and grammars, applied exactly under drafting.

A logits processor is mlx-lm's: ``f(tokens, logits) -> logits``, ``tokens`` every token
before the position (the prompt included, as mlx-lm's ``generate_step`` passes them)
and ``logits`` ``(1, V)``; `make_processors` builds mlx-lm's own (penalties, logit
bias). Plain decoding applies them once per token. A speculative round scores k + 1
positions in one pass: row j follows the committed tokens and the drafts d_1..d_j, so
row j is processed with exactly that prefix, and so is the draft distribution that
proposed d_{j+1}. Greedy output then equals plain decoding with the same processors
token for token, and speculative sampling stays exact (p and q are both processed).

A grammar (`mlx_mtp.grammar.Matcher`) is one more such rule, kept on the host: the
mask of row j is its state after d_1..d_j. The drafts are read to the host one by one
as they are made (a draft the grammar forbids is never proposed), each round's masks
are kept for its verify, and the grammar goes back to the committed tokens at the end
of each draft; `Rules.commit` then moves it over the tokens the round committed.
"""

from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from .errors import MTPError
from .grammar import constrain

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def make_processors(options, vocab_size: int) -> List[LogitsProcessor]:
    """mlx-lm's processors for ``options``' penalties and logit bias (its
    `make_logits_processors`), then ``options.logits_processors``; a logit-bias token
    outside the vocabulary is an `MTPError`."""
    from mlx_lm.sample_utils import make_logits_processors

    bias = dict(options.logit_bias or ())
    outside = [t for t in bias if not 0 <= t < vocab_size]
    if outside:
        raise MTPError(
            f"logit_bias token {outside[0]} is outside the vocabulary (0 to "
            f"{vocab_size - 1})"
        )
    made = make_logits_processors(
        bias or None,
        options.repetition_penalty,
        options.repetition_context_size,
        options.presence_penalty,
        options.presence_context_size,
        options.frequency_penalty,
        options.frequency_context_size,
    )
    return made + list(options.logits_processors)


def make_rules(options, vocab_size: int, tokenizer=None) -> Optional["Rules"]:
    """The `Rules` of a generation with ``options``: its processors and, for its
    ``grammar``, a `mlx_mtp.grammar.Matcher` over ``tokenizer``; None when there
    are neither (the loop then runs as without)."""
    processors = make_processors(options, vocab_size)
    matcher = None
    if options.grammar is not None:
        from .grammar import Matcher

        matcher = Matcher(options.grammar, tokenizer, vocab_size)
    if not processors and matcher is None:
        return None
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    return Rules(processors, matcher, eos)


class Rules:
    """One generation's processors and grammar, position by position.

    ``history`` is what the processors see before a round's first row: every
    committed token (`observe` keeps it). Per round: `begin`, then per draft
    `draft_logits` and `push`, then `end_draft`; `verify_logits` for the k + 1
    target rows; `commit` with the round's tokens.
    """

    def __init__(
        self, processors: Sequence[LogitsProcessor] = (), matcher=None, eos=()
    ):
        self.processors = list(processors)
        self.matcher = matcher
        self.eos = frozenset(eos)  # a grammar ends with one of these
        self._ended = False  # the committed tokens end with the grammar's EOS
        self.history = mx.zeros((0,), dtype=mx.int32)  # (n + 1,) committed tokens
        self.masks: List[mx.array] = []  # this round's grammar masks, (V,) each
        self._pushed = 0  # drafts the grammar consumed this round
        self._stuck = False  # a draft the grammar forbids: later rows do not count

    @property
    def needs_tokens(self) -> bool:
        """Whether each draft must be read to the host before the next (a grammar):
        no round can then be queued behind one whose tokens are not known."""
        return self.matcher is not None

    def observe(self, tokens: Sequence[int]) -> None:
        """Append committed ``tokens`` to the history the processors see."""
        if self.processors and tokens:
            new = mx.array(list(tokens), dtype=mx.int32)
            self.history = mx.concatenate([self.history, new])

    def begin(self, pending: Optional[mx.array] = None) -> None:
        """Start a round; ``pending`` is its first input when not committed yet (a
        plain round queued behind another: no grammar then)."""
        self._pending = pending
        self._pushed, self._stuck, self._past_end = 0, False, self._ended
        self.masks = [self._mask()] if self.matcher is not None else []

    def _mask(self) -> Optional[mx.array]:
        """The grammar's mask of the next token; None once its EOS is in the
        prefix (the positions after it are not constrained)."""
        return None if self._past_end else self.matcher.mask()

    def _prefix(self, drafts: Sequence[mx.array]) -> Optional[mx.array]:
        """The tokens before the row after ``drafts``, (n + 1 + j,); None without
        processors (a grammar reads its own state)."""
        if not self.processors:
            return None
        parts = [self.history]
        if self._pending is not None:
            parts.append(self._pending.reshape(1).astype(mx.int32))
        parts += [d.reshape(-1).astype(mx.int32) for d in drafts]
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def _process(self, logits: mx.array, prefix: mx.array, j: int) -> mx.array:
        for p in self.processors:
            logits = p(prefix, logits)
        mask = self.masks[min(j, len(self.masks) - 1)] if self.masks else None
        return logits if mask is None else constrain(logits, mask)

    def draft_logits(self, logits: mx.array, drafts: Sequence[mx.array]) -> mx.array:
        """``(1, V)`` draft logits of the row after ``drafts`` (each ``(1,)``), as the
        target's row will be processed."""
        return self._process(logits, self._prefix(drafts), len(drafts))

    def push(self, token) -> None:
        """The grammar consumes a draft token (an int, or an array read to the host
        here) and gives the next row's mask; after a token it forbids, the rows that
        follow cannot be accepted and repeat the last mask."""
        if self.matcher is None:
            return
        token = int(token.item()) if isinstance(token, mx.array) else int(token)
        if self._past_end:
            self.masks.append(None)
        elif not self._stuck and self._ends(token):
            self._past_end = True
            self.masks.append(None)
        elif not self._stuck and self.matcher.consume(token):
            self._pushed += 1
            self.masks.append(self._mask())
        else:
            self._stuck = True
            self.masks.append(self.masks[-1])

    def allowed_prefix(self, tokens: List[int]) -> List[int]:
        """The longest prefix of ``tokens`` the grammar allows (a lookup draft)."""
        if self.matcher is None or self._ended:
            return tokens
        n = 0
        for t in tokens:
            if self._ends(t):
                self.matcher.rollback(n)
                return tokens[: n + 1]
            if not self.matcher.consume(t):
                break
            n += 1
        self.matcher.rollback(n)
        return tokens[:n]

    def end_draft(self) -> None:
        """Put the grammar back at the committed tokens (the round's masks stay)."""
        if self.matcher is not None and self._pushed:
            self.matcher.rollback(self._pushed)
        self._pushed = 0

    def verify_logits(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """``(k + 1, V)`` target logits, row j processed with the prefix that ends in
        d_1..d_j (``drafts``: ``(k,)``)."""
        rows = []
        for j in range(logits.shape[0]):
            prefix = self._prefix([drafts[:j]])
            rows.append(self._process(logits[j : j + 1], prefix, j))
        return mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def commit(self, tokens: Sequence[int]) -> None:
        """The round committed ``tokens``: the history and the grammar move on."""
        self.observe(tokens)
        if self.matcher is not None:
            for t in tokens:
                self._ended = self._ended or self._ends(t)
                if self._ended or not self.matcher.consume(t):
                    break

    def _ends(self, token: int) -> bool:
        """Whether ``token`` is an EOS that ends the grammar here (EOS is not given
        to the engine, which may know fewer EOS ids than the tokenizer)."""
        return token in self.eos and self.matcher.allows(token)

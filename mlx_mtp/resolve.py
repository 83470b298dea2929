"""How a generation drafts, resolved once from its `DecodeOptions` and the model: the
draft-length policy, the draft vocabularies, the draft sources (`Drafting`).

Nothing here changes the output: it only decides what is drafted.
"""

from dataclasses import dataclass
from typing import List, Optional, Union

from .draft_length import (
    AdaptiveLength,
    Coverage,
    DraftPolicy,
    FixedLength,
    SourceChoice,
    model_costs,
)
from .errors import MTPError, RollbackError
from .history import DEFAULT_PRIOR, learn, learns, model_key, priors, shares
from .options import DecodeOptions, check_draft_count, longest_draft


@dataclass(frozen=True)
class Drafting:
    """What a generation drafts with (its parts keep state across rounds).

    ``policy`` sizes the heads' drafts (and picks their draft vocabulary);
    ``lookup_tokens`` is the longest prompt-lookup draft (0: heads only); ``sources``
    picks heads or lookup round by round (``draft_source`` "auto"); ``coverage``
    weighs several draft vocabularies (``draft_vocab`` "auto"). ``history``: the
    key of the model's acceptance history (`mlx_mtp.history`) the policies started
    from and `remember` adds to (None: they use the constant prior).
    """

    policy: DraftPolicy
    lookup_tokens: int = 0
    sources: Optional[SourceChoice] = None
    coverage: Optional[Coverage] = None
    history: Optional[str] = None

    def depth(self, model) -> int:
        """MTP layers in use: as many as the longest heads draft needs."""
        return min(self.policy.max_k, model.num_mtp_layers)

    def remember(self) -> None:
        """Add what this generation's adaptive policies saw to the model's history
        (once the generation ends)."""
        lookup = self.sources.lookup if self.sources is not None else None
        seen = {
            source: p.seen
            for source, p in (("heads", self.policy), ("lookup", lookup))
            if isinstance(p, AdaptiveLength)
        }
        if self.coverage is not None:
            seen["vocab"] = self.coverage.seen
        learn(self.history, seen)


def drafting(
    model, options: DecodeOptions, policy: Optional[DraftPolicy] = None
) -> Drafting:
    """Resolve ``options`` (checked) for ``model``; ``policy`` replaces the one
    ``num_draft_tokens`` asks for (the tests' scripted policies)."""
    source = options.draft_source
    if options.num_draft_tokens == 0 and source == "auto":
        source = "heads"  # k = 0 is plain decoding unless lookup is asked for
    if source != "heads":
        source = lookup_source(model, source)
    history = model_key(model) if learns(model, options) else None
    vocabs, coverage = draft_vocabs(model, options.draft_vocab, history)
    if policy is None:
        policy = draft_policy(
            model,
            options.num_draft_tokens,
            options.max_draft_tokens,
            vocabs,
            coverage,
            history,
        )
    elif not isinstance(policy, DraftPolicy):
        raise TypeError(f"policy must be a DraftPolicy, got {type(policy).__name__}")
    elif not model.num_mtp_layers:
        policy = FixedLength(0)
    coverage = coverage if len(vocabs) > 1 else None
    lookup = options.lookup_tokens if source != "heads" else 0
    sources = None
    if source == "auto":
        sizes = [n for n in vocabs if n is not None]
        costs = model_costs(model, max(policy.max_k, lookup), sizes)
        sources = SourceChoice(
            costs, policy.max_k, lookup, vocabs, coverage, _priors(history)
        )
    return Drafting(policy, lookup, sources, coverage, history)


def _priors(history: Optional[str]) -> dict:
    """The acceptance per position each draft source starts from: the model's
    history where it has one (else the policies' constant prior)."""
    found = {s: priors(history, s) for s in ("heads", "lookup")}
    return {s: p for s, p in found.items() if p}


def lookup_source(model, source: str) -> str:
    """``source`` ("lookup" or "auto") when the trunk's caches roll back exactly, as
    a rejected lookup draft needs; else, for "auto", "heads" (the heads' drafts, which
    the decode loop refuses on such caches too, or plain decoding without heads).

    Raises:
        RollbackError: "lookup" on caches that cannot roll back.
    """
    bad = caches_without_rollback(model)
    if not bad:
        return source
    if source == "lookup":
        raise RollbackError(
            "prompt lookup (draft_source lookup) needs exact cache rollback, which "
            f"mlx-mtp does not support for {', '.join(bad)} in this model; decode "
            "without it (draft_source heads)"
        )
    return "heads"


def caches_without_rollback(model) -> List[str]:
    """The kinds of the model's trunk caches that cannot roll back exactly (none: it
    can draft), sorted."""
    from .cache import check_rollback, make_caches

    bad = set()
    for c in make_caches(model).trunk:
        try:
            check_rollback([c])
        except RollbackError:
            bad.add(type(c).__name__)
    return sorted(bad)


def draft_vocabs(model, value: Union[int, str], history: Optional[str] = None):
    """The draft vocabularies ``draft_vocab`` lets the heads choose from (None: their
    own rows), and the `Coverage` that weighs them when there are several (starting
    from the shares in the model's ``history``, a `mlx_mtp.history` key, if any)."""
    from . import draft_vocab

    if value is None:
        return [None], None
    value = draft_vocab.parse(value)
    V = model.args.vocab_size
    trained = "draft_vocab" in model.mtp
    own = model.assistant is not None or (
        model.drafter is not None and not model.block_vocab_ok
    )
    if own or not model.num_mtp_layers:
        if isinstance(value, int) and own:
            raise MTPError("draft_vocab: a separate drafter drafts from its own head")
        return [None], None
    if value == "full" or (isinstance(value, int) and value >= V):
        return [V if trained else None], None
    if value == "auto":
        if not draft_vocab.wants_ranking(model):
            return [None], None  # nothing cheaper to draft from
        ranking = draft_vocab.ranking_for(model)
        if ranking is None:
            return [None], None
        sizes = draft_vocab.auto_sizes(V)
        return [None, *sizes], Coverage(ranking, sizes, start=shares(history, sizes))
    if trained:
        raise MTPError(
            f"these heads were trained to draft from their own "
            f"{model.mtp.draft_vocab.shape[0]} tokens: draft_vocab takes 'auto' or "
            "'full'"
        )
    if model.group is not None:
        raise MTPError("draft_vocab: a trunk sharded over several ranks drafts whole")
    if draft_vocab.ranking_for(model) is None:
        raise MTPError(
            f"draft_vocab {value}: {model.source} has no draft vocabulary and no "
            "tokenizer to rank one with"
        )
    return [value], None


def draft_policy(
    model,
    num_draft_tokens: Union[int, str],
    max_k: Optional[int],
    vocabs=(None,),
    coverage: Optional[Coverage] = None,
    history: Optional[str] = None,
) -> DraftPolicy:
    """The draft-length policy for ``num_draft_tokens`` (see `mtp_generate_step`),
    which also picks the draft vocabulary among ``vocabs`` (`draft_vocabs`); an
    adaptive one starts from the acceptance in the model's ``history`` (a
    `mlx_mtp.history` key; None: the constant prior).

    "auto" chooses among 0 and depth..max_k (None: `longest_draft`), depth being the
    model's MTP layers in use: a round drafting fewer tokens than that would leave
    deeper layers' caches behind.
    """
    max_k = longest_draft(model, max_k)
    check_draft_count("max_draft_tokens", max_k)
    check_draft_count("num_draft_tokens", num_draft_tokens, auto=True)
    limit = model.max_draft
    if limit is not None:  # a block drafter: gamma proposals a pass
        max_k = min(max_k, limit)
        if num_draft_tokens != "auto" and num_draft_tokens > limit:
            raise MTPError(
                f"num_draft_tokens {num_draft_tokens}: this drafter proposes at most "
                f"{limit} tokens a round (its block size)"
            )
    layers = model.num_mtp_layers
    sizes = [n for n in vocabs if n is not None]
    if num_draft_tokens == "auto":
        if not layers or not max_k:
            return FixedLength(0)
        depth = min(max_k, layers)
        allowed = [0, *range(depth, max_k + 1)]
        costs = model_costs(model, max_k, sizes)
        prior = _priors(history).get("heads", DEFAULT_PRIOR)
        return AdaptiveLength(
            costs, allowed, prior=prior, vocabs=vocabs, coverage=coverage
        )
    k = num_draft_tokens if layers else 0
    if k and len(vocabs) > 1:  # k fixed, the vocabulary chosen round by round
        costs = model_costs(model, k, sizes)
        return AdaptiveLength(costs, [k], vocabs=vocabs, coverage=coverage)
    return FixedLength(k, vocabs[0])

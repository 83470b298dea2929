"""The one served model: `MTPModelProvider` loads it with `mlx_mtp.load` (heads, or a
Gemma 4 assistant) and serves that model only (a request never makes the server load
another path); the round costs its requests decode with are measured before serving
(`warm_costs`, `warm_costs_batched`), and a request that would time others is refused
(`times_costs`)."""

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

from mlx_lm import server as lm_server

from .. import draft_vocab
from ..batch import warm_batch_costs
from ..batch_cache import batch_support
from ..defaults import MAX_DRAFT_TOKENS
from ..draft_length import model_costs
from ..loading import load
from ..options import DecodeOptions
from ..resolve import caches_without_rollback, draft_vocabs
from ..server_checks import RequestError
from .jobs import shutting_down

DEFAULT_MODEL = "default_model"  # mlx-lm's name for the served model


class MTPModelProvider(lm_server.ModelProvider):
    """Loads the one served model with `mlx_mtp.load`; any other name is refused."""

    def __init__(self, cli_args: argparse.Namespace):
        super().__init__(cli_args)
        self.served = model_id(cli_args.model)
        self.aliases = {DEFAULT_MODEL, self.served, cli_args.model}

    def _load_served(self) -> None:
        """Load the served model, and what its requests decode with (the draft
        vocabulary's ranking, the round costs, alone and batched), before serving,
        not in a request."""
        self.reset()
        args = self.cli_args
        tokenizer_config = {"trust_remote_code": args.trust_remote_code}
        if args.chat_template:
            tokenizer_config["chat_template"] = args.chat_template
        model, tokenizer = load(
            args.model,
            allow_missing_heads=args.allow_missing_heads,
            draft_model=args.draft_model,
            trust_remote_code=args.trust_remote_code,
            tokenizer_config=tokenizer_config,
            force=args.force,
        )
        if draft_vocab.wants_ranking(model):
            draft_vocab.ranking_for(model, tokenizer)
        warm_costs(model, args.decode)
        warm_costs_batched(model, args.max_batch)
        if args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (args.model, None, args.draft_model)
        self.model, self.tokenizer = model, tokenizer
        self.processor = None
        self.draft_model = None

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        """The served model and its tokenizer, loaded on first need: by `Server`
        before it serves, or by the generation loop as it starts (never by a
        request: see `held`); a 404 for any other name."""
        self.check_name(model_path)
        if self.model is None:
            self._load_served()
        return self.model, self.tokenizer

    def check_name(self, name: str) -> None:
        """A 404 unless ``name`` is one of the served model's names (`aliases`);
        nothing is loaded."""
        if name not in self.aliases:
            raise RequestError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.served!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )

    def held(self) -> "Served":
        """The served model and its tokenizer, as held now, for a request's checks;
        never loaded here: a 503 once the server closed (the generation loop
        dropped them as it ended)."""
        model, tokenizer = self.model, self.tokenizer
        if model is None or tokenizer is None:
            raise shutting_down()
        return Served(model, tokenizer)


class Served(NamedTuple):
    """The served model and its tokenizer, as a request's checks hold them: the
    generation loop may drop the provider's meanwhile (`MTPModelProvider.held`)."""

    model: Any
    tokenizer: Any


def warm_costs(model, defaults: DecodeOptions) -> None:
    """Read, or measure once, every round cost a request may decode with ("auto" draft
    lengths and sources weigh them), before serving: else a request would time them
    on the generation thread, every other request waiting. That is a trunk pass over
    up to `MAX_DRAFT_TOKENS` + 1 tokens (a request may ask for any k) and a draft step
    from each draft vocabulary that "auto", "full" and the server's ``draft_vocab``
    (``defaults``) draft from; a request that would need another is refused
    (`times_costs`)."""
    if caches_without_rollback(model):
        return  # no request drafts (`mlx_mtp.resolve.lookup_source`)
    sizes = set()
    for value in {"auto", "full", defaults.draft_vocab} - {None}:
        vocabs, _ = draft_vocabs(model, value)
        sizes.update(n for n in vocabs if n is not None)
    model_costs(model, MAX_DRAFT_TOKENS, sorted(sizes), on_measure=_say_timing)


def warm_costs_batched(model, max_batch: int) -> None:
    """Read, or measure once, what batched rounds of up to ``max_batch`` rows cost
    (`mlx_mtp.batch.warm_batch_costs`: the draft length of a batch's "auto" rows
    weighs them), before serving; nothing for a model that cannot batch, or one
    row."""
    if max_batch > 1 and batch_support(model) is None:
        warm_batch_costs(model, max_batch, on_measure=_say_batch_timing)


def _say_batch_timing() -> None:
    sys.stderr.write(
        "timing the model's batched rounds (once for this model and machine)...\n"
    )
    sys.stderr.flush()


def _say_timing() -> None:
    sys.stderr.write(
        f"timing the model's rounds for up to {MAX_DRAFT_TOKENS} drafts (once for "
        "this model and machine)...\n"
    )
    sys.stderr.flush()


def times_costs(model, options: DecodeOptions) -> bool:
    """Whether decoding with ``options`` would time round costs that `warm_costs` did
    not: an "auto" draft length or source weighing a number of draft tokens
    (``draft_vocab``) whose draft step was not measured, with native heads that draft
    from any rows (heads trained on their own rows refuse a number, in the loop)."""
    n, k = options.draft_vocab, options.num_draft_tokens
    weighs = k == "auto" or (options.draft_source == "auto" and k != 0)
    costs = model.round_costs
    return (
        weighs
        and isinstance(n, int)
        and n < model.args.vocab_size
        and model.num_mtp_layers > 0
        and model.assistant is None
        and model.drafter is None
        and "draft_vocab" not in model.mtp
        and (costs is None or n not in costs.drafts)
    )


def model_id(path: str) -> str:
    """The id `/v1/models` lists for the served model: a hub id as given, a local
    folder by its absolute path."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path

"""Text layer over the decode loops: ``stream_generate``, ``generate`` and
``batch_generate``, as in mlx-lm.

Responses are mlx-lm's ``GenerationResponse`` plus ``mtp``, a snapshot of the run's
`MTPStats`. Stopping at EOS and max_tokens follows mlx-lm's ``stream_generate``.
"""

import numbers
import time
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Callable, Generator, Iterable, List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.generate import GenerationResponse as _LMResponse
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .batch import RowOutput, failed_output, run_batch
from .defaults import DEFAULT_MAX_BATCH
from .errors import MTPError
from .grammar import grammar_fields
from .images import pending_media, prompt_media
from .memory import readable_size
from .options import DecodeOptions
from .speculative import Session, mtp_generate_step
from .stats import MTPStats
from .tables import mapped_bytes


@dataclass
class GenerationResponse(_LMResponse):
    """mlx-lm's response with the MTP statistics of the run so far, and where its
    token came from: ``source`` "heads" or "lookup" for an accepted draft (the MTP
    layers, an assistant or a block drafter are "heads"), None for a token the
    verify pass gave; ``mapped_memory``, the GB of tables read by row from their
    files (`mlx_mtp.tables`), which ``peak_memory`` does not count."""

    mtp: Optional[MTPStats] = None
    source: Optional[str] = None
    mapped_memory: float = 0.0


def encode_prompt(
    tokenizer: TokenizerWrapper, prompt, vocab_size: Optional[int] = None
) -> List[int]:
    """Token ids of a prompt given as text, ids or an ``mx.array`` (mlx-lm's rule for
    BOS). With ``vocab_size`` (the model's embedding rows), every id must be an
    integer from 0 to ``vocab_size - 1``: anything else is an `MTPError` naming it
    (the model would read outside its embedding, or crash)."""
    if isinstance(prompt, str):
        if not prompt:
            raise MTPError("the prompt is empty")
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, mx.array):
        ids = prompt.tolist() if prompt.ndim else [prompt.item()]
    elif isinstance(prompt, Iterable):
        ids = list(prompt)
    else:
        raise MTPError(
            f"a prompt must be text or token ids, got {type(prompt).__name__}"
        )
    if not ids:
        raise MTPError("the prompt is empty")
    return ids if vocab_size is None else _checked_ids(ids, vocab_size)


def _checked_ids(ids: list, vocab_size: int) -> List[int]:
    """``ids`` as ints, each a token id of a vocabulary of ``vocab_size`` tokens; an
    `MTPError` naming the first that is not (a bool, a float, out of range)."""
    out = []
    for i, token in enumerate(ids):
        whole = isinstance(token, numbers.Integral) and not isinstance(token, bool)
        if not whole or not 0 <= token < vocab_size:
            raise MTPError(
                f"token id {token!r} (position {i} of the prompt) is not a token of "
                f"this model: its vocabulary has {vocab_size} tokens (ids 0 to "
                f"{vocab_size - 1})"
            )
        out.append(int(token))
    return out


def fit_context(model, prompt_tokens: int, max_tokens: int) -> int:
    """Cap max_tokens at the model's context (``max_position_embeddings``); a prompt
    that does not leave room for one token is an error."""
    limit = getattr(model.args, "max_position_embeddings", None)
    if not limit:
        return max_tokens
    room = limit - prompt_tokens
    if room < 1:
        raise MTPError(
            f"the prompt has {prompt_tokens} tokens but the model's context is {limit}"
        )
    return room if max_tokens < 0 else min(max_tokens, room)


def _checked(options: DecodeOptions, tokenizer) -> DecodeOptions:
    """``options``, its grammar refused now, before any decoding, when the grammar
    engine refuses it (`mlx_mtp.grammar.GrammarError`)."""
    if options.grammar is not None:
        from .grammar import check_grammar

        check_grammar(options.grammar, tokenizer)
    return options


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    max_tokens: Optional[int] = None,
    *,
    options: Optional[DecodeOptions] = None,
    session: Optional[Session] = None,
    on_prefill: Optional[Callable[[Session], None]] = None,
    images: Optional[Sequence] = None,
    media=None,
    **fields,
) -> Generator[GenerationResponse, None, None]:
    """Stream a generation, one `GenerationResponse` per token.

    Args:
        model: A model from `mlx_mtp.load`.
        tokenizer: Its tokenizer (a ``TokenizerWrapper`` or a Hugging Face tokenizer).
        prompt: Text, or token ids (each from 0 to the model's vocabulary size
            - 1; any other id is an `MTPError`).
        max_tokens: Tokens to generate (-1: until EOS; default: the options').
        options: The `mlx_mtp.options.DecodeOptions` (default: its defaults);
            ``fields``, option names as keywords (``temp=0.7``,
            ``num_draft_tokens=2``, ...), override some of them. The drafting,
            sampling (as in mlx-lm), penalty, grammar and KV-cache options are
            described there. Structured output: ``json_schema=`` (a dict or
            JSON text), ``json_object=True`` or ``regex=`` (see
            `grammar_fields`).
        session: A `Session` to go on from (multi-turn chat): ``prompt`` is then what
            follows the tokens of earlier calls, whose caches are reused.
        on_prefill: Called with the session once the prompt is in its caches.
        images: For a model that reads images (GLM-OCR): the images (paths,
            encoded bytes or ``PIL.Image``s) of the prompt's image placeholders,
            one placeholder each, in order, as the chat template writes them
            (`mlx_mtp.images.image_messages`).
        media: Instead of ``images``: the `mlx_mtp.media.Media` of a prompt given
            as token ids that `mlx_mtp.images.prompt_media` made.

    Yields:
        `GenerationResponse`; the last one has ``finish_reason`` "stop" or "length".

    Raises:
        `mlx_mtp.grammar.GrammarError` (one line) for a grammar the engine refuses
        (before anything is decoded) or fails on while decoding (one of its limits
        reached; after the tokens before it were yielded), whatever
        ``num_draft_tokens`` is.
    """
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    options = DecodeOptions.build(options, **grammar_fields(fields))
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    options = _checked(options, tokenizer)
    going_on = session is not None and session.state is not None
    if going_on and isinstance(prompt, (list, tuple)) and not prompt:
        ids = []  # the session holds the whole prompt (`Sessions.take`)
    else:
        ids = encode_prompt(tokenizer, prompt, model.args.vocab_size)
    if images:
        ids, media = prompt_media(model, ids, images)
    before = len(session.tokens) if session is not None else 0
    max_tokens = fit_context(model, before + len(ids), options.max_tokens)
    steps = mtp_generate_step(
        ids,
        model,
        options.replace(max_tokens=max_tokens),
        session=session,
        on_prefill=on_prefill,
        tokenizer=tokenizer,
        media=media,
    )
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    mapped = mapped_bytes(model) / 1e9
    with (
        wired_limit(model, [generation_stream]),
        mx.stream(generation_stream),
        closing(steps),
    ):
        tic = time.perf_counter()
        for n, step in enumerate(steps):
            if n == 0:
                prompt_tps = len(ids) / (time.perf_counter() - tic)
                tic = time.perf_counter()
            stop = step.token in tokenizer.eos_token_ids
            if not stop:
                detokenizer.add_token(step.token)
            last = stop or n + 1 == max_tokens
            if last:
                detokenizer.finalize()
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=step.token,
                logprobs=step.logprobs,
                from_draft=step.from_draft,
                prompt_tokens=len(ids),
                prompt_tps=prompt_tps,
                generation_tokens=n + 1,
                generation_tps=(n + 1) / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=("stop" if stop else "length") if last else None,
                mtp=step.stats.snapshot(),
                source=step.source,
                mapped_memory=mapped,
            )
            if last:
                steps.close()
                return


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Generate a complete response; kwargs (``max_tokens``, ``options``, option
    names, ``session``) go to `stream_generate`."""
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(format_stats(response))
    return text


def format_stats(r: GenerationResponse) -> str:
    """One line: speed, then what MTP did: tokens per pass of the full model (a
    round: one verify pass; plain decoding makes 1.00), drafts per pass, and the
    drafts accepted, overall and by draft position."""
    line = (
        f"prompt {r.prompt_tokens} tok @ {r.prompt_tps:.1f} tok/s | "
        f"generated {r.generation_tokens} tok @ {r.generation_tps:.1f} tok/s | "
        f"peak {r.peak_memory:.2f} GB"
    )
    if getattr(r, "mapped_memory", 0.0):
        mapped = readable_size(r.mapped_memory * 1e9)
        line += f" (+ {mapped} of tables read from disk)"
    stats = r.mtp
    if stats is not None and stats.positions and not stats.drafted:
        line += " | no drafts (plain decoding)"
    elif stats is not None and stats.positions:
        drafted = [d > 0 for d in stats.drafted_per_position]
        acceptance = stats.acceptance_per_position[
            : len(drafted) - drafted[::-1].index(True)
        ]
        per_pos = " ".join(f"{x:.2f}" for x in acceptance)
        rate = f"{stats.acceptance_rate:.2f}"
        line += (
            f" | MTP {stats.tokens_per_round:.2f} tok/pass (plain: 1.00)"
            f" | drafts {stats.mean_draft_length:.2f}/pass,"
            f" accepted {stats.accepted}/{stats.drafted} ({rate}),"
            f" by position [{per_pos}]"
        )
        vocabs = stats.drafted_by_vocab
        if set(vocabs) - {"full"}:
            line += " | draft vocab " + ", ".join(
                f"{v} {n}" for v, n in sorted(vocabs.items(), key=lambda x: x[0])
            )
        if len(stats.drafted_by_source) > 1 or "lookup" in stats.drafted_by_source:
            line += " | by source " + ", ".join(
                f"{source} {stats.accepted_by_source[source]}/{n}"
                for source, n in sorted(stats.drafted_by_source.items())
            )
    return line


@dataclass
class BatchResponse:
    """What `batch_generate` returns, per prompt in order: ``texts`` (without the
    EOS token), ``token_ids``, ``finish_reasons`` ("stop", "length", or "error" for a
    prompt that failed), ``mtp`` (each stream's `MTPStats`, with ``batch_sizes``:
    rounds per batch size) and ``errors`` (why a prompt failed, in one line; None
    for the others); and the totals: prompt and generated tokens, seconds, peak
    memory (GB)."""

    texts: List[str]
    token_ids: List[List[int]]
    finish_reasons: List[str]
    mtp: List[MTPStats]
    batch_sizes: List[dict]
    prompt_tokens: int
    generation_tokens: int
    seconds: float
    peak_memory: float
    errors: List[Optional[str]] = field(default_factory=list)

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second, all streams together (prefills included)."""
        return self.generation_tokens / self.seconds if self.seconds else 0.0


def batch_generate(
    model,
    tokenizer,
    prompts: Sequence[Union[str, List[int]]],
    max_tokens: Union[int, Sequence[int], None] = None,
    *,
    options: Union[DecodeOptions, Sequence[DecodeOptions], None] = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    on_output: Optional[Callable[[RowOutput], None]] = None,
    images: Optional[Sequence[Optional[Sequence]]] = None,
    media: Optional[Sequence] = None,
    **fields,
) -> BatchResponse:
    """Generate a response for each prompt, the streams decoded together with MTP
    (`mlx_mtp.batch`), as mlx-lm's ``batch_generate`` does without it.

    Args:
        prompts: Texts or token ids.
        max_tokens: Tokens per response (one number, or one per prompt; default:
            the options').
        options: `DecodeOptions` for every prompt, or one per prompt; ``fields``
            (option names) override them all.
        max_batch: Streams decoded together at most; a prompt joins when a row is
            free.
        on_output: Called with every round's `mlx_mtp.batch.RowOutput` (progress).
        images: For a model that reads images: per prompt, its images (as
            `stream_generate` takes them) or None; rows with and without images
            decode together. Each is read and sized first (a bad image raises
            before anything decodes); its features are made when its prompt
            joins the batch (`mlx_mtp.images.PendingMedia`).
        media: Instead of ``images``, for prompts given as token ids that
            `mlx_mtp.images.prompt_media` or ``pending_media`` made: per prompt,
            its `mlx_mtp.media.Media` or ``PendingMedia``, or None.

    Each response is exactly what `generate` gives for its prompt alone under greedy
    decoding, and exact speculative sampling otherwise.

    Bad arguments (no prompts, an empty prompt, an option out of range, lists of the
    wrong length) raise an `MTPError` before anything is decoded. One prompt's
    failure never raises: a prompt longer than the model's context, a grammar the
    engine refuses or fails on while decoding (or, one prompt at a time for a model
    whose caches cannot batch, any error of its decoding) ends that prompt with
    ``finish_reasons[i] == "error"`` and ``errors[i]`` saying why, its
    ``token_ids`` and ``texts`` holding the tokens made before the failure; the
    other prompts decode exactly as they would without it. ``on_output`` gets its
    last `RowOutput` too (``finish_reason`` "error", ``error`` set).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompts, (str, mx.array)) or not len(prompts):
        raise MTPError("prompts must be a non-empty list of prompts")
    ids = [_prompt_ids(tokenizer, p, i, model) for i, p in enumerate(prompts)]
    if images is not None and media is not None:
        raise MTPError("give images or media, not both")
    for name, given in (("lists of images", images), ("media", media)):
        if given is not None and len(given) != len(ids):
            raise MTPError(f"{len(ids)} prompts but {len(given)} {name}")
    if images is not None:  # read and sized now, through the tower as rows join
        media = [None] * len(ids)
        for i, pictures in enumerate(images):
            if pictures:
                ids[i], media[i] = pending_media(model, ids[i], pictures)
    per_prompt = _per_prompt(options, len(ids), grammar_fields(fields), max_tokens)
    n = len(ids)
    tokens = [[] for _ in ids]
    finish, stats, sizes = [None] * n, [MTPStats(0)] * n, [{}] * n
    errors: List[Optional[str]] = [None] * n

    def take(out: RowOutput, uid: int) -> None:
        tokens[uid].extend(out.tokens)
        stats[uid] = out.stats
        if out.finish_reason is not None:
            finish[uid], errors[uid] = out.finish_reason, out.error
            sizes[uid] = dict(out.batch_sizes)
        if on_output is not None:
            on_output(out if out.uid == uid else replace(out, uid=uid))

    tic = time.perf_counter()
    live, decoding = [], []  # prompts to decode, and their options
    for i, (o, p) in enumerate(zip(per_prompt, ids)):
        try:
            o = o.replace(max_tokens=fit_context(model, len(p), o.max_tokens))
            decoding.append(_checked(o, tokenizer))
            live.append(i)
        except MTPError as e:  # this prompt's failure only
            take(failed_output(i, e, None, model.args.vocab_size), i)
    eos, left = tokenizer.eos_token_ids, [ids[i] for i in live]
    with wired_limit(model, [generation_stream]), mx.stream(generation_stream):
        media = media and [media[i] for i in live]
        outputs = run_batch(model, left, decoding, eos, max_batch, tokenizer, media)
        for out in outputs if live else ():
            take(out, live[out.uid])
    seconds = time.perf_counter() - tic
    kept = [t[:-1] if f == "stop" else t for t, f in zip(tokens, finish)]
    return BatchResponse(
        texts=[_detokenize(tokenizer, t) for t in kept],
        token_ids=kept,
        finish_reasons=finish,
        mtp=[s.snapshot() for s in stats],
        batch_sizes=sizes,
        prompt_tokens=sum(len(p) for p in ids),
        generation_tokens=sum(len(t) for t in tokens),
        seconds=seconds,
        peak_memory=mx.get_peak_memory() / 1e9,
        errors=errors,
    )


def _prompt_ids(tokenizer, prompt, i: int, model) -> List[int]:
    """`encode_prompt` of prompt ``i`` of a batch; its error names the prompt."""
    try:
        return encode_prompt(tokenizer, prompt, model.args.vocab_size)
    except MTPError as e:
        raise MTPError(f"prompt {i}: {e}") from None


def _detokenize(tokenizer: TokenizerWrapper, tokens: List[int]) -> str:
    """``tokens`` as the streaming detokenizer gives them (what `generate` returns
    for the same tokens; ``decode`` can differ, e.g. on a leading space)."""
    detokenizer = tokenizer.detokenizer  # a fresh copy
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def _per_prompt(options, n: int, fields: dict, max_tokens) -> List[DecodeOptions]:
    """One checked `DecodeOptions` per prompt."""
    if options is None or isinstance(options, DecodeOptions):
        options = [options] * n
    elif len(options) != n:
        raise MTPError(f"{n} prompts but {len(options)} sets of options")
    if max_tokens is None or isinstance(max_tokens, int):
        max_tokens = [max_tokens] * n
    elif len(max_tokens) != n:
        raise MTPError(f"{n} prompts but {len(max_tokens)} max_tokens")
    out = []
    for o, m in zip(options, max_tokens):
        changes = dict(fields) if m is None else {**fields, "max_tokens": m}
        out.append(DecodeOptions.build(o, **changes))
    return out

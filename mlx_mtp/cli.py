"""The ``mlx-mtp`` command line: thin commands that parse, call the library and print.

Every user error ends as one line on stderr and a non-zero exit; Ctrl-C stops cleanly.
"""

import errno
import functools
import sys

import click

from .defaults import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
    MIN_KV_SIZE,
    SERVER_MAX_TOKENS,
)
from .images import image_messages, no_images, prompt_media, read_image, reads_images
from .options import DRAFT_SOURCES, DecodeOptions

DEFAULTS = DecodeOptions()  # the decode flags' defaults
SEED = click.IntRange(0, 2**64 - 1)  # MLX's seeds (mlx_mtp.sampling.check_seed)


def _fail(message: str, code: int = 1):
    click.echo(f"mlx-mtp: error: {message}", err=True)
    sys.exit(code)


def _exit_interrupted(line: str = "interrupted"):
    """One ``line`` and exit 130, after Ctrl-C was caught.

    CPython 3.11 and 3.12 mark a KeyboardInterrupt that leaves an ``exec`` of a string
    (dataclasses and namedtuples build their methods so, while modules import) as
    unhandled, even once caught, and then end the process by SIGINT instead of with
    its exit code. Any ``exec`` that completes clears that mark."""
    click.echo(f"\n{line}", err=True)
    exec("")
    sys.exit(130)


_sigint_seen = False  # set by `on_sigint`, the handler `mlx-mtp` runs under


def on_sigint(signum, frame):
    """Python's own SIGINT handler (raise KeyboardInterrupt), noting that it ran."""
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def _is_interrupt(e: BaseException) -> bool:
    """Whether ``e`` is Ctrl-C: a KeyboardInterrupt, the ImportError a compiled
    extension (``mlx.core``) raises from one that hit it while it initialised, or
    any ImportError after Ctrl-C (a library that swallowed it and half-imported)."""
    if isinstance(e, KeyboardInterrupt):
        return True
    cause = e.__cause__ or e.__context__
    return isinstance(e, ImportError) and (
        _sigint_seen or isinstance(cause, KeyboardInterrupt)
    )


def friendly_errors(fn):
    """Turn user errors into one line and an exit code; Ctrl-C into exit 130.

    User errors are `MTPError` (what the library raises for bad input) and `OSError`
    (a file the system refuses: missing, unreadable, a full disk). Anything else is a
    bug in mlx-mtp and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .errors import MTPError, one_line

        try:
            return fn(*args, **kwargs)
        except (KeyboardInterrupt, ImportError) as e:
            if not _is_interrupt(e):
                raise
            _exit_interrupted()
        except MTPError as e:
            _fail(one_line(e, limit=1000))
        except OSError as e:
            if e.errno == errno.ENOSPC:
                _fail(f"no space left on the device ({e.filename or 'writing'})")
            _fail(one_line(e))

    return wrapper


class Stopped(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stops_on_signals(fn):
    """Let SIGTERM and SIGHUP stop a command that writes files as Ctrl-C does: its
    ``finally`` blocks remove what it was writing (scratch folders, partial files,
    locks), then one line and exit 128 + the signal's number. A second signal during
    that cleanup is ignored."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        signals = [
            getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)
        ]

        def stop(signum, frame):
            for s in signals:
                signal.signal(s, signal.SIG_IGN)
            raise Stopped(signum)

        previous = {s: signal.signal(s, stop) for s in signals}
        try:
            return fn(*args, **kwargs)
        except Stopped as e:
            click.echo(f"\nstopped by {signal.Signals(e.signum).name}", err=True)
            sys.exit(128 + e.signum)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    return wrapper


def _quiet_transformers():
    """Silence transformers' notes about model types it does not know (tokenizers load
    fine) and its advice that PyTorch is absent (not needed); mlx-mtp prints its own
    warnings."""
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-mtp")
def main():
    """Multi-token-prediction speculative decoding for MLX: the model's MTP heads
    draft, the model verifies, and the output is exactly the model's own.

    \b
    mlx-mtp generate -p "Hello"                 (no --model: the built-in demo)
    mlx-mtp chat --model PATH_OR_HF_REPO
    mlx-mtp convert --hf-path HF_REPO --mlx-path OUT -q
    mlx-mtp COMMAND --help                      (each command's options)
    """


def run(args=None):
    """The ``mlx-mtp`` entry point. Ctrl-C at any moment, also while options are
    parsed or a command's heavy imports run, exits 130 with one line (click alone
    would print "Aborted!" and exit 1)."""
    try:
        code = main.main(args=args, prog_name="mlx-mtp", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        _exit_interrupted()
    except ImportError as e:
        if not _is_interrupt(e):
            raise
        _exit_interrupted()
    sys.exit(code if isinstance(code, int) else 0)


class DraftLength(click.ParamType):
    """``auto`` or an integer from 0 to `MAX_DRAFT_TOKENS`."""

    name = "auto|K"

    def convert(self, value, param, ctx):
        if value == "auto":
            return value
        try:
            k = int(value)
        except ValueError:
            k = -1
        if not 0 <= k <= MAX_DRAFT_TOKENS:
            self.fail(
                f"{value!r} is not 'auto' or an integer from 0 to {MAX_DRAFT_TOKENS}",
                param,
                ctx,
            )
        return k


class DraftVocab(click.ParamType):
    """``auto``, ``full`` or a positive number of tokens."""

    name = "auto|full|N"

    def convert(self, value, param, ctx):
        from .draft_vocab import parse
        from .errors import MTPError

        try:
            return parse(value)
        except MTPError:
            self.fail(f"{value!r} is not 'auto', 'full' or a number of tokens", param)


def max_tokens_option(default: int, help: str, unlimited: bool = True):
    """``--max-tokens/-m``: a positive count of tokens, and with ``unlimited`` -1 for
    no limit; ``help`` says what the count bounds (one sentence, no full stop)."""

    def check(ctx, param, value):
        if value == -1 or value > 0:
            return value
        raise click.BadParameter(
            f"{value} is not a positive number of tokens (or -1 for no limit)"
        )

    return click.option(
        "--max-tokens",
        "-m",
        type=int if unlimited else click.IntRange(min=1),
        default=default,
        show_default=True,
        callback=check if unlimited else None,
        help=f"{help} (-1: no limit)." if unlimited else f"{help}.",
    )


# Options more than one command takes, each declared once here; a factory's
# parameters are what differs between the commands (a default, a help line).
MODEL_HELP = "Model folder or Hugging Face repo [default: the built-in demo model]."


def model_option(required: bool = False, help: str = MODEL_HELP):
    return click.option("--model", required=required, default=None, help=help)


MODEL = model_option()

DRAFT_MODEL = click.option(
    "--draft-model",
    default=None,
    help="A Gemma 4 assistant or a DSpark drafter (folder or Hugging Face repo) to "
    "draft with.",
)


def trust_remote_code_option(
    help: str = "Let the tokenizer run Python code from the model folder (off: "
    "refused).",
):
    return click.option("--trust-remote-code", is_flag=True, help=help)


TRUST_REMOTE_CODE = trust_remote_code_option()


def seed_option(default=None, help="Seed for reproducible sampling."):
    """``--seed``: one of MLX's seeds; its default shown when there is one."""
    return click.option(
        "--seed",
        type=SEED,
        default=default,
        show_default=default is not None,
        help=help,
    )


FORCE = click.option(
    "--force",
    is_flag=True,
    help="Load the model even when its weights exceed the memory MLX can use here "
    "(set MLX_MTP_MEMORY_LIMIT to choose that bound).",
)

ALLOW_MISSING_HEADS = click.option(
    "--allow-missing-heads",
    is_flag=True,
    help="Decode without MTP when the heads are missing.",
)


def max_batch_option(help: str):
    return click.option(
        "--max-batch",
        type=click.IntRange(min=1),
        default=DEFAULT_MAX_BATCH,
        show_default=True,
        help=help,
    )


def output_option(help: str):
    """``--output/-o FILE``: where a command writes its results."""
    return click.option("--output", "-o", default=None, metavar="FILE", help=help)


def tokens_option(least: int, default, help: str):
    """``--tokens``: a count of tokens, at least ``least``."""
    return click.option(
        "--tokens",
        type=click.IntRange(min=least),
        default=default,
        show_default=default is not None,
        help=help,
    )


def read_prompt_stdin() -> str:
    """All of stdin as text; bytes that are not UTF-8 are a one-line error."""
    from .errors import MTPError

    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MTPError(
            f"the prompt on stdin is not valid UTF-8 (byte 0x{data[e.start]:02x} at "
            f"offset {e.start})"
        ) from None


def check_text(text: str, what: str = "the prompt") -> str:
    """``text`` if it is valid Unicode; bytes that were not UTF-8 (kept by Python as
    lone surrogates, e.g. in command-line arguments) are a one-line error."""
    from .errors import MTPError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            byte = f"byte 0x{text[e.start].encode('utf-8', 'surrogateescape')[0]:02x}"
        except UnicodeEncodeError:  # a lone surrogate that was never a byte
            byte = f"code point U+{ord(text[e.start]):04X}"
        raise MTPError(
            f"{what} is not valid UTF-8 ({byte} at character {e.start})"
        ) from None
    return text


def render_chat(tokenizer, messages: list) -> str:
    """The conversation rendered by the model's chat template, ready for a reply; a
    template that fails to compile or raises is a one-line `MTPError`."""
    from .errors import MTPError, one_line

    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # jinja2 and template-raised errors have many types
        raise MTPError(f"the model's chat template failed: {one_line(e)}") from None


def build_prompt(
    tokenizer,
    prompt: str,
    system_prompt,
    ignore_chat_template: bool,
    escapes: bool = True,
    images: int = 0,
):
    """Token ids of the prompt, with the chat template applied as mlx-lm does (and,
    with ``escapes``, its ``\\n`` and ``\\t`` turned into a newline and a tab, as
    mlx-lm does for ``--prompt``); with ``images``, that many image parts before
    the text (one placeholder each, `mlx_mtp.images.image_messages`), which need
    the chat template."""
    from .errors import MTPError

    prompt = check_text(prompt)
    if escapes:
        prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not prompt.strip():
        raise MTPError("the prompt is empty")
    use_template = not ignore_chat_template and tokenizer.has_chat_template
    if images and not use_template:
        raise MTPError("--image needs the model's chat template")
    if use_template:
        system = check_text(system_prompt, "--system-prompt") if system_prompt else ""
        if images:
            messages = image_messages(prompt, images, system)
        else:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
        prompt = render_chat(tokenizer, messages)
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def _repeatable(help: str, multiple: bool) -> str:
    """``help``, and for a repeatable option (bench's runs) that it repeats."""
    return f"{help} Repeat the option for several runs." if multiple else help


# Drafting and sampling options: one value for ``generate``, ``chat`` and ``serve``;
# with ``multiple``, the values bench runs each workload with.
def num_draft_tokens_option(multiple: bool = False):
    return click.option(
        "--num-draft-tokens",
        "-k",
        type=DraftLength(),
        multiple=multiple,
        default=(0, 1, 2, 3, 4, "auto") if multiple else DEFAULTS.num_draft_tokens,
        show_default=True,
        help=_repeatable(
            "MTP drafts per round (0: plain decoding, or lookup drafts only with "
            "--draft-source lookup; auto: the fastest k, each round).",
            multiple,
        ),
    )


def temp_option(multiple: bool = False):
    return click.option(
        "--temp",
        type=click.FloatRange(min=0),
        multiple=multiple,
        default=(0.0, 0.7) if multiple else DEFAULTS.temp,
        show_default=True,
    )


def draft_source_option(multiple: bool = False):
    return click.option(
        "--draft-source",
        type=click.Choice(DRAFT_SOURCES),
        multiple=multiple,
        default=("heads",) if multiple else DEFAULTS.draft_source,
        show_default=True,
        help=_repeatable(
            "heads: the MTP heads; lookup: also continuations found in the prompt "
            "and the text so far (prompt lookup), else the heads; auto: the source "
            "measured to be faster, round by round.",
            multiple,
        ),
    )


def draft_vocab_option(multiple: bool = False):
    """``--draft-vocab``; repeated (bench) it has no default: the heads' own rows."""
    help = _repeatable(
        "Rows of the head the MTP heads draft from: full, the N tokens the model "
        "emits most, or auto (full or a smaller set, round by round, as measured "
        "fastest). The output is the same.",
        multiple,
    )
    return click.option(
        "--draft-vocab",
        type=DraftVocab(),
        multiple=multiple,
        default=None if multiple else DEFAULTS.draft_vocab,
        show_default=not multiple,
        help=f"{help} [default: the heads' own rows]" if multiple else help,
    )


SAMPLING_OPTIONS = [
    num_draft_tokens_option(),
    click.option(
        "--max-draft-tokens",
        type=click.IntRange(0, MAX_DRAFT_TOKENS),
        default=DEFAULTS.max_draft_tokens,
        help="The largest k that auto picks.  [default: a block drafter's whole "
        f"block, else {DEFAULT_MAX_DRAFT_TOKENS}]",
    ),
    temp_option(),
    click.option(
        "--top-p",
        type=click.FloatRange(0, 1, min_open=True),
        default=DEFAULTS.top_p,
        show_default=True,
    ),
    click.option(
        "--top-k", type=click.IntRange(min=0), default=DEFAULTS.top_k, show_default=True
    ),
    click.option(
        "--min-p",
        type=click.FloatRange(0, 1),
        default=DEFAULTS.min_p,
        show_default=True,
    ),
    draft_source_option(),
    click.option(
        "--lookup-tokens",
        type=click.IntRange(1, MAX_DRAFT_TOKENS),
        default=DEFAULTS.lookup_tokens,
        show_default=True,
        help="The longest lookup draft.",
    ),
    draft_vocab_option(),
]


class Penalty(click.ParamType):
    """A penalty's number, in the range `DecodeOptions` takes for ``option``."""

    name = "float"

    def __init__(self, option: str):
        self.option = option

    def convert(self, value, param, ctx):
        from .errors import MTPError

        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        try:
            DecodeOptions(**{self.option: number})
        except MTPError as e:
            self.fail(str(e).removeprefix(f"{self.option} "), param, ctx)
        return number


def _penalty(kind: str, help: str):
    return [
        click.option(
            f"--{kind}-penalty",
            type=Penalty(f"{kind}_penalty"),
            default=None,
            help=help,
        ),
        click.option(
            f"--{kind}-context-size",
            type=click.IntRange(min=1),
            default=20,
            show_default=True,
            help=f"The last tokens the {kind} penalty looks at.",
        ),
    ]


# mlx-lm's logits processors and structured output: ``generate`` and ``chat``.
PROCESSOR_OPTIONS = [
    *_penalty(
        "repetition",
        "Divide the logits of tokens seen lately by this (negative ones: multiply), "
        "as mlx-lm does: 0.01 to 100 (1 or 0: off).",
    ),
    *_penalty(
        "presence",
        "Subtract this (-2 to 2) from the logits of tokens seen lately.",
    ),
    *_penalty(
        "frequency",
        "Subtract this (-2 to 2) from a token's logit for each time it was seen "
        "lately.",
    ),
    click.option(
        "--logit-bias",
        multiple=True,
        metavar="ID=BIAS",
        help="Add BIAS to the logit of token ID (repeatable).",
    ),
    click.option(
        "--json-schema",
        type=click.File("rb"),
        default=None,
        help="Make the output JSON that follows the JSON schema in this file.",
    ),
    click.option(
        "--json",
        "json_object",
        is_flag=True,
        help="Make the output a JSON object.",
    ),
    click.option(
        "--regex",
        default=None,
        help="Make the whole output match this regular expression.",
    ),
]


def sampling_options(fn):
    for option in reversed(SAMPLING_OPTIONS):
        fn = option(fn)
    return fn


def decode_options(fn):
    """Drafting, sampling and KV-cache options shared by ``generate`` and ``chat``."""
    options = SAMPLING_OPTIONS + [
        seed_option(),
        click.option(
            "--kv-bits",
            type=click.Choice(["2", "3", "4", "6", "8"]),
            default=None,
            help="Quantize the KV cache to this many bits.",
        ),
        click.option(
            "--kv-group-size",
            type=click.IntRange(min=1),
            default=DEFAULTS.kv_group_size,
            show_default=True,
        ),
        click.option(
            "--quantized-kv-start",
            type=click.IntRange(min=0),
            default=DEFAULTS.quantized_kv_start,
            show_default=True,
            help="Positions before the KV cache is quantized.",
        ),
        *PROCESSOR_OPTIONS,
        click.option("--system-prompt", default=None),
        ALLOW_MISSING_HEADS,
        FORCE,
        DRAFT_MODEL,
        TRUST_REMOTE_CODE,
        click.option(
            "--verbose/--quiet",
            default=True,
            show_default=True,
            help="Print the stats line.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _decode_options(options: dict, **fields) -> DecodeOptions:
    """The `DecodeOptions` of the shared flags (and ``fields``), checked."""
    names = set(DecodeOptions.names()) - {"max_tokens", "max_kv_size", "kv_bits"}
    names -= {"logit_bias", "grammar"}
    chosen = {k: options[k] for k in names if k in options}
    kv_bits = options.get("kv_bits")
    chosen["kv_bits"] = None if kv_bits is None else int(kv_bits)
    if "logit_bias" in options:
        chosen["logit_bias"] = _logit_bias(options["logit_bias"])
    if "regex" in options:
        chosen["grammar"] = _grammar(options)
    return DecodeOptions.build(**chosen, **fields)


def _logit_bias(pairs):
    """``--logit-bias ID=BIAS`` flags as a dict (a bad one is a usage error)."""
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise click.BadParameter(
                f"{pair!r} is not ID=BIAS (a token id and a number)",
                param_hint="--logit-bias",
            ) from None
    return bias or None


def _grammar(options: dict):
    """The grammar of ``--json-schema FILE``, ``--json`` or ``--regex`` (None
    without); two of them, or a schema file or pattern that cannot be read (not
    UTF-8, not JSON, nested too deeply, not an object), is a one-line error and
    exit 2. The grammar engine's own refusals come later (exit 1)."""
    from .errors import MTPError
    from .grammar import GrammarSpec

    flags = {
        "json_schema": "--json-schema",
        "json_object": "--json",
        "regex": "--regex",
    }
    given = [flag for name, flag in flags.items() if options.get(name)]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} cannot go together")
    if options.get("json_schema"):
        f = options["json_schema"]
        where = f"--json-schema {f.name}"
        try:
            return GrammarSpec.json_schema(_schema_file(f.read(), where))
        except MTPError as e:
            _fail(f"{where}: {e}", 2)
    if options.get("json_object"):
        return GrammarSpec.json_object()
    if options.get("regex"):
        try:
            return GrammarSpec.regex(check_text(options["regex"], "--regex"))
        except MTPError as e:
            _fail(str(e), 2)
    return None


def _schema_file(data: bytes, where: str):
    """The JSON value of a schema file's bytes; not UTF-8, not JSON or nested
    deeper than Python's parser goes: one line naming ``where``, exit 2."""
    import json

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        _fail(
            f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset "
            f"{e.start})",
            2,
        )
    try:
        return json.loads(text)
    except RecursionError:
        _fail(f"{where}: the JSON nests too deeply to read", 2)
    except ValueError as e:
        _fail(f"{where}: not valid JSON: {e}", 2)


def _rank() -> int:
    """This process's rank under ``mlx.launch`` (0 when not launched). Other ranks
    than 0 print nothing to stdout: their output is rank 0's."""
    from .distributed import launched

    group = launched()
    return group.rank() if group is not None else 0


def _silence_other_ranks() -> int:
    """Send stdout of ranks other than 0 to /dev/null; returns the rank."""
    import os

    rank = _rank()
    if rank:
        sys.stdout = open(os.devnull, "w")
    return rank


def _load_for_decoding(model, options: dict):
    from .loading import load

    _quiet_transformers()
    if model is None:
        from .demo import demo_model

        model = str(demo_model())
    mdl, tokenizer = load(
        model,
        allow_missing_heads=options["allow_missing_heads"],
        trust_remote_code=options["trust_remote_code"],
        draft_model=options["draft_model"],
        force=options["force"],
    )
    return mdl, tokenizer


def _rank_vocabulary(model, tokenizer, options: dict, rank: int) -> None:
    """Rank the vocabulary for draft vocabularies now, before decoding, when the
    options draft with the heads from a draft vocabulary and the ranking is neither
    stored with the model nor cached; rank 0 says so on stderr unless ``--quiet``."""
    from . import draft_vocab

    if (
        options["draft_vocab"] == "full"
        or options["num_draft_tokens"] == 0
        or not draft_vocab.wants_ranking(model)
    ):
        return
    if not draft_vocab.has_ranking(model) and options["verbose"] and rank == 0:
        click.echo(
            "ranking the vocabulary for draft vocabularies (once for this model)...",
            err=True,
        )
    draft_vocab.ranking_for(model, tokenizer)


@main.command(short_help="Generate text from a prompt, drafting with MTP heads.")
@MODEL
@click.option(
    "--prompt",
    "-p",
    default="-",
    show_default=True,
    help="Prompt text; '-' reads stdin.",
)
@max_tokens_option(DEFAULTS.max_tokens, "Tokens to generate at most")
@click.option(
    "--max-kv-size",
    type=click.IntRange(min=MIN_KV_SIZE),
    default=None,
    help="Attend over this many positions at most (4 sink tokens + the latest, as "
    "mlx-lm's rotating cache); exact with drafting too.",
)
@click.option("--ignore-chat-template", is_flag=True)
@click.option(
    "--prompts-file",
    type=click.Path(exists=True, dir_okay=False, allow_dash=True),
    default=None,
    help="Generate for every prompt of this file ('-': stdin), decoded together "
    "(see above); one JSON result a line.",
)
@max_batch_option("With --prompts-file: prompts decoded together at most.")
@output_option(
    "With --prompts-file: append each result to this file as soon as it is "
    "done, and put the file in the prompts' order once all are. A rerun with the "
    "same FILE goes on from there: it checks that each line of FILE is the result "
    "of the prompt on its line (same line, id and prompt; the options are not "
    "compared), skips those prompts, and retries the ones that failed [default: "
    "stdout, in the prompts' order].",
)
@click.option(
    "--progress",
    is_flag=True,
    help="With --prompts-file: the progress line on stderr also when it is not a "
    "terminal (--quiet: none).",
)
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="An image the prompt is about, for a model that reads images (GLM-OCR); "
    "repeat for several (placed before the text, in order).",
)
@click.option(
    "--prompt-cache",
    type=click.Path(dir_okay=False),
    default=None,
    help="Keep the prompt's caches in this file: a later run whose prompt starts "
    "with the same tokens and goes on (a shared preamble, with "
    "--ignore-chat-template) runs only the rest; with --image, the file keeps the "
    "prompt up to its images, so that any later question about the same images "
    "runs only its own tokens. Written after the reply; a file "
    "of another model, or unreadable, is replaced (with a warning).",
)
@decode_options
@friendly_errors
def generate(
    model,
    prompt,
    max_tokens,
    max_kv_size,
    ignore_chat_template,
    images,
    prompt_cache,
    **options,
):
    """Generate text from a prompt, drafting with the model's MTP heads. Under
    ``mlx.launch`` the model is sharded over the ranks and rank 0 reads the prompt
    and prints.

    With --prompts-file FILE, every prompt of FILE is generated, the prompts
    decoded in batches with MTP (each text the same as alone), and the results
    written as JSONL, one object a prompt: id, line (the prompt's line in FILE),
    prompt, text, finish_reason, prompt_tokens, generation_tokens and mtp (drafted,
    accepted, acceptance_rate, tokens_per_round, batch_sizes). A prompt that fails
    while it decodes gets {id, line, prompt, "finish_reason": "error", error}, the
    others go on, and the run exits 1. Each result is written as soon as it is done
    (to stdout once the ones before it are; see --output); Ctrl-C or SIGTERM stops
    with one line saying how many were written (exit 130 or 143). FILE holds one
    prompt a line (blank lines skipped, the text taken as it is), or JSONL (when its
    first line starts with "{" or any line is a JSON object): one JSON object a
    line, "prompt" (text) or "messages" (a chat), an optional "id", and any decode
    option by its name, for that prompt alone:

    \b
    {"id": "a", "prompt": "Hello", "max_tokens": 64}
    {"messages": [{"role": "user", "content": "Hi"}], "temp": 0.7, "seed": 1}
    """
    from .distributed import Sync
    from .errors import MTPError
    from .generate import format_stats, stream_generate
    from .media import share as share_media

    batch = {k: options.pop(k) for k in ("prompts_file", "max_batch", "output")}
    batch["progress"] = options.pop("progress")
    _check_batch_flags(batch)
    decode = _decode_options(options, max_tokens=max_tokens, max_kv_size=max_kv_size)
    if images:
        _check_image_flags(batch)
        if _rank() == 0:  # rank 0 reads the images; bad files fail first
            pictures = [read_image(path) for path in images]
    if batch["prompts_file"] is not None:
        if prompt_cache is not None:
            raise click.UsageError("--prompt-cache does not go with --prompts-file")
        return _generate_file(model, decode, ignore_chat_template, batch, options)
    if prompt_cache is not None:
        from .distributed import launched

        if launched() is not None:
            raise click.UsageError("--prompt-cache does not run under mlx.launch")
        _check_writable(prompt_cache)
    rank = _silence_other_ranks()
    if prompt == "-" and rank == 0:
        prompt = read_prompt_stdin()
    mdl, tokenizer = _load_for_decoding(model, options)
    ids, error, media = [], None, None
    if rank == 0:
        try:
            if images and not reads_images(mdl):
                raise MTPError(f"--image: {no_images(mdl)}")
            ids = build_prompt(
                tokenizer,
                prompt,
                options["system_prompt"],
                ignore_chat_template,
                images=len(images),
            )
            if images:  # the placeholders repeated for the images' features
                ids, media = prompt_media(mdl, ids, pictures)
        except MTPError as e:
            error = e
    sync = Sync(mdl.group)
    sync.all_ok(error)
    ids = sync.share_tokens(ids)
    if images:  # read and encoded on rank 0
        media = share_media(sync, media)
    _rank_vocabulary(mdl, tokenizer, options, rank)
    session, done, prefilled = None, 0, []
    if prompt_cache is not None:
        session, done = _cached_session(prompt_cache, mdl, ids, decode, media)
        reused = done  # what the file held of the prompt
        if media is not None:  # kept up to the images: any question about them
            session, done, prefilled = _to_images(
                mdl, session, done, ids, media, decode
            )
    response = None
    try:
        for response in stream_generate(
            mdl,
            tokenizer,
            ids[done:],
            options=decode,
            session=session,
            on_prefill=lambda s: prefilled or prefilled.append(s.snapshot()),
            media=media,
        ):
            click.echo(response.text, nl=False)
    finally:
        if response is not None:
            click.echo()
            if options["verbose"] and rank == 0:
                cached = f" | prompt cache {reused} tok" if prompt_cache else ""
                click.echo(format_stats(response) + cached, err=True)
    if (
        prompt_cache is not None and prefilled
    ):  # the prompt's (or images'), not the reply's
        from . import session_files

        key = session_files.model_key(mdl)
        session_files.save(prefilled[0], prompt_cache, key)


def _to_images(model, session, done: int, ids, media, decode):
    """With ``--prompt-cache`` and images: ``session`` filled up to the end of the
    prompt's last image (what the file then keeps, so that a later question about
    the same images goes on from it, whatever it asks), ``done`` moved there, and
    that session's snapshot, to be saved."""
    from .cache import make_caches
    from .media import attach
    from .speculative import fill

    mark = media.spans[-1][1]
    if done >= mark or mark >= len(ids):
        return session, done, []
    if session.caches is None:
        session.caches = make_caches(model)
    attach(session.caches, media, done)
    fill(model, session, ids[done:mark], decode)
    return session, mark, [session.snapshot()]


def _check_image_flags(batch: dict) -> None:
    """--image goes with one prompt (a usage error otherwise)."""
    if batch["prompts_file"] is not None:
        raise click.UsageError(
            "--image does not go with --prompts-file (a JSONL line takes its own "
            "'images')"
        )


def _cached_session(path: str, model, ids, decode, media=None):
    """The session ``--prompt-cache`` goes on from, and how many of the prompt's
    tokens it holds: the file's when the prompt extends its tokens (its images the
    same: ``media``'s) and it drafts with the same MTP layers, else a new one (a
    file of another model or an unreadable one: a warning)."""
    import os

    from . import session_files
    from .media import keyed
    from .resolve import drafting
    from .speculative import Session

    if not os.path.exists(path):
        return Session(), 0
    try:
        session = session_files.load(path, session_files.model_key(model))
    except session_files.SessionFileError as e:
        click.echo(f"mlx-mtp: warning: {e}; starting afresh", err=True)
        return Session(), 0
    held = session.key
    depth = drafting(model, decode).depth(model)
    if session.state.depth != depth or not (
        len(held) < len(ids) and keyed(ids, media)[: len(held)] == held
    ):
        return Session(), 0
    return session, len(held)


def _check_batch_flags(batch: dict) -> None:
    """--prompts-file excludes --prompt; --max-batch, --output and --progress need
    it (usage errors)."""
    source = click.get_current_context().get_parameter_source
    if batch["prompts_file"] is not None:
        if source("prompt") is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError("--prompts-file and --prompt cannot go together")
        return
    for name in ("max_batch", "output", "progress"):
        if source(name) is not click.core.ParameterSource.DEFAULT:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(f"{flag} goes with --prompts-file")


@stops_on_signals
def _generate_file(model, decode, ignore_chat_template, batch: dict, options: dict):
    """``generate --prompts-file``: the file read and checked before the model loads,
    and then what only the model can tell (a bad line: one line naming it, exit 2,
    nothing generated); the prompts without a result (`mlx_mtp.prompts_file.results`)
    decoded with `mlx_mtp.batch_generate`, each result written as it is done. Prompts
    that failed while they decoded: their error results, one line, exit 1."""
    from . import prompts_file as pf
    from .distributed import launched

    if launched() is not None:
        raise click.UsageError("--prompts-file does not run under mlx.launch")
    path = batch["prompts_file"]
    try:
        prompts = pf.parse(pf.read(path), path)
        images = {p.line: pf.image_paths(p, path) for p in prompts if p.images}
        per_line = pf.decode_options(prompts, decode, path)
        per_line = {p.line: o for p, o in zip(prompts, per_line)}
        pf.check_output(batch["output"], path)
        results = pf.results(batch["output"], prompts, path)
        pending = results.pending
        if not pending:
            results.close()
            if options["verbose"]:
                done = f"every prompt of {pf.source_name(path)} has its result"
                click.echo(f"{done} in {batch['output']} already", err=True)
            return
        mdl, tokenizer = _load_for_decoding(model, options)
        ids = []
        for p in pending:
            tokens, parts = _file_prompt(
                mdl, tokenizer, p, path, ignore_chat_template, options
            )
            ids.append(tokens)
            if parts:  # a chat's image_url parts
                images[p.line] = parts
        media = _file_media(mdl, pending, ids, images, path)
        todo = [per_line[p.line] for p in pending]
        _check_loaded(mdl, tokenizer, pending, ids, todo, decode, path)
    except pf.PromptsFileError as e:
        _fail(str(e), 2)
    _rank_vocabulary(mdl, tokenizer, options, 0)
    _warm_batch_costs(mdl, min(batch["max_batch"], len(pending)), options["verbose"])
    show = options["verbose"] and (batch["progress"] or sys.stderr.isatty())
    progress = pf.Progress(len(prompts), show, done=len(prompts) - len(pending))
    collect = pf.Collector(pending, ids, tokenizer, results, progress, path)
    response = _decode_file(
        mdl, tokenizer, ids, todo, batch["max_batch"], collect, media
    )
    if options["verbose"]:
        click.echo(pf.summary(response), err=True)
    if collect.failed:
        where = batch["output"] if batch["output"] not in (None, "-") else "stdout"
        _fail(
            f"{collect.failed} of {len(pending)} prompts failed: their results in "
            f"{where} hold the error"
        )


def _decode_file(model, tokenizer, ids, options, max_batch: int, collect, media=None):
    """`mlx_mtp.batch_generate` of a prompts file's ``ids``, its outputs to
    ``collect`` (`mlx_mtp.prompts_file.Collector`), its results closed at the end.
    Ctrl-C, SIGTERM or SIGHUP: one line saying how many results were written and
    where, exit 128 + the signal's number; an error: one line saying it too."""
    import signal

    from .errors import MTPError, one_line
    from .generate import batch_generate

    results = collect.results
    try:
        with collect.progress:
            return batch_generate(
                model,
                tokenizer,
                ids,
                options=options,
                max_batch=max_batch,
                on_output=collect,
                media=media,
            )
    except KeyboardInterrupt:
        _exit_interrupted(f"interrupted: {results.state()}")
    except Stopped as e:
        name = signal.Signals(e.signum).name
        click.echo(f"\nstopped by {name}: {results.state()}", err=True)
        sys.exit(128 + e.signum)
    except MTPError as e:
        _fail(f"{one_line(e, limit=1000)} ({results.state()})")
    finally:
        results.close()


def _check_loaded(model, tokenizer, prompts, ids, options, base, path) -> None:
    """What only the loaded model tells about each prompt of a file, checked before
    any decoding: it fits the context, its grammar compiles, its logit_bias ids are
    tokens of the model, and it asks no KV-cache limit or quantization where the
    prompts decode in a batch (which has neither): a `PromptsFileError` naming the
    line, or the flag when the command line asks it."""
    from .batch_cache import batch_support
    from .errors import MTPError, one_line
    from .generate import fit_context
    from .grammar import check_grammar
    from .processors import make_processors
    from .prompts_file import PromptsFileError, source_name

    batched = batch_support(model) is None
    if batched and (base.max_kv_size is not None or base.kv_bits is not None):
        raise PromptsFileError(
            "--max-kv-size and --kv-bits do not go with --prompts-file on this model "
            "(its prompts are decoded in batches)"
        )
    for prompt, tokens, o in zip(prompts, ids, options):
        try:
            fit_context(model, len(tokens), o.max_tokens)
            if o.grammar is not None:
                check_grammar(o.grammar, tokenizer)
            make_processors(o, model.args.vocab_size)
            if batched and (o.max_kv_size is not None or o.kv_bits is not None):
                raise MTPError(
                    "max_kv_size and kv_bits cannot be used on this model with "
                    "--prompts-file (its prompts are decoded in batches)"
                )
        except MTPError as e:
            where = f"{source_name(path)} line {prompt.line}"
            raise PromptsFileError(f"{where}: {one_line(e, limit=1000)}") from None


def _warm_batch_costs(model, rows: int, verbose: bool) -> None:
    """Read, or time once (saying so), the batched rounds' costs of up to ``rows``
    rows, before the progress bar starts (`mlx_mtp.batch.warm_batch_costs`)."""
    from .batch import warm_batch_costs
    from .batch_cache import batch_support

    def say():
        if verbose:
            click.echo(
                "timing the model's batched rounds (once for this model and "
                "machine)...",
                err=True,
            )

    if rows > 1 and batch_support(model) is None:
        warm_batch_costs(model, rows, on_measure=say)


def _file_media(model, prompts, ids, images: dict, path: str):
    """The prompts of a file with ``images`` (line -> files): their ``ids`` made
    as the model reads them (in place) and their media to make when each joins the
    batch (`mlx_mtp.images.pending_media`: every image read and sized now), or
    None when no prompt has images; a failure is a `PromptsFileError` naming the
    line."""
    from .errors import MTPError
    from .images import pending_media
    from .prompts_file import PromptsFileError, source_name

    if not any(p.line in images for p in prompts):
        return None
    media = [None] * len(prompts)
    for i, prompt in enumerate(prompts):
        if prompt.line in images:
            try:
                ids[i], media[i] = pending_media(model, ids[i], images[prompt.line])
            except MTPError as e:
                where = f"{source_name(path)} line {prompt.line}"
                raise PromptsFileError(f"{where}: {e}") from None
    return media


def _file_prompt(model, tokenizer, prompt, path, ignore_chat_template, options):
    """Token ids of a `mlx_mtp.prompts_file.FilePrompt`, and the encoded images of
    its chat's ``image_url`` parts (none for text): text as ``--prompt`` (the chat
    template and --system-prompt applied, but no escapes, and its ``images``' one
    placeholder each), or a chat's messages rendered by the chat template (each
    image part a placeholder, refused for a ``model`` that reads none); a failure is
    a `PromptsFileError` naming the line."""
    from .errors import MTPError
    from .prompts_file import PromptsFileError, source_name
    from .server_checks import RequestError, check_messages, take_images

    try:
        if not prompt.is_chat:
            ids = build_prompt(
                tokenizer,
                prompt.prompt,
                options["system_prompt"],
                ignore_chat_template,
                escapes=False,
                images=len(prompt.images),
            )
            return ids, []
        if ignore_chat_template or not tokenizer.has_chat_template:
            raise MTPError("'messages' need the model's chat template")
        check_messages(prompt.prompt, images=reads_images(model))
        messages = [dict(m) for m in prompt.prompt]  # the line's own stay as given
        for m in messages:
            if isinstance(m.get("content"), list):
                m["content"] = [dict(part) for part in m["content"]]
        parts = take_images(messages, read=False)
        text = check_text(render_chat(tokenizer, messages), "the chat")
        return tokenizer.encode(text, add_special_tokens=False), parts
    except (MTPError, RequestError) as e:
        where = source_name(path)
        raise PromptsFileError(f"{where} line {prompt.line}: {e}") from None


CHAT_COMMANDS = {
    "/image PATH": "attach an image to your next message (a model that reads images)",
    "/reset": "start over",
    "/exit": "quit (also /quit, Ctrl-D)",
    "/help": "this list",
}


@main.command(short_help="Chat in the terminal (caches kept between turns).")
@MODEL
@max_tokens_option(1024, "Tokens per reply at most")
@decode_options
@friendly_errors
def chat(model, max_tokens, **options):
    """Chat in the terminal. Ctrl-C stops a reply; /reset starts over; /exit or Ctrl-D
    quits. The conversation's caches are kept between turns. Under ``mlx.launch`` the
    model is sharded over the ranks; rank 0 reads the lines and prints (Ctrl-C there
    ends the whole launch)."""
    from .distributed import Sync
    from .errors import MTPError
    from .generate import format_stats, stream_generate
    from .speculative import Session

    decode = _decode_options(options, max_tokens=max_tokens)
    rank = _silence_other_ranks()
    mdl, tokenizer = _load_for_decoding(model, options)
    sync = Sync(mdl.group)
    if not tokenizer.has_chat_template:
        raise MTPError("this model's tokenizer has no chat template: use generate")
    system = options["system_prompt"]
    start = []
    if system:
        start = [{"role": "system", "content": check_text(system, "--system-prompt")}]
    render_chat(tokenizer, start + [{"role": "user", "content": "hi"}])  # fail now
    _rank_vocabulary(mdl, tokenizer, options, rank)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # bad bytes: checked per line
    messages, session = list(start), Session()
    pictures, pending = [], []  # the conversation's images, and the next message's
    if rank == 0:
        click.echo(
            "mlx-mtp chat: /reset to start over, /exit or Ctrl-D to quit", err=True
        )
    while True:
        line = None
        if rank == 0:
            try:
                line = input(">> ")
            except EOFError:
                pass
        line = sync.share_text(line)  # every rank takes the same turn
        if line is None:
            click.echo()
            return
        try:
            line = check_text(line, "that line")
        except MTPError as e:
            if rank == 0:
                click.echo(f"mlx-mtp: error: {e}; ignored", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages, session = list(start), Session()
            pictures, pending = [], []
            continue
        if text.startswith("/image ") or text == "/image":
            image, error = None, None
            if rank == 0:  # rank 0 reads the images (`_next_turn` shares them)
                try:
                    image = _chat_image(mdl, text[len("/image") :].strip())
                except MTPError as e:
                    error = e
                    click.echo(f"mlx-mtp: error: {e}", err=True)
            if sync.share_int(int(error is not None)):
                continue
            pending.append(image)
            if rank == 0:
                click.echo(
                    f"(image {len(pending)} goes with your next message)", err=True
                )
            continue
        if _is_command(text):
            if rank:
                continue
            if text != "/help":
                click.echo(f"mlx-mtp: unknown command {text.split()[0]}", err=True)
            shown = [
                c for c in CHAT_COMMANDS if reads_images(mdl) or c != "/image PATH"
            ]
            width = max(8, *map(len, shown))
            for name in shown:
                click.echo(f"  {name:{width}} {CHAT_COMMANDS[name]}", err=True)
            continue
        content = line
        if pending:
            parts = [{"type": "image"}] * len(pending)
            content = parts + [{"type": "text", "text": line}]
        messages.append({"role": "user", "content": content})
        reply, response, replies = "", None, None
        try:
            ids, session, media = _next_turn(
                tokenizer, messages, session, mdl, pictures + pending, sync
            )
            pictures, pending = pictures + pending, []
            replies = stream_generate(
                mdl, tokenizer, ids, options=decode, session=session, media=media
            )
            for response in replies:
                click.echo(response.text, nl=False)
                reply += response.text
        except KeyboardInterrupt:
            session = Session()  # stopped at any point: rebuild from the text
        except MTPError as e:
            if rank == 0:
                click.echo(f"mlx-mtp: error: {e}", err=True)
            messages.pop()
            session = Session()
            continue
        finally:
            if replies is not None:
                replies.close()
        click.echo()
        if options["verbose"] and response is not None and rank == 0:
            click.echo(format_stats(response), err=True)
        messages.append({"role": "assistant", "content": reply})


def _is_command(text: str) -> bool:
    """A line meant as a chat command: one word of letters after a slash (a path such
    as ``/usr/bin is ...`` or ``/ 2`` goes to the model)."""
    return text.startswith("/") and text[1:].isalpha()


def _chat_image(model, path: str):
    """The image ``/image PATH`` attaches (an `MTPError` in one line otherwise)."""
    from .errors import MTPError

    if not reads_images(model):
        raise MTPError(f"/image: {no_images(model)}")
    if not path:
        raise MTPError("/image needs the path of an image")
    return read_image(path)


def _next_turn(tokenizer, messages, session, model=None, pictures=(), sync=None):
    """Token ids to feed for the conversation so far, the session to feed them to,
    and the conversation's media (its ``pictures``, for a model that reads images;
    None without): the new tokens only when the session's tokens begin the
    rendered conversation (its images the same), otherwise all of them and a new
    session. On several ranks (``sync``), rank 0 holds the pictures and makes the
    ids and media every rank then takes."""
    from .distributed import Sync
    from .errors import MTPError
    from .media import keyed
    from .media import share as share_media
    from .speculative import Session

    ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    media = None
    if pictures:
        sync = sync or Sync(None)
        error = None
        if sync.rank == 0:
            try:
                ids, media = prompt_media(model, ids, pictures)
            except MTPError as e:
                error = e
        sync.all_ok(error)
        ids, media = sync.share_tokens(ids), share_media(sync, media)
    held, mine = session.tokens, keyed(ids, media)
    if held and len(ids) > len(held) and mine[: len(held)] == session.key:
        return ids[len(held) :], session, media
    return ids, Session(), media


class IntChoice(click.Choice):
    """One of a few integers, shown and parsed as such."""

    def __init__(self, *values: int):
        super().__init__([str(v) for v in values])

    def convert(self, value, param, ctx):
        return int(super().convert(str(value), param, ctx))


def overwrite_option(
    help: str = "Replace an existing output that mlx-mtp or mlx-lm wrote (never a "
    "folder holding other files).",
):
    return click.option("--overwrite", is_flag=True, help=help)


OVERWRITE = overwrite_option()


def hf_path_option(help: str):
    return click.option("--hf-path", default=None, help=help)


def mlx_path_option(help: str, required: bool = False):
    return click.option("--mlx-path", required=required, default=None, help=help)


def min_agreement_option(hidden: bool = False):
    return click.option(
        "--min-agreement",
        type=click.FloatRange(0, 1),
        default=0.9,
        show_default=True,
        hidden=hidden,
        help="Least top-1 agreement of each head with the source's.",
    )


REVISION = click.option("--revision", default=None, help="Hub revision of the source.")


def head_bits_option(default: str):
    return click.option(
        "--head-bits",
        type=IntChoice(4, 8, 16),
        default=None,
        help=f"MTP head precision; 16 keeps the float dtype. [default: {default}]",
    )


def renamed_option(old: str, new: str, **kwargs):
    """A hidden option for ``old``, the spelling this command's option ``new`` had
    before ``--draft-vocab`` became the decoding option alone: giving it is a usage
    error that names the new spelling, never the old meaning kept silently. ``old``
    may be a flag pair (``--a/--no-a``), ``new`` the matching pair."""

    def refuse(ctx, param, value):
        if value is None:
            return
        pairs = [s.split("/") for s in (old, new)]
        given, to = (p[0 if value is True or len(p) == 1 else 1] for p in pairs)
        raise click.UsageError(
            f"{given} is now {to} (--draft-vocab is the decoding option of "
            "generate, chat and serve)",
            ctx,
        )

    return click.option(
        old, default=None, hidden=True, expose_value=False, callback=refuse, **kwargs
    )


def deprecated_option(old: str, new: str, dest: str, **kwargs):
    """A hidden option ``old`` that, for one release, does what this command's option
    ``new`` (parameter ``dest``) does, after one warning line on stderr; giving both
    is a usage error. Unlike `renamed_option`, the old spelling keeps its meaning.
    Its value reaches the command as ``dest``'s: the command never sees ``old``."""
    name = "deprecated_" + old.lstrip("-").replace("-", "_")

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **params):
            value = params.pop(name)
            if value is not None:
                ctx = click.get_current_context()
                given = ctx.get_parameter_source(dest)
                if given is not click.core.ParameterSource.DEFAULT:
                    raise click.UsageError(f"{old} and {new} cannot go together", ctx)
                click.echo(
                    f"mlx-mtp: warning: {old} is deprecated here: use {new} ({old} "
                    "is removed in the next release)",
                    err=True,
                )
                params[dest] = value
            return fn(*args, **params)

        option = click.option(old, name, default=None, hidden=True, **kwargs)
        return option(wrapper)

    return decorate


RANK_VOCAB = click.option(
    "--rank-vocab/--no-rank-vocab",
    default=True,
    show_default=True,
    help="Rank the vocabulary for draft vocabularies (one pass of the model over a "
    "built-in text) and store the ranking with the heads.",
)
OLD_RANK_VOCAB = renamed_option(
    "--draft-vocab/--no-draft-vocab", "--rank-vocab/--no-rank-vocab"
)


@main.command(short_help="Convert a Hugging Face checkpoint, keeping its MTP heads.")
@hf_path_option("Hugging Face checkpoint (folder, hub repo or .gguf file).")
@mlx_path_option("Output folder.")
@click.option("-q", "--quantize", is_flag=True, help="Quantize the trunk.")
@click.option(
    "--q-bits", type=IntChoice(2, 3, 4, 5, 6, 8), default=None, help="Trunk bits [4]."
)
@click.option("--q-group-size", type=IntChoice(32, 64, 128), default=None)
@click.option(
    "--q-mode",
    type=click.Choice(["affine", "mxfp4", "nvfp4", "mxfp8"]),
    default="affine",
    show_default=True,
)
@head_bits_option("8 with -q, else 16")
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16", "float32"]),
    default=None,
    help="Dtype of unquantized parameters (default: the checkpoint's).",
)
@REVISION
@click.option("--upload-repo", default=None, help="Upload the result to this hub repo.")
@OVERWRITE
@click.option(
    "--require-heads",
    is_flag=True,
    help="Refuse a checkpoint without MTP tensors instead of warning.",
)
@trust_remote_code_option(
    "Copy the source's *.py files (custom tokenizer code) into the output."
)
@click.option(
    "--draft-hf-path",
    default=None,
    help="A Gemma 4 assistant to write beside the target (the folder runs the pair).",
)
@RANK_VOCAB
@OLD_RANK_VOCAB
@click.option("--graft-heads-from", "graft_from", hidden=True)
@click.option("--check", "check_path", hidden=True)
@min_agreement_option(hidden=True)
@stops_on_signals
@friendly_errors
def convert(hf_path, mlx_path, graft_from, check_path, min_agreement, **options):
    """Convert a Hugging Face checkpoint to MLX, keeping its MTP heads.

    \b
    mlx-mtp convert --hf-path Qwen/Qwen3.6-27B --mlx-path q36-4bit -q
    mlx-mtp convert --hf-path google/gemma-4-E4B-it \\
        --draft-hf-path google/gemma-4-E4B-it-assistant --mlx-path g4 -q
    (--graft-heads-from and --check are the old spellings of `mlx-mtp graft` and
    `mlx-mtp check`; they still work, with a note, until the next release.)
    """
    _quiet_transformers()
    options["copy_code"] = options.pop("trust_remote_code")
    if check_path or graft_from:
        if bool(check_path) == bool(graft_from):
            raise click.UsageError("give either --check or --graft-heads-from")
        new = "check PATH [--hf-path SOURCE]" if check_path else "graft --from SOURCE"
        click.echo(f"note: this is now `mlx-mtp {new}`", err=True)
        if check_path:
            if mlx_path:
                raise click.UsageError("--check takes no --mlx-path")
            return _check(check_path, hf_path, min_agreement, options["copy_code"])
        if hf_path:
            raise click.UsageError("--graft-heads-from takes no --hf-path")
        return _graft(graft_from, mlx_path, options)
    if not hf_path or not mlx_path:
        raise click.UsageError("--hf-path and --mlx-path are required")
    from .convert import convert as run

    click.echo(f"wrote {run(hf_path, mlx_path, **options)}")


@main.command(short_help="Add MTP heads or a drafter to an MLX model.")
@click.option(
    "--from",
    "--drafter",
    "source",
    required=True,
    help="Hugging Face checkpoint whose MTP heads to add, or a drafter: a Gemma 4 "
    "assistant, a DSpark or DFlash drafter (folder or hub repo; only the files "
    "they need are downloaded).",
)
@mlx_path_option("The MLX conversion (without heads) to add to.", required=True)
@head_bits_option("8")
@REVISION
@overwrite_option("Replace heads the folder already has.")
@RANK_VOCAB
@OLD_RANK_VOCAB
@stops_on_signals
@friendly_errors
def graft(source, mlx_path, **options):
    """Add MTP heads to an existing MLX conversion (e.g. an mlx-community model),
    or the assistant or DSpark drafter it drafts with.

    \b
    mlx-mtp graft --from Qwen/Qwen3.6-27B --mlx-path ~/models/Qwen3.6-27B-4bit
    mlx-mtp graft --from google/gemma-4-E4B-it-assistant --mlx-path ~/models/g4-4bit
    mlx-mtp graft --from ./dspark-qwen3-8b --mlx-path ~/models/Qwen3-8B-4bit
    """
    _quiet_transformers()
    _graft(source, mlx_path, options)


def _graft(source, mlx_path, options: dict) -> None:
    from .convert import graft_assistant, graft_heads
    from .convert.assistant import is_assistant_source
    from .convert.drafter import drafter_kind, graft_drafter

    if not mlx_path:
        raise click.UsageError("--mlx-path is required")
    extra = {}
    if is_assistant_source(source, options["revision"]):
        graft, what = graft_assistant, "the assistant"
    elif kind := drafter_kind(source, options["revision"]):
        graft, what = graft_drafter, f"the {kind} drafter"
    else:
        graft, what = graft_heads, "MTP heads"
        extra = {"rank_vocab": options.get("rank_vocab", True)}
    out = graft(
        source,
        mlx_path,
        revision=options["revision"],
        head_bits=options["head_bits"] or 8,
        overwrite=options["overwrite"],
        **extra,
    )
    click.echo(f"grafted {what} from {source} onto {out}")


@main.command(short_help="What a conversion holds; its heads against the source.")
@click.argument("path")
@hf_path_option("The source to compare with [the one the conversion records].")
@min_agreement_option()
@TRUST_REMOTE_CODE
@friendly_errors
def check(path, hf_path, min_agreement, trust_remote_code):
    """Report what a conversion holds and test its heads against the source.

    \b
    mlx-mtp check q36-4bit [--hf-path Qwen/Qwen3.6-27B]
    """
    _quiet_transformers()
    _check(path, hf_path, min_agreement, trust_remote_code)


def _check(path, source, min_agreement, trust_remote_code):
    from .convert import check as run

    report = run(
        path,
        source=source,
        threshold=min_agreement,
        trust_remote_code=trust_remote_code,
    )
    for line in report.lines():
        click.echo(line)
    if report.source is not None and not report.passed:
        _fail("the conversion disagrees with its source (see above)")


@main.command("train-heads", short_help="Train MTP heads for a model that has none.")
@model_option(required=True, help="Model folder or repo (trunk to keep frozen).")
@click.option(
    "--data",
    multiple=True,
    help="Text files or folders (.py .rst .txt .md); repeatable.",
)
@click.option(
    "--distill",
    default=None,
    metavar="PROMPTS",
    help="Also train on the model's own replies to PROMPTS: 'builtin' (code and "
    "chat requests shipped with mlx-mtp), or a file with a prompt per line.",
)
@click.option(
    "--distill-samples",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Replies per prompt: the first greedy, the others sampled.",
)
@click.option(
    "--soft-targets",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Weight of the trunk's distribution (KL) beside its greedy token.",
)
@mlx_path_option("Output model folder (trunk + heads).", required=True)
@click.option(
    "--depth",
    type=click.IntRange(1, 8),
    default=2,
    show_default=True,
    help="Draft depths trained (one chained layer).",
)
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@tokens_option(
    least=1,
    default=None,
    help="Training tokens to compute features for, from the text and from the replies "
    "(default: all of it).",
)
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True
)
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(min=2),
    default=8192,
    show_default=True,
    help="The heads are trained to draft from this many tokens, the trunk's most "
    "frequent.",
)
@renamed_option("--draft-vocab", "--draft-vocab-size")
@click.option(
    "--eval-every", type=click.IntRange(min=1), default=100, show_default=True
)
@click.option(
    "--save-every", type=click.IntRange(min=1), default=100, show_default=True
)
@seed_option(default=0, help=None)
@click.option(
    "--init-heads",
    default=None,
    metavar="MODEL",
    help="Start from the heads of MODEL (a folder train-heads wrote for this trunk), "
    "with their draft vocabulary: training goes on, on new or more data.",
)
@click.option(
    "--any-trunk",
    is_flag=True,
    help="With --init-heads: start from heads trained for another trunk (e.g. the "
    "model a fine-tune or another quantization was made from); refused otherwise.",
)
@click.option("--work-dir", default=None, help="Features and checkpoints [OUT.train].")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in the work folder, with its options (a larger --steps "
    "trains longer; --eval-every and --save-every may change).",
)
@OVERWRITE
@TRUST_REMOTE_CODE
@stops_on_signals
@friendly_errors
def train_heads(model, data, mlx_path, **options):
    """Train MTP heads for a model that has none (frozen trunk, self-distillation)."""
    from dataclasses import fields

    from .convert.train_heads import TrainConfig
    from .convert.train_heads import train_heads as run
    from .fast_blas import describe

    _quiet_transformers()
    names = [f.name for f in fields(TrainConfig)]
    cfg = TrainConfig(**{k: options.pop(k) for k in names if k in options})
    if not data and not cfg.distill:
        raise click.UsageError("give --data, --distill, or both")
    if options["any_trunk"] and not cfg.init_heads:
        raise click.UsageError("--any-trunk goes with --init-heads")
    click.echo(f"BLAS: {describe()}")
    click.echo(f"wrote {run(model, list(data), mlx_path, cfg, **options)}")


@main.command(short_help="An OpenAI- and Anthropic-compatible server, with MTP.")
@MODEL
@DRAFT_MODEL
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--api-key",
    multiple=True,
    help="Require 'Authorization: Bearer KEY' (all endpoints but /health); give one "
    "key per client, repeating the option, to keep each one's prompt cache to itself "
    "[default: $MLX_MTP_API_KEY, comma-separated, else none].",
)
@click.option(
    "--allowed-origins",
    multiple=True,
    metavar="ORIGIN",
    help="Let web pages from ORIGIN (e.g. https://app.example.com; '*' for any) "
    "call the server; repeatable [default: pages of this machine only].",
)
@click.option(
    "--timeout",
    "request_timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds a client has to send its request, and may leave the reply unread.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Connections open at once; one more gets a 503.",
)
@sampling_options
@max_tokens_option(
    SERVER_MAX_TOKENS, "Tokens per reply when a request does not say", unlimited=False
)
@click.option(
    "--max-tokens-limit",
    type=click.IntRange(min=1),
    default=32768,
    show_default=True,
    help="The most a request may ask for.",
)
@click.option(
    "--prompt-cache-size",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Conversations whose caches are kept for prompt reuse.",
)
@click.option(
    "--prompt-cache-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Bound the kept conversations' cache memory [a quarter of the memory the "
    "weights leave].",
)
@click.option(
    "--prompt-cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep conversations on disk here too (those the memory drops, and all of "
    "them when the server stops): a restarted server goes on from them.",
)
@click.option(
    "--prompt-cache-disk-bytes",
    type=click.IntRange(min=1),
    default=10 * 10**9,
    show_default=True,
    help="Bound the conversations kept on disk (the least recently used go first).",
)
@max_batch_option("Requests decoded together at most; others wait for a free row.")
@click.option(
    "--batch-cache-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="Bound the decoding requests' cache memory (each row as wide as the "
    "longest prompt + max_tokens; a request that cannot fit alone is a 400) [half "
    "the memory the weights leave].",
)
@ALLOW_MISSING_HEADS
@FORCE
@click.option(
    "--chat-template-args",
    default="{}",
    help="JSON object passed to the chat template "
    "(e.g. '{\"enable_thinking\": false}').",
)
@TRUST_REMOTE_CODE
@friendly_errors
def serve(model, chat_template_args, **options):
    """Serve the model: OpenAI's chat, completions and Responses APIs, Anthropic's
    Messages API (streaming or not), and a chat page at http://HOST:PORT/.

    \b
    mlx-mtp serve --model Qwen/Qwen3.6-27B-4bit
    curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    import json
    import signal

    from .errors import MTPError
    from .server import Server, server_args

    _quiet_transformers()
    try:
        template_args = json.loads(chat_template_args)
    except ValueError as e:
        raise MTPError(f"--chat-template-args is not JSON: {e}") from None
    if not isinstance(template_args, dict):
        raise MTPError("--chat-template-args must be a JSON object")
    if model is None:
        from .demo import demo_model

        model = str(demo_model())
    if not options["api_key"]:
        options.pop("api_key")
    args = server_args(model=model, chat_template_args=template_args, **options)
    server = Server(args)
    click.echo(f"serving {model} at {server.url} (Ctrl-C to stop)", err=True)
    signum = server.serve_forever()  # streams ended, generation joined
    if signum is None:
        return
    click.echo(
        "\ninterrupted" if signum == signal.SIGINT else "stopped serving", err=True
    )
    _exit_now(130 if signum == signal.SIGINT else 0)


def _exit_now(code: int) -> None:
    """Exit with ``code`` once everything is written, skipping the interpreter's
    teardown: after a server's threads ran MLX, freeing what they left at exit can
    abort the process ("terminate called without an active exception", exit 134)."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@main.command(short_help="The models on this machine, and whether they fit.")
@click.argument("folders", nargs=-1, type=click.Path(file_okay=False))
@click.option(
    "--hub/--no-hub",
    default=True,
    show_default=True,
    help="Include the Hugging Face cache.",
)
@output_option("Also write the list here (JSON).")
@friendly_errors
def models(folders, hub, output):
    """The models in mlx-mtp's folder, the Hugging Face cache and FOLDERS (each a
    model, or a folder of models): type, size, quantization, what each drafts with,
    and whether its weights fit the memory MLX can use here
    ($MLX_MTP_MEMORY_LIMIT, else the machine's). Nothing is loaded.

    \b
    mlx-mtp models ~/models
    """
    from pathlib import Path

    from . import inventory
    from .memory import memory_limit, readable_size

    if output:
        _check_writable(output)
    entries = inventory.scan([Path(f) for f in folders], hub=hub)
    click.echo(inventory.table(entries))
    limit, source = memory_limit()
    click.echo(f"\nMLX can use {readable_size(limit)} here ({source}).")
    if output:
        Path(output).write_text(inventory.as_json(entries) + "\n")


@main.command(short_help="Speed against mlx-lm plain decoding.")
@MODEL
@tokens_option(
    least=16, default=128, help="Tokens per run (at least 16: fewer cannot be timed)."
)
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True)
@num_draft_tokens_option(multiple=True)
@temp_option(multiple=True)
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(
        ["code", "chat", "prose", "code-edit", "summarise", "adversarial"]
    ),
)
@draft_source_option(multiple=True)
@draft_vocab_option(multiple=True)
@output_option("Also write the results here (JSON).")
@deprecated_option("--json", "--output", "output")
@DRAFT_MODEL
@TRUST_REMOTE_CODE
@FORCE
@friendly_errors
def bench(
    model,
    tokens,
    reps,
    num_draft_tokens,
    temp,
    workloads,
    draft_source,
    draft_vocab,
    output,
    draft_model,
    trust_remote_code,
    force,
):
    """Speed against mlx-lm plain decoding, interleaved in one process (see
    scripts/bench.py for CPU timing with a fast BLAS)."""
    import json

    import mlx.core as mx

    from .bench import bench as run
    from .loading import load

    _quiet_transformers()
    if output:
        _check_writable(output)
    if model is None:
        from .demo import demo_model

        model = str(demo_model())
    click.echo(f"device {mx.default_device()}; model {model}")
    mdl, tokenizer = load(
        model,
        allow_missing_heads=True,
        trust_remote_code=trust_remote_code,
        draft_model=draft_model,
        force=force,
    )
    result = run(
        mdl,
        tokenizer,
        ks=num_draft_tokens,
        temps=temp,
        tokens=tokens,
        reps=reps,
        workloads=workloads or None,
        sources=draft_source,
        vocabs=draft_vocab or (None,),
        log=click.echo,
    )
    if output:
        with open(output, "w") as f:
            json.dump(result, f, indent=2)


def _check_writable(path: str) -> None:
    """Refuse now, not after a long run, a results file that cannot be written."""
    import os

    from .errors import MTPError

    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise MTPError(f"cannot write {path}: {e.strerror}") from None
    if not existed:
        os.remove(path)

"""The ``mlx-mtp`` command line: thin commands that parse, call the library and print.

Every user error ends as one line on stderr and a non-zero exit; Ctrl-C stops cleanly.
"""

import functools
import sys

import click

DEFAULT_MAX_TOKENS = 256


def _fail(message: str, code: int = 1):
    click.echo(f"mlx-mtp: error: {message}", err=True)
    sys.exit(code)


def friendly_errors(fn):
    """Turn user errors into one line and an exit code; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .errors import MTPError

        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)
        except MTPError as e:
            _fail(str(e))
        except (OSError, ValueError) as e:
            _fail(str(e).strip().splitlines()[0] if str(e).strip() else repr(e))

    return wrapper


def _quiet_transformers():
    """Silence transformers' notes about model types it does not know (tokenizers load
    fine); mlx-mtp prints its own warnings."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlx-mtp")
def main():
    """Multi-token-prediction speculative decoding for MLX."""


class DraftLength(click.ParamType):
    """``auto`` or a non-negative integer."""

    name = "auto|K"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            k = int(value)
        except ValueError:
            k = -1
        if k < 0:
            self.fail(f"{value!r} is not 'auto' or an integer >= 0", param, ctx)
        return k


def build_prompt(tokenizer, prompt: str, system_prompt, ignore_chat_template: bool):
    """Token ids of the prompt, with the chat template applied as mlx-lm does."""
    from .errors import MTPError

    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not prompt.strip():
        raise MTPError("the prompt is empty")
    use_template = not ignore_chat_template and tokenizer.has_chat_template
    if use_template:
        messages = (
            [{"role": "system", "content": system_prompt}] if system_prompt else []
        )
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    return tokenizer.encode(prompt, add_special_tokens=not use_template)


def decode_options(fn):
    """Drafting, sampling and KV-cache options shared by ``generate`` and ``chat``."""
    options = [
        click.option(
            "--num-draft-tokens",
            "-k",
            type=DraftLength(),
            default="auto",
            show_default=True,
            help="MTP drafts per round (0: plain decoding; auto: the fastest k, "
            "each round).",
        ),
        click.option(
            "--max-draft-tokens",
            type=click.IntRange(0, 16),
            default=4,
            show_default=True,
            help="The largest k that auto picks.",
        ),
        click.option(
            "--temp", type=click.FloatRange(min=0), default=0.0, show_default=True
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=1.0,
            show_default=True,
        ),
        click.option(
            "--top-k", type=click.IntRange(min=0), default=0, show_default=True
        ),
        click.option(
            "--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True
        ),
        click.option(
            "--seed", type=int, default=None, help="Seed for reproducible sampling."
        ),
        click.option(
            "--kv-bits",
            type=click.Choice(["2", "3", "4", "6", "8"]),
            default=None,
            help="Quantize the KV cache to this many bits.",
        ),
        click.option(
            "--kv-group-size",
            type=click.IntRange(min=1),
            default=64,
            show_default=True,
        ),
        click.option(
            "--quantized-kv-start",
            type=click.IntRange(min=0),
            default=5000,
            show_default=True,
            help="Positions before the KV cache is quantized.",
        ),
        click.option("--system-prompt", default=None),
        click.option(
            "--allow-missing-heads",
            is_flag=True,
            help="Decode without MTP when the heads are missing.",
        ),
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


def _decode_kwargs(options: dict) -> dict:
    """`stream_generate` keyword arguments from the shared options."""
    keys = (
        "num_draft_tokens",
        "max_draft_tokens",
        "temp",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "kv_group_size",
        "quantized_kv_start",
    )
    out = {k: options[k] for k in keys}
    out["kv_bits"] = None if options["kv_bits"] is None else int(options["kv_bits"])
    return out


def _load_for_decoding(model, allow_missing_heads):
    from .loading import load

    _quiet_transformers()
    if model is None:
        from .demo import demo_model

        model = str(demo_model())
    return load(model, allow_missing_heads=allow_missing_heads)


MODEL_HELP = "Model folder or Hugging Face repo [default: the built-in demo model]."


@main.command()
@click.option("--model", default=None, help=MODEL_HELP)
@click.option(
    "--prompt",
    "-p",
    default="-",
    show_default=True,
    help="Prompt text; '-' reads stdin.",
)
@click.option(
    "--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, show_default=True
)
@click.option(
    "--max-kv-size",
    type=click.IntRange(min=1),
    default=None,
    help="Rotating KV window (plain decoding only: -k 0).",
)
@click.option("--ignore-chat-template", is_flag=True)
@decode_options
@friendly_errors
def generate(model, prompt, max_tokens, max_kv_size, ignore_chat_template, **options):
    """Generate text from a prompt, drafting with the model's MTP heads."""
    from .generate import format_stats, stream_generate

    if prompt == "-":
        prompt = sys.stdin.read()
    mdl, tokenizer = _load_for_decoding(model, options["allow_missing_heads"])
    ids = build_prompt(
        tokenizer, prompt, options["system_prompt"], ignore_chat_template
    )
    response = None
    try:
        for response in stream_generate(
            mdl,
            tokenizer,
            ids,
            max_tokens,
            max_kv_size=max_kv_size,
            **_decode_kwargs(options),
        ):
            click.echo(response.text, nl=False)
    finally:
        if response is not None:
            click.echo()
            if options["verbose"]:
                click.echo(format_stats(response), err=True)


@main.command()
@click.option("--model", default=None, help=MODEL_HELP)
@click.option(
    "--max-tokens",
    "-m",
    type=int,
    default=1024,
    show_default=True,
    help="Tokens per reply at most.",
)
@decode_options
@friendly_errors
def chat(model, max_tokens, **options):
    """Chat in the terminal. Ctrl-C stops a reply; /reset starts over; /exit or Ctrl-D
    quits. The conversation's caches are kept between turns."""
    from .errors import MTPError
    from .generate import format_stats, stream_generate
    from .speculative import Session

    mdl, tokenizer = _load_for_decoding(model, options["allow_missing_heads"])
    if not tokenizer.has_chat_template:
        raise MTPError("this model's tokenizer has no chat template: use generate")
    system = options["system_prompt"]
    start = [{"role": "system", "content": system}] if system else []
    messages, session = list(start), Session()
    click.echo("mlx-mtp chat: /reset to start over, /exit or Ctrl-D to quit", err=True)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            click.echo()
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            messages, session = list(start), Session()
            continue
        messages.append({"role": "user", "content": line})
        ids, session = _next_turn(tokenizer, messages, session)
        reply, response, replies = "", None, None
        try:
            replies = stream_generate(
                mdl,
                tokenizer,
                ids,
                max_tokens,
                session=session,
                **_decode_kwargs(options),
            )
            for response in replies:
                click.echo(response.text, nl=False)
                reply += response.text
        except KeyboardInterrupt:
            session = Session()  # stopped at any point: rebuild from the text
        except MTPError as e:
            click.echo(f"mlx-mtp: error: {e}", err=True)
            messages.pop()
            session = Session()
            continue
        finally:
            if replies is not None:
                replies.close()
        click.echo()
        if options["verbose"] and response is not None:
            click.echo(format_stats(response), err=True)
        messages.append({"role": "assistant", "content": reply})


def _next_turn(tokenizer, messages, session):
    """Token ids to feed for the conversation so far, and the session to feed them to:
    the new tokens only when the session's tokens begin the rendered conversation,
    otherwise all of them and a new session."""
    from .speculative import Session

    ids = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(ids, add_special_tokens=False)
    held = session.tokens
    if held and len(ids) > len(held) and ids[: len(held)] == held:
        return ids[len(held) :], session
    return ids, Session()


@main.command()
@click.option("--hf-path", help="Hugging Face checkpoint to convert (folder or repo).")
@click.option(
    "--mlx-path",
    help="Output folder (or, with --graft-heads-from, the "
    "existing MLX conversion to add heads to).",
)
@click.option("-q", "--quantize", is_flag=True, help="Quantize the trunk.")
@click.option(
    "--q-bits",
    type=click.Choice(["2", "3", "4", "5", "6", "8"]),
    default=None,
    help="Trunk bits (default 4).",
)
@click.option("--q-group-size", type=click.Choice(["32", "64", "128"]), default=None)
@click.option(
    "--q-mode",
    type=click.Choice(["affine", "mxfp4", "nvfp4", "mxfp8"]),
    default="affine",
    show_default=True,
)
@click.option(
    "--head-bits",
    type=click.Choice(["4", "8", "16"]),
    default=None,
    help="MTP head precision; 16 keeps the float dtype. [default: 8 with -q, "
    "else 16]",
)
@click.option(
    "--dtype",
    type=click.Choice(["float16", "bfloat16", "float32"]),
    default=None,
    help="Dtype of unquantized parameters (default: the checkpoint's).",
)
@click.option("--revision", default=None, help="Hub revision of the source.")
@click.option("--upload-repo", default=None, help="Upload the result to this hub repo.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option(
    "--require-heads",
    is_flag=True,
    help="Refuse a checkpoint without MTP tensors instead of warning.",
)
@click.option(
    "--graft-heads-from",
    "graft_from",
    default=None,
    help="Add MTP heads from this HF checkpoint to the conversion at --mlx-path.",
)
@click.option(
    "--check",
    "check_path",
    default=None,
    help="Report on a conversion and test its heads against the source.",
)
@click.option(
    "--min-agreement",
    type=click.FloatRange(0, 1),
    default=0.9,
    show_default=True,
    help="--check: least top-1 agreement of each head with the source's.",
)
@friendly_errors
def convert(
    hf_path,
    mlx_path,
    quantize,
    q_bits,
    q_group_size,
    q_mode,
    head_bits,
    dtype,
    revision,
    upload_repo,
    overwrite,
    require_heads,
    graft_from,
    check_path,
    min_agreement,
):
    """Convert a Hugging Face checkpoint to MLX, keeping its MTP heads.

    \b
    mlx-mtp convert --hf-path Qwen/Qwen3.6-27B --mlx-path q36-4bit -q
    mlx-mtp convert --graft-heads-from Qwen/Qwen3.6-27B --mlx-path EXISTING_MLX_FOLDER
    mlx-mtp convert --check q36-4bit
    """
    _quiet_transformers()
    modes = [bool(hf_path), bool(graft_from), bool(check_path)]
    if sum(modes) != 1:
        raise click.UsageError(
            "give exactly one of --hf-path, --graft-heads-from or --check"
        )
    if check_path:
        return _check(check_path, hf_path, min_agreement)
    if not mlx_path:
        raise click.UsageError("--mlx-path is required")
    bits = int(head_bits) if head_bits else None
    if graft_from:
        from convert import graft_heads

        out = graft_heads(
            graft_from,
            mlx_path,
            revision=revision,
            head_bits=bits or 8,
            overwrite=overwrite,
        )
        click.echo(f"grafted MTP heads from {graft_from} onto {out}")
        return
    from convert import convert as run_convert

    out = run_convert(
        hf_path,
        mlx_path,
        quantize=quantize,
        q_bits=int(q_bits) if q_bits else None,
        q_group_size=int(q_group_size) if q_group_size else None,
        q_mode=q_mode,
        head_bits=bits,
        dtype=dtype,
        revision=revision,
        overwrite=overwrite,
        require_heads=require_heads,
        upload_repo=upload_repo,
    )
    click.echo(f"wrote {out}")


def _check(path, source, min_agreement):
    from convert import check

    report = check(path, source=source, threshold=min_agreement)
    for line in report.lines():
        click.echo(line)
    if report.source is not None and not report.passed:
        _fail("MTP heads disagree with the source (see above)")


@main.command("train-heads")
@click.option(
    "--model", required=True, help="Model folder or repo (trunk to keep frozen)."
)
@click.option(
    "--data",
    required=True,
    multiple=True,
    help="Text files or folders (.py .rst .txt .md); repeatable.",
)
@click.option("--mlx-path", required=True, help="Output model folder (trunk + heads).")
@click.option(
    "--depth",
    type=click.IntRange(1, 8),
    default=2,
    show_default=True,
    help="Draft depths trained (one chained layer).",
)
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option(
    "--tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Training tokens to compute features for (default: all the data).",
)
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=2),
    default=8192,
    show_default=True,
    help="Draft from the most frequent trunk tokens only.",
)
@click.option(
    "--eval-every", type=click.IntRange(min=1), default=100, show_default=True
)
@click.option(
    "--save-every", type=click.IntRange(min=1), default=100, show_default=True
)
@click.option("--work-dir", default=None, help="Features and checkpoints [OUT.train].")
@click.option("--resume", is_flag=True, help="Continue the run in the work folder.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--seed", type=int, default=0, show_default=True)
@friendly_errors
def train_heads(
    model,
    data,
    mlx_path,
    depth,
    steps,
    tokens,
    seq_len,
    batch_size,
    lr,
    draft_vocab,
    eval_every,
    save_every,
    work_dir,
    resume,
    overwrite,
    seed,
):
    """Train MTP heads for a model that has none (frozen trunk, self-distillation)."""
    from convert.train_heads import TrainConfig
    from convert.train_heads import train_heads as run

    _quiet_transformers()
    cfg = TrainConfig(
        depth=depth,
        seq_len=seq_len,
        batch_size=batch_size,
        steps=steps,
        tokens=tokens,
        lr=lr,
        draft_vocab=draft_vocab,
        eval_every=eval_every,
        save_every=save_every,
        seed=seed,
    )
    out = run(
        model,
        list(data),
        mlx_path,
        cfg,
        work_dir=work_dir,
        resume=resume,
        overwrite=overwrite,
    )
    click.echo(f"wrote {out}")


@main.command()
@click.option(
    "--model",
    default=None,
    help="Model folder or Hugging Face repo [the demo model].",
)
@click.option("--tokens", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "-k",
    "--num-draft-tokens",
    "ks",
    type=DraftLength(),
    multiple=True,
    default=(0, 1, 2, 3, 4, "auto"),
    show_default=True,
)
@click.option(
    "--temp",
    "temps",
    type=click.FloatRange(min=0),
    multiple=True,
    default=(0.0, 0.7),
    show_default=True,
)
@click.option(
    "--workload",
    "workloads",
    multiple=True,
    type=click.Choice(["code", "chat", "prose", "adversarial"]),
)
@click.option("--json", "json_path", default=None, help="Also write the results here.")
@friendly_errors
def bench(model, tokens, reps, ks, temps, workloads, json_path):
    """Speed against mlx-lm plain decoding, interleaved in one process (see
    scripts/bench.py for CPU timing with a fast BLAS)."""
    import json

    import mlx.core as mx

    from .bench import bench as run
    from .loading import load

    _quiet_transformers()
    if model is None:
        from .demo import demo_model

        model = str(demo_model())
    click.echo(f"device {mx.default_device()}; model {model}")
    mdl, tokenizer = load(model, allow_missing_heads=True)
    result = run(
        mdl,
        tokenizer,
        ks=ks,
        temps=temps,
        tokens=tokens,
        reps=reps,
        workloads=workloads or None,
        log=click.echo,
    )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)

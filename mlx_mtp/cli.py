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


@main.command()
@click.option("--model", required=True, help="Model folder or Hugging Face repo.")
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
    "--num-draft-tokens",
    "-k",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="MTP drafts per round (0: plain decoding).",
)
@click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@click.option(
    "--max-kv-size",
    type=click.IntRange(min=1),
    default=None,
    help="Rotating KV window (plain decoding only: -k 0).",
)
@click.option(
    "--kv-bits",
    type=click.Choice(["2", "3", "4", "6", "8"]),
    default=None,
    help="Quantize the KV cache to this many bits.",
)
@click.option(
    "--kv-group-size", type=click.IntRange(min=1), default=64, show_default=True
)
@click.option(
    "--quantized-kv-start",
    type=click.IntRange(min=0),
    default=5000,
    show_default=True,
    help="Positions before the KV cache is quantized.",
)
@click.option("--system-prompt", default=None)
@click.option("--ignore-chat-template", is_flag=True)
@click.option(
    "--allow-missing-heads",
    is_flag=True,
    help="Decode without MTP when the heads are missing.",
)
@click.option(
    "--verbose/--quiet", default=True, show_default=True, help="Print the stats line."
)
@friendly_errors
def generate(
    model,
    prompt,
    max_tokens,
    num_draft_tokens,
    temp,
    top_p,
    top_k,
    min_p,
    seed,
    max_kv_size,
    kv_bits,
    kv_group_size,
    quantized_kv_start,
    system_prompt,
    ignore_chat_template,
    allow_missing_heads,
    verbose,
):
    """Generate text from a prompt, drafting with the model's MTP heads."""
    from .generate import format_stats, stream_generate
    from .loading import load

    _quiet_transformers()
    if prompt == "-":
        prompt = sys.stdin.read()
    mdl, tokenizer = load(model, allow_missing_heads=allow_missing_heads)
    ids = build_prompt(tokenizer, prompt, system_prompt, ignore_chat_template)
    response = None
    try:
        for response in stream_generate(
            mdl,
            tokenizer,
            ids,
            max_tokens,
            num_draft_tokens=num_draft_tokens,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            max_kv_size=max_kv_size,
            kv_bits=None if kv_bits is None else int(kv_bits),
            kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start,
        ):
            click.echo(response.text, nl=False)
    finally:
        if response is not None:
            click.echo()
            if verbose:
                click.echo(format_stats(response), err=True)

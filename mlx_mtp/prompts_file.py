"""``mlx-mtp generate --prompts-file``: the file of prompts read and checked, and the
results written, one JSON object per prompt.

The file holds one prompt a line (plain text; blank lines skipped; the text is taken
as it is, ``\\n`` included), or JSONL when every non-blank line is a JSON object:
``prompt`` (text) or ``messages`` (a chat), optional ``id``, and any `DecodeOptions`
field (``max_tokens``, ``temp``, ``num_draft_tokens``, ``logit_bias``, ...) for
that prompt alone, or ``json_schema`` / ``json_object`` / ``regex`` for its grammar.
Everything is checked before a model loads: a bad line is a `PromptsFileError`
naming it.
"""

import difflib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Union

from .errors import MTPError, one_line
from .options import DecodeOptions

KEYS = ("prompt", "messages", "id")  # a JSONL line's keys besides the options
GRAMMAR_KEYS = ("json_schema", "json_object", "regex")  # for the grammar option


class PromptsFileError(MTPError):
    """The prompts file cannot be used as it is (a usage error: exit 2)."""


@dataclass(frozen=True)
class FilePrompt:
    """One prompt of the file: its 1-based ``line``, ``id`` (given, or the line's
    0-based index), ``prompt`` as given (text, or the messages of a chat) and the
    decode ``options`` the line sets (none for plain text)."""

    line: int
    id: Any
    prompt: Union[str, list]
    options: dict

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def read(path: str) -> str:
    """The text of the file ``path`` ('-': stdin), without a byte-order mark; bytes
    that are not UTF-8 are a `PromptsFileError` naming the line."""
    if path != "-":
        data = Path(path).read_bytes()
    elif hasattr(sys.stdin, "buffer"):
        data = sys.stdin.buffer.read()
    else:
        return sys.stdin.read()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        byte = f"byte 0x{data[e.start]:02x}"
        raise PromptsFileError(
            f"{source_name(path)} line {line}: not valid UTF-8 ({byte})"
        ) from None


def parse(text: str, path: str = "-") -> List[FilePrompt]:
    """The prompts of a file's ``text``, in order (``path`` names it in errors).

    Raises:
        PromptsFileError: no prompt at all; a JSONL line that is not an object or
            whose keys or values are wrong (naming the line and the key).
    """
    where = source_name(path)
    lines = [
        (i, line.removesuffix("\r"))
        for i, line in enumerate(text.split("\n"))
        if line.strip()
    ]
    if not lines:
        raise PromptsFileError(f"{where} has no prompts (it is empty)")
    objects = [_object(line) for _, line in lines]
    if objects[0] is None:
        return [FilePrompt(i + 1, i, line, {}) for i, line in lines]
    prompts = []
    for (i, line), obj in zip(lines, objects):
        if obj is None:
            raise PromptsFileError(
                f"{where} line {i + 1}: not a JSON object, but line {lines[0][0] + 1}"
                " is (a JSONL file has one object a line)"
            )
        prompts.append(_json_prompt(obj, i, f"{where} line {i + 1}"))
    return prompts


def decode_options(prompts: List[FilePrompt], base: DecodeOptions, path: str = "-"):
    """Each prompt's checked `DecodeOptions`: ``base`` (the command line's) with the
    line's options; a bad value is a `PromptsFileError` naming the line and key."""
    out = []
    for p in prompts:
        where = f"{source_name(path)} line {p.line}"
        options = _translated(p.options, where)
        for key, value in options.items():
            _check_value(base, key, value, where)
        try:
            out.append(base.replace(**options).check())
        except MTPError as e:
            raise PromptsFileError(f"{where}: {one_line(e)}") from None
    return out


def _translated(options: dict, where: str) -> dict:
    """A line's options with its `GRAMMAR_KEYS` as the ``grammar`` option and the
    JSON keys of ``logit_bias`` (text) as token ids."""
    from .grammar import grammar_fields

    options = dict(options)
    bias = options.get("logit_bias")
    if isinstance(bias, dict):
        try:
            options["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise PromptsFileError(
                f"{where}: logit_bias keys must be token ids"
            ) from None
    if "grammar" in options:
        raise PromptsFileError(
            f"{where}: give json_schema, json_object or regex, not grammar"
        )
    try:
        return grammar_fields(options)
    except MTPError as e:
        raise PromptsFileError(f"{where}: {one_line(e)}") from None


def source_name(path: str) -> str:
    """How errors name the file ``path``."""
    return "stdin" if path == "-" else str(path)


def _object(line: str) -> Optional[dict]:
    """The line's JSON object, or None when it is not one."""
    if not line.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _json_prompt(obj: dict, index: int, where: str) -> FilePrompt:
    names = DecodeOptions.names() + GRAMMAR_KEYS
    for key in obj:
        if key not in KEYS and key not in names:
            close = difflib.get_close_matches(key, KEYS + names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PromptsFileError(f"{where}: unknown key {key!r}{hint}")
    if ("prompt" in obj) == ("messages" in obj):
        raise PromptsFileError(f"{where}: give either 'prompt' or 'messages'")
    prompt = obj["prompt"] if "prompt" in obj else obj["messages"]
    if "prompt" in obj and not (isinstance(prompt, str) and prompt.strip()):
        raise PromptsFileError(f"{where}: 'prompt' must be non-empty text")
    if "messages" in obj and not _is_chat(prompt):
        raise PromptsFileError(
            f"{where}: 'messages' must be a non-empty list of objects with a "
            "'role' (text)"
        )
    id_ = obj.get("id", index)
    if isinstance(id_, bool) or not isinstance(id_, (str, int)):
        raise PromptsFileError(f"{where}: 'id' must be text or an integer")
    options = {k: v for k, v in obj.items() if k not in KEYS}
    return FilePrompt(index + 1, id_, prompt, options)


def _is_chat(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        )
    )


def _check_value(base: DecodeOptions, key: str, value, where: str) -> None:
    """Refuse ``value`` for option ``key`` in a message naming both. No option is a
    flag, so true/false is never a value; ``draft_vocab`` takes what the CLI's
    ``--draft-vocab`` takes."""
    message = None
    if isinstance(value, bool):
        message = f"{key} must not be {json.dumps(value)}"
    elif key == "draft_vocab" and not (
        value in ("auto", "full", None) or _whole(value)
    ):
        message = "draft_vocab must be 'auto', 'full' or a positive number of tokens"
    else:
        try:
            base.replace(**{key: value}).check()
        except MTPError as e:
            message = one_line(e)
    if message is not None:
        named = message if message.startswith(key) else f"{key}: {message}"
        raise PromptsFileError(f"{where}: {named}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def record(prompt: FilePrompt, ids: List[int], text: str, response, i: int) -> dict:
    """The result line of prompt ``i`` of a `mlx_mtp.generate.BatchResponse`."""
    stats, finish = response.mtp[i], response.finish_reasons[i]
    return {
        "id": prompt.id,
        "prompt": prompt.prompt,
        "text": text,
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "generation_tokens": len(response.token_ids[i]) + (finish == "stop"),
        "mtp": {
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_round": round(stats.tokens_per_round, 4),
            "batch_sizes": {
                str(b): n for b, n in sorted(response.batch_sizes[i].items())
            },
        },
    }


def write(records: List[dict], output: Optional[str]) -> None:
    """The records as JSONL to ``output`` (None or '-': stdout). A file is written
    under a temporary name beside it, then renamed: an interrupted run leaves the
    old file (or none), never half of one."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output is None or output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_output(output: Optional[str]) -> None:
    """Refuse, before anything runs, an ``output`` that cannot be written: its
    folder missing or read-only, or a folder in its place."""
    if output is None or output == "-":
        return
    path = Path(output)
    folder = path.parent
    if path.is_dir():
        raise PromptsFileError(f"--output {output} is a folder")
    if not folder.is_dir():
        raise PromptsFileError(f"--output {output}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PromptsFileError(f"--output {output}: the folder is not writable")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Progress:
    """The single updating line of a batch run on stderr (when ``show``): prompts
    completed of ``total``, tokens generated, tok/s. Called with each
    `mlx_mtp.batch.RowOutput`, it redraws at most every ``every`` seconds; as a
    context manager it ends its line on leaving, unless by Ctrl-C (whose own line
    ends it)."""

    def __init__(self, total: int, show: bool = True, every: float = 0.1, stream=None):
        self.total, self.done, self.tokens, self.show = total, 0, 0, show
        self.stream = stream if stream is not None else sys.stderr
        self.every, self.start, self.drawn = every, time.perf_counter(), 0.0
        self.width = 0

    def __call__(self, out) -> None:
        self.tokens += len(out.tokens)
        self.done += out.finish_reason is not None
        now = time.perf_counter()
        if self.show and (now - self.drawn >= self.every or self.done == self.total):
            self.drawn = now
            line = self.line(now - self.start)
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line.ljust(self.width))
            self.stream.flush()

    def line(self, seconds: float) -> str:
        tps = self.tokens / seconds if seconds > 0 else 0.0
        return f"{self.done}/{self.total} prompts | {self.tokens} tok | {tps:.1f} tok/s"

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self.drawn and kind is not KeyboardInterrupt:
            self.stream.write("\n")
            self.stream.flush()


def detokenize(tokenizer, tokens: List[int]) -> str:
    """The text of ``tokens`` as `mlx_mtp.generate` streams it (its detokenizer, so
    the same text as a lone generation, e.g. without a leading space)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


def summary(response) -> str:
    """One line for the end of a run: prompts, tokens, seconds, tok/s, acceptance."""
    drafted = sum(s.drafted for s in response.mtp)
    accepted = sum(s.accepted for s in response.mtp)
    line = (
        f"{len(response.texts)} prompts | generated {response.generation_tokens} tok "
        f"in {response.seconds:.1f} s @ {response.generation_tps:.1f} tok/s | "
        f"peak {response.peak_memory:.2f} GB"
    )
    if not drafted:
        return line + " | no drafts (plain decoding)"
    return line + f" | accepted {accepted}/{drafted} ({accepted / drafted:.2f})"

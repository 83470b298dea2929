"""``mlx-mtp generate --prompts-file``: the file of prompts read and checked, and the
results written as they finish, one JSON object per prompt.

The file holds one prompt a line (plain text; blank lines skipped; the text is taken
as it is, ``\\n`` included), or JSONL: one JSON object a line, ``prompt`` (text) or
``messages`` (a chat, checked as the server checks one, ``image_url`` parts with
``data:`` URLs included), optional ``id``, optional ``images`` (image files asked
about in ``prompt``; relative paths from the file's folder), and any
`DecodeOptions` field (``max_tokens``, ``temp``, ``num_draft_tokens``,
``logit_bias``, ...) for that prompt alone, or ``json_schema`` / ``json_object`` /
``regex`` for its grammar. A prompt's images (for a model that reads them) are read
and sized before decoding, and go through the vision tower when the prompt joins
the batch. A file is JSONL when its first line starts with ``{`` or
any line is a JSON object; every line must then be one. Everything is checked before
a model loads: a bad line is a `PromptsFileError` naming it.

Each result names its prompt by ``id`` and ``line`` (the prompt's line in the file,
from 1). Results go to stdout in the file's order, each as soon as it and all before
it are done; or to ``--output FILE`` (`ResultsFile`) each as soon as it is done, the
file put in the file's order once every prompt has its result. A rerun with the same
``--output`` goes on from there.
"""

import difflib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .errors import MTPError, one_line
from .options import DecodeOptions

KEYS = ("prompt", "messages", "id", "images")  # a JSONL line's keys besides options
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
    images: Tuple[str, ...] = ()

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
    """The prompts of a file's ``text``, in order (``path`` names it in errors): JSONL
    when the first line starts with ``{`` or any line is a JSON object, else plain
    text.

    Raises:
        PromptsFileError: no prompt at all; a line of a JSONL file that is not a JSON
            object (saying why the file is JSONL) or whose keys or values are wrong
            (naming the line and the key).
    """
    where = source_name(path)
    lines = [
        (i, line.removesuffix("\r"))
        for i, line in enumerate(text.split("\n"))
        if line.strip()
    ]
    if not lines:
        raise PromptsFileError(f"{where} has no prompts (it is empty)")
    parsed = [_object(line) for _, line in lines]
    first = next((n for n, (obj, _) in enumerate(parsed) if obj is not None), None)
    if first is None and not lines[0][1].lstrip().startswith("{"):
        return [FilePrompt(i + 1, i, line, {}) for i, line in lines]
    prompts = []
    for (i, line), (obj, why) in zip(lines, parsed):
        if obj is None:
            if first is None:
                because = (
                    "; a file whose first line starts with '{' is JSONL, one object "
                    "a line (a plain-text prompt that starts with '{' can be given "
                    'as {"prompt": ...})'
                )
            else:
                because = (
                    f", but line {lines[first][0] + 1} is (a JSONL file has one "
                    "object a line)"
                )
            raise PromptsFileError(
                f"{where} line {i + 1}: not a JSON object{why}{because}"
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
            out.append(base.replace(**options))
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


def _object(line: str) -> Tuple[Optional[dict], str]:
    """The line's JSON object, or None and why not (" (...)", or "" for a line that
    does not start with ``{``)."""
    if not line.lstrip().startswith("{"):
        return None, ""
    try:
        value = json.loads(line)
    except RecursionError:
        return None, " (it nests too deeply)"
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError):
            return None, f" ({e.msg} at column {e.colno})"
        return None, f" ({one_line(e)})"
    return value, ""


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
    if "messages" in obj:
        _check_chat(prompt, where)
    id_ = obj.get("id", index)
    if isinstance(id_, bool) or not isinstance(id_, (str, int)):
        raise PromptsFileError(f"{where}: 'id' must be text or an integer")
    options = {k: v for k, v in obj.items() if k not in KEYS}
    return FilePrompt(index + 1, id_, prompt, options, _images(obj, where))


def _images(obj: dict, where: str) -> Tuple[str, ...]:
    """A line's ``images``: paths of image files (relative ones from the prompts
    file's folder, `image_paths`), placed before its ``prompt`` text."""
    images = obj.get("images", [])
    if not isinstance(images, list) or not all(
        isinstance(p, str) and p.strip() for p in images
    ):
        raise PromptsFileError(f"{where}: 'images' must be a list of file paths")
    if images and "prompt" not in obj:
        raise PromptsFileError(f"{where}: 'images' go with a 'prompt' (text)")
    return tuple(images)


def image_paths(prompt: FilePrompt, path: str) -> List[Path]:
    """The image files of ``prompt``, relative paths taken from the folder of the
    prompts file ``path`` (stdin: the working directory).

    Raises:
        PromptsFileError: one is not a file (naming the line).
    """
    folder = Path(path).parent if path != "-" else Path.cwd()
    found = [folder / Path(p).expanduser() for p in prompt.images]
    for given, file in zip(prompt.images, found):
        if not file.is_file():
            raise PromptsFileError(
                f"{source_name(path)} line {prompt.line}: no image file {given}"
            )
    return found


def _check_chat(messages, where: str) -> None:
    """A line's ``messages``, checked as the server checks a request's
    (`mlx_mtp.server_checks.check_messages`, `check_json`)."""
    from .server_checks import RequestError, check_json, check_messages

    if not isinstance(messages, list) or not messages:
        raise PromptsFileError(f"{where}: 'messages' must be a non-empty list")
    try:
        check_messages(messages, images=True)  # the model tells, once it loads
        check_json(messages, "messages")
    except RequestError as e:
        raise PromptsFileError(f"{where}: {e}") from None


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
            base.replace(**{key: value})
        except MTPError as e:
            message = one_line(e)
    if message is not None:
        named = message if message.startswith(key) else f"{key}: {message}"
        raise PromptsFileError(f"{where}: {named}")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def result(prompt: FilePrompt, ids: List[int], tokens: List[int], text: str, out):
    """The result line of ``prompt`` (token ids ``ids``) from its last
    `mlx_mtp.batch.RowOutput` ``out``: every token it generated (EOS included) and
    their ``text`` (EOS not)."""
    stats = out.stats
    return {
        "id": prompt.id,
        "line": prompt.line,
        "prompt": prompt.prompt,
        "text": text,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(ids),
        "generation_tokens": len(tokens),
        "mtp": {
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_round": round(stats.tokens_per_round, 4),
            "batch_sizes": {str(b): n for b, n in sorted(out.batch_sizes.items())},
        },
    }


def failure(prompt: FilePrompt, message: str) -> dict:
    """The result line of a prompt that failed while it decoded: ``finish_reason``
    "error" and the ``error`` (one line, naming the file and line)."""
    return {
        "id": prompt.id,
        "line": prompt.line,
        "prompt": prompt.prompt,
        "finish_reason": "error",
        "error": message,
    }


def _dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def write(records: List[dict], output: str) -> None:
    """The records as JSONL to the file ``output``, written under a temporary name
    beside it, then renamed: an interrupted write leaves the old file, never half of
    one."""
    path = Path(output)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(_dumps(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultsStdout:
    """Results to stdout in the prompts' order, each as soon as it and every one
    before it are done (one that finishes before an earlier prompt waits for it)."""

    def __init__(self, prompts: List[FilePrompt]):
        self.prompts, self.pending = prompts, prompts
        self.waiting: Dict[int, dict] = {}
        self.written = 0

    def add(self, record: dict) -> None:
        self.waiting[record["line"]] = record
        order = self.prompts
        while self.written < len(order) and order[self.written].line in self.waiting:
            sys.stdout.write(_dumps(self.waiting.pop(order[self.written].line)))
            sys.stdout.flush()
            self.written += 1

    def close(self) -> None:
        """Nothing to do: every result was written as it came."""

    def state(self) -> str:
        """How many results were written, for the line an interrupted run ends with."""
        line = f"{self.written} of {len(self.prompts)} results written to stdout"
        if self.waiting:
            line += (
                f" ({len(self.waiting)} more were done but wait for an earlier prompt; "
                "--output FILE keeps every result as it is done, and a rerun goes on)"
            )
        return line


class ResultsFile:
    """``--output FILE``: each result appended, and flushed, as soon as its prompt is
    done (in the order they finish); once every prompt has its result, the file is
    put in the prompts' order (written beside it, then renamed).

    An existing FILE is an earlier run's results for the same prompts, which this run
    goes on from: each of its lines must be the result of the prompt on its ``line``,
    with that prompt's ``id`` and ``prompt`` (the options are not compared), else a
    `PromptsFileError` and nothing is written. The prompts it holds a result of are
    not generated again; those whose result is an ``error`` are. A line's last result
    counts; a last line cut short (a killed run) is dropped.
    """

    def __init__(self, output: str, prompts: List[FilePrompt], path: str = "-"):
        self.output, self.prompts, self.source = output, prompts, source_name(path)
        self.records: Dict[int, dict] = {}  # by the prompt's line
        self._file = None
        self._cut: Optional[int] = None  # the file's length once a cut line is gone
        self._newline = False  # the last result lacks its newline
        if Path(output).exists():
            self._read(Path(output).read_bytes())

    @property
    def pending(self) -> List[FilePrompt]:
        """The prompts without a result (or whose result is an error), in order."""
        done = {n for n, r in self.records.items() if "error" not in r}
        return [p for p in self.prompts if p.line not in done]

    def _read(self, data: bytes) -> None:
        by_line = {p.line: p for p in self.prompts}
        *lines, tail = data.split(b"\n")
        for n, raw in enumerate(lines, 1):
            if raw.strip() and not self._take(raw, by_line):
                raise PromptsFileError(self._foreign(n, raw, by_line))
        if tail.strip():
            self._newline = self._take(tail, by_line)
            if not self._newline:
                self._cut = len(data) - len(tail)

    def _take(self, raw: bytes, by_line: dict) -> bool:
        """Whether ``raw`` is the result of one of the prompts (then kept)."""
        record = _record(raw)
        prompt = by_line.get(_line(record))
        if prompt is None or not _same_prompt(record, prompt):
            return False
        self.records[prompt.line] = record
        return True

    def _foreign(self, n: int, raw: bytes, by_line: dict) -> str:
        record = _record(raw)
        if record is None or not ("text" in record or "error" in record):
            why = "it is not a result line of mlx-mtp"
        elif _line(record) not in by_line:
            why = f"{self.source} has no prompt on line {record.get('line')!r}"
        else:
            why = f"the prompt or id of line {record['line']} differs"
        return (
            f"--output {self.output} line {n} is not a result of {self.source} "
            f"({why}); give another --output, or delete that file to start over"
        )

    def add(self, record: dict) -> None:
        """Append ``record`` to the file (flushed)."""
        if self._file is None:
            self._file = open(self.output, "a", encoding="utf-8")
            if self._cut is not None:
                self._file.truncate(self._cut)
            self._file.write("\n" if self._newline else "")
        self._file.write(_dumps(record))
        self.records[record["line"]] = record
        self._file.flush()

    def close(self) -> None:
        """Close the file; once every prompt has its result, put it in order."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if any(p.line not in self.records for p in self.prompts):
            return
        records = [self.records[p.line] for p in self.prompts]
        text = "".join(_dumps(r) for r in records).encode("utf-8")
        path = Path(self.output)
        if not path.exists() or path.read_bytes() != text:
            write(records, self.output)

    def state(self) -> str:
        """How many results the file holds, for the line an interrupted run ends
        with."""
        return (
            f"{len(self.records)} of {len(self.prompts)} results written to "
            f"{self.output}; the same command goes on from there"
        )


def _record(raw: bytes) -> Optional[dict]:
    """A result line's object, or None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _line(record: Optional[dict]) -> Optional[int]:
    """The prompt's line a result names, if it names one."""
    line = record.get("line") if record is not None else None
    return line if type(line) is int else None


def _same_prompt(record: dict, prompt: FilePrompt) -> bool:
    """Whether ``record`` is a result (or an error) of ``prompt``."""
    return (
        record.get("id") == prompt.id
        and record.get("prompt") == prompt.prompt
        and ("text" in record or "error" in record)
    )


def results(output: Optional[str], prompts: List[FilePrompt], path: str = "-"):
    """Where the results go: `ResultsStdout` (``output`` None or '-') or
    `ResultsFile`."""
    if output is None or output == "-":
        return ResultsStdout(prompts)
    return ResultsFile(output, prompts, path)


def check_output(output: Optional[str], path: str = "-") -> None:
    """Refuse, before anything runs, an ``output`` that cannot be written: its
    folder missing or read-only, a folder or another file than a regular one in its
    place, or the prompts file ``path`` itself (links resolved)."""
    if output is None or output == "-":
        return
    out = Path(output)
    folder = out.parent
    if out.is_dir():
        raise PromptsFileError(f"--output {output} is a folder")
    if not folder.is_dir():
        raise PromptsFileError(f"--output {output}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PromptsFileError(f"--output {output}: the folder is not writable")
    if not out.exists():
        return
    if path != "-" and os.path.samefile(out, path):
        raise PromptsFileError(f"--output {output} is the prompts file itself")
    if not out.is_file():
        raise PromptsFileError(
            f"--output {output} is not a regular file ('-' writes to stdout)"
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Collector:
    """`mlx_mtp.batch_generate`'s ``on_output`` for the ``prompts`` of a file (token
    ids ``ids``; ``path`` names the file): ``progress`` called with every output, a
    prompt's tokens gathered round by round, and its result handed to ``results``
    as soon as it is done; a prompt that failed (``finish_reason`` "error") gets a
    `failure` naming its line, and counts in ``failed``."""

    def __init__(self, prompts, ids, tokenizer, results, progress, path: str = "-"):
        self.prompts, self.ids, self.tokenizer = prompts, ids, tokenizer
        self.results, self.progress, self.where = results, progress, source_name(path)
        self.tokens: List[List[int]] = [[] for _ in prompts]
        self.failed = 0

    def __call__(self, out) -> None:
        self.progress(out)
        tokens = self.tokens[out.uid]
        tokens.extend(out.tokens)
        if out.finish_reason is None:
            return
        prompt = self.prompts[out.uid]
        self.tokens[out.uid] = []
        if out.finish_reason == "error":
            self.failed += 1
            error = one_line(out.error or "the prompt failed")
            self.results.add(
                failure(prompt, f"{self.where} line {prompt.line}: {error}")
            )
            return
        kept = tokens[:-1] if out.finish_reason == "stop" else tokens
        text = detokenize(self.tokenizer, kept)
        self.results.add(result(prompt, self.ids[out.uid], tokens, text, out))


class Progress:
    """The single updating line of a batch run on stderr (when ``show``): prompts
    completed of ``total``, tokens generated, tok/s. Called with each
    `mlx_mtp.batch.RowOutput`, it redraws at most every ``every`` seconds; as a
    context manager it ends its line on leaving, unless by Ctrl-C or a signal (whose
    own line ends it). ``done``: prompts done before (an earlier run's)."""

    def __init__(
        self, total: int, show: bool = True, every: float = 0.1, stream=None, done=0
    ):
        self.total, self.done, self.tokens, self.show = total, done, 0, show
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
        if self.drawn and (kind is None or issubclass(kind, Exception)):
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
    stats = [s for s in response.mtp if s is not None]  # None: a prompt that failed
    drafted = sum(s.drafted for s in stats)
    accepted = sum(s.accepted for s in stats)
    line = (
        f"{len(response.texts)} prompts | generated {response.generation_tokens} tok "
        f"in {response.seconds:.1f} s @ {response.generation_tps:.1f} tok/s | "
        f"peak {response.peak_memory:.2f} GB"
    )
    if not drafted:
        return line + " | no drafts (plain decoding)"
    return line + f" | accepted {accepted}/{drafted} ({accepted / drafted:.2f})"

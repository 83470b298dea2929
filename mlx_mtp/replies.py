"""What a reply of `mlx-mtp serve` says, apart from decoding: where its text stops,
which of its tool calls parse, and that its JSON is valid.

- `StopText`: stop strings matched on the reply's text, as OpenAI and Anthropic
  match them (not on token ids: a stop string may begin or end inside a token);
- `checked_parser` and `Unparsed`: a tool parser of mlx-lm's whose every result is
  a list of well-formed calls, or an `Unparsed` that keeps the text it could not
  parse (the server returns that text as content);
- `finite`: a reply refused unless it is valid JSON (RFC 8259 has no NaN or
  Infinity).

This module knows nothing of HTTP or of decoding.
"""

import json
import logging
from typing import Callable, Iterable, Optional

log = logging.getLogger("mlx_mtp")


class StopText:
    """One reply's text, cut at its first stop string.

    `add` takes each piece of the reply's text as it is generated and returns what
    may be sent now: never a stop string or anything after one, nor a tail that
    could begin one (held until the next piece says). Once a stop string occurred,
    ``stop`` is it, the text returned ends where it began, and nothing more is
    returned. `flush` returns the held tail when the reply ends otherwise.

    The stop is where the reply's text first holds a whole stop string (of two that
    end at the same character, the longer), whatever pieces the text came in.
    Empty stop strings are ignored."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.stop: Optional[str] = None
        self._held = ""

    def add(self, text: str) -> str:
        if self.stop is not None:
            return ""
        if not self.stops:
            return text
        text = self._held + text
        found = [(text.find(s) + len(s), -len(s), s) for s in self.stops if s in text]
        if found:
            end, length, self.stop = min(found)
            self._held = ""
            return text[: end + length]
        keep = self._tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class Unparsed(dict):
    """What `checked_parser` gives for tool text it could not parse: a dict, as
    mlx-lm's ``ToolCallFormatter`` formats its results (it sets ``arguments``),
    keeping the ``text``."""

    def __init__(self, text: str):
        super().__init__(arguments=None)
        self.text = text


def checked_parser(parser: Optional[Callable]) -> Optional[Callable]:
    """``parser`` (mlx-lm's ``f(tool_text, tools)``, or None) giving a list of
    calls, each a dict with a non-empty string ``name`` and an object of
    ``arguments``, or an `Unparsed` of the text when it raises or gives anything
    else (a JSON number or list of numbers, a call without arguments)."""
    if parser is None or getattr(parser, "checked", False):
        return parser

    def parse(text, tools=None):
        try:
            calls = parser(text, tools)
        except Exception as e:  # a parser's own failure: the model's text
            log.info("tool call not parsed (%s: %s)", type(e).__name__, e)
            return Unparsed(text)
        calls = calls if isinstance(calls, list) else [calls]
        if calls and all(_well_formed(c) for c in calls):
            return calls
        log.info("tool call not parsed: not calls with a name and arguments")
        return Unparsed(text)

    parse.checked = True
    return parse


def _well_formed(call) -> bool:
    if not isinstance(call, dict):
        return False
    name, arguments = call.get("name"), call.get("arguments")
    return isinstance(name, str) and bool(name) and isinstance(arguments, dict)


def finite(value):
    """``value`` as it is when it is valid JSON (no NaN or infinite numbers); a
    ValueError otherwise."""
    json.dumps(value, allow_nan=False)
    return value

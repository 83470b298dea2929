"""Anthropic's Messages API (``POST /v1/messages``) for `mlx-mtp serve`, as a
translation to and from the OpenAI chat endpoint it already serves.

A Messages request becomes the chat request that endpoint decodes (`chat_request`):
the same checks, decode options, templates, tool parsing and prompt caches. Its reply
is asked for as a stream, whose chunks (the dicts the handler makes of the tokens,
as for an OpenAI reply: never the bytes written of them) become Anthropic's events
or, put together, its message (`Reply`, `Events`). Errors are the server's
`RequestError`s, in Anthropic's body (`error_body`, `error_event`). This module
knows nothing of decoding.
"""

import json
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from .server_checks import RequestError, bad_request

MESSAGES_PATH = "/v1/messages"

# Anthropic's request fields that change nothing here: ``metadata`` (a user id),
# ``thinking`` (the chat template decides whether the model reasons:
# ``chat_template_kwargs`` sets it), ``service_tier``.
IGNORED = ("metadata", "thinking", "service_tier")

# OpenAI chat fields a Messages request may not send: their Anthropic names, or None
# for those the Messages API has no equivalent of.
OPENAI_ONLY = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "stream_options": None,
    "logprobs": None,
    "top_logprobs": None,
    "role_mapping": None,
    "response_format": "output_format",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
}

TOOL_CHOICES = ("auto", "any", "tool", "none")

# Anthropic's error type for each HTTP status the server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

Event = Tuple[str, dict]  # an event's name and its data


def under_messages(path: str) -> bool:
    """Whether a request path is Anthropic's (``/v1/messages`` and below, any
    query): its errors take Anthropic's body."""
    found = urlsplit(path).path
    return found == MESSAGES_PATH or found.startswith(MESSAGES_PATH + "/")


def is_messages(path: str) -> bool:
    """Whether a request path is the Messages endpoint (any query: Claude Code sends
    ``?beta=true``)."""
    return urlsplit(path).path == MESSAGES_PATH


# --- errors --------------------------------------------------------------------------


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(error: RequestError) -> bytes:
    """``error`` in Anthropic's body: ``{"type": "error", "error": {"type": ...,
    "message": ...}}``, the type by its status (`ERROR_TYPES`)."""
    inner = {"type": error_type(error.status), "message": str(error)}
    return json.dumps({"type": "error", "error": inner}).encode()


def error_event(error: RequestError) -> bytes:
    """``error`` as the ``error`` event that ends a stream that had started."""
    return b"event: error\ndata: " + error_body(error) + b"\n\n"


# --- requests ------------------------------------------------------------------------


def chat_request(body: dict) -> Tuple[dict, bool]:
    """A Messages request as the OpenAI chat request that serves it, and whether its
    reply streams.

    The chat request streams always, with usage (`Reply` reads its chunks); its
    ``messages`` hold ``system`` first; ``tools`` and ``tool_choice`` become OpenAI
    tools (`chat_tools`), ``stop_sequences`` its ``stop``. `IGNORED` fields are
    dropped; the others (``model``, ``max_tokens``, sampling, mlx-mtp's own such as
    ``num_draft_tokens``) go on as they are, for the chat endpoint's checks.

    Raises:
        RequestError: a 400 naming the field, for a request of the wrong shape.
    """
    if "max_tokens" not in body:
        raise bad_request("max_tokens is required", "max_tokens")
    for name, instead in OPENAI_ONLY.items():
        if name in body:
            hint = f": send {instead}" if instead else ""
            raise bad_request(f"{name} is not a Messages API field{hint}", name)
    chat = {k: v for k, v in body.items() if k not in IGNORED}
    stream = chat.pop("stream", False)
    if type(stream) is not bool:
        raise bad_request("stream must be true or false", "stream")
    messages = chat.pop("messages", None)
    system = system_messages(chat.pop("system", None))
    chat["messages"] = system + chat_messages(messages)
    choice = chat.pop("tool_choice", None)
    tools = chat_tools(chat.pop("tools", None), choice)
    forced = chat_tool_choice(choice)
    if tools:
        chat["tools"] = tools
        chat.update(forced)
    elif "tool_choice" in forced:
        raise bad_request("a forced tool call needs tools", "tool_choice")
    stop = stop_words(chat.pop("stop_sequences", None))
    if stop:
        chat["stop"] = stop
    output = output_format(
        chat.pop("output_format", None), chat.pop("output_config", None)
    )
    if output is not None:
        chat["response_format"] = output
    chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat, stream


def output_format(fmt, config) -> Optional[dict]:
    """Anthropic's structured outputs (``output_format``, or ``output_config``'s
    ``format``: ``{"type": "json_schema", "schema": {...}}``) as the chat endpoint's
    ``response_format``; None without. The schema is enforced by the grammar engine
    at every position, drafts included."""
    if config is not None:
        if not isinstance(config, dict):
            raise bad_request("output_config must be an object", "output_config")
        if fmt is not None and config.get("format") is not None:
            raise bad_request(
                "send output_format or output_config.format, not both", "output_config"
            )
        fmt = config.get("format", fmt)
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(
            "output_format must be an object with type json_schema and a schema",
            "output_format",
        )
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_format needs a schema object", "output_format")
    schema = {"name": "output", "schema": fmt["schema"], "strict": True}
    return {"type": "json_schema", "json_schema": schema}


def system_messages(system) -> List[dict]:
    """``system`` (a string, or a list of text blocks) as the chat's first message;
    none when absent or empty."""
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        text = _text_of(system, "system", "system")
    else:
        raise bad_request("system must be a string or a list of text blocks", "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages) -> List[dict]:
    """Anthropic's ``messages`` as OpenAI chat messages.

    A user turn's ``tool_result`` blocks become ``tool`` messages (with the name of
    the tool_use they answer) and its text blocks a user message, in their order; an
    assistant turn's text and ``tool_use`` blocks become one message with
    ``tool_calls`` (``thinking`` blocks are dropped, as Anthropic drops those of
    earlier turns). Text blocks of one message are joined by a blank line.
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out, names = [], {}  # names: the tool of each tool_use id so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list) or not content:
            raise bad_request(
                f"{where}.content must be a string or a non-empty list of content "
                "blocks",
                "messages",
            )
        elif role == "assistant":
            out.append(_assistant_message(content, where, names))
        else:
            out.extend(_user_messages(content, where, names))
    if messages[-1]["role"] == "assistant":
        raise bad_request(
            "the last message is the assistant's: this server does not continue a "
            "reply (prefill); end with a user message",
            "messages",
        )
    return out


def _blocks(content: list, where: str, allowed: Sequence[str]):
    """``(index, type, block)`` of each block, refusing those not ``allowed``."""
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{at} must be an object with a type", "messages")
        if kind == "document" or (kind == "image" and kind not in allowed):
            raise bad_request(
                f"{at} is {'an image' if kind == 'image' else 'a document'}: this "
                "server's models take text only",
                "messages",
            )
        if kind not in allowed:
            raise bad_request(
                f"{at} has type {kind!r}; this message takes "
                f"{', '.join(allowed)} blocks",
                "messages",
            )
        yield at, kind, block


def _text_of(blocks: list, where: str, param: str) -> str:
    """The text of a list of text blocks, joined by a blank line."""
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "image":
                raise bad_request(
                    f"{at} is an image: this server's models take text only", param
                )
            raise bad_request(f"{at} must be a text block", param)
        texts.append(_text(block, at, param))
    return "\n\n".join(t for t in texts if t)


def _text(block: dict, at: str, param: str = "messages") -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{at}.text must be a string", param)
    return block["text"]


def _assistant_message(content: list, where: str, names: dict) -> dict:
    allowed = ("text", "tool_use", "thinking", "redacted_thinking")
    texts, calls = [], []
    for at, kind, block in _blocks(content, where, allowed):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
            names[block["id"]] = block["name"]
    message = {"role": "assistant", "content": "\n\n".join(t for t in texts if t)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict, at: str) -> dict:
    """A ``tool_use`` block as an OpenAI tool call (its input as JSON text)."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad_request(f"{at}.{key} must be a non-empty string", "messages")
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{at}.input must be an object", "messages")
    arguments = json.dumps(block["input"], ensure_ascii=False)
    function = {"name": block["name"], "arguments": arguments}
    return {"id": block["id"], "type": "function", "function": function}


def _user_messages(content: list, where: str, names: dict) -> List[dict]:
    """A user turn's blocks as OpenAI messages: text blocks in a row one message
    (joined by a blank line); with images among them (base64 ``image`` blocks), a
    list of ``text`` and ``image_url`` parts (a ``data:`` URL; a URL source is not
    fetched), which the chat check refuses for a model that reads no images."""
    out, parts = [], None
    for at, kind, block in _blocks(content, where, ("text", "tool_result", "image")):
        if kind == "tool_result":
            out.append(_tool_message(block, at, names))
            parts = None
            continue
        if parts is None:
            parts = []
            out.append({"role": "user", "content": parts})
        if kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image(block, at)}})
        elif parts and parts[-1]["type"] == "text":
            joined = (parts[-1]["text"], _text(block, at))
            parts[-1]["text"] = "\n\n".join(t for t in joined if t)
        else:
            parts.append({"type": "text", "text": _text(block, at)})
    for message in out:  # text alone: a string, as before
        content = message["content"]
        if isinstance(content, list) and all(p["type"] == "text" for p in content):
            message["content"] = "".join(p["text"] for p in content)
    return out


def _image(block: dict, at: str) -> str:
    """An ``image`` block's base64 source as a ``data:`` URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind != "base64":
        raise bad_request(
            f"{at}.source must be a base64 image (this server fetches no URL)",
            "messages",
        )
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not media.startswith("image/"):
        raise bad_request(f"{at}.source.media_type must be image/...", "messages")
    if not isinstance(data, str):
        raise bad_request(f"{at}.source.data must be a string", "messages")
    return f"data:{media};base64,{data}"


def _tool_message(block: dict, at: str, names: dict) -> dict:
    """A ``tool_result`` block as an OpenAI ``tool`` message. Its ``is_error`` is
    not rendered: chat templates have no place for it (the content says what
    failed)."""
    call = block.get("tool_use_id")
    if not isinstance(call, str) or call not in names:
        raise bad_request(
            f"{at}.tool_use_id must be the id of a tool_use block of an earlier "
            "assistant message",
            "messages",
        )
    content = block.get("content", "")
    if isinstance(content, list):
        content = _text_of(content, f"{at}.content", "messages")
    elif not isinstance(content, str):
        raise bad_request(
            f"{at}.content must be a string or a list of text blocks", "messages"
        )
    return {
        "role": "tool",
        "tool_call_id": call,
        "name": names[call],
        "content": content,
    }


def chat_tools(tools, choice) -> Optional[List[dict]]:
    """Anthropic's ``tools`` (custom tools: name, description, input_schema) as the
    OpenAI tools the chat template renders, as far as ``tool_choice`` lets: "none"
    does not show them to the model, the others do (`chat_tool_choice`)."""
    kind = _tool_choice(choice)
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    out = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    return out if kind != "none" else None


def _tool_choice(choice) -> str:
    if choice is None:
        return "auto"
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICES:
        raise bad_request(
            f"tool_choice must be an object whose type is one of "
            f"{', '.join(TOOL_CHOICES)}",
            "tool_choice",
        )
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice of type tool needs a name", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use", False)
    if type(parallel) is not bool:
        raise bad_request(
            "tool_choice.disable_parallel_tool_use must be true or false",
            "tool_choice",
        )
    return kind


def chat_tool_choice(choice) -> dict:
    """Anthropic's ``tool_choice`` as the chat request's fields: "any" is OpenAI's
    "required" and "tool" its named function, both a grammar that makes the reply
    tool calls only (`mlx_mtp.server_checks.tool_choice`);
    ``disable_parallel_tool_use`` is ``parallel_tool_calls`` false (one call at most:
    with "auto" nothing limits the calls, so it is a 400 there)."""
    kind = _tool_choice(choice)
    single = bool(choice and choice.get("disable_parallel_tool_use"))
    if kind == "auto" and single:
        raise bad_request(
            "tool_choice.disable_parallel_tool_use needs tool_choice any or tool: "
            "with auto nothing limits a reply to one tool call",
            "tool_choice",
        )
    out = {}
    if kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if single:
        out["parallel_tool_calls"] = False
    return out


def _tool(tool, at: str) -> dict:
    """A custom tool as an OpenAI function tool; server tools (``bash_...``,
    ``web_search_...``: a type of their own) are refused."""
    if not isinstance(tool, dict):
        raise bad_request(f"{at} must be an object", "tools")
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise bad_request(
            f"{at} has type {kind!r}: only custom tools (name, description, "
            "input_schema) are supported",
            "tools",
        )
    name, description = tool.get("name"), tool.get("description", "")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{at}.name must be a non-empty string", "tools")
    if not isinstance(description, str):
        raise bad_request(f"{at}.description must be a string", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"{at}.input_schema must be a JSON schema object", "tools")
    function = {
        "name": name,
        "description": description,
        "parameters": tool["input_schema"],
    }
    return {"type": "function", "function": function}


def stop_words(sequences) -> List[str]:
    """``stop_sequences``: a list of non-empty strings."""
    if sequences is None:
        return []
    if not isinstance(sequences, list) or not all(
        isinstance(s, str) and s for s in sequences
    ):
        raise bad_request(
            "stop_sequences must be a list of non-empty strings", "stop_sequences"
        )
    return sequences


# --- replies -------------------------------------------------------------------------


def stop_reason(
    finish: Optional[str], stop_sequence: Optional[str] = None
) -> Tuple[str, Optional[str]]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a reply the chat path
    ended with ``finish``: "length" is max_tokens, "tool_calls" tool_use; a "stop"
    at one of the request's stop sequences (``stop_sequence``: the server matches
    them on the text) is that stop_sequence, any other (an EOS token) end_turn."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None


def tool_use_id(call_id: Optional[str]) -> str:
    """A ``toolu_`` id for a tool call of the chat path (its id, or a new one)."""
    if call_id and call_id.startswith("toolu_"):
        return call_id
    kept = "".join(c for c in call_id or "" if c.isalnum())
    return "toolu_" + (kept or uuid.uuid4().hex)


class Reply:
    """One Anthropic message, made from the chunks of the chat path's streamed reply:
    its events as they come (`start`, `add`, `end`), and the whole message
    (`message`, once ended).

    A chunk's reasoning, text and tool calls, in that order, go on the open block of
    their kind (``thinking``, ``text``) or open a block; a tool call is a whole
    ``tool_use`` block (one ``input_json_delta``: mlx-lm parses a call once it is
    complete). ``prompt_tokens`` and ``cached_tokens`` are the prompt's (usage's
    ``input_tokens`` are those not cached); ``stop`` gives the stop reason of the
    chat path's finish reason (`stop_reason`). The ``mtp`` block of the last chunk
    that has one goes on the ``message_delta`` event and the message."""

    def __init__(
        self,
        model: str,
        prompt_tokens: int,
        cached_tokens: int,
        stop: Callable[[Optional[str]], Tuple[str, Optional[str]]],
    ):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self._stop = model, stop
        cached = max(cached_tokens, 0)
        self.usage = {
            "input_tokens": prompt_tokens - cached,
            "output_tokens": 0,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }
        self.content: List[dict] = []
        self.stop_reason = self.stop_sequence = self.mtp = None
        self._finish = None
        self._open: Optional[str] = None  # the kind of the block being streamed
        self._inputs: Dict[int, str] = {}  # a tool_use block's input, as JSON text

    def start(self) -> List[Event]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": dict(self.usage),
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def add(self, chunk: dict) -> List[Event]:
        """The events of one chunk of the chat path's reply."""
        if chunk.get("mtp") is not None:
            self.mtp = chunk["mtp"]
        if chunk.get("usage"):
            self.usage["output_tokens"] = chunk["usage"]["completion_tokens"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("thinking", delta["reasoning"])
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_use(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                events += self._close()
        return events

    def end(self) -> List[Event]:
        """The events that end the message: its stop reason, usage and mtp block."""
        self.stop_reason, self.stop_sequence = self._stop(self._finish)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        event = {"type": "message_delta", "delta": delta, "usage": dict(self.usage)}
        if self.mtp is not None:
            event["mtp"] = self.mtp
        done = ("message_stop", {"type": "message_stop"})
        return self._close() + [("message_delta", event), done]

    def message(self) -> dict:
        """The whole message, as a non-streamed reply: its blocks as streamed."""
        content = [dict(block) for block in self.content]
        for i, text in self._inputs.items():
            content[i]["input"] = json.loads(text)
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": dict(self.usage),
        }
        if self.mtp is not None:
            message["mtp"] = self.mtp
        return message

    def _text(self, kind: str, text: str) -> List[Event]:
        events = []
        if self._open != kind:
            events += self._close()
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events += self._open_block(block)
            self._open = kind
        index = len(self.content) - 1
        self.content[index][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return events + [_delta(index, delta)]

    def _tool_use(self, call: dict) -> List[Event]:
        function = call["function"]
        block = {
            "type": "tool_use",
            "id": tool_use_id(call.get("id")),
            "name": function["name"],
            "input": {},
        }
        events = self._close() + self._open_block(block)
        index = len(self.content) - 1
        self._inputs[index] = function["arguments"]
        delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
        return events + [_delta(index, delta), _stop(index)]

    def _open_block(self, block: dict) -> List[Event]:
        self.content.append(block)
        start = {
            "type": "content_block_start",
            "index": len(self.content) - 1,
            "content_block": dict(block),
        }
        return [("content_block_start", start)]

    def _close(self) -> List[Event]:
        if self._open is None:
            return []
        self._open = None
        return [_stop(len(self.content) - 1)]


def _delta(index: int, delta: dict) -> Event:
    data = {"type": "content_block_delta", "index": index, "delta": delta}
    return ("content_block_delta", data)


def _stop(index: int) -> Event:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def sse(event: Event) -> bytes:
    """An event as server-sent events write it."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode()


class Events:
    """A Messages reply on its way out, made from the chat path's chunks as the
    handler makes them (`Reply`): `open` once the reply starts (its headers sent),
    `add` with each chunk, `close` at its end. When ``stream``, each step's events
    go to ``out`` as they come; else nothing does, and the handler sends the
    reply's message."""

    def __init__(self, out, stream: bool):
        self.out, self.stream = out, stream
        self.reply: Optional[Reply] = None

    def open(self, reply: Reply) -> None:
        self.reply = reply
        self._send(reply.start())

    def add(self, chunk: dict) -> None:
        self._send(self.reply.add(chunk))

    def close(self) -> None:
        self._send(self.reply.end())

    def _send(self, events: List[Event]) -> None:
        if self.stream:
            self.out.write(b"".join(sse(e) for e in events))
            self.out.flush()

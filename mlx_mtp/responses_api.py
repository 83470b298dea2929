"""OpenAI's Responses API (``POST /v1/responses``) for `mlx-mtp serve`, as a
translation to and from the chat endpoint it serves (as `mlx_mtp.anthropic_api` does
for the Messages API).

A request becomes the chat request that endpoint decodes (`chat_request`): the same
checks, decode options, templates, tool parsing, grammars and prompt caches. Its
``input`` (a string, or items: messages, ``function_call`` and
``function_call_output``) and ``instructions`` are the chat messages; with
``previous_response_id`` a response kept by the server (`Kept`, per API key) goes
first, its own input and output included, so the kept conversation's caches carry
on. The reply is asked for as a stream, whose chunks (the dicts the handler makes
of the tokens, never the bytes written of them) become the Responses events or,
put together, the response object (`Reply`, `Events`). Errors are the server's
`RequestError`s in OpenAI's body; a stream that had started ends with an ``error``
event. This module knows nothing of decoding.
"""

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable, List, Optional, Tuple
from urllib.parse import urlsplit

from . import anthropic_api
from .anthropic_api import sse
from .server_checks import RequestError, bad_request

RESPONSES_PATH = "/v1/responses"

# Request fields that change nothing here: ``include`` (no encrypted reasoning is
# kept), ``reasoning`` (the chat template decides whether the model reasons:
# ``chat_template_kwargs`` sets it), ``truncation`` (a prompt over the context is a
# 400 either way), ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``
# and ``safety_identifier`` (prompt caches are per API key and token prefix).
IGNORED = (
    "include",
    "reasoning",
    "truncation",
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
)

# Chat fields a Responses request may not send: their Responses names, or None.
CHAT_ONLY = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "stop": None,
    "stream_options": None,
    "n": None,
    "logprobs": None,
    "role_mapping": None,
}

ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
ROLES["developer"] = "system"

# The responses a server keeps for ``previous_response_id``, at most.
KEPT_RESPONSES = 256

Event = Tuple[str, dict]


def under_responses(path: str) -> bool:
    """Whether a request path is the Responses API's (``/v1/responses`` and below)."""
    found = urlsplit(path).path
    return found == RESPONSES_PATH or found.startswith(RESPONSES_PATH + "/")


def is_responses(path: str) -> bool:
    """Whether a request path is the endpoint that makes responses."""
    return urlsplit(path).path == RESPONSES_PATH


# --- errors --------------------------------------------------------------------------


def error_body(error: RequestError) -> bytes:
    """``error`` in OpenAI's body, as the chat endpoint answers."""
    return error.body()


def error_event(error: RequestError) -> bytes:
    """``error`` as the ``error`` event that ends a stream that had started."""
    inner = json.loads(error.body())["error"]
    data = {
        "type": "error",
        "code": inner.get("code") or inner.get("type"),
        "message": inner.get("message", str(error)),
        "param": inner.get("param"),
        "sequence_number": 0,
    }
    return sse(("error", data))


# --- kept responses ------------------------------------------------------------------


class Kept:
    """The conversations of the responses a server made (unless a request said
    ``store: false``), for ``previous_response_id``: an LRU of at most ``size``,
    each its owner's (the API key its request presented)."""

    def __init__(self, size: int = KEPT_RESPONSES):
        self.size = size
        self._items: "OrderedDict[str, Tuple[object, List[dict]]]" = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: List[dict], owner=None) -> None:
        with self._lock:
            self._items[response_id] = (owner, messages)
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str, owner=None) -> Optional[List[dict]]:
        """The conversation of ``response_id`` (its input and output, as chat
        messages), if ``owner``'s; None if none."""
        with self._lock:
            found = self._items.get(response_id)
            if found is None or found[0] != owner:
                return None
            self._items.move_to_end(response_id)
            return list(found[1])


# --- requests ------------------------------------------------------------------------


class Request:
    """What a Responses request asks beyond its chat request: the fields its
    response echoes, whether it is kept, and its conversation as chat messages."""

    def __init__(self, body: dict, messages: List[dict]):
        self.messages = messages
        self.store = body.get("store", True) is not False
        self.previous = body.get("previous_response_id")
        text = body.get("text")
        self.echo = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": self.previous,
            "temperature": body.get("temperature"),
            "text": text if isinstance(text, dict) else {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "metadata": body.get("metadata") or {},
            "store": self.store,
            "truncation": body.get("truncation", "disabled"),
        }


def chat_request(
    body: dict, history: Callable[[str], Optional[List[dict]]]
) -> Tuple[dict, bool, Request]:
    """A Responses request as the chat request that serves it, whether its reply
    streams, and its `Request`.

    ``history(response_id)`` gives a kept response's conversation (None: unknown).
    The chat request streams always, with usage (`Reply` reads its chunks); its
    ``messages`` are ``instructions`` (as a system message), the previous
    response's conversation, then ``input``; ``tools`` and ``tool_choice`` become
    the chat ones, ``text.format`` its ``response_format``, ``max_output_tokens``
    its ``max_tokens``. `IGNORED` fields are dropped; the others (``model``,
    sampling, ``parallel_tool_calls``, mlx-mtp's own such as ``num_draft_tokens``) go
    on as they are, for the chat endpoint's checks.

    Raises:
        RequestError: a 400 naming the field, for a request of the wrong shape or a
            previous response that is not kept.
    """
    for name, instead in CHAT_ONLY.items():
        if name in body:
            hint = f": send {instead}" if instead else ""
            raise bad_request(f"{name} is not a Responses API field{hint}", name)
    if body.get("background"):
        raise bad_request("background responses are not supported", "background")
    if "store" in body and type(body["store"]) is not bool:
        raise bad_request("store must be true or false", "store")
    chat = {k: v for k, v in body.items() if k not in IGNORED}
    for name in ("store", "background", "previous_response_id", "instructions"):
        chat.pop(name, None)
    stream = chat.pop("stream", False)
    if type(stream) is not bool:
        raise bad_request("stream must be true or false", "stream")
    messages = _instructions(body.get("instructions"))
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad_request(
                "previous_response_id must be a string", "previous_response_id"
            )
        earlier = history(previous)
        if earlier is None:
            raise bad_request(
                f"no response {previous!r} is kept here (a response made with "
                "store false, another API key's, or one dropped)",
                "previous_response_id",
            )
        messages += [m for m in earlier if m.get("role") != "system"]
    if "input" not in body:
        raise bad_request("input is required", "input")
    conversation = messages + input_messages(chat.pop("input"))
    chat["messages"] = conversation
    tools = chat_tools(chat.pop("tools", None))
    if tools:
        chat["tools"] = tools
    choice = chat_tool_choice(chat.pop("tool_choice", "auto"))
    if choice == "none":  # the tools are not shown to the model
        chat.pop("tools", None)
    elif choice != "auto":
        if not tools:
            raise bad_request("a forced tool call needs tools", "tool_choice")
        chat["tool_choice"] = choice
    if "max_output_tokens" in chat:
        chat["max_tokens"] = chat.pop("max_output_tokens")
    text = chat.pop("text", None)
    fmt = text_format(text)
    if fmt is not None:
        chat["response_format"] = fmt
    chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat, stream, Request(body, conversation)


def _instructions(instructions) -> List[dict]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    return [{"role": "system", "content": instructions}] if instructions else []


def input_messages(items) -> List[dict]:
    """``input`` as chat messages: a string is a user message; items are messages
    (roles user, assistant, system, developer; content a string or text parts),
    ``function_call`` items (an assistant turn's tool calls, joined with its text)
    and ``function_call_output`` items (tool messages); ``reasoning`` items are
    dropped (the template does not take them back)."""
    if isinstance(items, str):
        if not items:
            raise bad_request("input must not be empty", "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list", "input")
    out: List[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            call = _function_call(item, at)
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                if last is not None and last["role"] == "assistant":
                    last["tool_calls"] = []
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1]["tool_calls"].append(call)
        elif kind == "function_call_output":
            out.append(_function_output(item, at))
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(
                f"{at} has type {kind!r}: input items are messages, function_call "
                "and function_call_output",
                "input",
            )
    if not any(m["role"] != "system" for m in out):
        raise bad_request("input holds no message to answer", "input")
    return out


def _image_part(part: dict, at: str) -> dict:
    """An ``input_image`` part (its ``image_url``, a ``data:`` URL) as a chat
    ``image_url`` part, which the chat check refuses for a model that reads no
    images (and any URL but a ``data:`` one: nothing is fetched)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad_request(
            f"{at}.image_url must be a data: URL (file ids are not served)", "input"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _message(item: dict, at: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(
            f"{at}.role must be one of {', '.join(ROLES)}, not {role!r}", "input"
        )
    content = item.get("content")
    if isinstance(content, list):
        allowed = ("output_text", "refusal") if role == "assistant" else ()
        allowed += ("input_text", "text")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image" and role == "user":
                parts.append(_image_part(part, f"{at}.content[{j}]"))
                continue
            if kind not in allowed:
                raise bad_request(
                    f"{at}.content[{j}] has type {kind!r}: this server takes text "
                    "and image parts only (no files)",
                    "input",
                )
            text = part.get("text", part.get("refusal", ""))
            parts.append({"type": "text", "text": text})
        if any(p["type"] == "image_url" for p in parts):
            return {"role": ROLES[role], "content": parts}
        content = "".join(p["text"] for p in parts)
    if not isinstance(content, str):
        raise bad_request(f"{at}.content must be a string or a list of parts", "input")
    return {"role": ROLES[role], "content": content}


def _function_call(item: dict, at: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad_request(f"{at}.{key} must be a string", "input")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _function_output(item: dict, at: str) -> dict:
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
        raise bad_request(
            f"{at} needs a call_id and an output string (or text parts)", "input"
        )
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def chat_tools(tools) -> Optional[List[dict]]:
    """Responses function tools (``name``, ``description``, ``parameters`` at the
    top level) as the chat endpoint's; other tool types (web search, files,
    computer use, custom grammars) are refused."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"{at} has type {kind!r}: only function tools are supported", "tools"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{at}.name must be a non-empty string", "tools")
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object"}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    """``tool_choice`` ("auto", "none", "required", or ``{"type": "function",
    "name": ...}``) as the chat endpoint's."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("name"), str) and choice["name"]:
            return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "auto", "none", "required" or {"type": "function", '
        '"name": ...}',
        "tool_choice",
    )


def text_format(text) -> Optional[dict]:
    """``text.format`` as the chat ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema", "text")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(
        "text.format.type must be text, json_object or json_schema", "text"
    )


# --- replies -------------------------------------------------------------------------


class Reply:
    """One response, made from the chunks of the chat path's streamed reply: its
    events as they come (`start`, `add`, `end`, each with its ``sequence_number``)
    and the whole response object (`response`, once ended).

    A chunk's reasoning and text go on the open item of their kind (a
    ``reasoning`` item with a ``reasoning_text`` part, a ``message`` with an
    ``output_text`` part) or open one; a tool call is a whole ``function_call``
    item (its arguments in one delta: mlx-lm parses a call once it is complete).
    ``prompt_tokens`` and ``cached_tokens`` make usage's ``input_tokens`` and its
    ``cached_tokens``. A reply that ended at ``max_output_tokens`` is
    ``incomplete``. The ``mtp`` block of the last chunk that has one goes on the
    response."""

    def __init__(self, model: str, prompt_tokens: int, cached_tokens: int, request):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.model, self.request = model, request
        self.created = time.time()
        self.usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": max(cached_tokens, 0)},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens,
        }
        self.output: List[dict] = []
        self.status, self.mtp, self._finish = "in_progress", None, None
        self._open: Optional[str] = None  # the type of the item being streamed
        self._seq = 0

    # events

    def start(self) -> List[Event]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def add(self, chunk: dict) -> List[Event]:
        """The events of one chunk of the chat path's reply."""
        if chunk.get("mtp") is not None:
            self.mtp = chunk["mtp"]
        usage = chunk.get("usage")
        if usage:
            self.usage["output_tokens"] = usage["completion_tokens"]
            self.usage["total_tokens"] = (
                usage["prompt_tokens"] + usage["completion_tokens"]
            )
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._function_call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                events += self._close()
        return events

    def end(self) -> List[Event]:
        """The events that end the response: ``response.completed``, or
        ``response.incomplete`` when it stopped at ``max_output_tokens``."""
        events = self._close()
        self.status = "incomplete" if self._finish == "length" else "completed"
        kind = f"response.{self.status}"
        return events + [self._event(kind, response=self.response())]

    def response(self) -> dict:
        """The response object, as it stands."""
        response = {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": self.status,
            "model": self.model,
            "output": [dict(item) for item in self.output],
            "usage": json.loads(json.dumps(self.usage)),
            "error": None,
            "incomplete_details": None,
            **self.request.echo,
        }
        if self.status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.status != "in_progress":
            response["completed_at"] = int(time.time())
        if self.mtp is not None:
            response["mtp"] = self.mtp
        return response

    message = response  # the whole reply, as `anthropic_api.Events` sends it

    def conversation(self) -> List[dict]:
        """The request's conversation and this response, as chat messages (what a
        later request with ``previous_response_id`` goes on from)."""
        text = "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        reply = {"role": "assistant", "content": text}
        if calls:
            reply["tool_calls"] = calls
        return self.request.messages + [reply]

    # items

    def _text(self, kind: str, text: str) -> List[Event]:
        events = []
        if self._open != kind:
            events += self._close()
            events += self._open_item(kind)
        index = len(self.output) - 1
        item = self.output[index]
        item["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        fields = {"logprobs": []} if kind == "message" else {}
        event = self._event(
            f"response.{name}.delta",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=text,
            **fields,
        )
        return events + [event]

    def _open_item(self, kind: str) -> List[Event]:
        self._open = kind
        if kind == "message":
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}"}
            item.update(status="in_progress", role="assistant", content=[])
            part = {
                "type": "output_text",
                "text": "",
                "annotations": [],
                "logprobs": [],
            }
        else:
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}"}
            item.update(status="in_progress", summary=[], content=[])
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        index = len(self.output) - 1
        added = self._event(
            "response.output_item.added", output_index=index, item=_copy(item)
        )
        item["content"].append(part)
        part_added = self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=dict(part),
        )
        return [added, part_added]

    def _close(self) -> List[Event]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        index = len(self.output) - 1
        item = self.output[index]
        part = item["content"][0]
        name = "output_text" if kind == "message" else "reasoning_text"
        fields = {"logprobs": []} if kind == "message" else {}
        where = dict(item_id=item["id"], output_index=index, content_index=0)
        item["status"] = "completed"
        return [
            self._event(f"response.{name}.done", text=part["text"], **where, **fields),
            self._event("response.content_part.done", part=dict(part), **where),
            self._event(
                "response.output_item.done", output_index=index, item=_copy(item)
            ),
        ]

    def _function_call(self, call: dict) -> List[Event]:
        function = call["function"]
        call_id = call.get("id") or f"call_{uuid.uuid4().hex}"
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": function["name"],
            "arguments": "",
            "status": "in_progress",
        }
        events = self._close()
        self.output.append(item)
        index = len(self.output) - 1
        where = dict(item_id=item["id"], output_index=index)
        events.append(
            self._event(
                "response.output_item.added", output_index=index, item=dict(item)
            )
        )
        item["arguments"] = function["arguments"]
        events.append(
            self._event(
                "response.function_call_arguments.delta",
                delta=function["arguments"],
                **where,
            )
        )
        item["status"] = "completed"
        events += [
            self._event(
                "response.function_call_arguments.done",
                arguments=function["arguments"],
                **where,
            ),
            self._event(
                "response.output_item.done", output_index=index, item=dict(item)
            ),
        ]
        return events

    def _event(self, kind: str, **data) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return (kind, event)


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


# A response on its way out is made as a Messages reply is (`Reply` has their
# interface: ``start``, ``add``, ``end``, ``message``).
Events = anthropic_api.Events


__all__ = [
    "Events",
    "Kept",
    "Reply",
    "Request",
    "chat_request",
    "error_body",
    "error_event",
    "is_responses",
    "under_responses",
]

"""What a request to `mlx-mtp serve` may be, and where it may come from: pure checks
that the server applies before anything is queued, each one a `RequestError` (an
HTTP status and an OpenAI-style error body) for the client.

- the sampling settings and seed, by the rules of the CLI and the MTP loop
  (`check_sampling`), the same on every path;
- a request's decode options: the server's, then the request's fields
  (`request_options`, checked by `DecodeOptions.check`);
- the shape of chat requests: messages, content parts (no images: no URL is ever
  fetched), tool calls, ``tools``, template arguments (`check_chat_fields`), and any
  JSON nested too deeply or holding text that is not Unicode (`check_json`);
- browser origins and ``Host`` names (`check_origins`, `local_origin`,
  `host_allowed`: a web page cannot drive a local server, nor rebind its name);
- a lower bound on a prompt's tokens from its bytes, to refuse what cannot fit
  before tokenizing it (`prompt_bytes_per_token`);
- which API key a request presents (`key_owner`: a bearer token or ``x-api-key``).
"""

import hmac
import ipaddress
import json
import re
from typing import Optional
from urllib.parse import urlsplit

from .errors import MTPError, one_line
from .images import ImageError, data_url, read_image
from .options import DecodeOptions
from .sampling import SamplingError, SamplingParams, check_seed


class RequestError(Exception):
    """An error for the client: HTTP status, OpenAI error type and code."""

    def __init__(self, status: int, message: str, kind: str, code=None, param=None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def body(self) -> bytes:
        error = {
            "message": str(self),
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }
        return json.dumps({"error": error}).encode()


def bad_request(message: str, param=None, code=None) -> RequestError:
    return RequestError(400, message, "invalid_request_error", code, param)


# The request fields of the sampling settings, by their `SamplingParams` names.
SAMPLING_FIELDS = {
    "temperature": "temp",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
}
_FIELD_OF = {name: field for field, name in SAMPLING_FIELDS.items()}


def check_sampling(body: dict, defaults: DecodeOptions, vocab_size: int) -> None:
    """400, naming the field, for sampling settings (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``) that `SamplingParams` or `check_seed` refuse: the
    rules of the CLI and the MTP loop, applied to every request before it is queued,
    as mlx-lm's batched path checks none of them. ``defaults`` (the server's decode
    options) stand for the fields the body lacks. A ``top_k`` of at least
    ``vocab_size`` keeps every token, as 0 does, and goes on as 0: mlx-lm's batch
    reads it so too."""
    values = {
        name: body.get(field, getattr(defaults, name))
        for field, name in SAMPLING_FIELDS.items()
    }
    try:
        SamplingParams(**values)
        check_seed(body.get("seed"))
    except SamplingError as e:
        raise sampling_request_error(e) from None
    if values["top_k"] >= vocab_size:
        body["top_k"] = 0


def sampling_request_error(e: SamplingError) -> RequestError:
    """A `SamplingError` as a 400 naming the request's field."""
    return option_error(e, e.name, _FIELD_OF.get(e.name, e.name))


def option_error(e: MTPError, name: str, field: str) -> RequestError:
    """The error of the decode option ``name`` as a 400 naming the request's
    ``field``, in the message too."""
    message = one_line(e)
    if message.startswith(name):
        message = field + message[len(name) :]
    return bad_request(message, field)


# mlx-mtp's own request fields, each the `DecodeOptions` field of its name: taken out
# of the body (mlx-lm's handler reads the rest).
DRAFTING_FIELDS = ("num_draft_tokens", "draft_source", "draft_vocab")
# mlx-lm's logits-processor fields, each the `DecodeOptions` field of its name (left
# in the body: mlx-lm's handler checks their types too). 0 is off, as in mlx-lm.
PROCESSOR_FIELDS = (
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "logit_bias",
)


def logit_bias(value, vocab_size: int) -> Optional[dict]:
    """A request's ``logit_bias`` (token ids as JSON keys, to numbers from -100 to
    100, as OpenAI takes them) as a dict of ints to floats; a 400 naming the field
    for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not re.fullmatch("[0-9]{1,10}", str(key)) or int(key) >= vocab_size:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id of this model (0 to "
                f"{vocab_size - 1})",
                "logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_request(
                f"logit_bias of token {key} must be a number, got {bias!r}",
                "logit_bias",
            )
        if not -100 <= bias <= 100:
            raise bad_request(
                f"logit_bias of token {key} must be from -100 to 100, got {bias}",
                "logit_bias",
            )
        out[int(key)] = float(bias)
    return out or None


def response_format(value):
    """A request's ``response_format`` as a `mlx_mtp.grammar.GrammarSpec` (None for
    plain text): ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
    (the schema is always enforced, strict or not) or, as an extension, ``{"type":
    "regex", "regex": PATTERN}``; a 400 naming the field otherwise (the engine's own
    refusals are checked later, with the tokenizer: `mlx_mtp.grammar.check_grammar`).
    """
    from .grammar import GrammarError, GrammarSpec

    field = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a type", field)
    kind = value["type"]
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return GrammarSpec.json_object()
        if kind == "regex":
            return GrammarSpec.regex(value.get("regex"))
        if kind != "json_schema":
            raise bad_request(
                f"response_format type {kind!r} is not one of text, json_object, "
                "json_schema, regex",
                field,
            )
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format json_schema needs a json_schema object with a "
                "schema",
                field,
            )
        strict = spec.get("strict", False)
        if strict is not None and type(strict) is not bool:
            raise bad_request("response_format strict must be true or false", field)
        return GrammarSpec.json_schema(spec["schema"])
    except GrammarError as e:
        raise bad_request(f"response_format: {one_line(e)}", field) from None


def tool_choice(body: dict, tokenizer):
    """OpenAI's ``tool_choice`` (and ``parallel_tool_calls``) as a grammar: "auto"
    (the default): None; "none": None, and the tools taken out of ``body`` (the
    template does not show them); "required", or ``{"type": "function", "function":
    {"name": N}}``: a `mlx_mtp.grammar.tool_calls` grammar (one call when
    ``parallel_tool_calls`` is false). A 400 naming the field for anything else,
    for a forced call without tools, or for a model whose tool-call format cannot be
    forced."""
    from .grammar import GrammarError, check_grammar, tool_calls

    choice, field = body.get("tool_choice"), "tool_choice"
    parallel = body.get("parallel_tool_calls", True)
    if type(parallel) is not bool:
        raise bad_request(
            "parallel_tool_calls must be true or false", "parallel_tool_calls"
        )
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        body.pop("tools", None)
        return None
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(
                'tool_choice must be "auto", "none", "required" or {"type": '
                '"function", "function": {"name": ...}}',
                field,
            )
        name = function.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.function.name must be a string", field)
    elif choice != "required":
        raise bad_request(
            f'tool_choice {choice!r} is not "auto", "none", "required" or a '
            "function",
            field,
        )
    if body.get("response_format") not in (None, {"type": "text"}):
        raise bad_request(
            "tool_choice: a forced tool call and response_format cannot go together",
            field,
        )
    try:
        spec = tool_calls(body.get("tools"), tokenizer, name, parallel)
        check_grammar(spec, tokenizer)
        return spec
    except GrammarError as e:
        raise bad_request(f"tool_choice: {one_line(e)}", field) from None


def request_options(
    body: dict, defaults: DecodeOptions, vocab_size: int = 2**31
) -> DecodeOptions:
    """The decode options of a request: ``defaults`` (the server's), then the
    request's own fields: the sampling settings and ``seed`` (checked already by
    `check_sampling`), ``max_completion_tokens`` or else ``max_tokens``, and
    `DRAFTING_FIELDS`, which are taken out of ``body``, `PROCESSOR_FIELDS` (0: off;
    ``logit_bias`` as `logit_bias` reads it, over ``vocab_size`` tokens) and
    ``response_format`` (`response_format`). A value `DecodeOptions.check` refuses
    is a 400 naming the field; ``draft_vocab`` is given as
    `mlx_mtp.draft_vocab.parse` reads it."""
    from .draft_vocab import parse

    changes = {}  # option -> (field, value)
    for field, name in SAMPLING_FIELDS.items():
        if field in body:
            changes[name] = (field, body[field])
    if body.get("seed") is not None:
        changes["seed"] = ("seed", body["seed"])
    for field in ("max_tokens", "max_completion_tokens"):  # the latter wins
        if body.get(field) is not None:
            changes["max_tokens"] = (field, body[field])
    for field in DRAFTING_FIELDS:
        if field in body:
            changes[field] = (field, body.pop(field))
    for field in PROCESSOR_FIELDS:
        value = body.get(field)
        if field == "logit_bias":
            value = logit_bias(value, vocab_size)
        if value is not None and (value != 0 or field.endswith("_size")):
            changes[field] = (field, value)
    grammar = response_format(body.get("response_format"))
    if grammar is not None:
        changes["grammar"] = ("response_format", grammar)
    options = defaults
    for name, (field, value) in changes.items():
        try:
            if name == "draft_vocab":
                value = parse(value)
            options = options.replace(**{name: value})
        except MTPError as e:  # ``defaults`` are valid: this field is not
            raise option_error(e, name, field) from None
    return options


def key_owner(keys, authorization: str, api_key: str = "") -> Optional[int]:
    """Which of ``keys`` a request presents, in an ``Authorization`` header ("Bearer
    KEY", OpenAI's) or an ``x-api-key`` one ("KEY", Anthropic's): its index, or None.
    Every key is compared, both ways, each in constant time."""
    bearer, plain, owner = authorization.encode(), api_key.encode(), None
    for i, key in enumerate(keys):
        as_bearer = hmac.compare_digest(bearer, f"Bearer {key}".encode())
        as_plain = hmac.compare_digest(plain, key.encode())
        if as_bearer or as_plain:
            owner = i
    return owner


MAX_DEPTH = 100  # levels of nesting a request's JSON may have


ROLES = ("system", "user", "assistant", "tool", "developer")


IMAGE_PARTS = ("image_url", "input_image", "image")  # mlx-lm's image content parts


# apply_chat_template's own parameters, which chat_template_kwargs may not set
TEMPLATE_PARAMETERS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt "
    "continue_final_message tokenize padding truncation max_length return_tensors "
    "return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


def check_origins(origins) -> frozenset:
    """``--allowed-origins`` as browsers spell them (lower case, no trailing slash):
    each an origin (``scheme://host[:port]``), ``null`` or ``*``; anything else is an
    `MTPError`."""
    checked = set()
    for origin in origins:
        spelled = origin.strip().lower().rstrip("/")
        if spelled not in ("*", "null") and not _is_origin(spelled):
            raise MTPError(
                f"--allowed-origins: {origin!r} is not an origin "
                "(scheme://host[:port], 'null' or '*')"
            )
        checked.add(spelled)
    return frozenset(checked)


def _is_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        parts.port  # a malformed port raises
    except ValueError:
        return False
    extra = parts.path or parts.query or parts.fragment or "@" in parts.netloc
    return bool(parts.scheme and parts.hostname) and not extra


def local_origin(origin: str) -> bool:
    """Whether ``origin`` is a page served from this machine: http(s) on localhost, a
    ``*.localhost`` name or a loopback address, any port (Ollama's default)."""
    if not _is_origin(origin):
        return False
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and _local_name(parts.hostname)


def _local_name(name: str) -> bool:
    """localhost, a ``*.localhost`` name (RFC 6761: never leaves the machine) or a
    loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: Optional[str], bound: str) -> bool:
    """Whether a request's ``Host`` is safe from DNS rebinding: none (no browser sends
    none), an IP address (no name to rebind), localhost, a ``*.localhost`` name, or
    ``bound``, the name the server was started on. A page on a name of its own that
    now resolves to 127.0.0.1 sends its own name, and is refused."""
    if not host:
        return True
    try:
        parts = urlsplit("//" + host)
        parts.port
    except ValueError:
        return False
    name = (parts.hostname or "").rstrip(".")
    if not name or parts.path or parts.query or "@" in parts.netloc:
        return False
    if name == bound.lower().rstrip(".") or _local_name(name):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def check_json(value, param: Optional[str] = None) -> None:
    """400 for JSON nested deeper than `MAX_DEPTH` or holding a string that is not
    Unicode text (a lone surrogate, which a ``\\ud800`` escape makes): the chat
    template and the tokenizer would fail on them, deep in a request's serving."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, param)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise bad_request(
                f"the request nests deeper than {MAX_DEPTH} levels", param
            )
        if isinstance(item, dict):
            for key in item:
                _check_text(key, param)
        values = item.values() if isinstance(item, dict) else item
        stack.extend((v, depth + 1) for v in values)


def _check_text(text: str, param: Optional[str]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param or 'the request'} holds a lone surrogate "
            f"({text[e.start]!r}); text must be valid Unicode",
            param,
        ) from None


def check_messages(messages: list, images: bool = False) -> None:
    """400 for any message mlx-lm could not turn into a prompt: each an object with
    a role among `ROLES`, content a string, null or a list of text parts (and, for
    a model that reads ``images``, ``image_url`` parts whose URL is a string: see
    `take_images`; image parts are refused otherwise), and ``tool_calls`` whose
    string arguments are JSON."""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(ROLES)}", "messages"
            )
        _check_content(message.get("content"), where, images)
        calls = message.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, where)


def _check_content(content, where: str, images: bool = False) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string, null or a list of parts", "messages"
        )
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise bad_request(
                f"{where}.content[{j}] must be an object with a type", "messages"
            )
        if kind in IMAGE_PARTS and images:
            if kind != "image_url" or image_url(part) is None:
                raise bad_request(
                    f"{where}.content[{j}] must be an image_url part with a url "
                    "(a data: URL)",
                    "messages",
                )
            continue
        if kind in IMAGE_PARTS:
            raise bad_request(
                f"{where}.content[{j}] is an image: this model takes no images",
                "messages",
            )
        if kind != "text":
            raise bad_request(
                f"{where}.content[{j}] is {kind!r}: only text parts are supported",
                "messages",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}].text must be a string", "messages")


def _check_tool_calls(calls, where: str) -> None:
    """As mlx-lm reads them: a list of objects whose ``function`` (an object) may
    hold ``arguments`` as a JSON string, which it parses."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise bad_request(f"{where}.tool_calls must be a list of objects", "messages")
    for j, call in enumerate(calls):
        function = call.get("function")
        if function is None:
            continue
        if not isinstance(function, dict):
            raise bad_request(
                f"{where}.tool_calls[{j}].function must be an object", "messages"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                check_json(json.loads(arguments), "messages")
            except (ValueError, RecursionError):
                raise bad_request(
                    f"{where}.tool_calls[{j}].function.arguments is not JSON",
                    "messages",
                ) from None


def image_url(part: dict) -> Optional[str]:
    """The URL of an OpenAI ``image_url`` part (``{"url": ...}`` or the string)."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) else None


# Images one request may carry at most (each is bounded by `mlx_mtp.images`).
MAX_IMAGES = 16


def take_images(messages: list, read: bool = True) -> list:
    """The images of checked ``messages``' ``image_url`` parts, in order, read
    (`mlx_mtp.images`: ``data:`` URLs only, bounded before decoding; ``read``
    False: their encoded bytes), each part replaced by ``{"type": "image"}`` for
    the chat template; 400 for an image that cannot be read, a URL that is not a
    ``data:`` URL (the server fetches nothing), or more than `MAX_IMAGES`."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            if len(found) == MAX_IMAGES:
                raise bad_request(
                    f"a request may carry {MAX_IMAGES} images at most", "messages"
                )
            try:
                data = data_url(image_url(part), where)
                found.append(read_image(data, where) if read else data)
            except ImageError as e:
                raise bad_request(one_line(e), "messages") from None
            content[j] = {"type": "image"}
    return found


def check_chat_fields(body: dict, images: bool = False) -> None:
    """400 for chat fields of the wrong shape: ``tools`` a list of OpenAI's tools
    (objects whose ``function`` has a name), ``chat_template_kwargs`` and
    ``role_mapping`` objects (the former not setting `TEMPLATE_PARAMETERS`), and the
    messages (`check_messages`; ``images``: the model reads them)."""
    check_messages(body["messages"], images)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise bad_request("tools must be a list of objects", "tools")
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(
                f"tools[{i}].function.name must be a non-empty string", "tools"
            )
    for field in ("chat_template_kwargs", "role_mapping"):
        if body.get(field) is not None and not isinstance(body[field], dict):
            raise bad_request(f"{field} must be an object", field)
    reserved = TEMPLATE_PARAMETERS.intersection(body.get("chat_template_kwargs") or {})
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
            "chat_template_kwargs",
        )


def prompt_bytes_per_token(tokenizer) -> Optional[int]:
    """The most UTF-8 bytes of prompt text that one token of ``tokenizer`` stands
    for, or None when its pipeline gives no such bound.

    A prompt of B bytes then has at least B / that many tokens. The bound holds for a
    BPE model that never fuses unknown characters into one token, after
    pre-tokenizers that keep every byte (`_keeps_text`) and normalizers that shrink
    the text by a known factor at most (`_normalizer_shrink`): a token stands for at
    most as many bytes as its own UTF-8 spelling in the vocabulary (byte-level and
    ``▁`` spellings only lengthen), an unknown character for at most 4. Added tokens
    that strip the whitespace around them could stand for any length: no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    shrink = _normalizer_shrink(spec.get("normalizer"))
    whole = model.get("type") == "BPE" and (
        model.get("byte_fallback") or not model.get("fuse_unk")
    )
    added = spec.get("added_tokens") or []
    stripping = any(t.get("lstrip") or t.get("rstrip") for t in added)
    if shrink is None or not whole or stripping:
        return None
    if not _keeps_text(spec.get("pre_tokenizer")):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return shrink * max(4, max(len(t.encode("utf-8")) for t in vocab))


def _normalizer_shrink(spec) -> Optional[int]:
    """How many times fewer UTF-8 bytes a normalizer can leave, None if unknown: 1
    for none, Prepend, and Replace by something no shorter; 4 for the Unicode normal
    forms (a 4-byte character can have a 1-byte compatibility form, U+1D400 -> A)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return 4
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = (spec.get("pattern") or {}).get("String")
        content = spec.get("content") or ""
        if pattern and len(content.encode()) >= len(pattern.encode()):
            return 1
    return None


def _keeps_text(spec) -> bool:
    """Whether a pre-tokenizer keeps every byte of the text (splits it, maps bytes
    to characters, spaces to ``▁``)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in spec.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")

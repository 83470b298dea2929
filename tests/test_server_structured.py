"""What agents send to ``mlx-mtp serve``, through the official ``openai`` client:
penalties and logit bias, and ``response_format`` (a JSON schema, any JSON object),
each reply with MTP drafting equal to plain decoding under the same rules, streamed or
not, alone or with other requests in the batch; bad fields are 400s naming them."""

import json
import threading

import jsonschema
import openai
import pytest

from mlx_mtp import generate as mtp_generate
from mlx_mtp.loading import load
from mlx_mtp.server import Server, server_args

MESSAGES = [{"role": "user", "content": "Reply in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "level": {"enum": ["low", "mid", "high"]},
        "ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "maxItems": 3,
        },
    },
    "required": ["name", "level", "ids"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}
PENALTIES = dict(frequency_penalty=0.6, presence_penalty=0.4, logit_bias={"5": 3.0})


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("qwen3_5", predictable=True)


@pytest.fixture(scope="module")
def served(folder):
    server = Server(server_args(model=str(folder), port=0)).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def local(folder):
    return load(str(folder))


def chat(client, k, stream=False, max_tokens=48, **fields):
    extra = {"num_draft_tokens": k, "draft_source": "heads", "draft_vocab": "full"}
    extra.update(fields.pop("extra_body", {}))
    r = client.chat.completions.create(
        model="default_model",
        messages=MESSAGES,
        max_tokens=max_tokens,
        stream=stream,
        extra_body=extra,
        **fields,
    )
    if not stream:
        return r.choices[0].message.content, r.model_extra["mtp"]
    chunks = list(r)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].model_extra.get("mtp")


def test_penalties_and_logit_bias_equal_plain_decoding(client, local):
    """The OpenAI penalties, mlx-lm's repetition penalty and logit_bias: drafted
    replies equal plain ones and `generate` with the same processors, and change the
    reply."""
    model, tokenizer = local
    extra = {"repetition_penalty": 1.3}
    plain, _ = chat(client, 0, **PENALTIES, extra_body=extra)
    drafted, mtp = chat(client, 3, **PENALTIES, extra_body=extra)
    assert drafted == plain and mtp["drafted"] > 0
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    options = dict(PENALTIES, logit_bias={5: 3.0}, repetition_penalty=1.3)
    assert plain == mtp_generate(
        model, tokenizer, prompt, max_tokens=48, num_draft_tokens=0, **options
    )
    assert plain != chat(client, 0)[0]


def test_json_schema_replies_are_valid_and_plain(client):
    plain, _ = chat(client, 0, max_tokens=200, response_format=FORMAT)
    jsonschema.validate(json.loads(plain), SCHEMA)
    drafted, mtp = chat(client, 3, max_tokens=200, response_format=FORMAT)
    assert drafted == plain and mtp["accepted"] > 0
    streamed, _ = chat(client, 3, stream=True, max_tokens=200, response_format=FORMAT)
    assert streamed == plain
    obj, _ = chat(client, 2, max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj), dict)


def test_requests_with_different_rules_batched_together(client):
    """Three requests at once (a schema, penalties, neither): each reply is its lone
    one."""
    asks = [
        dict(max_tokens=200, response_format=FORMAT),
        dict(**PENALTIES),
        dict(),
    ]
    alone = [chat(client, 2, **a)[0] for a in asks]
    got = [None] * len(asks)

    def ask(i):
        got[i] = chat(client, 2, **asks[i])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(response_format={"type": "json_schema", "json_schema": {}}), None),
        (dict(response_format={"type": "xml"}), None),
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            ),
            "wat",
        ),
        (dict(logit_bias={"a": 1}), "logit_bias"),
        (dict(logit_bias={"99999": 1}), "logit_bias"),
        (dict(logit_bias={"3": 500}), "logit_bias"),
        (dict(extra_body={"repetition_penalty": -1}), "repetition_penalty"),
        (
            dict(
                tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f"}}],
            ),
            "no tool calls",
        ),
    ],
)
def test_bad_fields_are_400s(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, 2, **fields)
    field = next(iter(fields)) if "extra_body" not in fields else param
    assert field in str(e.value)
    if param is not None:
        assert param in str(e.value)

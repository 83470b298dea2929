"""``mlx-mtp serve`` with a model that reads images (GLM-OCR): image requests through
the Chat Completions, Messages and Responses APIs answer what `stream_generate`
gives locally for the same image and prompt, alone and batched with text requests;
a follow-up about the same image goes on from its caches, another image with the
same text does not; bad images are 400s and nothing is fetched."""

import base64
import io
import threading

import anthropic
import openai
import pytest
from PIL import Image, ImageDraw

from mlx_mtp.generate import stream_generate
from mlx_mtp.images import image_messages
from mlx_mtp.server import Server, server_args

N = 16


def page(text: str) -> bytes:
    image = Image.new("RGB", (220, 60), "white")
    ImageDraw.Draw(image).text((6, 20), text, fill="black")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


PAGE, OTHER = page("The quick brown fox 1234"), page("Lorem ipsum dolor 5678")


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_with(data: bytes, text: str = "Transcribe.") -> list:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url(data)}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def served(checkpoint):
    path = checkpoint("glm_ocr", True)
    server = Server(server_args(model=str(path), port=0, max_batch=4)).start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)


def local(loaded, images, text="Transcribe.", n=N) -> str:
    model, tokenizer = loaded("glm_ocr", predictable=True)
    prompt = tokenizer.apply_chat_template(
        image_messages(text, len(images)), tokenize=False, add_generation_prompt=True
    )
    pictures = [Image.open(io.BytesIO(d)) for d in images]
    out = stream_generate(model, tokenizer, prompt, images=pictures, max_tokens=n)
    return "".join(r.text for r in out)


def ask(client, messages, n=N, **kw):
    return client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=n, temperature=0, **kw
    )


def test_chat_with_an_image_equals_local(client, loaded):
    r = ask(client, chat_with(PAGE))
    assert r.choices[0].message.content == local(loaded, [PAGE])
    stream = ask(client, chat_with(PAGE), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == local(loaded, [PAGE])


def test_follow_ups_reuse_the_image_only_when_it_is_the_same(client, loaded):
    first = ask(client, chat_with(PAGE, "Read it."))
    prompt = first.usage.prompt_tokens
    follow = chat_with(PAGE, "Read it.") + [
        {"role": "assistant", "content": "Some text."},
        {"role": "user", "content": "Again."},
    ]
    again = ask(client, follow)
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt
    other = ask(client, chat_with(OTHER, "Read it."))  # same tokens, other pixels
    assert other.usage.prompt_tokens == prompt
    assert other.usage.prompt_tokens_details.cached_tokens < prompt
    assert other.choices[0].message.content == local(loaded, [OTHER], "Read it.")
    assert other.choices[0].message.content != first.choices[0].message.content


def test_messages_and_responses_apis_take_images(served, loaded):
    messages = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(PAGE).decode(),
        },
    }
    reply = messages.messages.create(
        model="default_model",
        max_tokens=N,
        messages=[
            {
                "role": "user",
                "content": [block, {"type": "text", "text": "Transcribe."}],
            }
        ],
    )
    assert reply.content[0].text == local(loaded, [PAGE])
    responses = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    out = responses.responses.create(
        model="default_model",
        max_output_tokens=N,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url(PAGE)},
                    {"type": "input_text", "text": "Transcribe."},
                ],
            }
        ],
    )
    assert out.output_text == local(loaded, [PAGE])
    with pytest.raises(anthropic.BadRequestError, match="fetches no URL"):
        messages.messages.create(
            model="default_model",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "http://a/b"},
                        }
                    ],
                }
            ],
        )


def test_concurrent_image_and_text_requests(client, loaded):
    asks = [
        chat_with(PAGE),
        [{"role": "user", "content": "Tell me about foxes."}],
        chat_with(OTHER, "What does it say?"),
        [{"role": "user", "content": "Count to ten."}],
    ]
    out = [None] * len(asks)

    def run(i):
        out[i] = ask(client, asks[i]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model, tokenizer = loaded("glm_ocr", predictable=True)
    text = [
        "".join(
            r.text
            for r in stream_generate(
                model,
                tokenizer,
                tokenizer.apply_chat_template(
                    m, tokenize=False, add_generation_prompt=True
                ),
                max_tokens=N,
            )
        )
        for m in (asks[1], asks[3])
    ]
    assert out == [
        local(loaded, [PAGE]),
        text[0],
        local(loaded, [OTHER], "What does it say?"),
        text[1],
    ]


@pytest.mark.parametrize(
    "part, words",
    [
        ({"type": "image_url", "image_url": {"url": "https://a/b.png"}}, "only data:"),
        (
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
            "only data:",
        ),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
            "base64",
        ),
        ({"type": "image_url", "image_url": {"url": url(PAGE[:200])}}, "not an image"),
        ({"type": "image_url", "image_url": {"url": url(b"hello")}}, "not an image"),
        ({"type": "image_url", "image_url": {}}, "image_url part with a url"),
        ({"type": "input_image", "image_url": url(PAGE)}, "image_url part with a url"),
    ],
)
def test_bad_images_are_400s(client, part, words):
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(openai.BadRequestError, match=words):
        ask(client, messages, 4)


def test_too_many_images_and_huge_ones_are_400s(client):
    many = [{"type": "image_url", "image_url": {"url": url(PAGE)}}] * 17
    with pytest.raises(openai.BadRequestError, match="16 images at most"):
        ask(client, [{"role": "user", "content": many}], 4)
    buf = io.BytesIO()
    Image.new("1", (10_000, 6_000)).save(buf, format="PNG")
    huge = [{"type": "image_url", "image_url": {"url": url(buf.getvalue())}}]
    with pytest.raises(openai.BadRequestError, match="10000x6000 pixels"):
        ask(client, [{"role": "user", "content": huge}], 4)

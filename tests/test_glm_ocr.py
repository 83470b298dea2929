"""GLM-OCR with images: greedy decoding equal to mlx-vlm's plain generation on the same
image and prompt (k = 0..3 and auto, one stream and batched with text rows),
sampling against the target's distribution, the MTP head at image positions against
the numpy reference, and every bad image refused in one line."""

import io
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from PIL import Image, ImageDraw

import mlx_mtp.round as rounds
from mlx_mtp import load
from mlx_mtp.cache import make_caches
from mlx_mtp.cli import main
from mlx_mtp.convert import convert, graft_heads
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import encode_prompt, stream_generate
from mlx_mtp.images import (
    ImageError,
    data_url,
    image_messages,
    prompt_media,
    read_image,
)
from mlx_mtp.media import attach
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .numpy_glm_ocr import forward, rope_index
from .test_sampling import accept_always, chi_square_rejects
from .vision_checks import assert_rows_mix_text_and_images

N = 24


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """A rendered line of text and a solid-colour square, as PNG files."""
    folder = tmp_path_factory.mktemp("images")
    page = Image.new("RGB", (220, 60), "white")
    ImageDraw.Draw(page).text((6, 20), "The quick brown fox 1234", fill="black")
    page.save(folder / "page.png")
    Image.new("RGB", (64, 64), (200, 30, 30)).save(folder / "square.png")
    return folder / "page.png", folder / "square.png"


@pytest.fixture(scope="module")
def ocr(loaded):
    return loaded("glm_ocr", predictable=True)


def chat(tokenizer, text, images):
    return tokenizer.apply_chat_template(
        image_messages(text, images), tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def mlx_vlm_tokens(checkpoint):
    """``tokens(prompt, images, n)``: mlx-vlm's plain greedy generation on the
    fixture (its load skips the MTP layer: strict=False, as its GLM-OCR sanitize
    drops only the release's layer 16)."""
    vlm = pytest.importorskip("mlx_vlm")
    from mlx_vlm.generate.dispatch import stream_generate as vlm_generate

    model, processor = vlm.load(str(checkpoint("glm_ocr", True)), strict=False)

    def tokens(prompt, images, n):
        out = vlm_generate(
            model,
            processor,
            prompt,
            image=[str(p) for p in images],
            max_tokens=n,
            temperature=0.0,
        )
        return [r.token for r in out][:n]

    return tokens


def ours(model, tokenizer, prompt, images, n=N, **options):
    out = list(
        stream_generate(
            model, tokenizer, prompt, images=images, max_tokens=n, **options
        )
    )
    return [r.token for r in out], out[-1].mtp


@pytest.mark.parametrize("k", [0, 1, 2, 3, "auto"])
def test_image_greedy_equals_mlx_vlm(ocr, pictures, mlx_vlm_tokens, k):
    model, tokenizer = ocr
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = mlx_vlm_tokens(prompt, pictures[:1], N)
    tokens, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=k)
    assert tokens == expected
    if k not in (0, "auto"):
        assert 0 < stats.accepted < stats.drafted  # drafts after the image, some kept


def test_two_images_greedy_equals_mlx_vlm(ocr, pictures, mlx_vlm_tokens):
    model, tokenizer = ocr
    prompt = chat(tokenizer, "What is in these?", 2)
    expected = mlx_vlm_tokens(prompt, pictures, N)
    for k in (0, 3):
        assert (
            ours(model, tokenizer, prompt, pictures, num_draft_tokens=k)[0] == expected
        )


def test_batched_rows_mix_text_and_images(ocr, pictures):
    model, tokenizer = ocr
    assert_rows_mix_text_and_images(model, tokenizer, pictures, chat, ours, N)


@pytest.mark.parametrize(
    "rule", [None, pytest.param(accept_always, marks=pytest.mark.slow)]
)
def test_image_sampling_matches_target(ocr, pictures, monkeypatch, rule):
    """The first two tokens after an image, drafted (k=2) and accepted by rejection
    sampling, follow the target's joint distribution (chi-square); a wrong
    acceptance rule (every draft kept) fails the same test."""
    if rule is not None:
        monkeypatch.setattr(rounds, "accept_stochastic", rule)
    model, tokenizer = ocr
    text = chat(tokenizer, "Transcribe.", 1)
    ids, media = prompt_media(model, encode_prompt(tokenizer, text), pictures[:1])
    options = dict(temp=1.0, top_k=6)

    def next_probs(prefix):
        caches = make_caches(model)
        attach(caches, media)
        logits = model.logits(model.hidden(mx.array([prefix]), caches.trunk))[0, -1]
        top = mx.argsort(-logits)[:6]
        p = np.zeros(logits.shape[0])
        p[np.array(top)] = np.array(mx.softmax(logits[top]))
        return p

    p1 = next_probs(ids)
    joint = np.zeros((p1.size, p1.size))
    for a in np.nonzero(p1)[0]:
        joint[a] = p1[a] * next_probs(ids + [int(a)])
    counts, drafted = np.zeros_like(joint), 0
    for seed in range(600):
        steps = mtp_generate_step(
            ids,
            model,
            HEADS,
            media=media,
            num_draft_tokens=2,
            max_tokens=2,
            seed=seed,
            **options,
        )
        (a, _), (b, stats) = [(o.token, o.stats) for o in steps]
        counts[a, b] += 1
        drafted += stats.drafted
    assert drafted >= 600
    assert chi_square_rejects(counts, joint) == (rule is not None)


def test_head_at_image_positions_matches_numpy(ocr, pictures, checkpoint):
    """Teacher-forced trunk and MTP logits over a prompt with an image equal the
    independent reference, whose positions are its own (transformers'
    get_rope_index) and whose image embeddings are the tower's."""
    model, tokenizer = ocr
    text = chat(tokenizer, "Transcribe.", 1)
    ids, media = prompt_media(model, encode_prompt(tokenizer, text), pictures[:1])
    ids = ids + [
        o.token for o in mtp_generate_step(ids, model, media=media, max_tokens=8)
    ]
    caches = make_caches(model)
    attach(caches, media)
    seq = mx.array([ids])
    h = model.hidden(seq, caches.trunk)
    z = model.mtp_forward(0, h[:, :-1], seq[:, 1:], caches.mtp[0])
    main, mtp = np.array(model.logits(h)[0]), np.array(model.logits(z)[0])
    config = model.trunk.config
    grid = [[int(x) for x in g] for g in _grids(model, pictures[:1])]
    positions, delta = rope_index(ids, _config_dict(config), grid)
    assert delta == media.delta
    assert np.array_equal(positions[:, : media.length], np.array(media.positions))
    ref_main, (ref_mtp,) = forward(
        checkpoint("glm_ocr", True), ids, positions, np.array(media.features)
    )
    np.testing.assert_allclose(main, ref_main, atol=1e-4)
    np.testing.assert_allclose(mtp, ref_mtp, atol=1e-4)
    assert (mtp.argmax(-1) == ref_mtp.argmax(-1)).all()
    image = np.array(ids[1:]) == config.image_token_id  # MTP rows reading an image
    assert image.sum() > 8 and (~image).sum() > 8
    # a control: the placeholder's own embedding at those rows changes the head
    plain = forward(checkpoint("glm_ocr", True), ids, positions, None)[1][0]
    assert not np.allclose(plain[image], ref_mtp[image], atol=1e-3)


def _grids(model, images):
    processor = model.__dict__["_image_processor"]
    out = processor(images=[read_image(p) for p in images])
    return out["image_grid_thw"]


def _config_dict(config):
    return {
        "image_token_id": config.image_token_id,
        "vision_config": {
            "spatial_merge_size": config.vision_config.spatial_merge_size
        },
    }


# -- bad images -----------------------------------------------------------------------


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_are_one_line_errors(tmp_path, pictures):
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    with pytest.raises(ImageError, match="notes.png is not an image.*Pillow knows"):
        read_image(text)
    whole = pictures[0].read_bytes()
    with pytest.raises(ImageError, match="not an image that can be read"):
        read_image(whole[: len(whole) // 2], "half.png")
    with pytest.raises(ImageError, match="cannot read the image"):
        read_image(tmp_path / "missing.png")
    huge = png(Image.new("1", (10_000, 6_000)))  # 60 megapixels in a few kB
    assert len(huge) < 100_000
    with pytest.raises(ImageError, match="10000x6000 pixels"):
        read_image(huge, "huge.png")
    with pytest.raises(ImageError, match="only data: URLs"):
        data_url("https://example.com/a.png")
    with pytest.raises(ImageError, match="not valid base64"):
        data_url("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="data:image/"):
        data_url("data:text/plain;base64,aGVsbG8=")
    assert read_image(data_url("data:image/png;base64," + _b64(whole))).size == (
        220,
        60,
    )


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def test_placeholders_must_match_images(ocr, pictures):
    model, tokenizer = ocr
    with pytest.raises(MTPError, match="0 image placeholders for 1 images"):
        ours(model, tokenizer, chat(tokenizer, "Hi", 0), pictures[:1])
    with pytest.raises(MTPError, match="2 image placeholders for 1 images"):
        ours(model, tokenizer, chat(tokenizer, "Hi", 2), pictures[:1])


def test_text_model_refuses_images(loaded, pictures):
    model, tokenizer = loaded("glm4_moe")
    with pytest.raises(MTPError, match="reads no images"):
        ours(model, tokenizer, "hello", pictures[:1])


def test_cli_image(checkpoint, pictures, tmp_path, ocr, mlx_vlm_tokens):
    path = str(checkpoint("glm_ocr", True))
    model, tokenizer = ocr
    runner = CliRunner()
    args = ["generate", "--model", path, "-p", "Transcribe.", "-m", str(N)]
    result = runner.invoke(main, [*args, "--image", str(pictures[0])])
    assert result.exit_code == 0, result.output
    expected = mlx_vlm_tokens(chat(tokenizer, "Transcribe.", 1), pictures[:1], N)
    assert result.stdout.rstrip("\n") == tokenizer.decode(expected)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n broken")
    result = runner.invoke(main, [*args, "--image", str(bad)])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "bad.png" in result.output
    for family in ("glm4_moe", "mimo"):  # a chat template that takes no parts
        text_model = str(checkpoint(family))
        result = runner.invoke(
            main,
            [
                "generate",
                "--model",
                text_model,
                "-p",
                "hi",
                "--image",
                str(pictures[0]),
            ],
        )
        assert result.exit_code == 1 and "reads no images" in result.output


def test_chat_image_command(checkpoint, pictures, ocr):
    """``/image PATH`` attaches an image to the next message, whose reply is what
    decoding the conversation with it gives; a bad path is a one-line error."""
    model, tokenizer = ocr
    path = str(checkpoint("glm_ocr", True))
    lines = f"/image {pictures[0]}\nTranscribe.\n/image nowhere.png\n"
    result = CliRunner().invoke(
        main, ["chat", "--model", path, "-m", "12", "--temp", "0"], input=lines
    )
    assert result.exit_code == 0, result.output
    first = chat(tokenizer, "Transcribe.", 1)
    expected = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, first, images=pictures[:1], max_tokens=12
        )
    )
    assert expected in result.stdout
    assert "(image 1 goes with your next message)" in result.stderr
    assert "cannot read the image nowhere.png" in result.stderr
    assert result.stdout.count(">> ") == 4  # three lines, then end of input


def test_a_quantized_conversion_reads_images(checkpoint, pictures, tmp_path):
    """``convert -q`` keeps the vision tower (in float) and its config; the
    conversion's image replies draft and equal its own plain decoding."""
    src = checkpoint("glm_ocr", True)
    out = convert(str(src), tmp_path / "q4", quantize=True, q_bits=4, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["depth"] == 2
    weights = mx.load(str(out / "model.safetensors"))
    assert not any(k.startswith("vision_tower") and "scales" in k for k in weights)
    assert any(k.startswith("model.layers.0.") and "scales" in k for k in weights)
    assert (out / "preprocessor_config.json").is_file()
    model, tokenizer = load(str(out))
    prompt = chat(tokenizer, "Transcribe.", 1)
    plain = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=0)[0]
    tokens, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=3)
    assert tokens == plain and stats.accepted > 0


def test_graft_onto_an_mlx_vlm_conversion(checkpoint, pictures, tmp_path, ocr):
    """Heads grafted from the release onto mlx-vlm's own conversion of GLM-OCR
    (its names: ``language_model.model.*``, ``vision_tower.*``): image replies as
    from the release."""
    vlm = pytest.importorskip("mlx_vlm")
    src = checkpoint("glm_ocr", True)
    folder = tmp_path / "mlx-vlm"
    folder.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, folder / f.name)
    model, _ = vlm.load(str(src), strict=False)  # its sanitize: its own names
    weights = dict(tree_flatten(model.parameters()))
    assert any(k.startswith("language_model.model.layers.") for k in weights)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    grafted = graft_heads(str(src), str(folder))
    model, tokenizer = load(str(grafted))
    assert model.num_mtp_layers == 1
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = ours(*ocr, prompt, pictures[:1], num_draft_tokens=0)[0]
    assert (
        ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=3)[0] == expected
    )


def test_a_session_with_an_image_goes_to_disk_and_back(ocr, pictures, tmp_path):
    """A conversation about an image, saved as a session file and read back, goes on
    as the one kept in memory (its image features and positions are in the file)."""
    from mlx_mtp import session_files
    from mlx_mtp.speculative import Session

    model, tokenizer = ocr
    prompt = chat(tokenizer, "Transcribe.", 1)
    session = Session()
    list(
        stream_generate(
            model, tokenizer, prompt, images=pictures[:1], max_tokens=8, session=session
        )
    )
    key = session_files.model_key(model)
    session_files.save(session, tmp_path / "s.safetensors", key)
    back = session_files.load(tmp_path / "s.safetensors", key)
    assert back.key == session.key and any(
        str(t).startswith("image:") for t in back.key
    )
    more = tokenizer.encode("<|user|>\nAgain.<|assistant|>\n", add_special_tokens=False)
    a = [
        r.token
        for r in stream_generate(model, tokenizer, more, max_tokens=8, session=session)
    ]
    b = [
        r.token
        for r in stream_generate(
            model, tokenizer, more, max_tokens=8, session=back, num_draft_tokens=3
        )
    ]
    assert a == b


def test_the_same_images_again_skip_the_vision_tower(ocr, pictures, monkeypatch):
    model, tokenizer = ocr
    model.trunk.__dict__.pop("_features_kept", None)  # what earlier tests kept
    ids = encode_prompt(tokenizer, chat(tokenizer, "Hi", 1))
    tower, calls = type(model.trunk.vision_tower), []
    original = tower.__call__
    monkeypatch.setattr(
        tower,
        "__call__",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    first = prompt_media(model, ids, [read_image(pictures[0])])[1]
    again = prompt_media(model, ids, [read_image(pictures[0])])[1]
    other = prompt_media(model, ids, [read_image(pictures[1])])[1]
    assert len(calls) == 2 and again.features is first.features
    assert other.spans[0][2] != first.spans[0][2]


def test_prompt_cache_file_with_images(checkpoint, pictures, tmp_path):
    """``--prompt-cache`` with ``--image``: a later prompt about the same image runs
    only its new tokens; about another image, all of them; the text is the same as
    without the file."""
    path, cache = str(checkpoint("glm_ocr", True)), str(tmp_path / "c.safetensors")
    runner = CliRunner()

    def run(text, image, *extra):
        args = ["generate", "--model", path, "-p", text, "-m", "8", "--image", image]
        result = runner.invoke(main, [*args, "--verbose", *extra])
        assert result.exit_code == 0, result.output
        return result.stdout, result.stderr

    page, square = str(pictures[0]), str(pictures[1])
    run("Transcribe.", page, "--prompt-cache", cache)
    text, stats = run("Transcribe. Then summarize.", page, "--prompt-cache", cache)
    assert text == run("Transcribe. Then summarize.", page)[0]
    assert "prompt cache " in stats and "prompt cache 0 tok" not in stats
    text, stats = run("Transcribe. Then summarize.", square, "--prompt-cache", cache)
    assert text == run("Transcribe. Then summarize.", square)[0]
    assert "prompt cache 0 tok" in stats


def test_images_without_pillow_are_one_line(monkeypatch, pictures):
    """Without the extra (no Pillow), ``--image`` says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "PIL", None)
    result = CliRunner().invoke(
        main, ["generate", "--model", "m", "-p", "hi", "--image", str(pictures[0])]
    )
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "mlx-mtp[vlm]" in result.output

"""Qwen3.5 with images (its vision tower kept beside mlx-lm's text model): greedy
decoding equal to mlx-vlm's plain generation on the same image and prompt (k = 0..3
and auto, one and two images, dense and MoE), batched with text rows, sampling
against the target's distribution, the trunk and MTP head at image positions against
the numpy reference, a quantized conversion, the server, and the refusals of a
checkpoint without a tower or without mlx-vlm."""

import base64
import io
import json

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from PIL import Image, ImageDraw

import mlx_mtp.round as rounds
from mlx_mtp import load
from mlx_mtp.cache import make_caches
from mlx_mtp.cli import main
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import batch_generate, encode_prompt, stream_generate
from mlx_mtp.images import image_messages, prompt_media, read_image, reads_images
from mlx_mtp.media import attach
from mlx_mtp.models import qwen_vision, vlm
from mlx_mtp.server import Server, server_args
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .numpy_glm_ocr import rope_index
from .numpy_qwen_vl import forward
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
def folder(checkpoint):
    def make(family="qwen3_5", dtype="float32"):
        return checkpoint(family, True, vision=True, dtype=dtype)

    return make


@pytest.fixture(scope="module")
def qwen(folder):
    return load(str(folder()))


def chat(tokenizer, text, images):
    return tokenizer.apply_chat_template(
        image_messages(text, images), tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def mlx_vlm_tokens(folder):
    """``tokens(prompt, images, n, family)``: mlx-vlm's plain greedy generation on
    the fixture (its sanitize drops the ``mtp.`` tensors)."""
    vlm_package = pytest.importorskip("mlx_vlm")
    from mlx_vlm.generate.dispatch import stream_generate as vlm_generate

    models = {}

    def tokens(prompt, images, n, family="qwen3_5", dtype="float32"):
        if (family, dtype) not in models:
            path = str(folder(family, dtype))
            models[family, dtype] = vlm_package.load(path, strict=False)
        model, processor = models[family, dtype]
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
def test_image_greedy_equals_mlx_vlm(qwen, pictures, mlx_vlm_tokens, k):
    model, tokenizer = qwen
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = mlx_vlm_tokens(prompt, pictures[:1], N)
    tokens, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=k)
    assert tokens == expected
    if k not in (0, "auto"):
        assert 0 < stats.accepted < stats.drafted  # drafts after the image, some kept


def test_two_images_greedy_equals_mlx_vlm(qwen, pictures, mlx_vlm_tokens):
    model, tokenizer = qwen
    prompt = chat(tokenizer, "What is in these?", 2)
    expected = mlx_vlm_tokens(prompt, pictures, N)
    for k in (0, 3):
        assert (
            ours(model, tokenizer, prompt, pictures, num_draft_tokens=k)[0] == expected
        )


@pytest.mark.slow
def test_moe_image_greedy_equals_mlx_vlm(folder, pictures, mlx_vlm_tokens):
    model, tokenizer = load(str(folder("qwen3_5_moe")))
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = mlx_vlm_tokens(prompt, pictures[:1], N, "qwen3_5_moe")
    for k in (0, 2):
        tokens, _ = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=k)
        assert tokens == expected


@pytest.mark.slow
def test_bfloat16_image_greedy_equals_mlx_vlm(folder, pictures, mlx_vlm_tokens):
    """As released (bfloat16): the tower, the merge and M-RoPE in its dtype."""
    model, tokenizer = load(str(folder(dtype="bfloat16")))
    assert model.trunk.vision_tower.blocks[0].attn.qkv.weight.dtype == mx.bfloat16
    for text, images in (
        ("Transcribe.", pictures[:1]),
        ("What is in these?", pictures),
    ):
        prompt = chat(tokenizer, text, len(images))
        expected = mlx_vlm_tokens(prompt, images, N, dtype="bfloat16")
        for k in (0, 3):
            tokens, _ = ours(model, tokenizer, prompt, images, num_draft_tokens=k)
            assert tokens == expected


def test_batched_rows_mix_text_and_images(qwen, pictures):
    model, tokenizer = qwen
    assert_rows_mix_text_and_images(model, tokenizer, pictures, chat, ours, N)


@pytest.mark.slow  # GLM-OCR's runs in the default suite: the same round and media
@pytest.mark.parametrize("rule", [None, accept_always])
def test_image_sampling_matches_target(qwen, pictures, monkeypatch, rule):
    """The first two tokens after an image, drafted (k=2) and accepted by rejection
    sampling, follow the target's joint distribution (chi-square); a wrong
    acceptance rule (every draft kept) fails the same test."""
    if rule is not None:
        monkeypatch.setattr(rounds, "accept_stochastic", rule)
    model, tokenizer = qwen
    text = chat(tokenizer, "Transcribe.", 1)
    ids, media = prompt_media(model, encode_prompt(tokenizer, text), pictures[:1])

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
            temp=1.0,
            top_k=6,
        )
        (a, _), (b, stats) = [(o.token, o.stats) for o in steps]
        counts[a, b] += 1
        drafted += stats.drafted
    assert drafted >= 600
    assert chi_square_rejects(counts, joint) == (rule is not None)


def test_head_at_image_positions_matches_numpy(qwen, pictures, folder):
    """Teacher-forced trunk and MTP logits over a prompt with an image equal the
    independent reference, whose positions are its own and whose image embeddings
    are the tower's; the placeholder's own embedding at the MTP's image rows (a
    control) changes the head."""
    model, tokenizer = qwen
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
    main_logits, mtp = np.array(model.logits(h)[0]), np.array(model.logits(z)[0])
    config = json.loads((folder() / "config.json").read_text())
    processor = model.__dict__["_image_processor"]
    grid = processor(images=[read_image(pictures[0])])["image_grid_thw"]
    grid = [[int(x) for x in g] for g in grid]
    positions, delta = rope_index(ids, config, grid)
    assert delta == media.delta
    assert np.array_equal(positions[:, : media.length], np.array(media.positions))
    features = np.array(media.features)
    ref_main, ref_mtp = forward(folder(), ids, positions, features)
    np.testing.assert_allclose(main_logits, ref_main, atol=1e-4)
    np.testing.assert_allclose(mtp, ref_mtp, atol=1e-4)
    assert (mtp.argmax(-1) == ref_mtp.argmax(-1)).all()
    image = np.array(ids[1:]) == config["image_token_id"]  # MTP rows reading one
    assert image.sum() > 8 and (~image).sum() > 8
    plain = forward(folder(), ids, positions, None)[1]
    assert not np.allclose(plain[image], ref_mtp[image], atol=1e-3)


def test_a_checkpoint_without_tower_or_mlx_vlm_refuses_images(
    loaded, folder, pictures, monkeypatch, qwen
):
    model, tokenizer = loaded("qwen3_5")  # no vision tower
    assert not reads_images(model)
    with pytest.raises(MTPError, match="has no vision tower"):
        prompt_media(model, [1, 2], pictures[:1])

    def missing():
        raise MTPError(f"{qwen_vision.WHAT} needs mlx-vlm: {vlm.EXTRA}")

    monkeypatch.setattr(qwen_vision, "_config", missing)
    model, tokenizer = load(str(folder()))  # the tower's mlx-vlm is "missing"
    assert not reads_images(model)
    # it decodes text, as the same weights with their tower do (mlx-lm's rope)
    prompt = chat(tokenizer, "Tell me a story about a fox.", 0)
    text = ours(model, tokenizer, prompt, None, num_draft_tokens=0)[0]
    with_tower, tokenizer_2 = qwen
    for k in (0, 2):
        assert (
            ours(with_tower, tokenizer_2, prompt, None, num_draft_tokens=k)[0] == text
        )
    with pytest.raises(MTPError, match=r"needs mlx-vlm: pip install 'mlx-mtp\[vlm\]'"):
        prompt_media(model, [1, 2], pictures[:1])


@pytest.mark.slow  # the default suite's time
def test_a_tower_mlx_vlm_cannot_build_leaves_text(folder, tmp_path, pictures):
    """A vision config mlx-vlm refuses (deepstack layers, which it has not for
    Qwen3.5) loads the text model, and an image gets one line saying why."""
    import shutil

    copy = tmp_path / "deepstack"
    shutil.copytree(folder(), copy)
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    (copy / "config.json").write_text(json.dumps(config))
    model, tokenizer = load(str(copy))
    assert not reads_images(model)
    with pytest.raises(MTPError, match="cannot build the vision tower: deepstack"):
        prompt_media(model, [1, 2], pictures[:1])


def test_cli_image(folder, pictures, qwen, mlx_vlm_tokens):
    model, tokenizer = qwen
    expected = mlx_vlm_tokens(chat(tokenizer, "Transcribe.", 1), pictures[:1], 12)
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(folder()),
            "--image",
            str(pictures[0]),
            "-p",
            "Transcribe.",
            "-m",
            "12",
            "--temp",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert tokenizer.decode(expected) in result.output


@pytest.mark.slow  # the default suite's time; GLM-OCR's run there
def test_a_quantized_conversion_reads_images(folder, pictures, tmp_path, qwen):
    """``convert -q`` keeps the tower (in float) and ``vision_config``; the
    conversion reads images and drafts, equal to its own plain decoding."""
    out = tmp_path / "q"
    convert(str(folder()), str(out), quantize=True, q_bits=8, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert "vision_config" in config and (out / "preprocessor_config.json").exists()
    model, tokenizer = load(str(out))
    assert reads_images(model)
    assert "scales" not in model.trunk.vision_tower.blocks[0].attn.qkv
    assert "scales" in model.trunk.language_model.lm_head
    prompt = chat(tokenizer, "Transcribe.", 1)
    plain = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=0)[0]
    drafted, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=2)
    assert drafted == plain and stats.drafted > 0


# -- the server -----------------------------------------------------------------------


def _png(path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="module")
def served(folder):
    server = Server(server_args(model=str(folder()), port=0, max_batch=4)).start()
    yield server
    server.close()


@pytest.mark.slow  # the default suite's time; GLM-OCR's run there
def test_server_apis_take_images(served, qwen, pictures):
    model, tokenizer = qwen
    prompt = chat(tokenizer, "Transcribe.", 1)
    picture = Image.open(io.BytesIO(pictures[0].read_bytes()))
    expected = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, prompt, images=[picture], max_tokens=16
        )
    )
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    part = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + _png(pictures[0])},
    }
    r = client.chat.completions.create(
        model="default_model",
        messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "Transcribe."}]}
        ],
        max_tokens=16,
        temperature=0,
    )
    assert r.choices[0].message.content == expected
    messages = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": _png(pictures[0]),
        },
    }
    r = messages.messages.create(
        model="default_model",
        messages=[
            {
                "role": "user",
                "content": [block, {"type": "text", "text": "Transcribe."}],
            }
        ],
        max_tokens=16,
    )
    assert r.content[0].text == expected


def test_the_releases_tower_names_load_into_the_tower():
    """The vision tensors of a real release (Qwen3.5-0.8B's weights report in
    tests/golden/qwen3_5.json: its sampled ``model.visual.*`` names and shapes)
    become, through the trunk's sanitize, parameters of the tower built from its
    vision config (depth 12, width 768, as those shapes give it), shape for shape."""
    from mlx.utils import tree_flatten

    from mlx_mtp.models import get_family

    from .test_golden_layouts import GOLDEN, tensors

    doc = json.loads((GOLDEN / "qwen3_5.json").read_text())
    vision = {
        "model_type": "qwen3_5",
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 1024,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    }
    config = {**doc["config"], "vision_config": vision}
    weights = tensors(doc["trunk"])
    visual = {k: v for k, v in weights.items() if k.startswith("model.visual.")}
    assert len(visual) >= 4
    model_class, args_class = get_family(config).trunk_classes(config)
    trunk = model_class(args_class.from_dict(config))
    sanitized = trunk.sanitize(dict(weights))
    assert trunk.vision_tower is not None, trunk.vision_refusal
    params = dict(tree_flatten(trunk.parameters()))
    kept = {k: v for k, v in sanitized.items() if k.startswith("vision_tower.")}
    assert len(kept) == len(visual)
    for key, value in kept.items():
        assert key in params and params[key].shape == value.shape, key


@pytest.mark.slow  # GLM-OCR's runs in the default suite
def test_graft_onto_an_mlx_vlm_conversion(folder, pictures, tmp_path, qwen):
    """Heads grafted from the release onto mlx-vlm's own conversion of Qwen3.5 (its
    names: ``language_model.model.*``, ``vision_tower.*``, its norms shifted):
    image replies as from the release."""
    import shutil

    from mlx.utils import tree_flatten

    from mlx_mtp.convert import graft_heads

    vlm_package = pytest.importorskip("mlx_vlm")
    src = folder()
    out = tmp_path / "mlx-vlm"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    model, _ = vlm_package.load(str(src), strict=False)  # its sanitize: its names
    weights = dict(tree_flatten(model.parameters()))
    assert any(k.startswith("vision_tower.blocks.") for k in weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    model, tokenizer = load(str(graft_heads(str(src), str(out))))
    assert model.num_mtp_layers == 1 and reads_images(model)
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = ours(*qwen, prompt, pictures[:1], num_draft_tokens=0)[0]
    tokens, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=3)
    assert tokens == expected and stats.accepted > 0


@pytest.mark.slow
def test_converting_without_mlx_vlm_says_the_tower_is_left_out(
    folder, tmp_path, monkeypatch, caplog
):
    def missing():
        raise MTPError(f"{qwen_vision.WHAT} needs mlx-vlm: {vlm.EXTRA}")

    monkeypatch.setattr(qwen_vision, "_config", missing)
    out = tmp_path / "text-only"
    with caplog.at_level("WARNING", logger="mlx_mtp"):
        convert(str(folder()), str(out))
    assert "the vision tower is left out: Qwen3.5 image input needs mlx-vlm" in (
        caplog.text
    )
    monkeypatch.undo()
    model, _ = load(str(out))
    assert not reads_images(model) and model.num_mtp_layers == 1
    with pytest.raises(MTPError, match="has no vision tower"):
        prompt_media(model, [1, 2], [])


# -- many prompts with images ---------------------------------------------------------


def alone_text(model, tokenizer, text, images, n):
    prompt = chat(tokenizer, text, len(images))
    out = stream_generate(model, tokenizer, prompt, images=images or None, max_tokens=n)
    return "".join(r.text for r in out)


def test_a_prompts_file_with_images(folder, pictures, qwen, tmp_path):
    """JSONL lines with ``images`` (relative to the file's folder) and without,
    decoded in one batch: each its lone text; the vision tower runs for a prompt
    when it joins, not before."""
    model, tokenizer = qwen
    square = "data:image/png;base64," + _png(pictures[1])
    parts = [
        {"type": "image_url", "image_url": {"url": square}},
        {"type": "text", "text": "What colour is this?"},
    ]
    lines = [
        {"prompt": "Transcribe.", "images": ["page.png"]},
        {"prompt": "Tell me a story about a fox."},
        {"prompt": "What colour is this?", "images": [str(pictures[1])]},
        {"prompt": "What is in these?", "images": ["page.png", "square.png"]},
        {"messages": [{"role": "user", "content": parts}]},
    ]
    for picture in pictures:
        (tmp_path / picture.name).write_bytes(picture.read_bytes())
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["generate", "--model", str(folder()), "--prompts-file", str(path)]
    result = CliRunner().invoke(main, args + ["-m", "12", "--max-batch", "2"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    files = [[tmp_path / "page.png"], [], [pictures[1]], list(pictures)]
    expected = [
        alone_text(model, tokenizer, line["prompt"], images, 12)
        for line, images in zip(lines, files)
    ]
    assert [r["text"] for r in rows[:4]] == expected
    assert expected[0] != expected[2]
    assert rows[4]["text"] == expected[2]  # the same image and question, as a chat
    assert rows[4]["prompt"] == lines[4]["messages"]  # the line as given


@pytest.mark.parametrize(
    "line, words",
    [
        ({"prompt": "Hi.", "images": ["missing.png"]}, "line 1: no image file"),
        ({"prompt": "Hi.", "images": "page.png"}, "must be a list of file paths"),
        (
            {"messages": [{"role": "user", "content": "Hi"}], "images": ["a.png"]},
            "'images' go with a 'prompt'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "http://x/a"}}
                        ],
                    }
                ]
            },
            "line 1: messages[0].content[0]: only data: URLs are read",
        ),
    ],
)
def test_a_bad_images_line_is_one_line_and_exit_2(folder, tmp_path, line, words):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(line) + "\n")
    args = ["generate", "--model", str(folder()), "--prompts-file", str(path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and words in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow  # the default suite's time
def test_images_for_a_text_model_and_unreadable_ones_name_the_line(
    checkpoint, folder, tmp_path
):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    for model_path, image, words in (
        (checkpoint("qwen3_5"), "bad.png", "line 2: this qwen3_5 checkpoint"),
        (folder(), "bad.png", "line 2: " + str(tmp_path / "bad.png")),
    ):
        path = tmp_path / "prompts.jsonl"
        lines = [{"prompt": "Hi."}, {"prompt": "Hi.", "images": [image]}]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        args = ["generate", "--model", str(model_path), "--prompts-file", str(path)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and words in result.output, result.output


def test_an_image_gone_before_its_prompt_joins_fails_that_prompt_only(
    qwen, pictures, tmp_path
):
    """``batch_generate(media=)`` with media made when each prompt joins: an image
    deleted after it was sized fails its prompt (an error result), and the others
    decode as alone."""
    from mlx_mtp.images import pending_media

    model, tokenizer = qwen
    doomed = tmp_path / "doomed.png"
    doomed.write_bytes(pictures[0].read_bytes())
    texts = ["Transcribe.", "Tell me a story about a fox.", "Transcribe."]
    files = [[doomed], [], [pictures[0]]]
    ids, media = [], []
    for text, images in zip(texts, files):
        prompt = encode_prompt(tokenizer, chat(tokenizer, text, len(images)))
        made = pending_media(model, prompt, images) if images else (prompt, None)
        ids.append(made[0])
        media.append(made[1])
    doomed.unlink()
    out = batch_generate(model, tokenizer, ids, max_tokens=12, media=media, max_batch=2)
    assert out.finish_reasons[0] == "error" and "doomed.png" in out.errors[0]
    for i in (1, 2):
        images = files[i]
        assert out.texts[i] == alone_text(model, tokenizer, texts[i], images, 12)

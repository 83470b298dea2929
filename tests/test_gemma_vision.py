"""Gemma 4 pairs reading images: greedy decoding with the assistant equal to mlx-vlm's
plain generation on the same image and prompt (k = 0..3 and auto; the E2B shape with
per-layer inputs, and the 31B shape whose images attend within themselves both ways),
the masks against transformers' rule, prefill chunks that never split an image,
batched rows mixing text and images, sampling in distribution, the refusals, the CLI
and the server."""

import base64
import json

import mlx.core as mx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from PIL import Image, ImageDraw

import mlx_mtp.round as rounds
import mlx_mtp.speculative as speculative
from mlx_mtp import load
from mlx_mtp.cache import make_caches
from mlx_mtp.cli import main
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import encode_prompt, stream_generate
from mlx_mtp.images import image_messages, prompt_media, reads_images
from mlx_mtp.media import attach
from mlx_mtp.models import gemma_vision, vlm
from mlx_mtp.server import Server, server_args
from mlx_mtp.speculative import prefill
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

from .test_sampling import accept_always, chi_square_rejects
from .vision_checks import assert_rows_mix_text_and_images

N = 24
W = 24  # the fixtures' sliding window: wider than an image (16 features), as released
PAIRS = {"e2b": True, "dense": False}  # target kind -> centroid head


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
def paths(tmp_path_factory):
    """``paths(kind) -> (target, assistant)``: a predictable pair with its tower."""
    made = {}

    def get(kind):
        if kind not in made:
            root = tmp_path_factory.mktemp(f"gemma4-{kind}")
            target = write_gemma4(
                root / "t", kind, predictable=True, vision=True, sliding_window=W
            )
            assistant = write_gemma4_assistant(
                root / "a", target, centroids=PAIRS[kind], predictable=True
            )
            made[kind] = target, assistant
        return made[kind]

    return get


@pytest.fixture(scope="module")
def pairs(paths):
    made = {}

    def get(kind):
        if kind not in made:
            target, assistant = paths(kind)
            made[kind] = load(str(target), draft_model=str(assistant))
        return made[kind]

    return get


def chat(tokenizer, text, images):
    return tokenizer.apply_chat_template(
        image_messages(text, images), tokenize=False, add_generation_prompt=True
    )


def transformers_masks(vlm_model):
    """mlx-vlm 0.7.10 opens each image both ways in the full-attention layers too;
    transformers' ``create_masks_for_vision_model`` (the reference, and mlx-mtp)
    keeps them causal: its masks made so."""
    text = vlm_model.language_model.model
    made = text._make_masks

    def masks(h, cache, mm_token_type_ids=None):
        opened, causal = made(h, cache, mm_token_type_ids), made(h, cache, None)
        return [
            c if layer.layer_type == "full_attention" else o
            for layer, o, c in zip(text.layers, opened, causal)
        ]

    text._make_masks = masks


@pytest.fixture(scope="module")
def mlx_vlm_tokens(paths):
    """``tokens(kind, prompt, images, n)``: mlx-vlm's plain greedy generation of the
    target (with transformers' masks)."""
    vlm_package = pytest.importorskip("mlx_vlm")
    from mlx_vlm.generate.dispatch import stream_generate as vlm_generate

    models, made = {}, {}

    def tokens(kind, prompt, images, n=N):
        key = kind, prompt, tuple(map(str, images)), n
        if key in made:
            return made[key]
        if kind not in models:
            models[kind] = vlm_package.load(str(paths(kind)[0]), strict=False)
            transformers_masks(models[kind][0])
        model, processor = models[kind]
        out = vlm_generate(
            model,
            processor,
            prompt,
            image=[str(p) for p in images],
            max_tokens=n,
            temperature=0.0,
        )
        made[key] = [r.token for r in out][:n]
        return made[key]

    return tokens


def ours(model, tokenizer, prompt, images, n=N, **options):
    out = list(
        stream_generate(
            model, tokenizer, prompt, images=images, max_tokens=n, **options
        )
    )
    return [r.token for r in out], out[-1].mtp


@pytest.mark.parametrize("kind", list(PAIRS))
@pytest.mark.parametrize("k", [0, 1, 2, 3, "auto"])
def test_image_greedy_equals_mlx_vlm(pairs, pictures, mlx_vlm_tokens, kind, k):
    model, tokenizer = pairs(kind)
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = mlx_vlm_tokens(kind, prompt, pictures[:1])
    got, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=k)
    assert got == expected
    assert k == 0 or stats.drafted > 0
    assert len(set(got)) > 1  # not one token repeated


def test_two_images_greedy_equals_mlx_vlm(pairs, pictures, mlx_vlm_tokens):
    """Two images of different sizes (the tower runs them one by one, as mlx-vlm
    does), drafted at k = 3 after both."""
    model, tokenizer = pairs("dense")
    prompt = chat(tokenizer, "Compare these.", 2)
    expected = mlx_vlm_tokens("dense", prompt, pictures)
    assert ours(model, tokenizer, prompt, pictures, num_draft_tokens=3)[0] == expected


def test_images_open_both_ways_in_the_sliding_layers_only(pairs, pictures):
    """The masks of a prefill holding two images are transformers' (written here
    from ``create_masks_for_vision_model`` and ``masking_utils``): sliding layers
    AND(window, OR(causal, same image)), full-attention layers causal."""
    model, tokenizer = pairs("dense")
    ids, media = prompt_media(
        model, encode_prompt(tokenizer, chat(tokenizer, "Hi.", 2)), pictures
    )
    text = model.trunk.language_model.model
    seen = {}
    made = type(text)._make_masks

    def recording(self, h, cache):
        seen["masks"] = made(self, h, cache)
        return seen["masks"]

    caches = make_caches(model)
    attach(caches, media)
    type(text)._make_masks = recording
    try:
        model.hidden(mx.array([ids]), caches.trunk)
    finally:
        type(text)._make_masks = made
    T = len(ids)
    block = np.full(T, -1)
    for n, (a, b, _) in enumerate(media.spans):
        block[a:b] = n
    q, k = np.arange(T)[:, None], np.arange(T)[None]
    same = (block[:, None] == block[None]) & (block[:, None] >= 0)
    sliding = (k > q - W) & ((k <= q) | same)
    for layer, mask in zip(text.layers, seen["masks"]):
        if layer.layer_type == "sliding_attention":
            assert np.array_equal(np.array(mask).reshape(T, T), sliding)
        else:
            assert mask == "causal"
    assert (same & (k > q)).sum() > 100  # images did open up


@pytest.mark.parametrize("step", [3, 7])
def test_prefill_chunks_keep_each_image_whole(pairs, pictures, monkeypatch, step):
    """A prompt prefilled in chunks of ``step`` gives the logits of one pass: no
    chunk ends inside an image. Control: chunks that split images change them."""
    model, tokenizer = pairs("dense")
    ids, media = prompt_media(
        model, encode_prompt(tokenizer, chat(tokenizer, "Hi.", 2)), pictures
    )

    def last_logits(step):
        caches = make_caches(model)
        attach(caches, media)
        prefill(model, caches, ids, 0, step)
        return model.logits(model.hidden(mx.array([ids[-1:]]), caches.trunk))[0, -1]

    whole = last_logits(len(ids))
    assert mx.allclose(last_logits(step), whole, atol=1e-4)
    monkeypatch.setattr(speculative, "chunk_end", lambda media, start, end: end)
    assert not mx.allclose(last_logits(step), whole, atol=1e-2)


@pytest.mark.parametrize(  # the E2B shape's: with -m slow (the default suite's time)
    "kind", ["dense", pytest.param("e2b", marks=pytest.mark.slow)]
)
def test_batched_rows_mix_text_and_images(pairs, pictures, kind):
    model, tokenizer = pairs(kind)
    assert_rows_mix_text_and_images(
        model, tokenizer, pictures, chat, ours, N, prefill_step_size=5
    )


@pytest.mark.slow  # the default suite's time; GLM-OCR's runs there
@pytest.mark.parametrize("rule", [None, accept_always])
def test_image_sampling_matches_target(pairs, pictures, monkeypatch, rule):
    """The first two tokens after an image, drafted (k=2) by the assistant and
    accepted by rejection sampling, follow the target's joint distribution
    (chi-square); a wrong acceptance rule (every draft kept) fails the same test."""
    if rule is not None:
        monkeypatch.setattr(rounds, "accept_stochastic", rule)
    model, tokenizer = pairs("dense")
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
        steps = speculative.mtp_generate_step(
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


def test_a_tower_that_cannot_load_leaves_text(tmp_path, pictures, monkeypatch, paths):
    """A tower that does not match its vision config, or one mlx-vlm is missing for,
    loads the text model; an image gets one line saying why."""
    target = write_gemma4(tmp_path / "t", "e2b")  # a placeholder tower
    model, _ = load(str(target))
    assert not reads_images(model)
    with pytest.raises(MTPError, match="does not match its vision_config"):
        prompt_media(model, [1, 2], pictures[:1])

    def missing():
        raise MTPError(f"{gemma_vision.WHAT} needs mlx-vlm: {vlm.EXTRA}")

    monkeypatch.setattr(gemma_vision, "_config", missing)
    model, _ = load(str(paths("e2b")[0]))
    assert not reads_images(model)
    with pytest.raises(MTPError, match=r"needs mlx-vlm: pip install 'mlx-mtp\[vlm\]'"):
        prompt_media(model, [1, 2], pictures[:1])


def test_cli_image(paths, pairs, pictures, mlx_vlm_tokens):
    target, assistant = paths("dense")
    model, tokenizer = pairs("dense")
    expected = mlx_vlm_tokens("dense", chat(tokenizer, "Transcribe.", 1), pictures[:1])
    result = CliRunner().invoke(
        main,
        [
            "generate",
            "--model",
            str(target),
            "--draft-model",
            str(assistant),
            "--image",
            str(pictures[0]),
            "-p",
            "Transcribe.",
            "-m",
            str(N),
            "--temp",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert tokenizer.decode(expected) in result.output


@pytest.mark.slow  # the default suite's time; GLM-OCR's server images run there
def test_server_takes_images(paths, pairs, pictures):
    target, assistant = paths("dense")
    model, tokenizer = pairs("dense")
    prompt = chat(tokenizer, "Transcribe.", 1)
    expected = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, prompt, images=pictures[:1], max_tokens=16
        )
    )
    args = server_args(model=str(target), draft_model=str(assistant), port=0)
    server = Server(args).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        data = base64.b64encode(pictures[0].read_bytes()).decode()
        part = {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + data},
        }
        text = {"type": "text", "text": "Transcribe."}
        r = client.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": [part, text]}],
            max_tokens=16,
            temperature=0,
        )
    finally:
        server.close()
    assert r.choices[0].message.content == expected
    assert r.model_extra["mtp"]["drafted"] > 0


@pytest.mark.slow  # the default suite's time
def test_a_quantized_conversion_reads_images(paths, pictures, tmp_path):
    """``convert -q`` keeps the tower and projector (in float), ``vision_config``
    and the processor's settings; the conversion reads images and drafts with the
    assistant, equal to its own plain decoding."""
    target, assistant = paths("dense")
    out = tmp_path / "q"
    convert(str(target), str(out), quantize=True, q_bits=8, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert "vision_config" in config and (out / "processor_config.json").exists()
    model, tokenizer = load(str(out), draft_model=str(assistant))
    assert reads_images(model)
    layer = model.trunk.vision_tower.encoder.layers[0]
    assert "scales" not in layer.self_attn.q_proj.linear
    assert "scales" not in model.trunk.embed_vision.embedding_projection
    prompt = chat(tokenizer, "Transcribe.", 1)
    plain = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=0)[0]
    drafted, stats = ours(model, tokenizer, prompt, pictures[:1], num_draft_tokens=2)
    assert drafted == plain and stats.drafted > 0


def test_the_releases_tower_names_load_into_the_tower():
    """The tower of a released E2B / E4B (transformers' ``Gemma4VisionModel`` at its
    defaults, as those checkpoints use it: 16 layers 768 wide, a 2 x 10240 position
    table, clipped linears with their bounds) is, through the trunk's renaming,
    the tower mlx-vlm builds from that vision config, name for name and shape for
    shape (zero-stride arrays: no memory)."""
    config = {"model_type": "gemma4_vision", "use_clipped_linears": True}
    vision = gemma_vision._config().VisionConfig.from_dict(config)
    tower = gemma_vision._vision().VisionModel(vision)
    projector = gemma_vision._model().MultimodalEmbedder(768, 1536)

    def zeros(*shape):
        return mx.broadcast_to(mx.zeros((), mx.bfloat16), shape)

    p = "model.vision_tower."
    weights = {
        f"{p}patch_embedder.input_proj.weight": zeros(768, 768),
        f"{p}patch_embedder.position_embedding_table": zeros(2, 10240, 768),
        "model.embed_vision.embedding_projection.weight": zeros(1536, 768),
    }
    linears = {f"self_attn.{n}_proj": (768, 768) for n in "qkvo"}
    linears.update({"mlp.gate_proj": (3072, 768), "mlp.up_proj": (3072, 768)})
    linears["mlp.down_proj"] = (768, 3072)
    for i in range(16):
        b = f"{p}encoder.layers.{i}."
        for name, shape in linears.items():
            weights[f"{b}{name}.linear.weight"] = zeros(*shape)
            for bound in gemma_vision.CLIPPING:
                weights[f"{b}{name}.{bound}"] = zeros()
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            weights[f"{b}{norm}.weight"] = zeros(64)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            weights[f"{b}{norm}.weight"] = zeros(768)
    renamed = gemma_vision._renamed(weights, vision.use_clipped_linears)
    assert gemma_vision._mismatch(renamed, tower, projector) is None
    renamed["vision_tower.encoder.layers.3.mlp.up_proj.linear.weight"] = zeros(8, 768)
    assert "mlp.up_proj.linear.weight is (8, 768)" in gemma_vision._mismatch(
        renamed, tower, projector
    )


@pytest.mark.parametrize("kind", list(PAIRS))
def test_draft_steps_after_an_image_match_the_numpy_reference(
    pairs, paths, kind, pictures
):
    """Two chained assistant steps after a prompt with an image (its window full of
    the image's keys and values), reading the trunk's caches in place, equal
    transformers' math in float64 (`tests/numpy_gemma4.py`), fed every position's
    keys and values of the same layers from a plain cache of the same prefill."""
    from mlx_lm.models.cache import KVCache

    from mlx_mtp.cache import assistant_kv
    from mlx_mtp.media import MediaCache

    from .numpy_gemma4 import assistant_step

    model, tokenizer = pairs(kind)
    target, assistant = paths(kind)
    text = chat(tokenizer, "Transcribe.", 1)
    ids, media = prompt_media(model, encode_prompt(tokenizer, text), pictures[:1])
    history = [KVCache() for _ in model.trunk.make_cache()[:-1]] + [MediaCache()]
    history[-1].set(media)
    h = model.hidden(mx.array([ids]), history)  # (1, P, H)
    kv_all = {
        kind: tuple(np.array(a[0], np.float64) for a in history[i].keys_and_values())
        for kind, i in model.reads.items()
    }
    caches = make_caches(model)
    attach(caches, media)
    mx.eval(model.hidden(mx.array([ids]), caches.trunk))
    kv = assistant_kv(model, caches.trunk)
    hidden, ref_hidden = h[:, -1:], np.array(h[0, -1], np.float64)
    for token in (7, 300):  # the pending token, then a draft
        logits, hidden = model.assist(mx.array([[token]]), hidden, kv, len(ids))
        ref_logits, ref_hidden = assistant_step(
            assistant, target, token, ref_hidden, kv_all, len(ids)
        )
        np.testing.assert_allclose(np.array(logits[0, 0]), ref_logits, atol=1e-4)
        np.testing.assert_allclose(np.array(hidden[0, 0]), ref_hidden, atol=1e-4)
        assert int(mx.argmax(logits[0, 0])) == int(np.argmax(ref_logits))

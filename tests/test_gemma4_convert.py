"""Gemma 4 pairs in the converter and on the command line: an assistant converted
alone, beside its target (float; 4-bit target with an 8-bit assistant), grafted onto
an MLX conversion of the target, checked; plain mlx-lm loads the target of every pair
folder; mismatched pairs are refused in one line each."""

import fnmatch
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm import load as lm_load
from mlx_lm.generate import generate_step

from mlx_mtp.cli import main
from mlx_mtp.convert import check, convert, graft_assistant
from mlx_mtp.convert.check import assistant_predictions
from mlx_mtp.errors import MTPError
from mlx_mtp.images import no_images, reads_images
from mlx_mtp.loading import load_model
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_llama
from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

PROMPT = [5, 77, 301, 12, 9, 140, 88, 2, 40, 41, 42, 43]
N = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("g4")
    target = write_gemma4(root / "target", "e2b", predictable=True)
    assistant = write_gemma4_assistant(
        root / "assistant", target, centroids=True, predictable=True
    )
    return target, assistant


def tokens(model, k):
    steps = mtp_generate_step(PROMPT, model, HEADS, num_draft_tokens=k, max_tokens=N)
    return [o.token for o in steps]


def plain(model):
    steps = generate_step(mx.array(PROMPT), model.trunk, max_tokens=N)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("precision", ["float", "q4"])
def test_pair_folder_round_trip(pair, precision, tmp_path):
    """``convert --draft-hf-path``: the folder alone runs the pair exactly (the same
    tokens as the source pair in float), its assistant is 8-bit beside a 4-bit
    target, and plain mlx-lm loads the target and decodes as the pair does."""
    target, assistant = pair
    options = {"float": {}, "q4": dict(quantize=True, q_bits=4)}[precision]
    out = convert(
        str(target),
        tmp_path / "pair",
        draft_hf_path=str(assistant),
        progress=False,
        **options,
    )
    config = json.loads((out / "config.json").read_text())
    section = config["assistant"]
    assert (out / section["file"]).is_file()
    assert (section["quantization"] or {}).get("bits") == (
        8 if precision == "q4" else None
    )
    model = load_model(str(out))[0]
    assert model.assistant is not None
    expected = plain(model)
    for k in (1, 3):
        assert tokens(model, k) == expected
    if precision == "float":
        source = load_model(str(target), draft_model=str(assistant))[0]
        assert expected == plain(source)
        ours = assistant_predictions(model, PROMPT * 4)
        theirs = assistant_predictions(source, PROMPT * 4)
        assert np.array_equal(ours, theirs)
    lm_model, _ = lm_load(str(out))
    steps = generate_step(mx.array(PROMPT), lm_model, max_tokens=N)
    assert [int(t) for t, _ in steps] == expected


def test_assistant_alone_and_graft(pair, tmp_path):
    """An assistant converted alone (8-bit with -q) drafts for the target by
    ``--draft-model``; grafted onto a conversion of the target, the folder runs the
    pair; both decode as the target does, and graft keeps ``vision_config``."""
    target, assistant = pair
    alone = convert(str(assistant), tmp_path / "a", quantize=True, progress=False)
    config = json.loads((alone / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["model_type"].endswith(
        "assistant"
    )
    bare = convert(str(target), tmp_path / "t", progress=False)
    model = load_model(str(bare), draft_model=str(alone))[0]
    expected = plain(model)
    assert tokens(model, 2) == expected
    config = json.loads((bare / "config.json").read_text())
    config["vision_config"] = {"model_type": "gemma4_vision"}  # as mlx-vlm keeps it
    (bare / "config.json").write_text(json.dumps(config))
    graft_assistant(str(assistant), str(bare))
    config = json.loads((bare / "config.json").read_text())
    assert config["vision_config"] and config["assistant"]["provenance"]["grafted"]
    model = load_model(str(bare))[0]
    assert model.assistant is not None and tokens(model, 3) == expected
    with pytest.raises(MTPError, match="already has an assistant"):
        graft_assistant(str(assistant), str(bare))


def test_graft_from_the_hub_fetches_only_config_and_weights(
    pair, tmp_path, monkeypatch
):
    import mlx_lm.utils

    target, assistant = pair
    requests = []

    def fake_download(repo, revision=None, allow_patterns=None):
        requests.append(list(allow_patterns))
        cache = tmp_path / "hub-cache"
        cache.mkdir(exist_ok=True)
        for f in assistant.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, cache / f.name)
        return cache

    monkeypatch.setattr(mlx_lm.utils, "_download", fake_download)
    bare = convert(str(target), tmp_path / "t", progress=False)
    result = CliRunner().invoke(
        main, ["graft", "--from", "google/tiny-assistant", "--mlx-path", str(bare)]
    )
    assert result.exit_code == 0, result.output
    fetched = sorted(p.name for p in (tmp_path / "hub-cache").iterdir())
    assert "tokenizer.json" not in fetched and "model.safetensors" in fetched


def test_check_reports_agreement_and_catches_a_broken_assistant(pair, tmp_path):
    target, assistant = pair
    out = convert(str(target), tmp_path / "pair", draft_hf_path=str(assistant))
    report = check(str(out))
    assert report.passed and report.agreement == 1.0 and report.tokens > 100
    assert 0 < report.self_agreement <= 1
    text = "\n".join(report.lines())
    assert "centroid head" in text and "acceptance proxy" in text
    # a pre_projection written with its rows reversed: the drafts go elsewhere
    from mlx_mtp import assistant as assistants

    weights = mx.load(str(out / assistants.ASSISTANT_FILE))
    weights["pre_projection.weight"] = weights["pre_projection.weight"][::-1]
    mx.save_safetensors(str(out / assistants.ASSISTANT_FILE), weights)
    assert not check(str(out)).passed
    result = CliRunner().invoke(main, ["check", str(out)])
    assert result.exit_code == 1 and "FAIL" in result.output


def test_teacher_forced_predictions_equal_decode_steps(pair):
    """The one-pass teacher-forced drafts of `check` (masks over the whole history)
    equal the decode path's steps (window caches read in place)."""
    from mlx_mtp.cache import assistant_kv, make_caches

    target, assistant = pair
    model = load_model(str(target), draft_model=str(assistant))[0]
    seq = list(range(60, 90))
    batched = assistant_predictions(model, seq)
    caches = make_caches(model)
    for i in (0, 5, 17, 28):  # row i: token t_{i+1} at position i + 1
        caches = make_caches(model)
        h = model.hidden(mx.array(seq[: i + 1])[None], caches.trunk)
        kv = assistant_kv(model, caches.trunk)
        logits, _ = model.assist(mx.array([[seq[i + 1]]]), h[:, -1:], kv, i + 1)
        assert int(mx.argmax(logits[0, 0])) == batched[i]


# --- mismatched pairs --------------------------------------------------------------


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        section = config
        *parents, leaf = key.split(".")
        for p in parents:
            section = section[p]
        section[leaf] = value
    path.write_text(json.dumps(config))


@pytest.fixture
def copies(pair, tmp_path):
    target, assistant = pair
    return (
        shutil.copytree(target, tmp_path / "target"),
        shutil.copytree(assistant, tmp_path / "assistant"),
    )


def refused(target, assistant, match):
    with pytest.raises(MTPError, match=match) as e:
        load_model(str(target), draft_model=str(assistant))
    assert "\n" not in str(e.value)
    out = CliRunner().invoke(
        main,
        ["generate", "--model", str(target), "--draft-model", str(assistant)]
        + ["-p", "hi", "-m", "2"],
    )
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.output.count("\n") == 1, out.output


def test_refuses_another_backbone_width(copies):
    target, assistant = copies
    edit_config(assistant, backbone_hidden_size=128)
    refused(target, assistant, "hidden size 128; this target's is 64")


def test_refuses_another_vocabulary(copies):
    target, assistant = copies
    edit_config(assistant, **{"text_config.vocab_size": 1024})
    refused(target, assistant, "vocabulary of 1024 tokens; the target's has 512")


def test_refuses_another_tokenizer(copies):
    target, assistant = copies
    tok = json.loads((assistant / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (assistant / "tokenizer.json").write_text(json.dumps(tok))
    refused(target, assistant, "tokenizer .* is not the target's")


def test_refuses_a_target_without_the_layer_types_it_reads(copies, tmp_path):
    _, assistant = copies
    full = ["full_attention"] * 6
    target = write_gemma4(tmp_path / "all-full", "dense", layer_types=full)
    refused(target, assistant, "reads the target's sliding attention layers")


def test_refuses_a_unified_assistant_on_a_gemma4_target(copies):
    target, assistant = copies
    edit_config(assistant, model_type="gemma4_unified_assistant")
    refused(target, assistant, "drafts for gemma4_unified")


def test_refuses_what_is_not_an_assistant_and_an_assistant_as_model(copies, tmp_path):
    target, assistant = copies
    llama = write_llama(tmp_path / "llama", heads=True)
    refused(target, llama, "is neither a Gemma 4 assistant")
    refused(llama, assistant, "drafts for gemma4 or gemma4_text targets")
    out = CliRunner().invoke(
        main, ["generate", "--model", str(assistant), "-p", "hi", "-m", "2"]
    )
    assert out.exit_code == 1 and "is a Gemma 4 assistant" in out.output


def test_convert_refuses_a_mismatched_pair_before_writing(copies, tmp_path):
    target, assistant = copies
    edit_config(assistant, backbone_hidden_size=128)
    with pytest.raises(MTPError, match="hidden size"):
        convert(str(target), tmp_path / "out", draft_hf_path=str(assistant))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_generate_pair_folder_and_draft_model(pair, tmp_path):
    """As a new user runs them: ``--model PAIR`` and ``--model T --draft-model A``
    print the same text as ``-k 0``."""
    target, assistant = pair
    out = convert(str(target), tmp_path / "pair", draft_hf_path=str(assistant))
    base = ["generate", "-p", "def f(x):", "-m", "60", "--quiet"]
    runs = [
        CliRunner().invoke(main, base + ["--model", str(out), "-k", "3"]),
        CliRunner().invoke(
            main,
            base + ["--model", str(target), "--draft-model", str(assistant)],
        ),
        CliRunner().invoke(main, base + ["--model", str(out), "-k", "0"]),
    ]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].output == runs[1].output == runs[2].output
    assert len(runs[0].output) > 20


def test_damaged_or_missing_assistant_file(pair, tmp_path):
    from mlx_mtp import assistant as assistants
    from mlx_mtp.errors import MissingHeadsError

    target, assistant = pair
    out = convert(str(target), tmp_path / "pair", draft_hf_path=str(assistant))
    path = out / assistants.ASSISTANT_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(MTPError, match="assistant.safetensors") as e:
        load_model(str(out))
    assert "\n" not in str(e.value)
    path.unlink()
    with pytest.raises(MissingHeadsError, match="--allow-missing-heads"):
        load_model(str(out))
    model = load_model(str(out), allow_missing_heads=True)[0]
    assert model.assistant is None and tokens(model, 2) == plain(model)


def test_unified_pair_with_transformers_defaults(pair, tmp_path):
    """A ``gemma4_unified`` target with a ``gemma4_unified_assistant``, their configs
    leaving out what equals transformers' unified defaults (no per-layer inputs, a
    window of 1024, no double-wide MLP, no soft-capping): read as transformers
    reads them, the pair decodes as plain decoding."""
    target = write_gemma4(tmp_path / "t", "dense", predictable=True)
    assistant = write_gemma4_assistant(tmp_path / "a", target, predictable=True)
    for folder, model_type in ((target, "gemma4_unified"), (assistant, None)):
        config = json.loads((folder / "config.json").read_text())
        text = config["text_config"]
        text["model_type"] = "gemma4_unified_text"
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            text.pop(key)
        text.pop("use_double_wide_mlp")
        text["sliding_window"] = 1024
        config["model_type"] = model_type or "gemma4_unified_assistant"
        (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(target), draft_model=str(assistant))[0]
    assert model.trunk.language_model.args.hidden_size_per_layer_input == 0
    assert model.assistant.args.sliding_window == 1024
    assert tokens(model, 3) == plain(model)
    assert not reads_images(model) and "encoder-free vision" in no_images(model)
    with pytest.raises(MTPError, match="drafts for gemma4 or gemma4_text"):
        edit_config(assistant, model_type="gemma4_assistant")
        load_model(str(target), draft_model=str(assistant))

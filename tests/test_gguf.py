"""GGUF input: a tiny llama checkpoint written as llama.cpp would, converted back."""

import errno
import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.convert import convert
from mlx_mtp.errors import DiskFullError, MTPError
from mlx_mtp.heads import source_fingerprint
from mlx_mtp.loading import load
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_llama

from .gguf_writer import (
    ARRAY,
    F32,
    Q8_0,
    STRING,
    U32,
    header,
    kv,
    permute,
    tensor_info,
    write_gguf,
)

GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
NEXTN = {
    "enorm": "enorm",
    "hnorm": "hnorm",
    "eh_proj": "eh_proj",
    "shared_head.norm": "shared_head_norm",
}
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
    """A tiny llama checkpoint with one DeepSeek-style MTP layer at model.layers.2."""
    return write_llama(tmp_path_factory.mktemp("llama-hf"), heads=True)


def vocab_size(tok: dict) -> int:
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok["added_tokens"]]
    return 1 + max(ids)


def to_gguf(hf, path, quantize=False, extra=None):
    """Write ``hf`` as llama.cpp does: GGUF names, permuted q/k, tokenizer metadata
    (and the metadata ``extra``)."""
    config = json.loads((hf / "config.json").read_text())
    tok = json.loads((hf / "tokenizer.json").read_text())
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    weights = {
        k: np.array(v) for k, v in mx.load(str(hf / "model.safetensors")).items()
    }
    tensors = {}
    for name, w in weights.items():
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            if module in NEXTN:
                tensors[f"blk.{i}.nextn.{NEXTN[module]}.{leaf}"] = w
                continue
            if module == "self_attn.q_proj":
                w = permute(w, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = permute(w, config["num_key_value_heads"])
            tensors[f"blk.{i}.{GGUF_NAMES[module]}.{leaf}"] = w
    tokens = [None] * vocab_size(tok)
    for t, i in tok["model"]["vocab"].items():
        tokens[i] = t
    specials = {a["id"] for a in tok["added_tokens"]}
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    eos = tokens.index(tok_config["eos_token"])
    meta = {
        "general.architecture": "llama",
        "llama.block_count": config["num_hidden_layers"] + 1,
        "llama.nextn_predict_layers": 1,
        "llama.context_length": config["max_position_embeddings"],
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "llama.rope.freq_base": config["rope_theta"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [
            3 if i in specials else 1 for i in range(len(tokens))
        ],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eos,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.chat_template": tok_config["chat_template"],
        **(extra or {}),
    }
    big = {k for k, v in tensors.items() if v.ndim == 2 and v.shape[1] % 32 == 0}
    write_gguf(path, meta, tensors, quantize=big if quantize else ())
    return path


def greedy(model, ids, k, n=40):
    return [
        o.token
        for o in mtp_generate_step(ids, model, HEADS, num_draft_tokens=k, max_tokens=n)
    ]


def test_gguf_f32_converts_to_the_same_model(llama_hf, tmp_path):
    gguf = to_gguf(llama_hf, tmp_path / "tiny.gguf")
    out = convert(str(gguf), tmp_path / "mlx", progress=False)
    ref, ref_tok = load(str(llama_hf))
    model, tok = load(str(out))
    for text in ("Hello world!", "def add(a, b):\n    return a + b\n", "héllo 42"):
        assert tok.encode(text) == ref_tok.encode(text)
    assert tok.chat_template == ref_tok.chat_template
    config = json.loads((out / "config.json").read_text())
    assert config["mlx_mtp"]["source"] == str(gguf.resolve())
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] is True
    ids = ref_tok.encode(PROMPT)
    seq = mx.array(ids)[None]
    np.testing.assert_allclose(
        np.array(model(seq)), np.array(ref(seq)), atol=1e-5
    )  # q/k rows were un-permuted
    assert model.num_mtp_layers == 1  # blk.2.nextn.* became the MTP head
    expected = greedy(ref, ids, 0)
    assert greedy(model, ids, 0) == expected == greedy(model, ids, 2)


def test_gguf_q8_0_is_dequantized(llama_hf, tmp_path):
    gguf = to_gguf(llama_hf, tmp_path / "tiny-q8.gguf", quantize=True)
    out = convert(str(gguf), tmp_path / "mlx", progress=False)
    ref = load(str(llama_hf))[0]
    model = load(str(out))[0]
    q_ref = np.array(ref.trunk.model.layers[0].self_attn.q_proj.weight)
    q = np.array(model.trunk.model.layers[0].self_attn.q_proj.weight)
    step = np.abs(q_ref).max() / 127
    assert np.abs(q - q_ref).max() <= step  # un-permuted on the quantized path too
    assert model.trunk.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32


def test_gguf_errors(tmp_path):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    bad = tmp_path / "bad.gguf"
    write_gguf(
        bad, {"general.architecture": "gpt2"}, {"token_embd.weight": np.zeros((4, 32))}
    )
    result = CliRunner().invoke(
        main, ["convert", "--hf-path", str(bad), "--mlx-path", str(tmp_path / "o")]
    )
    assert (
        result.exit_code == 1
        and "architecture 'gpt2' is not supported" in result.output
    )
    assert not (tmp_path / "o").exists() and [p.name for p in tmp_path.iterdir()] == [
        "bad.gguf"
    ]
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + b"\0" * 10)
    result = CliRunner().invoke(
        main,
        ["convert", "--hf-path", str(truncated), "--mlx-path", str(tmp_path / "o")],
    )
    assert result.exit_code == 1 and "cannot read" in result.output


def crafted_files() -> dict:
    """Broken GGUF files that crashed MLX's native reader (string and key lengths,
    dimension and tensor counts), or would have a reader read past the file, or
    misread it: name -> (bytes, what the one-line error says)."""
    q = struct.pack
    pad = b"\0" * 64  # what a length or count claims more than
    arch = kv("general.architecture", "llama")
    data = np.zeros((2, 32), np.float32).tobytes()
    valid = header(1, 1, arch, tensor_info("token_embd.weight", [32, 2], F32, 0))

    def entry(key: bytes, kind: int, value: bytes = b"") -> bytes:
        return q("<Q", len(key)) + key + q("<I", kind) + value

    def tensor(dims, kind=F32, offset=0, body=data):
        info = tensor_info("token_embd.weight", dims, kind, offset)
        return header(1, 1, arch, info) + body

    many_dims = q("<Q", 1) + b"t" + q("<I", 1000) + q("<Q", 1) * 1000 + q("<IQ", F32, 0)
    return {
        "string-2^62": (
            header(0, 1, entry(b"name", STRING, q("<Q", 1 << 62) + pad)),
            "4611686018427387904 bytes, past the end",
        ),
        "key-2^40": (header(0, 1, q("<Q", 1 << 40) + b"general.name" + pad), "past"),
        "1000-dims": (header(1, 0, b"", many_dims) + data, "1000 dimensions"),
        "tensors-2^60": (header(1 << 60, 0) + pad, "1152921504606846976 tensors"),
        "kv-2^60": (header(0, 1 << 60) + pad, "metadata entries"),
        "array-2^50": (
            header(0, 1, entry(b"a", ARRAY, q("<IQ", U32, 1 << 50) + pad)),
            "past the end",
        ),
        "strings-2^50": (
            header(0, 1, entry(b"a", ARRAY, q("<IQ", STRING, 1 << 50) + pad)),
            "strings in 'a'",
        ),
        "nested-array": (
            header(0, 1, entry(b"a", ARRAY, q("<IQ", ARRAY, 1) + pad)),
            "nested",
        ),
        "too-short": (b"GGUF" + b"\0" * 10, "too short"),
        "truncated-header": ((valid + data)[:40], "past the end"),
        "truncated-data": ((valid + data)[:-8], "past the end"),
        "data-past-eof": (tensor([32, 2], offset=1 << 40), "past the end"),
        "misaligned": (tensor([32, 1], offset=8), "not 32-aligned"),
        "dims-overflow": (tensor([2**31 - 1] * 4), "past the end"),
        "dim-2^32": (tensor([1 << 32, 1]), "dimension out of range"),
        "zero-dim": (tensor([32, 0]), "dimension out of range"),
        "partial-block": (tensor([33, 1], kind=Q8_0), "not whole 32-blocks"),
        "version-1": (header(0, 0, version=1), "version 1 is not supported"),
        "version-99": (header(0, 0, version=99), "version 99 is not supported"),
        "value-type-99": (header(0, 1, entry(b"a", 99) + pad), "value type 99"),
        "ggml-type-99": (tensor([32, 2], kind=99), "ggml type 99"),
        "alignment-3": (
            header(0, 1, entry(b"general.alignment", U32, q("<I", 3))),
            "not a power of two",
        ),
        "key-twice": (header(0, 2, arch + arch), "appears twice"),
        "key-not-utf8": (header(0, 1, entry(b"\xff", U32, q("<I", 1))), "UTF-8"),
    }


# Runs each crafted file through the CLI in one process (a native crash ends it with
# 139 or 134 and shows as such): one JSON line per file, exit code and stderr.
CLI_LOOP = """
import contextlib, io, json, sys
from mlx_mtp.cli import run
for src in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run(["convert", "--hf-path", src, "--mlx-path", src + ".out"])
            code = 0
        except SystemExit as e:
            code = e.code
    print(json.dumps([src, code, err.getvalue()]), flush=True)
"""


def test_crafted_gguf_files_are_one_line_errors(tmp_path):
    """Every length, count, dimension, type and offset in a GGUF header is checked in
    Python before a native reader sees the file: a crafted file is one line (exit 1),
    no traceback, the source untouched and nothing left beside the output path."""
    cases, paths = crafted_files(), []
    for name, (blob, _) in cases.items():
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / f"{name}.gguf")
        paths[-1].write_bytes(blob)
    proc = subprocess.run(
        [sys.executable, "-c", CLI_LOOP, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases)
    for (src, code, err), (name, (blob, says)) in zip(results, cases.items()):
        assert code == 1, (name, err)
        assert err.startswith("mlx-mtp: error: cannot read") and says in err, name
        assert err.count("\n") == 1 and "Traceback" not in err, name
        assert [p.name for p in (tmp_path / name).iterdir()] == [f"{name}.gguf"]
        assert (tmp_path / name / f"{name}.gguf").read_bytes() == blob


def test_gguf_with_float64_metadata_converts(llama_hf, tmp_path):
    """MLX's reader crashes on float64 metadata (a valid GGUF value type): such a file
    goes to the ``gguf`` package and converts (in a subprocess: a crash shows)."""
    gguf = to_gguf(llama_hf, tmp_path / "f64.gguf", extra={"x.f64": np.float64(0.5)})
    proc = subprocess.run(
        [sys.executable, "-c", CLI_LOOP, str(gguf)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, code, err = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0 and "error" not in err
    assert load(str(tmp_path / "f64.gguf.out"))[0].num_mtp_layers == 1


@pytest.mark.parametrize(
    "module, name, error",
    [
        (mx, "save_safetensors", RuntimeError("[write] Unable to write 4096 bytes")),
        (Path, "write_text", OSError(errno.ENOSPC, "No space left on device")),
    ],
    ids=["weights", "configs"],
)
def test_full_disk_while_writing_the_scratch_copy(
    llama_hf, tmp_path, monkeypatch, module, name, error
):
    """A full disk while the GGUF file's Hugging Face scratch copy is written is one
    `DiskFullError`, through the CLI one line, and nothing is left beside the output
    path."""
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    (tmp_path / "src").mkdir()
    gguf = to_gguf(llama_hf, tmp_path / "src" / "tiny.gguf")
    out = tmp_path / "out" / "mlx"

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(module, name, full)
    with pytest.raises(DiskFullError, match=f"no space left on {out.parent}"):
        convert(str(gguf), out, progress=False)
    assert list(out.parent.iterdir()) == []
    result = CliRunner().invoke(
        main, ["convert", "--hf-path", str(gguf), "--mlx-path", str(out)]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("mlx-mtp: error: no space left on")
    assert result.output.count("\n") == 1 and list(out.parent.iterdir()) == []
    assert [p.name for p in gguf.parent.iterdir()] == ["tiny.gguf"]


def test_demo_model_is_built_from_a_wheel_and_shipped_heads(
    llama_hf, tmp_path, monkeypatch
):
    """The embedded default: trunk fetched as a GGUF (faked here), converted once into
    the cache, heads attached from the package; later calls reuse the cache."""
    from mlx_mtp import demo

    with_heads = convert(str(llama_hf), tmp_path / "with-heads", progress=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "mtp.safetensors").write_bytes(
        (with_heads / "mtp.safetensors").read_bytes()
    )
    section = json.loads((with_heads / "config.json").read_text())["mtp"]
    section["provenance"]["trunk_fingerprint"] = "0" * 64  # another trunk's heads
    (shipped / "mtp.json").write_text(json.dumps(section))
    fetched = []

    def fake_fetch(dest):
        fetched.append(dest)
        return to_gguf(llama_hf, dest)

    monkeypatch.setattr(demo, "HEADS", shipped)
    monkeypatch.setattr(demo, "fetch_gguf", fake_fetch)
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path / "home"))
    with pytest.raises(MTPError, match="not the one the shipped heads were trained"):
        demo.demo_model(progress=False)
    converted = tmp_path / "home" / "smollm2-135m-instruct-mtp"  # left unfinished
    assert not (converted / demo.DONE).exists()
    section["provenance"]["trunk_fingerprint"] = source_fingerprint(converted)
    (shipped / "mtp.json").write_text(json.dumps(section))
    folder = demo.demo_model(progress=False)
    assert demo.demo_model(progress=False) == folder and len(fetched) == 1
    model, tok = load(str(folder))
    ids = tok.encode(PROMPT)
    assert model.num_mtp_layers == 1 and greedy(model, ids, 2) == greedy(model, ids, 0)
    section["draft_vocab_size"] = None  # a later mlx-mtp ships other heads: the
    (shipped / "mtp.json").write_text(json.dumps(section))  # folder takes them
    assert demo.demo_model(progress=False) == folder and len(fetched) == 1
    config = json.loads((folder / "config.json").read_text())
    assert config["mtp"] == section and not list(folder.glob(".*.partial"))
    monkeypatch.setattr(demo, "HEADS", tmp_path / "none")
    with pytest.raises(Exception, match="no demo heads"):
        demo.demo_model()


def test_gemma3_gguf_with_types_mlx_cannot_read(tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes it (``blk.*`` names, norms stored + 1, a
    sentencepiece vocabulary, a Q5_0 tensor MLX's own reader refuses) converts to the
    model of the Hugging Face checkpoint it came from: greedy decoding is the same,
    long past the sliding window."""
    import gguf
    from gguf import quants
    from mlx_lm.generate import generate_step

    from mlx_mtp.convert.gguf import GEMMA3_BLOCK, TOP
    from mlx_mtp.testing.fixtures import write_gemma3

    hf = write_gemma3(tmp_path / "hf", pattern=6, weight_std=0.2)
    config = json.loads((hf / "config.json").read_text())
    weights = {
        k: np.array(v)
        for k, v in mx.load(str(hf / "model.safetensors")).items()
        if not k.startswith("model.layers.6.")  # the retrofitted head: not in GGUF
    }
    to_gguf = {v: k for k, v in TOP.items()}
    to_gguf.update({v: k for k, v in GEMMA3_BLOCK.items()})
    q5 = gguf.GGMLQuantizationType.Q5_0
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    for key, value in (
        ("context_length", 2048),
        ("embedding_length", 64),
        ("block_count", 6),
        ("feed_forward_length", config["intermediate_size"]),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("attention.key_length", 16),
        ("attention.value_length", 16),
        ("attention.sliding_window", config["sliding_window"]),
    ):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1000000.0)
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab += [f"<0x{b:02X}>" for b in range(256)]
    vocab += [f"\u2581w{i}" for i in range(512 - len(vocab))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (len(vocab) - 260))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    for name, value in weights.items():
        base, leaf = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            key = f"blk.{i}.{to_gguf[rest]}.{leaf}"
        else:
            key = f"{to_gguf[base]}.{leaf}"
        if name.endswith("norm.weight"):
            writer.add_tensor(key, value + 1.0)  # llama.cpp's Gemma convention
        elif name.endswith("mlp.down_proj.weight"):
            data = quants.quantize(value, q5)
            writer.add_tensor(key, data, raw_dtype=q5)
            weights[name] = quants.dequantize(data, q5)  # what the file holds
        else:
            writer.add_tensor(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuntimeError):
        mx.load(str(tmp_path / "g.gguf"))  # MLX alone cannot read it
    mx.save_safetensors(
        str(hf / "model.safetensors"),
        {k: mx.array(v) for k, v in weights.items()},
        {"format": "pt"},
    )
    config.pop("num_nextn_predict_layers")
    (hf / "config.json").write_text(json.dumps(config))

    out = convert(str(tmp_path / "g.gguf"), tmp_path / "mlx", progress=False)
    converted, tokenizer = load(str(out))
    reference, _ = load(str(hf))
    assert converted.model_type == "gemma3_text"
    assert tokenizer.encode("\u2581w7")[0] == 2  # <bos> first
    for prompt in ([300, 301, 302], list(range(300, 320))):
        a, b = (
            [int(t) for t, _ in generate_step(mx.array(prompt), m.trunk, max_tokens=64)]
            for m in (converted, reference)
        )
        assert a == b

"""Tables read by row from their files (`mlx_mtp.tables`): a `MappedEmbedding`
gives exactly what the loaded table gives, float or quantized; Qwen3.8-Flash-Next's
n-gram table is mapped on load, never among the parameters, counted apart by the
memory guard and in the run's statistics; ``convert -q`` quantizes it as mlx-vlm
does (its rows' widths are not a multiple of the default group)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp import generate, load, memory, tables
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import format_stats, stream_generate
from mlx_mtp.loading import load_model, load_trunk
from mlx_mtp.models import get_family

from .test_errors import assert_one_line_error, run_cli

IDS = np.random.default_rng(0).integers(0, 96, (2, 5, 3))
TABLE = ".ngram_embedding.shard"
PROMPT = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99, 7, 9]


def _mapped(tmp_path, arrays: dict, quantization=None) -> tables.MappedEmbedding:
    """``arrays`` (``t.weight`` and, quantized, ``t.scales``, ``t.biases``) saved
    beside an unrelated tensor, read back as a `MappedEmbedding`."""
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"other.weight": mx.ones((3, 7)), **arrays})
    found = tables.locate(tmp_path, ["t."])
    parts = [found.get(f"t.{p}") for p in tables.PARTS]
    return tables.MappedEmbedding(*parts, quantization=quantization)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_mapped_float_table_gives_the_loaded_rows(tmp_path, dtype):
    table = nn.Embedding(96, 48)
    table.weight = table.weight.astype(dtype)
    mapped = _mapped(tmp_path, {"t.weight": table.weight})
    ours, theirs = mapped(mx.array(IDS)), table(mx.array(IDS))
    assert ours.dtype == theirs.dtype and ours.shape == (2, 5, 3, 48)
    assert mx.array_equal(ours, theirs).item()
    assert mapped.nbytes == table.weight.nbytes
    assert not tree_flatten(mapped.parameters())


@pytest.mark.parametrize(
    "dtype, params",
    [
        (mx.float32, {"group_size": 32, "bits": 4, "mode": "affine"}),
        (mx.bfloat16, {"group_size": 64, "bits": 8, "mode": "affine"}),
        (mx.float16, {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
    ],
)
def test_a_mapped_quantized_table_gives_the_loaded_rows(tmp_path, dtype, params):
    table = nn.Embedding(96, 64)
    table.weight = table.weight.astype(dtype)
    quantized = table.to_quantized(**params)
    stored = {f"t.{k}": v for k, v in tree_flatten(quantized.parameters())}
    mapped = _mapped(tmp_path, stored, params)
    ours, theirs = mapped(mx.array(IDS)), quantized(mx.array(IDS))
    assert ours.dtype == theirs.dtype
    assert mx.array_equal(ours, theirs).item()
    assert mapped.to_quantized(**params) is mapped  # the loader's quantize pass
    assert mapped.weight.shape == quantized.weight.shape


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Qwen3.8-Flash-Next fixture whose n-gram rows are 32 wide (a group divides
    them), and its 4-bit conversion."""
    from mlx_mtp.testing.fixtures import write_checkpoint

    root = tmp_path_factory.mktemp("tables")
    src = write_checkpoint("qwen4_exp", root / "src", ple_embed_dim=128)
    q4 = convert(str(src), root / "q4", quantize=True)
    return {"float": src, "q4": q4}


def _tables(trunk):
    return [
        m
        for p, m in trunk.named_modules()
        if p.rpartition(".")[0].endswith("ngram_embedding.shards")
    ]


@pytest.mark.parametrize("form", ["float", "q4"])
def test_the_ngram_table_is_mapped_and_decodes_as_loaded(wide, form):
    """Every shard of the table is read from its file, none is a parameter, and the
    trunk computes exactly what it computes with the table loaded."""
    path = wide[form]
    model, _ = load(str(path))
    shards = _tables(model.trunk)
    assert len(shards) == 2
    assert all(isinstance(m, tables.MappedEmbedding) for m in shards)
    assert not any(TABLE in k for k, _ in tree_flatten(model.parameters()))
    assert tables.mapped_bytes(model) == tables.stored_bytes(path, [TABLE]) > 0

    family = get_family(json.loads((path / "config.json").read_text()))
    loaded, _, _ = load_trunk(path, family, lazy=False)  # a conversion's view
    assert not any(isinstance(m, tables.MappedEmbedding) for m in _tables(loaded))
    ids = mx.array([PROMPT])
    ours = model.family.logits(model.trunk, model.family.hidden(model.trunk, ids))
    theirs = family.logits(loaded, family.hidden(loaded, ids))
    assert mx.array_equal(ours, theirs).item()


def test_quantizing_a_loaded_model_leaves_its_mapped_tables(wide):
    """mlx-lm's ``quantize_model`` over a loaded model (as a script quantizing in
    memory runs it) keeps each mapped table as it is stored."""
    from mlx_lm.utils import quantize_model

    model, config, _ = load_model(str(wide["float"]))
    quantize_model(model.trunk, config, None, 4)
    shards = _tables(model.trunk)
    assert shards and all(isinstance(m, tables.MappedEmbedding) for m in shards)
    ids = mx.array([PROMPT])
    assert model.family.hidden(model.trunk, ids).shape[:2] == (1, len(PROMPT))


def test_a_quantized_conversion_quantizes_the_table_in_a_group_dividing_it(wide):
    """mlx-lm's ``quantize_model`` leaves rows the default group (64) does not divide
    float; the table takes the largest group that divides them (32), at -q's bits."""
    config = json.loads((wide["q4"] / "config.json").read_text())
    entries = {k: v for k, v in config["quantization"].items() if TABLE in k}
    assert len(entries) == 2
    assert all(
        v == {"group_size": 32, "bits": 4, "mode": "affine"} for v in entries.values()
    )
    found = tables.locate(wide["q4"], [TABLE])
    assert {s.dtype for k, s in found.items() if k.endswith(".weight")} == {"U32"}


def test_the_memory_guard_counts_the_table_apart(wide, monkeypatch):
    """The guard refuses weights that do not fit, but the table's bytes are read
    from disk: a limit just above the rest loads, one just below is refused."""
    path = wide["float"]
    table = tables.stored_bytes(path, [TABLE])
    rest = memory.weights_bytes([path]) - table
    monkeypatch.setenv(memory.LIMIT_ENV, str(rest))
    load(str(path))
    monkeypatch.setenv(memory.LIMIT_ENV, str(rest - 1))
    with pytest.raises(MTPError, match="read from disk"):
        load(str(path))
    result = run_cli("generate", "--model", str(path), "-p", "hi")
    assert_one_line_error(result, "besides", "read from disk")


@pytest.mark.slow
def test_the_run_statistics_name_the_table_apart_from_the_peak(wide):
    model, tokenizer = load(str(wide["float"]))
    *_, last = stream_generate(model, tokenizer, "hello", max_tokens=3)
    assert last.mapped_memory == tables.mapped_bytes(model) / 1e9 > 0
    assert "of tables read from disk" in format_stats(last)
    assert generate(model, tokenizer, "hello", max_tokens=3)


@pytest.mark.slow
def test_the_measuring_script_runs_and_both_loads_agree():
    """``scripts/table_memory.py`` on a small table: it exits 0 only when the
    mapped and the loaded table decode the same tokens."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "table_memory.py"
    run = [sys.executable, str(script), "--rows", "4e4", "--tokens", "8"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "same tokens: True" in out.stdout
    assert {line.split()[0] for line in out.stdout.splitlines()} >= {"mapped", "loaded"}


def test_the_server_budget_leaves_the_table_out(wide, monkeypatch):
    """The batch's cache budget is half of what the weights leave: a mapped table is
    not among them, so the budget is the table's half larger than with it loaded."""
    from mlx_mtp.serving.budget import default_budget

    mapped, _ = load(str(wide["float"]))
    table = tables.stored_bytes(wide["float"], [TABLE])
    monkeypatch.setattr(tables, "locate", lambda folder, markers: {})
    loaded, _ = load(str(wide["float"]))
    assert tables.mapped_bytes(loaded) == 0
    assert default_budget(mapped) - default_budget(loaded) in (
        table // 2,
        table // 2 + 1,
    )

"""Files mlx-mtp reads are untrusted: a bad cache (round costs, draft vocabulary) is
measured again and rewritten whole, a malformed JSON file of a model folder is one
line naming it, an empty or relative ``$MLX_MTP_HOME`` means what it says, and a
``max_kv_size`` with no room past the sink tokens is refused."""

import http.client
import json
import math
import os
import shutil
import struct
import threading

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mlx_mtp import MTPError, draft_length, draft_vocab, generate, stream_generate
from mlx_mtp.cli import main
from mlx_mtp.defaults import DEFAULT_LOOKUP_TOKENS, MAX_DRAFT_TOKENS
from mlx_mtp.files import read_json
from mlx_mtp.loading import load
from mlx_mtp.paths import home
from mlx_mtp.server import Server, server_args
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_checkpoint

PROMPT = "Write a function."
DEEP = "[" * 100000


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """This module's own ``$MLX_MTP_HOME`` (the draft-vocabulary ranking is computed
    once in it)."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("untrusted_home")
        patch.setenv("MLX_MTP_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(
        "deepseek_v3", tmp_path_factory.mktemp("untrusted"), predictable=True
    )


def auto_tokens(folder):
    """The tokens of a default (``-k auto``, greedy) generation by a fresh load."""
    model, tokenizer = load(str(folder))
    return [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=10)]


@pytest.fixture(scope="module")
def fresh(folder, cache_home):
    """What a run with no cache gives: its tokens, the model's key in the costs file
    and the entry stored there, and the ranking kept."""
    tokens = auto_tokens(folder)
    model, _ = load(str(folder))
    key = draft_length._cost_key(model)
    entry = json.loads((cache_home / "costs.json").read_text())[key]
    path = draft_vocab._cache_path(model)
    ranking = draft_vocab.load_ranking(path, model.args.vocab_size)
    return dict(tokens=tokens, key=key, entry=entry, path=path, ranking=ranking)


@pytest.fixture
def measured(fresh, monkeypatch):
    """Count the measurements of round costs; each gives the first run's costs (a
    measurement takes a fraction of a second; the tests here make many)."""
    calls = []

    def measure(model, max_k, reps=5, context=64, vocabs=()):
        calls.append(max_k)
        return draft_length.parse_costs(fresh["entry"])

    monkeypatch.setattr(draft_length, "measure_costs", measure)
    return calls


def strict_json(text):
    def refuse(name):
        raise AssertionError(f"{name} in a cache file")

    return json.loads(text, parse_constant=refuse)


def assert_measured(entry, vocab_size=512):
    """``entry`` is exactly a measurement: positive finite costs of the right shape
    (the CLI measures up to k = 8, the lookup default; a server every k it serves)."""
    assert set(entry) == {"verify", "draft", "drafts"}
    costs = [*entry["verify"], entry["draft"], *entry["drafts"].values()]
    assert all(type(c) is float and 0 < c < 100 for c in costs), entry
    reach = {DEFAULT_LOOKUP_TOKENS + 1, MAX_DRAFT_TOKENS + 1}
    assert entry["verify"][0] == 1.0 and len(entry["verify"]) in reach
    assert set(entry["drafts"]) == {str(vocab_size // d) for d in (16, 8, 4)}


def assert_costs_repaired(cache_home, key):
    table = strict_json((cache_home / "costs.json").read_text())
    assert isinstance(table, dict)
    for entry in table.values():
        assert_measured(entry)
    assert key in table
    assert not [p.name for p in cache_home.iterdir() if p.name.startswith(".")]


def _with(**fields):
    return lambda good: {**good, **fields}


def _verify(fn):
    return lambda good: {**good, "verify": fn(good["verify"])}


BAD_FILES = {
    "list": "[]",
    "null": "null",
    "number": "5",
    "string": '"costs"',
    "nested": DEEP,
}
BAD_ENTRIES = {
    "number": lambda good: 5,
    "null": lambda good: None,
    "list": lambda good: [],
    "empty": lambda good: {},
    "missing field": lambda good: {"verify": good["verify"], "draft": good["draft"]},
    "extra field": _with(note="x"),
    "zero block cost": _with(block=0.0),
    "string block cost": _with(block="1"),
    "zero costs": _verify(lambda v: [0.0] * len(v)),
    "negative costs": _verify(lambda v: [-c for c in v]),
    "nan costs": _verify(lambda v: [math.nan] * len(v)),
    "inf cost": _verify(lambda v: [1.0, math.inf, *v[2:]]),
    "huge cost": _verify(lambda v: [1.0, 1e300, *v[2:]]),
    "huge int cost": _verify(lambda v: [1, 10**400, *v[2:]]),
    "string costs": _verify(lambda v: [str(c) for c in v]),
    "no verify costs": _verify(lambda v: []),
    "too many verify costs": _verify(lambda v: [1.0] * 10000),
    "not relative to t(1)": _verify(lambda v: [2.0, *v[1:]]),
    "zero draft": _with(draft=0.0),
    "nan draft": _with(draft=math.nan),
    "drafts a list": _with(drafts=[]),
    "drafts bad size": lambda good: {**good, "drafts": {"x1": 0.5, **good["drafts"]}},
    "drafts zero cost": lambda good: {
        **good,
        "drafts": dict.fromkeys(good["drafts"], 0),
    },
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_bad_costs_file_is_measured_again(name, folder, fresh, cache_home, measured):
    (cache_home / "costs.json").write_text(BAD_FILES[name])
    assert auto_tokens(folder) == fresh["tokens"]
    assert measured == [8]
    assert_costs_repaired(cache_home, fresh["key"])


@pytest.mark.parametrize("name", BAD_ENTRIES)
def test_bad_costs_entry_is_measured_again(name, folder, fresh, cache_home, measured):
    bad = BAD_ENTRIES[name](dict(fresh["entry"]))
    (cache_home / "costs.json").write_text(json.dumps({fresh["key"]: bad}))
    assert auto_tokens(folder) == fresh["tokens"]
    assert measured == [8]
    assert_costs_repaired(cache_home, fresh["key"])


def test_costs_file_keeps_good_entries_and_drops_bad_ones(
    folder, fresh, cache_home, measured
):
    table = {fresh["key"]: None, "other": fresh["entry"], "bad": {"verify": [0]}}
    (cache_home / "costs.json").write_text(json.dumps(table))
    assert auto_tokens(folder) == fresh["tokens"]
    assert measured == [8]
    auto_tokens(folder)  # read, not measured again
    assert measured == [8]
    assert set(strict_json((cache_home / "costs.json").read_text())) == {
        fresh["key"],
        "other",
    }


def test_costs_file_is_never_left_half_written(fresh, cache_home, monkeypatch):
    """An interrupt or a full disk while the file is written leaves the old file
    whole and no temporary file; concurrent writers each write it whole."""
    path = cache_home / "costs.json"
    path.write_text(json.dumps({fresh["key"]: fresh["entry"]}))
    before = path.read_text()
    costs = draft_length.parse_costs(fresh["entry"])

    def fail(*a):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", fail)
        draft_length._store_costs("new", costs)  # skipped
    assert path.read_text() == before
    assert sorted(p.name for p in cache_home.iterdir() if p.name.startswith(".")) == []

    def write(i):
        for j in range(20):
            draft_length._store_costs(f"writer {i} entry {j}", costs)
            assert isinstance(strict_json(path.read_text()), dict)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert_costs_repaired(cache_home, fresh["key"])


@pytest.mark.slow
def test_cli_and_server_survive_a_bad_costs_file(folder, fresh, cache_home):
    (cache_home / "costs.json").write_text("[]")
    result = CliRunner().invoke(
        main,
        ["generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "8"],
    )
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert_costs_repaired(cache_home, fresh["key"])

    (cache_home / "costs.json").write_text(json.dumps({fresh["key"]: 5}))
    server = Server(server_args(model=str(folder), port=0)).start()
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            response = conn.getresponse()
            reply = json.loads(response.read())
            assert response.status == 200, reply
            assert reply["choices"][0]["message"]["content"]
    finally:
        server.close()
    assert_costs_repaired(cache_home, fresh["key"])


def _bad_rankings(ranking: draft_vocab.Ranking):
    """name -> tensors of a draft-vocabulary cache that is not this model's ranking."""
    order, mass = mx.array(ranking.order), mx.array(ranking.mass)
    n = len(ranking.order)
    nan = np.array(ranking.mass)
    nan[3] = np.nan
    dup = np.array(ranking.order)
    dup[1] = dup[0]
    return {
        "nan mass": {"order": order, "mass": mx.array(nan)},
        "increasing mass": {"order": order, "mass": mass[::-1]},
        "negative mass": {"order": order, "mass": -mass},
        "mass not summing to 1": {"order": order, "mass": mass * 2},
        "short": {"order": order[:-1], "mass": mass[:-1]},
        "out of range": {"order": order + n, "mass": mass},
        "duplicates": {"order": mx.array(dup), "mass": mass},
        "float order": {"order": order.astype(mx.float32), "mass": mass},
        "two-dimensional": {"order": order[None], "mass": mass[None]},
        "extra tensor": {"order": order, "mass": mass, "note": mass},
        "no mass": {"order": order},
    }


def test_bad_draft_vocab_cache_is_ranked_again(folder, fresh, monkeypatch):
    """Each bad cache is refused and ranked again (the ranking is deterministic: the
    first one is computed for real, the others reuse it), the run's tokens do not
    change, and the file is rewritten whole."""
    path, good = fresh["path"], fresh["ranking"]
    calls = []
    real = draft_vocab.rank_tokens

    def rank(*a, **kw):
        calls.append(1)
        return real(*a, **kw) if len(calls) == 1 else good

    monkeypatch.setattr(draft_vocab, "rank_tokens", rank)
    cases = {**_bad_rankings(good), "nested header": None, "truncated": None}
    for i, (name, tensors) in enumerate(cases.items()):
        if name == "nested header":
            path.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode())
        elif name == "truncated":
            path.write_bytes(path.read_bytes()[:100])
        else:
            mx.save_safetensors(str(path), tensors)
        with pytest.raises(MTPError):
            draft_vocab.load_ranking(path, 512)
        assert auto_tokens(folder) == fresh["tokens"], name
        assert len(calls) == i + 1, name
        kept = draft_vocab.load_ranking(path, 512)
        assert np.array_equal(kept.order, good.order), name
        assert np.array_equal(kept.mass, good.mass), name
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]


def test_draft_vocab_file_of_a_conversion_must_be_a_file_name(tmp_path):
    for name in ("../x.safetensors", "/etc/passwd", 5, "", ".", ".."):
        with pytest.raises(MTPError, match="draft_vocab file"):
            draft_vocab.load_stored(tmp_path, {"draft_vocab": {"file": name}}, 8)
    with pytest.raises(MTPError, match="cannot read the draft vocabulary"):
        draft_vocab.load_stored(tmp_path, {"draft_vocab": {"file": "absent"}}, 8)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-mtp: error:"), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "model.safetensors",
    ],
)
def test_nested_json_in_a_model_folder_is_one_line(name, folder, tmp_path):
    bad = shutil.copytree(folder, tmp_path / "nested")
    if name == "model.safetensors":
        (bad / name).write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode())
    else:
        (bad / name).write_text(DEEP)
    result = CliRunner().invoke(main, ["generate", "--model", str(bad), "-p", "hi"])
    assert_one_line_error(result, str(bad / name), "nested too deeply")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_model_folder_json_that_is_not_an_object_is_one_line(name, folder, tmp_path):
    bad = shutil.copytree(folder, tmp_path / "list")
    (bad / name).write_text("[]")
    result = CliRunner().invoke(main, ["generate", "--model", str(bad), "-p", "hi"])
    assert_one_line_error(result, str(bad / name), "not a JSON object")


def test_read_json_names_the_file(tmp_path):
    path = tmp_path / "x.json"
    for text, says in ((DEEP, "nested too deeply"), (b"\xff\xfe", "not valid JSON")):
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        with pytest.raises(MTPError, match=says) as e:
            read_json(path, "the thing")
        assert str(e.value).startswith(f"the thing {path} ") and "\n" not in str(
            e.value
        )
    with pytest.raises(MTPError, match="cannot read"):
        read_json(tmp_path / "absent.json")


def test_home(tmp_path, monkeypatch):
    """An empty or blank ``$MLX_MTP_HOME`` is unset; a relative one is made absolute
    once, so that changing directory later does not move the cache."""
    default = home()  # whatever the session's is
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    for value in ("", "   "):
        monkeypatch.setenv("MLX_MTP_HOME", value)
        assert home() == tmp_path / "user" / ".cache" / "mlx-mtp"
        assert draft_length._costs_file().parent == home()
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    monkeypatch.setenv("MLX_MTP_HOME", "rel")
    assert home() == (tmp_path / "a" / "rel").resolve() and home().is_absolute()
    monkeypatch.chdir(tmp_path)
    assert home() == (tmp_path / "a" / "rel").resolve()
    monkeypatch.undo()
    assert home() == default


@pytest.mark.parametrize("size", [1, 4])
def test_max_kv_size_below_the_sinks_is_refused_by_the_cli(size, folder):
    result = CliRunner().invoke(
        main,
        ["generate", "--model", str(folder), "-p", "hi", "--max-kv-size", str(size)],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Invalid value for '--max-kv-size'" in result.output, result.output


def test_max_kv_size_below_the_sinks_is_refused_by_the_api(folder):
    model, tokenizer = load(str(folder))
    for size in (-1, 0, 1, 4, 4.5, True, "8"):
        with pytest.raises(MTPError, match="max_kv_size must be"):
            generate(model, tokenizer, PROMPT, max_tokens=4, max_kv_size=size)
        with pytest.raises(MTPError, match="max_kv_size must be"):
            list(stream_generate(model, tokenizer, PROMPT, 4, max_kv_size=size))
        with pytest.raises(MTPError, match="max_kv_size must be"):
            list(mtp_generate_step([1, 2, 3], model, HEADS, max_kv_size=size))
    plain = generate(model, tokenizer, PROMPT, max_tokens=8, num_draft_tokens=0)
    assert generate(model, tokenizer, PROMPT, max_tokens=8, max_kv_size=64) == plain
    assert generate(model, tokenizer, PROMPT, max_tokens=8, max_kv_size=5)

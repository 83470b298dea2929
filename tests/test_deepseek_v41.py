"""DeepSeek-V4.1: mlx-lm's trunk loads with its DSpark drafter (``mtp.{0,1,2}``,
`tests/test_deepseek_v41_dspark.py` for the drafter itself), and decodes token for
token as mlx-lm: drafting (``auto``), with prompt lookup (its caches roll back), and
served."""

import http.client
import json
import logging

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm import load as lm_load
from mlx_lm import stream_generate as lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_mtp import load, stream_generate
from mlx_mtp.cli import main
from mlx_mtp.errors import MissingHeadsError
from mlx_mtp.loading import load_model
from mlx_mtp.server import Server, server_args
from mlx_mtp.testing.fixtures import write_checkpoint
from mlx_mtp.testing.fixtures_v41 import write_deepseek_v41

# Longer than the sliding window (8): several compressed blocks, candidate blocks.
PROMPT = "The quick brown fox jumps over the lazy dog, then it counts the stars."
CONVERSATIONS = [
    {"role": "user", "content": text}
    for text in (PROMPT, "One, two, three, four.", "Tell me about caches and rows.")
]
TOKENS = 24


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return write_deepseek_v41(tmp_path_factory.mktemp("deepseek_v41"))


@pytest.fixture(scope="module")
def loaded(v41):
    return load(str(v41))


def mlx_lm_tokens(v41, prompt):
    lm_model, lm_tokenizer = lm_load(str(v41))
    steps = lm_stream_generate(
        lm_model, lm_tokenizer, prompt, TOKENS, sampler=make_sampler(0.0)
    )
    return [r.token for r in steps], lm_tokenizer


def run_cli(*args):
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output, result.output
    return result


def error_line(result) -> str:
    """The one ``mlx-mtp: error:`` line of a failed run (warnings may come before)."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("mlx-mtp: error:"), result.output
    assert sum(line.startswith("mlx-mtp:") for line in lines) == 1, result.output
    return lines[-1]


def test_decoding_is_mlx_lms(v41, loaded):
    """Default options (k and source "auto": the drafter drafts) and k = 5 give
    mlx-lm's greedy tokens, through the library and the CLI."""
    model, tokenizer = loaded
    assert model.num_mtp_layers == 1 and model.drafter is not None
    theirs, lm_tokenizer = mlx_lm_tokens(v41, PROMPT)
    for options in ({}, {"num_draft_tokens": 5}):
        steps = stream_generate(model, tokenizer, PROMPT, TOKENS, **options)
        assert [r.token for r in steps] == theirs and len(set(theirs)) > 3
    args = ["generate", "--model", str(v41), "-p", PROMPT, "-m", str(TOKENS)]
    result = run_cli(*args, "--ignore-chat-template")
    assert result.exit_code == 0, result.output
    assert lm_tokenizer.decode(theirs) in result.output


@pytest.mark.slow
def test_prompt_lookup_is_mlx_lms(v41, loaded):
    """Rejected lookup drafts roll the trunk's caches back: mlx-lm's tokens, through
    the library and the CLI (lookup alone, and with the drafter)."""
    model, tokenizer = loaded
    theirs, lm_tokenizer = mlx_lm_tokens(v41, PROMPT)
    steps = stream_generate(model, tokenizer, PROMPT, TOKENS, draft_source="lookup")
    assert [r.token for r in steps] == theirs
    for k in ("0", "auto"):
        args = ["generate", "--model", str(v41), "-p", PROMPT, "-m", str(TOKENS)]
        args += ["-k", k, "--draft-source", "lookup", "--ignore-chat-template"]
        result = run_cli(*args)
        assert result.exit_code == 0, result.output
        assert lm_tokenizer.decode(theirs) in result.output


def test_the_trunk_alone_decodes_with_no_message(tmp_path, caplog):
    """Without ``mtp.*`` (an mlx-lm conversion keeps none) there is nothing to refuse:
    ``num_nextn_predict_layers`` counts DSpark stages, not missing heads."""
    path = write_deepseek_v41(tmp_path / "trunk", drafter=False)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        model, _, _ = load_model(str(path))
    assert model.num_mtp_layers == 0 and caplog.text == ""


def test_engram_layers_are_refused_in_one_line(tmp_path):
    """mlx-lm's V4.1 has no engram memory (the released config has engram layers)."""
    path = write_deepseek_v41(tmp_path / "engram", engram_layer_ids=[1])
    result = run_cli("generate", "--model", str(path), "-p", "hi")
    assert "engram" in error_line(result)


def test_heads_that_fail_to_build_are_allowed_missing(tmp_path):
    """A family's `build_mtp` refusing its heads is handled as `load_heads`'s
    refusal: the error names the flag, which then decodes plainly."""
    path = write_checkpoint("deepseek_v3", tmp_path / "ds3", tokenizer=False)
    weights = mx.load(str(path / "model.safetensors"))
    weights.pop("model.layers.3.eh_proj.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(MissingHeadsError, match="eh_proj.*--allow-missing-heads"):
        load_model(str(path))
    assert load_model(str(path), allow_missing_heads=True)[0].num_mtp_layers == 0


def post(server, body):
    host, port = server.url.split("//")[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    reply = connection.getresponse()
    return reply.status, json.loads(reply.read())


@pytest.mark.slow
def test_served_with_its_drafter_and_lookup(v41, loaded):
    """The server starts (its round costs timed with the drafter) and replies as
    `stream_generate`, with the drafter and with prompt lookup."""
    model, tokenizer = loaded
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = [r.token for r in stream_generate(model, tokenizer, prompt, 8)]
    server = Server(server_args(model=str(v41), port=0, max_batch=1)).start()
    try:
        for extra in ({}, {"draft_source": "lookup"}):
            body = {"messages": messages, "max_tokens": 8, **extra}
            status, reply = post(server, body)
            assert status == 200, reply
            text = reply["choices"][0]["message"]["content"]
            assert text == tokenizer.decode(expected)
    finally:
        server.close()


@pytest.mark.slow  # about 40 s: the server measures V4.1's batch costs first
def test_requests_at_once_are_served_together(v41, loaded, monkeypatch):
    """Three chat requests at once decode in one batch (`mlx_mtp.rows`: each row's
    passes its own), each reply equal to `stream_generate`'s alone."""
    from .test_server_batch import at_once, gathered

    model, tokenizer = loaded
    server = Server(server_args(model=str(v41), port=0, max_batch=3)).start()
    try:
        gathered(server.generator, 3, monkeypatch)
        bodies = [{"messages": [m], "max_tokens": 8} for m in CONVERSATIONS]
        replies = at_once(lambda i: post(server, bodies[i]), 3)
        for (status, reply), message in zip(replies, CONVERSATIONS):
            assert status == 200, reply
            text = reply["choices"][0]["message"]["content"]
            ids = tokenizer.apply_chat_template([message], add_generation_prompt=True)
            lone = [r.token for r in stream_generate(model, tokenizer, ids, 8)]
            assert text == tokenizer.decode(lone)
            assert 3 in {int(b) for b in reply["mtp"]["batch_sizes"]}, reply["mtp"]
    finally:
        server.close()

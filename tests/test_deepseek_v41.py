"""DeepSeek-V4.1: mlx-lm's trunk loads, its DSpark drafter (``mtp.{0,1,2}``) is
refused in one line, and ``--allow-missing-heads`` decodes plainly, token for token as
mlx-lm; its caches cannot roll back, so prompt lookup is refused and "auto" drafts
nothing, alone and served."""

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
from mlx_mtp.errors import MissingHeadsError, RollbackError
from mlx_mtp.loading import load_model
from mlx_mtp.server import Server, server_args
from mlx_mtp.testing.fixtures import write_checkpoint
from mlx_mtp.testing.fixtures_v41 import write_deepseek_v41

# Longer than the sliding window (8): several compressed blocks, candidate blocks.
PROMPT = "The quick brown fox jumps over the lazy dog, then it counts the stars."
TOKENS = 24


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    return write_deepseek_v41(tmp_path_factory.mktemp("deepseek_v41"))


@pytest.fixture(scope="module")
def loaded(v41):
    return load(str(v41), allow_missing_heads=True)


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


def test_the_dspark_drafter_is_refused_in_one_line(v41):
    with pytest.raises(MissingHeadsError, match="DSpark block drafter"):
        load_model(str(v41))
    result = run_cli("generate", "--model", str(v41), "-p", "hi")
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "mlx-mtp: error: DeepSeek-V4.1's mtp.{0,1,2} are a DSpark block drafter "
        "(5-token parallel proposals with a Markov head), not MTP heads: mlx-mtp "
        "does not draft with it (use --allow-missing-heads to decode without)"
    ]


def test_plain_decoding_is_mlx_lms(v41, loaded):
    """Default options (k and source "auto"): plain decoding, mlx-lm's greedy tokens,
    through the library and the CLI."""
    model, tokenizer = loaded
    assert model.num_mtp_layers == 0
    ours = [r.token for r in stream_generate(model, tokenizer, PROMPT, TOKENS)]
    lm_model, lm_tokenizer = lm_load(str(v41))
    theirs = [
        r.token
        for r in lm_stream_generate(
            lm_model, lm_tokenizer, PROMPT, TOKENS, sampler=make_sampler(0.0)
        )
    ]
    assert ours == theirs and len(set(ours)) > 3
    args = ["generate", "--model", str(v41), "-p", PROMPT, "-m", str(TOKENS)]
    result = run_cli(*args, "--allow-missing-heads", "--ignore-chat-template")
    assert result.exit_code == 0, result.output
    assert lm_tokenizer.decode(theirs) in result.output


def test_prompt_lookup_is_refused_in_one_line(v41, loaded):
    """A rejected lookup draft would need the trunk's `LayerCache` rolled back."""
    model, tokenizer = loaded
    with pytest.raises(RollbackError, match="LayerCache"):
        next(stream_generate(model, tokenizer, PROMPT, 4, draft_source="lookup"))
    for k in ("0", "auto"):
        args = ["generate", "--model", str(v41), "-p", PROMPT, "-m", "4", "-k", k]
        result = run_cli(*args, "--allow-missing-heads", "--draft-source", "lookup")
        line = error_line(result)
        assert "prompt lookup" in line and "LayerCache" in line, line


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


def test_served_plainly_and_lookup_refused(v41, loaded):
    """The server starts (no round costs to time: nothing drafts), replies as
    `stream_generate`, and refuses a lookup request with a 400."""
    model, tokenizer = loaded
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = [r.token for r in stream_generate(model, tokenizer, prompt, 8)]
    server = Server(server_args(model=str(v41), port=0, allow_missing_heads=True))
    server.start()
    try:
        status, reply = post(server, {"messages": messages, "max_tokens": 8})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == tokenizer.decode(expected)
        body = {"messages": messages, "max_tokens": 8, "draft_source": "lookup"}
        status, reply = post(server, body)
        assert status == 400 and "LayerCache" in reply["error"]["message"], reply
    finally:
        server.close()

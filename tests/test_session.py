"""Sessions: a generation goes on from an earlier one's caches (multi-turn chat) and
emits exactly what plain decoding of the whole conversation emits."""

import pytest

from mlx_mtp.errors import MTPError
from mlx_mtp.speculative import Session, mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import plain_greedy


def turn(model, session, ids, n, k, stop_after=None):
    steps = mtp_generate_step(
        ids, model, HEADS, num_draft_tokens=k, max_tokens=n, session=session
    )
    out = []
    for o in steps:
        out.append(o.token)
        if stop_after is not None and len(out) == stop_after:
            steps.close()
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo", "qwen3_5", "step3p5"])
@pytest.mark.parametrize("k", [2, "auto"])
def test_turns_equal_plain_decoding_of_the_conversation(family, k, loaded):
    model, tokenizer = loaded(family, predictable=True)
    user = [tokenizer.encode(t) for t in ("def forward(self, x):", " return", "\n#")]
    session, history = Session(), []
    for i, ids in enumerate(user):
        stop_after = 7 if i == 1 else None  # a reply cut short (Ctrl-C, a stop word)
        out = turn(model, session, ids, 24, k, stop_after)
        assert out == plain_greedy(model, history + ids, 24)[: len(out)]
        history += ids + out
        assert session.tokens == history
    assert session.state.hidden is None or session.state.hidden.shape[1] == (
        len(history) - 1 - session.state.frontier
    )


def test_session_keeps_its_draft_depth(loaded):
    model, tokenizer = loaded("mimo", predictable=True)  # two MTP layers
    session = Session()
    turn(model, session, tokenizer.encode("Hello"), 4, 2)
    with pytest.raises(MTPError, match="drafts with 2 MTP layer"):
        turn(model, session, tokenizer.encode(" again"), 4, 1)
    with pytest.raises(MTPError, match="rotating KV window"):
        list(mtp_generate_step([1, 2], model, HEADS, session=Session(), max_kv_size=8))


def test_chat_turns_reuse_the_session(loaded):
    """What `mlx-mtp chat` does each turn: render the conversation, feed only what the
    session does not hold yet, and reply exactly as plain decoding of it all."""
    from mlx_mtp.cli import _next_turn
    from mlx_mtp.generate import stream_generate

    model, tokenizer = loaded("deepseek_v3", predictable=True)
    messages, session = [], Session()
    for text in ("def f(x):", "and g?", "thanks"):
        messages.append({"role": "user", "content": text})
        ids, session, _ = _next_turn(tokenizer, messages, session)
        held = session.tokens  # [] when the reply did not re-tokenize the same
        replies = list(stream_generate(model, tokenizer, ids, 12, session=session))
        out = [r.token for r in replies]
        assert out == plain_greedy(model, held + ids, 12)[: len(out)]
        messages.append(
            {"role": "assistant", "content": "".join(r.text for r in replies)}
        )


def test_next_turn_feeds_only_new_tokens(loaded):
    from types import SimpleNamespace

    from mlx_mtp.cli import _next_turn

    _, tokenizer = loaded("deepseek_v3", predictable=True)
    messages = [{"role": "user", "content": "hi"}]
    first = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    reply = tokenizer.encode("hello", add_special_tokens=False)
    held = SimpleNamespace(tokens=tokenizer.encode(first, add_special_tokens=False))
    held.tokens += reply
    held.key = held.tokens  # as `Session.key` reads them: no images
    messages += [
        {"role": "assistant", "content": tokenizer.decode(reply)},
        {"role": "user", "content": "more"},
    ]
    ids, session, _ = _next_turn(tokenizer, messages, held)
    assert session is held and 0 < len(ids)
    whole, fresh, _ = _next_turn(tokenizer, messages, Session())
    assert whole == held.tokens + ids and fresh.tokens == []
    held.tokens[-1] += 1  # the reply re-tokenizes differently: start over
    assert _next_turn(tokenizer, messages, held)[0] == whole


def test_chat_command(checkpoint):
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    path = str(checkpoint("deepseek_v3", predictable=True))
    result = CliRunner().invoke(
        main,
        ["chat", "--model", path, "-m", "6", "--quiet"],
        input="hello\n\nwhat next?\n/reset\nhi\n/exit\n",
    )
    assert result.exit_code == 0, result.output
    assert result.output.count(">> ") == 6  # six lines read
    assert result.output.count("\n") == 4  # the banner and three replies
    eof = CliRunner().invoke(main, ["chat", "--model", path, "-m", "4"], input="hi\n")
    assert eof.exit_code == 0 and "tok/s" in eof.output  # Ctrl-D ends it too


@pytest.mark.parametrize("family", ["mimo", "step3p5", "mimo_v2_flash"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, "auto"])
def test_every_mtp_cache_reaches_the_frontier_after_turns_ending_at_max_tokens(
    family, k, loaded
):
    """A round capped by max_tokens below the draft depth must not leave the deeper
    MTP layers behind the frontier (their caches would miss rows for the rest of the
    conversation): after each turn every MTP cache holds exactly the rows below it."""
    model, tokenizer = loaded(family, predictable=True)  # two MTP layers
    session, history = Session(), []
    for ids, n in zip([tokenizer.encode("def f(x):"), [7], [9, 4], [5]], [7, 5, 6, 2]):
        out = turn(model, session, ids, n, k)
        assert out == plain_greedy(model, history + ids, n)
        history += ids + out
        depth = session.state.depth  # layers in use: k = 1 drafts with the first
        offsets = [c.offset for c in session.caches.mtp]
        assert offsets[:depth] == [session.state.frontier] * depth
        assert offsets[depth:] == [0] * (model.num_mtp_layers - depth)


@pytest.mark.parametrize("family", ["deepseek_v32", "deepseek_v4"])
def test_a_snapshot_goes_on_apart_from_its_session(family, loaded):
    """A server keeps a snapshot of a conversation and goes on with the live session:
    the snapshot's caches (a layer's several caches, DeepSeek-V4's compressor state
    included) stay as they were, so a later turn from it is plain decoding."""
    model, tokenizer = loaded(family, predictable=True)
    first, second = (tokenizer.encode(t) for t in ("def forward(self, x):", " return"))
    session = Session()
    reply = turn(model, session, first, 12, 2)
    kept = session.snapshot()
    for ours, theirs in zip(kept.caches.trunk, session.caches.trunk):
        assert not shared_parts(ours, theirs)
    turn(model, session, second, 24, 2)  # the live session moves on
    out = turn(model, kept, second, 24, 2)
    assert out == plain_greedy(model, first + reply + second, 24)


def shared_parts(a, b) -> list:
    """The objects (not arrays, numbers or strings) two caches hold in common."""
    out = []
    for name, value in vars(a).items():
        other = vars(b).get(name)
        pairs = (
            zip(value, other) if isinstance(value, (list, tuple)) else [(value, other)]
        )
        out += [
            name
            for x, y in pairs
            if x is y and hasattr(x, "__dict__") and not isinstance(x, type)
        ]
    return out

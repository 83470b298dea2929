"""Prompt caches that outlive the process: a session file round trip for every kind
of cache (hybrid recurrent states, sliding windows, DeepSeek-V4's compressed caches,
MLA with indexers) goes on exactly as the session it was saved from; the server's
disk tier finds a conversation again after a restart (``cached_tokens``), skips a
corrupt or foreign file with a warning, and stays within its bytes;
``generate --prompt-cache`` runs only the new tokens of a longer prompt and prints
the same text."""

import logging

import openai
import pytest

from mlx_mtp import session_files
from mlx_mtp.server import Server, server_args
from mlx_mtp.speculative import Session, mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_errors import run_cli

PROMPT = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31]


@pytest.mark.parametrize(
    "family", ["qwen3_5", "deepseek_v4", "mimo_v2_flash", "deepseek_v32", "nemotron_h"]
)
def test_a_saved_session_goes_on_as_the_original(family, loaded, tmp_path):
    model, _ = loaded(family, predictable=True)
    key = session_files.model_key(model)
    session = Session()
    list(
        mtp_generate_step(
            PROMPT[:6], model, HEADS, num_draft_tokens=2, max_tokens=10, session=session
        )
    )
    path = tmp_path / "s.safetensors"
    session_files.save(session, path, key, {"owner": "x"})
    tokens, fields = session_files.read_meta(path, key)
    assert tokens == session.tokens and fields == {"owner": "x"}
    copy = session_files.load(path, key)
    go_on = PROMPT[6:]
    want = [
        o.token
        for o in mtp_generate_step(
            go_on, model, HEADS, num_draft_tokens=2, max_tokens=12, session=session
        )
    ]
    got = [
        o.token
        for o in mtp_generate_step(
            go_on, model, HEADS, num_draft_tokens=2, max_tokens=12, session=copy
        )
    ]
    assert got == want


def test_foreign_corrupt_and_unsafe_files_are_refused(loaded, tmp_path):
    model, _ = loaded("deepseek_v3", predictable=True)
    key = session_files.model_key(model)
    session = Session()
    list(
        mtp_generate_step(
            PROMPT[:4], model, HEADS, num_draft_tokens=1, max_tokens=4, session=session
        )
    )
    path = tmp_path / "s.safetensors"
    session_files.save(session, path, key)
    with pytest.raises(session_files.SessionFileError, match="another model"):
        session_files.load(path, "0" * 32)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(session_files.SessionFileError):
        session_files.load(cut, key)
    with pytest.raises(session_files.SessionFileError, match="names the class"):
        session_files._decode({"object": "os:system", "attrs": {}}, {})
    with pytest.raises(session_files.SessionFileError, match="names the class"):
        session_files._decode({"object": "mlx_mtp.cache:os", "attrs": {}}, {})
    with pytest.raises(session_files.SessionFileError, match="not an mlx-mtp session"):
        session_files.read_meta(next(p for p in model.source.glob("*.safetensors")))


def chat(client, messages, max_tokens=6):
    r = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow  # about 10 s: with -m slow (CI runs both)
def test_the_server_finds_its_conversations_after_a_restart(
    checkpoint, tmp_path, caplog
):
    """A conversation kept before a restart: its next turn runs only its new tokens
    (``cached_tokens``) and equals a fresh server's reply; a junk file in the folder
    is skipped with a warning."""
    path = str(checkpoint("qwen3_5", predictable=True))
    folder = tmp_path / "cache"
    turn = [{"role": "user", "content": "A long question about caches. " * 3}]

    def start(where):
        args = server_args(model=path, port=0, prompt_cache_dir=str(where))
        server = Server(args).start()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return server, client

    server, client = start(folder)
    try:
        reply, cached = chat(client, turn)
    finally:
        server.close()  # the kept conversations go to disk
    assert cached == 0
    files = list(folder.glob("*/*.safetensors"))
    assert files
    (files[0].parent / "junk.safetensors").write_bytes(b"not a safetensors file")
    follow = turn + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"},
    ]
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        server, client = start(folder)
    assert "junk.safetensors" in caplog.text and "skipped" in caplog.text
    try:
        again, cached = chat(client, follow)
    finally:
        server.close()
    assert cached > 0  # the restarted server went on from the kept conversation
    server, client = start(tmp_path / "fresh")
    try:
        assert chat(client, follow) == (again, 0)
    finally:
        server.close()
    server, client = start(folder)  # a repeated prompt: all of it from the disk
    try:
        assert chat(client, turn) == (reply, len_prompt(client, turn))
    finally:
        server.close()


def len_prompt(client, messages) -> int:
    r = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=1, temperature=0
    )
    return r.usage.prompt_tokens


def test_generate_prompt_cache(checkpoint, tmp_path):
    path = str(checkpoint("qwen3_5", predictable=True))
    cache = str(tmp_path / "p.safetensors")
    base = ["generate", "--model", path, "--ignore-chat-template", "-m", "8", "-k", "2"]
    first = run_cli(*base, "-p", "A shared preamble. Q1", "--prompt-cache", cache)
    assert first.exit_code == 0 and "prompt cache 0 tok" in first.output
    second = run_cli(
        *base, "-p", "A shared preamble. Q1 and Q2", "--prompt-cache", cache
    )
    assert second.exit_code == 0 and "prompt cache 0 tok" not in second.output
    plain = run_cli(*base, "-p", "A shared preamble. Q1 and Q2")
    assert second.output.splitlines()[0] == plain.output.splitlines()[0]
    other = str(checkpoint("deepseek_v3", predictable=True))
    third = run_cli(
        "generate", "--model", other, "-p", "hi", "-m", "2", "--prompt-cache", cache
    )
    assert third.exit_code == 0 and "another model; starting afresh" in third.output


def test_the_disk_tier_stays_within_its_bytes_and_owners(loaded, tmp_path):
    from mlx_mtp.serving.sessions import DiskTier, Sessions

    model, _ = loaded("deepseek_v3", predictable=True)
    key = session_files.model_key(model)
    sessions = []
    for start in range(3):
        s = Session()
        prompt = PROMPT[start : start + 5]
        list(
            mtp_generate_step(
                prompt, model, HEADS, num_draft_tokens=1, max_tokens=3, session=s
            )
        )
        sessions.append(s)
    probe = session_files.save(sessions[0], tmp_path / "probe.safetensors", key)
    disk = DiskTier(tmp_path / "tier", int(2.5 * probe), key, tag=str)
    for s in sessions:
        disk.put(s, owner=1)
    assert len(list(disk.folder.glob("*.safetensors"))) == 2  # the oldest removed
    assert disk.nbytes <= 2.5 * probe
    longer = sessions[2].tokens + [7, 7]
    assert disk.best(longer, owner=1)[0] == len(sessions[2].tokens)
    assert disk.best(longer, owner=2) == (0, None)  # another key's
    assert disk.best(sessions[0].tokens + [7], owner=1) == (0, None)  # dropped
    kept = Sessions(size=1, disk=DiskTier(tmp_path / "tier", 10**9, key, tag=str))
    found = kept.take(longer, owner=1)
    assert found is not None and found.tokens == sessions[2].tokens


@pytest.mark.slow  # ~10 s each
@pytest.mark.parametrize("alone", [False, True])
def test_a_shared_system_prompt_is_kept_apart(checkpoint, tmp_path, alone):
    """Requests that share a long system prompt and ask different things go on from
    its caches (kept apart when the first one prefilled it), batched or through the
    single-stream loop, and after a restart from the disk; each reply is a fresh
    server's."""
    path = str(checkpoint("qwen3_5", predictable=True))
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    questions = ("First question?", "Another one entirely?")

    def ask(server, question):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        return chat(client, [system, {"role": "user", "content": question}])

    def start(folder):
        server = Server(server_args(model=path, port=0, prompt_cache_dir=str(folder)))
        server.start()
        if alone:
            server.generator.cannot_batch = "the single-stream loop, for this test"
        return server

    fresh = {}
    for q in questions:
        server = start(tmp_path / f"fresh-{q[:5]}")
        try:
            fresh[q] = ask(server, q)
        finally:
            server.close()
    assert all(cached == 0 for _, cached in fresh.values())
    server = start(tmp_path / "kept")
    try:
        assert ask(server, questions[0]) == fresh[questions[0]]
        text, cached = ask(server, questions[1])
    finally:
        server.close()
    assert text == fresh[questions[1]][0] and cached >= 64  # the system prompt
    server = start(tmp_path / "kept")  # restarted: the system prompt from the disk
    try:
        text, cached = ask(server, "A third one?")
    finally:
        server.close()
    assert cached >= 64

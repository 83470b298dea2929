"""Self-distillation for ``train-heads``: the prompts, the trunk's replies (exact,
resumable), the reply weights, and a distilled training run end to end."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step

from mlx_mtp.bench import WORKLOADS
from mlx_mtp.cli import main
from mlx_mtp.convert import distill
from mlx_mtp.convert.distill import (
    Prompt,
    builtin_prompts,
    conversation_rows,
    encode,
    generate_replies,
    read_prompts,
    reply_weights,
    split_prompts,
)
from mlx_mtp.convert.train_heads import (
    TrainConfig,
    compute_features,
    next_tokens,
    train_heads,
)
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_llama

PROMPTS = [
    Prompt("code", "Write a function that adds two numbers."),
    Prompt("chat", "Tell me about the sea."),
    Prompt("code", "How do I sort a list?"),
    Prompt("chat", "Hello!"),
    Prompt("code", "Reverse a string."),
]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama"))


def test_builtin_prompts_mix_code_and_chat_and_leave_the_benchmarks_out():
    prompts = builtin_prompts()
    kinds = [p.kind for p in prompts]
    assert len(prompts) == len(set(prompts)) > 1000
    assert 0.25 < kinds.count("chat") / len(kinds) < 0.6
    texts = {p.text for p in prompts}
    assert "demo" in WORKLOADS and not texts & set(WORKLOADS.values())
    assert prompts == builtin_prompts()  # a fixed order: resumable runs


def test_read_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('Say hi.\n\n{"prompt": "Write code.", "kind": "code"}\n')
    assert read_prompts(str(f)) == [
        Prompt("chat", "Say hi."),
        Prompt("code", "Write code."),
    ]
    for text, message in [
        ('{"text": 1}\n', "p.txt:1: not a prompt"),
        ('ok\n{"prompt": "x", "kind": "poem"}\n', "p.txt:2: 'kind' is code or chat"),
        ("\n\n", "holds no prompts"),
    ]:
        f.write_text(text)
        with pytest.raises(MTPError, match=message):
            read_prompts(str(f))
    with pytest.raises(MTPError, match="no such prompts file"):
        read_prompts(str(tmp_path / "nope.txt"))


def test_split_is_deterministic_disjoint_and_holds_out_each_kind():
    prompts = builtin_prompts()
    train, held = split_prompts(prompts, 0.05, 0)
    assert (train, held) == split_prompts(prompts, 0.05, 0)
    assert not set(train) & set(held) and set(train) | set(held) == set(prompts)
    assert {p.kind for p in held} == {"code", "chat"}
    assert {p.kind for p in train[:20]} == {"code", "chat"}  # kinds mixed
    assert split_prompts(prompts, 0.05, 1) != (train, held)
    assert split_prompts(prompts, 0.0, 0)[1] == []


def test_train_only_prompts_never_change_the_held_out_set():
    prompts = builtin_prompts()
    extra = [p for p in prompts if p.train_only]
    assert len(extra) > 500 and {p.kind for p in extra} == {"chat"}
    base = [p for p in prompts if not p.train_only]
    train, held = split_prompts(prompts, 0.05, 0)
    assert held == split_prompts(base, 0.05, 0)[1]  # what earlier heads were scored on
    assert set(extra) <= set(train) and not {p.text for p in held} & {
        p.text for p in extra
    }


def test_reply_weights_mark_the_drafted_positions():
    # prompt of 3 tokens, reply of 4 (positions 3..6), padded to 9: the trunk's token
    # at positions 3, 4, 5 predicts reply tokens 2..4, the ones drafts target
    assert reply_weights(3, 7, 9).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    records = [{"tokens": [1, 2, 3, 4, 5], "reply_start": 2, "kind": "code"}]
    tokens, weights = conversation_rows(records, 4, pad=0)  # cut to 4
    assert tokens.tolist() == [[1, 2, 3, 4]] and weights.tolist() == [[0, 0, 1, 0]]
    assert conversation_rows(records, 4, 0, kind="chat")[0].shape == (0, 4)


def test_replies_are_the_trunks_own_and_resume_exactly(trunk, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "TEMP", 20.0)  # the fixture's trunk is near one-hot
    monkeypatch.setattr(distill, "TOP_P", 1.0)
    model, tokenizer = load(str(trunk), allow_missing_heads=True)
    path = tmp_path / "replies.jsonl"
    args = (model, tokenizer, PROMPTS, 2, 64, path, 0)
    replies = generate_replies(*args, batch_size=4, progress=False)
    assert [(r["prompt"], r["sample"]) for r in replies] == [
        (i, s) for s in range(2) for i in range(5)
    ]
    for r in replies[:5]:  # sample 0 is greedy: plain decoding of the prompt
        prompt = encode(tokenizer, PROMPTS[r["prompt"]])
        assert r["tokens"][: r["reply_start"]] == prompt
        n = len(r["tokens"]) - r["reply_start"]
        steps = generate_step(mx.array(prompt), model.trunk, max_tokens=n)
        plain = [int(t) for t, _ in steps]
        assert r["tokens"][r["reply_start"] :] == plain
        assert len(r["tokens"]) <= 64
    assert any(a["tokens"] != b["tokens"] for a, b in zip(replies[:5], replies[5:]))
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:4]) + '\n{"prompt": 4, "sa')  # torn mid-batch
    again = generate_replies(*args, batch_size=4, progress=False)
    assert again == replies  # the same batches, seeds and replies
    assert generate_replies(*args, limit=200, batch_size=4, progress=False) == (
        replies[:4]
    )


def test_greedy_replies_skip_the_logits_and_keep_the_targets(
    trunk, tmp_path, monkeypatch
):
    """A greedy reply's trained targets are its own next tokens: the feature pass
    that skips its logits gives what the full pass's argmax gives there."""
    monkeypatch.setattr(distill, "TEMP", 20.0)
    monkeypatch.setattr(distill, "TOP_P", 1.0)
    model, tokenizer = load(str(trunk), allow_missing_heads=True)
    path = tmp_path / "replies.jsonl"
    replies = generate_replies(
        model, tokenizer, PROMPTS, 2, 48, path, 0, progress=False
    )
    tokens, weights = conversation_rows(replies, 48, tokenizer.eos_token_id)
    greedy = np.array([r["sample"] == 0 for r in replies])
    fast = compute_features(model, tokens, tmp_path, "fast", False, greedy)
    full = compute_features(model, tokens, tmp_path, "full", False)
    trained = weights > 0  # (n, L): reply positions
    assert np.array_equal(fast["hidden"], full["hidden"])
    assert np.array_equal(fast["greedy"][trained], full["greedy"][trained])
    assert np.array_equal(fast["greedy"][~greedy], full["greedy"][~greedy])
    sampled = np.stack([next_tokens(t) for t in tokens[~greedy]])
    assert (sampled != full["greedy"][~greedy])[trained[~greedy]].any()  # no shortcut


def test_distilled_training_end_to_end(trunk, tmp_path):
    prompts = tmp_path / "prompts.txt"
    lines = [json.dumps({"prompt": p.text, "kind": p.kind}) for p in PROMPTS] * 2
    lines += [f"Question number {i}?" for i in range(6)]
    prompts.write_text("\n".join(lines) + "\n")
    cfg = TrainConfig(
        depth=2,
        seq_len=40,
        batch_size=4,
        steps=8,
        draft_vocab_size=64,
        eval_every=4,
        save_every=4,
        warmup=2,
        held_out=0.2,
        distill=str(prompts),
        soft_targets=0.5,
    )
    out = train_heads(str(trunk), [], str(tmp_path / "out"), cfg, progress=False)
    info = json.loads((tmp_path / "out.train" / "progress.json").read_text())
    last = info["history"][-1]
    assert set(last["by_kind"]) == {"code replies", "chat replies"}
    for kind, cond in last["conditional_by_kind"].items():
        assert cond[0] == pytest.approx(last["by_kind"][kind][0])  # depth 1: the same
        assert all(0 <= c <= 1 for c in cond)
    config = json.loads((out / "config.json").read_text())
    record = config["mtp"]["provenance"]["training"]["distilled"]
    assert record["prompts"] == str(prompts) and record["replies"] > 0
    assert record["held_out_prompts"] >= 2
    model, tokenizer = load(str(out))
    ids = encode(tokenizer, PROMPTS[0])
    runs = [
        [
            o.token
            for o in mtp_generate_step(
                ids, model, HEADS, num_draft_tokens=k, max_tokens=20
            )
        ]
        for k in (0, 2)
    ]
    assert runs[0] == runs[1]  # exact, whatever heads


def test_cli_needs_data_or_prompts(trunk, tmp_path):
    args = ["train-heads", "--model", str(trunk), "--mlx-path", str(tmp_path / "o")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "give --data, --distill, or both" in result.output
    bad = CliRunner().invoke(main, args + ["--distill", str(tmp_path / "nope")])
    assert bad.exit_code == 1 and "no such prompts file" in bad.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.train").exists()


@pytest.mark.parametrize(
    "argv, platform, switched",
    [
        (["mlx-mtp", "train-heads", "--model", "m"], "linux", 0),
        (["mlx-mtp", "train-heads", "--help"], "linux", None),
        (["__main__.py", "generate", "-p", "x"], "linux", 1),
        (["mlx-mtp", "chat"], "linux", 1),
        (["mlx-mtp", "serve"], "linux", None),
        (["mlx-mtp", "train-heads", "--model", "m"], "darwin", None),
    ],
)
def test_fast_blas_commands(argv, platform, switched, monkeypatch):
    """On a Linux CPU the console entry re-execs train-heads on OpenBLAS with every
    core (0 here), generate and chat with one thread, and nothing else."""
    import os
    import sys

    from mlx_mtp import _entry, fast_blas

    calls = []
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(fast_blas, "ensure_fast_blas", lambda **kw: calls.append(kw))
    _entry._fast_blas()
    threads = switched or os.cpu_count() or 1
    argv = ["-m", "mlx_mtp", *argv[1:]]
    want = (
        []
        if switched is None
        else [dict(threads=threads, quiet=True, argv=argv, hold_sigint=True)]
    )
    assert calls == want

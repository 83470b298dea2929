"""Shared fixtures: tiny checkpoints in each family's Hugging Face layout, built
once."""

import signal

import mlx.core as mx
import pytest

from mlx_mtp.loading import load
from mlx_mtp.testing.fixtures import write_checkpoint

# The slowest modules (the exactness sweeps over every family, conversions (GGUF, the
# Gemma 4 pairs and DeepSeek-V4's release dtypes included), several ranks, batched V4
# rows, full-disk and interrupted writes): behind the ``slow`` marker, so that
# ``python -m pytest`` stays a few minutes; ``python -m pytest -m slow`` runs them,
# and CI (.ci/run) runs both. In the other modules a path's slowest further tests
# (another drafter's twin, a sampled sweep beside a greedy one) carry the mark
# themselves: each path keeps a test against plain decoding in the default run.
SLOW_MODULES = {
    "test_batch_greedy",
    "test_batch_sampling",
    "test_chat_page",
    "test_convert",
    "test_deepseek_v4_batch",
    "test_deepseek_v4_release",
    "test_distributed",
    "test_draft_vocab",
    "test_gemma4",
    "test_gemma4_convert",
    "test_gguf",
    "test_greedy",
    "test_safety",
    "test_lookup",
    "test_sampling",
    "test_window",
}


@pytest.fixture(autouse=True)
def fresh_sigint():
    """Every test starts with SIGINT as a new process has it (delivered, raising
    KeyboardInterrupt): an earlier test in the same worker that blocked or replaced
    it (the entry point's hold across an exec, a server's handler) must not make
    a later Ctrl-C test pass or fail by the order tests ran in."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(family, predictable=False, **kw) -> Path``, cached per arguments."""
    made = {}

    def make(family, predictable=False, **kw):
        key = (family, predictable, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}{'-pred' if predictable else ''}")
            made[key] = write_checkpoint(family, out, predictable=predictable, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def loaded(checkpoint):
    """``loaded(family, predictable=False) -> (model, tokenizer)``, cached."""
    models = {}

    def get(family, predictable=False):
        if (family, predictable) not in models:
            models[family, predictable] = load(str(checkpoint(family, predictable)))
        return models[family, predictable]

    return get


@pytest.fixture(scope="session")
def tool_folder(tmp_path_factory):
    """The predictable qwen3_5 checkpoint with a chat template that renders tools
    (`tests.test_anthropic.tool_checkpoint`), one per worker for every server module
    that serves it: its round costs and draft-vocabulary ranking are measured once."""
    from .test_anthropic import tool_checkpoint

    return tool_checkpoint(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="session", autouse=True)
def _home(tmp_path_factory):
    """Keep mlx-mtp's cache (measured round costs, demo files) out of the user's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("MLX_MTP_HOME", str(tmp_path_factory.mktemp("mlx_mtp_home")))
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _history(tmp_path_factory, monkeypatch):
    """Each test starts with no acceptance history (`mlx_mtp.history`): what one
    test's drafts did must not size another's (the round costs stay shared)."""
    from mlx_mtp import history

    path = tmp_path_factory.mktemp("history") / "acceptance.json"
    monkeypatch.setattr(history, "_file", lambda: path)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)

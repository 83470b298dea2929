"""Gemma 4 targets with their assistant drafters: the pair decodes exactly as plain
decoding of the target (greedy token for token, sampling in distribution), long past
the sliding window, through the same loop as MTP heads; mismatched pairs are refused
in one line."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_mtp.cache import WindowCache, assistant_kv, make_caches
from mlx_mtp.loading import load_model
from mlx_mtp.sampling import SamplingParams
from mlx_mtp.speculative import Session, mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

W = 8  # the fixtures' sliding window: 120 tokens wrap it 15 times
PROMPTS = ([5, 77, 301], list(range(40, 60)))  # shorter and longer than the window
PAIRS = {"e2b": True, "dense": False}  # target kind -> centroid head


def write_pair(root, kind, predictable=True, **options):
    target = write_gemma4(root / kind, kind, predictable=predictable, **options)
    assistant = write_gemma4_assistant(
        root / f"{kind}-assistant",
        target,
        centroids=PAIRS[kind],
        predictable=predictable,
    )
    return target, assistant


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request, tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("gemma4"), request.param)


@pytest.fixture(scope="module")
def model(pair):
    target, assistant = pair
    return load_model(str(target), draft_model=str(assistant))[0]


def plain(model, prompt, n):
    steps = generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    return [int(t) for t, _ in steps]


def test_pair_loads_with_the_assistant_reading_the_last_unshared_layers(model):
    text = model.trunk.language_model.args
    first_shared = text.num_hidden_layers - text.num_kv_shared_layers
    for kind, i in model.reads.items():
        assert text.layer_types[i] == kind and i < first_shared
        assert kind not in text.layer_types[i + 1 : first_shared]
    caches = make_caches(model)
    assert isinstance(caches.trunk[model.reads["sliding_attention"]], WindowCache)
    assert caches.mtp == [] and model.num_mtp_layers == 1


def test_greedy_identity_long_past_the_window(model):
    from .test_window import greedy_identity

    hist = greedy_identity(model, PROMPTS, policies=("auto",))
    assert all(h[0] > 0 for h in hist.values()), hist  # reject all
    assert all(h[-1] > 0 for h in hist.values()), hist  # accept all
    assert any(sum(h[1:-1]) > 0 for k, h in hist.items() if k > 1), hist  # partial


def test_chunked_prefill_and_sessions(model):
    """A prompt prefilled in chunks of 3 past the window, a generation stopped early
    and a session going on from it decode as plain decoding of the conversation."""
    first, second = list(range(100, 120)), [11, 12, 13]
    session = Session()
    steps = mtp_generate_step(
        first, model, HEADS, num_draft_tokens=3, session=session, prefill_step_size=3
    )
    got = [next(steps).token for _ in range(37)]
    steps.close()
    assert got == plain(model, first, 37)
    steps = mtp_generate_step(
        second, model, HEADS, num_draft_tokens=2, max_tokens=60, session=session
    )
    assert [o.token for o in steps] == plain(model, first + got + second, 60)


def test_drafting_reads_the_caches_in_place_and_writes_nothing(model):
    """The assistant's K/V are views of the trunk's cache buffers (the last W + 1
    positions of the sliding layer, every position of the full one), and a draft
    leaves every cache as it was."""
    caches = make_caches(model)
    prompt = list(range(30, 60))
    mx.eval(model.hidden(mx.array(prompt)[None], caches.trunk))
    kv = assistant_kv(model, caches.trunk)
    sliding = caches.trunk[model.reads["sliding_attention"]]
    full = caches.trunk[model.reads["full_attention"]]
    assert kv["sliding_attention"][0].shape[2] == W + 1
    assert kv["full_attention"][0].shape[2] == len(prompt)
    before = [(c.offset, np.array(c.state[0])) for c in (sliding, full)]
    from types import SimpleNamespace

    from mlx_mtp.round import DecodeState, RoundPlan, draft_heads

    h = model.hidden(mx.array(prompt[-2:-1])[None])
    state = DecodeState(prompt + [7], h, frontier=len(prompt) - 1, depth=1)
    run = SimpleNamespace(state=state, params=SamplingParams(), ruled=False)
    keys = mx.random.split(mx.random.key(0))
    rp = RoundPlan([4], [None], [None], [keys[0]], [keys[1]])
    tokens, _ = draft_heads(model, caches, [run], rp, 1)
    mx.eval(tokens)
    assert tokens.shape == (1, 4)
    for c, (offset, keys) in zip((sliding, full), before):
        assert c.offset == offset and np.array_equal(np.array(c.state[0]), keys)


# --- sampling exactness ------------------------------------------------------------

V = 16
SAMPLE_PROMPT = [3, 7, 1, 9, 4, 2, 8, 5, 6, 11]  # longer than the window of 4


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-small")
    target = write_gemma4(root / "t", "e2b", sliding_window=4, vocab_size=V)
    assistant = write_gemma4_assistant(
        root / "a", target, centroids=True, num_centroids=4, top_k=2, embed_std=0.1
    )  # flat logits: the tokens outside the chosen centroids keep some mass
    return load_model(str(target), draft_model=str(assistant))[0]


def sampling_fails(model, k, n=600) -> bool:
    """The chi-square test of `tests/test_sampling.py` on the first three tokens
    after a prompt longer than the window."""
    from .test_sampling import sampling_after_prompt_fails

    return sampling_after_prompt_fails(model, SAMPLE_PROMPT, V, k, n)


def test_sampling_is_exact_with_the_centroid_head(small):
    assert not sampling_fails(small, 2)


def test_sampling_test_catches_a_draft_distribution_cut_to_the_centroids(
    small, monkeypatch
):
    """Negative control: drafts sampled from the centroid head's logits (every other
    token at the smallest selected logit minus 1) but reported as if the other tokens
    had no mass must fail the same test."""
    from mlx_mtp import round as rounds

    pick = rounds._pick

    def cut(runs, logits, keys):
        tokens, q = pick(runs, logits, keys)
        floor = logits.min(axis=-1, keepdims=True)
        cut = mx.where(logits > floor, logits, -mx.inf)
        lp = cut - mx.logsumexp(cut, axis=-1, keepdims=True)  # (B, V)
        return tokens, [None if x is None else lp[b : b + 1] for b, x in enumerate(q)]

    monkeypatch.setattr(rounds, "_pick", cut)
    assert sampling_fails(small, 2)


# --- one draft step against the independent numpy reference -----------------------


@pytest.mark.parametrize("kind", list(PAIRS))
def test_draft_steps_match_the_numpy_reference(kind, tmp_path):
    """Two chained assistant steps after a prompt past the window, reading the trunk's
    window caches, equal transformers' math in float64 (`tests/numpy_gemma4.py`), fed
    every committed position of the same layers (it applies the window itself)."""
    from mlx_lm.models.cache import KVCache

    from .numpy_gemma4 import assistant_step

    target, assistant = write_pair(tmp_path, kind, predictable=False)
    model = load_model(str(target), draft_model=str(assistant))[0]
    prompt = list(range(30, 50))
    history = [KVCache() for _ in model.trunk.make_cache()]
    h = model.hidden(mx.array(prompt)[None], history)  # (1, 20, H)
    kv_all = {
        kind: tuple(np.array(a[0], np.float64) for a in history[i].keys_and_values())
        for kind, i in model.reads.items()
    }
    caches = make_caches(model)
    mx.eval(model.hidden(mx.array(prompt)[None], caches.trunk))
    kv = assistant_kv(model, caches.trunk)
    hidden, ref_hidden = h[:, -1:], np.array(h[0, -1], np.float64)
    for token in (7, 300):  # the pending token, then a draft
        logits, hidden = model.assist(mx.array([[token]]), hidden, kv, len(prompt))
        ref_logits, ref_hidden = assistant_step(
            assistant, target, token, ref_hidden, kv_all, len(prompt)
        )
        np.testing.assert_allclose(np.array(logits[0, 0]), ref_logits, atol=1e-4)
        np.testing.assert_allclose(np.array(hidden[0, 0]), ref_hidden, atol=1e-4)


def test_round_costs_are_kept_per_assistant(pair, tmp_path, monkeypatch):
    """``-k auto``'s measured costs are stored per target and assistant: another
    assistant for the same target is measured anew."""
    from mlx_mtp import draft_length

    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path))
    target, assistant = pair
    other = shutil.copytree(assistant, tmp_path / "other")
    keys = set()
    for a in (assistant, other, assistant):
        model = load_model(str(target), draft_model=str(a))[0]
        keys.add(draft_length._cost_key(model))
    assert len(keys) == 2

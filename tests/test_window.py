"""Sliding-window attention layers: `WindowCache` gives each query of a multi-token pass
exactly the window one-token decoding gives it, rolls back exactly at every offset of
the window, and MTP decoding of a sliding-window model equals mlx-lm's plain decoding
long past the window."""

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache

from mlx_mtp.cache import KVQuantization, WindowCache, make_caches
from mlx_mtp.cli import main
from mlx_mtp.draft_length import DraftPolicy
from mlx_mtp.errors import MTPError, RollbackError
from mlx_mtp.loading import load, load_model
from mlx_mtp.speculative import Session, mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_gemma3, write_gpt_oss, write_llama

from .test_draft_length import RandomLength

W = 8  # the fixture's window: 120 generated tokens wrap it 15 times
KV_HEADS, DIM = 2, 16
PROMPTS = ([5, 77, 301], list(range(40, 60)))  # shorter and longer than the window


def attend(q, keys, values, mask):
    """(1, H, N, D) queries over (1, H, L, D) keys with a bool (N, L) mask or None."""
    return mx.fast.scaled_dot_product_attention(
        q, keys, values, scale=DIM**-0.5, mask=mask
    )


def stream(n, seed=0):
    rng = np.random.default_rng(seed)
    shape = (1, KV_HEADS, n, DIM)
    return [mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in range(3)]


def rotating_outputs(q, k, v, keep=0):
    """Reference: one token at a time through mlx-lm's RotatingKVCache(W, keep)."""
    cache, out = RotatingKVCache(max_size=W, keep=keep), []
    for t in range(q.shape[2]):
        mask = cache.make_mask(1, window_size=W)
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        out.append(attend(q[:, :, t : t + 1], keys, values, mask))
    return mx.concatenate(out, axis=2)


def window_pass(cache, q, k, v):
    mask = cache.make_mask(q.shape[2], window_size=W)
    keys, values = cache.update_and_fetch(k, v)
    return attend(q, keys, values, mask)


@pytest.mark.parametrize("keep", [0, 3])
def test_every_query_of_a_pass_sees_its_own_window(keep):
    """Passes of 1..6 tokens (drafts and verify passes) from a cold start to far past
    the window give what one-token decoding gives, query by query, sink tokens
    (``--max-kv-size``'s ``keep``) included."""
    q, k, v = stream(60)
    expected = rotating_outputs(q, k, v, keep)
    cache, out, t = WindowCache(W, keep), [], 0
    sizes = np.random.default_rng(1).integers(1, 7, size=60)
    for n in sizes:
        if t >= 60:
            break
        n = min(int(n), 60 - t)
        out.append(window_pass(cache, *(a[:, :, t : t + n] for a in (q, k, v))))
        t += n
    np.testing.assert_allclose(
        np.array(mx.concatenate(out, axis=2)), np.array(expected), atol=1e-5
    )
    assert cache.keys.shape[2] <= 256 and cache._kept() <= W - 1 + cache.slack


@pytest.mark.parametrize("keep", [0, 3])
@pytest.mark.parametrize("k", [1, 4])
def test_rollback_parity_at_every_offset_of_the_window(k, keep):
    """After a verify pass of k + 1 tokens rolled back by n = 0..k, at every offset of
    the window (positions W..2W-1), the next query is answered exactly as by a fresh
    cache that saw only the kept tokens."""
    total = 2 * W + k + 2
    q, keys, values = stream(total, seed=2)
    for p in range(W, 2 * W):
        for n in range(k + 1):
            cache = WindowCache(W, keep)
            window_pass(cache, *(a[:, :, :p] for a in (q, keys, values)))
            window_pass(cache, *(a[:, :, p : p + k + 1] for a in (q, keys, values)))
            cache.trim(n)
            kept = p + k + 1 - n
            nxt = [a[:, :, total - 1 :] for a in (q, keys, values)]
            got = window_pass(cache, *nxt)
            fresh = WindowCache(W, keep)
            window_pass(fresh, *(a[:, :, :kept] for a in (q, keys, values)))
            want = window_pass(fresh, *nxt)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_rolling_back_past_what_is_kept_is_an_error():
    q, k, v = stream(40)
    cache = WindowCache(W, slack=4)
    window_pass(cache, q, k, v)
    cache.trim(4)
    window_pass(cache, *(a[:, :, :1] for a in (q, k, v)))  # still within the slack
    cache.trim(6)
    with pytest.raises(RollbackError, match="rolled back past"):
        window_pass(cache, *(a[:, :, :1] for a in (q, k, v)))


def write_sliding(family, path, window=W):
    """A model whose sliding-window layers attend over ``window`` positions, with
    retrofitted heads that agree with it part of the time: a llama with a sliding
    first layer, Gemma 3 (two sliding layers, then a full one) or gpt-oss (a sliding
    layer with attention sinks, then a full one)."""
    if family == "llama":
        return write_llama(
            path, heads=True, predictable=True, sliding_window=window, weight_std=0.2
        )
    write = write_gemma3 if family == "gemma3_text" else write_gpt_oss
    return write(path, predictable=True, sliding_window=window)


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "gpt_oss"])
def sliding(request, tmp_path_factory):
    return write_sliding(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def model(sliding):
    return load(str(sliding))[0]


def plain(model, prompt, n):
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    ]


def test_the_window_matters(sliding, model, tmp_path):
    """The fixture's output depends on the window (else the tests below prove
    nothing about it): the same weights with a window past the text decode otherwise."""
    full = write_sliding(model.model_type, tmp_path / "full", window=1024)
    assert plain(model, PROMPTS[1], 120) != plain(load(str(full))[0], PROMPTS[1], 120)


def greedy_identity(model, prompts, n=120, ks=(1, 2, 3, 4), policies=()):
    """Assert that every k, a random-k policy and ``policies`` (`DraftPolicy` objects
    or ``num_draft_tokens`` values) decode each prompt as plain decoding does; returns
    the accepted-count histograms per k, summed."""
    hist = {}
    for prompt in prompts:
        expected = plain(model, prompt, n)
        for k in ks:
            outs = list(
                mtp_generate_step(
                    prompt, model, HEADS, num_draft_tokens=k, max_tokens=n
                )
            )
            assert [o.token for o in outs] == expected, (len(prompt), k)
            h = hist.setdefault(k, [0] * (k + 1))
            hist[k] = [a + b for a, b in zip(h, outs[-1].stats.accepted_histogram)]
        for policy in (RandomLength([0, 1, 2, 3, 4], seed=len(prompt)), *policies):
            chosen = {"num_draft_tokens": policy}
            if isinstance(policy, DraftPolicy):
                chosen = {"policy": policy}
            outs = mtp_generate_step(prompt, model, HEADS, **chosen, max_tokens=n)
            assert [o.token for o in outs] == expected, (len(prompt), policy)
    return hist


def test_greedy_identity_long_past_the_window(model):
    hist = greedy_identity(model, PROMPTS)
    assert all(h[0] > 0 for h in hist.values()), hist  # reject all
    assert any(h[-1] > 0 for h in hist.values()), hist  # accept all
    assert any(sum(h[1:-1]) > 0 for k, h in hist.items() if k > 1), hist  # partial


def test_chunked_prefill_past_the_window(model):
    """A prompt of 2.5 windows prefilled in chunks of 3 (each chunk a multi-token pass
    over a wrapped window) decodes as plain decoding does."""
    prompt = list(range(100, 120))
    expected = plain(model, prompt, 40)
    steps = mtp_generate_step(
        prompt, model, HEADS, num_draft_tokens=2, max_tokens=40, prefill_step_size=3
    )
    assert [o.token for o in steps] == expected


def test_caches_are_windows_and_kv_bits_is_refused(model):
    caches = make_caches(model)
    assert isinstance(caches.trunk[0], WindowCache) and caches.trunk[0].window == W
    with pytest.raises(MTPError, match="sliding-window"):
        KVQuantization(4).check(caches.trunk)


def test_early_close_and_sessions_equal_a_fresh_prefill(model):
    """A generation stopped early, then continued in a session, decodes the whole
    conversation exactly as plain decoding of it does."""
    first, second = PROMPTS[1], [11, 12, 13]
    session = Session()
    steps = mtp_generate_step(first, model, HEADS, num_draft_tokens=3, session=session)
    got = [next(steps).token for _ in range(37)]
    steps.close()  # early: the round in flight is dropped
    assert got == plain(model, first, 37)
    reply = [
        o.token
        for o in mtp_generate_step(
            second, model, HEADS, num_draft_tokens=3, max_tokens=60, session=session
        )
    ]
    assert reply == plain(model, first + got + second, 60)


def test_cli_generate_k3_equals_k0(sliding):
    args = ["generate", "--model", str(sliding), "-p", "def f(x):", "-m", "200"]
    runs = [CliRunner().invoke(main, args + ["-k", k, "--quiet"]) for k in ("3", "0")]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    assert runs[0].output == runs[1].output and len(runs[0].output) > 100


# --- sampling exactness ------------------------------------------------------------

SAMPLE_PROMPT = [3, 7, 1, 9, 4, 2]  # already twice the window of 3


@pytest.fixture(scope="module")
def small_sliding(tmp_path_factory):
    path = tmp_path_factory.mktemp("small-sliding")
    write_llama(
        path,
        heads=True,
        predictable=True,
        sliding_window=3,
        weight_std=0.1,
        vocab_size=16,
    )
    return load_model(str(path))[0]


def sampling_fails(model, k, n=600) -> bool:
    """The chi-square test of `tests/test_sampling.py` on the first three tokens
    after a prompt longer than the window."""
    from .test_sampling import sampling_after_prompt_fails

    return sampling_after_prompt_fails(model, SAMPLE_PROMPT, 16, k, n)


def test_sampling_is_exact_past_the_window(small_sliding):
    assert not sampling_fails(small_sliding, 2)


def test_sampling_test_catches_a_pass_wide_window(small_sliding, monkeypatch):
    """Negative control: a cache that gives every query of a pass the window of the
    pass's last query must fail the same test."""

    def last_query_window(self, N, window_size=None, return_array=False):
        window = window_size or self.window
        k = mx.arange(self.start, self.offset + N)[None]
        causal = mx.arange(self.offset, self.offset + N)[:, None] >= k
        return causal & (k > self.offset + N - 1 - window)

    monkeypatch.setattr(WindowCache, "make_mask", last_query_window)
    assert sampling_fails(small_sliding, 2)


def test_max_kv_size_drafts_exactly(checkpoint):
    """``--max-kv-size N`` (every layer a window of N with 4 sink tokens, as mlx-lm's
    plain decoding keeps it) drafts exactly what one-token decoding gives, past the
    window many times, with prompts shorter and longer than it."""
    model = load(str(checkpoint("mimo", predictable=True)))[0]
    for prompt in PROMPTS:
        steps = generate_step(
            mx.array(prompt),
            model.trunk,
            max_tokens=100,
            max_kv_size=16,
            prefill_step_size=1,
        )  # one token at a time: mlx-lm's one-token semantics
        expected = [int(t) for t, _ in steps]
        for k in (0, 1, 3):
            outs = mtp_generate_step(
                prompt, model, HEADS, num_draft_tokens=k, max_tokens=100, max_kv_size=16
            )
            assert [o.token for o in outs] == expected, (len(prompt), k)

"""Greedy MTP decoding emits exactly plain greedy decoding (mlx-lm's generate_step)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import FAMILIES

NUM_TOKENS = 64
PROMPTS = ("def forward(self, x):", "The quick brown fox", "import numpy as np\n")


def plain_greedy(model, prompt, n):
    steps = generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    return [int(t) for t, _ in steps]


def mtp_greedy(model, prompt, n, k):
    outs = list(
        mtp_generate_step(prompt, model, HEADS, num_draft_tokens=k, max_tokens=n)
    )
    return [o.token for o in outs], outs[-1].stats


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_all_paths(family, loaded):
    """k = 1..4 on a head that often agrees: identical tokens, and every acceptance
    path (reject all, partial, accept all) is taken."""
    model, tokenizer = loaded(family, predictable=True)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = plain_greedy(model, ids, NUM_TOKENS)
        for k in range(1, 5):
            tokens, stats = mtp_greedy(model, ids, NUM_TOKENS, k)
            assert tokens == expected, (family, prompt, k)
            assert stats.emitted == NUM_TOKENS
    hist = _histograms(model, tokenizer)
    assert all(h[0] > 0 for h in hist.values()), hist  # reject all
    assert all(h[-1] > 0 for h in hist.values()), hist  # accept all
    assert any(sum(h[1:-1]) > 0 for k, h in hist.items() if k > 1), hist  # partial


def _histograms(model, tokenizer):
    hist = {}
    for k in range(1, 5):
        total = [0] * (k + 1)
        for prompt in PROMPTS:
            _, stats = mtp_greedy(model, tokenizer.encode(prompt), NUM_TOKENS, k)
            total = [a + b for a, b in zip(total, stats.accepted_histogram)]
        hist[k] = total
    return hist


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_random_heads(family, loaded):
    """Random heads are (almost) always rejected; the output is still exact."""
    model, tokenizer = loaded(family)
    ids = tokenizer.encode(PROMPTS[0])
    expected = plain_greedy(model, ids, NUM_TOKENS)
    for k in (1, 3):
        assert mtp_greedy(model, ids, NUM_TOKENS, k)[0] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_path_is_mlx_lm(family, loaded):
    """k = 0 is plain decoding through the same loop."""
    model, tokenizer = loaded(family, predictable=True)
    ids = tokenizer.encode(PROMPTS[1])
    tokens, stats = mtp_greedy(model, ids, 32, 0)
    assert tokens == plain_greedy(model, ids, 32)
    assert stats.drafted == 0 and stats.rounds == 32


def test_single_token_prompt_and_short_runs(loaded):
    """A one-token prompt has no hidden state to draft from in the first round."""
    model, _ = loaded("deepseek_v3", predictable=True)
    for n in (1, 2, 5):
        assert mtp_greedy(model, [7], n, 3)[0] == plain_greedy(model, [7], n)


def test_long_prompt_chunked_prefill(loaded):
    """Prefill in chunks (trunk and MTP rows) gives the same tokens."""
    model, tokenizer = loaded("mimo", predictable=True)
    ids = tokenizer.encode("def f(x):\n    return x * 2\n" * 12)
    expected = plain_greedy(model, ids, 24)
    steps = mtp_generate_step(
        ids, model, HEADS, num_draft_tokens=2, max_tokens=24, prefill_step_size=16
    )
    assert [o.token for o in steps] == expected


def test_drafting_params_do_not_matter_for_greedy(loaded):
    """Greedy ignores top-p/top-k: identical output."""
    model, tokenizer = loaded("glm4_moe", predictable=True)
    ids = tokenizer.encode(PROMPTS[2])
    outs = mtp_generate_step(
        ids,
        model,
        HEADS,
        num_draft_tokens=2,
        temp=0.0,
        top_p=0.5,
        top_k=3,
        max_tokens=32,
    )
    assert [o.token for o in outs] == plain_greedy(model, ids, 32)


def test_greedy_identity_with_quantized_kv(checkpoint):
    """KV caches quantized as mlx-lm's ``kv_bits`` does: rejected entries are trimmed
    from the quantized cache, and the tokens match mlx-lm's quantized decoding."""
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_mtp.cache import make_caches
    from mlx_mtp.loading import load

    path = checkpoint("mimo", predictable=True, num_attention_heads=2)
    model, tokenizer = load(str(path))
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        steps = generate_step(
            mx.array(ids),
            model.trunk,
            max_tokens=NUM_TOKENS,
            kv_bits=4,
            kv_group_size=32,
            quantized_kv_start=0,
        )
        expected = [int(t) for t, _ in steps]
        for k in (1, 3):
            caches = make_caches(model)
            outs = list(
                mtp_generate_step(
                    ids,
                    model,
                    HEADS,
                    num_draft_tokens=k,
                    max_tokens=NUM_TOKENS,
                    **kv,
                    caches=caches,
                )
            )
            assert [o.token for o in outs] == expected, (prompt, k)
            assert 0 < outs[-1].stats.accepted < outs[-1].stats.drafted
            assert all(isinstance(c, QuantizedKVCache) for c in caches.trunk)


def test_plain_path_with_rotating_window(loaded):
    """k = 0 with a rotating KV window equals mlx-lm's plain decoding with
    ``max_kv_size``, past the point where the window wraps."""
    model, tokenizer = loaded("mimo", predictable=True)
    ids = tokenizer.encode(PROMPTS[0])
    steps = generate_step(mx.array(ids), model.trunk, max_tokens=48, max_kv_size=16)
    expected = [int(t) for t, _ in steps]
    outs = mtp_generate_step(
        ids, model, HEADS, num_draft_tokens=0, max_tokens=48, max_kv_size=16
    )
    assert [o.token for o in outs] == expected

"""DeepSeek-V4's caches: a pass in chunks equals one pass, a rollback leaves every cache
as if the rejected positions had never been seen (compressed entries a draft closed,
open blocks a draft started, the indexer's keys, the window), and drafting over
prompts that cross compression blocks decodes as plain decoding."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.cache import begin_verify, make_caches, rewind
from mlx_mtp.errors import RollbackError
from mlx_mtp.models import deepseek_v4_cache
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .numpy_deepseek_v4 import reference_logits
from .test_greedy import plain_greedy
from .test_numerics import teacher_forced

N = 90  # > the window (8), 22 blocks of the CSA layers (4), 5 of the HCA layer (16)
TOKENS = np.random.default_rng(1).integers(0, 500, (1, N)).tolist()
STARTS = (15, 16, 17, 31, 32, 33, 47, 48, 63, 64)  # around the blocks' ends


@pytest.fixture(scope="module")
def v4(loaded):
    return loaded("deepseek_v4", True)


def logits(model, ids, cache=None):
    return model.logits(model.hidden(mx.array(ids), cache))


@pytest.mark.parametrize("predictable", (False, True))
def test_long_prompts_match_the_numpy_reference(loaded, checkpoint, predictable):
    """Over 80 tokens (`tests/test_numerics.py`'s prompt is shorter than the first
    HCA block and top-k's reach): the indexer prunes, HCA entries are seen, the MTP
    layer reads packed states; trunk and MTP logits within 1e-4 of float64."""
    model, _ = loaded("deepseek_v4", predictable)
    tokens = TOKENS[0][:80]
    trace = {}
    ref_main, ref_mtp = reference_logits(
        checkpoint("deepseek_v4", predictable), tokens, trace
    )
    for csa in ("entries_1", "entries_3"):  # top-k keeps 4 of up to 20 entries
        assert trace[csa].sum(axis=1).max() == 4 < trace[csa].shape[1]
    assert trace["entries_2"].sum(axis=1).max() == 80 // 16  # HCA sees all closed
    main, mtp = teacher_forced(model, tokens)
    np.testing.assert_allclose(main, ref_main, atol=1e-4)
    np.testing.assert_allclose(mtp[0], ref_mtp[0], atol=1e-4)


def test_a_pass_in_chunks_equals_one_pass(v4):
    model, _ = v4
    full = logits(model, TOKENS)
    for chunk in (1, 5):
        caches = make_caches(model).trunk
        parts = [
            logits(model, [TOKENS[0][s : s + chunk]], caches)
            for s in range(0, N, chunk)
        ]
        got = mx.concatenate(parts, axis=1)
        np.testing.assert_allclose(np.array(got), np.array(full), atol=1e-4)


def rolled_back_errors(model, full, draft: int) -> list:
    """``(start, max |diff|)`` of the logits after ``draft`` rejected positions at each
    of `STARTS` were rolled back, against one pass."""
    rng = np.random.default_rng(draft)
    out = []
    for start in STARTS:
        caches = make_caches(model).trunk
        mx.eval(model.hidden(mx.array([TOKENS[0][:start]]), caches))
        marks = begin_verify(caches)
        junk = rng.integers(0, 500, (1, draft)).tolist()
        mx.eval(model.hidden(mx.array(junk), caches))
        rewind(caches, marks, draft)
        got = logits(model, [TOKENS[0][start : start + 8]], caches)
        out.append((start, float(mx.abs(got - full[:, start : start + 8]).max())))
    return out


@pytest.mark.parametrize("draft", (1, 2, 3, 4, 5))
def test_rollback_leaves_the_caches_as_if_never_seen(v4, draft):
    model, _ = v4
    full = logits(model, TOKENS)
    for start, err in rolled_back_errors(model, full, draft):
        assert err < 1e-4, (start, draft, err)


def test_the_rollback_check_catches_a_compressor_left_untrimmed(v4, monkeypatch):
    """Negative control: with the compressors' trim switched off, rolled-back drafts
    that closed or opened blocks change what follows."""
    model, _ = v4
    full = logits(model, TOKENS)
    monkeypatch.setattr(
        deepseek_v4_cache.CompressorState, "trim_to", lambda self, end: None
    )
    assert max(err for _, err in rolled_back_errors(model, full, 4)) > 1e-2


def test_rolling_back_past_the_slack_is_refused(v4):
    model, _ = v4
    caches = make_caches(model).trunk
    mx.eval(model.hidden(mx.array(TOKENS), caches))
    layer = caches[2]  # the HCA layer (ratio 16)
    with pytest.raises(RollbackError):
        layer.trim(layer.slack + 20)


@pytest.mark.slow  # about 20 s
@pytest.mark.parametrize("prompt_len", (13, 15, 16, 30, 31))
def test_drafting_across_block_boundaries_is_plain_decoding(v4, prompt_len):
    """Prompts ending just before, at and after block ends: k = 1..4 and auto emit
    plain greedy decoding's tokens, with drafts accepted and rejected."""
    model, _ = v4
    prompt = TOKENS[0][:prompt_len]
    expected = plain_greedy(model, prompt, 40)
    for k in (1, 2, 3, 4, "auto"):
        steps = mtp_generate_step(
            prompt, model, HEADS, num_draft_tokens=k, max_tokens=40
        )
        outs = list(steps)
        assert [o.token for o in outs] == expected, (prompt_len, k)
        stats = outs[-1].stats
        if k != "auto":
            assert stats.drafted > stats.accepted > 0, (prompt_len, k)


def test_a_changed_mlx_lm_helper_is_refused_at_import():
    """The private ``deepseek_v41`` helpers V4 calls are checked, parameters and
    all: one gone, or with other parameters, is one `MTPError` line."""
    import types

    from mlx_mtp.errors import MTPError
    from mlx_mtp.models import deepseek_v4

    deepseek_v4.check_mlx_lm()  # the installed mlx-lm's pass
    helpers = {n: getattr(deepseek_v4.lm, n) for n, _ in deepseek_v4.MLX_LM_PRIVATE}
    gone = types.SimpleNamespace(**{**helpers, "_collapse": None})
    with pytest.raises(MTPError, match="_collapse is gone"):
        deepseek_v4.check_mlx_lm(gone)

    def _window_indices(previous, length, window):  # no longer keyword-only
        return None

    changed = types.SimpleNamespace(**{**helpers, "_window_indices": _window_indices})
    with pytest.raises(MTPError, match=r"_window_indices has changed"):
        deepseek_v4.check_mlx_lm(changed)

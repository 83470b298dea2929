"""Qwen3.8-Flash-Next (qwen4_exp) specifics: the trunk is mlx-vlm's, used through the
extra ``mlx-mtp[vlm]``, with caches that roll back exactly at every position (the
delta net's and the n-gram embedding's slots recorded per position, QSA's keys and
indexer keys trimmed); the suites over every family check greedy identity,
batching, conversion and numerics, `scripts/peer_qwen4_exp.py` the agreement with
mlx-vlm's own runtime."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.cache import begin_verify, keep_below, make_caches, rewind
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.models import qwen4_exp
from mlx_mtp.models.qwen4_exp import FLOAT_LAYERS as FLOATS
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_errors import assert_one_line_error
from .test_greedy import plain_greedy
from .vlm_trunks import generate_without_mlx_vlm

# Past 8 keys the indexer chooses 2 of the blocks of 4.
PROMPT = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99]
NEXT = [21, 22]


def hidden(model, ids, caches):
    return model.hidden(mx.array([ids]), caches)


def after(model, passes):
    """Trunk caches after ``passes`` (lists of ids, one pass each; those after the
    first verify passes, as the decode loop runs them)."""
    caches = make_caches(model)
    for i, ids in enumerate(passes):
        if i:
            begin_verify(caches.trunk)
        hidden(model, ids, caches.trunk)
    return caches


@pytest.mark.parametrize("length", [4, 10])
def test_the_trunk_rolls_back_at_every_position(loaded, length):
    """A verify pass of ``length`` positions, rolled back by n, is the verify pass
    of its first ``length - n`` positions, for every n: what the caches then give
    the next pass is identical (mlx-vlm's batch-invariant forward computes each
    position as a one-position pass does, whatever the pass's length)."""
    model, _ = loaded("qwen4_exp")
    extra = [7, 9, 11, 13, 15, 17, 19, 23, 29, 31][:length]
    for n in range(length + 1):
        caches = after(model, [PROMPT])
        marks = begin_verify(caches.trunk)
        hidden(model, extra, caches.trunk)
        rewind(caches.trunk, marks, n)
        kept = extra[: length - n]
        fresh = after(model, [PROMPT, kept] if kept else [PROMPT])
        ours, ref = (np.array(hidden(model, NEXT, c.trunk)) for c in (caches, fresh))
        np.testing.assert_array_equal(ours, ref, err_msg=str(n))


def test_the_mtp_layers_cache_trims_across_draft_passes(loaded):
    """The MTP layer's indexer pools are trimmed with no mark, after several
    one-row draft passes (across pool boundaries), to what the rows kept give."""
    model, _ = loaded("qwen4_exp")
    h = hidden(model, PROMPT + NEXT, make_caches(model).trunk)
    tokens = mx.array([PROMPT[1:] + NEXT])

    def mtp(cache, rows):
        return model.mtp_forward(0, h[:, rows], tokens[:, rows], cache)

    for limit in range(len(PROMPT) - 4, len(PROMPT) + 1):
        cache = make_caches(model).mtp[0]
        mtp(cache, slice(0, len(PROMPT) - 4))
        for i in range(len(PROMPT) - 4, len(PROMPT)):
            mtp(cache, slice(i, i + 1))
        keep_below([cache], [limit])
        fresh = make_caches(model).mtp[0]
        mtp(fresh, slice(0, limit))
        rows = slice(limit, limit + 1)
        np.testing.assert_array_equal(
            np.array(mtp(cache, rows)), np.array(mtp(fresh, rows)), err_msg=str(limit)
        )


def test_greedy_identity_with_a_long_prompt(loaded):
    """The predictable fixture past the indexer's first choices, k = 1 and 3:
    drafts are accepted and the tokens are plain decoding's."""
    model, _ = loaded("qwen4_exp", predictable=True)
    for k in (1, 3):
        steps = list(
            mtp_generate_step(PROMPT, model, HEADS, num_draft_tokens=k, max_tokens=40)
        )
        assert [o.token for o in steps] == plain_greedy(model, PROMPT, 40)
        assert steps[-1].stats.accepted > 0


def test_the_text_trunk_leaves_the_vision_tower_out(loaded):
    model, _ = loaded("qwen4_exp")
    names = [k for k, _ in tree_flatten(model.trunk.parameters())]
    assert names and not any("visual" in k or "vision" in k for k in names)
    assert len(model.mtp.layers) == 1


def test_without_mlx_vlm_a_load_fails_in_one_line(checkpoint, monkeypatch):
    path = checkpoint("qwen4_exp")
    cached = (
        qwen4_exp._language,
        qwen4_exp._vlm_model,
        qwen4_exp._drafter,
        qwen4_exp._fp8,
        qwen4_exp._attention_mask,
        qwen4_exp._trunk_classes,
        qwen4_exp.qsa_rows_class,
    )
    result = generate_without_mlx_vlm(path, cached, monkeypatch)
    message = "Qwen3.8-Flash-Next (qwen4_exp) needs mlx-vlm: pip install 'mlx-mtp[vlm]'"
    assert_one_line_error(result, message)


def test_several_ranks_are_refused_in_one_line(loaded):
    from mlx_mtp import distributed

    model, _ = loaded("qwen4_exp")
    with pytest.raises(MTPError, match="cannot shard"):
        distributed.shard(model.trunk, object())


def test_a_quantized_conversion_keeps_the_release_float_layers(checkpoint, tmp_path):
    """``convert -q`` quantizes the trunk (4 bits) and the heads (8), but each
    stream's injection gate and the shared expert's gate stay float, as released."""
    out = convert(str(checkpoint("qwen4_exp")), tmp_path / "q4", quantize=True)
    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    kept = [k for k in weights if k.endswith(tuple(f"{n}.weight" for n in FLOATS))]
    assert len(kept) == 3 * 4 + 3  # 2 gates + 1 per layer (4), and the MTP's 3
    assert all(weights[k].dtype == mx.float32 for k in kept)
    assert not any(k.replace(".weight", ".scales") in weights for k in kept)
    assert any(k.endswith("o_proj.scales") for k in weights)  # the rest is quantized

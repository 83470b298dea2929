"""GLM-5.3-Flash (glm5_next) specifics: the trunk is mlx-vlm's, used through the extra
``mlx-mtp[vlm]``, with caches that roll back exactly at every position (KDA states
recorded per position, indexer pools rebuilt from the key rows they keep); the
suites over every family check greedy identity, batching, conversion and numerics,
`scripts/peer_glm5_next.py` the agreement with mlx-vlm's own runtime."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.cache import begin_verify, keep_below, make_caches, rewind
from mlx_mtp.errors import MTPError, RollbackError
from mlx_mtp.models import glm5_next, vlm_cache
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_errors import assert_one_line_error
from .test_greedy import plain_greedy
from .vlm_trunks import generate_without_mlx_vlm

# Past 8 keys the indexer chooses 2 of the pools of 4 (and the open pool's tail).
PROMPT = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99]
NEXT = [21, 22]


def hidden(model, ids, caches):
    return model.hidden(mx.array([ids]), caches)


def after(model, passes):
    """Trunk caches after ``passes`` (lists of ids, one pass each)."""
    caches = make_caches(model)
    for ids in passes:
        hidden(model, ids, caches.trunk)
    return caches


@pytest.mark.parametrize("length", [5, 10])
def test_the_trunk_rolls_back_at_every_position(loaded, length):
    """A verify pass of ``length`` positions, rolled back by n, is the pass of its
    first ``length - n`` positions, for every n: what the caches then give the next
    pass is identical for 5 (mlx-vlm projects a pass of up to 8 positions as decode
    steps, so a shorter pass computes the kept positions alike), and equal to float
    rounding for 10 (a prefill's matrix products, which a pass of 8 or fewer does
    not reproduce bit for bit; it also extends the projected keys). A wrong state
    or pool moves the next pass's hidden states by about 0.1."""
    model, _ = loaded("glm5_next")
    extra = [7, 9, 11, 13, 15, 17, 19, 23, 29, 31][:length]
    for n in range(length + 1):
        caches = after(model, [PROMPT])
        marks = begin_verify(caches.trunk)
        hidden(model, extra, caches.trunk)
        rewind(caches.trunk, marks, n)
        kept = extra[: length - n]
        fresh = after(model, [PROMPT, kept] if kept else [PROMPT])
        ours, ref = (np.array(hidden(model, NEXT, c.trunk)) for c in (caches, fresh))
        if length <= 8:
            np.testing.assert_array_equal(ours, ref, err_msg=str(n))
        else:
            np.testing.assert_allclose(ours, ref, atol=1e-5, err_msg=str(n))


def test_the_mtp_layers_cache_trims_across_draft_passes(loaded):
    """The MTP layer's indexer pools are trimmed with no mark, after several
    one-row draft passes (across pool boundaries), to what the rows kept give."""
    model, _ = loaded("glm5_next")
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


def test_a_rollback_past_what_is_kept_is_refused():
    """Past its slack, an indexer cache refuses (never a wrong pool)."""
    pools = vlm_cache.pool_cache_class()(4, slack=4)
    kv = mx.random.normal((1, 12, 8))
    ready, _, _ = pools.accumulate_windows(kv, kv, 0)  # as the indexer pools them
    pools.update_and_fetch(ready.reshape(1, -1, 4, 8).mean(axis=2))
    pools.trim(3)
    assert (pools.positions, pools.remainder, pools.pooled.shape[1]) == (9, 1, 2)
    with pytest.raises(RollbackError, match="past the 4 positions"):
        pools.trim(3)


def test_greedy_identity_with_a_long_prompt(loaded):
    """The predictable fixture past the indexer's first choices, k = 1 and 3:
    drafts are accepted and the tokens are plain decoding's."""
    model, _ = loaded("glm5_next", predictable=True)
    for k in (1, 3):
        steps = list(
            mtp_generate_step(PROMPT, model, HEADS, num_draft_tokens=k, max_tokens=40)
        )
        assert [o.token for o in steps] == plain_greedy(model, PROMPT, 40)
        assert steps[-1].stats.accepted > 0


def test_the_text_trunk_leaves_the_vision_tower_out(loaded):
    model, _ = loaded("glm5_next")
    names = [k for k, _ in tree_flatten(model.trunk.parameters())]
    assert names and not any("visual" in k or "vision" in k for k in names)
    assert len(model.mtp.layers) == 1


def test_without_mlx_vlm_a_load_fails_in_one_line(checkpoint, monkeypatch):
    cached = (
        glm5_next._language,
        glm5_next._drafter,
        glm5_next._linear,
        glm5_next._trunk_classes,
        glm5_next._block_class,
    )
    result = generate_without_mlx_vlm(checkpoint("glm5_next"), cached, monkeypatch)
    assert_one_line_error(
        result, "GLM-5.3-Flash (glm5_next) needs mlx-vlm: pip install 'mlx-mtp[vlm]'"
    )


def test_several_ranks_are_refused_in_one_line(loaded):
    from mlx_mtp import distributed

    model, _ = loaded("glm5_next")
    with pytest.raises(MTPError, match="cannot shard"):
        distributed.shard(model.trunk, object())

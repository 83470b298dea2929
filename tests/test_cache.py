"""Rollback: after decoding with partial acceptance, every cache equals a fresh prefill
of the committed tokens; the MTP caches hold entries computed from true trunk states."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlx_mtp.cache import Caches, check_rollback, make_caches, mtp_caches
from mlx_mtp.draft_length import DraftPolicy
from mlx_mtp.errors import RollbackError
from mlx_mtp.media import MediaCache
from mlx_mtp.models.deepseek_v4_cache import V4Cache
from mlx_mtp.models.glm5_next_cache import ProjectionRows
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import FAMILIES


def assert_same_kv(cache, fresh, upto=None):
    if isinstance(fresh, MediaCache):  # the same images, or none
        assert [m and m.key for m in cache.rows] == [m and m.key for m in fresh.rows]
        return
    if hasattr(fresh, "pooled"):  # GLM-5.3-Flash's indexer pools
        assert_same_pools_below(cache, fresh, upto)
        return
    upto = fresh.offset if upto is None else upto
    if isinstance(fresh, ProjectionRows):  # a prefix of the positions, maybe none
        upto = min(upto, cache.offset, fresh.offset)
    if isinstance(fresh, CacheList):
        for c, f in zip(cache.caches, fresh.caches):
            assert_same_kv(c, f, upto)
        return
    for ours, ref in ((cache.keys, fresh.keys), (cache.values, fresh.values)):
        np.testing.assert_allclose(
            np.array(ours[..., :upto, :]), np.array(ref[..., :upto, :]), atol=1e-4
        )


def assert_same_cache(cache, fresh):
    """KV entries, or a recurrent layer's conv and SSM states, match (float32); a
    layer's several caches (DeepSeek-V3.2's MLA and indexer) one by one."""
    if isinstance(fresh, CacheList):
        assert len(cache.caches) == len(fresh.caches)
        for ours, ref in zip(cache.caches, fresh.caches):
            assert_same_cache(ours, ref)
    elif isinstance(fresh, V4Cache):
        assert_same_v4_cache(cache, fresh)
    elif isinstance(fresh, MediaCache):
        assert_same_kv(cache, fresh)
    elif hasattr(fresh, "pooled"):  # GLM-5.3-Flash's indexer pools
        assert_same_pools(cache, fresh)
    elif isinstance(fresh, ProjectionRows):
        assert_same_kv(cache, fresh)
    elif isinstance(fresh, ArraysCache) or isinstance(getattr(fresh, "cache", 0), list):
        assert len(cache.cache) == len(fresh.cache)
        for ours, ref in zip(cache.cache, fresh.cache):
            np.testing.assert_allclose(np.array(ours), np.array(ref), atol=1e-4)
    else:
        assert cache.offset == fresh.offset
        assert_same_kv(cache, fresh)


def assert_same_pools(cache, fresh):
    """The same positions, closed pools and open pool's rows (mlx-vlm's
    ``PoolingCache`` as `mlx_mtp.models.vlm_cache.PoolCache` keeps it)."""
    assert (cache.positions, cache.remainder) == (fresh.positions, fresh.remainder)
    assert (cache.pooled is None) == (fresh.pooled is None)
    pairs = [(cache.buf_kv, fresh.buf_kv), (cache.buf_gate, fresh.buf_gate)]
    pairs = [(a[:, : fresh.remainder], b[:, : fresh.remainder]) for a, b in pairs]
    if fresh.pooled is not None:
        pairs.append((cache.pooled, fresh.pooled))
    for ours, ref in pairs:
        np.testing.assert_allclose(np.array(ours), np.array(ref), atol=1e-4)


def assert_same_pools_below(cache, fresh, upto):
    """The closed pools below position ``upto`` and the raw key rows of the pool
    open there (from which a rollback rebuilds it), as both caches keep them."""
    closed = upto // fresh.ratio
    if closed:
        np.testing.assert_allclose(
            np.array(cache.pooled[:, :closed]),
            np.array(fresh.pooled[:, :closed]),
            atol=1e-4,
        )
    first = closed * fresh.ratio
    for ours, ref in zip(cache.rows, fresh.rows):
        a = ours[:, first - cache.rows_start : upto - cache.rows_start]
        b = ref[:, first - fresh.rows_start : upto - fresh.rows_start]
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def assert_same_v4_cache(cache, fresh):
    """The window rows both caches hold (at least a window's), every compressed
    entry, and the projections both keep for the open blocks."""
    assert cache.offset == fresh.offset
    n = min(cache.keys.shape[2], fresh.keys.shape[2])
    assert n >= min(fresh.offset, cache.window - 1)
    np.testing.assert_allclose(
        np.array(cache.keys[:, :, -n:]), np.array(fresh.keys[:, :, -n:]), atol=1e-4
    )
    for ours, ref in zip(cache._compressors(), fresh._compressors()):
        assert ours.end == ref.end and ours.count == ref.count
        if ref.count:
            np.testing.assert_allclose(
                np.array(ours.entries), np.array(ref.entries), atol=1e-4
            )
        n = min(ours.end - ours.start, ref.end - ref.start)
        for a, b in ((ours.kv, ref.kv), (ours.gate, ref.gate)):
            np.testing.assert_allclose(
                np.array(a[:, a.shape[1] - n :]),
                np.array(b[:, b.shape[1] - n :]),
                atol=1e-4,
            )


def held_positions(caches) -> int:
    """Positions in a trunk cache list (read from its attention layers)."""
    return next(c.offset for c in caches if hasattr(c, "offset"))


def fresh_caches(model, tokens):
    """Trunk caches of a prefill of ``tokens``, and MTP caches of a teacher-forced
    pass."""
    caches = make_caches(model)
    seq = mx.array(tokens)[None]
    h = model.hidden(seq, caches.trunk)
    for j, c in enumerate(caches.mtp):
        h = model.mtp_forward(j, h[:, : len(tokens) - 1 - j], seq[:, j + 1 :], c)
    return caches


class PlainRuns(DraftPolicy):
    """Draft-length policy: three plain rounds (queued two at a time), then k."""

    def __init__(self, k):
        self.max_k, self.round = k, 0

    def next(self):
        self.round += 1
        return self.max_k if self.round % 4 == 0 else 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stop_after", (7, 30))
@pytest.mark.parametrize("policy", ["fixed", "plain-runs"])
def test_caches_equal_fresh_prefill_after_close(family, stop_after, policy, loaded):
    model, tokenizer = loaded(family, predictable=True)
    prompt = tokenizer.encode("The quick brown fox")
    caches = make_caches(model)
    steps = mtp_generate_step(
        prompt,
        model,
        HEADS,
        num_draft_tokens=3,
        policy=None if policy == "fixed" else PlainRuns(3),
        max_tokens=64,
        caches=caches,
    )
    seen = [o for _, o in zip(range(stop_after), steps)]
    steps.close()
    stats = seen[-1].stats
    assert stats.accepted > 0 if policy == "fixed" else stats.rounds_by_k[0] >= 3
    if stop_after == 30 and policy == "fixed":
        assert stats.accepted < stats.drafted  # rejections were rolled back
    tokens = prompt + [o.token for o in seen]
    held = held_positions(caches.trunk)
    assert held == len(tokens) - 1  # the last yielded token stays pending
    fresh = fresh_caches(model, tokens[:held])
    for ours, ref in zip(caches.trunk, fresh.trunk):
        assert_same_cache(ours, ref)
    for j, (ours, ref) in enumerate(zip(caches.mtp, fresh.mtp)):
        assert 0 < ours.offset <= ref.offset
        assert_same_kv(ours, ref, upto=ours.offset)


def test_mtp_cache_keeps_up_over_a_long_run(loaded):
    """The MTP cache follows the committed sequence (no decay from stale entries)."""
    model, tokenizer = loaded("glm4_moe", predictable=True)
    prompt = tokenizer.encode("import numpy as np\n")
    caches = make_caches(model)
    outs = list(
        mtp_generate_step(
            prompt, model, HEADS, num_draft_tokens=2, max_tokens=96, caches=caches
        )
    )
    committed = len(prompt) + len(outs)
    assert caches.mtp[0].offset >= committed - 4
    fresh = fresh_caches(model, prompt + [o.token for o in outs])
    assert_same_kv(caches.mtp[0], fresh.mtp[0], upto=caches.mtp[0].offset)


def test_unsupported_caches_fail_closed():
    check_rollback([KVCache(), KVCache()])
    with pytest.raises(RollbackError, match="ArraysCache"):
        check_rollback([KVCache(), ArraysCache(2)])
    with pytest.raises(RollbackError, match="sliding-window"):
        check_rollback([RotatingKVCache(max_size=8)])


def test_loop_refuses_before_decoding(loaded):
    model, _ = loaded("mimo")
    caches = Caches(trunk=[ArraysCache(2) for _ in model.layers], mtp=mtp_caches(model))
    with pytest.raises(RollbackError):  # when called, before anything runs
        mtp_generate_step([1, 2, 3], model, HEADS, num_draft_tokens=2, caches=caches)
    assert all(c.offset == 0 for c in caches.mtp)


def test_quantized_kv_equals_fresh_prefill_after_rejections(checkpoint):
    """Quantized KV caches (``kv_bits``) trimmed after rejections hold exactly the
    entries of a fresh prefill quantized the same way."""
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_mtp.loading import load

    model, tokenizer = load(str(checkpoint("mimo", True, num_attention_heads=2)))
    prompt = tokenizer.encode("The quick brown fox")
    caches = make_caches(model)
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    steps = mtp_generate_step(
        prompt, model, HEADS, num_draft_tokens=3, max_tokens=64, caches=caches, **kv
    )
    seen = [o for _, o in zip(range(30), steps)]
    steps.close()
    assert 0 < seen[-1].stats.accepted < seen[-1].stats.drafted
    tokens = prompt + [o.token for o in seen]
    fresh = fresh_caches(model, tokens[:-1])
    for ours, ref in zip(caches.trunk, fresh.trunk):
        assert isinstance(ours, QuantizedKVCache)
        ref = ref.to_quantized(group_size=32, bits=4)
        assert ours.offset == ref.offset == len(tokens) - 1
        for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
            got, _ = dequantized(a, ref.offset)
            want, scales = dequantized(b, ref.offset)
            # float noise may move a value across one 4-bit bin, never more
            step = float(mx.abs(scales).max())
            assert float(mx.abs(got - want).max()) <= 1.01 * step


def dequantized(packed, upto: int):
    """(values, scales) of a quantized cache tensor's first ``upto`` positions."""
    w, scales, biases = (t[..., :upto, :] for t in packed)
    return mx.dequantize(w, scales, biases, group_size=32, bits=4), scales

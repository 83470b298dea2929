"""Hy4 (hy_v4) specifics: the trunk is mlx-vlm's, used through the extra
``mlx-mtp[vlm]`` with its indexers made exact; without the extra, or with another
mlx-vlm release, a load fails in one line. (Numerics against the numpy reference,
greedy identity, batching, sampling and conversion run in the suites over every
fixture family.)"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.errors import MTPError
from mlx_mtp.models import hy_v4, vlm
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_errors import assert_one_line_error
from .test_greedy import plain_greedy
from .test_numerics import SEQ, teacher_forced
from .vlm_trunks import generate_without_mlx_vlm


def test_the_indexers_select(loaded, monkeypatch):
    """Past ``index_topk`` positions the logits depend on the selection (of the full
    layers, which the shared ones reuse, and of the MTP layer's own): with every
    indexer keeping all keys, rows past the first topk change, so the numpy
    comparison checks the sparse path."""
    model, _ = loaded("hy_v4")
    sparse = teacher_forced(model, SEQ)
    blocks = [*model.trunk.layers, model.mtp.layers[0].block]
    indexers = [b.self_attn.indexer for b in blocks if b.self_attn.indexer]
    assert len(indexers) == 3  # layers 0 and 2, and the MTP layer's
    for indexer in indexers:
        monkeypatch.setattr(indexer, "index_topk", 1000)
    dense = teacher_forced(model, SEQ)
    np.testing.assert_allclose(sparse[0][:4], dense[0][:4], atol=1e-5)
    assert not np.allclose(sparse[0][4:], dense[0][4:], atol=1e-2)
    assert not np.allclose(sparse[1][0][4:], dense[1][0][4:], atol=1e-2)


def test_the_releases_conventions_are_checked(checkpoint, monkeypatch):
    """Each place mlx-vlm differs from the release's references changes the logits
    the numpy reference checks (a control for each): the indexer's RoPE on the last
    dimensions of a head (read as mlx-vlm reads it, the first), the routed experts'
    clamp (removed), the MTP's zeroed position 0 (kept)."""
    from mlx_mtp import load

    from .numpy_reference import reference_logits

    path = checkpoint("hy_v4")
    ref_main, ref_mtp = reference_logits(path, SEQ)

    def off(main, mtp) -> bool:
        return not (
            np.allclose(main, ref_main, atol=1e-3)
            and np.allclose(mtp[0], ref_mtp[0], atol=1e-3)
        )

    model = load(str(path))[0]
    assert not off(*teacher_forced(model, SEQ))
    args = model.trunk.args  # index heads of 16 = 8 + 8: the permutation is its inverse
    for block in [*model.trunk.layers, model.mtp.layers[0].block]:
        indexer = block.self_attn.indexer
        if indexer is not None:
            for name in ("wq_b", "wk"):
                module = getattr(indexer, name)
                module.weight = hy_v4._rope_first(module.weight, f".{name}.", args)
            norm = indexer.k_norm
            norm.weight = hy_v4._rope_first(norm.weight, ".k_norm.", args)
            norm.bias = hy_v4._rope_first(norm.bias, ".k_norm.", args)
    assert off(*teacher_forced(model, SEQ))

    model = load(str(path))[0]
    for block in [*model.trunk.layers, model.mtp.layers[0].block]:
        if hasattr(block.mlp, "switch_mlp"):
            block.mlp.switch_mlp.activation.limit = float("inf")
    assert off(*teacher_forced(model, SEQ))

    model = load(str(path))[0]
    monkeypatch.setattr(
        model, "family", replace(model.family, MASK_FIRST_POSITION=False)
    )
    assert off(*teacher_forced(model, SEQ))  # row 0, and the rows attending to it


def _top_keys(indexer, x, qr, mask) -> list:
    """Per query with at least ``index_topk`` keys before it, the keys kept."""
    picked = indexer(x, qr, mask)  # (B, 1, L, topk)
    return [sorted(row) for row in np.array(picked)[0, 0, 3:].tolist()]


def test_mlx_vlms_indexer_misselects_and_ours_does_not(loaded):
    """mlx-vlm 0.7.10's ``HyV4Indexer`` compiles its top-k shapeless, fixing
    ``kth`` to the first call's key count: at another count it keeps other keys.
    Ours (the same parameters) keeps the top ``index_topk`` by score at every count.
    """
    from mlx_vlm.models.hy_v4.indexer import HyV4Indexer

    model, _ = loaded("hy_v4")
    ours = model.trunk.layers[0].self_attn.indexer
    theirs = HyV4Indexer(model.trunk.args)
    theirs.update(ours.parameters())
    rng = np.random.default_rng(0)
    wrong = 0
    for n in (14, 9, 11):
        x = mx.array(rng.standard_normal((1, n, 64)).astype(np.float32))
        qr = mx.array(rng.standard_normal((1, n, 32)).astype(np.float32))
        mask = mx.tril(mx.ones((n, n), dtype=mx.bool_))
        scores = _index_scores(ours, x, qr, mask)  # (n, n)
        best = [sorted(np.argsort(-row)[:4].tolist()) for row in scores[3:]]
        assert _top_keys(ours, x, qr, mask) == best
        wrong += _top_keys(theirs, x, qr, mask) != best
    assert wrong  # if mlx-vlm fixes this, `hy_v4._indexer` can go


def _index_scores(indexer, x, qr, mask) -> np.ndarray:
    """The indexer's scores of query i for key j, -inf above the diagonal."""
    b, n, _ = x.shape
    q = indexer.wq_b(qr).reshape(b, n, indexer.n_heads, -1).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(b, 1, n, -1)
    q, k = indexer.rope(q), indexer.rope(k)
    w = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    s = (mx.maximum(q @ k.swapaxes(-1, -2), 0) * w.swapaxes(-1, -2)[..., None]).sum(1)
    return np.where(np.array(mask), np.array(s[0]), -np.inf)


def test_greedy_identity(loaded):
    """Drafts at k = 1 and 3 on the predictable fixture are accepted, and the tokens
    are plain decoding's (the suites over every family check more paths)."""
    model, _ = loaded("hy_v4", predictable=True)
    prompt = SEQ[:6]
    for k in (1, 3):
        steps = list(
            mtp_generate_step(prompt, model, HEADS, num_draft_tokens=k, max_tokens=30)
        )
        assert [o.token for o in steps] == plain_greedy(model, prompt, 30)
        assert steps[-1].stats.accepted > 0


def test_without_mlx_vlm_a_load_fails_in_one_line(checkpoint, monkeypatch):
    cached = (hy_v4._language, hy_v4._drafter, hy_v4._indexer, hy_v4._trunk_class)
    result = generate_without_mlx_vlm(checkpoint("hy_v4"), cached, monkeypatch)
    assert_one_line_error(
        result, "Hy4 (hy_v4) needs mlx-vlm: pip install 'mlx-mtp[vlm]'"
    )


def test_another_mlx_vlm_release_is_refused(monkeypatch):
    hy_v4._language.cache_clear()
    monkeypatch.setattr(vlm, "_version", lambda: "0.8.0")
    try:
        with pytest.raises(MTPError, match="needs mlx-vlm 0.7.10, not 0.8.0"):
            hy_v4._language()
    finally:
        hy_v4._language.cache_clear()


def test_a_changed_member_is_refused(monkeypatch):
    """A declared member with other parameters: one line naming it."""
    with pytest.raises(MTPError, match=r"HyV4Model.__call__ has changed"):
        vlm.need(
            "models.hy_v4.language", "Hy4", [("HyV4Model.__call__", "self, x, cache")]
        )


def test_the_mxfp8_release_loads_packed_and_exactly(checkpoint):
    """The ModelOpt MXFP8 release form (e4m3 bytes with ``weight_scale``, fused
    experts): every projection loads packed as mxfp8, trunk and MTP layer, and their
    teacher-forced logits are the numpy reference's on the same values in float;
    greedy decoding drafts and equals plain decoding."""
    from mlx_mtp import load

    from .numpy_reference import reference_logits

    model = load(str(checkpoint("hy_v4", release="mxfp8")))[0]
    modules = [
        model.trunk.layers[1].self_attn.q_a_proj,
        model.trunk.layers[1].self_attn.embed_q,
        model.trunk.layers[1].mlp.switch_mlp.gate_up_proj,
        model.mtp.layers[0].block.self_attn.o_proj,
        model.mtp.layers[0].block.mlp.switch_mlp.down_proj,
    ]
    assert all(getattr(m, "mode", None) == "mxfp8" for m in modules)
    main, mtp = teacher_forced(model, SEQ)
    ref_main, ref_mtp = reference_logits(
        checkpoint("hy_v4", release="dequantized"), SEQ
    )
    np.testing.assert_allclose(main, ref_main, atol=1e-4)
    np.testing.assert_allclose(mtp[0], ref_mtp[0], atol=1e-4)

    model = load(str(checkpoint("hy_v4", predictable=True, release="mxfp8")))[0]
    steps = list(
        mtp_generate_step(SEQ[:6], model, HEADS, num_draft_tokens=2, max_tokens=30)
    )
    assert [o.token for o in steps] == plain_greedy(model, SEQ[:6], 30)
    assert steps[-1].stats.accepted > 0


def test_several_ranks_are_refused_in_one_line(loaded):
    """mlx-vlm's Hy4 trunk inherits a ``pipeline`` its forward does not follow: a
    split over ranks is refused, not run on a part of the layers."""
    from mlx_mtp import distributed

    model, _ = loaded("hy_v4")
    with pytest.raises(MTPError, match="runs on one machine"):
        distributed.shard(model.trunk, object())

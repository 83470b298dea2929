"""The MTP heads' teacher-forced logits match an independent numpy implementation."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_mtp.cache import mtp_caches
from mlx_mtp.testing.fixtures import FAMILIES

from .numpy_reference import reference_logits

SEQ = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99]


def teacher_forced(model, tokens):
    """(main, [mtp_j]) logits: layer j row i predicts t_{i+j+2} from the chain."""
    seq = mx.array(tokens)[None]
    h = model.hidden(seq)  # (1, n, H)
    main = model.logits(h)[0]
    out, n = [], len(tokens)
    for j in range(model.num_mtp_layers):
        h = model.mtp_forward(
            j, h[:, : n - 1 - j], seq[:, j + 1 :], mtp_caches(model)[j]
        )
        out.append(np.array(model.logits(h)[0]))
    return np.array(main), out


@pytest.mark.parametrize("predictable", (False, True))
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_logits_match_numpy(family, predictable, checkpoint, loaded):
    model, _ = loaded(family, predictable)
    main, mtp = teacher_forced(model, SEQ)
    ref_main, ref_mtp = reference_logits(checkpoint(family, predictable), SEQ)
    assert len(mtp) == len(ref_mtp) == model.num_mtp_layers >= 1
    np.testing.assert_allclose(main, ref_main, atol=1e-4)
    for ours, ref in zip(mtp, ref_mtp):
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=1e-4)
        assert ours.std() > 0.1  # logits are not degenerate


def test_cached_mtp_rows_equal_one_pass(loaded):
    """Rows fed one at a time through the MTP cache equal one teacher-forced pass."""
    model, _ = loaded("deepseek_v3", True)
    seq = mx.array(SEQ)[None]
    h = model.hidden(seq)[:, :-1]
    full = model.mtp_forward(0, h, seq[:, 1:], KVCache())
    cache, rows = KVCache(), []
    for i in range(len(SEQ) - 1):
        rows.append(model.mtp_forward(0, h[:, i : i + 1], seq[:, i + 1 : i + 2], cache))
    np.testing.assert_allclose(
        np.array(mx.concatenate(rows, axis=1)), np.array(full), atol=1e-4
    )

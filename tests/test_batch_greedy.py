"""Batched greedy decoding over every fixture family that batches: each row equals
plain greedy decoding token for token, rows joining at different rounds, at k = 1, 3
and auto (families that cannot batch decode one at a time, as `run_batch` says)."""

import pytest

from mlx_mtp.batch import Batch
from mlx_mtp.batch_cache import batch_support
from mlx_mtp.options import DecodeOptions
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import FAMILIES
from tests.test_batch import PROMPTS, drive, plain


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_every_family_batches_exactly(family, k, loaded):
    model, tokenizer = loaded(family, predictable=True)
    if batch_support(model) is not None:
        pytest.skip(batch_support(model))
    base = HEADS if k != "auto" else DecodeOptions()
    opts = base.replace(num_draft_tokens=k)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [24, 11, 17, 13]
    joins = {0: [], 3: []}
    for i, (p, n) in enumerate(zip(ids, lengths)):
        joins[(0, 0, 3, 3)[i]].append((i, p, opts.replace(max_tokens=n)))
    out, _ = drive(Batch(model, opts), joins)
    for i, (p, n) in enumerate(zip(ids, lengths)):
        assert out[i] == plain(model, p, n), (family, k, i)

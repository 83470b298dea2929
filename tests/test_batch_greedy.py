"""Batched greedy decoding over every fixture family that batches: each row equals
plain greedy decoding token for token, rows joining at different rounds, at k = 1, 3
and auto, and prompts prefilled together (families that cannot batch decode one at
a time, as `run_batch` says)."""

import pytest

from mlx_mtp.batch import Batch
from mlx_mtp.batch_cache import batch_support
from mlx_mtp.options import DecodeOptions
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import FAMILIES
from tests.test_batch import PROMPTS, assert_together_exact, drive, plain


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


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_prefills_together_exactly(family, loaded):
    """Prompts of different lengths prefilled in one padded pass
    (`prefill_together`), on every family that batches: each row then decodes as
    plain greedy decoding."""
    model, tokenizer = loaded(family, predictable=True)
    if batch_support(model) is not None:
        pytest.skip(batch_support(model))
    opts = HEADS.replace(num_draft_tokens=2, prefill_step_size=5)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert_together_exact(model, ids, opts, [14, 9, 12, 10])


@pytest.mark.parametrize("kind", ["e2b", "dense"])
def test_gemma4_pairs_batch_exactly(kind, tmp_path):
    """A Gemma 4 target with its assistant: every row's assistant reads its own
    committed positions of the trunk's caches (the last W + 1 in the sliding layer),
    long past the window; greedy rows equal plain decoding, seeded rows their lone
    runs."""
    from mlx_mtp.loading import load_model
    from mlx_mtp.speculative import mtp_generate_step
    from tests.test_gemma4 import write_pair

    target, assistant = write_pair(tmp_path, kind)
    model = load_model(str(target), draft_model=str(assistant))[0]
    prompts = [[5, 77, 301], list(range(40, 60)), [9], list(range(100, 111))]
    for opts in (
        HEADS.replace(num_draft_tokens=3, max_tokens=30),
        DecodeOptions(num_draft_tokens=2, max_tokens=20, temp=0.9, seed=7),
        DecodeOptions(max_tokens=20),  # auto: the batch costs timed with the assistant
    ):
        joins = {0: [(i, p, opts) for i, p in enumerate(prompts[:2])]}
        joins[2] = [(i + 2, p, opts) for i, p in enumerate(prompts[2:])]
        out, _ = drive(Batch(model, opts), joins)
        for i, p in enumerate(prompts):
            alone = [o.token for o in mtp_generate_step(p, model, opts)]
            assert out[i] == alone, (kind, opts.temp, i)
            if not opts.temp:
                assert out[i] == plain(model, p, opts.max_tokens)

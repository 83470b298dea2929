"""DeepSeek-V4 rows decoded together (`mlx_mtp.models.deepseek_v4_cache.V4Rows`):
each row keeps its own `V4Cache`, at its own compression-block phase, and rolls back
by its own count; every row equals its lone decoding and plain decoding."""

import mlx.core as mx
import pytest

from mlx_mtp.batch import Batch, prefill_together
from mlx_mtp.batch_cache import batch_support
from mlx_mtp.cache import make_caches
from mlx_mtp.serving.budget import cache_cost
from mlx_mtp.speculative import mtp_generate_step, prefill
from mlx_mtp.testing import HEADS
from tests.test_batch import plain

# 13 and 30 tokens: with the fixture's ratios 4 and 16, the rows start decoding at
# block phases 0 and 1 (r = 4) and 12 and 13 (r = 16) (the last token is pending)
LENGTHS = (13, 30)


@pytest.fixture(scope="module")
def v4(loaded):
    return loaded("deepseek_v4", predictable=True)[0]


def decode_together(model, ids, opts, together):
    """Every row's tokens and target log-probabilities ``(n, V)``, and each round's
    accepted drafts per row."""
    batch = Batch(model, opts)
    new = [batch.admit(i, p, opts) for i, p in enumerate(ids)]
    if together:
        prefill_together(new)
    for admission in new:
        batch.join(admission)
    tokens, logprobs, accepted = {}, {}, []
    while len(batch):
        outputs = batch.step()
        accepted.append({o.uid: sum(o.from_draft) for o in outputs})
        for o in outputs:
            tokens.setdefault(o.uid, []).extend(o.tokens)
            logprobs.setdefault(o.uid, []).append(o.logprobs)
    return tokens, {u: mx.concatenate(lp) for u, lp in logprobs.items()}, accepted


@pytest.mark.parametrize("together", [False, True])
def test_rows_at_different_block_phases_decode_as_alone(v4, together):
    """Two V4 rows decoded together, prefilled alone or together (left padding,
    which must never enter a row's caches), give each row's lone tokens and
    log-probabilities (the predictable fixture damps attention: its tokens alone
    would miss a wrong window or compressed entry); some round rejects drafts in
    one row while the other accepts all of its own."""
    assert batch_support(v4) is None
    opts = HEADS.replace(num_draft_tokens=3, max_tokens=14)
    V = v4.args.vocab_size
    ids = [[(5 * n + 3 * i + 1) % V for i in range(n)] for n in LENGTHS]
    tokens, logprobs, accepted = decode_together(v4, ids, opts, together)
    for i, p in enumerate(ids):
        steps = list(mtp_generate_step(p, v4, opts))
        assert tokens[i] == [s.token for s in steps] == plain(v4, p, 14), i
        lone = mx.stack([s.logprobs for s in steps])
        assert mx.allclose(logprobs[i], lone, atol=1e-4).item(), i
    split = [r for r in accepted if len(r) == 2 and max(r.values()) == 3]
    assert any(min(r.values()) < 3 for r in split), accepted


def test_the_servers_cache_cost_bounds_v4_rows(v4):
    """The server's memory budget reads V4's caches (it raised AttributeError on
    `V4Cache`): the window, an entry per closed block, the projections kept."""
    cost = cache_cost(v4, 1)
    for n in (40, 400):
        caches = make_caches(v4)
        prefill(v4, caches, [3] * n, 1, 256)
        held = sum(c.nbytes for c in caches.trunk)
        assert held <= cost.bytes([n]) < 2 * held + 64 * 1024, n

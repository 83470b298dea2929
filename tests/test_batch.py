"""Several streams decoded together (`mlx_mtp.batch`): every stream's tokens equal
its own single-stream decoding (and mlx-lm's), whatever else is in the batch and
whenever it joined or the others left; each row's caches roll back on their own;
sampled rows are exact, and a seeded row gives its lone text."""

import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlx_mtp.batch as batch_module
import mlx_mtp.kv_cache as kv_cache
from mlx_mtp import batch_generate, generate
from mlx_mtp.batch import Batch, prefill_groups, prefill_together, run_batch
from mlx_mtp.batch_cache import RaggedKVCache, batch_support
from mlx_mtp.batch_costs import BatchCosts, BatchLength, parse_batch_costs
from mlx_mtp.errors import MTPError
from mlx_mtp.options import DecodeOptions
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

PROMPTS = (
    "def forward(self, x):",
    "The quick brown fox jumps over",
    "import numpy as np\n",
    "a",
)


def plain(model, ids, n):
    steps = generate_step(mx.array(ids), model.trunk, max_tokens=n)
    return [int(t) for t, _ in steps]


def alone(model, ids, options):
    return [o.token for o in mtp_generate_step(ids, model, options)]


def drive(batch, joins, removals=(), together=False):
    """Step ``batch`` until it is empty: ``joins`` maps a round number to the
    (uid, ids, options) that join before it (``together``: prefilled together,
    `prefill_together`), ``removals`` a round number to uids removed before it.
    Returns the tokens per uid and the per-round accepted counts of every row."""
    out, accepted, rnd = {}, [], 0
    joins, removals = dict(joins), dict(removals)
    while len(batch) or any(r >= rnd for r in joins):
        new = [batch.admit(uid, ids, opts) for uid, ids, opts in joins.pop(rnd, ())]
        if together and new:
            prefill_together(new)
        for admission in new:
            batch.join(admission)
            out.setdefault(admission.uid, [])
        batch.remove(removals.pop(rnd, ()))
        outputs = batch.step()
        accepted.append({o.uid: sum(o.from_draft) for o in outputs})
        for o in outputs:
            out.setdefault(o.uid, []).extend(o.tokens)
        rnd += 1
    return out, accepted


@pytest.mark.parametrize("family", ["qwen3_5", "mimo", "step3p5"])
@pytest.mark.parametrize("k", [1, 3])
def test_staggered_rows_decode_as_alone(family, k, loaded):
    """Rows join at different rounds, with different lengths, and accept different
    numbers of drafts in the same round; each equals its lone decoding and plain
    greedy decoding (hybrid trunk, two MTP layers, sliding windows)."""
    model, tokenizer = loaded(family, predictable=True)
    opts = HEADS.replace(num_draft_tokens=k)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [20, 9, 16, 12]
    joins = {0: [], 2: [], 5: []}
    for i, (p, n) in enumerate(zip(ids, lengths)):
        joins[(0, 0, 2, 5)[i]].append((i, p, opts.replace(max_tokens=n)))
    out, accepted = drive(Batch(model, opts), joins)
    for i, (p, n) in enumerate(zip(ids, lengths)):
        assert (
            out[i] == plain(model, p, n) == alone(model, p, opts.replace(max_tokens=n))
        )
    ragged = [r for r in accepted if len(set(r.values())) > 1]
    assert ragged, "no round had rows accepting different numbers of drafts"


def test_a_removed_row_leaves_the_others_exact(loaded):
    model, tokenizer = loaded("qwen3_5", predictable=True)
    opts = HEADS.replace(num_draft_tokens=2, max_tokens=18)
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    joins = {0: [(i, p, opts) for i, p in enumerate(ids)]}
    out, _ = drive(Batch(model, opts), joins, removals={3: [1]})
    for i in (0, 2):
        assert out[i] == plain(model, ids[i], 18)
    assert out[1] == plain(model, ids[1], 18)[: len(out[1])]
    assert len(out[1]) < 18


def test_holes_are_compacted_exactly(loaded, monkeypatch):
    """With compaction forced after every round, rejected entries are packed away
    and the rows stay exact."""
    monkeypatch.setattr(kv_cache, "COMPACT_SLACK", 0)
    model, tokenizer = loaded("qwen3_5", predictable=True)
    opts = HEADS.replace(num_draft_tokens=3, max_tokens=24)
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    batch = Batch(model, opts)
    out, _ = drive(batch, {0: [(i, p, opts) for i, p in enumerate(ids)]})
    for i, p in enumerate(ids):
        assert out[i] == plain(model, p, 24)


def test_a_leaving_row_keeps_its_session(loaded):
    """A row's session, taken as it leaves, goes on single-stream exactly."""
    model, tokenizer = loaded("mimo_v2_flash", predictable=True)
    opts = HEADS.replace(num_draft_tokens=2, max_tokens=10)
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    batch = Batch(model, opts, keep_sessions=True)
    rows = [batch.join(batch.admit(i, p, opts)) for i, p in enumerate(ids)]
    out, _ = drive(batch, {})
    more = tokenizer.encode(" and then")
    for row, p in zip(rows, ids):
        assert row.session is not None
        steps = mtp_generate_step(more, model, opts, session=row.session)
        assert [o.token for o in steps] == plain(model, p + out[row.uid] + more, 10)


def test_seeded_rows_give_their_lone_text(loaded):
    """Sampled rows with different settings and k, beside a greedy one: each seeded
    row's tokens are its lone seeded run's (per-row keys, drawn as alone)."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    base = DecodeOptions(max_tokens=14)
    settings = [
        dict(num_draft_tokens=2, temp=0.8, seed=3),
        dict(num_draft_tokens=1, temp=1.0, top_k=20, seed=4),
        dict(num_draft_tokens=3),
        dict(num_draft_tokens=3, temp=0.7, top_p=0.9, seed=5),
    ]
    opts = [base.replace(**s) for s in settings]
    ids = [tokenizer.encode(p) for p in PROMPTS]
    joins = {0: [(i, p, o) for i, (p, o) in enumerate(zip(ids, opts))]}
    out, _ = drive(Batch(model, base.replace(num_draft_tokens=3)), joins)
    for i, (p, o) in enumerate(zip(ids, opts)):
        assert out[i] == alone(model, p, o), settings[i]


def test_batch_generate_equals_generate(loaded):
    model, tokenizer = loaded("nemotron_h", predictable=True)
    lengths = [10, 20, 5, 15]
    r = batch_generate(
        model,
        tokenizer,
        list(PROMPTS),
        max_tokens=lengths,
        max_batch=3,
        num_draft_tokens=2,
    )
    for p, text, n in zip(PROMPTS, r.texts, lengths):
        assert text == generate(model, tokenizer, p, max_tokens=n, num_draft_tokens=2)
    assert all(s.drafted > 0 for s in r.mtp)
    assert any(max(sizes) > 1 for sizes in r.batch_sizes)
    assert r.generation_tokens >= sum(len(t) for t in r.token_ids)


def test_a_model_that_cannot_batch_decodes_one_at_a_time(loaded, monkeypatch):
    """Every fixture family batches; a model whose caches could not (say) decodes
    its prompts one at a time through the single-stream loop, with the same
    outputs."""
    model, tokenizer = loaded("deepseek_v32", predictable=True)
    assert batch_support(model) is None  # MLA latent and indexer keys, ragged
    reason = "mlx-mtp has no batched cache for this model's FancyCache"
    monkeypatch.setattr(batch_module, "batch_support", lambda m: reason)
    with pytest.raises(MTPError, match="FancyCache"):
        Batch(model)
    opts = HEADS.replace(num_draft_tokens=2, max_tokens=8)
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    got = {}
    for o in run_batch(model, ids, [opts, opts]):
        got.setdefault(o.uid, []).extend(o.tokens)
    assert [got[0], got[1]] == [plain(model, p, 8) for p in ids]


def test_bad_batch_arguments_are_one_line_errors(loaded):
    model, tokenizer = loaded("qwen3_5", predictable=True)
    for prompts, kw, match in [
        ([], {}, "non-empty list"),
        ("hello", {}, "non-empty list"),
        (["a", ""], {}, "prompt is empty"),
        (["a", "b"], {"max_tokens": [1]}, "2 prompts but 1 max_tokens"),
        (["a"], {"max_batch": 0}, "max_batch"),
        (["a"], {"temp": -1}, "temp"),
    ]:
        with pytest.raises(MTPError, match=match):
            batch_generate(model, tokenizer, prompts, **kw)
    batch = Batch(model)
    with pytest.raises(MTPError, match="kv_bits"):
        batch.admit(0, [1, 2], DecodeOptions(kv_bits=4))


def test_ragged_cache_rolls_rows_back_on_their_own():
    """Rows keep their own positions: a rewind of one row leaves a hole the mask
    hides, `compact` packs rows without changing what any query sees."""
    c = RaggedKVCache(2)
    keys = mx.arange(2 * 1 * 4 * 1, dtype=mx.float32).reshape(2, 1, 4, 1)
    c.update_and_fetch(keys, keys)
    c.rewind_rows([1, 3])  # row 0 keeps 3 positions, row 1 one
    assert c.offset.tolist() == [3, 1] and c.held == [3, 1]
    mask = c.make_mask(1)  # (B, 1, 1, T + 1): the next query of each row
    assert mask[0, 0, 0].tolist() == [True, True, True, True]
    assert mask[1, 0, 0].tolist() == [True, False, False, True]
    c.compact()
    assert c.pos.tolist() == [[0, 1, 2], [-1, -1, 0]]
    assert c.make_mask(1)[1, 0, 0].tolist() == [False, False, True, True]
    c.keep_below([2, 1])
    assert c.pos[:, : c._idx].tolist() == [[0, 1, -1], [-1, -1, 0]]


def test_stored_batch_costs_are_checked():
    good = {"verify": {"1": [1, 1.1, 1.2, 1.3, 1.4]}, "draft": {"1": 0.1}}
    assert parse_batch_costs(good) is not None
    for bad in [
        {"verify": {"1": [2, 1, 1, 1, 1]}, "draft": {"1": 0.1}},
        {"verify": {"2": [1, 1, 1, 1, 1]}, "draft": {"2": 0.1}},
        {"verify": {"1": [1, 1, 1]}, "draft": {"1": 0.1}},
        {"verify": {"1": [1, 1, 1, 1, float("nan")]}, "draft": {"1": 0.1}},
        {"verify": {"1": [1, 1, 1, 1, 1]}, "draft": {}},
        [],
    ]:
        assert parse_batch_costs(bad) is None


def test_batch_length_turns_drafting_off_where_it_does_not_pay(loaded):
    """At a batch size where a wider pass costs nearly its share, auto rows are
    capped at 0 (batched plain) once each has drafted (a row's first round drafts,
    to measure its acceptance) and probe at doubling intervals; where verification
    is nearly free they draft. Past the crossover (no acceptance would pay) they
    never draft, not even a first round, and never probe."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    cheap = [1.0, 1.02, 1.04, 1.06, 1.08]
    costs = BatchCosts(
        {
            1: cheap,
            2: [1.1 * c for c in cheap],
            8: [2.0, 3.0, 4.0, 5.0, 6.0],
            16: [4.0, 8.0, 12.0, 16.0, 20.0],
        },
        {1: 0.05, 2: 0.06, 8: 0.5, 16: 1.0},
    )
    assert [costs.pays(B, 4) for B in (1, 2, 8, 16)] == [True, True, True, False]
    opts = DecodeOptions(num_draft_tokens="auto", max_tokens=4)

    def rows_of(B):
        batch = Batch(model, opts, length=length)
        ids = tokenizer.encode("x y z")
        return [batch.join(batch.admit(i, ids, opts)) for i in range(B)]

    for B, expect_drafts in [(2, True), (8, False)]:
        length = BatchLength(costs, 1)
        rows = rows_of(B)
        assert length.cap(rows, [3] * B, [True] * B) in (None, 1), B  # unseen rows
        for r in rows:
            r.stats.record(1, 1)
        cap = length.cap(rows, [3] * B, [True] * B)
        assert (cap is None or cap > 0) == expect_drafts, (B, cap)
    probes = [i for i in range(200) if length.cap(rows, [3] * B, [True] * B)]
    assert probes == [14, 46, 110], probes  # every 16, 32, 64 rounds: none paid
    length, rows = BatchLength(costs, 1), rows_of(16)
    caps = [length.cap(rows, [3] * 16, [True] * 16) for _ in range(600)]
    assert caps == [0] * 600  # unseen rows included
    fixed = [3] + [2] * 15, [False] + [True] * 15
    assert length.cap(rows, *fixed) is None  # none asks beyond the fixed row
    assert length.cap(rows, [1] + [2] * 15, fixed[1]) == 1


def test_a_block_drafters_batched_round_pays_its_pass_once():
    """A block drafter's batched round costs its verify pass and one block pass,
    whatever K (a drafter from the heads pays a step per draft): so a long block
    pays where K draft steps would not."""
    verify = {1: [1.0, 1.02, 1.04, 1.06, 1.08], 2: [1.1, 1.14, 1.18, 1.22, 1.26]}
    steps = BatchCosts(verify, {1: 0.3, 2: 0.3})
    block = BatchCosts(verify, {1: 0.3, 2: 0.3}, block=True)
    assert block.round(2, 0) == steps.round(2, 0) == 1.1
    assert block.round(2, 4) == pytest.approx(1.26 + 0.3)
    assert steps.round(2, 4) == pytest.approx(1.26 + 4 * 0.3)
    best = {}
    for name, costs in [("steps", steps), ("block", block)]:
        tokens = [sum(0.7**j for j in range(K + 1)) for K in range(5)]
        best[name] = max(range(5), key=lambda K: tokens[K] / costs.round(2, K))
    assert best == {"steps": 2, "block": 4}, best


def test_batch_length_weighs_the_rounds_it_times(loaded):
    """Costs that say drafting pays at batch 2, on a machine whose drafting rounds
    are in fact dear: once the batch has timed drafting and plain rounds, the auto
    rows stop drafting (but for probes), whatever K it timed; where the rounds cost
    what the table says, they go on drafting, with two plain rounds now and then to
    time plain decoding. Without the timings (the control) they draft throughout."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    cheap = [1.0, 1.02, 1.04, 1.06, 1.08]
    costs = BatchCosts({1: cheap, 2: [1.1 * c for c in cheap]}, {1: 0.05, 2: 0.06})
    opts = DecodeOptions(num_draft_tokens="auto", max_tokens=4)
    batch = Batch(model, opts)
    ids = tokenizer.encode("x y z")
    rows = [batch.join(batch.admit(i, ids, opts)) for i in range(2)]
    for r in rows:
        r.stats.record(3, 2)

    def caps(seconds, timed=True, rounds=400):
        length = BatchLength(costs, 1)
        out = []
        for _ in range(rounds):
            cap = length.cap(rows, [3, 3], [True, True])
            K = 3 if cap is None else cap
            if timed:
                length.observe(2, K, seconds(K))
            out.append(K)
        return out

    table = [1.1 * cheap[K] + 0.06 * K for K in range(4)]  # what the costs say
    dear = caps(lambda K: table[0] * (1 + 2 * K))
    assert dear[200:].count(0) >= 195, dear[200:]  # probes only
    right = caps(lambda K: table[K])
    assert right[200:].count(0) in range(8, 16), right[200:]  # timing plain rounds
    runs = "".join("0" if K == 0 else "k" for K in right[200:]).strip("0").split("k")
    assert {len(r) for r in runs if r} == {2}, right[200:]  # plain rounds in pairs
    control = caps(lambda K: 0.0, timed=False)
    assert control[200:].count(0) in range(8, 16), control[200:]


@pytest.mark.parametrize("k", [0, 2])
def test_rows_leaving_while_rounds_are_queued_keep_exact_sessions(k, loaded):
    """Plain rounds are launched two ahead: rows that finish, or are removed, while
    a round is queued leave with sessions holding exactly what they committed (the
    recurrent states from before the queued round), and the others go on exact."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    opts = HEADS.replace(num_draft_tokens=k)
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    lengths = [6, 11, 15]
    batch = Batch(model, opts, keep_sessions=True)
    rows = [
        batch.join(batch.admit(i, p, opts.replace(max_tokens=n)))
        for i, (p, n) in enumerate(zip(ids, lengths))
    ]
    out, _ = drive(batch, {}, removals={4: [2]})
    more = tokenizer.encode(" next")
    for row, p, n in zip(rows, ids, lengths):
        got = out[row.uid]
        assert got == plain(model, p, n)[: len(got)]
        assert len(got) == n or row.uid == 2
        steps = mtp_generate_step(
            more, model, opts.replace(max_tokens=6), session=row.session
        )
        assert [o.token for o in steps] == plain(model, p + got + more, 6)


def test_a_short_draft_in_a_deeper_batch_still_drafts(loaded):
    """A row asking k = 1 in a batch using two MTP layers drafts (every layer in use
    runs, so every frontier moves), exactly, and as it drafts alone."""
    model, tokenizer = loaded("mimo", predictable=True)
    batch = Batch(model, HEADS.replace(num_draft_tokens=3))
    assert batch.depth == 2
    ids = [tokenizer.encode(p) for p in PROMPTS[:2]]
    opts = [HEADS.replace(num_draft_tokens=k, max_tokens=16) for k in (1, 3)]
    rows = [batch.join(batch.admit(i, p, o)) for i, (p, o) in enumerate(zip(ids, opts))]
    out, _ = drive(batch, {})
    for row, p, o in zip(rows, ids, opts):
        assert out[row.uid] == plain(model, p, 16) == alone(model, p, o)
        assert row.stats.drafted > 0


def _cache_arrays(caches):
    """Every array a session's caches hold, in order (K/V up to the offset)."""
    out = []
    for c in caches.trunk + caches.mtp:
        for part in getattr(c, "caches", [c]):
            if hasattr(part, "keys"):
                if part.keys is not None:
                    n = part.offset
                    out += [part.keys[..., :n, :], part.values[..., :n, :]]
            else:
                out += [x for x in part.cache if x is not None]
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "step3p5"])
def test_prompts_prefilled_together_decode_as_alone(family, loaded):
    """Prompts of different lengths (one of a single token) prefilled in one padded
    pass per chunk: each session holds what its own prefill gives (padding hidden
    from attention, masked in the recurrent layers; chunks narrower than the
    padding), and each row then decodes as plain greedy decoding."""
    model, tokenizer = loaded(family, predictable=True)
    opts = HEADS.replace(num_draft_tokens=2, prefill_step_size=4)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    batch = Batch(model, opts)
    together = [batch.admit(i, p, opts) for i, p in enumerate(ids)]
    alone_ = [batch.admit(i, p, opts) for i, p in enumerate(ids)]
    prefill_together(together)
    for a, b in zip(together, alone_):
        while not b.ready:
            b.advance()
        assert a.ready and not a.fresh
        x, y = a.session.state, b.session.state
        assert x.tokens == y.tokens and x.frontier == y.frontier
        assert mx.allclose(x.hidden, y.hidden, atol=1e-5)
        got, want = _cache_arrays(a.session.caches), _cache_arrays(b.session.caches)
        assert len(got) == len(want) and (got or len(x.tokens) == 1)
        assert all(g.shape == w.shape for g, w in zip(got, want))
        assert all(mx.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    assert_together_exact(model, ids, opts, [12, 7, 10, 9])


def assert_together_exact(model, ids, opts, lengths):
    """Prompts ``ids`` joining at once, prefilled together, prompt i decoding
    ``lengths[i]`` tokens: each equals plain greedy decoding."""
    joins = {
        0: [
            (i, p, opts.replace(max_tokens=n))
            for i, (p, n) in enumerate(zip(ids, lengths))
        ]
    }
    out, _ = drive(Batch(model, opts), joins, together=True)
    for i, (p, n) in enumerate(zip(ids, lengths)):
        assert out[i] == plain(model, p, n), i


def test_prefill_groups_bound_the_padding():
    """Fresh admissions group longest first while padding stays within PAD_WASTE
    of their tokens; an admission already begun is prefilled alone."""
    from types import SimpleNamespace

    def adm(n, fresh=True):
        return SimpleNamespace(todo=[0] * n, fresh=fresh)

    a = [adm(10), adm(50), adm(1), adm(48), adm(9), adm(30, fresh=False)]
    groups = [[len(x.todo) for x in g] for g in prefill_groups(a)]
    assert groups == [[50, 48], [10, 9], [1], [30]]


def test_a_dense_ragged_cache_keeps_its_bookkeeping_on_the_host():
    """One stream's cache (no hole, no padding) stores no positions and gives an int
    offset, as mlx-lm's KVCache does, through passes and uniform rollbacks; a
    ragged rollback stores them, and the mask is then the same as computed."""
    kv = mx.ones((1, 2, 3, 4))
    c = RaggedKVCache.from_kv(kv, kv, range(3))
    assert c.offset == 3 and c._pos is None
    c.update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    c.rewind_rows([1])
    c.keep_below([3])
    assert c.offset == 3 and c._pos is None and c.held == [3]
    assert c.make_mask(1) is None and c.make_mask(2) == "causal"
    c.extend(RaggedKVCache.from_kv(kv[..., :1, :], kv[..., :1, :], range(1)))
    assert c._pos is not None and c.offset.tolist() == [3, 1]
    assert c.pos[:, : c._idx].tolist() == [[0, 1, 2], [-1, -1, 0]]
    c.update_and_fetch(mx.ones((2, 2, 2, 4)), mx.ones((2, 2, 2, 4)))
    c.rewind_rows([1, 2])
    assert c.pos[:, : c._idx].tolist() == [[0, 1, 2, 3], [-1, -1, 0, -1]]


def test_batch_costs_time_whole_rounds_as_the_loop_runs_them(loaded, monkeypatch):
    """The plain round and the round drafting one token are timed whole, through
    `Batch.step` (drafts, verify, accept, commit), on every batch size measured;
    the costs are then well formed."""
    from mlx_mtp.batch import filled_batch
    from mlx_mtp.batch_costs import measure_batch_costs

    model, _ = loaded("qwen3_5", predictable=True)
    ks, real = [], Batch.step

    def step(self):
        ks.append((len(self.rows), sorted({r.run.policy.next() for r in self.rows})))
        return real(self)

    monkeypatch.setattr(Batch, "step", step)
    costs = measure_batch_costs(model, [1, 2], filled_batch, reps=1, context=8)
    for B in (1, 2):
        assert ks.count((B, [0])) >= 3 and ks.count((B, [1])) >= 3, ks
    entry = {"verify": costs.verify, "draft": costs.draft}
    assert parse_batch_costs(json.loads(json.dumps(entry))) is not None
    assert costs.verify[1][0] == 1 and all(d > 0 for d in costs.draft.values())

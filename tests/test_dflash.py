"""Qwen3 targets with DFlash2 block drafters (``--draft-model``, the released
``DFlash2DraftModel`` layout), and with DFlash ones: a block equals the float64
reference of the release's numerics (dynamic convolutions, candidate selector), the
pair decodes exactly as plain decoding of the target (greedy token for token at every
block length and ``auto``, batched rows, draft vocabularies, sampling in
distribution, with a negative control), the context cache rolls back with the round,
conversion and graft keep it exact, and drafters that do not fit are refused in one
line."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlx_mtp.round as rounds
from mlx_mtp.cache import block_context, mtp_caches, ops
from mlx_mtp.cli import main
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.models import dflash
from mlx_mtp.models.dflash import DFlash, DFlash2
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.dspark import (
    BLOCK_SIZE,
    TARGET_LAYER_IDS,
    gemma4_dflash_config,
    write_dflash,
    write_dflash2,
    write_gemma4_dflash,
    write_qwen3_target,
)
from mlx_mtp.testing.gemma4 import write_gemma4

from .test_dspark import (
    PROMPTS,
    SAMPLE_PROMPT,
    V,
    assert_context_rolls_back,
    assert_rows_decode_as_alone,
    assert_served_as_plain,
    greedy_run,
    plain,
    ranked_by_hand,
)

GAMMA = BLOCK_SIZE  # the fixtures' block_size is gamma + 1 (the anchor row)
VARIANTS = {
    "released": {},
    "wider": dict(
        kernel_size=3,
        output_multiplier=0.7,
        final_logit_softcapping=2.0,
        input_embedding_scale=1.3,
    ),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_qwen3_target(tmp_path_factory.mktemp("dflash2") / "target")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A predictable pair: acceptance about 0.55 at the block's first slot."""
    root = tmp_path_factory.mktemp("dflash2-predictable")
    target = write_qwen3_target(root / "target", predictable=True)
    path = write_dflash2(root / "drafter", target, predictable=True)
    return load_model(str(target), draft_model=str(path))[0]


def test_the_released_layout_loads_with_the_targets_embedding_and_head(target):
    path = write_dflash2(target.parent / "layout", target)
    d = load_model(str(target), draft_model=str(path))[0].drafter
    assert isinstance(d, DFlash2) and d.block_size == GAMMA
    assert d.spec.target_layer_ids == tuple(TARGET_LAYER_IDS)
    assert not d.spec.sample_from_anchor and not d.cuts
    assert "embed_tokens" not in d and "lm_head" not in d and "markov_head" not in d
    assert d.candidate_selector.top_k == 16  # a quarter of the fixture's 64 tokens
    assert d.layers[0].attention_conv.base_kernel.shape == (2, 2, 32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_block_matches_the_numpy_reference(target, variant):
    """One block after a prompt's context rows: every slot's selector scores
    (candidates, unary logits and edges, each slot after a given previous token)
    equal the float64 reference (`tests/numpy_dflash.py`), -inf off the same
    candidates."""
    from .numpy_dflash import dflash_block
    from .numpy_dspark import target_taps

    path = write_dflash2(target.parent / variant, target, **VARIANTS[variant])
    model = load_model(str(target), draft_model=str(path))[0]
    prompt, anchor, prevs = list(range(10, 30)), 7, [7, 3, 9, 11]
    taps = target_taps(str(target), prompt, TARGET_LAYER_IDS)
    caches = mtp_caches(model)
    model.draft_context(model.hidden(mx.array(prompt)[None]), caches)
    context = block_context(model.drafter, caches, [len(prompt)])
    z, g = model.draft_block(mx.array([anchor]), context, len(prompt))
    ref = dflash_block(str(path), str(target), taps, anchor, prevs)
    for k, prev in enumerate(prevs):
        ours, _ = model.slot_logits(z[:, k], mx.array([prev]), g[:, k], None)
        ours = np.array(ours[0])
        assert (np.isinf(ours) == np.isinf(ref[k])).all(), k
        live = np.isfinite(ref[k])
        np.testing.assert_allclose(ours[live], ref[k][live], rtol=1e-4, atol=1e-4)


def test_greedy_identity_at_every_block_length_and_auto(model):
    """k = 1..gamma, a random k per round and ``auto``; at k = gamma rounds reject
    at the block's first slot and accept it whole."""
    from .test_window import greedy_identity

    ks = tuple(range(1, GAMMA + 1))
    hist = greedy_identity(model, PROMPTS, n=60, ks=ks, policies=("auto",))
    assert hist[GAMMA][0] > 0 and hist[GAMMA][-1] > 0, hist


def test_random_drafters_decode_exactly(target):
    from .test_window import greedy_identity

    for variant, keys in VARIANTS.items():
        path = write_dflash2(target.parent / f"random-{variant}", target, **keys)
        model = load_model(str(target), draft_model=str(path))[0]
        greedy_identity(model, PROMPTS[1:], n=40, ks=(GAMMA,))


def test_context_cache_equals_a_fresh_one_after_every_rejection(model):
    assert_context_rolls_back(model)


@pytest.mark.slow
def test_batched_rows_decode_as_alone(model):
    assert_rows_decode_as_alone(model)


# --- sampling and draft vocabularies ------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 16-token predictable pair whose selector keeps half of the vocabulary."""
    root = tmp_path_factory.mktemp("dflash2-small")
    t = write_qwen3_target(root / "t", vocab_size=V)
    d = write_dflash2(root / "d", t, predictable=True, agree=0.5)
    config = json.loads((d / "config.json").read_text())
    config["dflash_config"]["selector_top_k"] = V // 2
    (d / "config.json").write_text(json.dumps(config))
    return load_model(str(t), draft_model=str(d))[0]


def sampling_fails(model, n=600, **options) -> bool:
    from .test_sampling import sampling_after_prompt_fails

    return sampling_after_prompt_fails(model, SAMPLE_PROMPT, V, GAMMA, n, **options)


@pytest.mark.slow
def test_sampling_is_exact(small):
    assert not sampling_fails(small)


@pytest.mark.slow  # about 7 s: with -m slow (CI runs both)
def test_sampling_test_catches_q_without_the_selectors_edges(small, monkeypatch):
    """Negative control: drafts drawn from the selector's scores but reported with
    q from the slot's own logits over the vocabulary (no edges, no candidate
    set) must fail the same test."""
    slot, pick, last = small.drafter.slot, rounds._pick, {}

    def recording(z, prev, g, state, w2=None, rows=None):
        last["z"] = z
        return slot(z, prev, g, state, w2, rows)

    def uncorrected(runs, logits, keys):
        tokens, q = pick(runs, logits, keys)
        z = last["z"]
        lp = z - mx.logsumexp(z, axis=-1, keepdims=True)  # (B, V)
        return tokens, [None if x is None else lp[b : b + 1] for b, x in enumerate(q)]

    monkeypatch.setattr(small.drafter, "slot", recording)
    monkeypatch.setattr(rounds, "_pick", uncorrected)
    assert sampling_fails(small)


@pytest.fixture
def ranked(small):
    yield from ranked_by_hand(small)


def test_a_block_drafts_from_a_draft_vocabulary(ranked):
    """From half of the vocabulary, each slot's candidates are its top-k among
    those rows (token ids mapped through them, so the codebooks read the right
    rows); greedy decoding from it at k = 1, gamma and auto is plain decoding."""
    model, n = ranked, V // 2
    rows = np.array(model.vocab_ranking.rows(n))
    caches = mtp_caches(model)
    prompt = [3, 7, 5, 3, 7, 1]
    model.draft_context(model.hidden(mx.array(prompt[:-1])[None]), caches)
    context = block_context(model.drafter, caches, [len(prompt) - 1])
    anchor, at = mx.array(prompt[-1:]), len(prompt) - 1
    full, g = model.draft_block(anchor, context, at)
    some, _ = model.draft_block(anchor, context, at, n)
    part, _ = model.slot_logits(some[:, 0], anchor, g[:, 0], None, n)
    part = np.array(part)[0]
    assert np.isinf(np.delete(part, rows)).all()
    sel = model.drafter.candidate_selector
    kept = rows[np.argsort(-np.array(full[0, 0])[rows], kind="stable")[: sel.top_k]]
    assert set(np.flatnonzero(np.isfinite(part))) == set(kept.tolist())
    e = sel.predecessor_codebook(anchor) * sel.hidden_projection(g[:, 0])
    edges = np.array((e * sel.successor_codebook(mx.array(kept))).sum(-1))
    np.testing.assert_allclose(
        part[kept], np.array(full[0, 0])[kept] + edges, rtol=1e-5, atol=1e-5
    )
    for k in (1, GAMMA, "auto"):
        steps = list(
            mtp_generate_step(
                prompt, model, num_draft_tokens=k, max_tokens=24, draft_vocab=n
            )
        )
        assert [o.token for o in steps] == plain(model, prompt, 24), k


# --- files --------------------------------------------------------------------------


def refused(target, path, match):
    with pytest.raises(MTPError, match=match) as e:
        load_model(str(target), draft_model=str(path))
    assert "\n" not in str(e.value)


def edited(target, name, top=None, **dflash):
    path = write_dflash2(target.parent / name, target)
    config = json.loads((path / "config.json").read_text())
    config.update(top or {})
    config["dflash_config"].update(dflash)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_drafters_mlx_mtp_cannot_run_are_refused_in_one_line(target):
    refused(target, edited(target, "causal", {"is_causal": True}), "causal blocks")
    refused(
        target, edited(target, "sinks", attention_sink_bias=True), "attention sinks"
    )
    mixed = {"layer_types": ["sliding_attention", "full_attention"]}
    refused(target, edited(target, "open", mixed), "sliding_window must be")
    three = {"layer_types": ["full_attention"] * 3}
    refused(target, edited(target, "three", three), "3 layer types for 2 layers")
    refused(target, edited(target, "group", conv_group_size=5), "does not divide")
    refused(target, edited(target, "top", selector_top_k=V * 8), "exceeds")
    refused(target, edited(target, "block", block_size=1), "block_size")
    refused(target, edited(target, "taps", target_layer_ids=[0, 9]), "taps layer 9")


def test_a_sliding_drafter_attends_to_its_window_only(target):
    """Sliding layers (the released configs' kind) read the last sliding_window - 1
    context rows (the round reads the drafter's ``context_windows``), which changes
    the block; decoding stays exact."""
    from .test_window import greedy_identity

    sliding = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 6}
    path = edited(target, "sliding", sliding)
    model = load_model(str(target), draft_model=str(path))[0]
    assert model.drafter.context_windows == (5, 5)
    prompt = list(range(10, 30))
    caches = mtp_caches(model)
    model.draft_context(model.hidden(mx.array(prompt)[None]), caches)
    blocks = []
    for window in (None, 5):
        context = [ops(c).read_kv([len(prompt)], window) for c in caches]
        blocks.append(np.array(model.draft_block(mx.array([7]), context, 20)[0]))
    assert np.abs(blocks[0] - blocks[1]).max() > 1e-3
    greedy_identity(model, PROMPTS[1:], n=40, ks=(GAMMA,), policies=("auto",))


def test_a_converted_drafter_decodes_exactly_beside_a_quantized_target(model, tmp_path):
    """``convert -q`` of a DFlash2 drafter alone (its widths that allow it at 8
    bits), beside a quantized conversion of its target, and ``graft`` of it onto
    that conversion: greedy exact with drafts accepted."""
    src = model.drafter_source
    target = src.parent / "target"
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = convert(str(src), tmp_path / "d8", quantize=True, progress=False)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    saved = mx.load(str(out / "model.safetensors"))
    assert "fc.scales" in saved and "layers.0.attention_conv.base_kernel" in saved
    assert "candidate_selector.predecessor_codebook.weight" in saved
    quantized = convert(
        str(target), tmp_path / "t4", quantize=True, q_group_size=32, progress=False
    )
    pair = load_model(str(quantized), draft_model=str(out))[0]
    tokens, stats = greedy_run(pair, PROMPTS[1])
    assert tokens == plain(pair, PROMPTS[1], 24) and stats.accepted > 0, stats
    args = ["graft", "--from", str(src), "--mlx-path", str(quantized)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "the DFlash2 drafter" in result.output
    grafted = load_model(str(quantized))[0]
    assert isinstance(grafted.drafter, DFlash2)
    tokens, stats = greedy_run(grafted, PROMPTS[1])
    assert tokens == plain(grafted, PROMPTS[1], 24) and stats.accepted > 0, stats


@pytest.mark.slow
def test_a_gemma4_dflash2_drafter_decodes_exactly_and_rolls_back(tmp_path):
    """A DFlash2 drafter beside a Gemma 4 target (the Gemma spelling, its mask
    token named, as mlx-vlm's DFlash2 config requires): greedy identity with blocks
    accepted whole, in part and not at all, and the context cache equal to a fresh
    one after a rejection at every position of a block. ``peer_dspark.py
    --dflash`` checks its scores against mlx-vlm's."""
    from .test_dspark import assert_context_rolls_back
    from .test_window import greedy_identity

    t = write_gemma4(tmp_path / "t", "dense", predictable=True, damping=2.5)
    config = gemma4_dflash_config(t)
    path = write_dflash2(
        tmp_path / "d",
        t,
        predictable=True,
        selector_rank=64,
        config=config,
        mask_token_id=4,
    )
    model = load_model(str(t), draft_model=str(path))[0]
    d = model.drafter
    assert type(d) is DFlash2 and d.context_windows == (3, None) and d.softcap == 30
    prompts = ([5, 17, 30, 4, 9], list(range(10, 40)), [100, 200, 300, 7])
    hist = greedy_identity(model, prompts, n=40, ks=(2, GAMMA), policies=("auto",))
    assert hist[GAMMA][0] and hist[GAMMA][-1] and sum(hist[GAMMA][1:-1]), hist
    assert_context_rolls_back(model, prompts)


@pytest.mark.slow
def test_check_compares_a_grafted_drafter_with_its_source(tmp_path):
    """``check`` of a conversion with a grafted drafter: every slot's top-1,
    teacher-forced over the built-in text, agrees with its source drafter's on the
    same target, and not with another drafter's (exit 1); a drafter folder alone is
    refused in one line naming the way to check it."""
    t = write_qwen3_target(tmp_path / "t", vocab_size=512, predictable=True)
    d = write_dflash2(tmp_path / "d", t, predictable=True)
    quantized = convert(str(t), tmp_path / "t4", quantize=True, progress=False)
    args = ["graft", "--from", str(d), "--mlx-path", str(quantized)]
    assert CliRunner().invoke(main, args).exit_code == 0
    check = CliRunner().invoke(main, ["check", str(quantized)])
    assert check.exit_code == 0 and "DFlash2, 2 layers" in check.output, check.output
    assert f"agreement with {d} " in check.output and ") ok" in check.output
    other = write_dflash2(tmp_path / "other", t, seed=3, predictable=True, agree=0.5)
    args = ["check", str(quantized), "--hf-path", str(other)]
    check = CliRunner().invoke(main, args)
    assert check.exit_code == 1 and ") FAIL" in check.output, check.output
    alone = CliRunner().invoke(main, ["check", str(d)])
    assert alone.exit_code == 1 and "graft --from" in alone.output
    assert alone.output.count("\n") == 1, alone.output


def test_cli_generate_with_the_drafter_prints_the_plain_text(tmp_path):
    t = write_qwen3_target(tmp_path / "t", vocab_size=512, predictable=True)
    d = write_dflash2(tmp_path / "d", t, predictable=True)
    base = ["generate", "--model", str(t), "-p", "def f(x):", "-m", "40", "--quiet"]
    runs = [
        CliRunner().invoke(main, base + ["--draft-model", str(d), "-k", str(GAMMA)]),
        CliRunner().invoke(main, base + ["--draft-model", str(d)]),
        CliRunner().invoke(main, base + ["-k", "0"]),
    ]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].output == runs[1].output == runs[2].output
    models = CliRunner().invoke(main, ["models", str(d)])
    assert "DFlash2 drafter" in models.output, models.output


# --- DFlash (the first version) -----------------------------------------------------


def test_a_dflash_drafter_drops_its_anchor_row_and_matches_the_reference(target):
    """A ``DFlashDraftModel`` folder (``block_size`` counting the anchor row, which
    mlx-mtp read as DSpark's gamma before) loads as DFlash: gamma = block_size - 1,
    slot k the output of block row k + 1; its logits (soft-capped) equal the
    float64 reference, and it decodes exactly."""
    from .numpy_dflash import dflash_block
    from .numpy_dspark import target_taps
    from .test_window import greedy_identity

    path = write_dflash(target.parent / "v1", target, final_logit_softcapping=3.0)
    model = load_model(str(target), draft_model=str(path))[0]
    d = model.drafter
    assert type(d) is DFlash and d.block_size == GAMMA
    assert not d.spec.sample_from_anchor and "markov_head" not in d
    prompt, anchor = list(range(10, 30)), 7
    taps = target_taps(str(target), prompt, TARGET_LAYER_IDS)
    caches = mtp_caches(model)
    model.draft_context(model.hidden(mx.array(prompt)[None]), caches)
    context = block_context(model.drafter, caches, [len(prompt)])
    z, g = model.draft_block(mx.array([anchor]), context, len(prompt))
    ref = dflash_block(str(path), str(target), taps, anchor, [anchor] * GAMMA)
    for k in range(GAMMA):
        ours, _ = model.slot_logits(z[:, k], mx.array([anchor]), g[:, k], None)
        np.testing.assert_allclose(np.array(ours[0]), ref[k], rtol=1e-4, atol=1e-4)
    greedy_identity(model, PROMPTS[1:], n=40, ks=(GAMMA,), policies=("auto",))


def test_a_dflash_config_is_told_from_a_dspark_one_by_mlx_vlms_rule():
    """mlx-vlm's ``get_model_type``: a ``dflash_config`` names a DFlash drafter
    unless DSpark's marks are there (``projector_type`` "dspark", a Markov head, a
    DSpark architecture); mlx-mtp read every unnamed one as DSpark (gamma off by
    the anchor row)."""
    taps = {"target_layer_ids": [0, 2], "mask_token_id": 5}
    bare = {"model_type": "qwen3", "dflash_config": taps}
    assert dflash.kind(bare) == "DFlash"
    assert dflash.kind({**bare, "markov_rank": 8}) is None
    assert dflash.kind({**bare, "architectures": ["DSparkDraftModel"]}) is None
    spark = {**bare, "dflash_config": {**taps, "projector_type": "dspark"}}
    assert dflash.kind(spark) is None
    assert dflash.kind({"target_layer_ids": [0], "mask_token_id": 5}) is None


def test_a_gemma4_dflash_drafter_matches_the_reference_and_decodes_exactly(tmp_path):
    """Gemma 4's DFlash drafters (z-lab's, as mlx-vlm's ``gemma4_dflash`` reads
    them) say ``model_type`` gemma4, name no architecture nor mask token, and mix
    sliding and full layers. One loads as DFlash with Gemma's ``<mask>`` (4), each
    layer reading its own window of the context; its slot logits equal the float64
    reference (the target's embedding scaled by sqrt(H), the target's head without
    the target's soft cap, then the drafter's own), on the taps of mlx-mtp's Gemma 4
    trunk; and it decodes exactly. ``scripts/peer_dspark.py --dflash`` checks the
    same folder against mlx-vlm's drafter."""
    from .numpy_dflash import dflash_block
    from .test_window import greedy_identity

    t = write_gemma4(tmp_path / "t", "dense")
    path = write_gemma4_dflash(tmp_path / "d", t)
    model = load_model(str(t), draft_model=str(path))[0]
    d = model.drafter
    assert type(d) is DFlash and d.block_size == GAMMA and d.spec.mask_token_id == 4
    assert d.context_windows == (3, None)
    prompt, anchor = list(range(10, 30)), 7
    caches = mtp_caches(model)
    taps = model.hidden(mx.array(prompt)[None])
    model.draft_context(taps, caches)
    context = block_context(model.drafter, caches, [len(prompt)])
    z, g = model.draft_block(mx.array([anchor]), context, len(prompt))
    taps = np.array(taps[0, :, : d.tap_width].astype(mx.float32), np.float64)
    ref = dflash_block(str(path), str(t), taps, anchor, [anchor] * GAMMA)
    for k in range(GAMMA):
        ours, _ = model.slot_logits(z[:, k], mx.array([anchor]), g[:, k], None)
        np.testing.assert_allclose(np.array(ours[0]), ref[k], rtol=1e-4, atol=1e-4)
    greedy_identity(model, PROMPTS[1:], n=40, ks=(2, GAMMA), policies=("auto",))
    converted = convert(str(t), tmp_path / "t4", quantize=True, progress=False)
    args = ["graft", "--from", str(path), "--mlx-path", str(converted)]
    result = CliRunner().invoke(main, args)  # the target's args are its text model's
    assert result.exit_code == 0 and "the DFlash drafter" in result.output
    listed = CliRunner().invoke(main, ["models", str(path), str(converted)])
    assert listed.output.count("DFlash drafter") == 2, listed.output
    grafted = load_model(str(converted))[0]
    assert type(grafted.drafter) is DFlash and grafted.drafter.context_windows == (
        3,
        None,
    )
    greedy_identity(grafted, PROMPTS[1:2], n=24, ks=(GAMMA,), policies=("auto",))


@pytest.mark.slow
def test_serving_a_target_with_its_dflash2_drafter(tmp_path):
    t = write_qwen3_target(tmp_path / "t", vocab_size=512, predictable=True)
    assert_served_as_plain(t, write_dflash2(tmp_path / "d", t, predictable=True))


def test_a_qwen3_5_target_rolls_back_its_recurrent_state_with_blocks(tmp_path):
    """A Qwen3.5-layout target (Gated-DeltaNet and gated attention layers, the
    layout of Qwen3.8-27B, which the released DFlash2 drafters serve) with a DFlash2
    drafter of its widths: greedy identity at several block lengths and auto, the
    recurrent state rolled back wherever a block is rejected (k = 2 and gamma, a
    random k per round), batched rows too."""
    from mlx_mtp.batch import Batch
    from mlx_mtp.testing.fixtures import write_checkpoint

    from .test_batch import drive
    from .test_window import greedy_identity

    t = write_checkpoint("qwen3_5", tmp_path / "t", predictable=True)
    d = write_dflash2(tmp_path / "d", t, predictable=True)
    model = load_model(str(t), draft_model=str(d))[0]
    hist = greedy_identity(model, PROMPTS, n=48, ks=(2, GAMMA), policies=("auto",))
    assert sum(hist[GAMMA][1:]) > 0, hist  # blocks accepted in part
    opts = HEADS.replace(num_draft_tokens=GAMMA, max_tokens=24)
    prompts = [[5, 17, 30], list(range(10, 40)), [9, 8]]
    joins = {
        0: [(0, prompts[0], opts)],
        1: [(1, prompts[1], opts), (2, prompts[2], opts)],
    }
    out, _ = drive(Batch(model, opts), joins)
    for i, p in enumerate(prompts):
        assert out[i] == plain(model, p, 24), i

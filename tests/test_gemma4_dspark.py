"""Gemma 4 targets with Gemma 4 DSpark drafters (``Gemma4DSparkModel``, the published
layout as mlx-vlm's ``gemma4_dspark`` reads it): Gemma 4 layers, their own embedding
and head, Markov and confidence heads. The pair decodes exactly as plain decoding of
the target (greedy at every block length and auto, batched rows, sampling in
distribution), the context cache rolls back with the round, conversion and graft
keep it exact, and a layout mlx-mtp cannot rotate is refused in one line.
``scripts/peer_dspark.py --vlm DIR`` checks the block's logits against mlx-vlm's."""

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_mtp.cli import main
from mlx_mtp.convert import convert
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import load_model
from mlx_mtp.models.gemma4_dspark import Gemma4DSpark
from mlx_mtp.testing.dspark import BLOCK_SIZE, write_gemma4_dspark
from mlx_mtp.testing.gemma4 import write_gemma4

from .test_dspark import (
    assert_context_rolls_back,
    assert_rows_decode_as_alone,
    greedy_run,
    plain,
)

GAMMA = BLOCK_SIZE
PROMPTS = ([5, 17, 30, 4, 9], list(range(10, 40)), [100, 200, 300, 7])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A predictable pair: blocks accepted whole, in part, and not at all."""
    root = tmp_path_factory.mktemp("gemma4-dspark")
    target = write_gemma4(root / "target", "dense", predictable=True, damping=2.5)
    return target, write_gemma4_dspark(root / "drafter", target, predictable=True)


@pytest.fixture(scope="module")
def model(pair):
    return load_model(str(pair[0]), draft_model=str(pair[1]))[0]


def test_the_published_layout_loads_with_its_own_tables(model, pair):
    """Its own embedding (at Gemma's sqrt(H)) and head stay its own, its logits are
    soft-capped at 30, its full layers' heads are ``global_head_dim`` wide with one
    projection for keys and values, and Gemma's ``<mask>`` is its mask token."""
    d = model.drafter
    assert type(d) is Gemma4DSpark and d.block_size == GAMMA
    assert d.spec.mask_token_id == 4 and d.spec.markov_rank == 64
    assert "embed_tokens" in d and "lm_head" in d and d.cuts is False
    assert d.embed_scale == 64**0.5 and d.softcap == 30.0
    assert d.context_windows == (None, None)
    for layer in d.layers:
        attn = layer.self_attn
        assert attn.head_dim == 32 and attn.k_eq_v and "v_proj" not in attn
    listed = CliRunner().invoke(main, ["models", str(pair[1])])
    assert "is a DSpark drafter" in listed.output, listed.output


def test_greedy_identity_at_every_block_length_and_auto(model):
    from .test_window import greedy_identity

    ks = tuple(range(1, GAMMA + 1))
    hist = greedy_identity(model, PROMPTS, n=40, ks=ks, policies=("auto",))
    assert hist[GAMMA][0] and hist[GAMMA][-1] and sum(hist[GAMMA][1:-1]), hist


@pytest.mark.slow
def test_context_cache_equals_a_fresh_one_after_every_rejection(model):
    assert_context_rolls_back(model, PROMPTS)


@pytest.mark.slow
def test_batched_rows_decode_as_alone(model):
    assert_rows_decode_as_alone(model)


@pytest.mark.slow
def test_sampling_is_exact(tmp_path):
    from .test_sampling import sampling_after_prompt_fails

    V = 16
    t = write_gemma4(tmp_path / "t", "dense", predictable=True, vocab_size=V)
    d = write_gemma4_dspark(tmp_path / "d", t, predictable=True)
    small = load_model(str(t), draft_model=str(d))[0]
    assert not sampling_after_prompt_fails(small, [3, 7, 1, 9, 4, 2], V, GAMMA)


def test_sliding_layers_read_their_window_and_a_wider_rope_is_refused(pair):
    """A sliding first layer (its RoPE rotates the full layer's first dims, as
    mlx-vlm's one RoPE does) reads the last sliding_window - 1 context rows; a
    full first layer's RoPE, wider than a sliding layer's heads, is refused."""
    from .test_window import greedy_identity

    target = pair[0]
    kinds = ("sliding_attention", "full_attention")
    path = write_gemma4_dspark(target.parent / "mixed", target, layer_types=kinds)
    model = load_model(str(target), draft_model=str(path))[0]
    assert model.drafter.context_windows == (3, None)
    greedy_identity(model, PROMPTS[1:2], n=24, ks=(GAMMA,), policies=("auto",))
    wider = write_gemma4_dspark(
        target.parent / "wider", target, layer_types=kinds[::-1]
    )
    with pytest.raises(MTPError, match="first layer's RoPE") as e:
        load_model(str(target), draft_model=str(wider))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_converted_and_a_grafted_drafter_decode_exactly(model, pair, tmp_path):
    """``convert -q`` of the drafter alone (its layers at 8 bits) beside a
    quantized conversion of its target, and ``graft`` of it onto that conversion:
    greedy exact with drafts accepted."""
    target, src = pair
    out = convert(str(src), tmp_path / "d8", quantize=True, progress=False)
    assert "layers.0.mlp.gate_proj.scales" in mx.load(str(out / "model.safetensors"))
    quantized = convert(str(target), tmp_path / "t4", quantize=True, progress=False)
    for folder, drafter in ((quantized, str(out)), (quantized, None)):
        if drafter is None:
            args = ["graft", "--from", str(src), "--mlx-path", str(quantized)]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
        pair_ = load_model(str(folder), draft_model=drafter)[0]
        assert type(pair_.drafter) is Gemma4DSpark
        tokens, stats = greedy_run(pair_, PROMPTS[1])
        assert tokens == plain(pair_, PROMPTS[1], 24) and stats.accepted > 0, stats

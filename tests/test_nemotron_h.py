"""Nemotron-H specifics: config spellings of the layer types, the MTP step's sub-layers,
and refusals. (Numerics, greedy identity, sampling and conversion run in the suites
that iterate over every fixture family.)"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp import load
from mlx_mtp.errors import MissingHeadsError, UnsupportedModelError
from mlx_mtp.models.nemotron_h import step_pattern
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_checkpoint

from .test_greedy import plain_greedy
from .test_numerics import SEQ, teacher_forced


@pytest.mark.parametrize(
    "config,pattern",
    [
        ({}, "*E"),  # transformers' default
        ({"mtp_hybrid_override_pattern": "*E"}, "*E"),
        ({"mtp_hybrid_override_pattern": "-*E"}, "-*E"),
        ({"mtp_layers_block_type": ["attention", "moe"]}, "*E"),
        ({"mtp_layers_block_type": ["full_attention", "mlp"]}, "*-"),
        # an explicit non-default list wins over the legacy string
        (
            {"mtp_layers_block_type": ["moe"], "mtp_hybrid_override_pattern": "*E"},
            "E",
        ),
        # the default list yields to it
        (
            {
                "mtp_layers_block_type": ["full_attention", "moe"],
                "mtp_hybrid_override_pattern": "*-",
            },
            "*-",
        ),
    ],
)
def test_step_pattern_follows_transformers(config, pattern):
    assert step_pattern(config) == pattern


def test_unknown_step_layer_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="unknown Nemotron-H MTP layer"):
        step_pattern({"mtp_layers_block_type": ["attention", "kda"]})


@pytest.mark.parametrize("names", ["old", "new"])
def test_list_configs_equal_the_released_strings(names, loaded, tmp_path):
    """transformers' ``layers_block_type`` / ``mtp_layers_block_type`` lists, with the
    pre- and post-5.13 type names, build the same model as the released pattern
    strings (same seed, same tensors)."""
    reference, _ = loaded("nemotron_h")
    path = write_checkpoint("nemotron_h", tmp_path / names, names=names)
    config = json.loads((path / "config.json").read_text())
    assert "hybrid_override_pattern" not in config
    assert "num_hidden_layers" not in config
    model, _ = load(str(path))
    for ours, ref in zip(
        teacher_forced(model, SEQ)[1], teacher_forced(reference, SEQ)[1]
    ):
        np.testing.assert_array_equal(ours, ref)


def test_three_sub_layer_step_decodes_exactly(tmp_path):
    """A step of MLP, attention and MoE sub-layers (the continuing residual over P = 3)
    loads, matches the numpy reference and decodes exactly."""
    from .numpy_reference import reference_logits

    path = write_checkpoint(
        "nemotron_h", tmp_path / "p3", predictable=True, mtp_pattern="-*E"
    )
    model, tokenizer = load(str(path))
    assert len(model.mtp.layers[0].block.layers) == 3
    main, mtp = teacher_forced(model, SEQ)
    ref_main, ref_mtp = reference_logits(path, SEQ)
    np.testing.assert_allclose(mtp[0], ref_mtp[0], atol=1e-4)
    ids = tokenizer.encode("def forward(self, x):")
    expected = plain_greedy(model, ids, 32)
    for k in (1, 3):
        steps = mtp_generate_step(ids, model, HEADS, num_draft_tokens=k, max_tokens=32)
        assert [o.token for o in steps] == expected


def _damaged(checkpoint, tmp_path, edit):
    out = tmp_path / "broken"
    shutil.copytree(checkpoint("nemotron_h"), out)
    weights = mx.load(str(out / "model.safetensors"))
    edit(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def test_missing_and_misshapen_mtp_tensors_are_refused(checkpoint, tmp_path):
    path = _damaged(
        checkpoint, tmp_path, lambda w: w.pop("mtp.layers.1.final_layernorm.weight")
    )
    with pytest.raises(MissingHeadsError, match="missing layers.0.norm.weight"):
        load(str(path))
    shutil.rmtree(path)

    def shrink(w):
        w["mtp.layers.0.mixer.k_proj.weight"] = mx.zeros((16, 64))

    path = _damaged(checkpoint, tmp_path, shrink)
    with pytest.raises(
        MissingHeadsError, match=r"shape \(16, 64\), expected \(32, 64\)"
    ):
        load(str(path))


def test_mamba_sub_layer_in_the_step_is_refused(checkpoint, tmp_path):
    """A step with a Mamba-2 sub-layer would need a recurrent MTP cache: refused in
    one line at load, not drafted inexactly."""
    out = tmp_path / "mamba-step"
    shutil.copytree(checkpoint("nemotron_h"), out)
    config = json.loads((out / "config.json").read_text())
    config["mtp_hybrid_override_pattern"] = "M*E"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="no Mamba sub-layer"):
        load(str(out))

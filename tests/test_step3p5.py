"""Step-3.5 specifics: several MTP layers, a sliding-window one among them, raw
``(1 + w)`` norms, copies of the head, and refusals. (Numerics, greedy identity,
sampling and conversion run in the suites that iterate over every fixture family.)"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_mtp import load
from mlx_mtp.cache import WindowCache, make_caches
from mlx_mtp.errors import MissingHeadsError, UnsupportedModelError
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import plain_greedy


def test_sliding_mtp_layer_has_a_window_cache_and_needs_it(loaded):
    """The MTP layer typed ``sliding_attention`` attends to the last W positions
    (a full-attention pass over the same rows gives other logits), and decoding gives
    it a window cache."""
    model, _ = loaded("step3p5", predictable=True)
    assert [layer.window for layer in model.mtp.layers] == [8, None]
    caches = make_caches(model).mtp
    assert isinstance(caches[0], WindowCache) and isinstance(caches[1], KVCache)
    seq = mx.array([[5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99]])
    h = model.hidden(seq)[:, :-1]
    windowed = model.mtp_forward(0, h, seq[:, 1:], KVCache())
    layer = model.mtp.layers[0]
    full = layer(model.embed(seq[:, 1:]), h, model.mtp_mask(h, None), None)
    np.testing.assert_allclose(
        np.array(windowed[:, :8]), np.array(full[:, :8]), atol=1e-5
    )
    assert not np.allclose(np.array(windowed[:, 8:]), np.array(full[:, 8:]), atol=1e-3)


def test_chunked_prefill_past_the_window(loaded):
    model, tokenizer = loaded("step3p5", predictable=True)
    ids = tokenizer.encode("def f(x):\n    return x * 2\n" * 4)
    expected = plain_greedy(model, ids, 24)
    for k in (1, 2):
        steps = mtp_generate_step(
            ids, model, HEADS, num_draft_tokens=k, max_tokens=24, prefill_step_size=5
        )
        assert [o.token for o in steps] == expected


@pytest.fixture
def damaged(checkpoint, tmp_path):
    def make(edit_weights=None, edit_config=None):
        out = tmp_path / "broken"
        shutil.copytree(checkpoint("step3p5"), out)
        if edit_weights:
            weights = mx.load(str(out / "model.safetensors"))
            edit_weights(weights)
            mx.save_safetensors(str(out / "model.safetensors"), weights)
        if edit_config:
            config = json.loads((out / "config.json").read_text())
            edit_config(config)
            (out / "config.json").write_text(json.dumps(config))
        return out

    return make


def test_a_head_copy_from_another_model_is_refused(damaged):
    def perturb(w):
        w["model.layers.4.shared_head.output.weight"] = w["lm_head.weight"] * 1.5

    with pytest.raises(MissingHeadsError, match="do not belong to this model"):
        load(str(damaged(perturb)))


def test_missing_and_misshapen_mtp_tensors_are_refused(damaged):
    path = damaged(
        lambda w: w.pop("model.layers.4.transformer.self_attn.g_proj.weight")
    )
    with pytest.raises(
        MissingHeadsError, match="missing layers.1.block.self_attn.g_proj"
    ):
        load(str(path))
    shutil.rmtree(path)

    def shrink(w):
        w["model.layers.3.eh_proj.weight"] = mx.zeros((64, 64))

    with pytest.raises(
        MissingHeadsError, match=r"shape \(64, 64\), expected \(64, 128\)"
    ):
        load(str(damaged(shrink)))


def test_layer_lists_without_the_mtp_entries_are_refused(damaged):
    """A config whose per-layer lists stop at the trunk does not say what the MTP
    layers' attention is: one line, not an IndexError."""

    def trim(config):
        for key in ("layer_types", "rope_theta", "partial_rotary_factors"):
            config[key] = config[key][:3]

    with pytest.raises(UnsupportedModelError, match="none for MTP layer 0"):
        load(str(damaged(edit_config=trim)))

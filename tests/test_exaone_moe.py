"""EXAONE-MoE specifics: the released layout (Qwen3-Next's ``mtp.`` names, plain norms,
a dense full-attention MTP layer without RoPE) and a sliding-window MTP layer.
(Numerics, greedy identity and conversion run in the suites over every family.)"""

import json

import mlx.core as mx
import numpy as np

from mlx_mtp import load
from mlx_mtp.cache import WindowCache, make_caches
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_checkpoint

from .numpy_reference import reference_logits
from .test_greedy import plain_greedy
from .test_numerics import SEQ, teacher_forced


def test_released_layout(checkpoint, loaded):
    path = checkpoint("exaone_moe")
    weights = mx.load(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    assert config["mtp_layer_types"] == ["full_attention"]
    assert config["mtp_sliding_windows"] == [0]
    assert weights["mtp.fc.weight"].shape == (64, 128)
    assert weights["mtp.layers.0.mlp.gate_proj.weight"].shape == (128, 64)  # dense
    assert "model.layers.1.mlp.e_score_correction_bias" in weights
    model, _ = loaded("exaone_moe")
    attn = model.mtp.layers[0].block.self_attn
    assert not attn.use_rope and model.mtp.layers[0].window is None  # NoPE, full


def test_sliding_mtp_layer(tmp_path):
    path = write_checkpoint(
        "exaone_moe", tmp_path / "swa", predictable=True, mtp_sliding=True
    )
    model, tokenizer = load(str(path))
    assert model.mtp.layers[0].window == 8
    assert isinstance(make_caches(model).mtp[0], WindowCache)
    assert model.mtp.layers[0].block.self_attn.use_rope
    _, mtp = teacher_forced(model, SEQ)
    _, ref = reference_logits(path, SEQ)
    np.testing.assert_allclose(mtp[0], ref[0], atol=1e-4)
    ids = tokenizer.encode("def forward(self, x):")
    expected = plain_greedy(model, ids, 40)
    for k in (1, 3):
        steps = mtp_generate_step(ids, model, HEADS, num_draft_tokens=k, max_tokens=40)
        assert [o.token for o in steps] == expected

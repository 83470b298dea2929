"""The DeepSeek-V4 numpy reference on its own (no MLX): causal and consistent.

The reference is checked against transformers 5.24 by
``scripts/deepseek_v4_transformers_check.py`` (torch is not a test dependency).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_mtp.testing.fixtures import _deepseek_v4, _Init, _to_mx

from . import numpy_deepseek_v4 as ref
from .numpy_reference import load_checkpoint, reference_logits

PROMPT = 40  # > sliding_window, 10 CSA and 2 HCA entries, top-k active


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory, v4_tensors):
    """The V4 fixture in its release layout (float32), written without MLX."""
    out = tmp_path_factory.mktemp("deepseek_v4")
    cfg, tensors = v4_tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def v4_tensors():
    return _deepseek_v4(_Init(np.random.default_rng(0)), 512)


def test_prefix_logits_equal_the_full_run(v4_dir):
    """Logits of tokens[:m] are the first rows of the full run's (trunk and MTP),
    and the run exercises what it should: the top-k prunes CSA entries and HCA
    entries are seen."""
    tokens = np.random.default_rng(1).integers(0, 512, PROMPT).tolist()
    trace = {}
    main, (mtp,) = ref.reference_logits(v4_dir, tokens, trace)
    assert main.shape == (PROMPT, 512) and mtp.shape == (PROMPT - 1, 512)
    assert main.std() > 0.1 and mtp.std() > 0.1
    visible = np.isfinite(trace["index_1"]).sum(axis=1)
    assert (visible > 4).any() and trace["entries_1"].sum(axis=1).max() == 4
    assert trace["entries_2"].sum(axis=1).max() == PROMPT // 16
    for m in (1, 5, 17, 33):
        head, (draft,) = ref.reference_logits(v4_dir, tokens[:m])
        np.testing.assert_allclose(head, main[:m], rtol=0, atol=1e-12)
        np.testing.assert_allclose(draft, mtp[: m - 1], rtol=0, atol=1e-12)


def test_bfloat16_release_dtypes_load(tmp_path, v4_tensors):
    """A bfloat16 checkpoint with the release's int32 ``tid2eid`` and float32 ``hc_*``
    loads in the reference (the by-hand bfloat16 reader), through
    ``numpy_reference.reference_logits``."""
    cfg, tensors = v4_tensors
    arrays = {k: _to_mx(k, v, mx.bfloat16) for k, v in tensors.items()}
    assert arrays["layers.0.ffn.gate.tid2eid"].dtype == mx.int32
    assert arrays["hc_head_fn"].dtype == mx.float32
    mx.save_safetensors(str(tmp_path / "model.safetensors"), arrays)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, W = load_checkpoint(tmp_path)
    table = tensors["layers.0.ffn.gate.tid2eid"]
    np.testing.assert_array_equal(W["layers.0.ffn.gate.tid2eid"], table)
    np.testing.assert_array_equal(W["hc_head_fn"], tensors["hc_head_fn"])
    main, (mtp,) = reference_logits(tmp_path, [3, 1, 4, 1, 5, 9, 2, 6])
    assert main.shape == (8, 512) and mtp.shape == (7, 512)

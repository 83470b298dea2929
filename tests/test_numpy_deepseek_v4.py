"""The DeepSeek-V4 numpy reference on its own (no MLX): causal and consistent.

The reference is checked against transformers 5.24 by
``scripts/deepseek_v4_transformers_check.py`` (torch is not a test dependency).
"""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlx_mtp.testing.fixtures import _deepseek_v4, _Init

from . import numpy_deepseek_v4 as ref

PROMPT = 40  # > sliding_window, 10 CSA and 2 HCA entries, top-k active


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """The V4 fixture in its release layout (float32), written without MLX."""
    out = tmp_path_factory.mktemp("deepseek_v4")
    cfg, tensors = _deepseek_v4(_Init(np.random.default_rng(0)), 512)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


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

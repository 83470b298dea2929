"""DeepSeek-V3.2 / GLM-5 specifics: the DSA indexer binds in the fixtures' passes, and
a layer's two caches (MLA latent, indexer keys) roll back together. (Numerics, greedy
identity, sampling and conversion run in the suites over every fixture family.)"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_mtp.cache import ListCache, make_caches
from mlx_mtp.speculative import Session, mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import plain_greedy
from .test_numerics import SEQ, teacher_forced


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_the_indexer_selects(family, loaded, monkeypatch):
    """Past ``index_topk`` positions the logits depend on the selection: with the
    indexer made to keep every key, rows past the first topk change (so the numpy
    comparison checks the sparse path, not only dense attention)."""
    model, _ = loaded(family)
    sparse = teacher_forced(model, SEQ)
    for layer in [*model.trunk.layers, model.mtp.layers[0].block]:
        monkeypatch.setattr(layer.self_attn.indexer, "index_topk", 1000)
    dense = teacher_forced(model, SEQ)
    np.testing.assert_allclose(sparse[0][:4], dense[0][:4], atol=1e-5)
    assert not np.allclose(sparse[0][4:], dense[0][4:], atol=1e-2)
    assert not np.allclose(sparse[1][0][4:], dense[1][0][4:], atol=1e-2)


def test_caches_are_lists_and_sessions_go_on(loaded):
    model, tokenizer = loaded("deepseek_v32", predictable=True)
    caches = make_caches(model)
    assert all(isinstance(c, ListCache) for c in caches.trunk + caches.mtp)
    session, history = Session(), []
    for text in ("def forward(self, x):", " return"):
        ids = tokenizer.encode(text)
        steps = mtp_generate_step(
            ids, model, HEADS, num_draft_tokens=3, max_tokens=20, session=session
        )
        out = [o.token for o in steps]
        assert out == plain_greedy(model, history + ids, 20)
        history += ids + out
    mx.eval([c.state for c in session.caches.trunk])


@pytest.mark.parametrize(
    "edit",
    [
        {"indexer_types": ["full", "full", "shared"]},
        {"index_topk_freq": 4, "index_skip_topk_offset": 3},
    ],
)
def test_shared_indexers_are_refused_in_one_line(checkpoint, tmp_path, edit):
    """GLM-5.2 / 5.3 configs (indexers shared across layers) are refused by load
    and convert with one line, as the CLI prints it, not on the missing tensors."""
    import json
    import shutil

    from click.testing import CliRunner

    from mlx_mtp import load
    from mlx_mtp.cli import main
    from mlx_mtp.errors import UnsupportedModelError

    path = tmp_path / "glm52"
    shutil.copytree(checkpoint("glm_moe_dsa"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(UnsupportedModelError, match="share a sparse-attention indexer"):
        load(str(path))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["convert", "--hf-path", str(path), "--mlx-path", str(out)]
    )
    assert result.exit_code != 0 and not out.exists()
    assert "share a sparse-attention indexer" in result.output
    assert "Traceback" not in result.output

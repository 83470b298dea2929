"""DeepSeek-V3.2 / GLM-5 specifics: the DSA indexer binds in the fixtures' passes, and
a layer's two caches (MLA latent, indexer keys) roll back together. (Numerics, greedy
identity, sampling and conversion run in the suites over every fixture family.)"""

import json
import shutil

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


def glm52(checkpoint, tmp_path, predictable=False):
    """The GLM-5 fixture as GLM-5.2 lays it out: layer 2 shares the indexer of layer
    1, the last full one before it (``indexer_types``), and ships none; the MTP layer
    keeps its own."""
    path = tmp_path / f"glm52-{predictable}"
    shutil.copytree(checkpoint("glm_moe_dsa", predictable=predictable), path)
    config = json.loads((path / "config.json").read_text())
    config["indexer_types"] = ["full", "full", "shared", "full"]
    (path / "config.json").write_text(json.dumps(config))
    for shard in path.glob("*.safetensors"):
        weights = mx.load(str(shard))
        kept = {
            k: v for k, v in weights.items() if "layers.2.self_attn.indexer" not in k
        }
        assert len(kept) < len(weights)
        mx.save_safetensors(str(shard), kept)
    index = path / "model.safetensors.index.json"
    if index.exists():
        table = json.loads(index.read_text())
        table["weight_map"] = {
            k: v
            for k, v in table["weight_map"].items()
            if "layers.2.self_attn.indexer" not in k
        }
        index.write_text(json.dumps(table))
    return path


def test_shared_indexers_match_the_reference_and_decode_exactly(checkpoint, tmp_path):
    """GLM-5.2 / 5.3: a shared layer attends to the keys its full layer selected.
    Teacher-forced logits (trunk and MTP layer) equal the numpy reference's, which
    differ from a dense shared layer's; greedy decoding at k = 1..3 and auto, alone
    and batched, is plain decoding's."""
    from mlx_mtp import load
    from mlx_mtp.batch import run_batch
    from mlx_mtp.models.deepseek_v32 import FullIndexer, SharedIndexer
    from mlx_mtp.options import DecodeOptions

    from .numpy_reference import reference_logits
    from .test_window import greedy_identity

    path = glm52(checkpoint, tmp_path)
    model = load(str(path))[0]
    kinds = [type(layer.self_attn.indexer) for layer in model.trunk.layers]
    assert kinds == [FullIndexer, FullIndexer, SharedIndexer]
    main, mtp = teacher_forced(model, SEQ)
    ref_main, ref_mtp = reference_logits(path, SEQ)
    np.testing.assert_allclose(main, ref_main, atol=1e-4)
    np.testing.assert_allclose(mtp[0], ref_mtp[0], atol=1e-4)
    dense = model.trunk.layers[2].self_attn
    dense.indexer.top = type(dense.indexer.top)()  # nothing selected: dense attention
    assert not np.allclose(teacher_forced(model, SEQ)[0][4:], ref_main[4:], atol=1e-2)

    model = load(str(glm52(checkpoint, tmp_path, predictable=True)))[0]
    greedy_identity(
        model, [SEQ[:6], list(range(3, 40))], n=40, ks=(1, 2, 3), policies=("auto",)
    )
    prompts = [SEQ[:5], list(range(3, 30))]
    options = DecodeOptions(draft_source="heads", num_draft_tokens=2, max_tokens=24)
    outs = {}
    for o in run_batch(model, prompts, [options, options], max_batch=2):
        outs.setdefault(o.uid, []).extend(o.tokens)
    assert [outs[u] for u in sorted(outs)] == [
        plain_greedy(model, p, 24) for p in prompts
    ]


def test_indexer_types_from_the_config():
    """``indexer_types`` as given, or from ``index_topk_pattern``, or from
    ``index_topk_freq`` and ``index_skip_topk_offset`` (GLM-5.2: a full indexer on
    layers 0, 1, 2, 6, 10, ..., 74 of 78); a shared first layer is refused."""
    from mlx_mtp.errors import UnsupportedModelError
    from mlx_mtp.models.deepseek_v32 import indexer_types

    glm52 = {"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3}
    full = [i for i, kind in enumerate(indexer_types(glm52)) if kind == "full"]
    assert full == [0, 1, 2] + list(range(6, 78, 4))
    assert indexer_types({"num_hidden_layers": 3}) == ["full"] * 3
    pattern = {"num_hidden_layers": 3, "index_topk_pattern": "FSF"}
    assert indexer_types(pattern) == ["full", "shared", "full"]
    given = {"num_hidden_layers": 2, "indexer_types": ["full", "shared", "full"]}
    assert indexer_types(given) == ["full", "shared"]  # the MTP layer's entry dropped
    with pytest.raises(UnsupportedModelError, match="full layer before it"):
        indexer_types({"num_hidden_layers": 2, "indexer_types": ["shared", "full"]})

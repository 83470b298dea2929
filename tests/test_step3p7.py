"""Step-3.7 specifics: Step-3.5's text model and MTP layers inside a vision-language
checkpoint (``text_config``), the vision tensors left out of the text trunk, and the
``model.language_model.`` spelling. (Numerics, greedy identity, batching, sampling
and conversion run in the suites that iterate over every fixture family.)"""

import shutil

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp import load
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

from .test_greedy import plain_greedy

PROMPT = [5, 77, 301, 12, 9, 140, 88]


def test_the_text_trunk_and_its_heads_leave_the_vision_tower_out(loaded):
    model, _ = loaded("step3p7", predictable=True)
    assert model.num_mtp_layers == 2 and model.trunk.args.model_type == "step3p5"
    names = [k for k, _ in tree_flatten(model.trunk.parameters())]
    assert names and not any("vision" in k or "projector" in k for k in names)


def test_the_language_model_spelling_decodes_the_same(checkpoint, tmp_path):
    """A conversion that keeps the text tensors under ``model.language_model.`` (as
    mlx-vlm's ``step3p7`` also reads) loads the same trunk and heads: greedy tokens
    at k = 2 equal the released spelling's and plain decoding's."""
    src = checkpoint("step3p7", predictable=True)
    out = tmp_path / "nested"
    shutil.copytree(src, out)
    weights = mx.load(str(out / "model.safetensors"))
    renamed = {
        (
            k.replace("model.", "model.language_model.", 1)
            if k.startswith("model.") and "projector" not in k
            else k
        ): v
        for k, v in weights.items()
    }
    assert any(k.startswith("model.language_model.layers.4.") for k in renamed)
    mx.save_safetensors(str(out / "model.safetensors"), renamed)
    tokens = {}
    for path in (src, out):
        model = load(str(path))[0]
        steps = mtp_generate_step(
            PROMPT, model, HEADS, num_draft_tokens=2, max_tokens=24
        )
        tokens[path] = [o.token for o in steps]
        assert tokens[path] == plain_greedy(model, PROMPT, 24)
    assert tokens[src] == tokens[out]

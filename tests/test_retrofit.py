"""Retrofitted heads on plain mlx-lm trunks (the `retrofit` family): a DeepSeek-style
MTP layer whose block is a copy of the trunk's last decoder layer, loaded, trained by
`train-heads` and drafted exactly."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlx_mtp.convert.train_heads import train_heads
from mlx_mtp.loading import load
from mlx_mtp.models import get_family
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_retrofitted

from .test_train_heads import DATA, QUICK

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
TRUNKS = {
    "qwen3": BASE,
    "qwen2": {k: v for k, v in BASE.items() if k != "head_dim"},
    "mistral": {  # mlx-lm's llama class, with a sliding-window layer
        **BASE,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
PROMPTS = ([5, 77, 301], list(range(40, 60)))


@pytest.fixture(scope="module", params=list(TRUNKS))
def trunk(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return write_retrofitted(
        path, request.param, TRUNKS[request.param], predictable=True
    )


def plain(model, prompt, n):
    return [
        int(t) for t, _ in generate_step(mx.array(prompt), model.trunk, max_tokens=n)
    ]


def drafted(model, prompt, n, k):
    outs = list(
        mtp_generate_step(prompt, model, HEADS, num_draft_tokens=k, max_tokens=n)
    )
    return [o.token for o in outs], outs[-1].stats


def test_retrofitted_heads_draft_exactly(trunk):
    model, _ = load(str(trunk))
    assert get_family({"model_type": model.model_type}).name == model.model_type
    accepted = 0
    for prompt in PROMPTS:
        expected = plain(model, prompt, 80)
        for k in (1, 2, 3):
            tokens, stats = drafted(model, prompt, 80, k)
            assert tokens == expected, (model.model_type, len(prompt), k)
            accepted += stats.accepted
    assert accepted > 0  # the heads are used, not only rejected


def test_train_heads_on_a_retrofitted_trunk(tmp_path):
    src = write_retrofitted(tmp_path / "src", "qwen3", TRUNKS["qwen3"])
    out = train_heads(str(src), DATA[:2], str(tmp_path / "out"), QUICK, progress=False)
    model, _ = load(str(out))
    assert model.num_mtp_layers == 1
    assert drafted(model, PROMPTS[0], 32, 2)[0] == plain(model, PROMPTS[0], 32)

"""Ling (bailing) specifics: the lightning-attention and KDA states roll back exactly,
and a Ling 3.0 config under transformers' ``bailing_hybrid`` name is refused with its
fix.
(Numerics, greedy identity and conversion run in the suites over every family.)"""

import json
import shutil

import mlx.core as mx
import pytest

from mlx_mtp import load
from mlx_mtp.cache import RecurrentCache, begin_verify, make_caches, rewind
from mlx_mtp.errors import UnsupportedModelError

from .test_cache import assert_same_cache


@pytest.mark.parametrize("drop", (0, 1, 3))
@pytest.mark.parametrize("family", ("bailing_hybrid", "bailing_moe_v3"))
def test_linear_attention_state_rolls_back(loaded, family, drop):
    """Lightning attention (Ling 2.5) and Kimi Delta Attention with its three short
    convolutions (Ling 3.0): after a pass and a rollback, every cache equals a fresh
    prefill of the kept tokens."""
    model, _ = loaded(family)
    prompt, extra = [5, 17, 99, 3, 64, 8, 21], [40, 2, 77, 120]

    def caches_after(tokens, more=None):
        caches = make_caches(model).trunk
        model(mx.array(tokens)[None], caches)
        if more:
            marks = begin_verify(caches)
            model(mx.array(more)[None], caches)
            rewind(caches, marks, drop)
        return caches

    ours = caches_after(prompt, extra)
    fresh = caches_after(prompt + extra[: len(extra) - drop])
    assert sum(isinstance(c, RecurrentCache) for c in ours) == 2
    for a, b in zip(ours, fresh):
        assert_same_cache(a, b)


def test_ling_3_config_under_the_hybrid_name_is_refused(checkpoint, tmp_path):
    out = tmp_path / "ling3"
    shutil.copytree(checkpoint("bailing_hybrid"), out)
    config = json.loads((out / "config.json").read_text())
    config.update(short_conv_kernel_size=4, kda_lower_bound=-5.0)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match='"model_type": "bailing_moe_v3"'):
        load(str(out))

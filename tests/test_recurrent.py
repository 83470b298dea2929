"""Exact rollback of recurrent (Gated-DeltaNet) state on hybrid trunks, and the Qwen
norm-shift guard."""

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.cache import RecurrentCache, begin_verify, make_caches, rewind
from mlx_mtp.loading import load_model
from mlx_mtp.models.qwen3_next import SHIFTED
from mlx_mtp.options import DecodeOptions
from mlx_mtp.resolve import drafting
from mlx_mtp.round import commit, launch, plan
from mlx_mtp.speculative import Run, Session, prefill

from .test_cache import assert_same_cache, fresh_caches

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PROMPT = "def forward(self, x):"


def trunk_state(caches):
    """Evaluate every trunk cache (KV or recurrent)."""
    mx.eval([c.state for c in caches.trunk])


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("n", (0, 1, 2, 3))
def test_rewind_restores_state_at_any_length(family, n, loaded):
    """A 4-token verify pass rewound by n equals a prefill without those n tokens."""
    model, tokenizer = loaded(family, predictable=True)
    prompt = tokenizer.encode(PROMPT)
    extra = [11, 230, 57, 301]
    caches = make_caches(model)
    model.hidden(mx.array(prompt)[None], caches.trunk)
    trunk_state(caches)
    marks = begin_verify(caches.trunk)
    model.hidden(mx.array(extra)[None], caches.trunk)
    rewind(caches.trunk, marks, n)
    fresh = fresh_caches(model, prompt + extra[: len(extra) - n])
    for ours, ref in zip(caches.trunk, fresh.trunk):
        assert_same_cache(ours, ref)


def test_fast_path_copies_nothing(loaded):
    """When every draft is accepted, the recurrent state is the pass's own output."""
    model, tokenizer = loaded("qwen3_5", predictable=True)
    caches = make_caches(model)
    model.hidden(mx.array(tokenizer.encode(PROMPT))[None], caches.trunk)
    marks = begin_verify(caches.trunk)
    model.hidden(mx.array([11, 230, 57])[None], caches.trunk)
    recurrent = [c for c in caches.trunk if isinstance(c, RecurrentCache)]
    assert recurrent
    before = [list(c.cache) for c in recurrent]
    rewind(caches.trunk, marks, 0)
    for c, old in zip(recurrent, before):
        assert all(a is b for a, b in zip(c.cache, old))
        assert c.capture is None


@pytest.mark.parametrize("family", HYBRID)
def test_rollback_parity_after_partial_round(family, loaded):
    """Run rounds until one accepts some but not all drafts; the trunk caches then
    equal a fresh prefill of the committed tokens."""
    model, tokenizer = loaded(family, predictable=True)
    k, opts = 3, DecodeOptions(num_draft_tokens=3, max_tokens=-1, draft_vocab=None)
    caches = make_caches(model)
    state = prefill(model, caches, tokenizer.encode(PROMPT), 1, 512)
    session = Session(caches, state)
    run = Run(model, session, drafting(model, opts), opts, mx.random.key(0))
    run.begin()
    partial = 0
    for _ in range(40):
        rnd = launch(model, caches, [run], plan([run]), state.depth)
        a = rnd.accepted.item()
        new = rnd.drafts[0, :a].tolist() + [rnd.next_tokens.item()]
        commit(caches, [run], rnd, [new], state.depth)
        if 0 < a < k:
            partial += 1
            fresh = fresh_caches(model, state.tokens[:-1])
            for ours, ref in zip(caches.trunk, fresh.trunk):
                assert_same_cache(ours, ref)
            if partial == 2:
                break
    assert partial == 2, "no round with partial acceptance"


# --- the (1 + w) norm shift is applied exactly once -----------------------------------


def mlx_conversion(src, dst, shift_heads=True):
    """Write what a correct converter writes: mlx-lm's sanitized trunk (norms shifted,
    conv weights transposed, experts stacked) plus the ``mtp.*`` tensors with their
    norms shifted too (or, with ``shift_heads=False``, left raw: the bug of shifting
    twice on load would then be invisible, so that is the negative control's input)."""
    trunk, _ = mlx_lm_load_model(src, lazy=False)
    weights = dict(tree_flatten(trunk.parameters()))
    raw = mx.load(str(src / "model.safetensors"))
    for key, value in raw.items():
        if not key.startswith("mtp."):
            continue
        norm = key.endswith(SHIFTED) or key.split(".")[1].endswith("norm_embedding")
        norm = norm or key in ("mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")
        weights[key] = value + 1.0 if (shift_heads and norm) else value
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst


def mtp_logits(model, tokens):
    seq = mx.array(tokens)[None]
    h = model.hidden(seq)[:, :-1]
    return np.array(model.logits(model.mtp_forward(0, h, seq[:, 1:])))


@pytest.mark.parametrize("family", HYBRID)
def test_converted_checkpoint_is_not_shifted_again(family, checkpoint, tmp_path):
    src = checkpoint(family, predictable=True)
    tokens = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31]
    raw_model = load_model(str(src))[0]
    expected = mtp_logits(raw_model, tokens)
    converted = load_model(str(mlx_conversion(src, tmp_path / "mlx")))[0]
    np.testing.assert_allclose(mtp_logits(converted, tokens), expected, atol=1e-4)
    # The head norms of the converted copy hold 1 + w; had the loader added 1 again,
    # its output would differ as much as this deliberately double-shifted copy does.
    doubled = mlx_conversion(src, tmp_path / "doubled")
    weights = mx.load(str(doubled / "model.safetensors"))
    weights = {
        k: v + 1.0 if k.startswith("mtp.") and k.endswith("norm.weight") else v
        for k, v in weights.items()
    }
    mx.save_safetensors(str(doubled / "model.safetensors"), weights)
    wrong = mtp_logits(load_model(str(doubled))[0], tokens)
    assert np.abs(wrong - expected).max() > 0.5
    assert (wrong.argmax(-1) != expected.argmax(-1)).any()


@pytest.mark.parametrize("family", HYBRID)
def test_raw_heads_are_shifted_once(family, checkpoint):
    """The loaded head norms are the file's values + 1, and no more."""
    src = checkpoint(family, predictable=True)
    raw = mx.load(str(src / "model.safetensors"))
    layer = load_model(str(src))[0].mtp.layers[0]
    pairs = [
        (layer.enorm.weight, "mtp.pre_fc_norm_embedding.weight"),
        (layer.hnorm.weight, "mtp.pre_fc_norm_hidden.weight"),
        (layer.norm.weight, "mtp.norm.weight"),
        (layer.block.input_layernorm.weight, "mtp.layers.0.input_layernorm.weight"),
        (layer.block.self_attn.q_norm.weight, "mtp.layers.0.self_attn.q_norm.weight"),
    ]
    for loaded_weight, name in pairs:
        np.testing.assert_allclose(np.array(loaded_weight), np.array(raw[name] + 1.0))


# --- the same mechanism on a Mamba-2 hybrid (mlx-lm's nemotron_h trunk) ------------


@pytest.fixture(scope="module")
def nemotron_h():
    """A tiny random Nemotron-H trunk (Mamba-2, attention, MLP blocks), float32."""
    from mlx_lm.models import nemotron_h as lm

    from mlx_mtp.models.capture import install_capture

    mx.random.seed(3)
    args = lm.ModelArgs(
        model_type="nemotron_h",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=False,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_proj_bias=False,
        ssm_state_size=16,
        conv_kernel=4,
        n_groups=2,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        hybrid_override_pattern="M*M-M",
        time_step_limit=(0.0, float("inf")),
    )
    model = lm.Model(args)
    model.set_dtype(mx.float32)
    install_capture(model.layers)
    return model


@pytest.mark.parametrize("n", (0, 1, 3))
def test_mamba2_rollback_on_nemotron_h(nemotron_h, n):
    from mlx_mtp.cache import with_recurrent_caches

    def caches_after(tokens, extra=None, drop=0):
        caches = with_recurrent_caches(nemotron_h.make_cache())
        nemotron_h(mx.array(tokens)[None], caches)
        if extra:
            mx.eval([c.state for c in caches])
            marks = begin_verify(caches)
            nemotron_h(mx.array(extra)[None], caches)
            rewind(caches, marks, drop)
        return caches

    prompt, extra = [5, 17, 99, 3, 64, 8, 21], [40, 2, 77, 120]
    ours = caches_after(prompt, extra, n)
    fresh = caches_after(prompt + extra[: len(extra) - n])
    assert any(isinstance(c, RecurrentCache) for c in ours)
    for a, b in zip(ours, fresh):
        assert_same_cache(a, b)

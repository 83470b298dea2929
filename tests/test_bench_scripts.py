"""The batch and server benchmarks parse their arguments, and the synthetic-model
builder's Qwen3.5 layout loads in both loaders with its heads agreeing by construction,
its DeepSeek-V4 layout in mlx-mtp's (how it lands on an acceptance is the llama test's,
in test_bench.py: the same code)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlx_mtp.loading import load_model
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS
from mlx_mtp.testing.fixtures import write_tokenizer

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize(
    "script, option", [("batch_bench.py", "--batch"), ("serve_bench.py", "--max-batch")]
)
def test_benchmark_scripts_parse_their_arguments(script, option):
    """--help answers without loading a model; a bad value is one usage error."""
    run = [sys.executable, str(SCRIPTS / script)]
    ok = subprocess.run(run + ["--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and option in ok.stdout
    bad = subprocess.run(
        run + ["--model", "x", option, "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "at least 1" in bad.stderr.splitlines()[-1]


def test_synthetic_qwen3_5_loads_in_both_loaders(tmp_path, monkeypatch):
    """A hybrid Qwen3.5 trunk (Gated-DeltaNet and full attention) with its MTP layer:
    mlx-lm loads the trunk (dropping ``mtp.*``) with mlx-mtp's logits, and at gamma 0
    the head drafts the trunk's next-but-one token."""
    from mlx_lm import load as lm_load

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import make_synthetic_model as syn

    arch = syn.ARCHS["qwen3_5"]
    config = syn.qwen3_5_config(1e6, 512, 64)
    text = config["text_config"]
    assert set(text["layer_types"]) == {"linear_attention", "full_attention"}
    w = syn.build_weights(arch, config, seed=0)[0]
    syn.set_gamma(arch, w, config, 0.0)
    w.pop("_noise")
    assert any(k.startswith("mtp.layers.0.self_attn.") for k in w)
    write_tokenizer(tmp_path, 512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)

    model = load_model(str(tmp_path))[0]
    trunk = lm_load(str(tmp_path))[0]
    assert model.num_mtp_layers == 1
    prompt = np.random.default_rng(0).integers(0, 512, 12).tolist()
    ours = model.logits(model.hidden(mx.array(prompt)[None]))
    assert mx.allclose(ours, trunk(mx.array(prompt)[None]), atol=1e-4)
    outs = list(
        mtp_generate_step(prompt, model, HEADS, num_draft_tokens=1, max_tokens=24)
    )
    plain = [t for t, _ in generate_step(mx.array(prompt), trunk, max_tokens=24)]
    assert [o.token for o in outs] == plain
    assert outs[-1].stats.acceptance_rate > 0.8


def test_synthetic_deepseek_v4_is_the_release_layout(tmp_path, monkeypatch):
    """V4-Flash's release layout from the fixture builder at the script's shapes:
    DeepSeek's names with ``e_proj`` and ``h_proj`` apart, window, CSA and HCA layers,
    hash routing; at gamma 0 the head drafts the trunk's next-but-one token, and
    drafting decodes token for token as plain decoding."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import make_synthetic_model as syn

    arch = syn.ARCHS["deepseek_v4"]
    config = syn.deepseek_v4_config(7e5, 512, 64)  # 4 layers
    ratios = config["compress_ratios"]
    assert ratios[:4] == [0, 0, 4, 16] and ratios[-1] == 0
    assert len(ratios) == config["num_hidden_layers"] + 1
    w = syn.build_weights(arch, config, seed=0)[0]
    syn.set_gamma(arch, w, config, 0.0)
    w.pop("_noise")
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "head.weight"} <= set(w)
    assert "layers.0.ffn.gate.tid2eid" in w and "mtp.0.ffn.gate.bias" in w
    write_tokenizer(tmp_path, 512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)

    model = load_model(str(tmp_path))[0]
    assert model.num_mtp_layers == 1
    prompt = np.random.default_rng(0).integers(0, 512, 12).tolist()
    outs = list(
        mtp_generate_step(prompt, model, HEADS, num_draft_tokens=1, max_tokens=24)
    )
    plain = mtp_generate_step(prompt, model, HEADS, num_draft_tokens=0, max_tokens=24)
    assert [o.token for o in outs] == [o.token for o in plain]
    assert outs[-1].stats.acceptance_rate > 0.8


def test_synthetic_qwen4_exp_is_the_release_layout(tmp_path, monkeypatch):
    """Qwen3.8-Flash-Next's release layout from the fixture builder at the script's
    shapes: top-level ``mtp.*`` with ``fc_embedding`` and ``fc_hidden`` apart,
    zero-centred MTP norms, the MTP's mixer the trunk's; at gamma 0 the head drafts
    the trunk's next-but-one token, and drafting decodes as plain decoding does."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import make_synthetic_model as syn

    arch = syn.ARCHS["qwen4_exp"]
    config = syn.qwen4_exp_config(2e6, 512, 128)
    text = config["text_config"]
    assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    w = syn.build_weights(arch, config, seed=0)[0]
    syn.set_gamma(arch, w, config, 0.0)
    w.pop("_noise")
    assert {"mtp.fc_embedding.weight", "mtp.fc_hidden.weight"} <= set(w)
    assert not mx.any(w["mtp.pre_fc_norm_hidden.weight"]).item()
    write_tokenizer(tmp_path, 512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), w)

    model = load_model(str(tmp_path))[0]
    prompt = np.random.default_rng(0).integers(0, 500, 12).tolist()
    outs = list(
        mtp_generate_step(prompt, model, HEADS, num_draft_tokens=1, max_tokens=24)
    )
    plain = mtp_generate_step(prompt, model, HEADS, num_draft_tokens=0, max_tokens=24)
    assert [o.token for o in outs] == [o.token for o in plain]
    assert outs[-1].stats.acceptance_rate > 0.8

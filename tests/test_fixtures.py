"""Tiny HF-layout checkpoints: load with plain mlx-lm, tokenizer, names and shapes."""

import json
import pathlib
import runpy
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, load_tokenizer

from mlx_mtp.models import get_family
from mlx_mtp.testing.fixtures import FAMILIES, write_checkpoint

H = 64
V = 512

# Where the families of the name and shape tests below keep their MTP tensors
# (official HF names); the others' are checked against real releases
# (tests/golden, tests/test_golden_layouts.py).
MTP_PREFIX = {
    "deepseek_v3": ("model.layers.3.",),
    "glm4_moe": ("model.layers.2.",),
    "glm4_moe_lite": ("model.layers.3.",),
    "mimo": ("model.mtp_layers.0.", "model.mtp_layers.1."),
}
ORIGINAL = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo")
QWEN = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
NEXTN_FUSION = {
    "enorm.weight": (H,),
    "hnorm.weight": (H,),
    "eh_proj.weight": (H, 2 * H),
    "shared_head.norm.weight": (H,),
    "shared_head.head.weight": (V, H),
    "embed_tokens.weight": (V, H),
}
MIMO_FUSION = {
    "token_layernorm.weight": (H,),
    "hidden_layernorm.weight": (H,),
    "input_proj.weight": (H, 2 * H),
    "final_layernorm.weight": (H,),
}
MLA_SHAPES = {
    "self_attn.q_a_proj.weight": (32, H),
    "self_attn.q_a_layernorm.weight": (32,),
    "self_attn.q_b_proj.weight": (4 * 24, 32),
    "self_attn.kv_a_proj_with_mqa.weight": (24, H),
    "self_attn.kv_a_layernorm.weight": (16,),
    "self_attn.kv_b_proj.weight": (4 * 32, 16),
    "self_attn.o_proj.weight": (H, 64),
}
GLM_ATTN_SHAPES = {
    "self_attn.q_proj.weight": (64, H),
    "self_attn.q_proj.bias": (64,),
    "self_attn.k_proj.weight": (32, H),
    "self_attn.k_proj.bias": (32,),
    "self_attn.v_proj.weight": (32, H),
    "self_attn.v_proj.bias": (32,),
    "self_attn.o_proj.weight": (H, 64),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
}
MOE_SHAPES = {
    "mlp.gate.weight": (4, H),
    "mlp.gate.e_score_correction_bias": (4,),
    **{
        f"mlp.experts.{e}.{p}.weight": s
        for e in range(4)
        for p, s in (
            ("gate_proj", (32, H)),
            ("up_proj", (32, H)),
            ("down_proj", (H, 32)),
        )
    },
    "mlp.shared_experts.gate_proj.weight": (32, H),
    "mlp.shared_experts.up_proj.weight": (32, H),
    "mlp.shared_experts.down_proj.weight": (H, 32),
}
# (projection, embedding norm, final norm) rewired by predictable=True.
PREDICTABLE_NAMES = {
    "deepseek_v3": ("eh_proj.weight", "enorm.weight", "shared_head.norm.weight"),
    "glm4_moe": ("eh_proj.weight", "enorm.weight", "shared_head.norm.weight"),
    "glm4_moe_lite": ("eh_proj.weight", "enorm.weight", "shared_head.norm.weight"),
    "mimo": ("input_proj.weight", "token_layernorm.weight", "final_layernorm.weight"),
}


def _weights(path: pathlib.Path) -> dict:
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _is_mtp(family: str, key: str) -> bool:
    return key.startswith(MTP_PREFIX[family])


def _strip_mtp(family: str, src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Copy of ``src`` without MTP tensors (plain mlx-lm only drops layer 61), as the
    family's split finds them."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    layer_of = get_family(config).mtp_layer_of
    trunk = {k: v for k, v in _weights(src).items() if layer_of(k, config) is None}
    mx.save_safetensors(str(dst / "model.safetensors"), trunk, {"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixtures")
    return {
        (fam, pred): write_checkpoint(fam, root / f"{fam}-{pred}", predictable=pred)
        for fam in FAMILIES
        for pred in (False, True)
    }


@pytest.mark.parametrize("predictable", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_loads_with_plain_mlx_lm(checkpoints, tmp_path, family, predictable):
    path = _strip_mtp(family, checkpoints[family, predictable], tmp_path / "trunk")
    own = get_family({"model_type": family}).trunk_classes  # mlx-lm has none (V4)
    extra = {"get_model_classes": own} if own else {}
    model, config = load_model(path, **extra)  # strict: every parameter is present
    assert config["model_type"] == family
    logits = model(mx.array([[1, 2, 3, 4, 5]]))
    assert logits.shape == (1, 5, V)
    assert bool(mx.all(mx.isfinite(logits)))
    assert float(mx.std(logits[0, -1])) > 0.3  # not degenerate


@pytest.mark.parametrize(
    "family",
    [
        "bailing_hybrid",
        "bailing_moe_v3",
        "ernie4_5_moe",
        "exaone_moe",
        "glm4_moe",
        "longcat_flash",
        "mimo",
        "mimo_v2_flash",
        "nemotron_h",
        "step3p5",
        *QWEN,
    ],
)
def test_mlx_lm_sanitize_drops_mtp_itself(checkpoints, family):
    model, _ = load_model(checkpoints[family, False])
    assert model(mx.array([[7, 8]])).shape == (1, 2, V)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips(checkpoints, family):
    path = checkpoints[family, False]
    tok = load_tokenizer(path)
    config = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    texts = ["Hello world!", "def add(a, b):\n    return a + b\n", "héllo ✓ 日本"]
    for text in texts:
        ids = tok.encode(text)
        assert max(ids) < V
        assert tok.decode(ids) == text
    assert len(tok._tokenizer) <= V
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == config["eos_token_id"] == config["bos_token_id"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    if family == "glm_ocr":  # GLM's own chat tokens, and its reply ends at <|user|>
        user = tok.convert_tokens_to_ids("<|user|>")
        assert gen["eos_token_id"] == [config["eos_token_id"], user]
        assert chat == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
        assert tok.encode(chat)[0] == tok.convert_tokens_to_ids("[gMASK]")
        image = tok.convert_tokens_to_ids("<|image|>")
        assert tok.encode("a<|image|>b").count(image) == 1
        assert config["image_token_id"] == image
        return
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert gen["eos_token_id"] == [config["eos_token_id"], im_end]
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_start|>")[-1] == tok.convert_tokens_to_ids("<|im_start|>")


def _expected_mtp_shapes(family: str) -> dict:
    if family == "mimo":
        layer = {
            "input_layernorm.weight": (H,),
            "post_attention_layernorm.weight": (H,),
            **{k: v for k, v in GLM_ATTN_SHAPES.items() if "_norm" not in k},
            "mlp.gate_proj.weight": (128, H),
            "mlp.up_proj.weight": (128, H),
            "mlp.down_proj.weight": (H, 128),
        }
        return {
            p + k: s
            for p in MTP_PREFIX[family]
            for k, s in {**MIMO_FUSION, **layer}.items()
        }
    attn = GLM_ATTN_SHAPES if family == "glm4_moe" else MLA_SHAPES
    layer = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        **attn,
        **MOE_SHAPES,
    }
    (prefix,) = MTP_PREFIX[family]
    return {prefix + k: s for k, s in {**NEXTN_FUSION, **layer}.items()}


@pytest.mark.parametrize("family", ORIGINAL)
def test_mtp_tensor_names_and_shapes(checkpoints, family):
    weights = _weights(checkpoints[family, False])
    mtp = {k: tuple(v.shape) for k, v in weights.items() if _is_mtp(family, k)}
    assert mtp == _expected_mtp_shapes(family)
    assert weights["model.embed_tokens.weight"].shape == (V, H)
    assert weights["lm_head.weight"].shape == (V, H)
    if family != "mimo":
        (prefix,) = MTP_PREFIX[family]
        head, embed = (
            weights[prefix + "shared_head.head.weight"],
            weights[prefix + "embed_tokens.weight"],
        )
        assert mx.array_equal(head, weights["lm_head.weight"])
        assert mx.array_equal(embed, weights["model.embed_tokens.weight"])
        assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (128, H)
        assert weights["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (4,)


@pytest.mark.parametrize("family", ORIGINAL)
def test_config_keys(checkpoints, family):
    config = json.loads((checkpoints[family, False] / "config.json").read_text())
    arch = {
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
        "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    }
    assert config["architectures"] == [arch.get(family, "MiMoForCausalLM")]
    assert config["hidden_size"] == H and config["vocab_size"] == V
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    layers = {"deepseek_v3": (3, 1), "glm4_moe": (2, 1), "mimo": (2, 2)}
    layers = {**layers, "glm4_moe_lite": (3, 1)}[family]
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == layers
    tok_cfg = json.loads(
        (checkpoints[family, False] / "tokenizer_config.json").read_text()
    )
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tok_cfg["chat_template"]


@pytest.mark.parametrize("family", ORIGINAL)
def test_predictable_construction(checkpoints, family):
    w = {k: np.array(v) for k, v in _weights(checkpoints[family, True]).items()}
    base = {k: np.array(v) for k, v in _weights(checkpoints[family, False]).items()}
    np.testing.assert_allclose(
        w["model.embed_tokens.weight"],
        30 * base["model.embed_tokens.weight"],
        rtol=1e-6,
    )
    proj, enorm, final = PREDICTABLE_NAMES[family]
    for prefix in MTP_PREFIX[family]:
        p = w[prefix + proj]
        eye = p[:, H:] if family == "mimo" else p[:, :H]
        np.testing.assert_array_equal(eye, np.eye(H))
        np.testing.assert_array_equal(w[prefix + enorm], np.ones(H))
        np.testing.assert_array_equal(w[prefix + final], w["model.norm.weight"])
        o = prefix + "self_attn.o_proj.weight"
        np.testing.assert_allclose(w[o], 0.2 * base[o], rtol=1e-6)
        if family != "mimo":
            np.testing.assert_array_equal(
                w[prefix + "embed_tokens.weight"], w["model.embed_tokens.weight"]
            )


def test_deterministic_and_seeded(tmp_path):
    a = write_checkpoint("glm4_moe", tmp_path / "a", seed=3)
    b = write_checkpoint("glm4_moe", tmp_path / "b", seed=3)
    c = write_checkpoint("glm4_moe", tmp_path / "c", seed=4)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (
        c / "model.safetensors"
    ).read_bytes()


def test_sharded_index_puts_mtp_last(tmp_path):
    path = write_checkpoint(
        "deepseek_v3", tmp_path / "ds", num_shards=3, dtype="bfloat16"
    )
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weights = _weights(path)
    assert set(weight_map) == set(weights)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in weights.values())
    for key, shard in weight_map.items():
        assert set(mx.load(str(path / shard))) >= {key}
        if _is_mtp("deepseek_v3", key):
            assert shard == shards[-1]
    assert weights["lm_head.weight"].dtype == mx.bfloat16
    assert (
        weights["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    )
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sharded_checkpoint_loads_with_plain_mlx_lm(tmp_path):
    path = write_checkpoint("mimo", tmp_path / "mimo", num_shards=2)
    model, _ = load_model(path)
    assert model(mx.array([[1, 2]])).shape == (1, 2, V)


def test_cli_script(tmp_path, monkeypatch, capsys):
    script = (
        pathlib.Path(__file__).resolve().parents[1]
        / "scripts"
        / "make_tiny_checkpoint.py"
    )
    out = tmp_path / "cli"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            str(script),
            "mimo",
            str(out),
            "--predictable",
            "--seed",
            "2",
            "--shards",
            "2",
        ],
    )
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors.index.json").exists()


QWEN_ATTN = {
    "self_attn.q_proj.weight": (128, H),  # query and gate
    "self_attn.k_proj.weight": (32, H),
    "self_attn.v_proj.weight": (32, H),
    "self_attn.o_proj.weight": (H, 64),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
}


def _qwen_mtp_shapes(family: str) -> dict:
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        **{"mtp.layers.0." + k: v for k, v in QWEN_ATTN.items()},
    }
    if family == "qwen3_5":
        mlp = {"gate_proj": (128, H), "up_proj": (128, H), "down_proj": (H, 128)}
        shapes.update({f"mtp.layers.0.mlp.{p}.weight": s for p, s in mlp.items()})
        return shapes
    expert = {"gate_proj": (32, H), "up_proj": (32, H), "down_proj": (H, 32)}
    shared = {"gate_proj": (64, H), "up_proj": (64, H), "down_proj": (H, 64)}
    prefix = "mtp.layers.0.mlp."
    shapes[prefix + "gate.weight"] = (4, H)
    shapes[prefix + "shared_expert_gate.weight"] = (1, H)
    shapes.update({f"{prefix}shared_expert.{p}.weight": s for p, s in shared.items()})
    for e in range(4):
        shapes.update({f"{prefix}experts.{e}.{p}.weight": s for p, s in expert.items()})
    return shapes


@pytest.mark.parametrize("family", QWEN)
def test_qwen_names_shapes_and_config(checkpoints, family):
    path = checkpoints[family, False]
    weights = _weights(path)
    mtp = {k: tuple(v.shape) for k, v in weights.items() if k.startswith("mtp.")}
    assert mtp == _qwen_mtp_shapes(family)
    config = json.loads((path / "config.json").read_text())
    base = "model." if family == "qwen3_next" else "model.language_model."
    assert weights[base + "embed_tokens.weight"].shape == (V, H)
    assert weights["lm_head.weight"].shape == (V, H)
    gdn = base + "layers.0.linear_attn."
    assert weights[gdn + "conv1d.weight"].shape == (128, 1, 4)  # HF (C, 1, K)
    assert weights[base + "layers.3.self_attn.q_proj.weight"].shape == (128, H)
    if family == "qwen3_next":
        assert weights[gdn + "in_proj_qkvz.weight"].shape == (192, H)
        assert config["num_nextn_predict_layers"] == 1
        assert "text_config" not in config
        assert base + "layers.0.mlp.experts.3.down_proj.weight" in weights
    else:
        assert weights[gdn + "in_proj_qkv.weight"].shape == (128, H)
        text = config["text_config"]
        assert text["mtp_num_hidden_layers"] == 1
        assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]
        assert text["layer_types"][-1] == "full_attention"
    if family == "qwen3_5_moe":  # trunk experts fused, MTP experts per expert
        assert weights[base + "layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, H)
    # (1 + w) norms are stored zero-centred; the Gated-DeltaNet norm is not
    assert abs(float(weights[base + "norm.weight"].mean())) < 0.1
    assert abs(float(weights["mtp.norm.weight"].mean())) < 0.1
    assert abs(float(weights[gdn + "norm.weight"].mean()) - 1) < 0.1


@pytest.mark.parametrize("family", QWEN)
def test_qwen_predictable_construction(checkpoints, family):
    w = {k: np.array(v) for k, v in _weights(checkpoints[family, True]).items()}
    base = {k: np.array(v) for k, v in _weights(checkpoints[family, False]).items()}
    prefix = "model." if family == "qwen3_next" else "model.language_model."
    embed = prefix + "embed_tokens.weight"
    np.testing.assert_allclose(w[embed], 30 * base[embed], rtol=1e-6)
    np.testing.assert_array_equal(w["mtp.fc.weight"][:, :H], np.eye(H))
    np.testing.assert_array_equal(w["mtp.pre_fc_norm_embedding.weight"], np.zeros(H))
    np.testing.assert_array_equal(w["mtp.norm.weight"], w[prefix + "norm.weight"])
    o = "mtp.layers.0.self_attn.o_proj.weight"
    np.testing.assert_allclose(w[o], 0.2 * base[o], rtol=1e-6)


def _nemotron_block_shapes(kind: str) -> dict:
    if kind == "*":
        mixer = {"q_proj": (64, H), "k_proj": (32, H), "v_proj": (32, H)}
        mixer = {f"{k}.weight": v for k, v in mixer.items()}
        mixer["o_proj.weight"] = (H, 64)
    else:  # E: latent MoE (latent 32, expert width 32, shared expert 64)
        mixer = {
            "gate.weight": (4, H),
            "gate.e_score_correction_bias": (4,),
            "fc1_latent_proj.weight": (32, H),
            "fc2_latent_proj.weight": (H, 32),
            "shared_experts.up_proj.weight": (64, H),
            "shared_experts.down_proj.weight": (H, 64),
        }
        for e in range(4):
            mixer[f"experts.{e}.up_proj.weight"] = (32, 32)
            mixer[f"experts.{e}.down_proj.weight"] = (32, 32)
    return {"norm.weight": (H,), **{f"mixer.{k}": v for k, v in mixer.items()}}


def test_nemotron_h_names_shapes_and_config(checkpoints):
    path = checkpoints["nemotron_h", False]
    weights = _weights(path)
    mtp = {k: tuple(v.shape) for k, v in weights.items() if k.startswith("mtp.")}
    expected = {
        "mtp.layers.0.enorm.weight": (H,),
        "mtp.layers.0.hnorm.weight": (H,),
        "mtp.layers.0.eh_proj.weight": (H, 2 * H),
        "mtp.layers.1.final_layernorm.weight": (H,),
    }
    for s, kind in enumerate("*E"):
        expected.update(
            {f"mtp.layers.{s}.{k}": v for k, v in _nemotron_block_shapes(kind).items()}
        )
    assert mtp == expected
    assert weights["backbone.embeddings.weight"].shape == (V, H)
    assert weights["lm_head.weight"].shape == (V, H)
    mamba = "backbone.layers.0.mixer."
    assert weights[mamba + "in_proj.weight"].shape == (128 + 192 + 8, H)
    assert weights[mamba + "conv1d.weight"].shape == (192, 1, 4)  # HF (C, 1, K)
    assert weights["backbone.layers.3.mixer.up_proj.weight"].shape == (128, H)
    config = json.loads((path / "config.json").read_text())
    assert config["hybrid_override_pattern"] == "M*E-M"
    assert config["mtp_hybrid_override_pattern"] == "*E"
    assert config["num_nextn_predict_layers"] == 1
    assert config["architectures"] == ["NemotronHForCausalLM"]


def test_nemotron_h_predictable_construction(checkpoints):
    w = {k: np.array(v) for k, v in _weights(checkpoints["nemotron_h", True]).items()}
    base = {
        k: np.array(v) for k, v in _weights(checkpoints["nemotron_h", False]).items()
    }
    embed = "backbone.embeddings.weight"
    np.testing.assert_allclose(w[embed], 30 * base[embed], rtol=1e-6)
    np.testing.assert_array_equal(w["mtp.layers.0.eh_proj.weight"][:, :H], np.eye(H))
    np.testing.assert_array_equal(w["mtp.layers.0.enorm.weight"], np.ones(H))
    np.testing.assert_array_equal(
        w["mtp.layers.1.final_layernorm.weight"], w["backbone.norm_f.weight"]
    )
    for key in (
        "mtp.layers.0.mixer.o_proj.weight",
        "mtp.layers.1.mixer.experts.2.down_proj.weight",
    ):
        np.testing.assert_allclose(w[key], 0.2 * base[key], rtol=1e-6)


def test_step3p5_names_shapes_and_config(checkpoints):
    path = checkpoints["step3p5", False]
    weights = _weights(path)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["num_nextn_predict_layers"] == 2
    assert len(config["layer_types"]) == len(config["rope_theta"]) == 5  # padded
    assert config["layer_types"][3:] == ["sliding_attention", "full_attention"]
    for i, heads in ((3, 6), (4, 4)):  # sliding layers have more heads
        prefix = f"model.layers.{i}."
        assert weights[prefix + "eh_proj.weight"].shape == (H, 2 * H)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            assert weights[f"{prefix}{name}.weight"].shape == (H,)
        assert mx.array_equal(
            weights[prefix + "shared_head.output.weight"], weights["lm_head.weight"]
        )
        block = prefix + "transformer."
        assert weights[block + "self_attn.q_proj.weight"].shape == (heads * 16, H)
        assert weights[block + "self_attn.g_proj.weight"].shape == (heads, H)
        assert weights[block + "mlp.gate_proj.weight"].shape == (128, H)  # dense
    assert weights["model.layers.1.moe.gate_proj.weight"].shape == (4, 32, H)
    assert weights["model.layers.1.moe.router_bias"].dtype == mx.float32
    assert weights["model.layers.2.share_expert.up_proj.weight"].shape == (32, H)
    assert abs(float(weights["model.layers.4.enorm.weight"].mean())) < 0.1  # (1 + w)


def test_mimo_v2_flash_names_shapes_and_config(checkpoints):
    path = checkpoints["mimo_v2_flash", False]
    weights = _weights(path)
    config = json.loads((path / "config.json").read_text())
    assert not any("nextn" in k or "mtp" in k for k in config)  # not counted
    layer = {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (4 * 24, H),
        "self_attn.k_proj.weight": (4 * 24, H),
        "self_attn.v_proj.weight": (4 * 16, H),
        "self_attn.o_proj.weight": (H, 4 * 16),
        "self_attn.attention_sink_bias": (4,),
        "pre_mlp_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (128, H),
        "mlp.up_proj.weight": (128, H),
        "mlp.down_proj.weight": (H, 128),
        "final_layernorm.weight": (H,),
    }
    mtp = {k: tuple(v.shape) for k, v in weights.items() if k.startswith("model.mtp.")}
    assert mtp == {
        f"model.mtp.layers.{j}.{k}": s for j in range(2) for k, s in layer.items()
    }
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 24, H)
    assert "model.layers.0.self_attn.attention_sink_bias" not in weights  # full layer
    assert weights["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (H, 32)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indexer_names_shapes_and_config(checkpoints, family):
    weights = _weights(checkpoints[family, False])
    config = json.loads((checkpoints[family, False] / "config.json").read_text())
    assert (config["index_topk"], config["index_n_heads"]) == (4, 8)
    for layer in range(4):  # the trunk's three and the MTP layer
        prefix = f"model.layers.{layer}.self_attn.indexer."
        assert weights[prefix + "wq_b.weight"].shape == (8 * 16, 32)
        assert weights[prefix + "wk.weight"].shape == (16, H)
        assert weights[prefix + "k_norm.bias"].shape == (16,)
        assert weights[prefix + "weights_proj.weight"].shape == (8, H)
    assert weights["model.layers.3.eh_proj.weight"].shape == (H, 2 * H)
    if family == "glm_moe_dsa":
        assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"]


def test_ernie_names_and_the_trunk_norm(checkpoints):
    """ERNIE's MTP tensors carry the layer index after the part's name, and the step
    has no final norm of its own: loading closes it with the trunk's."""
    from mlx_mtp import load

    path = checkpoints["ernie4_5_moe", False]
    weights = _weights(path)
    mtp = sorted({k.rsplit(".", 1)[0] for k in weights if k.startswith("model.mtp_")})
    assert mtp[:3] == [
        "model.mtp_block.0.input_layernorm",
        "model.mtp_block.0.mlp.down_proj",
        "model.mtp_block.0.mlp.gate_proj",
    ]
    assert weights["model.mtp_linear_proj.0.weight"].shape == (H, 2 * H)
    assert not any("norm" in k and "mtp" in k and "final" in k for k in weights)
    model, _ = load(str(path))
    assert mx.array_equal(model.mtp.layers[0].norm.weight, weights["model.norm.weight"])

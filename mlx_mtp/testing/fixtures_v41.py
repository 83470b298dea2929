"""A tiny DeepSeek-V4.1 checkpoint in the released layout, with a DSpark drafter.

``write_deepseek_v41(out_dir)`` writes a complete, offline folder: ``config.json`` as
V4.1 releases nest it (``model_type`` ``deepseek_v41``, the text model under
``text_config``, ``num_nextn_predict_layers`` 3 and the ``dspark_*`` keys),
``model.safetensors`` with DeepSeek's own tensor names (``embed``, ``head``, ``norm``,
``layers.{i}.attn.*``, ``ffn.*``, ``hc_attn_*``, ``hc_ffn_*``: the names mlx-lm's
``deepseek_v41`` sanitize renames), and the fixture tokenizer.

The trunk is mlx-lm's ``deepseek_v41`` model at tiny sizes (hidden 64, five layers as
the release mixes them: a sliding-window one; two of ratio 2, the first compressing and
indexing, the second reusing both; two of ratio 1, the first compressing, indexing and
picking the candidate blocks, the second indexing its keys among them), random
weights. Beside it sit a few recognisable tensors of V4.1's DSpark block drafter
(``mtp.{0,1,2}.*``: ``main_proj``, ``main_norm``, the stages' attention, ``hc_head_*``,
the Markov and confidence heads), random too: mlx-mtp must refuse them, never draft
with them. Not in `mlx_mtp.testing.fixtures`' families: the generic suites would
expect drafting.
"""

from __future__ import annotations

import pathlib
import re

import mlx.core as mx

from .fixtures import (
    _generation_config,
    _special_token_ids,
    _token_id_config,
    _write_json,
    write_tokenizer,
)

VOCAB = 512
HIDDEN = 64
LAYERS = 5
HC = 4
DSPARK_STAGES = 3
MARKOV_RANK = 8


def text_config() -> dict:
    """The tiny text config, with V4.1's key names (``text_config`` of the
    release)."""
    return {
        "model_type": "deepseek_v41_text",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 32,
        "o_lora_rank": 16,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        # One entry per layer, then the drafter's three stages (as released).
        "compress_ratios": [0, 2, 2, 1, 1] + [0] * DSPARK_STAGES,
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 4],
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 4,
        "hc_eps": 1e-6,
        "engram_layer_ids": [],
        "num_nextn_predict_layers": DSPARK_STAGES,
        "dspark_block_size": 5,
        "dspark_noise_token_id": VOCAB - 4,
        "dspark_target_layer_ids": [2, 3, 4],
        "dspark_markov_rank": MARKOV_RANK,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    }


# MLX name -> DeepSeek name, undoing mlx-lm's `deepseek_v41._rename` (applied in this
# order; `write_deepseek_v41` checks that `_rename` maps every name back).
_UNRENAME = (
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    (".shared_experts.gate_proj.", ".shared_experts.w1."),
    (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".compressor.kv_norm.", ".compressor.norm."),
    (".indexer.k_proj.", ".indexer.wk."),
    (".gate.e_score_correction_bias", ".gate.bias"),
)
_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\.switch_mlp\.(\w+)_proj\.weight"
_EXPERT_NAMES = {"gate": "w1", "down": "w2", "up": "w3"}


def _release_name(name: str) -> str:
    """The DeepSeek checkpoint name of an MLX parameter name."""
    if name == "lm_head.weight":
        return "head.weight"
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    name = name.removeprefix("model.")
    for mlx_part, release_part in _UNRENAME:
        name = name.replace(mlx_part, release_part)
    return name


def release_tensors(params: dict, o_groups: int) -> dict:
    """mlx-lm ``deepseek_v41`` parameters (MLX names) under their released names:
    routed experts one by one, ``wo_a`` as one block-diagonal matrix.

    Raises:
        AssertionError: mlx-lm's ``_rename`` does not map a name back.
    """
    from mlx_lm.models.deepseek_v41 import _rename

    out = {}
    for name, value in params.items():
        expert = re.fullmatch(_EXPERTS, name)
        if expert is not None:
            layer, proj = expert.groups()
            for e in range(value.shape[0]):
                w = _EXPERT_NAMES[proj]
                out[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = value[e]
            continue
        release = _release_name(name)
        assert _rename(release) == name, (name, release, _rename(release))
        if name.endswith(".o_a_proj.weight"):
            value = value.reshape(-1, value.shape[-1])
        out[release] = value
    return out


def _random(params: dict, seed: int) -> dict:
    """Random weights in the parameters' shapes: norms near one, the rest normal
    (std 0.1; the embedding std 1, so that the hyper-connection streams differ)."""
    keys = mx.random.split(mx.random.key(seed), len(params))
    out = {}
    for key, (name, value) in zip(keys, sorted(params.items())):
        noise = mx.random.normal(value.shape, key=key)
        if "norm" in name or name.endswith(".scale"):
            out[name] = 1.0 + 0.05 * noise
        elif name == "model.embed_tokens.weight":
            out[name] = noise
        else:
            out[name] = 0.1 * noise
    return out


def dspark_tensors(config: dict, seed: int) -> dict:
    """A few tensors of each DSpark stage ``mtp.{j}``, with their released names and
    shapes (hidden H, vocabulary V, Markov rank R): ``mtp.0.main_proj`` (H, 3H) and
    ``main_norm`` fuse the target layers' hidden states; every stage has its norms,
    hyper-connections, attention and router; ``mtp.2`` closes with ``norm``,
    ``hc_head_*``, the Markov head (``markov_w1``, ``markov_w2``: V x R) and the
    confidence head (1, H + R)."""
    H, V, R = HIDDEN, config["vocab_size"], MARKOV_RANK
    targets = len(config["dspark_target_layer_ids"])
    mix = (2 + HC) * HC
    shapes = {
        "mtp.0.main_proj.weight": (H, targets * H),
        "mtp.0.main_norm.weight": (H,),
    }
    for j in range(DSPARK_STAGES):
        p = f"mtp.{j}."
        shapes.update(
            {
                p + "attn_norm.weight": (H,),
                p + "ffn_norm.weight": (H,),
                p + "hc_attn_fn": (mix, HC * H),
                p + "hc_attn_base": (mix,),
                p + "hc_attn_scale": (3,),
                p + "attn.wq_a.weight": (config["q_lora_rank"], H),
                p + "attn.wkv.weight": (config["head_dim"], H),
                p + "attn.attn_sink": (config["num_attention_heads"],),
                p + "ffn.gate.weight": (config["dspark_n_routed_experts"], H),
            }
        )
    shapes.update(
        {
            "mtp.2.norm.weight": (H,),
            "mtp.2.hc_head_fn": (HC, HC * H),
            "mtp.2.hc_head_base": (HC,),
            "mtp.2.hc_head_scale": (1,),
            "mtp.2.markov_head.markov_w1.weight": (V, R),
            "mtp.2.markov_head.markov_w2.weight": (V, R),
            "mtp.2.confidence_head.proj.weight": (1, H + R),
        }
    )
    keys = mx.random.split(mx.random.key(seed + 1), len(shapes))
    return {
        name: 0.1 * mx.random.normal(shape, key=key)
        for key, (name, shape) in zip(keys, shapes.items())
    }


def write_deepseek_v41(
    out_dir, *, seed: int = 0, drafter: bool = True, **text
) -> pathlib.Path:
    """Write the tiny V4.1 checkpoint into ``out_dir`` and return its path.

    Args:
        seed: The weights' seed (same seed, same bytes).
        drafter: Write the DSpark ``mtp.*`` tensors (False: the trunk only, as an
            mlx-lm conversion keeps it).
        text: Overrides of `text_config` values (``engram_layer_ids=[1]``, say).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v41 as lm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, VOCAB)
    ids = _special_token_ids(VOCAB)
    cfg = {**text_config(), **text}
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "torch_dtype": "float32",
        **_token_id_config(ids),
        "text_config": cfg,
    }
    clean = {**cfg, "engram_layer_ids": []}
    args = lm.ModelArgs.from_dict({**config, "text_config": clean})
    params = dict(tree_flatten(lm.Model(args).parameters()))
    weights = release_tensors(_random(params, seed), args.o_groups)
    if drafter:
        weights.update(dspark_tensors(cfg, seed))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(ids))
    return out

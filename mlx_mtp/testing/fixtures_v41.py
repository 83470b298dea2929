"""A tiny DeepSeek-V4.1 checkpoint in the released layout, with its DSpark drafter.

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
weights. Beside it sit the three stages of V4.1's DSpark block drafter in the
released layout (``/work/notes/dspark_spec.md`` §1b, §6B): each stage ``mtp.{j}.*`` a
window-only block under the trunk layers' names (norms, hyper-connections,
attention with its sink, the router and the ``dspark_n_routed_experts`` experts, the
shared expert); ``mtp.0.main_proj`` / ``main_norm``; the last stage's ``norm``,
``markov_head.embed`` / ``markov_head.head`` and ``confidence_head.proj``. No
``hc_head_*`` and no ``markov_w1`` / ``markov_w2``: those are DeepSeek-V4-Flash-0731's
DSpark names. ``predictable=True`` makes a pair whose drafter often agrees with its
trunk (`_following_drafter`, `_walking_trunk`). Not in `mlx_mtp.testing.fixtures`'
families: the generic suites draft with MTP heads.
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
MARKOV_RANK = 32  # room for 512 distinct successors (predictable=True)
# predictable=True: the embedding's scale (it dominates the streams), the Markov
# head's scale (its bias is about MARKOV_SCALE**2 for the successor it carries) and
# the damping of the block's own logits
EMBED_STD = 4.0
MARKOV_SCALE = 6.0
BLOCK_DAMPING = 0.02


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


def stage_args(args, cfg: dict):
    """mlx-lm ``deepseek_v41`` args for the DSpark stages: the trunk's with the
    ``dspark_*`` expert counts."""
    from dataclasses import replace

    return replace(
        args,
        n_routed_experts=cfg["dspark_n_routed_experts"],
        num_experts_per_tok=cfg["dspark_num_experts_per_tok"],
    )


def dspark_params(args, cfg: dict, seed: int) -> dict:
    """Random DSpark stage tensors, MLX names (stage j as ``model.layers.{L + j}``,
    a window-only mlx-lm ``deepseek_v41`` decoder layer with the stages' expert
    counts), and the drafter's own under ``own.*``: ``main_proj`` (H, n H),
    ``main_norm``, ``norm``, the Markov head (V x R each) and the confidence head
    (1, H + R), all drawn as `_random` draws."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v41 as lm

    H, V, R = args.hidden_size, args.vocab_size, cfg["dspark_markov_rank"]
    n, L = len(cfg["dspark_target_layer_ids"]), args.num_hidden_layers
    shapes = {}
    for j in range(cfg["num_nextn_predict_layers"]):
        layer = lm.DecoderLayer(stage_args(args, cfg), L + j)
        for name, value in tree_flatten(layer.parameters()):
            shapes[f"model.layers.{L + j}.{name}"] = value
    own = {
        "main_proj.weight": (H, n * H),
        "main_norm.weight": (H,),
        "norm.weight": (H,),
        "markov_head.embed.weight": (V, R),
        "markov_head.head.weight": (V, R),
        "confidence_head.proj.weight": (1, H + R),
    }
    shapes.update({f"own.{k}": mx.zeros(v) for k, v in own.items()})
    return _random(shapes, seed + 1)


def dspark_tensors(params: dict, cfg: dict) -> dict:
    """`dspark_params` under their released names (spec §1b): every stage's block
    tensors as the trunk's layers name theirs, under ``mtp.{j}.``; ``main_proj``
    and ``main_norm`` in ``mtp.0``; ``norm``, ``markov_head.embed`` /
    ``markov_head.head`` and ``confidence_head.proj`` (no bias) in the last stage.
    No ``hc_head_*``: that is DeepSeek-V4-Flash-0731's DSpark, not V4.1's."""
    L, last = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] - 1
    stages = {k: v for k, v in params.items() if not k.startswith("own.")}
    out = {}
    for name, value in release_tensors(stages, cfg["o_groups"]).items():
        j, rest = name[len("layers.") :].split(".", 1)
        out[f"mtp.{int(j) - L}.{rest}"] = value
    for name, value in params.items():
        if name.startswith("own."):
            stage = 0 if name.startswith("own.main_") else last
            out[f"mtp.{stage}.{name[len('own.'):]}"] = value
    return out


def _walking_trunk(params: dict, V: int, rng) -> None:
    """Make the trunk mostly walk a random permutation pi: its embedding (std
    `EMBED_STD`) dominates the streams, and row pi(u) of the untied head is u's
    embedding. ``params`` (MLX names) is changed in place."""
    import numpy as np

    embed = params["model.embed_tokens.weight"] * EMBED_STD
    params["model.embed_tokens.weight"] = embed
    params["lm_head.weight"] = embed[mx.array(np.argsort(rng.permutation(V)))]


def _following_drafter(params: dict, drafter: dict, args, agree: float, rng) -> None:
    """Give the drafter's Markov head the trunk's greedy bigram f (its argmax after
    the one-token prompt u) for a share ``agree`` of the tokens, a random successor
    for the rest, strongly enough to outweigh the block's own logits (the last
    stage's ``norm`` damped); as `mlx_mtp.testing.dspark` does for Qwen3.
    ``drafter`` is changed in place."""
    import numpy as np
    from mlx_lm.models import deepseek_v41 as lm

    V, R = args.vocab_size, drafter["own.markov_head.embed.weight"].shape[1]
    trunk = lm.Model(args)
    trunk.load_weights(list(params.items()))
    f = np.array(mx.argmax(trunk(mx.arange(V)[:, None])[:, -1], axis=-1))
    follow = np.where(rng.random(V) < agree, f, rng.integers(0, V, V))
    w1 = rng.standard_normal((V, R)).astype(np.float32)
    w1 /= np.linalg.norm(w1, axis=1, keepdims=True)
    w2 = np.zeros_like(w1)
    np.add.at(w2, follow, w1)  # W2[v] . W1[u] is largest where v = follow(u)
    drafter["own.markov_head.embed.weight"] = mx.array(MARKOV_SCALE * w1)
    drafter["own.markov_head.head.weight"] = mx.array(MARKOV_SCALE * w2)
    drafter["own.norm.weight"] = drafter["own.norm.weight"] * BLOCK_DAMPING


# The drafter's tensors the V4.1 release stores in FP8 (e4m3, ue8m0 scales per 32x32
# block: the reference's default ``Linear`` dtype) and in FP4 (the routed experts);
# ``wo_a`` is bfloat16 there, the router, norms and heads float.
_RELEASE_FP8 = re.compile(
    r"^mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.w[123]"
    r"|main_proj)\.weight$"
)
_RELEASE_FP4 = re.compile(r"^mtp\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
RELEASE_FP8_BLOCK = (32, 32)


def release_drafter(weights: dict) -> dict:
    """``weights`` (float, released names) as numpy, the drafter's FP8 and FP4
    tensors in the release's dtypes with their ``.scale`` beside them
    (`mlx_mtp.testing.deepseek_v4_release`'s encoders)."""
    import numpy as np

    from .deepseek_v4_release import quantize_fp4_np, quantize_fp8_np

    out = {}
    for name, value in weights.items():
        value = np.array(value, dtype=np.float32)
        base = name[: -len(".weight")]
        if _RELEASE_FP8.match(name):
            out[name], out[base + ".scale"] = quantize_fp8_np(value, RELEASE_FP8_BLOCK)
        elif _RELEASE_FP4.match(name):
            out[name], out[base + ".scale"] = quantize_fp4_np(value)
        else:
            out[name] = value
    return out


def write_deepseek_v41(
    out_dir,
    *,
    seed: int = 0,
    drafter: bool = True,
    predictable: bool = False,
    walk: bool = True,
    agree: float = 0.9,
    release: bool = False,
    **text,
) -> pathlib.Path:
    """Write the tiny V4.1 checkpoint into ``out_dir`` and return its path.

    Args:
        seed: The weights' seed (same seed, same bytes).
        drafter: Write the DSpark ``mtp.*`` tensors (False: the trunk only, as an
            mlx-lm conversion keeps it).
        predictable: A drafter that often agrees with its trunk
            (`_following_drafter`: ``agree`` is the share of tokens whose Markov
            successor is the trunk's) and, with ``walk``, a trunk that mostly walks
            a permutation (`_walking_trunk`; without, its distributions stay spread,
            as sampling tests need).
        release: The drafter's tensors in the release's FP8 / FP4 dtypes
            (`release_drafter`; the trunk's stay float32).
        text: Overrides of `text_config` values (``engram_layer_ids=[1]``,
            ``vocab_size=16``, say). Below `VOCAB` tokens the folder has no
            tokenizer, and the noise token is the vocabulary's last.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v41 as lm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**text_config(), **text}
    config = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "torch_dtype": "float32",
    }
    if cfg["vocab_size"] >= VOCAB:
        write_tokenizer(out, VOCAB)
        ids = _special_token_ids(VOCAB)
        config.update(_token_id_config(ids))
        _write_json(out / "generation_config.json", _generation_config(ids))
    else:
        cfg.setdefault("dspark_noise_token_id", cfg["vocab_size"] - 1)
        cfg["dspark_noise_token_id"] = min(
            cfg["dspark_noise_token_id"], cfg["vocab_size"] - 1
        )
    config["text_config"] = cfg
    clean = {**cfg, "engram_layer_ids": []}
    args = lm.ModelArgs.from_dict({**config, "text_config": clean})
    params = _random(dict(tree_flatten(lm.Model(args).parameters())), seed)
    stages = dspark_params(args, cfg, seed)
    if predictable:
        import numpy as np

        rng = np.random.default_rng(seed)
        if walk:
            _walking_trunk(params, args.vocab_size, rng)
        _following_drafter(params, stages, args, agree, rng)
    weights = release_tensors(params, args.o_groups)
    if drafter:
        weights.update(dspark_tensors(stages, cfg))
    mx.eval(weights)
    path = out / "model.safetensors"
    if release:
        from .deepseek_v4_release import write_release_safetensors

        write_release_safetensors(path, release_drafter(weights))
    else:
        mx.save_safetensors(str(path), weights, {"format": "pt"})
    _write_json(out / "config.json", config)
    return out

"""Tiny Gemma 4 pairs in the released Hugging Face layouts: a target and its assistant.

Targets (``Gemma4ForConditionalGeneration``: ``model.language_model.*``, a vision tower
that loading drops, ``text_config`` and ``vision_config``):

- ``"e2b"``: the E2B/E4B shape: sliding and full layers (window ``sliding_window``),
  the last ``num_kv_shared_layers`` layers KV-shared (their files still carry
  ``k_proj``/``v_proj``/``k_norm``, as the real ones do), per-layer inputs, double-wide
  MLPs on the shared layers, soft-capped logits;
- ``"dense"``: the 31B shape: no sharing, no per-layer inputs, full layers with
  ``attention_k_eq_v`` and their own number of key/value heads.

Assistants (``Gemma4AssistantForCausalLM``): four KV-shared layers ``[sliding x 3,
full]``, ``pre_projection`` / ``post_projection``, a tied head, and with
``centroids=True`` the E2B/E4B centroid head (``masked_embedding.centroids``,
``masked_embedding.token_ordering``).

``predictable=True`` makes a pair whose assistant often agrees with its target: the
target's embedding dominates its residual stream, so with its tied head it mostly
repeats the current token, breaking off where its attention and MLPs (``weight_std``)
win; the assistant's head and ``pre_projection`` are built from the target's
embedding so that it predicts "the current token again". Acceptance then depends on
``weight_std``: every round type (all, some, none accepted) occurs.
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from .fixtures import CHAT_TEMPLATE, _special_token_ids, write_tokenizer

VOCAB = 512
HIDDEN = 64
ASSISTANT_HIDDEN = 32
ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}

# Block-output scales at which a predictable pair accepts all, some and none of the
# drafts in a mix (k = 3: about half the first drafts accepted).
DAMPING = {"e2b": 1.5, "dense": 3.0}

Tensors = Dict[str, np.ndarray]


def target_text_config(kind: str, sliding_window: int, vocab_size: int = VOCAB) -> dict:
    """The ``text_config`` of a tiny target of shape ``kind`` ("e2b" or "dense")."""
    common = {
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 16,
        "global_head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_parameters": ROPE,
        "sliding_window": sliding_window,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    s, f = "sliding_attention", "full_attention"
    if kind == "e2b":
        return {
            **common,
            "num_hidden_layers": 7,
            "num_key_value_heads": 1,
            "layer_types": [s, s, f, s, s, s, f],
            "num_kv_shared_layers": 3,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": vocab_size,
            "use_double_wide_mlp": True,
            "attention_k_eq_v": False,
            "enable_moe_block": False,
        }
    if kind == "dense":
        return {
            **common,
            "num_hidden_layers": 6,
            "num_key_value_heads": 2,
            "num_global_key_value_heads": 1,
            "layer_types": [s, s, f, s, s, f],
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "attention_k_eq_v": True,
            "enable_moe_block": False,
        }
    raise ValueError(f"unknown Gemma 4 fixture kind {kind!r}")


def assistant_text_config(target: dict) -> dict:
    """The ``text_config`` of a tiny assistant for a target's text config."""
    s, f = "sliding_attention", "full_attention"
    shared = {
        k: target[k]
        for k in ("head_dim", "global_head_dim", "sliding_window", "vocab_size")
    }
    config = {
        "model_type": "gemma4_text",
        "hidden_size": ASSISTANT_HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": target["num_key_value_heads"],
        "layer_types": [s, s, s, f],
        "num_kv_shared_layers": 4,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "final_logit_softcapping": None,
        "attention_k_eq_v": target["attention_k_eq_v"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": ROPE,
        "max_position_embeddings": target["max_position_embeddings"],
        "tie_word_embeddings": True,
        **shared,
    }
    if target.get("num_global_key_value_heads"):
        config["num_global_key_value_heads"] = target["num_global_key_value_heads"]
    return config


class _Init:
    def __init__(self, seed: int, std: float):
        self.rng, self.std = np.random.default_rng(seed), std

    def normal(self, *shape, std: Optional[float] = None) -> np.ndarray:
        std = self.std if std is None else std
        return (std * self.rng.standard_normal(shape)).astype(np.float32)

    def norm(self, dim: int) -> np.ndarray:
        return 1.0 + self.normal(dim, std=0.05)


def _layer(init: _Init, p: str, cfg: dict, i: int) -> Tensors:
    """One Gemma 4 decoder layer's tensors (Hugging Face names under ``p``)."""
    H, kind = cfg["hidden_size"], cfg["layer_types"][i]
    full = kind == "full_attention"
    hd = cfg["global_head_dim"] if full else cfg["head_dim"]
    k_eq_v = cfg.get("attention_k_eq_v") and full
    kv = cfg["num_key_value_heads"]
    if k_eq_v and cfg.get("num_global_key_value_heads"):
        kv = cfg["num_global_key_value_heads"]
    first_shared = cfg["num_hidden_layers"] - cfg.get("num_kv_shared_layers", 0)
    wide = cfg.get("use_double_wide_mlp") and i >= first_shared > 0
    inter = cfg["intermediate_size"] * (2 if wide else 1)
    nh = cfg["num_attention_heads"]
    t = {
        f"{p}input_layernorm.weight": init.norm(H),
        f"{p}post_attention_layernorm.weight": init.norm(H),
        f"{p}pre_feedforward_layernorm.weight": init.norm(H),
        f"{p}post_feedforward_layernorm.weight": init.norm(H),
        f"{p}self_attn.q_proj.weight": init.normal(nh * hd, H),
        f"{p}self_attn.o_proj.weight": init.normal(H, nh * hd),
        f"{p}self_attn.q_norm.weight": init.norm(hd),
        f"{p}mlp.gate_proj.weight": init.normal(inter, H),
        f"{p}mlp.up_proj.weight": init.normal(inter, H),
        f"{p}mlp.down_proj.weight": init.normal(H, inter),
        f"{p}layer_scalar": np.array([0.5 + 0.5 * init.rng.random()], np.float32),
    }
    # every layer has K/V projections in the released files, KV-shared ones too
    t[f"{p}self_attn.k_proj.weight"] = init.normal(kv * hd, H)
    t[f"{p}self_attn.k_norm.weight"] = init.norm(hd)
    if not k_eq_v:
        t[f"{p}self_attn.v_proj.weight"] = init.normal(kv * hd, H)
    P = cfg.get("hidden_size_per_layer_input") or 0
    if P:
        t[f"{p}per_layer_input_gate.weight"] = init.normal(P, H)
        t[f"{p}per_layer_projection.weight"] = init.normal(H, P)
        t[f"{p}post_per_layer_input_norm.weight"] = init.norm(H)
    return t


# Gemma 4's image markers (begin, placeholder, end), as its tokenizer spells them.
VISION_TOKENS = ("<|image>", "<|image|>", "<image|>")
# ChatML, with image parts as Gemma 4's template writes them: one ``<|image|>`` per
# image (the processor wraps and repeats it).
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The release's processor settings (16-pixel patches pooled 3 x 3), with a budget of
# 16 features per image (the release allows 280).
VISION_PROCESSOR = {
    "processor_class": "Gemma4Processor",
    "image_processor": {
        "image_processor_type": "Gemma4ImageProcessor",
        "do_convert_rgb": True,
        "do_normalize": False,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "max_soft_tokens": 16,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "rescale_factor": 1 / 255,
        "resample": 3,
    },
    "image_seq_length": 16,
}


def vision_config(width: int = 32, layers: int = 2) -> dict:
    """A tiny ``vision_config`` with the release's keys (its tower is 1152 wide, 27
    layers of 16 heads of 72)."""
    return {
        "model_type": "gemma4_vision",
        "hidden_size": width,
        "intermediate_size": 2 * width,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": width // 2,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 64,
        "default_output_length": 16,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "use_clipped_linears": False,
        "standardize": False,
    }


def _vision_tensors(init: _Init, cfg: dict, text_hidden: int) -> Tensors:
    """The vision tower under ``model.vision_tower.`` and its projector under
    ``model.embed_vision.`` (transformers' ``Gemma4VisionModel`` and
    ``Gemma4MultimodalEmbedder`` names: clippable linears hold ``.linear``)."""
    p, W = "model.vision_tower.", cfg["hidden_size"]
    heads, hd, inner = (
        cfg["num_attention_heads"],
        cfg["head_dim"],
        cfg["intermediate_size"],
    )
    t = {
        f"{p}patch_embedder.input_proj.weight": init.normal(W, 3 * 16 * 16, std=0.05),
        f"{p}patch_embedder.position_embedding_table": init.normal(
            2, cfg["position_embedding_size"], W, std=0.3
        ),
    }
    for i in range(cfg["num_hidden_layers"]):
        b = f"{p}encoder.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (heads * hd, W)),
            ("self_attn.k_proj", (cfg["num_key_value_heads"] * hd, W)),
            ("self_attn.v_proj", (cfg["num_key_value_heads"] * hd, W)),
            ("self_attn.o_proj", (W, heads * hd)),
            ("mlp.gate_proj", (inner, W)),
            ("mlp.up_proj", (inner, W)),
            ("mlp.down_proj", (W, inner)),
        ):
            t[f"{b}{name}.linear.weight"] = init.normal(*shape, std=W**-0.5)
        t[f"{b}self_attn.q_norm.weight"] = init.norm(hd)
        t[f"{b}self_attn.k_norm.weight"] = init.norm(hd)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[f"{b}{norm}.weight"] = init.norm(W)
    t["model.embed_vision.embedding_projection.weight"] = init.normal(
        text_hidden, W, std=W**-0.5
    )
    return t


def _target_tensors(cfg: dict, seed: int, std: float, embed_std: float) -> Tensors:
    init = _Init(seed, std)
    p = "model.language_model."
    H, V, N = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    t = {f"{p}embed_tokens.weight": init.normal(V, H, std=embed_std)}
    for i in range(N):
        t.update(_layer(init, f"{p}layers.{i}.", cfg, i))
    t[f"{p}norm.weight"] = init.norm(H)
    P = cfg.get("hidden_size_per_layer_input") or 0
    if P:
        t[f"{p}embed_tokens_per_layer.weight"] = init.normal(
            cfg["vocab_size_per_layer_input"], N * P
        )
        t[f"{p}per_layer_model_projection.weight"] = init.normal(N * P, H)
        t[f"{p}per_layer_projection_norm.weight"] = init.norm(P)
    return t


def write_gemma4(
    out_dir,
    kind: str = "e2b",
    *,
    seed: int = 0,
    sliding_window: int = 8,
    predictable: bool = False,
    weight_std: float = 0.1,
    damping: Optional[float] = None,
    vocab_size: int = VOCAB,
    layer_types: Optional[list] = None,
    vision: bool = False,
    bidirectional: Optional[bool] = None,
) -> pathlib.Path:
    """A tiny Gemma 4 target (``kind`` "e2b" or "dense", see the module docstring).
    ``damping`` scales the blocks' output norms of a predictable target (default:
    the kind's, which gives rounds of every kind with a predictable assistant).

    Its vision tower is a placeholder that loading drops, or with ``vision`` a real
    one (`vision_config`, `VISION_TOKENS`, `VISION_PROCESSOR`), its images open
    both ways in the sliding layers (``use_bidirectional_attention: "vision"``)
    for ``bidirectional`` (default: the dense kind, as the 31B release)."""
    text = target_text_config(kind, sliding_window, vocab_size)
    if layer_types is not None:  # a target of another layout, for refusals
        text["layer_types"] = list(layer_types)
    if bidirectional is None:
        bidirectional = kind == "dense"
    if vision and bidirectional:
        text["use_bidirectional_attention"] = "vision"
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 8,
            "num_hidden_layers": 1,
        },
        "audio_config": None,
        "image_token_id": vocab_size - 4,
        "tie_word_embeddings": True,
        "eos_token_id": [vocab_size - 3, vocab_size - 1],
        "pad_token_id": vocab_size - 3,
        "bos_token_id": vocab_size - 3,
    }
    embed_std = 1.0 if predictable else 0.5
    tensors = _target_tensors(text, seed, weight_std, embed_std)
    if predictable:
        damp(tensors, damping or DAMPING[kind])
    if not vision:  # the multimodal parts mlx-lm's text model drops
        init = _Init(seed + 7, weight_std)
        tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = init.normal(
            16, 8
        )
        tensors["model.embed_vision.embedding_projection.weight"] = init.normal(
            text["hidden_size"], 8
        )
        return _write(out_dir, config, tensors)
    config["vision_config"] = vision_config()
    tensors.update(
        _vision_tensors(
            _Init(seed + 7, 0.1), config["vision_config"], text["hidden_size"]
        )
    )
    ids = _special_token_ids(VOCAB, VISION_TOKENS)
    boi, image, eoi = (ids[t] for t in VISION_TOKENS)
    eos, end = ids["<|endoftext|>"], ids["<|im_end|>"]
    config.update(
        image_token_id=image,
        boi_token_id=boi,
        eoi_token_id=eoi,
        eos_token_id=[eos, end],
        pad_token_id=eos,
        bos_token_id=eos,
    )
    out = _write(out_dir, config, tensors, VISION_TOKENS, VISION_CHAT_TEMPLATE)
    (out / "processor_config.json").write_text(json.dumps(VISION_PROCESSOR, indent=2))
    path = out / "tokenizer_config.json"  # the tokenizer's names for its image tokens
    settings = json.loads(path.read_text())
    settings["extra_special_tokens"] = dict(
        zip(("boi_token", "image_token", "eoi_token"), VISION_TOKENS)
    )
    path.write_text(json.dumps(settings, indent=2))
    return out


def write_gemma4_assistant(
    out_dir,
    target_dir,
    *,
    centroids: bool = False,
    seed: int = 1,
    predictable: bool = False,
    weight_std: float = 0.1,
    num_centroids: int = 16,
    top_k: int = 4,
    embed_std: float = 0.5,
) -> pathlib.Path:
    """A tiny assistant for the target in ``target_dir`` (see the module docstring);
    ``embed_std`` sets the scale of its logits."""
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    t_text = target["text_config"]
    text = assistant_text_config(t_text)
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": t_text["hidden_size"],
        "use_ordered_embeddings": centroids,
        "num_centroids": num_centroids,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "text_config": text,
    }
    init = _Init(seed, weight_std)
    H, Hd, V = t_text["hidden_size"], text["hidden_size"], text["vocab_size"]
    t = {"model.embed_tokens.weight": init.normal(V, Hd, std=embed_std)}
    for i in range(text["num_hidden_layers"]):
        t.update(_layer(init, f"model.layers.{i}.", text, i))
    t["model.norm.weight"] = init.norm(Hd)
    t["pre_projection.weight"] = init.normal(Hd, 2 * H, std=0.2)
    t["post_projection.weight"] = init.normal(H, Hd, std=0.2)
    if predictable:
        _copying(t, target_dir, init, H)
    if centroids:
        order = init.rng.permutation(V).astype(np.int64)
        if predictable:  # clusters of similar head rows: the chosen ones hold t
            table = t["model.embed_tokens.weight"]
            _, _, vt = np.linalg.svd(table - table.mean(0), full_matrices=False)
            angle = np.arctan2(table @ vt[1], table @ vt[0])
            order = np.argsort(angle, kind="stable").astype(np.int64)
        t["masked_embedding.token_ordering"] = order
        table = t["model.embed_tokens.weight"][order].reshape(num_centroids, -1, Hd)
        t["masked_embedding.centroids.weight"] = table.mean(axis=1) * 4
    out = _write(out_dir, config, t)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = pathlib.Path(target_dir) / name  # the target's (image tokens too)
        if source.exists():
            (out / name).write_bytes(source.read_bytes())
    return out


def _copying(t: Tensors, target_dir, init: _Init, H: int) -> None:
    """Make the assistant predict the current token: ``pre_projection`` reads the
    embedding half through a random map A, and the tied head's row v is A e_v."""
    weights = mx.load(str(pathlib.Path(target_dir) / "model.safetensors"))
    E = np.array(weights["model.language_model.embed_tokens.weight"], np.float32)
    Hd = t["pre_projection.weight"].shape[0]
    A = init.normal(Hd, H, std=1.0 / np.sqrt(H))
    pre = np.zeros((Hd, 2 * H), np.float32)
    pre[:, :H] = A / np.sqrt(H)  # the embedding comes scaled by sqrt(H)
    pre[:, H:] = init.normal(Hd, H, std=0.02)
    t["pre_projection.weight"] = pre
    t["model.embed_tokens.weight"] = (E @ A.T).astype(np.float32)
    damp(t, 0.05)


def damp(t: Tensors, scale: float) -> None:
    """Scale the norms of the blocks' outputs (Gemma normalizes each block output, so
    this is where a block's share of the residual stream is set)."""
    for key in list(t):
        if key.endswith(
            ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
        ):
            t[key] = t[key] * scale


def _write(
    out_dir, config: dict, tensors: Tensors, extra=(), template=CHAT_TEMPLATE
) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = (config.get("text_config") or config)["vocab_size"]
    if vocab_size >= VOCAB:  # smaller ones are for tests that need no tokenizer
        write_tokenizer(out, VOCAB, extra, template)
    arrays = {k: mx.array(v) for k, v in tensors.items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out

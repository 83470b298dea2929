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

from .fixtures import write_tokenizer

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
    # the multimodal parts mlx-lm's text model drops
    t["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = init.normal(16, 8)
    t["model.embed_vision.embedding_projection.weight"] = init.normal(H, 8)
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
) -> pathlib.Path:
    """A tiny Gemma 4 target (``kind`` "e2b" or "dense", see the module docstring).
    ``damping`` scales the blocks' output norms of a predictable target (default:
    the kind's, which gives rounds of every kind with a predictable assistant)."""
    text = target_text_config(kind, sliding_window, vocab_size)
    if layer_types is not None:  # a target of another layout, for refusals
        text["layer_types"] = list(layer_types)
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
    return _write(out_dir, config, tensors)


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
    return _write(out_dir, config, t)


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


def _write(out_dir, config: dict, tensors: Tensors) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = (config.get("text_config") or config)["vocab_size"]
    if vocab_size >= VOCAB:  # smaller ones are for tests that need no tokenizer
        write_tokenizer(out, VOCAB)
    arrays = {k: mx.array(v) for k, v in tensors.items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out

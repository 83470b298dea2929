"""Tiny Qwen3 targets with DSpark drafter folders, in the released layouts
(``/work/notes/dspark_spec.md`` §6A).

- `write_qwen3_target`: a Hugging Face Qwen3 checkpoint (``Qwen3ForCausalLM``, tied
  embeddings, 4 layers, hidden 32, 4/2 heads of 8, no MTP heads; the predictable
  one's head is untied);
- `write_dspark`: a drafter folder for it, ``layout="deepspec"`` as DeepSeek's
  DeepSpec release writes it (the target's config plus the drafter keys at the top
  level, tensors without prefix, ``embed_tokens``/``lm_head`` copies of the
  target's unless ``embeddings=False``), or ``layout="nested"`` as mlx-vlm's
  published configs spell it (``dflash_config`` holding the mask token and the
  tapped layers, ``num_target_layers`` at the top level, tensors under ``model.``,
  no embedding or head). ``markov`` picks DeepSpec's Markov head (``vanilla``,
  ``gated``, ``rnn``); ``confidence_threshold``, when given, is written as the
  config key (mlx-vlm's spelling; the released configs have none).

``predictable=True`` makes a pair whose drafter often agrees with its target. The
target's current-token embedding dominates its residual stream and an untied head maps
it to pi(u) for a random permutation pi, so its text mostly walks pi, breaking off
where its layers win. The drafter's Markov head carries the target's greedy bigram f
(f(u): its argmax after the one-token prompt u) for a share ``agree`` of the tokens (a
random successor for the rest), strongly enough to outweigh the block's own logits,
whose final norm is damped. A block then proposes f(a), f(f(a)), ..., which the
target follows as far as its context lets it: rounds of every kind (all, some, none
accepted) occur. A gated head's gate (about 0.7, varying with the slot's output and
the previous token) scales that bias; an rnn head's output o reads W1[prev] as it
is, so that its bias W2 tanh(o) carries f too, its state and the slot's output
perturbing it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from .fixtures import EOS_TOKEN, write_tokenizer

Tensors = Dict[str, np.ndarray]
TOKENIZER_VOCAB = 512

VOCAB = 64
HIDDEN = 32
LAYERS = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
INTERMEDIATE = 64
BLOCK_SIZE = 4
TARGET_LAYER_IDS = [0, 2]  # never the last layer (3): spec §2.1
MARKOV_RANK = 8
DRAFT_LAYERS = 2
# predictable=True: the Markov head's scale (its bias is about MARKOV_SCALE**2 for
# the successor it carries) and the damping of the block's own logits
MARKOV_SCALE = 6.0
BLOCK_DAMPING = 0.02
RNN_GAIN = 2.0  # an rnn head's bias W2 tanh(o) is weaker than W2 e: made up here


def target_config(vocab_size: int = VOCAB) -> dict:
    """A tiny Qwen3 ``config.json`` (Hugging Face keys)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


class _Init:
    def __init__(self, seed: int, std: float):
        self.rng, self.std = np.random.default_rng(seed), std

    def normal(self, *shape, std=None) -> np.ndarray:
        s = self.std if std is None else std
        return (s * self.rng.standard_normal(shape)).astype(np.float32)

    def norm(self, dim: int) -> np.ndarray:
        return (1.0 + 0.05 * self.rng.standard_normal(dim)).astype(np.float32)


def _layer(init: _Init, p: str, cfg: dict) -> Tensors:
    """One Qwen3 decoder layer's tensors, Hugging Face names under ``p``."""
    H, D, I = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    return {
        f"{p}input_layernorm.weight": init.norm(H),
        f"{p}post_attention_layernorm.weight": init.norm(H),
        f"{p}self_attn.q_proj.weight": init.normal(q, H),
        f"{p}self_attn.k_proj.weight": init.normal(kv, H),
        f"{p}self_attn.v_proj.weight": init.normal(kv, H),
        f"{p}self_attn.o_proj.weight": init.normal(H, q),
        f"{p}self_attn.q_norm.weight": init.norm(D),
        f"{p}self_attn.k_norm.weight": init.norm(D),
        f"{p}mlp.gate_proj.weight": init.normal(I, H),
        f"{p}mlp.up_proj.weight": init.normal(I, H),
        f"{p}mlp.down_proj.weight": init.normal(H, I),
    }


def write_qwen3_target(
    out_dir,
    *,
    seed: int = 0,
    vocab_size: int = VOCAB,
    predictable: bool = False,
    weight_std: Optional[float] = None,
    embed_std: Optional[float] = None,
) -> pathlib.Path:
    """A tiny random Qwen3 target (see the module docstring), with the fixtures'
    tokenizer when ``vocab_size`` is at least `TOKENIZER_VOCAB` tokens (for the
    CLI), else none. ``predictable``: its text mostly walks a random permutation
    pi of the vocabulary (the current token's embedding dominates the residual
    stream, and an untied head maps it to pi of it), breaking off where its
    layers (``weight_std``) win."""
    config = target_config(vocab_size)
    if vocab_size >= TOKENIZER_VOCAB:
        config.update(_tokenizer(pathlib.Path(out_dir)))
    if weight_std is None:
        weight_std = 0.2 if predictable else 0.4
    if embed_std is None:
        embed_std = 4.0 if predictable else 0.3
    init = _Init(seed, weight_std)
    embed = init.normal(vocab_size, HIDDEN, std=embed_std)
    t = {"model.embed_tokens.weight": embed}
    for i in range(LAYERS):
        t.update(_layer(init, f"model.layers.{i}.", config))
    t["model.norm.weight"] = init.norm(HIDDEN)
    if predictable:  # row pi(u) of the head is u's embedding
        config["tie_word_embeddings"] = False
        head = np.empty_like(embed)
        head[init.rng.permutation(vocab_size)] = embed
        t["lm_head.weight"] = head
    return _write(out_dir, config, t)


def _tokenizer(out: pathlib.Path) -> dict:
    """Write the fixtures' tokenizer into ``out``; its end-of-text id as config keys."""
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, TOKENIZER_VOCAB)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    eos = next(t["id"] for t in added if t["content"] == EOS_TOKEN)
    return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}


def write_dspark(
    out_dir,
    target_dir,
    *,
    seed: int = 1,
    layout: str = "deepspec",
    embeddings: bool = True,
    predictable: bool = False,
    agree: float = 0.9,
    block_size: int = BLOCK_SIZE,
    weight_std: float = 0.2,
    markov: str = "vanilla",
    confidence_threshold: Optional[float] = None,
    layers: int = DRAFT_LAYERS,
    markov_rank: int = MARKOV_RANK,
    target_layer_ids: Optional[List[int]] = None,
    successor: Optional[np.ndarray] = None,
) -> pathlib.Path:
    """A DSpark drafter for the target in ``target_dir`` (see the module
    docstring): tiny by default, or of ``layers`` decoder layers of the target's
    shapes, a Markov head of rank ``markov_rank`` and the taps
    ``target_layer_ids``. ``successor`` (predictable only): the target's greedy
    next token after each token, where it is known by construction (else it is
    measured, one pass per token)."""
    if layout not in ("deepspec", "nested"):
        raise ValueError(f"unknown layout {layout!r}")
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    V, H = target["vocab_size"], target["hidden_size"]
    taps = list(TARGET_LAYER_IDS if target_layer_ids is None else target_layer_ids)
    shape = {"layers": layers, "markov_rank": markov_rank, "taps": taps}
    config = _drafter_config(target, layout, block_size, markov, **shape)
    if confidence_threshold is not None:
        config["confidence_threshold"] = confidence_threshold
    init = _Init(seed, weight_std)
    t = {}
    for i in range(layers):
        t.update(_layer(init, f"layers.{i}.", config))
    t["fc.weight"] = init.normal(H, len(taps) * H)
    t["hidden_norm.weight"] = init.norm(H)
    t["norm.weight"] = init.norm(H)
    t["markov_head.markov_w1.weight"] = init.normal(V, markov_rank, std=0.5)
    t["markov_head.markov_w2.weight"] = init.normal(V, markov_rank, std=0.5)
    t.update(_markov_extras(init, markov, H, markov_rank))
    t["confidence_head.proj.weight"] = init.normal(1, H + markov_rank)
    t["confidence_head.proj.bias"] = init.normal(1)
    weights = mx.load(str(pathlib.Path(target_dir) / "model.safetensors"))
    embed = np.array(weights["model.embed_tokens.weight"], np.float32)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    if predictable:
        _predictable(t, target_dir, init, agree, markov, successor)
    if embeddings and layout == "deepspec":
        t["embed_tokens.weight"] = embed
        t["lm_head.weight"] = np.array(head, np.float32)  # the target's head
    if layout == "nested":
        t = {f"model.{k}": v for k, v in t.items()}
    return _write(out_dir, config, t)


def _markov_extras(init: _Init, markov: str, H: int, r: int) -> Tensors:
    """The tensors a ``gated`` or ``rnn`` Markov head of rank ``r`` adds (DeepSpec's
    names and shapes: ``gate_proj`` [r, H + r], ``joint_proj`` [3 r, 2 r + H], with
    biases)."""
    if markov == "gated":
        p = "markov_head.gate_proj."
        return {f"{p}weight": init.normal(r, H + r), f"{p}bias": init.normal(r)}
    if markov == "rnn":
        p = "markov_head.joint_proj."
        return {
            f"{p}weight": init.normal(3 * r, 2 * r + H),
            f"{p}bias": init.normal(3 * r),
        }
    if markov != "vanilla":
        raise ValueError(f"unknown Markov head {markov!r}")
    return {}


def _drafter_config(
    target: dict, layout: str, block_size: int, markov: str, layers, markov_rank, taps
) -> dict:
    """The target's config with the drafter keys (spec §1a), in ``layout``."""
    config = {**target, "num_hidden_layers": layers, "block_size": block_size}
    config.update(
        layer_types=["full_attention"] * layers,
        tie_word_embeddings=False,
        markov_rank=markov_rank,
        markov_head_type=markov,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    taps = {
        "mask_token_id": target["vocab_size"] - 1,
        "target_layer_ids": list(taps),
    }
    if layout == "deepspec":
        config.update(
            architectures=["Qwen3DSparkModel"],
            num_target_layers=target["num_hidden_layers"],
            num_anchors=8,
            **taps,
        )
    else:  # mlx-vlm's published Qwen3.8 spelling
        config.update(
            architectures=["DSparkDraftModel"],
            num_target_layers=target["num_hidden_layers"],
            dflash_config={"projector_type": "dspark", **taps},
        )
    return config


def _predictable(
    t: Tensors, target_dir, init: _Init, agree: float, markov, successor=None
) -> None:
    """Give the Markov head the target's greedy bigram (``successor``, else
    measured) for a share ``agree`` of the previous tokens (random successors for
    the rest), and damp the block's own logits (see the module docstring)."""
    f = successor
    if f is None:
        from mlx_mtp.loading import load_model

        model = load_model(str(target_dir))[0]
        V = model.args.vocab_size
        f = np.array(mx.argmax(model(mx.arange(V)[:, None])[:, -1], axis=-1))
    V, r = len(f), t["markov_head.markov_w1.weight"].shape[1]
    follow = np.where(init.rng.random(V) < agree, f, init.rng.integers(0, V, V))
    w1 = init.normal(V, r, std=1.0)
    w1 /= np.linalg.norm(w1, axis=1, keepdims=True)
    w2 = np.zeros_like(w1)
    np.add.at(w2, follow, w1)  # W2[v] . W1[u] is largest where v = follow(u)
    t["markov_head.markov_w1.weight"] = MARKOV_SCALE * w1
    t["markov_head.markov_w2.weight"] = MARKOV_SCALE * w2
    t["norm.weight"] = t["norm.weight"] * np.float32(BLOCK_DAMPING)
    if markov == "gated":  # a gate about sigmoid(1) on every rank dimension
        t["markov_head.gate_proj.bias"] = np.ones(r, np.float32)
    if markov == "rnn":  # the output gate o reads e = W1[prev] as it is
        joint = t["markov_head.joint_proj.weight"]
        joint[2 * r :, r : 2 * r] = np.eye(r, dtype=np.float32)
        t["markov_head.markov_w2.weight"] *= np.float32(RNN_GAIN)


def write_dflash2(
    out_dir,
    target_dir,
    *,
    seed: int = 1,
    predictable: bool = False,
    agree: float = 0.9,
    block_size: int = BLOCK_SIZE + 1,
    weight_std: float = 0.2,
    layers: int = DRAFT_LAYERS,
    kernel_size: int = 2,
    group_size: int = 8,
    selector_rank: int = MARKOV_RANK,
    top_k: Optional[int] = None,
    target_layer_ids: Optional[List[int]] = None,
    successor: Optional[np.ndarray] = None,
    config: Optional[dict] = None,
    **dflash_keys,
) -> pathlib.Path:
    """A DFlash2 drafter for the target in ``target_dir``, in the released layout
    (z-lab's ``DFlash2DraftModel``: the target's Qwen3 keys with the drafter's
    layer count, ``dflash_config`` holding ``block_size`` (anchor row included),
    the convolutions' and the selector's shapes, the mask token and the taps; bare
    tensor names, the codebooks as bare tables; no embedding or head). ``top_k``:
    the selector's candidates (default: a quarter of the vocabulary; all of it when
    predictable); ``dflash_keys``: more ``dflash_config`` keys
    (``output_multiplier``, ``final_logit_softcapping``, ...).

    ``predictable``: the selector carries the target's greedy bigram (as
    `write_dspark`'s Markov head does) for a share ``agree`` of the tokens, every
    token a candidate; the layers' outputs are damped, so that each mask row's
    output g stays near that of the mask token's embedding alone, g0, and
    ``hidden_projection`` maps g0 to a constant vector. ``config``: another
    spelling of the backbone's keys (`gemma4_dflash_config`'s; ``layers`` and the
    taps then its own)."""
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    text = target.get("text_config") or target
    V, H, r = text["vocab_size"], text["hidden_size"], selector_rank
    top_k = V if predictable else (top_k or V // 4)
    keys = {
        "block_size": block_size,
        "conv_kernel_size": kernel_size,
        "conv_group_size": group_size,
        "selector_rank": r,
        "selector_top_k": top_k,
        **dflash_keys,
    }
    if config is None:
        config = _dflash_config(target, "DFlash2DraftModel", layers, target_layer_ids)
    else:
        config = {**config, "architectures": ["DFlash2DraftModel"]}
    config["dflash_config"].update(keys)
    layers = config["num_hidden_layers"]
    init = _Init(seed, weight_std)
    damp = np.float32(0.05 if predictable else 1.0)
    groups = H // group_size
    t = _dflash_tensors(init, config, damp)
    for i in range(layers):
        p = f"layers.{i}."
        for conv in ("attention_conv", "mlp_conv"):
            base = init.normal(2, kernel_size, H, std=0.3)
            base[:, 0] += 1.0  # near the identity, as trained kernels are
            t[f"{p}{conv}.base_kernel"] = base
            t[f"{p}{conv}.kernel_projection.weight"] = init.normal(
                2 * kernel_size * groups, H, std=weight_std / 2
            )
    t["candidate_selector.predecessor_codebook"] = init.normal(V, r, std=0.5)
    t["candidate_selector.successor_codebook"] = init.normal(V, r, std=0.5)
    t["candidate_selector.hidden_projection.weight"] = init.normal(r, H)
    if predictable:
        mask = config["dflash_config"]["mask_token_id"]
        _predictable_selector(t, target_dir, init, agree, successor, mask)
    return _write(out_dir, config, t)


def write_dflash(
    out_dir,
    target_dir,
    *,
    seed: int = 1,
    block_size: int = BLOCK_SIZE + 1,
    weight_std: float = 0.2,
    layers: int = DRAFT_LAYERS,
    target_layer_ids: Optional[List[int]] = None,
    config: Optional[dict] = None,
    **keys,
) -> pathlib.Path:
    """A random DFlash drafter (z-lab's ``DFlashDraftModel``, as mlx-vlm's
    ``qwen3_dflash`` reads it) for the target in ``target_dir``: the target's Qwen3
    keys with the drafter's layer count and ``block_size`` (anchor row included) at
    the top level, ``dflash_config`` holding the mask token and the taps; bare
    tensor names, no embedding or head. ``keys``: more top-level keys
    (``final_logit_softcapping``, ...); ``config``: another spelling of the keys
    (``layers`` and the taps then its own)."""
    if config is None:
        target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
        config = _dflash_config(target, "DFlashDraftModel", layers, target_layer_ids)
    config.update(block_size=block_size, **keys)
    t = _dflash_tensors(_Init(seed, weight_std), config, np.float32(1.0))
    return _write(out_dir, config, t)


def write_gemma4_dflash(out_dir, target_dir, **options) -> pathlib.Path:
    """A random Gemma 4 DFlash drafter (z-lab's ``gemma-4-*-DFlash``, as mlx-vlm's
    ``gemma4_dflash`` and dflash-mlx read it) for the Gemma 4 target in
    ``target_dir``, its config `gemma4_dflash_config`'s (``options`` of that and
    of `write_dflash`)."""
    shape = {k: options.pop(k) for k in GEMMA4_DFLASH_SHAPE if k in options}
    config = gemma4_dflash_config(target_dir, **shape)
    return write_dflash(out_dir, target_dir, config=config, **options)


GEMMA4_DFLASH_SHAPE = ("layer_types", "sliding_window", "target_layer_ids")


def gemma4_dflash_config(
    target_dir,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window: int = 4,
    target_layer_ids: Optional[List[int]] = None,
) -> dict:
    """A Gemma 4 DFlash-kin drafter's config for the Gemma 4 target in
    ``target_dir``: Qwen3-style layers of the target's widths, sliding and full
    (``layer_types``), ``model_type`` the target's (``gemma4``), Gemma's final soft
    cap, no architecture named and no mask token (Gemma's ``<mask>``, 4, is
    implied); bare tensor names, no embedding or head."""
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    text = target["text_config"]
    config = {k: text[k] for k in QWEN3_KEYS if k in text and k != "hidden_act"}
    config.update(
        model_type="gemma4",
        num_hidden_layers=len(layer_types),
        rope_theta=1000000.0,
        final_logit_softcapping=text["final_logit_softcapping"],
        tie_word_embeddings=True,
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        num_target_layers=text["num_hidden_layers"],
        dflash_config={"target_layer_ids": list(target_layer_ids or TARGET_LAYER_IDS)},
    )
    return config


# the Gemma 4 text keys a Gemma 4 DSpark drafter's config copies from its target's
GEMMA4_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "final_logit_softcapping",
    "hidden_activation",
)


def write_gemma4_dspark(
    out_dir,
    target_dir,
    *,
    seed: int = 1,
    predictable: bool = False,
    agree: float = 0.9,
    block_size: int = BLOCK_SIZE,
    weight_std: float = 0.2,
    layer_types=("full_attention", "full_attention"),
    sliding_window: int = 4,
    markov_rank: int = 64,  # 8 cannot tell 512 tokens' successors apart
) -> pathlib.Path:
    """A Gemma 4 DSpark drafter (``Gemma4DSparkModel``, as mlx-vlm's
    ``gemma4_dspark`` reads the published ones) for the Gemma 4 target in
    ``target_dir``: a ``gemma4_text`` config of the target's widths with DSpark's
    keys at its top level, Gemma 4 layers (``layer_types``: a full layer's heads
    ``global_head_dim`` wide, keys and values one projection), its own embedding
    and head (not the target's), the vanilla Markov head and the confidence
    head; tensors under ``model.``, the heads bare. ``predictable``: the Markov
    head carries the target's greedy bigram for a share ``agree`` of tokens."""
    target = json.loads((pathlib.Path(target_dir) / "config.json").read_text())
    text = target["text_config"]
    V, H = text["vocab_size"], text["hidden_size"]
    config = {k: text[k] for k in GEMMA4_KEYS if k in text}
    config.update(
        architectures=["Gemma4DSparkModel"],
        model_type="gemma4_text",
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        block_size=block_size,
        mask_token_id=4,
        target_layer_ids=list(TARGET_LAYER_IDS),
        num_target_layers=text["num_hidden_layers"],
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    init = _Init(seed, weight_std)
    t = {}
    for i, kind in enumerate(layer_types):
        t.update(_gemma4_layer(init, f"layers.{i}.", config, kind))
    t["fc.weight"] = init.normal(H, len(TARGET_LAYER_IDS) * H)
    t["hidden_norm.weight"] = init.norm(H)
    t["norm.weight"] = init.norm(H)
    t["markov_head.markov_w1.weight"] = init.normal(V, markov_rank, std=0.5)
    t["markov_head.markov_w2.weight"] = init.normal(V, markov_rank, std=0.5)
    t["confidence_head.proj.weight"] = init.normal(1, H + markov_rank)
    t["confidence_head.proj.bias"] = init.normal(1)
    if predictable:
        _predictable(t, target_dir, init, agree, "vanilla")
    heads = {k: v for k, v in t.items() if k.split(".")[0].endswith("_head")}
    t = {f"model.{k}": v for k, v in t.items() if k not in heads}
    t["model.embed_tokens.weight"] = init.normal(V, H, std=0.5)
    t["lm_head.weight"] = init.normal(V, H, std=0.5)
    return _write(out_dir, config, {**t, **heads})


def _gemma4_layer(init: _Init, p: str, cfg: dict, kind: str) -> Tensors:
    """A Gemma 4 drafter layer of ``kind`` (sliding or full attention)."""
    H, F = cfg["hidden_size"], cfg["intermediate_size"]
    full = kind == "full_attention"
    D = cfg["global_head_dim"] if full else cfg["head_dim"]
    shared = full and cfg.get("attention_k_eq_v")
    heads = cfg["num_attention_heads"]
    kv = cfg["num_global_key_value_heads"] if shared else cfg["num_key_value_heads"]
    a = p + "self_attn."
    t = {
        a + "q_proj.weight": init.normal(heads * D, H),
        a + "k_proj.weight": init.normal(kv * D, H),
        a + "o_proj.weight": init.normal(H, heads * D),
        a + "q_norm.weight": init.norm(D),
        a + "k_norm.weight": init.norm(D),
        p + "mlp.gate_proj.weight": init.normal(F, H),
        p + "mlp.up_proj.weight": init.normal(F, H),
        p + "mlp.down_proj.weight": init.normal(H, F),
        p + "layer_scalar": np.ones(1, np.float32),
    }
    if not shared:
        t[a + "v_proj.weight"] = init.normal(kv * D, H)
    for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        t[f"{p}{norm}_layernorm.weight"] = init.norm(H)
    return t


# a DFlash-kin drafter's Qwen3 keys, copied from its target's text config
QWEN3_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "attention_bias",
    "rms_norm_eps",
    "max_position_embeddings",
    "torch_dtype",
)


def _dflash_config(target: dict, architecture: str, layers: int, taps) -> dict:
    """A DFlash-kin drafter's config for the ``target`` config (a Qwen3 one, or a
    Qwen3.5 one's text config): a Qwen3 backbone of the target's widths and
    ``layers`` layers, the taps and the mask token in ``dflash_config``."""
    taps = list(TARGET_LAYER_IDS if taps is None else taps)
    text = target.get("text_config") or target
    config = {k: text[k] for k in QWEN3_KEYS if k in text}
    rope = text.get("rope_theta") or text["rope_parameters"]["rope_theta"]
    config.update(model_type="qwen3", rope_theta=rope, num_hidden_layers=layers)
    config.update(
        architectures=[architecture],
        tie_word_embeddings=False,
        layer_types=["full_attention"] * layers,
        is_causal=False,
        num_target_layers=text["num_hidden_layers"],
        dflash_config={
            "target_layer_ids": taps,
            "mask_token_id": text["vocab_size"] - 1,
        },
    )
    return config


def _dflash_tensors(init: _Init, config: dict, damp) -> Tensors:
    """A DFlash drafter's Qwen3 layers (their outputs scaled by ``damp``), ``fc``
    and norms."""
    H, taps = config["hidden_size"], config["dflash_config"]["target_layer_ids"]
    t = {}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update(_layer(init, p, config))
        t[f"{p}self_attn.o_proj.weight"] *= damp
        t[f"{p}mlp.down_proj.weight"] *= damp
    t["fc.weight"] = init.normal(H, len(taps) * H)
    t["hidden_norm.weight"] = init.norm(H)
    t["norm.weight"] = init.norm(H)
    return t


def _predictable_selector(t: Tensors, target_dir, init: _Init, agree, successor, mask):
    """`write_dflash2`'s predictable selector: the codebooks carry the bigram as
    `_predictable`'s Markov head does, and ``hidden_projection`` sends g0 (the
    final norm of the mask token's embedding) to ones."""
    weights = mx.load(str(pathlib.Path(target_dir) / "model.safetensors"))
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    embed = np.array(weights[name], np.float32)
    markov = {
        "markov_head.markov_w1.weight": t["candidate_selector.predecessor_codebook"],
        "norm.weight": t["norm.weight"],
    }
    _predictable(markov, target_dir, init, agree, "vanilla", successor)
    t["candidate_selector.predecessor_codebook"] = markov[
        "markov_head.markov_w1.weight"
    ]
    t["candidate_selector.successor_codebook"] = markov["markov_head.markov_w2.weight"]
    t["norm.weight"] = markov["norm.weight"]  # damped: the slots' own logits are weak
    m = embed[mask]
    g0 = m / np.sqrt(np.mean(m * m) + 1e-6) * t["norm.weight"]
    r = t["candidate_selector.hidden_projection.weight"].shape[0]
    t["candidate_selector.hidden_projection.weight"] = (
        np.ones((r, 1), np.float32) * g0[None] / np.float32(g0 @ g0)
    )


def _write(out_dir, config: dict, tensors: Tensors) -> pathlib.Path:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: mx.array(v) for k, v in tensors.items()}
    mx.save_safetensors(str(out / "model.safetensors"), arrays, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out

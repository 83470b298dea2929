"""A float32 llama-layout checkpoint whose MTP head is accepted at a chosen rate.

Speed claims need models whose drafts are accepted at a known rate, so that the
runtime's own efficiency (measured speedup / the speedup the acceptance allows) can be
read off independently of head quality. The construction:

- trunk: random llama weights at a real size (--params), embedding scaled so the
  residual stream is dominated by the current token, attention / MLP outputs damped;
  the untied ``lm_head`` maps token x's direction to pi(x), pi one long random cycle,
  so the trunk's greedy next token is pi(x_t) and never loops early. With
  ``--draft-vocab N`` the cycle runs over N tokens only and the other rows of
  ``lm_head`` are zero, so the trunk emits those N tokens (a real model's output mass
  is concentrated likewise) and the heads draft from them alone (FR-Spec style, as
  ``mlx-mtp train-heads`` writes them): a draft step then reads N rows of the head;
- head (DeepSeek-style, ``model.layers.{L}``): ``eh_proj = [I | gamma * R]`` passes the
  next token's embedding through (predicting pi(x_{t+1}) = x_{t+2}) plus noise driven by
  the trunk's hidden state; gamma is set by bisection so that teacher-forced agreement
  on greedy continuations equals --acceptance.

    python scripts/make_synthetic_model.py OUT --acceptance 0.7 [--params 300e6]
        [--draft-vocab 4096]

Without ``--draft-vocab`` the heads are in the Hugging Face layout
(``model.layers.{L}.*``); with it, the folder is an mlx-mtp conversion (trunk in
``model.safetensors``, heads and their draft vocabulary in ``mtp.safetensors``).
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

from mlx_mtp.models.llama import LAYOUT  # noqa: E402  (DeepSeek-style head names)

EMBED_SCALE = 8.0
DAMPING = 0.2


def llama_config(params: float, vocab: int, hidden: int = 1024) -> dict:
    hd = 64
    heads = max(1, hidden // hd)
    kv = max(1, heads // 4)
    inter = 64 * round(2.75 * hidden / 64)
    per_layer = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    layers = max(2, round((params - 2 * vocab * hidden) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "float32",
    }


def build_weights(config: dict, seed: int, cycle: int = 0):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)
    w = {k: v for k, v in tree_flatten(model.parameters())}
    V, H = config["vocab_size"], config["hidden_size"]
    head = LAYOUT.prefix(config, 0)  # the MTP layer's tensors, DeepSeek-style
    embed = mx.random.normal((V, H)) * (EMBED_SCALE / np.sqrt(H))
    w["model.embed_tokens.weight"] = embed
    for k in list(w):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * DAMPING
    order = rng.permutation(V)[: cycle or V]  # the tokens the trunk emits
    inverse = np.zeros(V, dtype=np.int64)  # lm_head row pi(x) = direction of x
    inverse[order] = np.roll(order, 1)  # pi(order[i]) = order[i + 1]
    unit = embed / mx.linalg.norm(embed, axis=-1, keepdims=True)
    emitted = np.zeros((V, 1), dtype=np.float32)
    emitted[order] = 4.0
    w["lm_head.weight"] = unit[mx.array(inverse)] * mx.array(emitted)
    block = dict(tree_flatten(llama.TransformerBlock(args).parameters()))
    for k, v in block.items():
        scale = DAMPING if k.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        w[f"{head}{k}"] = v * scale
    for name in ("enorm", "hnorm"):
        w[f"{head}{LAYOUT.name(name)}.weight"] = mx.ones((H,))
    w[f"{head}{LAYOUT.name('norm')}.weight"] = mx.array(w["model.norm.weight"])
    w["_noise"] = mx.random.normal((H, H)) / np.sqrt(H)
    return w, np.sort(order)


def write_conversion(out: Path, config: dict, w: dict, vocab, info) -> None:
    """Rewrite ``out`` as an mlx-mtp conversion whose heads draft from ``vocab``."""
    from mlx_mtp.heads import HEADS_FILE, heads_section, save_heads
    from mlx_mtp.loading import load_model
    from mlx_mtp.models.mtp import MTPStack

    model = load_model(str(out))[0]
    stack = MTPStack(list(model.mtp.layers), len(vocab))
    stack.draft_vocab = mx.array(vocab, dtype=mx.int32)
    head = LAYOUT.prefix(config, 0)
    trunk = {k: v for k, v in w.items() if not k.startswith(head)}
    mx.save_safetensors(str(out / "model.safetensors"), trunk, {"format": "pt"})
    save_heads(out / HEADS_FILE, stack)
    config = dict(config)
    config["mtp"] = heads_section(stack, None, {"source": None, "synthetic": info})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def set_gamma(w: dict, config: dict, gamma: float) -> None:
    H = w["_noise"].shape[0]
    w[f"{LAYOUT.prefix(config, 0)}{LAYOUT.name('eh_proj')}.weight"] = mx.concatenate(
        [mx.eye(H), gamma * w["_noise"]], axis=1
    )


def agreement(model, features, vocab=None) -> float:
    """Teacher-forced depth-1 agreement of the head with the trunk's greedy tokens
    (drafting from ``vocab`` only, when given)."""
    hits = total = 0
    for seq, h, greedy in features:
        z = model.mtp_forward(0, h[:, :-1], seq[:, 1:])
        logits = model.logits(z)
        if vocab is not None:
            logits = logits[..., vocab]
        pred = mx.argmax(logits, axis=-1)[0]  # row i predicts token i + 2
        if vocab is not None:
            pred = vocab[pred]
        hits += (pred == greedy[1:]).sum().item()
        total += pred.shape[0]
    return hits / total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--params", type=float, default=300e6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-vocab", type=int, default=0, help="tokens the trunk emits (0: all)"
    )
    args = p.parse_args()
    blas = ensure_fast_blas()
    from mlx_lm.generate import generate_step

    from mlx_mtp.loading import load_model
    from mlx_mtp.testing.fixtures import write_tokenizer

    config = llama_config(args.params, args.vocab, args.hidden)
    w, emitted = build_weights(config, args.seed, args.draft_vocab)
    vocab = mx.array(emitted, dtype=mx.int32) if args.draft_vocab else None
    noise = w.pop("_noise")
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out, 512)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))

    def write(gamma):
        w["_noise"] = noise
        set_gamma(w, config, gamma)
        w.pop("_noise")
        mx.save_safetensors(str(args.out / "model.safetensors"), w, {"format": "pt"})
        return load_model(str(args.out))[0]

    model = write(0.0)
    rng = np.random.default_rng(args.seed + 1)
    features = []
    for _ in range(4):  # greedy continuations of random prompts, trunk states fixed
        prompt = rng.integers(0, args.vocab, 8).tolist()
        steps = generate_step(mx.array(prompt), model.trunk, max_tokens=120)
        seq = mx.array(prompt + [int(t) for t, _ in steps])[None]
        h = model.hidden(seq)
        features.append((seq, h, mx.argmax(model.logits(h), axis=-1)[0]))
    layer = model.mtp.layers[0]
    lo, hi = 0.0, 64.0
    for _ in range(14):  # bisection on gamma: agreement falls as gamma grows
        gamma = (lo + hi) / 2
        layer.eh_proj.weight = mx.concatenate(
            [mx.eye(noise.shape[0]), gamma * noise], axis=1
        )
        if agreement(model, features, vocab) > args.acceptance:
            lo = gamma
        else:
            hi = gamma
    gamma = (lo + hi) / 2
    layer.eh_proj.weight = mx.concatenate(
        [mx.eye(noise.shape[0]), gamma * noise], axis=1
    )
    measured = agreement(model, features, vocab)
    write(gamma)
    trunk_params = sum(
        v.size for k, v in w.items() if not k.startswith(LAYOUT.prefix(config, 0))
    )
    info = {
        "target_acceptance": args.acceptance,
        "measured_agreement": measured,
        "gamma": gamma,
        "trunk_parameters": trunk_params,
        "draft_vocab": args.draft_vocab,
        "blas": blas,
    }
    if args.draft_vocab:
        write_conversion(args.out, config, w, emitted, info)
    (args.out / "synthetic.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info))


if __name__ == "__main__":
    main()

"""A float32 Gemma 4 pair (target + assistant) whose assistant is accepted at a chosen
rate: the Gemma 4 counterpart of make_synthetic_model.py, for speed measurements.

- target (``gemma4_text``, the 31B layout: sliding and full layers, ``attention_k_eq_v``
  on full layers, soft-capped logits, Gemma's 262144-token vocabulary by default):
  random weights at a real size (--params), the embedding dominating the residual
  stream (block outputs damped at their output norms), an untied ``lm_head`` whose
  row pi(x) is token x's direction, pi one random cycle over the vocabulary, so the
  greedy next token is pi(x_t). Token embeddings are grouped (a shared component per
  group of 128 tokens), as a real vocabulary's are by meaning;
- assistant (``gemma4_assistant``, four KV-shared layers): ``pre_projection`` passes
  the input token's embedding through a random map A, its tied head's row pi(x) is
  A e_x, so it drafts pi(t); ``gamma`` times a random map of the hidden-state half
  adds noise, set by bisection so that its teacher-forced first draft agrees with
  the target's greedy token at --acceptance. With --centroids it has the E2B/E4B
  centroid head, whose clusters are the embedding groups.

The folder is a pair folder (`mlx_mtp.assistant`): the target in Hugging Face names,
the assistant in ``assistant.safetensors``.

    python scripts/make_synthetic_gemma4.py OUT --acceptance 0.7 [--params 400e6]
        [--centroids] [--vocab 262144]
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

GROUP = 128  # tokens per embedding group (= per centroid)
DAMPING = 0.2  # the target's block-output norms
ASSISTANT_DAMPING = 0.05


def target_config(params: float, vocab: int, hidden: int) -> dict:
    heads, hd, kv = hidden // 128, 128, max(1, hidden // 512)
    inter = 4 * hidden
    per_layer = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    layers = max(6, 6 * round((params - 2 * vocab * hidden) / per_layer / 6))
    s, f = "sliding_attention", "full_attention"
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_global_key_value_heads": kv,
        "head_dim": hd,
        "global_head_dim": 2 * hd,
        "attention_k_eq_v": True,
        "layer_types": ([s] * 5 + [f]) * (layers // 6),
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "sliding_window": 1024,
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "torch_dtype": "float32",
    }


def assistant_config(target: dict, centroids: bool) -> dict:
    s, f = "sliding_attention", "full_attention"
    keys = ("head_dim", "global_head_dim", "sliding_window", "vocab_size")
    keys += ("attention_k_eq_v", "rope_parameters", "max_position_embeddings")
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": centroids,
        "num_centroids": target["vocab_size"] // GROUP,
        "centroid_intermediate_top_k": 32,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 256,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": target["num_key_value_heads"],
            "num_global_key_value_heads": target["num_global_key_value_heads"],
            "layer_types": [s, s, s, f],
            "num_kv_shared_layers": 4,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "final_logit_softcapping": None,
            "rms_norm_eps": 1e-6,
            **{k: target[k] for k in keys},
        },
    }


def build(config: dict, a_config: dict, seed: int):
    """The target's and the assistant's weights (gamma 0), pi, and the noise map."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma4_text

    from mlx_mtp.models.gemma4_assistant import Assistant
    from mlx_mtp.testing.gemma4 import damp

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    V, H = config["vocab_size"], config["hidden_size"]
    target = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config))
    w = dict(tree_flatten(target.parameters()))
    groups = mx.random.normal((V // GROUP, H))
    embed = 0.6 * mx.repeat(groups, GROUP, axis=0) + 0.8 * mx.random.normal((V, H))
    w["model.embed_tokens.weight"] = embed
    damp(w, DAMPING)
    order = rng.permutation(V)
    inverse = np.zeros(V, dtype=np.int64)  # lm_head row pi(x) = direction of x
    inverse[order] = np.roll(order, 1)  # pi(order[i]) = order[i + 1]
    unit = embed / mx.linalg.norm(embed, axis=-1, keepdims=True)
    w["lm_head.weight"] = 4.0 * unit[mx.array(inverse)]

    assistant = Assistant(a_config)
    a = dict(tree_flatten(assistant.parameters()))
    Hd = a_config["text_config"]["hidden_size"]
    A = mx.random.normal((Hd, H)) / H
    mapped = embed @ A.T  # (V, Hd): A e_x
    head = mapped / mx.linalg.norm(mapped, axis=-1, keepdims=True)
    a["model.embed_tokens.weight"] = 4.0 * head[mx.array(inverse)]  # row pi(x)
    a["pre_projection.weight"] = mx.concatenate([A, mx.zeros((Hd, H))], axis=1)
    damp(a, ASSISTANT_DAMPING)
    if "masked_embedding.token_ordering" in a:
        # cluster c: the tokens pi(x) of the x in embedding group c
        ordering = np.argsort(inverse // GROUP, kind="stable")
        a["masked_embedding.token_ordering"] = mx.array(ordering, dtype=mx.int32)
        rows = a["model.embed_tokens.weight"][mx.array(ordering)]
        a["masked_embedding.centroids.weight"] = rows.reshape(-1, GROUP, Hd).mean(1)
    noise = mx.random.normal((Hd, H)) / np.sqrt(H)
    return w, a, order, noise


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--acceptance", type=float, default=0.7)
    p.add_argument("--params", type=float, default=400e6)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--centroids", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    blas = ensure_fast_blas()
    from mlx_lm.generate import generate_step

    from mlx_mtp import assistant as assistants
    from mlx_mtp.convert.check import assistant_predictions
    from mlx_mtp.loading import load_model
    from mlx_mtp.testing.fixtures import write_tokenizer

    config = target_config(args.params, args.vocab, args.hidden)
    a_config = assistant_config(config, args.centroids)
    w, a, order, noise = build(config, a_config, args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, 512)
    mx.save_safetensors(str(out / "model.safetensors"), w, {"format": "pt"})
    config["assistant"] = assistants.section(a_config, None, {"synthetic": True})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(out / assistants.ASSISTANT_FILE), a, {"format": "mlx"})
    model = load_model(str(out))[0]
    H = config["hidden_size"]

    rng = np.random.default_rng(args.seed + 1)
    sequences = []
    for _ in range(3):  # greedy continuations of random prompts
        prompt = rng.integers(0, args.vocab, 8).tolist()
        steps = generate_step(mx.array(prompt), model.trunk, max_tokens=100)
        seq = prompt + [int(t) for t, _ in steps]
        greedy = mx.argmax(model.logits(model.hidden(mx.array(seq)[None])), -1)[0]
        sequences.append((seq, np.array(greedy)))
    follows = np.mean([np.mean(np.array(s[9:]) == g[8:-1]) for s, g in sequences])

    def agreement(gamma: float) -> float:
        pre = mx.concatenate([a["pre_projection.weight"][:, :H], gamma * noise], 1)
        model.assistant.pre_projection.weight = pre
        hits = [np.mean(assistant_predictions(model, s) == g[1:]) for s, g in sequences]
        return float(np.mean(hits))

    lo, hi = 0.0, 16.0
    for _ in range(12):  # agreement falls as gamma grows
        gamma = (lo + hi) / 2
        if agreement(gamma) > args.acceptance:
            lo = gamma
        else:
            hi = gamma
    gamma = (lo + hi) / 2
    reached = agreement(gamma)
    a["pre_projection.weight"] = model.assistant.pre_projection.weight
    mx.save_safetensors(str(out / assistants.ASSISTANT_FILE), a, {"format": "mlx"})
    info = dict(
        gamma=gamma,
        acceptance=reached,
        trunk_follows_cycle=float(follows),
        blas=blas,
        target_parameters=int(sum(v.size for v in w.values())),
        assistant_parameters=int(sum(v.size for v in a.values())),
    )
    config["assistant"]["provenance"] = {"synthetic": info}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(json.dumps(info))


if __name__ == "__main__":
    main()

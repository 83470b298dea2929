"""Gemma 4's DSpark drafters (architecture ``Gemma4DSparkModel``), as mlx-vlm 0.7.10's
``gemma4_dspark`` reads the published checkpoints.

A DSpark drafter (`mlx_mtp.models.dspark`: context rows from the target's tapped
layers, a non-causal block ``[a, M, ...]``, the vanilla Markov head, the confidence
head) whose layers are Gemma 4's instead of Qwen3's:

- the config is a ``gemma4_text`` one (Gemma 4's widths, ``layer_types``,
  per-layer-type ``rope_parameters``) with DSpark's keys at its top level;
- a layer is Gemma 4's sandwich: ``x + post_attention_layernorm(attn(
  input_layernorm(x)))``, then ``h + post_feedforward_layernorm(mlp(
  pre_feedforward_layernorm(h)))``, times ``layer_scalar``; the MLP is GeGLU
  (``gelu_approx(gate) * up``);
- attention has q/k norms and a unit softmax scale; a full layer's heads are
  ``global_head_dim`` wide, and with ``attention_k_eq_v`` it has no ``v_proj``:
  its values are its keys' projection before ``k_norm``, as mlx-vlm computes them
  (Gemma 4's own layers also norm the values; mlx-vlm's drafter does not);
- one RoPE for every layer, of the first layer's type (``rope_parameters`` of that
  type, partial rotation on a full layer's ``global_head_dim``), as mlx-vlm builds
  it;
- its own embedding (scaled by sqrt(H)) and head, whose logits are soft-capped at
  ``final_logit_softcapping`` (30 when unset) before the Markov bias.

Sliding layers read the last ``sliding_window - 1`` context rows (1024 when unset),
full ones all of them (`mlx_mtp.models.dspark.windows_of`).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import MTPError
from . import dspark

ARCHITECTURE = "Gemma4DSparkModel"
# mlx-vlm's Gemma4DsparkConfig defaults, for keys a published config leaves out
DEFAULTS = {
    "final_logit_softcapping": 30.0,
    "sliding_window": 1024,
    "hidden_activation": "gelu_pytorch_tanh",
}


def is_gemma4_dspark(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or ())


class Attention(nn.Module):
    """A Gemma 4 drafter layer's attention projections (called by `DSpark._attend`
    and `Gemma4DSpark._kv`)."""

    def __init__(self, config: dict, sliding: bool, rope):
        super().__init__()
        H, eps = config["hidden_size"], config["rms_norm_eps"]
        self.head_dim = _width(config, sliding)
        self.k_eq_v = bool(config.get("attention_k_eq_v")) and not sliding
        self.n_heads = config["num_attention_heads"]
        self.n_kv_heads = config["num_key_value_heads"]
        if self.k_eq_v and config.get("num_global_key_value_heads") is not None:
            self.n_kv_heads = config["num_global_key_value_heads"]
        self.scale = 1.0
        D = self.head_dim
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = nn.RMSNorm(D, eps=eps)
        self.k_norm = nn.RMSNorm(D, eps=eps)
        self.rope = rope


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: dict, sliding: bool, rope):
        super().__init__()
        H, eps = config["hidden_size"], config["rms_norm_eps"]
        self.self_attn = Attention(config, sliding, rope)
        self.mlp = MLP(H, config["intermediate_size"])
        self.input_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(H, eps=eps)
        self.layer_scalar = mx.ones((1,))


class Gemma4DSpark(dspark.DSpark):
    """A Gemma 4 DSpark drafter (see the module docstring)."""

    WHERE = "the Gemma 4 DSpark drafter"

    def __init__(self, config: dict, own_embed: bool = True, own_head: bool = True):
        config = {**DEFAULTS, **config}
        self.check(config)
        super().__init__(config, own_embed, own_head)
        self.embed_scale = config["hidden_size"] ** 0.5

    @classmethod
    def check(cls, config: dict) -> None:
        """One-line errors for a config mlx-mtp cannot run as mlx-vlm does."""
        where = cls.WHERE
        if config.get("hidden_activation") != "gelu_pytorch_tanh":
            raise MTPError(
                f"{where}: hidden_activation {config.get('hidden_activation')!r} is "
                "not gelu_pytorch_tanh"
            )
        for key in ("is_causal", "attention_sink_bias", "enable_moe_block"):
            if config.get(key):
                raise MTPError(f"{where} has {key} set, which mlx-mtp does not run")
        for key in ("num_kv_shared_layers", "hidden_size_per_layer_input"):
            if config.get(key):
                raise MTPError(f"{where}: {key} must be 0")
        for key in ("head_dim", "num_attention_heads", "num_key_value_heads"):
            dspark.whole(config, key, where)
        if not isinstance(config.get("layer_types"), list):
            raise MTPError(f"{where}: layer_types must list each layer's type")
        dspark.windows_of(config, where)
        widths = {
            _width(config, t == "sliding_attention") for t in config["layer_types"]
        }
        first = _width(config, config["layer_types"][0] == "sliding_attention")
        if first > min(widths):
            raise MTPError(
                f"{where} rotates every layer with its first layer's RoPE ({first} "
                f"dimensions, as mlx-vlm does), wider than a later layer's heads "
                f"({min(widths)})"
            )

    @staticmethod
    def read_args(config: dict):
        """The shared widths, as mlx-lm's Qwen3 args hold them (its RoPE keys
        are not Gemma's per-type ones, which `make_layers` reads)."""
        plain = {k: v for k, v in config.items() if k != "rope_parameters"}
        return dspark.layer_args({**plain, "rope_theta": 10000.0})

    @staticmethod
    def make_layers(config: dict, args) -> list:
        types = config["layer_types"]
        rope = _rope(config, types[0] == "sliding_attention")
        return [Layer(config, t == "sliding_attention", rope) for t in types]

    @staticmethod
    def _kv(attn: Attention, x: mx.array):
        """Keys (normed) and values of rows ``x``; a ``k_eq_v`` layer's values are
        its keys' projection before the norm."""
        B, L, _ = x.shape
        raw = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)
        v = raw if attn.k_eq_v else attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1)
        return (
            attn.k_norm(raw).transpose(0, 2, 1, 3),
            v.transpose(0, 2, 1, 3),
        )

    def block(self, x: mx.array, context, position) -> mx.array:
        """`DSpark.block` with Gemma 4's layers (module docstring); ``x`` the
        block rows' embeddings at the scale the layers read."""
        for layer, seen in zip(self.layers, context):
            h = self._attend(layer.self_attn, layer.input_layernorm(x), seen, position)
            x = x + layer.post_attention_layernorm(h)
            h = layer.mlp(layer.pre_feedforward_layernorm(x))
            x = (x + layer.post_feedforward_layernorm(h)) * layer.layer_scalar
        return self.norm(x[:, -self.block_size :])


def _rope(config: dict, sliding: bool):
    """mlx-vlm's one RoPE of a Gemma 4 drafter: the first layer type's parameters
    over that type's head width."""
    kind = "sliding_attention" if sliding else "full_attention"
    params = dict((config.get("rope_parameters") or {}).get(kind) or {})
    return initialize_rope(
        _width(config, sliding),
        base=params.get("rope_theta", 10000.0),
        traditional=bool(config.get("rope_traditional", False)),
        scaling_config=params,
        max_position_embeddings=config.get("max_position_embeddings"),
    )


def _width(config: dict, sliding: bool) -> int:
    """A layer's head width: ``head_dim``, or a full layer's ``global_head_dim``."""
    wide = config.get("global_head_dim")
    return config["head_dim"] if sliding or not wide else wide

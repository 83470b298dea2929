"""Ling / Ring 2.5 (``bailing_hybrid``): MTP layers appended after a lightning-attention
hybrid trunk.

The trunk is mlx-lm's ``bailing_hybrid``: groups of lightning (gated linear) attention
layers closed by an MLA layer, MoE MLPs. MTP layer j sits at ``model.layers.{L + j}``
with ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``final_layernorm`` and a decoder layer
in the trunk's own names (``attention.*`` MLA with ``dense`` as its output, MoE
``mlp.*``): mlx-lm's ``DecoderLayer`` at index L + j, which is MLA + MoE there (vLLM's
``bailing_mtp``). The embedding (``model.word_embeddings``) and head are the trunk's;
as vLLM does, the embedding of the first MTP row is zeroed. The lightning state rolls
back through the capture in `mlx_mtp.models.capture`.

transformers uses ``bailing_hybrid`` for Ling 3.0 (Kimi Delta Attention), whose trunk
mlx-lm runs as ``bailing_moe_v3``: such a config is refused with that fix.
"""

from mlx_lm.models import bailing_hybrid as lm

from ..errors import UnsupportedModelError
from . import deepseek_v3
from .base import check_copy, sanitize_layers, split_mtp
from .capture import install_capture
from .family import Layout, define
from .mtp import MTPLayer

LAYOUT = Layout(
    prefix=lambda config, j: f"model.layers.{config['num_hidden_layers'] + j}.",
    fusion={
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "final_layernorm": "norm",
    },
)
EMBEDDING_KEY = "model.word_embeddings.weight"
KDA_KEYS = ("short_conv_kernel_size", "kda_lower_bound", "kda_safe_gate", "no_kda_lora")
COPIES = {
    "shared_head.head.weight": "lm_head.weight",
    "embed_tokens.weight": EMBEDDING_KEY,
}


def fix_config(config: dict) -> dict:
    """Refuse Ling 3.0 configs, which transformers also names ``bailing_hybrid``."""
    if any(key in config for key in KDA_KEYS):
        raise UnsupportedModelError(
            "this bailing_hybrid config is Ling 3.0 (Kimi Delta Attention, "
            "transformers' name), which mlx-lm's bailing_hybrid (Ling 2.5) cannot "
            'run; mlx-lm runs it as bailing_moe_v3: set "model_type": '
            '"bailing_moe_v3" in its config.json'
        )
    return {}


def split_weights(weights: dict, config: dict):
    """Split into (trunk, mtp); check and drop the layers' copies of embedding /
    head."""
    trunk, mtp = split_mtp(weights, config, deepseek_v3.mtp_layer_of)
    for key in list(mtp):
        name = key.split(".", 3)[3]
        if name in COPIES:
            check_copy(mtp.pop(key), trunk.get(COPIES[name]), key)
    return trunk, mtp


def sanitize(weights: dict, config: dict, trunk, raw: bool = True) -> dict:
    return sanitize_layers(trunk, weights, config, deepseek_v3.mtp_layer_of, LAYOUT)


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    """MTP layer j: mlx-lm's decoder layer at index L + j (MLA + MoE there)."""
    args = trunk.args
    block = lm.DecoderLayer(args, args.num_hidden_layers + j)
    return MTPLayer(args.hidden_size, args.rms_norm_eps, block)


def embed(trunk, ids):
    return trunk.model.word_embeddings(ids)


def logits(trunk, h):
    if trunk.args.tie_word_embeddings:
        return trunk.model.word_embeddings.as_linear(h)
    return trunk.lm_head(h)


def head(trunk):
    return (
        trunk.model.word_embeddings if trunk.args.tie_word_embeddings else trunk.lm_head
    )


def prepare(trunk) -> None:
    """Make the trunk's lightning-attention layers record per-position states."""
    install_capture(trunk.layers)


FAMILY = define(
    LAYOUT=LAYOUT,
    MTP_CONFIG_KEYS=("num_nextn_predict_layers",),
    MASK_FIRST_POSITION=True,
    MASK_AS_ARRAY=True,  # MLA adds the mask into its own scores
    EMBEDDING_KEY=EMBEDDING_KEY,
    fix_config=fix_config,
    mtp_layer_of=deepseek_v3.mtp_layer_of,
    split_weights=split_weights,
    sanitize=sanitize,
    make_layer=make_layer,
    embed=embed,
    logits=logits,
    head=head,
    prepare=prepare,
)

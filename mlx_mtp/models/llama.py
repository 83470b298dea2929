"""Llama-architecture models (Llama, Mistral, SmolLM, ...) with retrofitted MTP heads.

Llama checkpoints ship no heads; `mlx-mtp train-heads` trains DeepSeek-style heads for
them, and llama.cpp writes such heads in GGUF as ``blk.{L}.nextn.*``. Both use
DeepSeek's naming at ``model.layers.{L + j}`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and a llama decoder layer), so this family shares DeepSeek-V3's
translation; without heads a llama model loads for plain decoding and conversion.
"""

from mlx_lm.models import llama as lm

from . import deepseek_v3
from .mtp import MTPLayer


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    return MTPLayer(args.hidden_size, args.rms_norm_eps, lm.TransformerBlock(args))


# DeepSeek-V3's layout and translation; the heads' first row keeps its embedding (as
# train-heads trains them) and llama's attention takes mlx-lm's "causal" mask
FAMILY = deepseek_v3.FAMILY.derive(
    make_layer=make_layer, defaults=("MASK_FIRST_POSITION", "MASK_AS_ARRAY")
)

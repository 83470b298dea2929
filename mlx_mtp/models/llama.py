"""Llama-architecture models (Llama, Mistral, SmolLM, ...) with retrofitted MTP heads.

Llama checkpoints ship no heads; `mlx-mtp train-heads` trains DeepSeek-style heads for
them, and llama.cpp writes such heads in GGUF as ``blk.{L}.nextn.*``. Both use DeepSeek's
naming at ``model.layers.{L + j}`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and a llama decoder layer), so this family shares DeepSeek-V3's
translation; without heads a llama model loads for plain decoding and conversion.
"""

from mlx_lm.models import llama as lm

from . import deepseek_v3
from .mtp import MTPLayer

LAYOUT = deepseek_v3.LAYOUT
MTP_CONFIG_KEYS = deepseek_v3.MTP_CONFIG_KEYS

declared_mtp_layers = deepseek_v3.declared_mtp_layers
mtp_layer_of = deepseek_v3.mtp_layer_of
split_weights = deepseek_v3.split_weights
sanitize = deepseek_v3.sanitize


def make_layer(trunk, j: int, config: dict) -> MTPLayer:
    args = trunk.args
    return MTPLayer(args.hidden_size, args.rms_norm_eps, lm.TransformerBlock(args))

"""The MTP module shared by every family: fuse a token embedding with a hidden state,
run one decoder block, normalize.

    x = eh_proj(concat(enorm(e), hnorm(h)))      # [hidden, embedding] when hidden_first
    z = norm(block(x))                           # post-norm, fed to the shared head

Parameter names follow the internal schema
`layers.{j}.{enorm,hnorm,eh_proj,block.*,norm}`; each family's `sanitize` maps its
Hugging Face names onto it. The block is the family's own mlx-lm decoder layer, so its
weights load exactly as the trunk's do.
"""

from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn


class MTPLayer(nn.Module):
    """One MTP layer.

    Args:
        hidden_size: Model width H.
        eps: RMSNorm epsilon of the family.
        block: A decoder layer called as ``block(x, mask, cache)``.
        hidden_first: Concatenate ``[hidden, embedding]`` (MiMo) instead of
            ``[embedding, hidden]`` (everyone else).

    Attributes:
        window: The block's sliding window, when its attention has one (its cache is
            then a `mlx_mtp.cache.WindowCache`); None for full attention.
        kv_caches: How many KV caches the block's attention keeps (2 for
            DeepSeek-V3.2's MLA latent and indexer keys: a `mlx_mtp.cache.ListCache`).
        reads_media: The layer reads the prompt's images: its cache is a
            `mlx_mtp.cache.ListCache` of its KV cache(s) and a
            `mlx_mtp.media.MediaCache` (GLM-OCR).
        make_caches: When the block's attention keeps caches of its own kinds, a
            function giving them (a fresh list, in the order the block reads
            them; a `mlx_mtp.cache.ListCache` of them): GLM-5.3-Flash's indexer.
        float_layers: Name endings of linear layers quantized heads keep float
            (`mlx_mtp.heads.quantize_heads`): those a release keeps in full
            precision.
    """

    window: Optional[int] = None
    kv_caches: int = 1
    reads_media: bool = False
    make_caches: Optional[Callable[[], List[Any]]] = None
    float_layers: Tuple[str, ...] = ()

    def __init__(
        self, hidden_size: int, eps: float, block: nn.Module, hidden_first: bool = False
    ):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_first = hidden_first

    def __call__(
        self,
        embeddings: mx.array,
        hidden: mx.array,
        mask: Optional[Any] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        """Map (embedding of t_{i+1}, hidden at i) rows to post-norm outputs.

        Args:
            embeddings: ``(B, L, H)`` token embeddings.
            hidden: ``(B, L, H)`` hidden states of the row's position.
        Returns:
            ``(B, L, H)`` outputs after the final norm.
        """
        e, h = self.enorm(embeddings), self.hnorm(hidden)
        x = mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1)
        return self.norm(self.block(self.eh_proj(x), mask, cache))


class MTPStack(nn.Module):
    """The MTP layers of a checkpoint, in order.

    Retrofitted heads may draft from a shortlist of the vocabulary (``draft_vocab``,
    sorted token ids, FR-Spec style): their drafts are restricted to it. The target
    model's distribution is never restricted, so exactness is unaffected.
    """

    def __init__(self, layers: List[MTPLayer], draft_vocab_size: int = 0):
        super().__init__()
        self.layers = layers
        if draft_vocab_size:
            self.draft_vocab = mx.zeros((draft_vocab_size,), dtype=mx.int32)


BlockFactory = Callable[[Any, int], nn.Module]

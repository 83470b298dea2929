"""Port Hugging Face checkpoints to MLX with their MTP heads.

- `convert`: a Hugging Face checkpoint (folder or hub repo) -> an MLX folder: the trunk
  as mlx-lm writes it (optionally quantized), the heads in ``mtp.safetensors`` (8-bit
  by default when the trunk is quantized), tokenizer files, provenance.
- `graft_heads`: attach heads from a Hugging Face checkpoint to an existing MLX
  conversion, downloading only the shards that hold them.
- `graft_assistant`: the same for a Gemma 4 assistant (`mlx_mtp.assistant`); ``convert``
  writes one beside its target with ``draft_hf_path``, or converts one alone.
- `check`: report what a conversion holds and how well its heads agree with the source.

Outputs are written to a temporary folder (or file) next to the destination and renamed
at the end; sources are never modified.
"""

from .assistant import graft_assistant
from .check import check
from .graft import graft_heads
from .hf import convert

__all__ = ["check", "convert", "graft_assistant", "graft_heads"]

"""Test and measurement helpers: tiny checkpoints in each family's exact Hugging Face
layout (`mlx_mtp.testing.fixtures`). Never imported by the runtime."""

from ..options import DecodeOptions

# Drafting with the MTP heads alone, from their own rows: what the exactness tests of
# the heads decode with (the defaults also try prompt lookup and draft vocabularies).
HEADS = DecodeOptions(draft_source="heads", draft_vocab=None)

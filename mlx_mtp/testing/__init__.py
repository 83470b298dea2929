"""Test and measurement helpers: tiny checkpoints in each family's exact Hugging Face
layout (`mlx_mtp.testing.fixtures`). Never imported by the runtime."""

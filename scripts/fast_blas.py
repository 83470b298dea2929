"""Timing scripts' BLAS switch: `mlx_mtp.fast_blas` (OpenBLAS, one thread)."""

from mlx_mtp.fast_blas import ensure_fast_blas  # noqa: F401

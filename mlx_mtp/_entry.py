"""The ``mlx-mtp`` console entry point, kept apart so that Ctrl-C is answered from the
first moment: this module installs a quiet SIGINT handler as it is imported, before the
CLI (click, then MLX and transformers) is, and hands over to ordinary
``KeyboardInterrupt`` handling once the commands' own handlers are in place.

``train-heads`` computes on OpenBLAS with every core where MLX computes on a Linux CPU
(`mlx_mtp.fast_blas`): the wheel's reference BLAS is ~20x slower there. Set
``MLX_MTP_FAST_BLAS=0`` to keep the reference BLAS."""

import os
import signal
import sys

FAST_BLAS_COMMANDS = ("train-heads",)


def _interrupted(signum, frame):
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)


signal.signal(signal.SIGINT, _interrupted)


def _fast_blas() -> None:
    """Re-exec a fast-BLAS command with OpenBLAS where that is safe (see above)."""
    if len(sys.argv) < 2 or sys.argv[1] not in FAST_BLAS_COMMANDS:
        return
    if sys.platform != "linux" or "--help" in sys.argv:
        return
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        from .fast_blas import ensure_fast_blas

        ensure_fast_blas(threads=os.cpu_count() or 1, quiet=True)


def run():
    _fast_blas()
    from .cli import on_sigint
    from .cli import run as run_cli

    signal.signal(signal.SIGINT, on_sigint)
    run_cli()

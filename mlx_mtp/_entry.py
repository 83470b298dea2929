"""The ``mlx-mtp`` console entry point, kept apart so that Ctrl-C is answered from the
first moment: this module installs a quiet SIGINT handler as it is imported, before the
CLI (click, then MLX and transformers) is, and hands over to ordinary
``KeyboardInterrupt`` handling once the commands' own handlers are in place. Across
the BLAS re-exec below SIGINT is held (blocked, so a Ctrl-C stays pending) until this
module has its handler in place again: every Ctrl-C after the interpreter's own
start-up ends the command with "interrupted" and exit 130.

Where MLX computes on a Linux CPU, ``train-heads`` runs on OpenBLAS with every core,
and ``generate`` and ``chat`` with one thread (`mlx_mtp.fast_blas`): with the wheel's
reference BLAS a pass over several tokens costs several passes, so no draft can pay,
and training is ~16x slower. Set ``MLX_MTP_FAST_BLAS=0`` to keep the reference BLAS."""

import os
import signal
import sys

FAST_BLAS_COMMANDS = {"train-heads": None, "generate": 1, "chat": 1}  # threads


def _interrupted(signum, frame):
    """Ctrl-C before the CLI's handler is in place: one line and exit 130, at once.
    Nothing needs cleaning up yet (the BLAS shim's build holds SIGINT until it is
    done), and an exception raised here could land where Python drops it: in a weakref
    callback of the import system's module locks ("Exception ignored in ...")."""
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted)


def _release_held_sigint() -> None:
    """After the BLAS re-exec, take the Ctrl-C held across it (`fast_blas`): one
    that came during this interpreter's start-up is answered now, by the handler."""
    from .fast_blas import release_sigint

    release_sigint()


_release_held_sigint()


def _fast_blas() -> None:
    """Re-exec a fast-BLAS command with OpenBLAS where that is safe (see above)."""
    if len(sys.argv) < 2 or sys.argv[1] not in FAST_BLAS_COMMANDS:
        return
    if sys.platform != "linux" or "--help" in sys.argv:
        return
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        from .fast_blas import ensure_fast_blas

        threads = FAST_BLAS_COMMANDS[sys.argv[1]] or os.cpu_count() or 1
        argv = ["-m", "mlx_mtp", *sys.argv[1:]]  # as `mlx-mtp` or `python -m mlx_mtp`
        ensure_fast_blas(threads=threads, quiet=True, argv=argv, hold_sigint=True)


def _deliver_again(unraisable) -> None:
    """``sys.unraisablehook`` under the CLI: a Ctrl-C whose ``KeyboardInterrupt`` was
    raised where Python cannot let it out (a weakref callback or ``__del__``, as the
    import system's module locks have) comes again a moment later, from another
    thread, to land where it ends the command; anything else goes to Python's hook."""
    import _thread
    import threading

    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        threading.Timer(0.01, _thread.interrupt_main).start()
    else:
        sys.__unraisablehook__(unraisable)


def run():
    _fast_blas()
    from .cli import on_sigint
    from .cli import run as run_cli

    sys.unraisablehook = _deliver_again
    signal.signal(signal.SIGINT, on_sigint)
    run_cli()

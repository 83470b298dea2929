"""The ``mlx-mtp`` console entry point, kept apart so that Ctrl-C is answered from the
first moment: this module installs a quiet SIGINT handler as it is imported, before the
CLI (click, then MLX and transformers) is, and hands over to ordinary
``KeyboardInterrupt`` handling once the commands' own handlers are in place."""

import signal
import sys


def _interrupted(signum, frame):
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)


signal.signal(signal.SIGINT, _interrupted)


def run():
    from .cli import on_sigint
    from .cli import run as run_cli

    signal.signal(signal.SIGINT, on_sigint)
    run_cli()

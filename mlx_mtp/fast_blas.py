"""Run MLX's CPU float32 matmuls on OpenBLAS instead of the wheel's reference BLAS.

The ``mlx[cpu]`` wheel links a netlib reference BLAS (~3 GFLOP/s), which makes every
multi-token pass compute-bound; Apple Silicon decoding is memory-bound. On Linux
`ensure_fast_blas` compiles a 10-line shim that forwards ``cblas_sgemm`` to the
OpenBLAS shipped inside numpy's wheel, and re-executes the process with it preloaded.
It returns a one-line description of the BLAS in use, for the report.

Timing scripts use one thread (with two, t(1) gets faster but the cost ratio of a
multi-token verify pass rises from ~1.08 to ~1.28, a regime unlike a Mac);
``mlx-mtp train-heads`` uses every core (`mlx_mtp._entry`). Nothing changes where MLX
computes on a GPU, on macOS (Accelerate), or where the shim cannot be built.
"""

import contextlib
import glob
import hashlib
import os
import pathlib
import signal
import subprocess
import sys

SHIM = r"""
#include <stdint.h>
void scipy_cblas_sgemm64_(int, int, int, int64_t, int64_t, int64_t, float,
                          const float *, int64_t, const float *, int64_t, float,
                          float *, int64_t);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta,
                 float *c, int ldc) {
  scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""
MARK = "MLX_MTP_FAST_BLAS"
HELD = "MLX_MTP_SIGINT_HELD"  # SIGINT blocked across the exec: unblock it


def _openblas() -> str:
    import numpy

    libs = pathlib.Path(numpy.__file__).parent.parent / "numpy.libs"
    found = glob.glob(str(libs / "libscipy_openblas64_*.so"))
    if not found:
        raise FileNotFoundError("numpy's wheel has no scipy-openblas64 library")
    return found[0]


def _build(openblas: str) -> pathlib.Path:
    """The shim for this OpenBLAS (named by its path, so a new numpy gets its own),
    compiled once into the cache and renamed into place whole."""
    tag = hashlib.sha256(openblas.encode()).hexdigest()[:12]
    out = pathlib.Path.home() / ".cache" / "mlx-mtp" / f"sgemm_shim-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.stem}-{os.getpid()}")
        src = tmp.with_suffix(".c")
        src.write_text(SHIM)
        lib = pathlib.Path(openblas)
        try:
            subprocess.run(
                [
                    "cc",
                    "-shared",
                    "-fPIC",
                    "-O2",
                    str(src),
                    "-o",
                    str(tmp),
                    f"-L{lib.parent}",
                    f"-l:{lib.name}",
                    f"-Wl,-rpath,{lib.parent}",
                ],
                check=True,
                capture_output=True,
            )
            tmp.replace(out)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
    return out


def describe() -> str:
    """The CPU BLAS this process's float32 matmuls run on, in words."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if os.environ.get(MARK) == "1":
        n = os.environ.get("OPENBLAS_NUM_THREADS", "?")
        return f"OpenBLAS via sgemm shim ({n} thread{'' if n == '1' else 's'})"
    return "reference BLAS (slow: every pass is compute-bound; ratios understate MTP)"


def ensure_fast_blas(
    threads: int = 1, quiet: bool = False, argv=None, hold_sigint: bool = False
) -> str:
    """Re-exec with OpenBLAS preloaded (``threads`` threads) when possible, running
    ``python ARGV`` (default: this process's own arguments); describe the BLAS in
    use. Only for a process's entry point: the process is replaced.

    An exec resets a caught signal to its default action, so a Ctrl-C in the new
    interpreter's start-up would end it silently by the signal. With ``hold_sigint``
    SIGINT is blocked across the exec instead (the new process starts with
    ``MLX_MTP_SIGINT_HELD=1``): a Ctrl-C then waits, pending, until ARGV's code has
    its handler in place and unblocks it (`release_sigint`); only for an ARGV that
    does so, as ``mlx-mtp``'s entry point."""
    if sys.platform == "darwin" or os.environ.get(MARK) in ("0", "1"):
        return describe()
    try:
        with _sigint_blocked(hold_sigint):  # a Ctrl-C waits for the build's clean-up
            shim = _build(_openblas())
    except (OSError, subprocess.CalledProcessError) as e:
        if not quiet:
            print(f"[fast_blas] cannot build the OpenBLAS shim: {e}", file=sys.stderr)
        os.environ[MARK] = "0"
        return ensure_fast_blas(threads, quiet, argv, hold_sigint)
    preload = " ".join(filter(None, [str(shim), os.environ.get("LD_PRELOAD")]))
    env = dict(os.environ, LD_PRELOAD=preload, OPENBLAS_NUM_THREADS=str(threads))
    env[MARK] = "1"
    if hold_sigint:  # a Ctrl-C that came before this is handled by this call
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        env[HELD] = "1"
    try:
        os.execve(sys.executable, [sys.executable, *(argv or sys.argv)], env)
    finally:  # the exec failed: this process goes on, and takes its Ctrl-C
        release_sigint(env)


@contextlib.contextmanager
def _sigint_blocked(block: bool):
    """SIGINT blocked (a Ctrl-C pending) inside, if ``block``; delivered after."""
    if not block:
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def release_sigint(env=os.environ) -> None:
    """Unblock the SIGINT that `ensure_fast_blas` held across the exec (pending, a
    Ctrl-C of the new process's start-up is delivered now), if ``env`` says so; call
    once the process's SIGINT handler is in place."""
    if env.pop(HELD, None) == "1":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

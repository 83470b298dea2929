"""Run MLX's CPU float32 matmuls on OpenBLAS instead of the wheel's reference BLAS.

The ``mlx[cpu]`` wheel links a netlib reference BLAS (~3 GFLOP/s), which makes every
decode step compute-bound; Apple Silicon decoding is memory-bound. Timing scripts call
`ensure_fast_blas()` first: on Linux it compiles a 10-line shim that forwards
``cblas_sgemm`` to the OpenBLAS shipped inside numpy's wheel, and re-executes the
script with it preloaded (one thread: with two, t(1) gets faster but the cost ratio
of a multi-token verify pass rises from ~1.08 to ~1.28, a regime unlike a Mac).
It returns a one-line description of the BLAS in use, for the report.
"""

import glob
import os
import pathlib
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


def _openblas() -> str:
    import numpy

    libs = pathlib.Path(numpy.__file__).parent.parent / "numpy.libs"
    found = glob.glob(str(libs / "libscipy_openblas64_*.so"))
    if not found:
        raise FileNotFoundError("numpy's wheel has no scipy-openblas64 library")
    return found[0]


def _build(openblas: str) -> pathlib.Path:
    out = pathlib.Path.home() / ".cache" / "mlx-mtp" / "sgemm_shim.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".c")
        src.write_text(SHIM)
        lib = pathlib.Path(openblas)
        subprocess.run(
            [
                "cc",
                "-shared",
                "-fPIC",
                "-O2",
                str(src),
                "-o",
                str(out),
                f"-L{lib.parent}",
                f"-l:{lib.name}",
                f"-Wl,-rpath,{lib.parent}",
            ],
            check=True,
        )
    return out


def ensure_fast_blas() -> str:
    """Re-exec with OpenBLAS preloaded when possible; describe the BLAS in use."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    if os.environ.get(MARK) == "1":
        return "OpenBLAS via sgemm shim (1 thread)"
    if os.environ.get(MARK) == "0":
        return (
            "reference BLAS (slow: every pass is compute-bound; ratios understate MTP)"
        )
    try:
        shim = _build(_openblas())
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"[fast_blas] cannot build the OpenBLAS shim: {e}", file=sys.stderr)
        os.environ[MARK] = "0"
        return ensure_fast_blas()
    env = dict(os.environ, LD_PRELOAD=str(shim), OPENBLAS_NUM_THREADS="1")
    env[MARK] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

"""Load an optimised BLAS into the process before MLX's CPU backend binds its own (DESIGN §6).

The `mlx[cpu]` wheel on Linux links the reference (netlib) BLAS, so float32 GEMM/GEMV runs at a
few GFLOP/s. MLX resolves `cblas_sgemm`/`cblas_sgemv` through the dynamic linker, so a library
loaded earlier with `RTLD_GLOBAL` interposes its symbols: loading OpenBLAS before the first
`import mlx.core` makes MLX use it. Measured here with scripts/bench_executor.py (Debian's
OpenBLAS 0.3.21, one thread, on a 2-core VM shared with other work): f32 GEMM 256x1024x3072 37x,
batch-4 GEMM 4.2x, a 128-token prefill of 4 Qwen3-0.6B blocks 28x faster; batch-1 decode, which
is memory-bound, 0.9-1.2x (noise) here, where DESIGN §6 measured 2.4x on an idle machine. It
never lost beyond noise, so it is on by default.

This module must not import mlx. `kafilad/executor/__init__.py` calls `load_openblas()` first.

Environment:
    KAFILA_BLAS: "reference" keeps MLX's bundled BLAS; a path loads that library instead of the
        search list below; unset or "openblas" searches the list.
    OPENBLAS_NUM_THREADS: set to 1 if unset. MLX's CPU backend runs one stream on one thread, and a
        second BLAS thread spins and eats a cgroup CPU quota (DESIGN §9).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import Optional

#: Candidate OpenBLAS libraries, most preferred first (Debian/Ubuntu multiarch, Fedora, generic).
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "libopenblas.so.0",
)

_loaded: Optional[str] = None
_tried = False


def load_openblas() -> Optional[str]:
    """Load OpenBLAS with RTLD_GLOBAL so MLX's CPU backend uses it; idempotent.

    Must run before `mlx.core` is first imported; afterwards it has no effect on MLX, so it warns
    (RuntimeWarning) and returns None. On macOS MLX uses Accelerate and this does nothing.

    Returns:
        The path of the library loaded, or None when KAFILA_BLAS=reference, on macOS, when mlx
        was already imported, or when no OpenBLAS is installed
        (`apt-get install libopenblas0-pthread` on Debian/Ubuntu).
    """
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    choice = os.environ.get("KAFILA_BLAS", "openblas").strip()
    if choice == "reference" or sys.platform == "darwin":
        return None
    if "mlx.core" in sys.modules:
        warnings.warn("mlx.core was imported before kafilad.executor, so MLX keeps its slow reference BLAS; "
                      "import kafilad.executor first.", RuntimeWarning, stacklevel=2)
        return None
    candidates = (choice,) if choice not in ("", "openblas") else OPENBLAS_CANDIDATES
    for path in candidates:
        if path.startswith("/") and not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = path
        return path
    return None


def blas_status() -> str:
    """One line for logs and `status`: which BLAS MLX's CPU backend uses in this process."""
    if _loaded:
        return f"OpenBLAS ({_loaded}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')})"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return "MLX's bundled reference BLAS (slow f32 matmul; install libopenblas0-pthread)"

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
    OPENBLAS_NUM_THREADS: the BLAS threads; if unset (nor OMP_NUM_THREADS), the CPUs this process
        may use (kafilad/cpus.py: its affinity mask, capped by its cgroup's CPU quota), set through
        `openblas_set_num_threads` so the environment children inherit stays as it was. Decode is
        memory-bound and one core does not draw a machine's memory bandwidth; a process under a
        quota below two CPUs (the emulated fleet, DESIGN §9) gets 1, as a second thread would eat
        its quota. Measured on this 2-core VM (issue 12, docs/performance.md "2026-12-02"; three
        interleaved runs each, OPENBLAS_NUM_THREADS=1 against unset, the machine otherwise idle):
        three daemons sharing the two cores served the 386 MB Qwen3 at 11.9 -> 17.0 tokens/s, one
        request through the API (`scripts/bench_ring.py --model ... --api --modes direct --runs 3
        --tokens 48`); single-process mlx-lm 14.8 -> 23.8.
    OPENBLAS_THREAD_TIMEOUT: 4 if unset (OpenBLAS's default 28): log2 of the cycles an idle BLAS
        thread spins before it sleeps. A ring's stage computes a part of each step; threads spinning
        ~0.1 s after each call would take the cores of the stage computing next where daemons share a
        machine. A single process decoded as fast with 4 as with 28 (12.3-14.4 ms a token either way:
        spot checks of 8 blocks of a hidden-512 Llama, 2 threads, not a benchmark).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import Optional

from kafilad.cpus import usable_cpus

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

#: OPENBLAS_THREAD_TIMEOUT when unset (OpenBLAS clamps it to 4..30)
THREAD_TIMEOUT_LOG2 = 4

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
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_TIMEOUT_LOG2))  # read when loaded
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
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if not any(os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
            setter = getattr(lib, "openblas_set_num_threads", None)
            if setter is not None:
                setter(usable_cpus())
        _loaded = path
        return path
    return None


def blas_threads() -> Optional[int]:
    """The threads OpenBLAS computes with in this process (None when it is not loaded)."""
    if not _loaded:
        return None
    getter = getattr(ctypes.CDLL(_loaded), "openblas_get_num_threads", None)
    return int(getter()) if getter is not None else None


def blas_status() -> str:
    """One line for logs and `status`: which BLAS MLX's CPU backend uses in this process."""
    if _loaded:
        return f"OpenBLAS ({_loaded}, {blas_threads()} thread(s))"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return "MLX's bundled reference BLAS (slow f32 matmul; install libopenblas0-pthread)"

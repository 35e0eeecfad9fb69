"""The executor: the only package that imports mlx (STYLE.md layout, DESIGN §6).

Importing this package first loads an optimised OpenBLAS (see `blas.py`) so MLX's CPU backend
uses it; every module here that imports `mlx.core` is imported through this package, so the
load always happens first. Modules: `stage` (a contiguous block range built from mlx-lm's own
architecture class), `runner` (per-request KV caches, wire format for activations), `probe`
(capability measurement, DESIGN §5.1), `synth` (the deterministic synthetic demo model).
"""

from kafilad.executor.blas import blas_status, load_openblas

BLAS_LIBRARY = load_openblas()

__all__ = ["BLAS_LIBRARY", "blas_status", "load_openblas"]

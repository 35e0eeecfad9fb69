"""Import kafilad.executor before any test module imports mlx, so OpenBLAS is loaded first
(kafilad/executor/blas.py), as it is in the daemon."""

import kafilad.executor  # noqa: F401

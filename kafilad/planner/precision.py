"""Per-device precision: the float dtype each member holds its stage in (issue 12 item 4).

MLX's CPU backend runs float32 fastest (its bf16 kernels are slow and the optimised BLAS only
speeds up f32, DESIGN §6); Metal and CUDA run the checkpoint's own float dtype fastest, and a
cast to f32 would double a bf16 model's memory and bytes per token there. So each member reports
the dtype its backend runs fastest with, and the one it can fall back to:

```
 backend       dtype (the probe times it)        fallback_dtype
 metal, cuda   the checkpoint's float dtype       none
 cpu           float32                            the checkpoint's float dtype, when narrower
```

A member does not know its share when it reports (proto_spec 05 §2 `capability`), so the
memory half of the rule is the planner's: a device holds a stage in `dtype` when that stage's
resident bytes (weights, KV cache and working memory in that dtype, kafilad.planner.costmodel)
fit its memory, else in `fallback_dtype` when that fits, else (nothing fits: the stage is
refused) in the narrower of the two. `stage_dtype` is that rule; `backend_dtypes` the table.

The planner takes the model's byte profile per dtype: `Profiles` is one ModelProfile (every
device counted the same, whatever its dtype: a hand-made fleet, as before this item) or a
mapping {dtype name: ModelProfile} (kafilad.modelinfo.ModelInfo.profiles), each device then
counted in its own dtype; a device that reports no dtype holds DEFAULT_DTYPE.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

from kafilad.errors import PlanError
from kafilad.planner.records import Device, ModelProfile

#: bytes per element of each float dtype a stage may hold (MLX names; proto_spec 02 §4.1).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: the dtype of a device that reports none (members before issue 12 item 4 held float32).
DEFAULT_DTYPE = "float32"
#: MLX backends a member may run on.
BACKENDS = ("cpu", "metal", "cuda")

Profiles = Union[ModelProfile, Mapping[str, ModelProfile]]


def check_dtype(name: str, what: str) -> str:
    """`name` when it is a dtype of DTYPE_BYTES.

    Raises:
        PlanError: any other name (the message says `what` carried it).
    """
    if name not in DTYPE_BYTES:
        raise PlanError(f"{what} has dtype {name!r}; a stage holds float32, bfloat16 or float16.")
    return name


def backend_dtypes(backend: str, checkpoint_dtype: str) -> tuple[str, Optional[str]]:
    """(dtype, fallback_dtype) a member on `backend` reports (the module docstring's table).

    Args:
        backend: "cpu", "metal" or "cuda".
        checkpoint_dtype: the checkpoint's float dtype ("bfloat16", "float16", "float32").
    Returns:
        the dtype its backend runs fastest with, and the narrower dtype it may fall back to when
        that stage does not fit (None: no fallback).
    Raises:
        PlanError: an unknown backend or dtype.
    """
    check_dtype(checkpoint_dtype, "The checkpoint")
    if backend not in BACKENDS:
        raise PlanError(f"Unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}.")
    if backend != "cpu":
        return checkpoint_dtype, None
    if DTYPE_BYTES[checkpoint_dtype] < DTYPE_BYTES["float32"]:
        return "float32", checkpoint_dtype
    return "float32", None


def stage_dtype(dtype: str, fallback_dtype: Optional[str], memory_bytes: int,
                resident_bytes: Mapping[str, int]) -> str:
    """The dtype a device holds one stage in: `dtype` when its stage fits, else the fallback.

    Args:
        dtype, fallback_dtype: what the device reported (`backend_dtypes`).
        memory_bytes: the device's memory budget.
        resident_bytes: {dtype: the stage's resident bytes in it} for dtype and the fallback.
    Returns:
        `dtype` when resident_bytes[dtype] <= memory_bytes; else `fallback_dtype` when given and
        fitting; else (nothing fits) the one of the two needing fewer bytes (dtype on a tie).
    """
    if fallback_dtype is None or fallback_dtype == dtype or resident_bytes[dtype] <= memory_bytes:
        return dtype
    if resident_bytes[fallback_dtype] < resident_bytes[dtype]:
        return fallback_dtype
    return dtype


def reference(model: Profiles) -> ModelProfile:
    """One profile standing for the model's shape (model_id, n_blocks) in every dtype.

    Raises:
        PlanError: an empty mapping, or profiles that disagree on the number of blocks.
    """
    if isinstance(model, ModelProfile):
        return model
    if not model:
        raise PlanError("The model has no byte profile in any dtype.")
    profiles = list(model.values())
    counts = sorted({p.n_blocks for p in profiles})
    if len(counts) > 1:
        raise PlanError(f"The model's per-dtype profiles disagree on its number of blocks ({counts}).")
    return model[DEFAULT_DTYPE] if DEFAULT_DTYPE in model else profiles[0]


def device_dtypes(device: Device) -> tuple[str, Optional[str]]:
    """(dtype, fallback_dtype) of a device, DEFAULT_DTYPE when it reports none; no fallback
    that equals the dtype."""
    dtype = device.dtype or DEFAULT_DTYPE
    fb = device.fallback_dtype
    return dtype, (None if fb == dtype else fb)


def device_profiles(model: Profiles, device: Device) -> list[tuple[Optional[str], ModelProfile]]:
    """[(dtype, profile)] the device may hold its stage in, preferred first.

    One ModelProfile counts every device the same: [(None, model)] (no dtype decided).

    Raises:
        PlanError: the mapping lacks a dtype the device reported.
    """
    if isinstance(model, ModelProfile):
        return [(None, model)]
    out = []
    for dt in device_dtypes(device):
        if dt is None:
            continue
        prof = model.get(dt)
        if prof is None:
            raise PlanError(f"Device {device.name!r} holds its stage in {dt}, but the model's byte profile was "
                            f"made for {', '.join(sorted(model)) or 'no dtype'} only.")
        out.append((dt, prof))
    return out

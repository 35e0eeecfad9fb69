"""A CPU member never holds a mixture-of-experts model in bfloat16 (docs/architectures.md ¹: MLX's CPU
backend runs gather_mm in float32 only, so mlx-lm itself cannot run such a model in bf16 on a CPU):
the host drops that member's narrower fallback, so a plan either holds it in float32 or refuses up
front naming the member; Metal and CUDA members and dense models keep theirs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kafilad.executor import archs
from kafilad.node.session.host import HostSession
from kafilad.planner.precision import stage_dtype


def fallback(config, capability):
    return HostSession._fallback_dtype(SimpleNamespace(info=SimpleNamespace(config=config)), capability)


@pytest.mark.parametrize("arch", archs.GATHER_MM_ARCHS)
def test_moe_on_cpu_keeps_float32(arch):
    cpu = {"backend": "cpu", "dtype": "float32", "fallback_dtype": "bfloat16"}
    assert fallback(archs.ARCHS[arch], cpu) is None
    assert fallback(archs.ARCHS[arch], {**cpu, "backend": "metal"}) == "bfloat16"
    assert fallback(archs.ARCHS["llama"], cpu) == "bfloat16"
    # without a fallback, a stage that does not fit in float32 stays float32 (and the plan refuses it)
    assert stage_dtype("float32", None, 100, {"float32": 200, "bfloat16": 100}) == "float32"

"""Capability probes (probe.py, DESIGN §5.1): sane, positive values; no timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kafilad.executor.blas import OPENBLAS_CANDIDATES
from kafilad.executor.probe import (available_memory_bytes, cgroup_headroom_bytes, measure_bandwidth_Bps,
                                    measure_capability, measure_stage_Bps)
from kafilad.executor.synth import synth_config


def mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def test_available_memory_is_below_total_and_honours_reserve():
    total = mem_total_bytes()
    m0 = available_memory_bytes(reserve_bytes=0)
    assert 0 < m0 <= total
    m1 = available_memory_bytes(reserve_bytes=1 << 30)
    assert m1 <= max(0, m0 - (1 << 30)) + (256 << 20)  # other processes may free memory meanwhile
    assert available_memory_bytes(reserve_bytes=total * 4) == 0
    room = cgroup_headroom_bytes()
    if room is not None:
        assert m0 <= room + (256 << 20)


def test_bandwidth_probe_is_plausible():
    bw = measure_bandwidth_Bps("float32", nbytes=8 << 20, repeats=3)
    assert 1e8 < bw < 1e13


def test_stage_probe_on_a_config_needs_no_weights():
    cfg = synth_config("qwen3", num_hidden_layers=4, hidden_size=128)
    bw, overhead = measure_stage_Bps(cfg, repeats=3)
    assert 1e6 < bw < 1e13
    assert 0.0 <= overhead < 1.0


def test_capability_report(stories260k):
    cap = measure_capability(stories260k)
    assert set(cap) == {"memory_bytes", "bandwidth_Bps", "step_overhead_s", "dtype", "bandwidth_source"}
    assert cap["dtype"] == "float32" and cap["bandwidth_source"] == "stage"
    assert isinstance(cap["memory_bytes"], int) and cap["memory_bytes"] > 0
    assert cap["bandwidth_Bps"] > 1e6 and cap["step_overhead_s"] >= 0.0


def test_capability_report_synth_twin(tmp_path):
    from kafilad.executor.synth import synthesize_model

    cap = measure_capability(synthesize_model(tmp_path, num_hidden_layers=2))
    assert cap["bandwidth_source"] == "stage" and cap["bandwidth_Bps"] > 1e6 and cap["memory_bytes"] > 0
    gemv = measure_capability(None)
    assert gemv["bandwidth_source"] == "gemv" and gemv["step_overhead_s"] == 0.0 and gemv["bandwidth_Bps"] > 1e8


def _blas_in_child(env_extra: dict) -> list[str]:
    env = {**os.environ, **env_extra}
    env.pop("OPENBLAS_NUM_THREADS", None)
    code = ("import os, kafilad.executor as e, mlx.core as mx; "
            "mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); print(e.BLAS_LIBRARY, os.environ['OPENBLAS_NUM_THREADS'])")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_blas_reference_switch_and_default():
    assert _blas_in_child({"KAFILA_BLAS": "reference"}) == ["None", "1"]
    installed = [p for p in OPENBLAS_CANDIDATES if p.startswith("/") and Path(p).exists()]
    lib, threads = _blas_in_child({"KAFILA_BLAS": "openblas"})
    assert threads == "1"
    assert lib == (installed[0] if installed else "None")


def test_blas_warns_when_mlx_came_first():
    code = ("import warnings, mlx.core; warnings.simplefilter('error'); import kafilad.executor")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KAFILA_BLAS": "openblas"},
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "mlx.core was imported before kafilad.executor" in p.stderr


def test_this_test_process_uses_openblas_when_installed():
    import kafilad.executor as ex

    installed = [p for p in OPENBLAS_CANDIDATES if p.startswith("/") and Path(p).exists()]
    if os.environ.get("KAFILA_BLAS", "openblas") == "openblas":
        assert ex.BLAS_LIBRARY == (installed[0] if installed else None)

"""Capability probes (probe.py, DESIGN §5.1): sane, positive values; no timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kafilad.executor.blas import OPENBLAS_CANDIDATES
import pytest

from kafilad.errors import PlanError
from kafilad.executor.probe import (available_memory_bytes, backend_name, cgroup_headroom_bytes,
                                    checkpoint_dtype_of, current_backend, measure_bandwidth_Bps,
                                    measure_capability, measure_stage, measure_stage_Bps, _rewind)
from kafilad.executor.synth import synth_config, synthesize_model
from kafilad.planner.precision import backend_dtypes, stage_dtype


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
    assert set(cap) == {"memory_bytes", "bandwidth_Bps", "step_overhead_s", "batch_row_cost", "dtype",
                        "fallback_dtype", "backend", "bandwidth_source"}
    assert cap["dtype"] == "float32" and cap["bandwidth_source"] == "stage"
    assert cap["fallback_dtype"] is None and cap["backend"] == current_backend()  # an f32 checkpoint: no fallback
    assert isinstance(cap["memory_bytes"], int) and cap["memory_bytes"] > 0
    assert cap["bandwidth_Bps"] > 1e6 and cap["step_overhead_s"] >= 0.0
    rho = cap["batch_row_cost"]  # a 4-row batched decode step against the 1-row one (issue 12)
    assert isinstance(rho, float) and 0.0 <= rho <= 1.0 and round(rho, 3) == rho


def test_capability_report_synth_twin(tmp_path):
    from kafilad.executor.synth import synthesize_model

    cap = measure_capability(synthesize_model(tmp_path, num_hidden_layers=2))
    assert cap["bandwidth_source"] == "stage" and cap["bandwidth_Bps"] > 1e6 and cap["memory_bytes"] > 0
    assert 0.0 <= cap["batch_row_cost"] <= 1.0
    gemv = measure_capability(None)
    assert gemv["bandwidth_source"] == "gemv" and gemv["step_overhead_s"] == 0.0 and gemv["bandwidth_Bps"] > 1e8
    assert gemv["batch_row_cost"] is None  # nothing to batch: unknown, planned as 1


# ---- rho: the batch row cost (issue 12; proto_spec 05 §2.6) ----------------------------------------
@pytest.mark.parametrize("arch, layers", [("llama", 8), ("qwen3", 2), ("llama", 1)])
def test_the_stage_probe_measures_rho_of_a_batched_decode_step(arch, layers):
    cfg = synth_config(arch, num_hidden_layers=layers, hidden_size=128)
    t = measure_stage(cfg, batch_rows=4, window_s=0.05)
    assert 0.0 <= t.batch_row_cost <= 1.0 and round(t.batch_row_cost, 3) == t.batch_row_cost
    assert 1e6 < t.bandwidth_Bps < 1e13 and t.step_overhead_s >= 0.0
    assert measure_stage(cfg, window_s=0.05).batch_row_cost is None  # batch 1 only: not measured


def test_rewinding_keeps_single_and_batched_caches_at_the_context():
    import mlx.core as mx

    from kafilad.executor.stage import build_random_stage

    stage = build_random_stage(synth_config("llama", num_hidden_layers=2, hidden_size=64), 2)
    cache = stage.make_cache()
    mx.eval(stage.run_blocks(mx.zeros((1, 16, 64)), cache))
    batch = [c.merge([c] * 4) for c in cache]  # as the runner's run_batch builds them
    for _ in range(3):
        mx.eval(stage.run_blocks(mx.full((1, 1, 64), 0.1), cache))
        _rewind(cache)
        out = stage.run_blocks(mx.full((4, 1, 64), 0.1), batch)
        mx.eval(out)
        assert out.shape == (4, 1, 64)
        _rewind(batch)
    assert [c.offset for c in cache] == [16, 16]
    assert [c.offset.tolist() for c in batch] == [[16] * 4] * 2 and [c._idx for c in batch] == [16, 16]


def test_a_measured_rho_crosses_the_capability_frame():
    from kafilad.proto import control as cf

    cap = measure_capability(synth_config("llama", num_hidden_layers=2, hidden_size=64))
    assert cap["bandwidth_source"] == "stage" and cap["batch_row_cost"] is not None
    frame = cf.decode_control(cf.Capability.from_measurement(cap).to_wire())
    assert frame.batch_row_cost == cap["batch_row_cost"] and frame.as_record()["batch_row_cost"] == cap["batch_row_cost"]


def _blas_in_child(env_extra: dict) -> list[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}, **env_extra}
    code = ("import os, kafilad.executor as e, mlx.core as mx; from kafilad.executor.blas import blas_threads; "
            "mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); print(e.BLAS_LIBRARY, blas_threads(), "
            "os.environ.get('OPENBLAS_NUM_THREADS'))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_blas_reference_switch_and_default():
    from kafilad.cpus import usable_cpus

    assert _blas_in_child({"KAFILA_BLAS": "reference"}) == ["None", "None", "None"]
    installed = [p for p in OPENBLAS_CANDIDATES if p.startswith("/") and Path(p).exists()]
    lib, threads, env = _blas_in_child({"KAFILA_BLAS": "openblas"})
    assert lib == (installed[0] if installed else "None")
    if installed:  # every CPU the process may use; the environment its children inherit unchanged
        assert threads == str(usable_cpus()) == str(len(os.sched_getaffinity(0))) and env == "None"
        assert _blas_in_child({"KAFILA_BLAS": "openblas", "OPENBLAS_NUM_THREADS": "1"})[1:] == ["1", "1"]


@pytest.mark.parametrize("proc, files, want", [
    ("1:cpu,cpuacct:/fleet_slow\n0::/\n", {"cpu,cpuacct/fleet_slow/cpu.cfs_quota_us": "2000",
                                             "cpu,cpuacct/fleet_slow/cpu.cfs_period_us": "10000"}, 0.2),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ("0::/user.slice/a.service\n", {"user.slice/a.service/cpu.max": "250000 100000\n"}, 2.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/gone\n", {}, None),
])
def test_cgroup_cpu_limit_reads_v1_and_v2(tmp_path, proc, files, want):
    from kafilad.cpus import cgroup_cpu_limit

    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    assert cgroup_cpu_limit(str(tmp_path / "proc_cgroup"), str(tmp_path)) == want


def test_a_daemon_under_a_quota_below_two_cpus_gets_one_blas_thread():
    """The emulated fleet (DESIGN §9, scripts/cg.sh): a process at 150 % of a core gets 1 thread."""
    group = Path("/sys/fs/cgroup/cpu/kafila_test_blas")
    if not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists() or os.geteuid() != 0 or not any(
            Path(p).exists() for p in OPENBLAS_CANDIDATES if p.startswith("/")):
        pytest.skip("needs root, cgroup v1's cpu controller and OpenBLAS (as on the CI machine)")
    group.mkdir(exist_ok=True)
    try:
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text("15000")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_")}
        code = (f"open('{group}/cgroup.procs', 'w').write(str(__import__('os').getpid())); "
                "import os, kafilad.executor; from kafilad.executor.blas import blas_threads; "
                "print(blas_threads(), os.environ['OPENBLAS_THREAD_TIMEOUT'])")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
        assert out == ["1", "4"]
    finally:
        group.rmdir()


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


# ---- the dtype a member reports (issue 12 item 4; kafilad/planner/precision.py) ---------------------
@pytest.mark.parametrize("backend, checkpoint, want", [
    ("metal", "bfloat16", ("bfloat16", None)),
    ("cuda", "bfloat16", ("bfloat16", None)),
    ("metal", "float16", ("float16", None)),
    ("cuda", "float32", ("float32", None)),
    ("cpu", "bfloat16", ("float32", "bfloat16")),
    ("cpu", "float16", ("float32", "float16")),
    ("cpu", "float32", ("float32", None)),
])
def test_backend_dtype_rule(backend, checkpoint, want):
    assert backend_dtypes(backend, checkpoint) == want


def test_backend_dtype_rule_refuses_what_it_does_not_know():
    with pytest.raises(PlanError, match="Unknown backend 'tpu'"):
        backend_dtypes("tpu", "bfloat16")
    with pytest.raises(PlanError, match="dtype 'int8'"):
        backend_dtypes("cpu", "int8")


def test_cpu_holds_float32_when_memory_allows_else_the_checkpoint_dtype():
    dtype, fallback = backend_dtypes("cpu", "bfloat16")
    stage = {"float32": 2000, "bfloat16": 1000}
    assert stage_dtype(dtype, fallback, 2000, stage) == "float32"  # the f32 stage fits exactly
    assert stage_dtype(dtype, fallback, 1999, stage) == "bfloat16"  # one byte short: the checkpoint's
    assert stage_dtype(dtype, fallback, 999, stage) == "bfloat16"  # nothing fits: the narrower, named in refusals
    gpu, none = backend_dtypes("metal", "bfloat16")
    assert stage_dtype(gpu, none, 10, {"bfloat16": 1000}) == "bfloat16"  # a GPU never widens


def test_backend_of_the_default_device():
    assert backend_name("cpu", True) == "cpu"
    assert backend_name("gpu", True) == "metal"
    assert backend_name("gpu", False) == "cuda"
    assert current_backend() in ("cpu", "metal", "cuda")


def test_checkpoint_dtype_from_headers_admitted_frame_or_config(tmp_path):
    bf16 = synthesize_model(tmp_path / "bf", num_hidden_layers=2, dtype="bfloat16")
    f32 = synthesize_model(tmp_path / "f", num_hidden_layers=2)
    assert checkpoint_dtype_of(bf16) == "bfloat16" and checkpoint_dtype_of(f32) == "float32"
    assert checkpoint_dtype_of({"torch_dtype": "float16"}) == "float16"
    assert checkpoint_dtype_of({"torch_dtype": "float16"}, "bfloat16") == "bfloat16"  # the host's word wins
    assert checkpoint_dtype_of({}) == "float32"


def test_capability_reports_and_times_the_backend_dtype(tmp_path):
    bf16 = synthesize_model(tmp_path, num_hidden_layers=2, dtype="bfloat16")
    gpu = measure_capability(bf16, backend="cuda")  # a CUDA member's choice (timed here on this device)
    assert (gpu["dtype"], gpu["fallback_dtype"], gpu["backend"]) == ("bfloat16", None, "cuda")
    assert gpu["bandwidth_source"] == "stage" and gpu["bandwidth_Bps"] > 1e6
    cpu = measure_capability(bf16, backend="cpu")
    assert (cpu["dtype"], cpu["fallback_dtype"]) == ("float32", "bfloat16")
    cfg = measure_capability(synth_config("llama", num_hidden_layers=2, hidden_size=64), backend="metal",
                             checkpoint_dtype="float16")
    assert (cfg["dtype"], cfg["fallback_dtype"]) == ("float16", None)


# ---- the fit and the rounds under a time-sliced CPU (a busy machine, a CPU quota) -------------------
def test_fit_takes_medians_of_paired_rounds_so_one_disturbed_round_does_not_move_it():
    from kafilad.executor.probe import fit_block_overhead_s

    ms = 1e-3
    one = [(10 * ms * 5, 5), (10 * ms * 5, 5), (30 * ms * 5, 5), (10 * ms * 5, 5), (11 * ms * 5, 5)]
    two = [(18 * ms * 4, 4), (18 * ms * 4, 4), (60 * ms * 4, 4), (18 * ms * 4, 4), (19 * ms * 4, 4)]
    per_block_s, overhead_s = fit_block_overhead_s(one, two)
    assert per_block_s == pytest.approx(8 * ms) and overhead_s == pytest.approx(2 * ms)
    # the window means would have read (t2 - t1) = 26.6 - 14.2 ms: a 55 % higher per-block time
    assert fit_block_overhead_s(one, None) == (pytest.approx(10 * ms), 0.0)  # one block: no split
    slower_one = [(20 * ms, 1)] * 3
    assert fit_block_overhead_s(slower_one, [(15 * ms, 1)] * 3) == (pytest.approx(20 * ms), 0.0)  # no positive slope


class _FakeClock:
    """time.perf_counter for `_interleaved_chunks_s`: calls advance it by the durations given."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(clock: _FakeClock, durations_s):
    it = iter(durations_s)

    def fn():
        clock.now += next(it)
    return fn


def test_rounds_stop_at_the_base_window_when_chunks_agree_and_go_on_while_they_scatter(monkeypatch):
    import itertools

    from kafilad.executor import probe

    clock = _FakeClock()
    monkeypatch.setattr(probe.time, "perf_counter", clock)
    steady = _timed(clock, itertools.repeat(0.01))
    chunks = probe._interleaved_chunks_s([steady], 1, [0.25], rounds=5, stable_within=0.02, max_rounds=15)
    assert len(chunks[0]) == 5 and all(n in (5, 6) for _, n in chunks[0])  # 50 ms chunks of 10 ms calls (+ rounding)
    # chunks alternately 10 ms and 30 ms per call (a quota's gaps landing in some chunks): the relative
    # standard error stays above 2 %, so rounds continue up to max_rounds
    jitter = _timed(clock, itertools.cycle([0.01] * 6 + [0.03] * 2))
    watched_only = _timed(clock, itertools.repeat(0.01))
    chunks = probe._interleaved_chunks_s([watched_only, jitter], 1, [0.25, 0.25], rounds=5, stable_within=0.02,
                                         max_rounds=15, watched=2)
    assert [len(c) for c in chunks] == [15, 15]
    chunks = probe._interleaved_chunks_s([steady, jitter], 1, [0.25, 0.25], rounds=5, stable_within=0.02,
                                         max_rounds=15, watched=1)  # the scattered one is not watched
    assert [len(c) for c in chunks] == [5, 5]
    chunks = probe._interleaved_chunks_s([jitter], 1, [0.25], rounds=5)  # stable_within 0: the base window only
    assert len(chunks[0]) <= 5 and sum(s for s, _ in chunks[0]) >= 0.25

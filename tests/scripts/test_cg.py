"""scripts/cg.sh, the cgroup v1 fleet-emulation helper (DESIGN §9 item 4; ../shared/fleet-emulation.md),
and the prediction side of scripts/validate_cost_model.py.

Real cgroups: needs root and cgroup v1 cpu + memory controllers; skipped elsewhere. No timing is
asserted (the benchmark itself is scripts/validate_cost_model.py); these check what the helper
writes, that `run` really places a process in both groups, and that the validation predicts with
the planner's own cost model.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CG = REPO / "scripts" / "cg.sh"
CPU = Path("/sys/fs/cgroup/cpu")


def _memroot() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
    pytest.skip("no cgroup v1 memory controller")


needs_cgroup = pytest.mark.skipif(os.geteuid() != 0 or not (CPU / "cpu.cfs_quota_us").exists(),
                                  reason="needs root and cgroup v1 at /sys/fs/cgroup/cpu")


def cg(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CG), *args], capture_output=True, text=True, check=check)


@pytest.fixture
def group():
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    cg("rm", name, check=False)


@needs_cgroup
def test_mk_writes_period_quota_and_memory_limit(group):
    out = cg("mk", group, "25", "300", "10000").stdout
    d = CPU / f"fleet_{group}"
    assert (d / "cpu.cfs_period_us").read_text().strip() == "10000"
    assert (d / "cpu.cfs_quota_us").read_text().strip() == "2500"
    mem = _memroot() / f"fleet_{group}"
    assert int((mem / "memory.limit_in_bytes").read_text()) == 300 * 1024 * 1024
    assert out.strip() == f"fleet_{group}: period=10000 quota=2500 mem={300 * 1024 * 1024}"


@needs_cgroup
def test_mk_zero_means_unlimited(group):
    cg("mk", group, "0", "0", "10000")
    assert (CPU / f"fleet_{group}" / "cpu.cfs_quota_us").read_text().strip() == "-1"
    assert int((_memroot() / f"fleet_{group}" / "memory.limit_in_bytes").read_text()) >= 1 << 60


@needs_cgroup
def test_run_places_the_command_in_both_groups_and_rm_removes_them(group):
    cg("mk", group, "50", "256", "10000")
    own = cg("run", group, "cat", "/proc/self/cgroup").stdout
    lines = {ctrl: rel for _, ctrl, rel in (l.split(":", 2) for l in own.splitlines())}
    cpu_rel = next(rel for ctrl, rel in lines.items() if "cpu" in ctrl.split(","))
    mem_rel = next(rel for ctrl, rel in lines.items() if "memory" in ctrl.split(","))
    assert cpu_rel == f"/fleet_{group}"
    assert mem_rel.endswith(f"/fleet_{group}")
    stat = cg("stat", group).stdout
    assert stat.startswith(f"fleet_{group}: nr_periods ") and "failcnt=0" in stat
    cg("rm", group)
    assert not (CPU / f"fleet_{group}").exists()
    assert not (_memroot() / f"fleet_{group}").exists()


@needs_cgroup
def test_runmem_joins_only_the_memory_group(group):
    cg("mk", group, "50", "256", "10000")
    own = cg("runmem", group, "cat", "/proc/self/cgroup").stdout
    lines = {ctrl: rel for _, ctrl, rel in (l.split(":", 2) for l in own.splitlines())}
    assert next(rel for ctrl, rel in lines.items() if "memory" in ctrl.split(",")).endswith(f"/fleet_{group}")
    assert next(rel for ctrl, rel in lines.items() if "cpu" in ctrl.split(",")) != f"/fleet_{group}"


def test_usage_errors_exit_64():
    assert cg("mk", check=False).returncode == 64
    assert cg("bogus", "x", check=False).returncode == 64
    assert "unknown command bogus" in cg("bogus", "x", check=False).stderr


def test_validation_predicts_with_the_planner_cost_model(tmp_path):
    """predict_s is the planner's stage_s (DESIGN §5.1) for a device at quota q: base / q."""
    import importlib.util

    from kafilad.executor.synth import synthesize_model
    from kafilad.modelinfo import read_model_info

    spec = importlib.util.spec_from_file_location("validate_cost_model", REPO / "scripts" / "validate_cost_model.py")
    vcm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vcm)
    d = synthesize_model(tmp_path / "m", arch="llama", num_hidden_layers=4, hidden_size=64, dtype="bfloat16")
    prof = read_model_info(d).profile(float_dtype_bytes=4)
    bw, ov = 2.0e9, 1.0e-4
    pred, nbytes = vcm.predict_s(str(d), 1, 3, False, bw, ov, 1.0)
    assert nbytes == prof.block_bytes[1] + prof.block_bytes[2]  # held as f32: twice the stored bf16 bytes
    assert nbytes == 2 * sum(t.nbytes for t in read_model_info(d).stage_tensors(1, 3, False))
    assert pred == pytest.approx(ov + nbytes / bw, rel=1e-12)
    head, head_bytes = vcm.predict_s(str(d), 0, 2, True, bw, ov, 1.0)
    assert head_bytes == prof.block_bytes[0] + prof.block_bytes[1] + prof.head_read_bytes
    assert head == pytest.approx(ov + head_bytes / bw, rel=1e-12)
    for q in (0.5, 0.25, 0.1):
        assert vcm.predict_s(str(d), 1, 3, False, bw, ov, q)[0] == pytest.approx(pred / q, rel=1e-12)
    # the measured stages cover the model: a 3-way split from block 0, and the whole model with the head
    stages = vcm.stages_for(8)
    assert stages[0][0] == 0 and stages[0][2] and stages[2][1] == 8
    assert all(a < b for a, b, _ in stages) and stages[0][1] == stages[1][0] and stages[1][1] == stages[2][0]
    assert stages[3] == (0, 8, True)

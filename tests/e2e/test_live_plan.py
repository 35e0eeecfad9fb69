"""Issue 4 "Done when": the daemon's plan for a live session equals `kafila-ctl plan` on the
measured fleet (DESIGN §5; proto_spec/06-fleet.md: `status --json` reports the live `fleet` in
the fleet-file format, so the offline planner must reproduce the live plan from it).

Real processes on loopback: a rendezvous and three kafilad daemons (kafila_ctl.demo.LoopbackCluster),
each measuring its own capability with the real probe; `kafila-ctl status --json` and
`kafila-ctl plan` run as separate processes, as a user would run them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kafila_ctl.demo import LoopbackCluster

pytestmark = pytest.mark.slow

PLAN_KEYS_EXACT = ("order", "head", "blocks", "tier", "n_blocks", "context", "concurrency", "resident_bytes",
                   "memory_bytes", "strategy")
PLAN_KEYS_APPROX = ("bottleneck_s", "circuit_s", "utilization", "imbalance")


def kafila_ctl(*args: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "kafila_ctl.cli", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def live_and_offline(model_dir: Path, root: Path) -> tuple[dict, dict, dict]:
    """Form a 3-member session on `model_dir`; return (status, live plan, offline plan of its fleet)."""
    with LoopbackCluster(3, root=str(root)) as cluster:
        cluster.form(str(model_dir), context=512, concurrency=1)
        rc, out, err = kafila_ctl("--state-dir", str(cluster.state_dir(0)), "status", "--json")
        assert rc == 0, err
        status = json.loads(out)
    assert status["state"] == "ready"
    fleet, live = status["fleet"], status["plan"]
    fleet_file = root / "fleet.json"
    fleet_file.write_text(json.dumps(fleet))
    rc, out, err = kafila_ctl("plan", "--fleet", str(fleet_file), "--model", str(model_dir), "--json",
                              "--hold-dtype", "f32", "--strategy", live["strategy"])  # the cluster forms "kafila"
    assert rc == 0, err
    return status, live, json.loads(out)


def check_equal(status: dict, live: dict, offline: dict, n_blocks: int) -> None:
    # the fleet is what the members measured, in the fleet-file format: the host (anchor) first,
    # then the members in the order they joined (concurrent joins: any order)
    devices = status["fleet"]["devices"]
    assert devices[0]["name"] == "m0" and sorted(d["name"] for d in devices) == ["m0", "m1", "m2"]
    assert all(d["bandwidth_Bps"] > 0 and d["memory_bytes"] > 0 for d in devices)
    assert status["fleet"]["context"] == 512 and status["fleet"]["concurrency"] == 1
    assert live["tier"] == "cost-model" and live["n_blocks"] == n_blocks
    assert offline["hold_dtype"] == "f32"
    for k in PLAN_KEYS_EXACT:
        assert offline[k] == live[k], k
    assert set(offline["stage_s"]) == set(live["stage_s"]) == {"m0", "m1", "m2"}
    for name, s in live["stage_s"].items():
        assert offline["stage_s"][name] == pytest.approx(s, rel=1e-9), name
    for k in PLAN_KEYS_APPROX:
        assert offline[k] == pytest.approx(live[k], rel=1e-9), k
    assert offline["bottleneck_s"] == pytest.approx(max(live["stage_s"].values()), rel=1e-12)
    # the members were given exactly the blocks of that plan
    by_name = {m["name"]: m for m in status["members"]}
    for name, (a, b) in live["blocks"].items():
        assert by_name[name]["blocks"] == [a, b]
        assert by_name[name]["head"] == (name == live["head"])


def test_live_plan_equals_offline_plan_stories260k(stories260k, tmp_path):
    status, live, offline = live_and_offline(stories260k, tmp_path)
    check_equal(status, live, offline, 5)


@pytest.fixture(scope="module")
def synth_bf16(tmp_path_factory) -> Path:
    """A synthesised Qwen3 stored in bfloat16: the daemon casts it to f32 (DESIGN §6), so the
    offline planner agrees only when told `--hold-dtype f32`."""
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("synth") / "synth-qwen3-bf16", arch="qwen3", seed=3,
                            num_hidden_layers=6, hidden_size=128, dtype="bfloat16")


def test_live_plan_equals_offline_plan_synth(synth_bf16, tmp_path):
    status, live, offline = live_and_offline(synth_bf16, tmp_path)
    check_equal(status, live, offline, 6)
    # as stored (bf16) the same fleet holds half the weight bytes: the flag is what makes them agree
    rc, out, err = kafila_ctl("plan", "--fleet", str(tmp_path / "fleet.json"), "--model", str(synth_bf16),
                              "--json", "--hold-dtype", "stored")
    assert rc == 0, err
    stored = json.loads(out)
    assert stored["resident_bytes"] != live["resident_bytes"]
    assert sum(stored["resident_bytes"].values()) < sum(live["resident_bytes"].values())

"""Issue 12: each member's measured batch row cost rho reaches the host's Devices and its plan.

A member reports rho in its capability frame (kafilad/executor/probe.py, proto_spec 05 §2.6); the
host builds each Device with it (kafilad/node/session/host.py) and the plan's predictions for K users
follow it (kafilad/planner/throughput.py). ``KAFILA_TEST_CAPABILITY`` overrides it like any other
capability field.
"""

from __future__ import annotations

import json

import pytest
from trio.testing import trio_test

from kafilad.executor.synth import synth_config
from kafilad.node.serving import stagehost
from kafilad.planner.throughput import predict
from kafilad.proto import control as cf
import node.session_harness as harness
from node.session_harness import CAPABILITY, session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kafilad.executor.synth import synthesize_model
    return synthesize_model(tmp_path_factory.mktemp("rho") / "synth", arch="llama", seed=7,
                            num_hidden_layers=3, hidden_size=32)


def test_the_daemon_reports_a_measured_rho_and_the_test_hook_overrides_it(monkeypatch):
    cfg = synth_config("llama", num_hidden_layers=2, hidden_size=64)
    monkeypatch.delenv(stagehost.TEST_CAPABILITY_ENV, raising=False)
    measured = stagehost.measure_capability(cfg)
    assert measured["bandwidth_source"] == "stage" and 0.0 <= measured["batch_row_cost"] <= 1.0
    monkeypatch.setenv(stagehost.TEST_CAPABILITY_ENV, json.dumps({"batch_row_cost": 0.3, "bandwidth_Bps": 1e6}))
    cap = stagehost.measure_capability(cfg)
    assert (cap["batch_row_cost"], cap["bandwidth_Bps"]) == (0.3, 1e6)
    frame = cf.decode_control(cf.Capability.from_measurement(cap).to_wire())  # as a member sends it
    assert frame.as_record()["batch_row_cost"] == 0.3


@trio_test
async def test_the_host_plans_with_each_members_rho(tmp_path, model_dir, monkeypatch):
    # members report rho 0.05 in their capability frames; the host measures its own 0.02
    monkeypatch.setattr(harness, "CAPABILITY", {**CAPABILITY, "batch_row_cost": 0.05})
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        w.host_capability = {**CAPABILITY, "batch_row_cost": 0.02}
        h, _ = await w.form(2, concurrency=4)
        assert {d.name: d.batch_row_cost for d in h.fleet_devices} == {"h": 0.02, "m1": 0.05, "m2": 0.05}
        assert {d["name"]: d["batch_row_cost"] for d in h.fleet_json()["devices"]} == {"h": 0.02, "m1": 0.05,
                                                                                       "m2": 0.05}
        p = h.snapshot()["plan"]
        stage = [p["stage_s"][n] for n in p["order"]]
        rho = [{"h": 0.02, "m1": 0.05, "m2": 0.05}[n] for n in p["order"]]
        hop = p["circuit_s"] - sum(stage)
        one, k = p["throughput"]
        assert k["users"] == 4 and k["tokens_per_s"] == pytest.approx(predict(stage, rho, hop, 4).tokens_per_s,
                                                                       rel=1e-12)
        # what rho = 1 would say: slower wherever the best schedule batches rows; with a hop (the
        # measured loopback RTT) longer than the stages, 4 one-row micro-batches win and rho drops out
        worst = predict(stage, [1.0] * 3, hop, 4).tokens_per_s
        assert k["tokens_per_s"] > worst if k["rows"] > 1 else k["tokens_per_s"] >= worst
        assert one["tokens_per_s"] == pytest.approx(predict(stage, rho, hop, 1).tokens_per_s, rel=1e-12)

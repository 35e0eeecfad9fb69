"""The batch row cost rho (issue 12): the probe's formula, and plans whose predictions for K users
follow each device's measured rho (kafilad/planner/throughput.py; proto_spec 05 §2.6, 06 §2)."""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

import pytest

from kafila_ctl import plan_cmd
from kafilad.planner import Device, ModelProfile, plan
from kafilad.planner.fleet import fleet_to_json, load_fleet
from kafilad.planner.throughput import batch_row_cost_of, predict

REPO = Path(__file__).resolve().parents[2]


# ---- the formula: rho = (median t(B)/t(1) - 1) / (B - 1), clamped to [0, 1], 3 digits ------------------
def test_the_issues_measurement_gives_rho_0_024():
    # 8 Llama blocks (hidden 512): 4 rows 13.2 ms, 1 row 12.3 ms -> (1.0732 - 1) / 3
    assert batch_row_cost_of([12.3e-3], [13.2e-3], 4) == 0.024


@pytest.mark.parametrize("one, batch, rows, rho", [
    ([1.0, 1.0, 1.0], [1.3, 1.06, 9.0], 4, 0.1),      # median of the ratios: 1.3; the 9x outlier does not count
    ([1.0, 1.0], [1.06, 1.12], 4, 0.03),              # an even count: the mean of the middle two, 1.09
    ([2.0, 4.0, 1.0], [2.2, 4.4, 1.1], 4, 0.033),     # ratios, not times: each pair is 1.1
    ([2.0], [3.0], 2, 0.5),
    ([0.01], [0.04], 4, 1.0),                         # as dear as 4 separate steps
    ([0.01], [0.05], 4, 1.0),                         # dearer: clamped to 1
    ([0.012], [0.011], 4, 0.0),                       # a batched step faster than one row: clamped to 0
    ([0.012], [0.012], 4, 0.0),
    ([1.0], [1.0004], 2, 0.0),                        # 0.0004 rounds to 0.000
    ([1.0], [1.0006], 2, 0.001),
])
def test_batch_row_cost_exact_values(one, batch, rows, rho):
    assert batch_row_cost_of(one, batch, rows) == rho


@pytest.mark.parametrize("one, batch, rows, fragment", [
    ([1.0], [1.1], 1, "at least 2 rows"),
    ([], [], 4, "non-empty"),
    ([1.0, 1.0], [1.1], 4, "equal"),
    ([0.0], [1.1], 4, "positive"),
    ([1.0], [-1.0], 4, "positive"),
])
def test_batch_row_cost_refuses_what_gives_no_rho(one, batch, rows, fragment):
    with pytest.raises(ValueError, match=fragment):
        batch_row_cost_of(one, batch, rows)


# ---- plans: the predictions for K users follow rho ------------------------------------------------------
#: four blocks of 1000 bytes; two devices at 1000 B/s hold two each (2 s stages), no RTT known (hop 0)
MODEL = ModelProfile(model_id="m", block_bytes=(1000,) * 4, head_read_bytes=0, head_resident_bytes=0,
                     kv_bytes_per_block_token=0)


def pair(rho_a, rho_b) -> list[Device]:
    return [Device(name="a", memory_bytes=10 ** 6, bandwidth_Bps=1000.0, batch_row_cost=rho_a),
            Device(name="b", memory_bytes=10 ** 6, bandwidth_Bps=1000.0, batch_row_cost=rho_b)]


@pytest.mark.parametrize("strategy", ["kafila", "load", "uniform", "memory"])
@pytest.mark.parametrize("rho_a, rho_b, tokens_per_s, micro_batches, rows", [
    # unknown = 1: K = 4 single rows, round = max(4, 4 x 2) = 8 s (DESIGN §10's formula)
    (None, None, 4 / 8.0, 4, 1),
    (1.0, 1.0, 4 / 8.0, 4, 1),
    # rho = 0.02: 2 micro-batches of 2 rows, stages 2 x 1.02 = 2.04 s, round max(4.08, 2 x 2.04) = 4.08 s
    (0.02, 0.02, 4 / 4.08, 2, 2),
    # rho = 0: a 2-row step costs one row: round max(4, 2 x 2) = 4 s (P = 2 ties P = 1 and wins: most P)
    (0.0, 0.0, 4 / 4.0, 2, 2),
    # one measured, one unknown: P = 4 (8 s) ties P = 2 (a 2 s, b 4 s: max(6, 8)); the unknown binds
    (0.0, None, 4 / 8.0, 4, 1),
    # 0.25 and 0.5: P = 2: 2.5 s and 3 s, round max(5.5, 6) = 6 s; P = 1: 3.5 s and 5 s, round 8.5 s
    (0.25, 0.5, 4 / 6.0, 2, 2),
])
def test_plan_predictions_for_k_users_follow_rho(strategy, rho_a, rho_b, tokens_per_s, micro_batches, rows):
    p = plan(pair(rho_a, rho_b), MODEL, context=16, concurrency=4, strategy=strategy)
    if strategy == "load" and (rho_a, rho_b) == (0.0, None):
        # the load objective leaves the unknown member on standby: a alone, 4 rows in one 4 s step; the
        # best with both is a 3 s, b 1 s: P = 2 of 2 rows, b's step 2 s, round max(5, 2 x 3) = 6 s
        assert p.blocks == {"a": (0, 4)} and p.standby == ("b",) and p.full_fleet_tokens_per_s == 4 / 6.0
        assert [(t.users, t.tokens_per_s, t.micro_batches, t.rows) for t in p.throughput] == [(1, 1 / 4.0, 1, 1),
                                                                                             (4, 1.0, 1, 4)]
        return
    assert p.blocks == {"a": (0, 2), "b": (2, 4)} and p.stage_s == {"a": 2.0, "b": 2.0}
    one, k = p.throughput
    assert one.users == 1 and one.tokens_per_s == pytest.approx(1 / 4.0, rel=1e-12)  # 1 user: the circuit alone
    assert k.users == 4 and k.tokens_per_s == pytest.approx(tokens_per_s, rel=1e-12)
    assert (k.micro_batches, k.rows) == (micro_batches, rows)
    assert p.to_json()["throughput"][-1]["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)


@pytest.mark.parametrize("rho, kafila_rate, load_blocks, load_rate", [
    # rho = 1: 8 single rows, bound by the 1 s stages: max(2, 8 x 1) = 8 s; load keeps the same division
    (None, 8 / 8.0, {"a": (0, 4), "b": (4, 5)}, 8 / 8.0),
    # rho = 0.5: 2 micro-batches of 4 rows, stages 2.5 s: max(5, 2 x 2.5) = 5 s
    (0.5, 8 / 5.0, {"a": (0, 4), "b": (4, 5)}, 8 / 5.0),
    # rho = 0: kafila's division serves 2 x 4 rows in max(2, 2 x 1) = 2 s; load puts all 5 blocks on a
    # (1.25 s) and one batch of 8 rows goes round in 1.25 s, b on standby
    (0.0, 8 / 2.0, {"a": (0, 5)}, 8 / 1.25),
])
def test_the_kafila_prediction_and_the_load_division_follow_rho(rho, kafila_rate, load_blocks, load_rate):
    # a fast (4000 B/s) and a slow (1000 B/s) member, 5 blocks of 1000 bytes, 8 users
    devices = [Device(name="a", memory_bytes=10 ** 6, bandwidth_Bps=4000.0, batch_row_cost=rho),
               Device(name="b", memory_bytes=10 ** 6, bandwidth_Bps=1000.0, batch_row_cost=rho)]
    model = ModelProfile(model_id="m", block_bytes=(1000,) * 5, head_read_bytes=0, head_resident_bytes=0,
                         kv_bytes_per_block_token=0)
    k = plan(devices, model, context=16, concurrency=8, strategy="kafila")
    assert k.blocks == {"a": (0, 4), "b": (4, 5)}  # kafila minimises the bottleneck whatever rho is ...
    assert k.throughput[0].tokens_per_s == pytest.approx(1 / 2.0, rel=1e-12)
    assert k.throughput[-1].tokens_per_s == pytest.approx(kafila_rate, rel=1e-12)  # ... and predicts with it
    ld = plan(devices, model, context=16, concurrency=8, strategy="load")
    assert ld.blocks == load_blocks
    assert ld.throughput[-1].tokens_per_s == pytest.approx(load_rate, rel=1e-12)


# ---- fleet files and `kafila-ctl plan` carry it ----------------------------------------------------------
def test_a_fleet_round_trips_batch_row_cost(tmp_path):
    devices = pair(0.02, None)
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps(fleet_to_json(devices, 16, 4)))
    back = load_fleet(f)
    assert [d.batch_row_cost for d in back.devices] == [0.02, None]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    headers = runpy.run_path(str(REPO / "scripts" / "make_model_headers.py"))
    out = tmp_path_factory.mktemp("models")
    headers["make_model"](out, "qwen3-14b", "single")
    return out / "qwen3-14b"


def run_plan_json(fleet: dict, model: Path, tmp_path: Path, capsys) -> dict:
    f = tmp_path / "fleet.json"
    f.write_text(json.dumps(fleet))
    p = argparse.ArgumentParser(prog="kafila-ctl")
    plan_cmd.add_parser(p.add_subparsers(required=True))
    a = p.parse_args(["plan", "--fleet", str(f), "--model", str(model), "--json", "--context", "1024",
                      "--concurrency", "8", "--strategy", "kafila"])
    assert a.func(a) == 0
    return json.loads(capsys.readouterr().out)


def test_kafila_ctl_plan_predicts_k_users_with_each_devices_rho(qwen_dir, tmp_path, capsys):
    def fleet(rho_mac, rho_pc):
        devs = [{"name": "mac", "memory_bytes": 24 << 30, "bandwidth_Bps": 100e9, "step_overhead_s": 0.002},
                {"name": "pc", "memory_bytes": 24 << 30, "bandwidth_Bps": 50e9, "step_overhead_s": 0.002}]
        for d, rho in zip(devs, (rho_mac, rho_pc)):
            if rho is not None:
                d["batch_row_cost"] = rho
        return {"name": "pair", "devices": devs}

    unknown = run_plan_json(fleet(None, None), qwen_dir, tmp_path, capsys)
    measured = run_plan_json(fleet(0.02, 0.05), qwen_dir, tmp_path, capsys)
    assert run_plan_json(fleet(1.0, 1.0), qwen_dir, tmp_path, capsys)["throughput"] == unknown["throughput"]
    assert measured["blocks"] == unknown["blocks"]  # the kafila division does not depend on rho
    stage = [measured["stage_s"][n] for n in measured["order"]]
    hop = measured["circuit_s"] - sum(stage)
    rho = [{"mac": 0.02, "pc": 0.05}[n] for n in measured["order"]]
    want = predict(stage, rho, hop, 8)
    got = measured["throughput"][-1]
    assert got["bound"] == want.bound
    assert {k: v for k, v in got.items() if k != "bound"} == pytest.approx(
        {k: v for k, v in want.to_json().items() if k != "bound"}, rel=1e-12)
    assert (got["micro_batches"], got["rows"]) == (want.micro_batches, want.rows) and want.rows > 1
    # 8 users: without rho 8 single rows, bound by the slowest stage; with rho a few batched rows
    assert got["tokens_per_s"] > 2 * unknown["throughput"][-1]["tokens_per_s"]
    assert unknown["throughput"][-1]["rows"] == 1
    assert measured["throughput"][0] == unknown["throughput"][0]  # 1 user: the circuit, rho or not

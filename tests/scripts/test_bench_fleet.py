"""scripts/bench_fleet.py and its fleet_harness / fleet_report modules (issue 12 item 7): the pure
parts, and a --quick smoke run without cgroups.

The pure parts are the fleet and argument parsing, the capability a quota stands for, reading the
plan's predictions and the `end` frames' stage rows out of a status snapshot, the sub-fleets and
the planner's predictions for them, and the ratios and verdicts against issue 12's targets. The
smoke run starts real daemons and a 3-rank mlx-lm pipeline on a tiny model (no quotas: its
ratios mean nothing; it checks that every path runs and that nothing is left behind).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_fleet.py"
_spec = importlib.util.spec_from_file_location("bench_fleet", SCRIPT)
bf = importlib.util.module_from_spec(_spec)
sys.modules["bench_fleet"] = bf  # dataclasses look their module up while the class is made
_spec.loader.exec_module(bf)
import fleet_harness as fh  # noqa: E402 - beside the script, on sys.path once it is loaded
import fleet_report as fr  # noqa: E402


def test_parse_fleet_reads_name_quota_memory_host_first():
    fleet = fh.parse_fleet("fast:80:900, mid:40:1300,slow:20:700")
    assert [(m.name, m.quota_pct, m.mem_mb) for m in fleet] == [("fast", 80, 900), ("mid", 40, 1300), ("slow", 20, 700)]
    assert fleet[0].group == "bf_fast"
    assert fh.total_quota_cores(fleet) == pytest.approx(1.4)
    assert fh.total_quota_cores(fh.parse_fleet("a:0:0,b:50:0")) == pytest.approx(1.5)  # unlimited counts as a core


@pytest.mark.parametrize("text, words", [
    ("fast:80", "NAME:QUOTA_PCT:MEM_MB"), ("fast:x:900,b:1:1", "integers"), ("fast:120:900,b:1:1", "0-100"),
    ("fast:80:900", "at least 2"), ("a:1:1,a:2:2", "unique"), ("a-b:1:1,c:1:1", "NAME:QUOTA_PCT:MEM_MB")])
def test_parse_fleet_refuses_malformed(text, words):
    with pytest.raises(ValueError, match=words):
        fh.parse_fleet(text)


def test_parse_args_defaults_and_quick():
    full = bf.parse_args([])
    assert (full.tokens, full.runs, full.concurrency, full.hidden, full.layers, full.sub_fleets) == (32, 3, 6, 512, 16, 2)
    assert full.strategy_list == ["kafila", "uniform", "memory", "load"]
    quick = bf.parse_args(["--quick", "--tokens", "5"])
    assert quick.tokens == 5  # an explicit value wins over --quick
    assert (quick.runs, quick.hidden, quick.layers, quick.concurrency, quick.sub_fleets) == (1, 128, 6, 2, 0)
    with pytest.raises(SystemExit):
        bf.parse_args(["--strategies", "kafila,fastest"])
    with pytest.raises(SystemExit):
        bf.parse_args(["--runs", "0"])


def test_scaled_capability_is_base_times_quota():
    base = {"bandwidth_Bps": 6e9, "step_overhead_s": 2e-4, "memory_bytes": 1}
    assert fh.scaled_capability(base, 40) == {"bandwidth_Bps": pytest.approx(2.4e9), "step_overhead_s": pytest.approx(5e-4)}
    assert fh.scaled_capability(base, 0) == {"bandwidth_Bps": 6e9, "step_overhead_s": 2e-4}  # unlimited
    assert fh.scaled_capability({"bandwidth_Bps": 1e9}, 50)["step_overhead_s"] == 0.0


def test_parse_args_calibration_defaults_to_the_probe_inside_the_groups():
    assert bf.parse_args([]).calibration == "probe"
    assert bf.parse_args(["--calibration", "scaled"]).calibration == "scaled"
    with pytest.raises(SystemExit):
        bf.parse_args(["--calibration", "guess"])


def test_probe_calibration_starts_daemons_in_both_groups_scaled_in_the_memory_group_only():
    member = fh.Member("nosuch_member_xyz", 20, 700)
    argv = ["python", "-m", "kafilad.main"]
    probe = fh.Cgroups([member], enabled=True, calibration="probe")
    scaled = fh.Cgroups([member], enabled=True, calibration="scaled")
    assert probe.wrap(member, argv) == ["bash", str(fh.CG), "run", "bf_nosuch_member_xyz", *argv]
    assert scaled.wrap(member, argv) == ["bash", str(fh.CG), "runmem", "bf_nosuch_member_xyz", *argv]
    assert fh.Cgroups([member], enabled=False, calibration="probe").wrap(member, argv) == argv
    probe.throttle(member, 1)  # already in its CPU group: nothing to move (the group does not exist here)
    with pytest.raises(OSError):  # scaled moves the daemon: here into a group that does not exist
        scaled.throttle(member, 1)
    with pytest.raises(ValueError, match="calibration"):
        fh.Cgroups([member], enabled=True, calibration="guess")


def test_capability_env_overrides_only_for_the_scaled_calibration():
    from kafilad.node.serving.stagehost import TEST_CAPABILITY_ENV

    member = fh.Member("slow", 20, 700)
    assert fh.capability_env(None, member) == {}  # the daemon reports its own probe
    env = fh.capability_env({"bandwidth_Bps": 8e9, "step_overhead_s": 1e-4}, member)
    assert json.loads(env[TEST_CAPABILITY_ENV]) == {"bandwidth_Bps": pytest.approx(1.6e9),
                                                    "step_overhead_s": pytest.approx(5e-4)}


def test_reported_capabilities_read_the_sessions_fleet():
    fleet = {"devices": [{"name": "fast", "bandwidth_Bps": 5.5e9, "batch_row_cost": 0.02, "memory_bytes": 1},
                         {"name": "slow", "bandwidth_Bps": 1.4e9, "step_overhead_s": 3e-4}]}
    assert fh.reported_capabilities(fleet) == {
        "fast": {"bandwidth_Bps": 5.5e9, "step_overhead_s": None, "batch_row_cost": 0.02},
        "slow": {"bandwidth_Bps": 1.4e9, "step_overhead_s": 3e-4, "batch_row_cost": None}}
    assert fh.reported_capabilities(None) == {}


def _status() -> dict:
    """A host status snapshot as kafilad/node/session/host.py writes it, after one request."""
    return {
        "plan": {"order": ["fast", "mid", "slow"], "blocks": {"fast": [0, 9], "mid": [9, 14], "slow": [14, 16]},
                 "stage_s": {"fast": 0.020, "mid": 0.025, "slow": 0.020},
                 "throughput": [{"users": 1, "tokens_per_s": 15.0}, {"users": 6, "tokens_per_s": 40.5}]},
        "members": [{"name": "fast", "peer_id": "P0"}, {"name": "slow", "peer_id": "P2"}, {"name": "mid", "peer_id": "P1"}],
        # end-frame rows: [peer_id, steps, compute_s_total, decode_stage_s_median, bytes_sent]
        "last_generation": {"stats": [["P0", 10, 0.22, 0.021, 100], ["P1", 10, 0.30, 0.027, 100],
                                      ["P2", 10, 0.18, 0.017, 100]]},
    }


def test_throughput_at_reads_the_plan_rows():
    plan = _status()["plan"]
    assert fr.throughput_at(plan, 1) == 15.0
    assert fr.throughput_at(plan, 6) == 40.5
    assert fr.throughput_at(plan, 4) is None
    assert fr.throughput_at({}, 1) is None


def test_stage_rows_pair_end_frame_rows_with_predictions_in_ring_order():
    rows = fr.stage_rows(_status())
    assert [r["name"] for r in rows] == ["fast", "mid", "slow"]
    fast, mid, slow = rows
    assert fast["blocks"] == [0, 9] and fast["steps"] == 10
    assert fast["mean_s"] == pytest.approx(0.022) and fast["mean_ratio"] == pytest.approx(1.1)
    assert mid["median_s"] == 0.027 and mid["median_ratio"] == pytest.approx(1.08)
    assert slow["mean_ratio"] == pytest.approx(0.9)


def test_stage_rows_without_a_generation_have_no_ratio():
    status = _status()
    status["last_generation"] = {}
    rows = fr.stage_rows(status)
    assert all(r["mean_s"] is None and r["mean_ratio"] is None and r["steps"] == 0 for r in rows)
    assert rows[0]["predicted_s"] == 0.020


def test_sub_fleets_are_every_proper_subset_anchor_first():
    fleet = {"context": 512, "devices": [{"name": n} for n in ("a", "b", "c")]}
    subs = [[d["name"] for d in s["devices"]] for s in fr.sub_fleets(fleet)]
    assert subs == [["a"], ["b"], ["c"], ["a", "b"], ["a", "c"], ["b", "c"]]
    assert all(s["context"] == 512 for s in fr.sub_fleets(fleet))


def test_sub_fleets_keep_only_their_own_measured_edges():
    fleet = {"devices": [{"name": n} for n in ("a", "b", "c")],
             "edges": [{"from": "a", "to": "b", "rtt_ms": 80.0}, {"from": "b", "to": "c", "rtt_ms": 1.0}]}
    edges = {tuple(d["name"] for d in s["devices"]): s["edges"] for s in fr.sub_fleets(fleet)}
    assert edges[("a", "b")] == [{"from": "a", "to": "b", "rtt_ms": 80.0}]
    assert edges[("a", "c")] == [] and edges[("a",)] == []


def test_predictions_count_the_fleets_measured_round_trips(tmp_path):
    """A live fleet carries the round trips its ring measured (proto_spec/06-fleet.md §1 `edges`): the
    predictions plan with them, so hops the rendezvous cannot see lower the predicted rates."""
    model = fh.synthesize_qwen2(tmp_path / "q2", hidden=64, layers=4)
    gib = 1 << 30
    fleet = {"devices": [{"name": "fast", "memory_bytes": gib, "bandwidth_Bps": 8e9},
                         {"name": "slow", "memory_bytes": gib, "bandwidth_Bps": 2e9}], "context": 256}
    hops = {**fleet, "edges": [{"from": "fast", "to": "slow", "rtt_ms": 80.0}]}
    lan = fr.predict_strategies(fleet, str(model), context=256, concurrency=1)
    wan = fr.predict_strategies(hops, str(model), context=256, concurrency=1)
    # uniform's two edges each pay 40 ms one way: at most 1 / 0.08 s tokens/s for one user
    assert wan["uniform"] < 1 / 0.08 < lan["uniform"]
    pair = [p for p in fr.predict_sub_fleets({**hops, "devices": [*hops["devices"], {"name": "x", "memory_bytes": gib,
                                                                                    "bandwidth_Bps": 1e9}]},
                                             str(model), context=256) if p["names"] == ["fast", "slow"]]
    assert pair and pair[0]["tokens_per_s"] < 1 / 0.08


def test_predict_sub_fleets_uses_the_planner_and_drops_what_does_not_fit(tmp_path):
    model = fh.synthesize_qwen2(tmp_path / "q2", hidden=64, layers=4)
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.3.self_attn.q_proj.bias" in index and "lm_head.weight" in index
    gib = 1 << 30
    fleet = {"devices": [{"name": "fast", "memory_bytes": gib, "bandwidth_Bps": 4e9},
                         {"name": "mid", "memory_bytes": gib, "bandwidth_Bps": 2e9},
                         {"name": "tiny", "memory_bytes": 1000, "bandwidth_Bps": 8e9}]}  # holds nothing
    preds = fr.predict_sub_fleets(fleet, str(model), context=256)
    names = [p["names"] for p in preds]
    assert all("tiny" not in n for n in names)
    assert names[0] == ["fast"]  # one user: the fastest device alone beats any ring with a slower one
    assert set(map(tuple, names)) == {("fast",), ("mid",), ("fast", "mid")}
    rates = [p["tokens_per_s"] for p in preds]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0


def test_predict_strategies_divides_one_fleet_every_way(tmp_path):
    """The predicted gain compares divisions of the same devices (fleet_report.predict_strategies):
    on a fleet 4:1 in speed with room everywhere, the default beats uniform, and a division that
    cannot place the model is None."""
    model = fh.synthesize_qwen2(tmp_path / "q2", hidden=64, layers=4)
    gib = 1 << 30
    fleet = {"devices": [{"name": "fast", "memory_bytes": gib, "bandwidth_Bps": 8e9},
                         {"name": "slow", "memory_bytes": gib, "bandwidth_Bps": 2e9}], "context": 256}
    pred = fr.predict_strategies(fleet, str(model), context=256, concurrency=2)
    assert set(pred) == {"load", "kafila", "uniform", "memory"}
    assert pred["load"] > pred["uniform"] > 0 and pred["memory"] == pytest.approx(pred["uniform"], rel=0.01)
    tight = {"devices": [{**fleet["devices"][0], "memory_bytes": 40_000}, fleet["devices"][1]], "context": 256}
    assert fr.predict_strategies(tight, str(model), context=256, concurrency=2)["uniform"] is None


def test_summary_ratios_and_verdicts():
    res = {"strategies": {"kafila": {"saturated_tps": 40.0, "one_user_tps": 12.0,
                                     "stages": [{"mean_ratio": 1.05}, {"mean_ratio": 0.92}, {"mean_ratio": None}]},
                          "load": {"saturated_tps": 36.0, "one_user_tps": 15.0,
                                   "saturated_stages": [{"median_ratio": 1.12}], "stages": [{"mean_ratio": 1.01}]},
                          "uniform": {"saturated_tps": 20.0, "one_user_tps": 9.0},
                          "memory": {"saturated_tps": 32.0, "one_user_tps": 7.0}},
           "load_at_1": {"one_user_tps": 16.0},
           "sub_fleets_measured": [{"one_user_tps": 15.0}, {"one_user_tps": None}],
           "peers": {"ring_api_decode_tps": 30.0, "mlx_lm_single_tps": 40.0, "mlx_lm_pipeline_tps": 15.0}}
    r = fr.summary_ratios(res)
    assert r["kafila_over_uniform_saturated"] == 2.0
    assert r["kafila_over_memory_saturated"] == 1.25
    # "Kafila" in the targets is the default strategy, load; the paper's division beside it
    assert r["default_over_uniform_saturated"] == 1.8 and r["default_over_memory_saturated"] == 1.125
    assert r["default_stage_measured_over_predicted_max_dev"] == pytest.approx(0.12)  # under load first
    assert r["kafila_stage_measured_over_predicted_max_dev"] == pytest.approx(0.08)
    assert r["one_user_load_at_1_over_best_sub_fleet"] == pytest.approx(16 / 15)
    assert r["one_user_kafila_full_fleet_over_best_sub_fleet"] == pytest.approx(12 / 15)
    assert r["ring_api_over_mlx_lm_single"] == 0.75
    assert r["ring_api_over_mlx_lm_pipeline"] == 2.0
    assert r["default_over_uniform_saturated_predicted"] is None  # no plan rows: nothing predicted
    one_fleet = fr.summary_ratios({**res, "predicted_on_default_fleet": {"load": 30.0, "uniform": 15.0, "memory": 20.0}})
    assert one_fleet["default_over_uniform_saturated_predicted"] == 2.0  # the same devices divided both ways
    assert one_fleet["default_over_uniform_measured_over_predicted_gain"] == pytest.approx(0.9)
    assert one_fleet["default_over_memory_saturated_predicted"] == 1.5
    v = fr.verdicts(r)
    assert v["default_over_uniform_saturated"] == "met"
    assert v["default_over_memory_saturated"] == "not met"
    assert v["default_stage_measured_over_predicted_max_dev"] == "not met"
    assert "kafila_over_uniform_saturated" not in v
    assert v["ring_api_over_mlx_lm_single"] == "not met"
    assert fr.verdicts({})["ring_api_over_mlx_lm_pipeline"] == "not measured"


def test_ratio_handles_missing_values():
    assert fr.ratio(3.0, 2.0) == 1.5
    assert fr.ratio(None, 2.0) is None and fr.ratio(1.0, None) is None and fr.ratio(1.0, 0.0) is None


@pytest.mark.slow
def test_quick_smoke_run_without_cgroups(tmp_path):
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--no-cgroups", "--strategies", "kafila,uniform",
                           "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["strategies"]) == {"kafila", "uniform"}
    for rec in res["strategies"].values():
        assert rec["saturated_tps"] > 0 and rec["one_user_tps"] > 0
        assert [r["name"] for r in rec["stages"]] == rec["plan"]["order"]
        assert all(r["steps"] >= 2 and r["mean_s"] > 0 for r in rec["stages"])
    peers = res["peers"]
    assert peers["mlx_lm_pipeline"]["tokens"] == 8 and peers["mlx_lm_pipeline_tps"] > 0
    assert peers["mlx_lm_single_tps"] > 0 and peers["ring_api_decode_tps"] > 0
    assert res["ratios"]["kafila_over_uniform_saturated"] > 0
    assert "ratios measured in this run" in proc.stdout


def test_saturated_stage_rows_scale_the_prediction_by_the_rows_and_rho():
    status = {"plan": {"order": ["a", "b"], "stage_s": {"a": 0.010, "b": 0.020}},
              "fleet": {"devices": [{"name": "a", "batch_row_cost": 0.1}, {"name": "b"}]},
              "members": [{"name": "a", "peer_id": "pa"}, {"name": "b", "peer_id": "pb"}],
              "last_generation": {"batch_rows_median": 5,
                                  "stats": [["pa", 40, 0.1, 0.0154, 0], ["pb", 40, 0.5, 0.09, 0]]}}
    a, b = fr.saturated_stage_rows(status)
    assert a["predicted_s"] == pytest.approx(0.010 * 1.4) and a["median_ratio"] == pytest.approx(1.1)
    assert b["rho"] is None and b["predicted_s"] == pytest.approx(0.020 * 5)  # unknown rho: 1.0, as planned
    assert b["median_ratio"] == pytest.approx(0.9)


def test_cpu_share_of_a_process_from_proc():
    import os
    import time

    before, t0, c0 = fh.process_cpu_s(os.getpid()), time.perf_counter(), time.process_time()
    x = 0
    while time.process_time() - c0 < 0.3:  # busy for 0.3 s of CPU
        x += 1
    after, wall_s, cpu_s = fh.process_cpu_s(os.getpid()), time.perf_counter() - t0, time.process_time() - c0
    assert after - before == pytest.approx(cpu_s, abs=0.05)
    assert fh.process_cpu_s(2 ** 22 + 12345) is None  # no such process (above the default pid_max)
    share = fh.cpu_shares([before, None], [after, 1.0], wall_s)
    # every thread of this process counts (process_time too), so the share may pass one core; how large
    # it is depends on what else the machine runs, so only its agreement with process_time is asserted
    assert share[0] > 0 and share[0] == pytest.approx(cpu_s / wall_s, abs=0.05 / wall_s) and share[1] is None
    assert fh.cpu_shares([1.0], [1.5], 2.0) == [0.25] and fh.cpu_shares([1.0], [1.5], 0.0) == [None]


def test_named_fleets_expand_and_the_mission_fleet_ranks_memory_against_speed():
    """`--fleet mission` (the default, issue 24 item 3) names a spec; memory does not rank like speed."""
    args = bf.parse_args(["--skip-peers"])
    assert args.fleet == bf.FLEETS["mission"] and [m.name for m in args.fleet_members] == ["fast", "mid", "slow"]
    by_speed = sorted(args.fleet_members, key=lambda m: -m.quota_pct)
    assert [m.mem_mb for m in by_speed] != sorted((m.mem_mb for m in by_speed), reverse=True)
    assert bf.parse_args(["--fleet", "no-uniform"]).fleet == bf.FLEETS["no-uniform"]
    assert bf.parse_args(["--fleet", "a:50:300,b:50:300"]).fleet == "a:50:300,b:50:300"


def test_memory_use_reads_each_groups_peak_against_its_limit_and_counts_limit_hits():
    res = {"fleet": "fast:80:480,mid:40:510", "strategies": {
        "load": {"cgroup_stat": ["bf_fast: nr_periods 10 mem_peak_MB=240 failcnt=0",
                                 "bf_mid: nr_periods 10 mem_peak_MB=459 failcnt=2"]},
        "uniform": {"strategy": "uniform", "refused": "the plan does not fit fast"}}}
    peak, hits = fr.memory_use(res)
    assert peak == pytest.approx(459 / 510) and hits == 2
    assert fr.verdicts(fr.summary_ratios(res))["memory_limit_hits"] == "not met"
    assert fr.memory_use({"fleet": "fast:80:480", "strategies": {}}) == (None, None)


def test_the_gain_over_uniform_is_set_against_the_predicted_gain():
    res = {"strategies": {"load": {"saturated_tps": 72.0, "saturated_predicted_tps": 120.0},
                          "uniform": {"saturated_tps": 36.0, "saturated_predicted_tps": 80.0}}}
    r = fr.summary_ratios(res)
    assert r["default_over_uniform_saturated"] == 2.0 and r["default_over_uniform_saturated_predicted"] == 1.5
    assert r["default_over_uniform_measured_over_predicted_gain"] == pytest.approx(2.0 / 1.5)

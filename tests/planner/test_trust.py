"""Members checked against what they do (issue 22 item 5; kafilad/planner/trust.py): the bound, the
correction derived from measurement, and who may be the head (`plan(heads=...)`)."""

from __future__ import annotations

import pytest

from kafilad.planner import Device, ModelProfile, plan
from kafilad.planner.costmodel import ChainCost
from kafilad.planner.trust import MIN_STEPS, RATIO_HIGH, RATIO_LOW, SLACK_S, MemberChecks, derived_device, judge

MODEL = ModelProfile(model_id="m", block_bytes=(10_000_000,) * 8, head_read_bytes=40_000_000,
                     head_resident_bytes=80_000_000, kv_bytes_per_block_token=0)
#: the host is slow; m1 claims 100x its real bandwidth (1e9 B/s)
FLEET = [Device("host", 10**9, 1e9), Device("m1", 10**9, 1e11), Device("m2", 10**9, 1e9)]


def test_judge_applies_the_bound_after_enough_steps_and_beyond_the_slack():
    assert judge(0.100, 0.010, MIN_STEPS - 1) is None  # too few steps to judge
    assert judge(0.100, 0.010, MIN_STEPS) == "off"  # 10x slower than reported
    assert judge(0.004, 0.040, MIN_STEPS) == "off"  # 10x faster
    assert judge(0.010 * RATIO_HIGH * 0.99, 0.010, MIN_STEPS) == "confirmed"
    assert judge(0.010 * RATIO_LOW * 1.01, 0.010, MIN_STEPS) == "confirmed"
    # sub-millisecond stages: a 5x ratio within the slack is noise, not a lie
    assert judge(0.0005, 0.0001, MIN_STEPS) == "confirmed" and 0.0005 - 0.0001 < SLACK_S


def test_the_derived_device_predicts_what_was_measured():
    d = Device("m1", 10**9, 1e11, step_overhead_s=0.001)
    for scale in (20.0, 0.25):
        fixed = derived_device(d, scale)
        for a, b in ((0, 3), (2, 8)):
            was = ChainCost([d, d], MODEL, context=8, concurrency=1, tier="cost-model").stage_s(1, a, b)
            now = ChainCost([fixed, fixed], MODEL, context=8, concurrency=1, tier="cost-model").stage_s(1, a, b)
            assert now == pytest.approx(scale * was)
        assert fixed.memory_bytes == d.memory_bytes
    assert derived_device(d, 1.0) is d


def test_a_lying_member_is_judged_off_once_then_confirmed_under_its_derived_figures():
    c = MemberChecks(exempt=frozenset({"host"}))
    c.new_plan(1, {"host": 0.05, "m1": 0.001, "m2": 0.05})
    # the first request: 10 steps, too few; the host's own stage is never judged
    assert c.observe(1, [("host", 10, 0.5), ("m1", 10, 0.020), ("m2", 10, 0.05)]) == []
    out = c.observe(1, [("host", 10, 0.5), ("m1", 10, 0.020), ("m2", 10, 0.06)])
    assert [(v.name, v.outcome) for v in out] == [("m1", "off"), ("m2", "confirmed")]
    m1 = out[0]
    assert m1.ratio == pytest.approx(20.0) and m1.scale == pytest.approx(20.0) and m1.steps == 20
    assert c.head_allowed(["host", "m1", "m2"]) == {"host", "m2"}
    # judged off under this plan: later requests of it change nothing (no compounding)
    assert c.observe(1, [("m1", 30, 0.020)]) == [] and c.scale["m1"] == pytest.approx(20.0)
    # batched requests and requests of an earlier plan count for nothing
    c.new_plan(2, {"host": 0.05, "m1": 0.019, "m2": 0.05})
    assert c.observe(2, [("m1", 40, 0.020)], batch_rows=3) == [] and c.observe(1, [("m1", 40, 0.020)]) == []
    out = c.observe(2, [("m1", 40, 0.021)])
    assert [(v.name, v.outcome) for v in out] == [("m1", "confirmed")] and c.scale["m1"] == pytest.approx(20.0)
    assert c.head_allowed(["host", "m1", "m2"]) == {"host", "m1", "m2"}
    st = c.status("m1")
    assert st["confirmed"] and st["outcome"] == "confirmed" and st["scale"] == pytest.approx(20.0)
    assert c.device(FLEET[1]).bandwidth_Bps == pytest.approx(1e11 / 20)
    assert c.status("host") is None


@pytest.mark.parametrize("strategy", ["kafila", "load"])
def test_no_member_heads_on_its_word_alone(strategy):
    unchecked = plan(FLEET, MODEL, context=8, strategy=strategy)
    assert unchecked.head == "m1"  # what the report alone earns (the QA finding)
    p = plan(FLEET, MODEL, context=8, strategy=strategy, heads=frozenset({"host"}))
    assert p.head == "host" and p.held_back == "m1" and not p.head_unconfirmed
    assert p.to_json()["held_back"] == "m1" and p.to_json()["held_back_gain"] == p.held_back_gain > 0.25
    # confirmed by measurement, it may head; with its figures derived from measurement it no longer earns it
    assert plan(FLEET, MODEL, context=8, strategy=strategy, heads=frozenset({"host", "m1"})).head == "m1"
    c = MemberChecks(exempt=frozenset({"host"}), scale={"m1": 100.0}, confirmed={"m1"})
    fixed = plan([c.device(d) for d in FLEET], MODEL, context=8, strategy=strategy,
                 heads=c.head_allowed(d.name for d in FLEET))
    assert fixed.head == "host" and fixed.held_back is None


@pytest.mark.parametrize("strategy", ["kafila", "load"])
def test_when_no_allowed_head_fits_the_planner_says_so(strategy):
    small_host = [Device("host", 30_000_000, 1e9), Device("m1", 10**9, 1e9), Device("m2", 10**9, 1e9)]
    p = plan(small_host, MODEL, context=8, strategy=strategy, heads=frozenset({"host"}))
    assert p.head != "host" and p.head_unconfirmed and p.to_json()["head_unconfirmed"] is True


def test_the_fleet_file_carries_who_may_head_and_the_offline_plan_honours_it():
    from kafilad.planner import fleet_to_json, load_fleet
    from kafilad.planner.fleet import FleetFormatError
    obj = fleet_to_json(FLEET, 8, 1, heads=frozenset({"host"}))
    assert obj["heads"] == ["host"]
    fleet = load_fleet(obj)
    assert fleet.heads == ("host",) and load_fleet(fleet_to_json(FLEET)).heads is None
    assert plan(list(fleet.devices), MODEL, context=8, strategy="load", heads=frozenset(fleet.heads)).head == "host"
    for bad in ([], ["nobody"], "host", [1]):
        with pytest.raises(FleetFormatError, match="'heads'"):
            load_fleet({**obj, "heads": bad})

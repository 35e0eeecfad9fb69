"""Measured round trips in the planner (issue 24): a live session's ring edges' check RTTs win over
the rendezvous estimates in the ring order, in each edge's latency and in the predicted rates, and
decide when a serving plan is made again (kafilad/planner/plan.py `rtt_replan_due`)."""

from __future__ import annotations

import pytest

from kafilad.planner import Device, ModelProfile, fleet_to_json, load_fleet, order_ring, plan
from kafilad.planner.fleet import FleetFormatError
from kafilad.planner.plan import RTT_REPLAN_MIN_S, hop_change_s, ring_hop_s, rtt_replan_due

MB = 10**6
# 8 blocks of 10 MB, a 20 MB head: on 1 GB/s devices a block reads in 10 ms
MODEL = ModelProfile(model_id="m", block_bytes=(10 * MB,) * 8, head_read_bytes=20 * MB,
                     head_resident_bytes=20 * MB, kv_bytes_per_block_token=0)


def dev(name: str, bandwidth_Bps: float = 1e9, memory_bytes: int = 10**9, **kw) -> Device:
    return Device(name, memory_bytes, bandwidth_Bps, **kw)


def test_a_measured_edge_sets_its_latency_and_the_predicted_rate():
    ds = [dev("a"), dev("b"), dev("c")]
    blind = plan(ds, MODEL, context=16, strategy="uniform")
    assert blind.edge_latency_s == (None, None, None) and blind.edge_measured == (False, False, False)
    assert blind.circuit_s == pytest.approx(sum(blind.stage_s.values()))
    # 80 ms round trips on every edge, one given the other way round: 40 ms one way each
    measured = {("a", "b"): 80.0, ("c", "b"): 80.0, ("c", "a"): 80.0}
    seen = plan(ds, MODEL, context=16, strategy="uniform", measured_rtt_ms=measured)
    assert seen.order == ("a", "b", "c") and seen.blocks == blind.blocks
    assert seen.edge_latency_s == pytest.approx((0.04, 0.04, 0.04))
    assert seen.edge_measured == (True, True, True)
    assert seen.circuit_s == pytest.approx(blind.circuit_s + 0.12)
    assert seen.throughput[0].tokens_per_s == pytest.approx(1 / seen.circuit_s)
    edges = seen.to_json()["edges"]
    assert [(e["from"], e["to"], e["latency_s"], e["measured"]) for e in edges] == [
        ("a", "b", pytest.approx(0.04), True), ("b", "c", pytest.approx(0.04), True),
        ("c", "a", pytest.approx(0.04), True)]


def test_a_measured_rtt_wins_over_the_rendezvous_estimate():
    # both members 10-12 ms from the rendezvous: a direct edge is estimated at |10 - 12| = 2 ms
    ds = [dev("a", rendezvous_rtt_ms=10.0), dev("b", rendezvous_rtt_ms=12.0)]
    assert plan(ds, MODEL, context=16, strategy="uniform").edge_latency_s == pytest.approx((0.001, 0.001))
    p = plan(ds, MODEL, context=16, strategy="uniform", measured_rtt_ms={("b", "a"): 50.0})
    assert p.edge_latency_s == pytest.approx((0.025, 0.025)) and p.edge_measured == (True, True)
    assert ring_hop_s(ds, {("a", "b"): 50.0}) == pytest.approx(0.05)


def test_the_ring_avoids_a_slow_pair_it_measured():
    ds = [dev(n, rendezvous_rtt_ms=5.0) for n in "abcd"]  # estimates: 0 ms everywhere
    assert [d.name for d in order_ring(ds)] == ["a", "b", "c", "d"]
    # a and b measured 100 ms apart (a slow path between their homes): b goes opposite a
    slow = {("a", "b"): 100.0}
    assert [d.name for d in order_ring(ds, slow)] == ["a", "c", "b", "d"]
    p = plan(ds, MODEL, context=16, strategy="kafila", measured_rtt_ms=slow)
    assert {frozenset(e[:2]) for e in p.edges}.isdisjoint({frozenset("ab")})
    # without rendezvous RTTs the order needs every pair measured to rank by RTT
    bare = [dev(n) for n in "abcd"]
    assert [d.name for d in order_ring(bare, slow)] == ["a", "b", "c", "d"]
    every = {("a", "b"): 100.0, ("a", "c"): 1.0, ("a", "d"): 1.0, ("b", "c"): 1.0, ("b", "d"): 1.0, ("c", "d"): 1.0}
    assert [d.name for d in order_ring(bare, every)] == ["a", "c", "b", "d"]


def test_one_user_leaves_a_member_behind_a_slow_hop_on_standby():
    """A fast member helps one user across a LAN, not across 2 x 50 ms of hops a token."""
    ds = [dev("home", 1e9), dev("fast", 4e9)]
    lan = plan(ds, MODEL, context=16, strategy="load")
    assert lan.standby == () and lan.counts()["fast"] > lan.counts()["home"]
    wan = plan(ds, MODEL, context=16, strategy="load", measured_rtt_ms={("home", "fast"): 100.0})
    assert wan.standby == ("fast",) and wan.blocks == {"home": (0, 8)}
    assert wan.throughput[0].tokens_per_s == pytest.approx(1 / wan.circuit_s)
    # the pair, 100 ms of hops a token, is slower than home alone: the load objective's choice
    assert wan.full_fleet_tokens_per_s < wan.throughput[0].tokens_per_s


def test_a_plan_is_due_again_when_measured_hops_move_it():
    ds = [dev("a"), dev("b"), dev("c")]
    p = plan(ds, MODEL, context=16, strategy="uniform")
    wan = {("a", "b"): 40.0, ("b", "c"): 40.0, ("c", "a"): 40.0}
    change_s, worst = hop_change_s(p, wan)
    assert change_s == pytest.approx(0.06) and worst in {("a", "b"), ("b", "c"), ("c", "a")}
    assert rtt_replan_due(p, wan)
    # a plan made with those figures is not due again: replanning on them ends
    again = plan(ds, MODEL, context=16, strategy="uniform", measured_rtt_ms=wan)
    assert hop_change_s(again, wan)[0] == pytest.approx(0.0) and not rtt_replan_due(again, wan)
    # loopback check RTTs (0.4 ms) move the hops by 0.6 ms a token: below the floor, not due
    lo = {k: 0.4 for k in wan}
    assert hop_change_s(p, lo)[0] == pytest.approx(0.0006) and 0.0006 < RTT_REPLAN_MIN_S
    assert not rtt_replan_due(p, lo)
    # nor a loaded loopback ring's 5 ms checks (7.5 ms a token), while 10 ms hops (20 ms RTTs) are
    assert not rtt_replan_due(p, {k: 5.0 for k in wan}) and rtt_replan_due(p, {k: 20.0 for k in wan})
    # nothing measured on this plan's ring: no change
    assert hop_change_s(p, {("x", "y"): 500.0}) == (0.0, None) and not rtt_replan_due(p, {})


def test_the_fleet_carries_measured_edges_both_ways():
    ds = [dev("a"), dev("b")]
    obj = fleet_to_json(ds, 16, 1, rtt_ms={("a", "b"): 42.5})
    assert obj["edges"] == [{"from": "a", "to": "b", "rtt_ms": 42.5}]
    fleet = load_fleet(obj)
    assert fleet.rtt_ms == {("a", "b"): 42.5} and fleet.devices == tuple(ds)
    assert "edges" not in fleet_to_json(ds) and load_fleet(fleet_to_json(ds)).rtt_ms == {}
    # `kafila-ctl plan` on the live fleet reproduces a plan made with them
    p = plan(list(fleet.devices), MODEL, context=16, strategy="uniform", measured_rtt_ms=fleet.rtt_ms)
    assert p.edge_latency_s == pytest.approx((0.02125, 0.02125))


@pytest.mark.parametrize("edges", [
    {"from": "a", "to": "b"},                              # not a list
    [{"from": "a", "to": "zz", "rtt_ms": 1.0}],            # unknown device
    [{"from": "a", "to": "a", "rtt_ms": 1.0}],             # a device with itself
    [{"from": "a", "to": "b", "rtt_ms": -1.0}],            # negative
    [{"from": "a", "to": "b", "rtt_ms": "fast"}],          # not a number
    [{"from": "a", "to": "b"}],                            # missing
    ["a-b"],                                               # not an object
])
def test_a_malformed_fleet_edge_is_refused_by_name(edges):
    obj = {**fleet_to_json([dev("a"), dev("b")]), "edges": edges}
    with pytest.raises(FleetFormatError):
        load_fleet(obj)

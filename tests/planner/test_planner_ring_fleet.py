"""Ring order (DESIGN §3 step 4, §5.2), tiers (§5.4), circuit time, the fleet format (proto_spec/06-fleet.md)."""

from __future__ import annotations

import json

import pytest

from kafilad.errors import PlanError
from kafilad.planner import (Device, FleetFormatError, ModelProfile, fleet_to_json, load_fleet,
                             order_ring, plan, predict_path, select_tier)
from kafilad.planner.ring import ring_edges


def names(ds):
    return [d.name for d in ds]


def relays(ds):
    return sum(1 for a, b in ring_edges(ds) if predict_path(a.nat_class, b.nat_class) == "relayed")


@pytest.mark.parametrize("a,b,path", [
    ("O", "O", "direct"), ("O", "C", "direct"), ("C", "C", "direct"), ("O", "S", "direct"),
    ("C", "S", "relayed"), ("S", "C", "relayed"), ("S", "S", "relayed"),
    (None, "S", "direct"), ("S", None, "direct"), (None, None, "direct"), ("s", "c", "relayed"),
])
def test_predict_path_table(a, b, path):
    assert predict_path(a, b) == path


def test_listed_order_without_nat_or_rtt():
    ds = [Device(n, 1) for n in "abcde"]
    assert names(order_ring(ds)) == list("abcde")


def test_o_s_mix_alternates():
    ds = [Device("o1", 1, nat_class="O"), Device("o2", 1, nat_class="O"),
          Device("s1", 1, nat_class="S"), Device("s2", 1, nat_class="S")]
    assert relays(ds) == 1  # listed: o1 o2 s1 s2 -> s1-s2 relays
    got = order_ring(ds)
    assert names(got) == ["o1", "s1", "o2", "s2"] and relays(got) == 0


def test_o_s_mix_alternates_whatever_the_rtts_say():
    # RTT estimates alone would prefer o1 o2 s1 s2 (Σ 0 + 4.9 + 0.2 relayed + 4.9 = 10.0 ms against
    # 4 x 4.9 = 19.6 alternating); fewer relays come first (DESIGN §5.2; seen in the NAT lab, where
    # sub-millisecond rendezvous RTTs put the two S members side by side)
    ds = [Device("o1", 1, nat_class="O", rendezvous_rtt_ms=5.0), Device("o2", 1, nat_class="O", rendezvous_rtt_ms=5.0),
          Device("s1", 1, nat_class="S", rendezvous_rtt_ms=0.1), Device("s2", 1, nat_class="S", rendezvous_rtt_ms=0.1)]
    got = order_ring(ds)
    assert relays(got) == 0 and names(got) in (["o1", "s1", "o2", "s2"], ["o1", "s2", "o2", "s1"])


def test_c_s_mix_keeps_cones_together():
    ds = [Device("c1", 1, nat_class="C"), Device("s1", 1, nat_class="S"),
          Device("c2", 1, nat_class="C"), Device("s2", 1, nat_class="S")]
    assert relays(ds) == 4  # C,S,C,S
    got = order_ring(ds)
    assert relays(got) == 3 and names(got)[0] == "c1"
    assert names(got) == ["c1", "s1", "s2", "c2"]  # the ring C,S,S,C: cones adjacent across the wrap


def test_anchor_stays_first_even_when_symmetric():
    ds = [Device("s0", 1, nat_class="S"), Device("c1", 1, nat_class="C"),
          Device("o1", 1, nat_class="O"), Device("c2", 1, nat_class="C")]
    got = order_ring(ds)
    assert names(got)[0] == "s0"
    # S must sit between O and ... only one O: one relayed edge is unavoidable
    assert relays(got) == 1


def test_rtt_order_minimises_estimated_ring_rtt():
    # all open: direct edges cost |rA - rB|; sorted by RTT around the ring is cheapest
    r = {"a": 10.0, "b": 50.0, "c": 20.0, "d": 40.0, "e": 30.0}
    ds = [Device(n, 1, nat_class="O", rendezvous_rtt_ms=v) for n, v in r.items()]
    got = order_ring(ds)
    assert names(got)[0] == "a"
    # the minimum of Σ|rA-rB| over a ring is 2 * (max - min) = 80
    total = sum(abs(x.rendezvous_rtt_ms - y.rendezvous_rtt_ms) for x, y in ring_edges(got))
    assert total == 80.0
    # the sorted ring a,c,e,d,b and its mirror are equal; the listed-order tie-break takes the mirror
    assert names(got) == ["a", "b", "d", "e", "c"]


def test_all_relayed_puts_similar_rtts_together():
    ds = [Device("s1", 1, nat_class="S", rendezvous_rtt_ms=10.0),
          Device("s2", 1, nat_class="S", rendezvous_rtt_ms=90.0),
          Device("s3", 1, nat_class="S", rendezvous_rtt_ms=12.0),
          Device("s4", 1, nat_class="S", rendezvous_rtt_ms=88.0)]
    got = order_ring(ds)
    adjacent = {frozenset((a.name, b.name)) for a, b in ring_edges(got)}
    assert frozenset(("s1", "s3")) in adjacent and frozenset(("s2", "s4")) in adjacent
    assert names(got) == ["s1", "s2", "s4", "s3"]  # first such ring in listed order


def test_large_fleet_heuristic_keeps_anchor_and_everyone():
    ds = [Device(f"d{i}", 1, nat_class="CS"[i % 2], rendezvous_rtt_ms=float(i * 7 % 11)) for i in range(11)]
    got = order_ring(ds)
    assert names(got)[0] == "d0" and sorted(names(got)) == sorted(names(ds))


def model(n=6, head=0, flops=True):
    return ModelProfile("m", (100,) * n, head_read_bytes=head, head_resident_bytes=head,
                        kv_bytes_per_block_token=0,
                        block_flops_per_token=(1000.0,) * n if flops else (),
                        head_flops_per_token=500.0 if flops else 0.0)


def test_tier_selection():
    full = [Device("a", 10**6, bandwidth_Bps=100.0, flops_per_s=10.0), Device("b", 10**6, bandwidth_Bps=50.0, flops_per_s=10.0)]
    assert select_tier(full, model()) == "cost-model"
    part = [Device("a", 10**6, bandwidth_Bps=100.0, flops_per_s=10.0), Device("b", 10**6, flops_per_s=30.0)]
    assert select_tier(part, model()) == "flops"
    assert select_tier(part, model(flops=False)) == "memory"
    assert select_tier([Device("a", 10**6), Device("b", 10**6, bandwidth_Bps=1.0)], model()) == "memory"


def test_flops_tier_stage_times():
    ds = [Device("a", 10**6, flops_per_s=1000.0), Device("b", 10**6, flops_per_s=2000.0, step_overhead_s=0.25)]
    p = plan(ds, model(), mu=1.0)
    assert p.tier == "flops"
    # a (head): k blocks -> k + 0.5 s; b: 0.25 + (6-k)/2 -> k=2: 2.5 vs 2.25; k=1: 1.5 vs 2.75
    assert p.blocks == {"a": (0, 2), "b": (2, 6)}
    assert p.stage_s == {"a": 2.5, "b": 2.25}


def test_memory_tier_is_memory_proportional():
    ds = [Device("a", 3000), Device("b", 1000)]
    p = plan(ds, model(n=8), mu=1.0)
    assert p.tier == "memory"
    assert p.counts() == {"a": 6, "b": 2}
    assert p.stage_s == {"a": pytest.approx(0.2), "b": pytest.approx(0.2)}  # fraction of memory read per token
    assert plan(ds, model(n=8), strategy="memory").counts() == {"a": 6, "b": 2}


def test_circuit_adds_one_way_edge_latency():
    ds = [Device("a", 10**6, 100.0, nat_class="O", rendezvous_rtt_ms=10.0),
          Device("b", 10**6, 100.0, nat_class="S", rendezvous_rtt_ms=30.0),
          Device("c", 10**6, 100.0, nat_class="C", rendezvous_rtt_ms=20.0)]
    p = plan(ds, model(n=3))
    assert p.order == ("a", "b", "c")  # c-b would relay; a-b-c-a has one relay... check below
    edges = {(a, b): path for a, b, path in p.edges}
    # a->b O-S direct |10-30| = 20; b->c S-C relayed 30+20 = 50; c->a direct 10: total 80 ms RTT
    assert edges == {("a", "b"): "direct", ("b", "c"): "relayed", ("c", "a"): "direct"}
    assert p.edge_latency_s == pytest.approx((0.010, 0.025, 0.005))
    assert p.circuit_s == pytest.approx(sum(p.stage_s.values()) + 0.040)
    assert p.bottleneck_s == pytest.approx(1.0)


def test_circuit_without_rtts_is_the_stage_sum():
    ds = [Device("a", 10**6, 100.0), Device("b", 10**6, 200.0)]
    p = plan(ds, model(n=3))
    assert p.circuit_s == pytest.approx(sum(p.stage_s.values()))
    assert p.edges == (("a", "b", "direct"), ("b", "a", "direct"))
    assert p.edge_latency_s == (None, None)


def test_single_device_has_no_edges():
    p = plan([Device("solo", 10**6, 100.0)], model(n=3, head=50))
    assert p.blocks == {"solo": (0, 3)} and p.edges == () and p.imbalance == 1.0 and p.utilization == 1.0
    assert p.stage_s == {"solo": pytest.approx(3.5)}


def test_to_json_has_the_issue_keys():
    ds = [Device("a", 10**6, 100.0), Device("b", 10**6, 200.0)]
    j = plan(ds, model(n=3)).to_json()
    for k in ("order", "head", "blocks", "stage_s", "bottleneck_s", "circuit_s", "utilization",
              "imbalance", "resident_bytes", "tier"):
        assert k in j
    assert j["blocks"] == {"a": [0, 1], "b": [1, 3]}
    assert json.loads(json.dumps(j)) == j


def test_plan_errors():
    ds = [Device("a", 10**6, 100.0), Device("a", 10**6, 100.0)]
    with pytest.raises(PlanError, match="'a' appears twice"):
        plan(ds, model())
    with pytest.raises(PlanError, match="Unknown strategy 'best'"):
        plan(ds[:1], model(), strategy="best")
    with pytest.raises(PlanError, match="must both be at least 1"):
        plan(ds[:1], model(), context=0)


FLEET = {
    "name": "t", "context": 2048, "concurrency": 2,
    "devices": [
        {"name": "studio", "memory_bytes": 144000000000, "bandwidth_Bps": 8e11, "nat_class": "c",
         "rendezvous_rtt_ms": 12.5, "source": "ignored extra key"},
        {"name": "box", "memory_bytes": 60000000000, "flops_per_s": 1e12, "step_overhead_s": 0.001},
    ],
}


def test_load_fleet_and_roundtrip(tmp_path):
    f = load_fleet(FLEET)
    assert f.context == 2048 and f.concurrency == 2 and f.name == "t"
    assert f.devices[0] == Device("studio", 144000000000, bandwidth_Bps=8e11, nat_class="C", rendezvous_rtt_ms=12.5)
    assert f.devices[1] == Device("box", 60000000000, flops_per_s=1e12, step_overhead_s=0.001)
    obj = fleet_to_json(f.devices, f.context, f.concurrency)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(obj))
    g = load_fleet(path)
    assert g.devices == f.devices and (g.context, g.concurrency) == (2048, 2)
    assert "context" not in fleet_to_json(f.devices)


@pytest.mark.parametrize("obj,msg", [
    ({}, "'devices' is a non-empty list"),
    ({"devices": []}, "'devices' is a non-empty list"),
    ({"devices": [{"memory_bytes": 1}]}, "Fleet device #0 needs a non-empty string 'name'"),
    ({"devices": [{"name": "a"}]}, "Fleet device 'a' lacks 'memory_bytes'"),
    ({"devices": [{"name": "a", "memory_bytes": -5}]}, "'memory_bytes' must be positive"),
    ({"devices": [{"name": "a", "memory_bytes": 1.5}]}, "'memory_bytes' must be a whole number"),
    ({"devices": [{"name": "a", "memory_bytes": 1, "bandwidth_Bps": "fast"}]}, "'bandwidth_Bps' must be a number"),
    ({"devices": [{"name": "a", "memory_bytes": 1, "nat_class": "X"}]}, "'nat_class' must be one of O, C, S"),
    ({"devices": [{"name": "a", "memory_bytes": 1}, {"name": "a", "memory_bytes": 2}]}, "'a' repeats"),
    ({"devices": [{"name": "a", "memory_bytes": 1}], "context": 0}, "'context' must be positive"),
])
def test_fleet_format_errors(obj, msg):
    with pytest.raises(FleetFormatError, match=msg):
        load_fleet(obj)


def test_fleet_file_errors(tmp_path):
    with pytest.raises(FleetFormatError, match="does not exist"):
        load_fleet(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(FleetFormatError, match="is not valid JSON"):
        load_fleet(bad)

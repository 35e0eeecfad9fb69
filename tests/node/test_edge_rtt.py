"""A ring edge's settled round trip (issue 24): the sender's direct path reports the smallest of its
QUIC RTT samples once it has enough of them (proto_spec 07 §6 `path_rtt_ms`, `rtt_samples`), and the
host plans with those, never with the one connectivity check's `rtt_ms` taken while daemons start."""

from __future__ import annotations

import types

from kafilad.node.paths.edge import RTT_REPORT_MIN_MS, RTT_SETTLED_SAMPLES, rtt_report_due
from kafilad.node.serving.stagehost import measured_rtt_ms
from kafilad.proto.edge_record import EdgeRecord, PathKind


def test_a_round_trip_is_reported_once_settled_then_only_when_it_falls_clearly():
    assert not rtt_report_due(40.0, RTT_SETTLED_SAMPLES - 1, None)
    assert rtt_report_due(40.0, RTT_SETTLED_SAMPLES, None)
    assert not rtt_report_due(39.0, 50, 40.0)          # 2.5 %: noise
    assert rtt_report_due(30.0, 50, 40.0)              # 25 % and 10 ms lower
    assert not rtt_report_due(0.3, 50, 0.5)            # 40 % of a loopback RTT, but under RTT_REPORT_MIN_MS
    assert RTT_REPORT_MIN_MS > 0.2


def test_the_record_shows_its_path_round_trip_only_on_a_direct_path():
    rec = EdgeRecord("a", "b", path=PathKind.DIRECT, rtt_ms=35.0, path_rtt_ms=20.5, rtt_samples=9)
    out = rec.to_json()
    assert (out["rtt_ms"], out["path_rtt_ms"], out["rtt_samples"]) == (35.0, 20.5, 9)
    relayed = EdgeRecord("a", "b", path=PathKind.RELAYED, path_rtt_ms=20.5, rtt_samples=9).to_json()
    assert "path_rtt_ms" not in relayed and "path_rtt_ms" not in EdgeRecord("a", "b").to_json()


def session(own: list, members: dict) -> types.SimpleNamespace:
    rows = {name: types.SimpleNamespace(name=name, is_host=False, load={"edges": edges}) for name, edges in members.items()}
    return types.SimpleNamespace(node=types.SimpleNamespace(name="h"), paths=None, members=rows,
                                 _own=own)


def test_the_host_takes_settled_path_round_trips_only(monkeypatch):
    from kafilad.node.serving import stagehost
    s = session([], {
        "m1": [{"from": "m1", "to": "m2", "path": "direct", "rtt_ms": 90.0, "path_rtt_ms": 41.0,
                "rtt_samples": RTT_SETTLED_SAMPLES}],
        "m2": [{"from": "m2", "to": "h", "path": "direct", "rtt_ms": 12.0, "path_rtt_ms": 0.4,
                "rtt_samples": RTT_SETTLED_SAMPLES - 1},                          # not settled yet
               {"from": "m1", "to": "m2", "path": "direct", "path_rtt_ms": 5.0, "rtt_samples": 99}],  # not its own
        "m3": [{"from": "m3", "to": "h", "path": "relayed", "rtt_ms": 30.0},       # no path round trip
               {"from": "m3", "to": "m1", "path": "direct", "path_rtt_ms": True, "rtt_samples": 9},  # junk
               "junk", {"from": 5}],
    })
    monkeypatch.setattr(stagehost, "own_edges", lambda session: session._own)
    s._own = [{"from": "h", "to": "m1", "path": "direct", "path_rtt_ms": 0.3, "rtt_samples": 20}]
    assert measured_rtt_ms(s) == {("m1", "m2"): 41.0, ("h", "m1"): 0.3}

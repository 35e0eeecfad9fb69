"""An edge's record (kafilad/proto/edge_record.py, proto_spec 07 §6-§7a) through its transitions, with the
clock's readings given (no sockets, no clock)."""

from __future__ import annotations

from kafilad.proto.edge_record import EdgeRecord, PathKind

FOUND = {"verify_s": 0.05, "rtt_ms": 41.0, "remote": "192.0.2.7:4000"}


def test_an_edge_direct_at_formation_falls_back_and_a_reprobe_upgrades_it_at_the_switch():
    rec = EdgeRecord("m0", "m1")
    rec.note_attempt(0, FOUND, now_s=10.0)
    assert rec.path == PathKind.DIRECT and rec.to_json()["rtt_ms"] == 41.0 and rec.last_attempt is None
    rec.fell_back("the path went silent", now_s=20.0)
    j = rec.to_json()
    assert (j["path"], j["reason"], j["fallbacks"], j["fell_back_at"]) == ("relayed", "the path went silent", 1, 20.0)
    rec.note_attempt(1, {**FOUND, "rtt_ms": 43.0}, now_s=30.0)  # verified: parked until the switch (§7 step 2)
    assert rec.path == PathKind.RELAYED and rec.pending["rtt_ms"] == 43.0
    assert rec.last_attempt == {"try": 1, "ok": True, "reason": "", "at": 30.0}
    rec.upgraded(direct_after_s=1.5, now_s=31.0)
    j = rec.to_json()
    assert (j["path"], j["rtt_ms"], j["upgraded_at"], j["upgraded_from"]) == ("direct", 43.0, 31.0, "relayed")
    assert rec.pending is None


def test_a_failed_attempt_relays_with_its_reason():
    rec = EdgeRecord("m1", "m2")
    rec.note_attempt(0, None, "no candidate offer from m2 within 5 s", now_s=1.0)
    assert rec.to_json()["path"] == "relayed" and rec.reason == "no candidate offer from m2 within 5 s"

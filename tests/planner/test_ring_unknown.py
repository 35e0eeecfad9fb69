"""Ring order with unknown NAT classes (kafilad/planner/ring.py; DESIGN §3 steps 4-5, §5.2).

An unknown class (None, or "unknown" when the classification could not measure the mapping) makes
no prediction: its edges are verified by checks at formation, then decided. So they are never
predicted relayed, and ordering counts them as not relayed.
"""

from __future__ import annotations

import pytest

from kafilad.planner import Device, order_ring, predict_path
from kafilad.planner.ring import class_known, edge_rtt_ms, ring_edges


def _relays(ds):
    return sum(1 for a, b in ring_edges(ds) if predict_path(a.nat_class, b.nat_class) == "relayed")


@pytest.mark.parametrize("a,b", [("unknown", "S"), ("S", "unknown"), ("unknown", "unknown"), ("unknown", "C"),
                                 ("UNKNOWN", "s"), ("x", "S"), (None, "S")])
def test_an_unknown_class_is_verified_not_predicted_relayed(a, b):
    assert predict_path(a, b) == "direct"


@pytest.mark.parametrize("cls,known", [("O", True), ("c", True), ("S", True), ("unknown", False), (None, False),
                                       ("", False), (3, False)])
def test_class_known(cls, known):
    assert class_known(cls) is known


def test_an_unknown_member_is_placed_where_a_known_s_would_relay():
    # c1, s, c2, u relays c1-s and s-c2. S needs two neighbours that are not C; only u (unknown:
    # verified, not predicted relayed) qualifies, so one relay is unavoidable and u sits beside s.
    ds = [Device("c1", 1, nat_class="C"), Device("s", 1, nat_class="S"), Device("c2", 1, nat_class="C"),
          Device("u", 1, nat_class="unknown")]
    assert _relays(ds) == 2
    got = order_ring(ds)
    names = [d.name for d in got]
    assert names[0] == "c1" and _relays(got) == 1
    i = names.index("s")
    assert "u" in (names[i - 1], names[(i + 1) % 4])


def test_unknown_edges_estimate_as_direct_when_rtts_are_known():
    a = Device("a", 1, nat_class="unknown", rendezvous_rtt_ms=10.0)
    b = Device("b", 1, nat_class="S", rendezvous_rtt_ms=30.0)
    c = Device("c", 1, nat_class="C", rendezvous_rtt_ms=30.0)
    assert edge_rtt_ms(a, b) == 20.0  # |rA - rB|: the checks may find a direct path
    assert edge_rtt_ms(b, c) == 60.0  # rA + rB: predicted relay


def test_all_unknown_keeps_the_listed_order_without_rtts():
    ds = [Device(n, 1, nat_class="unknown") for n in "abcd"]
    assert [d.name for d in order_ring(ds)] == list("abcd")

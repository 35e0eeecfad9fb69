"""Ring ordering from NAT classes and rendezvous RTTs (DESIGN §3 step 4, §5.2).

Path prediction (table lookup, zero packets; classes measured in the NAT lab):

```
         O        C        S
  O   direct   direct   direct
  C   direct   direct   relayed
  S   direct   relayed  relayed
```

A pair with an unknown class is *verified, then decided*: DESIGN §3 step 5 verifies every chosen
edge by hole punching, keeps a verified edge direct and relays a failed one, and only a
*prediction* of relay lets an edge skip its checks. An unknown class (None: not classified, no
STUN server; "unknown": classified, but the mapping was not measured, proto_spec 04 §4.6) gives no
prediction, so such an edge is never predicted relayed: ``predict_path`` returns "direct" (the
edge's checks run at formation) and ordering counts it as not relayed. A wrong guess costs one
check timeout and a fallback at formation, while guessing relay could split a ring needlessly and
skip a path that works. Status says which classes were unknown and why (kafilad/node/paths/manager.py).

Edge RTT estimates from the members' rendezvous RTTs rA, rB (ms): a direct edge ≈ |rA − rB|
(a lower bound), a relayed one = rA + rB. Unknown when either RTT is unknown. A *measured* RTT
wins over the estimate: a ring edge's settled round trip (the smallest QUIC RTT sample of its
direct path, `path_rtt_ms` in proto_spec 07 §6 edge records, RFC 9002 §5.2), which a live session
passes back to the planner for the pairs its rings have joined (issue 24: the rendezvous RTTs
cannot see a slow hop between two members, so a plan from estimates alone over-predicted a 1-user
rate 2-3x across 40 ms hops).

Ordering (anchor = devices[0] stays first). The ring is cyclic, so each ordering of the others
is one candidate ring. Candidates are ranked by, in turn:
1. the number of predicted-relayed edges (DESIGN §5.2's first pass by NAT class);
2. Σ edge RTTs (measured, else estimated), when every pair of devices has one (relays cost
   rA + rB);
3. Σ |rA − rB| over edges when RTTs are known — breaks the tie when every edge relays (then
   key 1 is 2·Σr for every order) by putting members with similar RTT next to each other;
4. the listed order (the first candidate in lexicographic order of listed positions wins).
The search is exhaustive for m <= EXACT_MAX_DEVICES (8: 5,040 rings); above it, a nearest-
neighbour start improved by 2-opt moves until none helps (documented heuristic).
Without any NAT class or RTT the listed order is returned unchanged.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence

from kafilad.planner.records import Device

EXACT_MAX_DEVICES = 8
_RELAY = {("C", "S"), ("S", "C"), ("S", "S")}
#: Classes that make a prediction (DESIGN §3 step 4); anything else (None, "unknown") does not.
KNOWN_CLASSES = ("O", "C", "S")


def class_known(nat_class: Optional[str]) -> bool:
    """True for a measured class "O", "C" or "S" (any case); False for None, "unknown" or junk."""
    return isinstance(nat_class, str) and nat_class.upper() in KNOWN_CLASSES


def predict_path(a_class: Optional[str], b_class: Optional[str]) -> str:
    """Predicted path between two NAT classes (DESIGN §3 step 4).

    Args:
        a_class, b_class: "O", "C", "S", "unknown" or None (not classified).
    Returns:
        "relayed" for C–S and S–S, else "direct". A pair with a class that is not known is
        "direct": verified by its checks at formation, then decided (module docstring).
    """
    if not (class_known(a_class) and class_known(b_class)):
        return "direct"
    return "relayed" if (a_class.upper(), b_class.upper()) in _RELAY else "direct"


def measured_rtt(measured: Optional[Mapping], a: str, b: str) -> Optional[float]:
    """The measured RTT of the pair a–b in ms from `measured` ({(from, to): rtt_ms}, either
    direction: a path's round trip is the same both ways), or None."""
    if not measured:
        return None
    v = measured.get((a, b))
    if v is None:
        v = measured.get((b, a))
    return None if v is None else float(v)


def edge_rtt_ms(a: Device, b: Device, measured: Optional[Mapping] = None) -> Optional[float]:
    """RTT of the edge a→b in ms: measured (`measured`, {(from, to): rtt_ms}) where known, else the
    estimate from rendezvous RTTs (DESIGN §5.2); None when neither is known."""
    m = measured_rtt(measured, a.name, b.name)
    if m is not None:
        return m
    ra, rb = a.rendezvous_rtt_ms, b.rendezvous_rtt_ms
    if ra is None or rb is None:
        return None
    if predict_path(a.nat_class, b.nat_class) == "relayed":
        return float(ra) + float(rb)
    return abs(float(ra) - float(rb))


def ring_edges(order: Sequence[Device]) -> list[tuple[Device, Device]]:
    """Ring edges in order, the last closing back to order[0]; none for a single device."""
    m = len(order)
    if m < 2:
        return []
    return [(order[i], order[(i + 1) % m]) for i in range(m)]


def _spread_ms(a: Device, b: Device) -> float:
    ra, rb = a.rendezvous_rtt_ms, b.rendezvous_rtt_ms
    return 0.0 if ra is None or rb is None else abs(ra - rb)


def _key(order: Sequence[Device], all_rtt: bool, measured: Optional[Mapping] = None) -> tuple:
    edges = ring_edges(order)
    relays = sum(1 for a, b in edges if predict_path(a.nat_class, b.nat_class) == "relayed")
    if not all_rtt:
        return (relays,)
    rtt = sum(edge_rtt_ms(a, b, measured) for a, b in edges)  # type: ignore[misc]
    spread = sum(_spread_ms(a, b) for a, b in edges)
    # fewest predicted relays first (DESIGN §5.2 "first pass by NAT class"), then the cheapest RTT:
    # RTT first let sub-millisecond RTT noise put two S members side by side (a relayed edge)
    return (relays, round(rtt, 9), round(spread, 9))


def _two_opt(order: list[Device], all_rtt: bool, measured: Optional[Mapping]) -> list[Device]:
    best, best_key = order, _key(order, all_rtt, measured)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(best) - 1):
            for k in range(i + 1, len(best)):
                cand = best[:i] + best[i:k + 1][::-1] + best[k + 1:]
                ck = _key(cand, all_rtt, measured)
                if ck < best_key:
                    best, best_key, improved = cand, ck, True
    return best


def order_ring(devices: Sequence[Device], measured_rtt_ms: Optional[Mapping] = None) -> list[Device]:
    """Choose the ring order (DESIGN §5.2); devices[0] (the anchor) stays first.

    Args:
        devices: the fleet, anchor first.
        measured_rtt_ms: measured round trips, {(from name, to name): ms}, either direction; they
            win over the rendezvous estimates (module docstring).
    Returns:
        the devices in ring order (a new list). Unchanged when no device has a NAT class or RTT
        and no pair a measured RTT.
    """
    devices = list(devices)
    if len(devices) <= 2:
        return devices
    pairs = list(itertools.combinations(devices, 2))
    if all(d.nat_class is None and d.rendezvous_rtt_ms is None for d in devices) and \
            not any(measured_rtt(measured_rtt_ms, a.name, b.name) is not None for a, b in pairs):
        return devices
    # ranked by RTT only when every candidate ring's every edge has one (measured or estimated)
    all_rtt = all(edge_rtt_ms(a, b, measured_rtt_ms) is not None for a, b in pairs)
    measured = measured_rtt_ms
    anchor, rest = devices[0], devices[1:]
    if len(devices) <= EXACT_MAX_DEVICES:
        best, best_key = devices, _key(devices, all_rtt, measured)
        for perm in itertools.permutations(rest):
            cand = [anchor, *perm]
            k = _key(cand, all_rtt, measured)
            if k < best_key:
                best, best_key = cand, k
        return best
    # nearest-neighbour start, then 2-opt
    order = [anchor]
    left = list(rest)
    while left:
        last = order[-1]
        nxt = min(left, key=lambda d: _key([last, d], all_rtt, measured))
        order.append(nxt)
        left.remove(nxt)
    return _two_opt(order, all_rtt, measured)

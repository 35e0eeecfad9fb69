"""ICE-style connectivity checks (kafilad.proto.ice) against the in-memory NAT model (tests/netsim.py), fake clock."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto.ice import (
    AgentState,
    ChecksFailed,
    IceAgent,
    PathLost,
    PathVerified,
    SizeConfirmed,
    candidates_from_sdp,
    candidates_to_sdp,
    make_candidate,
    new_credentials,
)
from kafilad.proto.stun import decode
from netsim import Nat

STUN_SERVER = ("192.0.2.10", 3478)


@dataclass
class Side:
    local: tuple
    nat: Nat
    agent: IceAgent | None = None
    events: list = field(default_factory=list)


def make_pair(cls_a, cls_b, *, timeout_s=5.0, loss=0.0, seed=1):
    """Two sides behind NATs with credentials and candidates exchanged as the signal channel would."""
    a = Side(("10.0.1.2" if cls_a else "203.0.113.1", 5000), Nat(cls_a, "203.0.113.1"))
    b = Side(("10.0.2.2" if cls_b else "203.0.113.2", 5000), Nat(cls_b, "203.0.113.2"))
    ca, cb = new_credentials(), new_credentials()

    def cands(side):
        srflx = side.nat.outbound(side.local, STUN_SERVER)  # what STUN classification learnt
        return candidates_to_sdp([make_candidate("host", side.local), make_candidate("srflx", srflx)])

    sa, sb = cands(a), cands(b)
    a.agent = IceAgent(controlling=True, local=ca, remote=cb, remote_candidates=candidates_from_sdp(sb), now=0.0,
                       tie_breaker=1, timeout_s=timeout_s)
    b.agent = IceAgent(controlling=False, local=cb, remote=ca, remote_candidates=candidates_from_sdp(sa), now=0.0,
                       tie_breaker=2, timeout_s=timeout_s)
    return a, b, random.Random(seed), loss


def run(a, b, rng, loss, until_s=10.0, one_way_s=0.01, drop=lambda data, src, dst: False):
    """Pump datagrams between the sides through their NATs until both agents are settled."""
    now = 0.0
    in_flight = []  # (arrival_s, data, public src, dst, receiving side)
    sides = {id(a): a, id(b): b}
    publics = {a.nat.public_ip: a, b.nat.public_ip: b}
    while now <= until_s:
        for side in (a, b):
            other = b if side is a else a
            for data, dst in side.agent.datagrams_to_send(now):
                src = side.nat.outbound(side.local, dst)
                if rng.random() < loss or drop(data, src, dst):
                    continue
                target = publics.get(dst[0]) if dst[0] in publics else None
                if target is other:
                    in_flight.append((now + one_way_s, data, src, dst, other))
            while (ev := side.agent.next_event()) is not None:
                side.events.append((now, ev))
        in_flight.sort(key=lambda x: x[0])
        timers = [t for t in (a.agent.get_timer(), b.agent.get_timer()) if t is not None]
        if in_flight:
            timers.append(in_flight[0][0])
        if not timers:
            break
        now = max(now, min(timers))
        while in_flight and in_flight[0][0] <= now:
            _, data, src, dst, side = in_flight.pop(0)
            local = side.nat.inbound(src, dst)
            if local == side.local:
                side.agent.receive_datagram(data, src, now)
        for side in (a, b):
            t = side.agent.get_timer()
            if t is not None and now >= t:
                side.agent.handle_timer(now)
        if all(s.agent.state != AgentState.CHECKING for s in (a, b)) and (a.agent.get_timer() or 1e9) > now + 1 \
                and all(s.events for s in (a, b)) and not in_flight:
            break
    del sides
    return now


@pytest.mark.parametrize("cls_a,cls_b", [("O", "O"), ("C", "C"), ("O", "C"), ("C", "O"), ("O", "S"), ("S", "O"),
                                         (None, "S"), (None, None)])
def test_predicted_direct_pairs_verify_on_both_sides(cls_a, cls_b):
    a, b, rng, loss = make_pair(cls_a, cls_b)
    run(a, b, rng, loss)
    ev_a, ev_b = a.events[0][1], b.events[0][1]
    assert isinstance(ev_a, PathVerified) and isinstance(ev_b, PathVerified), (a.events, b.events)
    # each side selected the address that really reaches the other (its NAT's mapping toward us)
    assert ev_a.remote == b.nat.outbound(b.local, a.nat.outbound(a.local, ev_a.remote))
    assert ev_b.remote == a.nat.outbound(a.local, ev_a.remote)
    assert ev_a.rtt_ms == pytest.approx(20.0)
    assert a.agent.verified_after_s < 0.5 and b.agent.verified_after_s < 0.5


@pytest.mark.parametrize("cls_a,cls_b", [("C", "S"), ("S", "C"), ("S", "S")])
def test_predicted_relay_pairs_fail_within_the_bound(cls_a, cls_b):
    a, b, rng, loss = make_pair(cls_a, cls_b, timeout_s=3.0)
    run(a, b, rng, loss)
    for side in (a, b):
        when, ev = side.events[0]
        assert isinstance(ev, ChecksFailed) and when == pytest.approx(3.0)
        assert ev.reason.startswith("no direct path answered within 3 s")
        # paced at 50 ms: about 60 checks in 3 s, never a burst
        assert 50 <= side.agent.checks_sent <= 62


def test_checks_are_paced_50_ms_apart():
    a, b, rng, loss = make_pair("S", "S", timeout_s=1.0)
    sent = []
    now = 0.0
    while now < 1.0:
        sent += [now for _ in a.agent.datagrams_to_send(now)]
        now = a.agent.get_timer()
        a.agent.handle_timer(now)
    gaps = [round(y - x, 6) for x, y in zip(sent, sent[1:])]
    assert gaps and all(g == pytest.approx(0.05) for g in gaps)


def test_lossy_network_still_verifies_cone_pairs():
    wins = 0
    for seed in range(20):
        a, b, rng, loss = make_pair("C", "C", loss=0.3, seed=seed)
        run(a, b, rng, loss)
        wins += all(isinstance(s.events[0][1], PathVerified) for s in (a, b) if s.events)
    assert wins >= 18


def test_a_lost_nomination_is_repeated_until_answered():
    a, b, rng, loss = make_pair("O", "O")
    dropped = []

    def drop_first_nominations(data, src, dst):
        msg = decode(data)
        if msg is not None and "USE-CANDIDATE" in msg.attributes and len(dropped) < 3:
            dropped.append(msg)
            return True
        return False

    run(a, b, rng, loss, drop=drop_first_nominations)
    assert len(dropped) == 3
    assert isinstance(b.events[0][1], PathVerified)
    assert a.agent._nominated


def test_keepalives_every_15_s_and_loss_of_the_path_is_reported():
    a, b, rng, loss = make_pair("O", "O")
    run(a, b, rng, loss)
    # keep the flow alive for a minute: no PathLost, keepalives well under conntrack's 30 s
    now = 1.0
    sent_at = []
    while now < 60.0:
        for data, dst in a.agent.datagrams_to_send(now):
            sent_at.append(now)
            resp = None
            b.agent.receive_datagram(data, a.nat.outbound(a.local, dst), now)
            for rdata, rdst in b.agent.datagrams_to_send(now):
                resp = (rdata, rdst)
            if resp:
                a.agent.receive_datagram(resp[0], dst, now + 0.02)
        now = min(a.agent.get_timer(), 60.0)
        a.agent.handle_timer(now)
    assert a.agent.state == AgentState.VERIFIED
    assert len(sent_at) >= 3 and all(y - x <= 15.0 + 1e-6 for x, y in zip(sent_at, sent_at[1:]))
    # then the peer vanishes
    while a.agent.state == AgentState.VERIFIED:
        a.agent.datagrams_to_send(now)
        now = a.agent.get_timer()
        a.agent.handle_timer(now)
    ev = [e for e in iter(a.agent.next_event, None)]
    assert isinstance(ev[-1], PathLost) and "stopped answering for 35 s" in ev[-1].reason


def test_wrong_password_and_foreign_usernames_are_not_accepted():
    a, b, rng, loss = make_pair("O", "O")
    intruder = IceAgent(controlling=True, local=new_credentials(), remote=b.agent.local,
                        remote_candidates=[], now=0.0)
    intruder.remote = type(b.agent.local)(b.agent.local.ufrag, "x" * 32)  # right ufrag, wrong password
    intruder.add_remote_candidate(("10.0.2.2", 5000))
    data, _ = intruder.datagrams_to_send(0.0)[0]
    assert b.agent.receive_datagram(data, ("198.51.100.1", 9), 0.01) is True  # claimed (its ufrag) ...
    assert b.agent.datagrams_to_send(0.01) == [] or all(
        decode(d).message_class.name == "REQUEST" for d, _ in b.agent.datagrams_to_send(0.01))  # ... not answered
    other = new_credentials()
    stranger = IceAgent(controlling=True, local=new_credentials(), remote=other, remote_candidates=[], now=0.0)
    stranger.add_remote_candidate(("10.0.2.2", 5000))
    data, _ = stranger.datagrams_to_send(0.0)[0]
    assert b.agent.receive_datagram(data, ("198.51.100.1", 9), 0.01) is False  # someone else's ufrag


def test_candidates_round_trip_and_bad_ones_are_skipped():
    cands = [make_candidate("host", ("10.0.1.2", 5000)), make_candidate("srflx", ("203.0.113.1", 40000))]
    lines = candidates_to_sdp(cands)
    back = candidates_from_sdp(lines + ["garbage", 7, "1 1 udp 5 not-an-ip 9 typ host", "1 1 tcp 5 1.2.3.4 9 typ host"])
    assert [(c.host, c.port, c.type) for c in back] == [("10.0.1.2", 5000, "host"), ("203.0.113.1", 40000, "srflx")]
    assert back[0].priority > back[1].priority
    assert candidates_from_sdp("not a list") == []


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200), flips=st.lists(st.integers(0, 10_000), max_size=8), cut=st.integers(0, 400))
def test_fuzz_malformed_check_packets_are_dropped_never_raise(data, flips, cut):
    a, b, rng, loss = make_pair("O", "O")
    real, _ = a.agent.datagrams_to_send(0.0)[0]
    mutated = bytearray(real)
    for f in flips:
        mutated[f % len(mutated)] ^= 1 << (f % 8)
    for packet in (data, bytes(mutated), bytes(mutated[:cut]), real[:cut] + data):
        b.agent.receive_datagram(packet, ("203.0.113.1", 40000), 0.01)
        a.agent.receive_datagram(packet, ("203.0.113.2", 40000), 0.01)
    b.agent.datagrams_to_send(0.02)
    assert b.agent.state in (AgentState.CHECKING, AgentState.VERIFIED)


# ---- size probes (proto_spec 07 §4a) ---------------------------------------------------------------

def test_a_size_probe_is_exactly_as_large_as_asked_and_its_answer_confirms_the_size():
    a, b, rng, loss = make_pair("O", "C")
    run(a, b, rng, loss)
    assert a.agent.state == b.agent.state == AgentState.VERIFIED
    assert not a.agent.send_size_probe(1250, 0.0)  # not a multiple of 4: nothing queued
    assert a.agent.send_size_probe(1252, 0.0)  # (each run() starts its clock at 0)
    (data, dst), = a.agent.datagrams_to_send(0.0)
    assert len(data) == 1252 and dst == a.agent.selected
    msg = decode(data)
    assert len(msg.attributes["PADDING"]) > 1000 and msg.check_message_integrity(b.agent.local.pwd.encode())
    a.agent._out.append((data, dst))  # send it through the NATs with everything else
    a.events.clear()
    run(a, b, rng, loss, until_s=2.0)
    confirmed = [ev for _, ev in a.events if isinstance(ev, SizeConfirmed)]
    assert [c.size_bytes for c in confirmed] == [1252] and confirmed[0].rtt_ms == pytest.approx(20.0)


def test_a_size_probe_larger_than_the_path_goes_unanswered_and_costs_nothing_else():
    a, b, rng, loss = make_pair("O", "O")
    run(a, b, rng, loss)
    a.events.clear()
    too_big = lambda data, src, dst: len(data) > 1252  # noqa: E731 - an MTU of 1280 with fragments dropped
    assert a.agent.send_size_probe(1348, 0.0)
    run(a, b, rng, loss, until_s=3.0, drop=too_big)
    assert not [ev for _, ev in a.events if isinstance(ev, SizeConfirmed)]
    assert a.agent.state == AgentState.VERIFIED  # the path itself is fine


def test_size_probes_need_a_selected_pair_and_stop_with_the_agent():
    a, b, rng, loss = make_pair("O", "O")
    assert not a.agent.send_size_probe(1252, 0.0)  # still checking
    run(a, b, rng, loss)
    a.agent.close()
    assert a.agent.state == AgentState.CLOSED and a.agent.get_timer() is None
    assert not a.agent.send_size_probe(1252, 2.0) and a.agent.datagrams_to_send(2.0) == []

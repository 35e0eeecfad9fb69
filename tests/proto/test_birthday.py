"""Birthday-paradox probing, sans-IO (kafilad/proto/birthday.py; proto_spec 07 §7b).

The probability functions against exact combinatorics, the port order, authentication and budget
accounting, and whole searches between two machines through an in-memory model of the lab's NATs
(a symmetric NAT drawing a random port per flow, as ``masquerade random`` does, and a
port-restricted cone), including the hand-off of the found pair to two ICE agents. No sockets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto import birthday as bd
from kafilad.proto import ice
from kafilad.proto.stun import decode

C_LOCAL, S_LOCAL_IP = ("10.0.1.2", 5000), "10.0.2.2"
C_PUB_IP, S_PUB_IP = "172.16.0.21", "172.16.0.22"
C_PUB = (C_PUB_IP, 40000)


# ---- probability --------------------------------------------------------------------------------

@given(r=st.integers(1, 60), n=st.integers(0, 60), m=st.integers(0, 60))
def test_miss_probability_is_the_hypergeometric_zero_term(r, n, m):
    if n > r or m > r:
        with pytest.raises(ValueError):
            bd.miss_probability(n, m, r)
        return
    exact = math.comb(r - n, m) / math.comb(r, m) if m <= r - n else 0.0
    assert bd.miss_probability(n, m, r) == pytest.approx(exact, rel=1e-9, abs=1e-12)


@settings(max_examples=40)
@given(target=st.floats(0.0, 0.999), n=st.integers(1, 300))
def test_probes_for_is_the_fewest_reaching_the_target(target, n):
    r = 4096
    m = bd.probes_for(target, n, r)
    assert bd.success_probability(n, m, r) >= target - 1e-12
    if m > 0:
        assert bd.success_probability(n, m - 1, r) < target


def test_the_default_budgets_reach_far_beyond_nine_in_ten():
    p = bd.success_probability(bd.POOL_SOCKETS, bd.SWEEP_PROBES)
    assert bd.PORT_RANGE == 64512
    assert 0.9996 < p < 0.9998  # 1 - exp(-256 * 2048 / 64512) = 0.99970
    assert bd.probes_for(0.9, bd.POOL_SOCKETS) == 577  # exp(-n m / R) would say 580
    assert bd.probes_for(0.99, bd.POOL_SOCKETS) == 1148
    # ten tries, each with p: at least nine succeed with probability > 0.9999
    assert p ** 10 + 10 * p ** 9 * (1 - p) > 0.9999


def test_roles_by_class_pair():
    assert bd.role_for("S", "C") == bd.Role.POOL
    assert bd.role_for("C", "S") == bd.Role.SWEEP
    assert bd.role_for("S", "S") == bd.Role.BOTH
    for pair in [("O", "S"), ("S", "O"), ("C", "C"), ("O", "O"), ("unknown", "S"), (None, "S"), ("S", None)]:
        assert bd.role_for(*pair) is None


@given(seed=st.integers(0, 2**32), count=st.integers(0, 5000), first=st.lists(st.integers(0, 70000), max_size=5))
def test_sweep_ports_are_distinct_in_range_low_ports_first(seed, count, first):
    ports = bd.sweep_ports(random.Random(seed), count, first=first)
    assert len(ports) == count and len(set(ports)) == count
    assert all(bd.PORT_MIN <= p <= bd.PORT_MAX for p in ports)
    lead = list(dict.fromkeys(p for p in first if bd.PORT_MIN <= p <= bd.PORT_MAX))[:count]
    assert ports[:len(lead)] == lead
    low = [p for p in ports[len(lead):] if p < 2 * bd.PORT_MIN]
    assert ports[len(lead):len(lead) + len(low)] == low  # the doubly likely ports come before the rest


# ---- an in-memory model of the lab's NATs ---------------------------------------------------------

@dataclass
class Cone:
    """Port-restricted cone (C): one public port per local socket; admits only what it sent to."""

    ip: str
    ports: dict = field(default_factory=dict)    # local -> public port
    sent_to: set = field(default_factory=set)     # (public port, remote)

    def out(self, local, dst):
        port = self.ports.setdefault(local, 40000 + len(self.ports))
        self.sent_to.add((port, dst))
        return (self.ip, port)

    def inbound(self, src, dst):
        if (dst[1], src) not in self.sent_to:
            return None
        return next((loc for loc, p in self.ports.items() if p == dst[1]), None)


@dataclass
class Symmetric:
    """Symmetric NAT (S) as Linux ``masquerade random``: a random port per (local, destination) flow;
    admits only the reply of a flow."""

    ip: str
    rng: random.Random
    flows: dict = field(default_factory=dict)   # (local, dst) -> public port
    by_port: dict = field(default_factory=dict)  # (public port, remote) -> local

    def out(self, local, dst):
        port = self.flows.get((local, dst))
        if port is None:
            while True:
                port = bd.PORT_MIN + self.rng.getrandbits(16) % bd.PORT_RANGE
                if (port, dst) not in self.by_port:
                    break
            self.flows[(local, dst)] = port
            self.by_port[(port, dst)] = local
        return (self.ip, port)

    def inbound(self, src, dst):
        return self.by_port.get((dst[1], src))


class Side:
    """One end: its search, then the ICE agent the found pair is handed to."""

    def __init__(self, name, nat, locals_, search):
        self.name, self.nat, self.locals, self.search = name, nat, locals_, search
        self.agent: Optional[ice.IceAgent] = None
        self.agent_socket: Optional[int] = None
        self.events: list = []

    def deliver(self, local, data, src, now):
        sock = self.locals.index(local)
        if self.agent is not None and sock == self.agent_socket and self.agent.receive_datagram(data, src, now):
            return
        self.search.receive_datagram(sock, data, src, now)

    def outgoing(self, now):
        out = [(self.locals[s], d, dst) for s, d, dst in self.search.datagrams_to_send(now)]
        if self.agent is not None:
            out += [(self.locals[self.agent_socket], d, dst) for d, dst in self.agent.datagrams_to_send(now)]
        return out

    def timers(self):
        ts = [self.search.get_timer()]
        if self.agent is not None:
            ts.append(self.agent.get_timer())
        return [t for t in ts if t is not None]

    def tick(self, now):
        if (t := self.search.get_timer()) is not None and now >= t:
            self.search.handle_timer(now)
        if self.agent is not None and (t := self.agent.get_timer()) is not None and now >= t:
            self.agent.handle_timer(now)

    def take_events(self, now, creds):
        while (ev := self.search.next_event()) is not None:
            self.events.append(ev)
            pick = isinstance(ev, bd.Nominated) or (isinstance(ev, bd.Answered) and self.search.controlling)
            if pick and self.agent is None:
                self.search.close() if self.search.controlling else None
                local, remote = creds
                self.agent = ice.IceAgent(controlling=self.search.controlling, local=local, remote=remote,
                                          remote_candidates=[ice.make_candidate("prflx", ev.remote)], now=now)
                self.agent_socket = ev.socket
        while self.agent is not None and (ev := self.agent.next_event()) is not None:
            self.events.append(ev)


def run_pair(seed: int, *, c_controlling: bool, s_classes=("C", "S"), horizon_s: float = 12.0,
             pool: int = bd.POOL_SOCKETS, probes: Optional[int] = None):
    """A search between a C (or S) end and an S end through the model NATs; both ends' events."""
    rng = random.Random(seed)
    ca, cb = ice.new_credentials(rng.randbytes), ice.new_credentials(rng.randbytes)
    a_cls, b_cls = s_classes
    a_nat = Cone(C_PUB_IP) if a_cls == "C" else Symmetric(C_PUB_IP, random.Random(seed + 1))
    b_nat = Symmetric(S_PUB_IP, random.Random(seed + 2))
    a_role, b_role = bd.role_for(a_cls, b_cls), bd.role_for(b_cls, a_cls)
    a_locals = [C_LOCAL] if a_role == bd.Role.SWEEP else [("10.0.1.2", 6000 + i) for i in range(pool)]
    b_locals = [(S_LOCAL_IP, 6000 + i) for i in range(pool)]
    # each end learns the other's server-reflexive address from STUN (for S: the IP is what counts)
    a_srflx = a_nat.out(a_locals[0], ("172.16.0.10", 3478))
    b_srflx = b_nat.out(b_locals[0], ("172.16.0.10", 3478))
    a = Side("a", a_nat, a_locals, bd.BirthdaySearch(
        role=a_role, controlling=c_controlling, local=ca, remote=cb, peer=b_srflx, sockets=len(a_locals), now=0.0,
        probes=probes, rng=random.Random(seed + 3), random_bytes=rng.randbytes))
    b = Side("b", b_nat, b_locals, bd.BirthdaySearch(
        role=b_role, controlling=not c_controlling, local=cb, remote=ca, peer=a_srflx, sockets=len(b_locals),
        now=0.0, probes=probes, rng=random.Random(seed + 4), random_bytes=rng.randbytes))
    sides, creds = {"a": a, "b": b}, {"a": (ca, cb), "b": (cb, ca)}
    other = {"a": b, "b": a}
    now = 0.0
    sent = {"a": 0, "b": 0}
    while now <= horizon_s:
        for name, side in sides.items():
            side.tick(now)
        moved = True
        while moved:  # deliver until quiet (zero delay: answers go out at the same instant)
            moved = False
            for name, side in sides.items():
                for local, data, dst in side.outgoing(now):
                    moved = True
                    sent[name] += 1
                    src_pub = side.nat.out(local, dst)
                    peer = other[name]
                    if dst[0] != peer.nat.ip:
                        continue
                    to_local = peer.nat.inbound(src_pub, dst)
                    if to_local is not None:
                        peer.deliver(to_local, data, src_pub, now)
                side.take_events(now, creds[name])
            for name, side in sides.items():
                side.take_events(now, creds[name])
        done = all(s.agent is not None and s.agent.state == ice.AgentState.VERIFIED for s in sides.values())
        failed = all(s.search.state == bd.SearchState.FAILED for s in sides.values())
        if done or failed:
            break
        timers = [t for s in sides.values() for t in s.timers() if t > now]
        if not timers:
            break
        now = min(timers)
    return a, b, now, sent


@pytest.mark.parametrize("c_controlling", [True, False], ids=["C-sender", "S-sender"])
def test_c_and_s_find_one_pair_and_hand_it_to_ice_agents(c_controlling):
    a, b, now, sent = run_pair(7, c_controlling=c_controlling)
    va = [e for e in a.events if isinstance(e, ice.PathVerified)]
    vb = [e for e in b.events if isinstance(e, ice.PathVerified)]
    assert len(va) == 1 and len(vb) == 1, (a.events, b.events)
    # the pair: the C socket with S_IP:p_i, and the S pool socket i with C's mapped address
    assert vb[0].remote == C_PUB and va[0].remote[0] == S_PUB_IP
    s_local = b.locals[b.agent_socket]
    assert b.nat.flows[(s_local, C_PUB)] == va[0].remote[1]
    assert a.agent_socket == 0
    assert now < bd.SWEEP_DELAY_S + bd.SWEEP_PROBES / bd.BURST * bd.TICK_S + 0.5
    controlled = b if c_controlling else a
    assert any(isinstance(e, bd.Nominated) for e in controlled.events)
    assert a.search.probes_sent <= a.search.budget + bd.MAX_TRIGGERED
    assert b.search.probes_sent <= b.search.budget + bd.MAX_TRIGGERED
    assert b.search.budget == bd.POOL_SOCKETS * (1 + len(bd.POOL_RESEND_S))


def test_c_and_s_succeed_at_the_predicted_rate():
    """100 seeded searches with a smaller pool (64 sockets, predicted 1 - exp(-64 * 2048 / 64512) = 0.87)
    land near the prediction; the default pool is checked on a few seeds (each must succeed)."""
    wins = 0
    for seed in range(100):
        a, b, _, _ = run_pair(1000 + seed, c_controlling=seed % 2 == 0, pool=64)
        wins += bool(a.agent and b.agent and a.agent.state == b.agent.state == ice.AgentState.VERIFIED)
    predicted = bd.success_probability(64, bd.SWEEP_PROBES)
    assert 0.86 < predicted < 0.88
    assert abs(wins / 100 - predicted) < 0.1, wins
    for seed in range(5):
        a, b, now, _ = run_pair(seed, c_controlling=True)
        assert a.agent.state == b.agent.state == ice.AgentState.VERIFIED and now < 4.0


def test_s_and_s_exhaust_their_budgets_and_fail_with_a_sentence():
    a, b, now, sent = run_pair(3, c_controlling=True, s_classes=("S", "S"), pool=16, probes=256)
    for side in (a, b):
        assert side.search.state == bd.SearchState.FAILED
        (failed,) = [e for e in side.events if isinstance(e, bd.SearchFailed)]
        assert failed.reason.startswith("no birthday probe answered within 8 s (256 checks from 16 sockets")
        assert side.search.probes_sent == 256
    assert now == pytest.approx(bd.SEARCH_TIMEOUT_S)


def _pool(controlling=False, **kw):
    ca, cb = ice.new_credentials(), ice.new_credentials()
    args = dict(role=bd.Role.POOL, controlling=controlling, local=ca, remote=cb, peer=C_PUB, sockets=4, now=0.0)
    args.update(kw)
    return bd.BirthdaySearch(**args), ca, cb


def test_a_pool_sends_one_round_per_socket_then_its_resends():
    s, _, cb = _pool()
    first = s.datagrams_to_send(0.0)
    assert sorted(sock for sock, _, _ in first) == [0, 1, 2, 3] and all(dst == C_PUB for _, _, dst in first)
    msg = decode(first[0][1])
    assert msg.attributes["USERNAME"].startswith(cb.ufrag + ":") and msg.check_message_integrity(cb.pwd.encode())
    assert s.get_timer() == pytest.approx(bd.POOL_RESEND_S[0])
    assert s.datagrams_to_send(1.0) == []
    s.handle_timer(bd.POOL_RESEND_S[0])
    assert len(s.datagrams_to_send(bd.POOL_RESEND_S[0])) == 4
    s.handle_timer(bd.POOL_RESEND_S[1])
    assert len(s.datagrams_to_send(bd.POOL_RESEND_S[1])) == 4
    assert s.probes_sent == s.budget == 12
    assert s.get_timer() == bd.SEARCH_TIMEOUT_S


def test_a_sweep_waits_for_the_pool_and_paces_its_bursts():
    ca, cb = ice.new_credentials(), ice.new_credentials()
    s = bd.BirthdaySearch(role=bd.Role.SWEEP, controlling=True, local=ca, remote=cb, peer=(S_PUB_IP, 3333),
                          sockets=9, now=0.0, probes=40)
    assert s.sockets == 1 and s.datagrams_to_send(0.0) == [] and s.get_timer() == bd.SWEEP_DELAY_S
    out = []
    t = s.get_timer()
    while t is not None and t < bd.SEARCH_TIMEOUT_S:
        s.handle_timer(t)
        out.append((t, s.datagrams_to_send(t)))
        t = s.get_timer()
    sizes = [len(d) for _, d in out if d]
    assert sizes == [16, 16, 8]
    assert [round(t - bd.SWEEP_DELAY_S, 6) for t, d in out if d] == [0.0, bd.TICK_S, 2 * bd.TICK_S]
    ports = [dst[1] for _, d in out for _, _, dst in d]
    assert len(set(ports)) == 40 and all(dst[0] == S_PUB_IP for _, d in out for _, _, dst in d)


def test_checks_with_a_wrong_password_or_from_elsewhere_are_claimed_and_dropped():
    s, ca, cb = _pool(controlling=True)
    sent = s.datagrams_to_send(0.0)
    sock, data, dst = sent[2]
    req = decode(data)
    # an answer from another address than the check went to: claimed, no event
    good = _answer(req, ca, cb.pwd)
    assert s.receive_datagram(sock, good, ("172.16.0.99", 1), 0.01)
    assert s.next_event() is None and s.state == bd.SearchState.SEARCHING
    # the right address, the wrong key
    assert s.receive_datagram(sock, _answer(req, ca, "x" * 32), dst, 0.01)
    assert s.next_event() is None
    # the right address and key: Answered, and the controlling end picks the pair
    assert s.receive_datagram(sock, good, dst, 0.02)
    ev = s.next_event()
    assert isinstance(ev, bd.Answered) and (ev.socket, ev.remote) == (2, C_PUB) and ev.probes == 4
    assert s.state == bd.SearchState.FOUND and s.found == (2, C_PUB)
    # a request of another session's credentials is not ours
    other = ice.new_credentials()
    foreign = ice.IceAgent(controlling=False, local=other, remote=ice.new_credentials(),
                           remote_candidates=[ice.make_candidate("host", ("10.9.9.9", 9))], now=0.0)
    (fdata, _), = foreign.datagrams_to_send(0.0)
    assert not s.receive_datagram(0, fdata, ("10.9.9.9", 9), 0.1)


def _answer(req, responder: ice.Credentials, key: str) -> bytes:
    from aioice.stun import Class, Message, Method
    resp = Message(Method.BINDING, Class.RESPONSE, transaction_id=req.transaction_id,
                   attributes={"XOR-MAPPED-ADDRESS": ("172.16.0.22", 4242)})
    resp.add_message_integrity(key.encode())
    resp.add_fingerprint()
    return bytes(resp)


def test_the_controlled_end_answers_checks_until_nominated_then_leaves_the_nomination_to_its_agent():
    s, ca, cb = _pool(controlling=False)
    s.datagrams_to_send(0.0)
    peer = ice.IceAgent(controlling=True, local=cb, remote=ca, remote_candidates=[], now=0.0)
    peer.add_remote_candidate(("172.16.0.22", 5555))
    (check, _), = peer.datagrams_to_send(0.0)
    assert s.receive_datagram(1, check, C_PUB, 0.1)
    out = s.datagrams_to_send(0.1)
    kinds = [(sock, decode(d).message_class.name, dst) for sock, d, dst in out]
    assert kinds == [(1, "RESPONSE", C_PUB), (1, "REQUEST", C_PUB)]  # the answer, then a triggered check
    assert s.answers_sent == 1 and s.state == bd.SearchState.SEARCHING
    assert peer.receive_datagram(out[0][1], ("172.16.0.22", 5555), 0.11)
    assert isinstance(peer.next_event(), ice.PathVerified)
    (nomination, _), = peer.datagrams_to_send(0.11)
    assert "USE-CANDIDATE" in decode(nomination).attributes
    assert s.receive_datagram(1, nomination, C_PUB, 0.12)
    assert s.datagrams_to_send(0.12) == []  # unanswered
    ev = s.next_event()
    assert isinstance(ev, bd.Nominated) and (ev.socket, ev.remote) == (1, C_PUB)
    assert s.state == bd.SearchState.FOUND and s.get_timer() is None
    s.close()
    assert not s.receive_datagram(1, check, C_PUB, 0.2)


def test_a_bad_peer_address_or_no_socket_is_refused():
    with pytest.raises(ValueError):
        _pool(peer=("not an ip", 1))
    with pytest.raises(ValueError):
        _pool(sockets=0)

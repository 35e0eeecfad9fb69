"""Honest NAT classes and host candidates (issue 11; proto_spec 04 §4.6, 07 §1-§2, §6), no sockets, mock clock.

Real parts: the RFC 5780 classifier against STUN responders, ICE agents, QUIC, Noise, the UDP
demultiplexer. Simulated: the wire (tests/netsim.py NAT boxes, a firewall hook) and the rendezvous.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import trio
from trio.testing import MockClock, trio_test

from kafilad.net import udp_endpoint
from kafilad.node.paths.edge import RingEdge
from kafilad.node.paths.manager import CLASSIFY_RETRY_S, PathKind, open_session_paths
from kafilad.proto import ice
from kafilad.proto.identity import peer_id as peer_id_of
from kafilad.proto.rendezvous_proof import public_key
from netsim import STUN_GRID, MemoryRendezvous, SimNet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


class _Peer:
    def __init__(self, name, key, endpoint, rdv):
        self.name, self.key, self.endpoint, self.rdv = name, key, endpoint, rdv
        self.paths = None

    @property
    def peer_id(self):
        return peer_id_of(public_key(self.key))


async def _hold(peer, *, task_status=trio.TASK_STATUS_IGNORED):
    node = SimpleNamespace(name=peer.name, static_private=peer.key)
    async with open_session_paths(node, peer.rdv, endpoint=peer.endpoint) as pm:
        peer.rdv.on_signal = pm.on_signal
        peer.paths = pm
        task_status.started(pm)
        await trio.sleep_forever()


async def _peers(nursery, net, hub, endpoints: dict) -> dict:
    peers = {}
    for i, (name, ep) in enumerate(endpoints.items()):
        key = bytes([i + 1]) * 32
        peer = peers[name] = _Peer(name, key, ep, hub.client(peer_id_of(public_key(key)), name))
        await nursery.start(_hold, peer)
    return peers


def _roster(peers):
    return {p.peer_id: {"name": p.name, "public_key": public_key(p.key)} for p in peers.values()}


async def _form_pair(a, b, roster):
    out = RingEdge(a.paths, peer_id=b.peer_id, roster=roster, sender=True, session_id="s1")
    into = RingEdge(b.paths, peer_id=a.peer_id, roster=roster, sender=False, session_id="s1", incoming=b.rdv.incoming)
    async with trio.open_nursery() as n:
        n.start_soon(out.form)
        n.start_soon(into.form)
    return out, into


@trio_test
async def test_stun_dropped_gives_unknown_classes_with_reasons_and_the_edge_still_forms(clock):
    firewall = {"stun": True}

    def drop(data, src, dst):  # UDP to and from the rendezvous's STUN ports is dropped; nothing else
        return firewall["stun"] and (dst in STUN_GRID or src in STUN_GRID)
    async with trio.open_nursery() as nursery:
        net = SimNet(drop=drop)
        await nursery.start(net.run)
        hub = MemoryRendezvous(stun_servers=net.stun_servers())
        await nursery.start(hub.run)
        p = await _peers(nursery, net, hub, {"a": net.host("a", "O", "203.0.113.1"),
                                             "b": net.host("b", "C", "203.0.113.2")})
        caps = {}
        for name in "ab":
            caps[name] = await p[name].paths.capability()
        for name in "ab":
            cap = caps[name]
            assert cap["nat_class"] == "unknown" and cap["rendezvous_rtt_ms"] is None
            assert cap["nat_reason"].startswith("no STUN answer to Test I from 192.0.2.10:3478, 192.0.2.10:3479 ("), cap
            assert cap["nat_reason"].endswith("(UDP to the rendezvous's STUN ports may be blocked)")
            (ev,) = [e for e in p[name].paths.events if e["event"] == "nat_class"]
            assert ev["nat_class"] == "unknown" and ev["reason"] == cap["nat_reason"] and ev["attempt"] == 1
        out, into = await _form_pair(p["a"], p["b"], _roster(p))
        rec = out.record.to_json()
        # unknown classes predict nothing: the edge was verified by checks (a's host candidate is
        # private and no mapped address is known, so they fail) and then relayed
        assert rec["predicted_path"] == "direct" and rec["path"] == "relayed"
        assert rec["reason"].startswith("no direct path answered within 5 s"), rec
        assert rec["classes"] == {"a": "unknown", "b": "unknown"}
        assert rec["class_reasons"] == {"a": caps["a"]["nat_reason"], "b": caps["b"]["nat_reason"]}
        assert into.record.to_json()["class_reasons"] == rec["class_reasons"]
        await out.link.send({"t": "probe"})
        assert await into.link.receive() == {"t": "probe"}

        firewall["stun"] = False  # STUN passes again: the background retry measures the real classes
        await trio.sleep(CLASSIFY_RETRY_S * 3 + 10)
        for name, cls in (("a", "O"), ("b", "C")):
            pm = p[name].paths
            assert pm.nat_class == cls and pm.nat_reason == ""
            cap = await pm.capability()
            assert cap["nat_class"] == cls and "nat_reason" not in cap
            assert cap["rendezvous_rtt_ms"] in (None, pytest.approx(20.0))  # None when Test I was retransmitted
            kinds = [(e["nat_class"], e["attempt"]) for e in pm.events if e["event"] == "nat_class"]
            assert kinds[0] == ("unknown", 1) and kinds[-1][0] == cls and len(kinds) >= 2
        retries_at = len(net.sent)
        await trio.sleep(CLASSIFY_RETRY_S * 8)
        assert [s for s in net.sent[retries_at:] if s.dst in STUN_GRID] == []  # known classes: no more retries
        nursery.cancel_scope.cancel()


@trio_test
async def test_unknown_class_retries_back_off(clock):
    def drop(data, src, dst):
        return dst in STUN_GRID
    async with trio.open_nursery() as nursery:
        net = SimNet(drop=drop)
        await nursery.start(net.run)
        hub = MemoryRendezvous(stun_servers=net.stun_servers())
        await nursery.start(hub.run)
        p = await _peers(nursery, net, hub, {"a": net.host("a", "C", "203.0.113.1")})
        t0 = trio.current_time()
        assert (await p["a"].paths.capability())["nat_class"] == "unknown"
        await trio.sleep(200)
        starts = [e["ts"] for e in p["a"].paths.events if e["event"] == "nat_class"]
        test1 = sorted({round(s.at_s - t0, 1) for s in net.sent_by("a", kind="stun") if s.dst == STUN_GRID[0]})
        # each classification starts with Test I: at 0, then after waits of 5, 10, 20, 40, 80 s (each run ~6 s)
        firsts = [test1[0]] + [t for prev, t in zip(test1, test1[1:]) if t - prev > 4.0]
        gaps = [round(b - a) for a, b in zip(firsts, firsts[1:])]
        assert len(starts) == len(firsts) >= 5
        assert all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), gaps  # the waits grow
        assert gaps[0] == pytest.approx(CLASSIFY_RETRY_S + 6, abs=1.5), gaps
        nursery.cancel_scope.cancel()


@trio_test
async def test_two_members_behind_one_symmetric_nat_go_direct_at_formation(clock):
    async with trio.open_nursery() as nursery:
        net = SimNet()
        await nursery.start(net.run)
        hub = MemoryRendezvous(stun_servers=net.stun_servers())
        await nursery.start(hub.run)
        a_ep = net.host("a", "S", "203.0.113.1")
        b_ep = net.host("b", None, "", behind=a_ep)
        c_ep = net.host("c", "S", "203.0.113.3")  # another S NAT: S-S still relays by prediction
        p = await _peers(nursery, net, hub, {"a": a_ep, "b": b_ep, "c": c_ep})
        for name in "abc":
            assert (await p[name].paths.capability())["nat_class"] == "S"
        assert b_ep.local == ("10.0.1.3", 5000) and a_ep.nat is b_ep.nat
        t0 = trio.current_time()
        out, into = await _form_pair(p["a"], p["b"], _roster(p))
        assert trio.current_time() - t0 < 1.5  # no check timeout, no re-probe
        rec = out.record.to_json()
        assert rec["path"] == rec["predicted_path"] == "direct" and rec["tries"] == 0, rec
        assert rec["same_network"] is True and rec["remote"] == "10.0.1.3:5000"  # b's host candidate
        assert rec["classes"] == {"a": "S", "b": "S"} and "class_reasons" not in rec
        assert into.record.path == PathKind.DIRECT
        await out.link.send({"t": "probe", "n": 1})
        assert await into.link.receive() == {"t": "probe", "n": 1}
        assert hub.clients[p["a"].peer_id].circuits == []

        out2, into2 = await _form_pair(p["a"], p["c"], _roster(p))
        rec2 = out2.record.to_json()
        assert rec2["path"] == rec2["predicted_path"] == "relayed" and "same_network" not in rec2
        assert rec2["reason"] == "predicted relay (S-S)"
        nursery.cancel_scope.cancel()


@trio_test
async def test_offers_carry_host_candidates_then_the_mapped_address(clock):
    async with trio.open_nursery() as nursery:
        net = SimNet()
        await nursery.start(net.run)
        hub = MemoryRendezvous(stun_servers=net.stun_servers())
        await nursery.start(hub.run)
        p = await _peers(nursery, net, hub, {"a": net.host("a", "C", "203.0.113.1")})
        pm = p["a"].paths
        await pm.capability()
        cands = ice.candidates_from_sdp(await pm.candidates())
        assert [(c.type, c.host, c.port) for c in cands] == [
            ("host", "10.0.1.2", 5000), ("srflx", "203.0.113.1", pm.report.mapped_address[1])]
        pm.endpoint.interfaces = lambda: [("10.0.1.2", 24), ("192.168.7.4", 24), ("172.20.0.9", 16),
                                          ("10.9.9.9", 8), ("10.8.8.8", 8), ("10.7.7.7", 8)]
        cands = ice.candidates_from_sdp(await pm.candidates())
        hosts = [c.host for c in cands if c.type == "host"]
        assert hosts == ["10.0.1.2", "192.168.7.4", "172.20.0.9", "10.9.9.9", "10.8.8.8"]  # bounded: 1 + 4
        assert [c.type for c in cands][-1] == "srflx"
        nursery.cancel_scope.cancel()


class _Adapter:
    def __init__(self, name, ips):
        self.nice_name, self.ips = name, ips


class _IP:
    def __init__(self, ip, prefix):
        self.ip, self.network_prefix = ip, prefix
        self.is_IPv4 = isinstance(ip, str)


def test_interface_addresses_skip_loopback_link_local_and_other_families(monkeypatch):
    import ifaddr
    adapters = [_Adapter("lo", [_IP("127.0.0.1", 8), _IP(("::1", 0, 0), 128)]),
                _Adapter("eth0", [_IP("192.168.1.20", 24), _IP(("fe80::1", 0, 2), 64), _IP(("2001:db8::5", 0, 0), 64)]),
                _Adapter("wlan0", [_IP("169.254.3.3", 16), _IP("10.1.2.3", 16), _IP("192.168.1.20", 24)]),
                _Adapter("odd", [_IP("0.0.0.0", 0), _IP("224.0.0.1", 4)])]
    monkeypatch.setattr(ifaddr, "get_adapters", lambda: adapters)
    assert udp_endpoint.interface_addresses(socket.AF_INET) == [("192.168.1.20", 24), ("10.1.2.3", 16)]
    assert udp_endpoint.interface_addresses(socket.AF_INET6) == [("2001:db8::5", 64)]
    many = [_Adapter(f"e{i}", [_IP(f"10.{i}.0.1", 24)]) for i in range(20)]
    monkeypatch.setattr(ifaddr, "get_adapters", lambda: many)
    assert len(udp_endpoint.interface_addresses()) == udp_endpoint.MAX_INTERFACES


@trio_test
async def test_a_socket_bound_to_one_address_offers_only_it():
    ep = await udp_endpoint.UdpEndpoint.bind("127.0.0.1")
    try:
        assert ep.interfaces() == []  # loopback is never a host candidate
    finally:
        ep.sock.close()

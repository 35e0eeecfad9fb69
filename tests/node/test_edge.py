"""RingEdge and the session's path manager over the in-memory NAT network (tests/netsim.py), mock clock.

Real parts: the RFC 5780 classifier against STUN responders, ICE agents, QUIC (aioquic), Noise XX,
the UDP demultiplexer, RingMember's reading of a switched edge. Simulated: the wire (NAT boxes,
10 ms one way) and the rendezvous (signals, relayed circuits as memory streams). Time is
``MockClock(autojump_threshold=0)``: the 5 s check timeouts and re-probe backoffs pass instantly.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, trio_test

from kafilad.errors import HandshakeRefused, RingEdgeError, SessionError
from kafilad.node.serving import stagehost
from kafilad.node.paths.edge import RingEdge, form_ring
from kafilad.node.paths.link import LinkClosed
from kafilad.node.paths.manager import PathKind
from kafilad.node.serving.ring import RingMember
from kafilad.proto.rendezvous_proof import public_key
from netsim import STUN_GRID, SimNet
from pathworld import edge_pair as _edge_pair, form_edges as _form, world as _world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


async def _check_frames(out: RingEdge, into: RingEdge, text: str) -> None:
    await out.link.send({"t": "probe", "text": text})
    assert await into.link.receive() == {"t": "probe", "text": text}


def _host_checks(net: SimNet, host: str) -> list:
    """STUN datagrams ``host`` sent to anything but the STUN servers: connectivity checks."""
    return [s for s in net.sent_by(host, kind="stun") if s.dst not in STUN_GRID]


def _drop_checks(on: dict):
    """A firewall that drops host-to-host STUN (the checks) while ``on["checks"]``."""
    def drop(data, src, dst):
        return on["checks"] and data[:1] < b"\x04" and dst not in STUN_GRID and src not in STUN_GRID
    return drop


@trio_test
async def test_an_open_to_open_edge_goes_direct_over_quic(clock):
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"})
        out, into = _edge_pair(p["a"], p["b"], roster)
        t0 = trio.current_time()
        await _form(out, into, delays_s=(0.0, 1.0))  # b's edge starts late: a's offer waits in b's inbox
        assert trio.current_time() - t0 < 1.5
        rec = out.record.to_json()
        assert rec["path"] == rec["predicted_path"] == "direct" and rec["tries"] == 0 and "reason" not in rec
        mapped_b = p["b"].endpoint.nat.table[(p["b"].endpoint.local,)]
        assert rec["remote"] == f"203.0.113.2:{mapped_b}"
        assert rec["rtt_ms"] == pytest.approx(20.0) and 0 < rec["verify_s"] < 1.5
        assert into.record.path == PathKind.DIRECT and into.record.src == "a" and into.record.dst == "b"
        await _check_frames(out, into, "over quic")
        assert net.sent_by("a", kind="quic") and hub.clients[p["a"].peer_id].circuits == []
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_cone_to_symmetric_edge_relays_by_prediction_without_checks(clock):
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"c": "C", "s": "S"})
        out, into = _edge_pair(p["c"], p["s"], roster)
        t0 = trio.current_time()
        await _form(out, into)
        assert trio.current_time() - t0 < 0.5  # no check timeout waited
        for e in (out, into):
            assert e.record.path == e.record.predicted == PathKind.RELAYED
        assert out.record.reason == "predicted relay (C-S)" and into.record.reason == "predicted relay (S-C)"
        assert _host_checks(net, "c") == [] and _host_checks(net, "s") == []
        await _check_frames(out, into, "over the relay")
        assert len(hub.clients[p["c"].peer_id].circuits) == 1
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_direct_path_whose_checks_are_all_dropped_falls_back_to_the_relay(clock):
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "C"}, drop=_drop_checks({"checks": True}))
        out, into = _edge_pair(p["a"], p["b"], roster)
        t0 = trio.current_time()
        await _form(out, into)
        assert 5.0 <= trio.current_time() - t0 < 5.5  # the check timeout, then the relay at once
        for e in (out, into):
            assert e.record.path == PathKind.RELAYED and e.record.predicted == PathKind.DIRECT
            assert e.record.reason.startswith("no direct path answered within 5 s"), e.record.reason
        assert len(_host_checks(net, "a")) >= 50  # paced checks went out; none came back
        await _check_frames(out, into, "relayed after the checks failed")
        nursery.cancel_scope.cancel()


@trio_test
async def test_noise_that_does_not_finish_over_quic_falls_back_to_the_relay(clock):
    def drop_quic_data(data, src, dst):  # the QUIC handshake (long headers) passes; 1-RTT packets are lost
        return 64 <= data[0] <= 127
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"}, drop=drop_quic_data)
        out, into = _edge_pair(p["a"], p["b"], roster)
        t0 = trio.current_time()
        await _form(out, into)
        assert 10.0 <= trio.current_time() - t0 < 11.0  # DIRECT_NOISE_TIMEOUT_S, then the relay
        for e in (out, into):
            assert e.record.path == PathKind.RELAYED
            assert e.record.reason.startswith("Noise over the direct path failed: the Noise handshake on the ring "
                                              "link did not finish within 10 s"), e.record.reason
        await _check_frames(out, into, "relayed after Noise timed out")
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_relayed_edge_is_reprobed_and_upgraded_make_before_break(clock, monkeypatch):
    monkeypatch.setenv("KAFILA_REPROBE_S", "2")
    firewall = {"checks": True}
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "C"}, drop=_drop_checks(firewall))
        out, into = _edge_pair(p["a"], p["b"], roster)
        await _form(out, into)
        relay_out, relay_in = out.path_link, into.path_link
        assert out.record.path == into.record.path == PathKind.RELAYED
        firewall["checks"] = False  # the NAT state changed: a re-probe can now succeed

        sender = RingMember(peer_id=p["a"].peer_id, name="a", runner=None, mlx_lock=trio.Lock(), head=True)
        receiver = RingMember(peer_id=p["b"].peer_id, name="b", runner=None, mlx_lock=trio.Lock(), head=False)
        sender.next_link = out.link  # as stagehost.connect_ring / attach_ring do
        nursery.start_soon(receiver.feed_from, into.link)
        reports = []
        assert out.start_upgrades(sender, lambda: reports.append("a"))
        assert into.start_upgrades(receiver, lambda: reports.append("b"))

        got = []

        async def consume():  # what RingMember.run reads: the inbox the edge feeds
            async for frame in receiver._inbox_recv:
                got.append(frame["seq"])
        nursery.start_soon(consume)
        switched_at = None
        for seq in range(60):  # a frame every 0.1 s across the switch, as RingMember._send_next sends
            await sender.next_link.send({"t": "act", "seq": seq})
            if switched_at is None and out.record.path == PathKind.DIRECT:
                switched_at = seq
            await trio.sleep(0.1)
        await trio.sleep(1)

        assert switched_at is not None and 10 < switched_at < 50, switched_at
        assert got == list(range(60))  # every frame once, in order, across the switch
        assert not receiver.broken and sender.next_link is out.link  # the ring's end never changed
        for e in (out, into):
            rec = e.record.to_json()
            assert rec["path"] == "direct" and rec["upgraded_from"] == "relayed" and rec["tries"] >= 1, rec
            assert "reason" not in rec and rec["rtt_ms"] == pytest.approx(20.0)
        assert out.record.links == [relay_out, out.path_link] and out.links == out.record.links
        assert relay_out.bytes_sent > 0 and out.path_link.bytes_sent > 0
        assert out.link.acked == out.link.sent == 60 and out.link.kept == 0  # every frame acknowledged
        assert relay_out.closed_reason is not None and relay_in.closed_reason is not None  # let go after the switch
        assert set(reports) == {"a", "b"} and reports.count("b") == 1  # a also reports its datagram size search
        ups = [e for e in p["a"].paths.events if e["event"] == "edge_upgraded"]
        assert [u["edge"] for u in ups] == ["a -> b"]
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_ring_forms_per_prediction_and_closing_a_session_ends_its_paths(clock, monkeypatch):
    monkeypatch.setenv("KAFILA_REPROBE_S", "1")
    monkeypatch.setenv("KAFILA_BIRTHDAY", "0")  # ordinary checks on the C-S re-probe (birthday: tests/natlab)
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "C", "c": "S"})
        ring = [p[n].peer_id for n in "abc"]
        members = {n: RingMember(peer_id=p[n].peer_id, name=n, runner=None, mlx_lock=trio.Lock(), head=n == "a")
                   for n in "abc"}
        links = {}

        async def connect(n):
            links[n] = await stagehost.connect_ring(paths=p[n].paths, session_id="s1", ring=ring, roster=roster,
                                                    incoming=p[n].rdv.incoming, member=members[n])
        async with trio.open_nursery() as n:
            for name in "abc":
                n.start_soon(connect, name)
        edges = {(e["from"], e["to"]): (e["path"], e["predicted_path"]) for e in p["b"].paths.edge_list()}
        assert edges == {("b", "c"): ("relayed", "relayed"), ("a", "b"): ("direct", "direct")}
        assert [e["path"] for e in stagehost.edges_of(p["c"].paths)] == ["direct", "relayed"]  # c -> a, b -> c
        assert members["a"].next_link is links["a"][0]

        await trio.sleep(8)  # b re-probes its relayed edge to c (C-S: the checks fail, 5 s each)
        assert p["b"].paths.edge_from_me(p["c"].peer_id).tries >= 1
        b_ep = p["b"].endpoint
        p["b"].leave.set()
        await p["b"].left.wait()
        assert trio.current_time() == p["b"].left_at_s  # the scope ended at once: nothing waited
        await trio.sleep(0.5)
        with pytest.raises(LinkClosed, match=r"^b closed the link$"):  # b's CONNECTION_CLOSE reached a: a clean end
            await links["a"][0].send({"t": "act"})
        await trio.sleep(120)  # well past keepalive (15 s), PING (15 s) and re-probe periods

        assert net.sent_by("b", after_s=p["b"].left_at_s) == []
        assert b_ep._stun_handlers == [] and b_ep._by_cid == {}  # no agent, no QUIC connection routed
        assert not [s for s in hub.clients[p["b"].peer_id].signals if s[0] > p["b"].left_at_s]
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_key_not_in_the_roster_is_refused_on_the_direct_path_not_relayed(clock):
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"})
        wrong = {**roster, p["b"].peer_id: {"name": "b", "public_key": public_key(b"\x09" * 32)}}
        out = RingEdge(p["a"].paths, peer_id=p["b"].peer_id, roster=wrong, sender=True, session_id="s1")
        into = RingEdge(p["b"].paths, peer_id=p["a"].peer_id, roster=roster, sender=False, session_id="s1",
                        incoming=p["b"].rdv.incoming)
        nursery.start_soon(into.form)
        with pytest.raises(HandshakeRefused, match="ring neighbour b presented a key not in the session roster"):
            await out.form()
        assert out.record.path == PathKind.DIRECT  # verified, then refused: no fallback
        assert hub.clients[p["a"].peer_id].circuits == []
        nursery.cancel_scope.cancel()


@trio_test
async def test_form_ring_names_a_refused_edge_and_a_lone_member_has_none(clock):
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"})
        assert await form_ring(p["a"].paths, session_id="s1", ring=[p["a"].peer_id], roster=roster,
                               incoming=p["a"].rdv.incoming) == (None, None)
        wrong = {**roster, p["b"].peer_id: {"name": "b", "public_key": public_key(b"\x09" * 32)}}
        ring = [p["a"].peer_id, p["b"].peer_id]
        b_failed = trio.Event()

        async def b_side():  # b's key is refused by a on both edges: b's formation fails too
            with pytest.raises(RingEdgeError, match="^ring edge refused: ") as b_err:
                await form_ring(p["b"].paths, session_id="s1", ring=ring, roster=roster, incoming=p["b"].rdv.incoming)
            assert b_err.value.peer_id == p["a"].peer_id  # the edge's other end, for the host's replan
            b_failed.set()
        nursery.start_soon(b_side)
        with pytest.raises(RingEdgeError, match="^ring edge refused: ring neighbour b presented a key not in") as a_err:
            await form_ring(p["a"].paths, session_id="s1", ring=ring, roster=wrong, incoming=p["a"].rdv.incoming)
        assert a_err.value.peer_id == p["b"].peer_id and isinstance(a_err.value, SessionError)
        with trio.fail_after(30):
            await b_failed.wait()
        assert all(c.circuits == [] for c in hub.clients.values())  # refused keys never fall back to the relay
        nursery.cancel_scope.cancel()


@trio_test
async def test_forming_a_new_ring_closes_the_edges_of_the_last_one(clock, monkeypatch):
    monkeypatch.setenv("KAFILA_REPROBE_S", "1")
    monkeypatch.setenv("KAFILA_BIRTHDAY", "0")  # ordinary checks on the C-S re-probe (birthday: tests/natlab)
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "C", "c": "S"})

        async def ring_of(names):
            ring = [p[n].peer_id for n in names]
            async with trio.open_nursery() as n:
                for name in names:
                    member = RingMember(peer_id=p[name].peer_id, name=name, runner=None, mlx_lock=trio.Lock(),
                                        head=name == names[0])
                    n.start_soon(lambda name=name, member=member: stagehost.connect_ring(
                        paths=p[name].paths, session_id="s1", ring=ring, roster=roster, incoming=p[name].rdv.incoming,
                        member=member))
        await ring_of("abc")
        old_c = list(p["c"].paths.ring_edges)  # c -> a (direct), b -> c (relayed, being re-probed)
        assert [(e.record.src, e.record.dst, str(e.record.path)) for e in old_c] == [
            ("c", "a", "direct"), ("b", "c", "relayed")]
        await trio.sleep(3)
        await ring_of("ac")  # the host replans a ring of a and c; b, left out, keeps re-probing its old edge to c

        for me in "ac":
            assert sorted((e["from"], e["to"], e["path"]) for e in p[me].paths.edge_list()) == [
                ("a", "c", "direct"), ("c", "a", "direct")]
        assert all(e.closed and e.links and all(lk.closed_reason is not None for lk in e.links) for e in old_c)
        replanned_at = trio.current_time()
        await trio.sleep(60)
        old_edge = p["c"].paths.edge_id(p["b"].peer_id, False)
        b_offers = [s for s in hub.clients[p["b"].peer_id].signals if s[0] > replanned_at and s[2]["edge"] == old_edge]
        c_offers = [s for s in hub.clients[p["c"].peer_id].signals if s[0] > replanned_at and s[2]["edge"] == old_edge]
        assert len(b_offers) >= 3 and c_offers == []  # c's end of the old edge no longer answers
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_circuit_left_over_from_an_earlier_rings_formation_is_dropped_unread(clock, monkeypatch):
    """proto_spec 07 §2, §5: edge ids carry the plan epoch and relayed circuits are labelled with
    theirs, so the receiver of a re-formed ring skips the earlier formation's circuit that its
    sender gave up on (without closing it) instead of spending the Noise handshake's 20 s on it."""
    monkeypatch.setenv("KAFILA_DIRECT", "0")  # every edge relays: the circuits are the point
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"}, classify=False)
        ring = [p["a"].peer_id, p["b"].peer_id]
        with trio.move_on_after(3):  # plan 1: only a forms; its circuit to b waits in b's inbox, unanswered
            await form_ring(p["a"].paths, session_id="s1", ring=ring, roster=roster, incoming=p["a"].rdv.incoming,
                            epoch=1)
        stale = [c for c in hub.clients[p["a"].peer_id].circuits]
        assert [c.label for c in stale] == [f"ring:s1:1:{p['a'].peer_id}>{p['b'].peer_id}"]
        held_open = await p["a"].rdv.open_circuit(p["b"].peer_id, stale[0].label)  # one its sender never closed
        formed = {}

        async def form(name):
            formed[name] = await form_ring(p[name].paths, session_id="s1", ring=ring, roster=roster,
                                           incoming=p[name].rdv.incoming, epoch=2)
        t0 = trio.current_time()
        async with trio.open_nursery() as n:  # plan 2: both form
            for name in "ab":
                n.start_soon(form, name)
        assert trio.current_time() - t0 < 5  # the old code took the stale circuit: a 20 s handshake timeout, then failed
        out, into = formed["a"][0], formed["b"][1]
        assert out.edge_id == into.edge_id == f"s1:2:{p['a'].peer_id}>{p['b'].peer_id}"
        await _check_frames(out, into, "plan 2")
        await _check_frames(formed["b"][0], formed["a"][1], "plan 2 back")
        with pytest.raises((trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError)):
            await held_open.receive_message()  # b closed it unread: no handshake message came back
        nursery.cancel_scope.cancel()


@trio_test
async def test_closing_an_edge_ends_a_send_parked_on_its_full_window(clock, monkeypatch):
    """Issue 25 item 6: `RingEdge.aclose` marked its sender closed without waking it, so a send waiting
    for acknowledgements (a full window) or for a repair slept on after the ring re-formed."""
    from kafilad.errors import LinkEnded
    from kafilad.node.paths import edgelink
    monkeypatch.setattr(edgelink, "KEEP_FRAMES", 2)
    async with trio.open_nursery() as nursery:
        net, hub, p, roster = await _world(nursery, {"a": "O", "b": "O"})
        out, into = _edge_pair(p["a"], p["b"], roster)
        await _form(out, into)
        for i in range(2):  # nobody reads acknowledgements here: the window is full after two frames
            await out.link.send({"t": "act", "i": i})
        ended = []

        async def third():
            try:
                await out.link.send({"t": "act", "i": 2})
            except LinkEnded as e:
                ended.append(e.reason)
        nursery.start_soon(third)
        await trio.sleep(1)
        assert not ended and out.link.kept == 2
        await out.aclose("the ring re-formed")
        with trio.fail_after(5):
            while not ended:
                await trio.sleep(0.1)
        assert ended == ["the ring re-formed"]
        nursery.cancel_scope.cancel()

"""A direct ring edge whose path dies mid-session falls back to the relay, then returns (proto_spec 07 §7a).

Over the in-memory NAT network (tests/netsim.py) under a mock clock, with the real ICE agents,
QUIC, Noise, demultiplexer, RingEdge / EdgeSender / EdgeReceiver and RingMember's reading of an
edge. A firewall hook drops the UDP between the two members (not the STUN servers) while frames
flow every 0.1 s, as decode steps do; every frame must arrive once and in order.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, trio_test

from kafilad.errors import LinkBroken, SessionError
from kafilad.node.paths import edge as edge_mod
from kafilad.node.paths.manager import PathKind
from kafilad.node.serving.ring import RingMember
from netsim import STUN_GRID
from pathworld import edge_pair as _edge_pair, form_edges as _form, world as _world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


def _firewall(state: dict):
    """Drops UDP between the members while state["a->b"] / state["b->a"] (a is 203.0.113.1)."""
    def drop(data, src, dst):
        if src in STUN_GRID or dst in STUN_GRID:
            return False
        if dst[0] == "203.0.113.2" or src[0] == "203.0.113.1":
            return state.get("a->b", False)
        return state.get("b->a", False)
    return drop


async def _serving_pair(nursery, classes, firewall, **kw):
    net, hub, p, roster = await _world(nursery, classes, drop=_firewall(firewall), **kw)
    out, into = _edge_pair(p["a"], p["b"], roster)
    await _form(out, into)
    sender = RingMember(peer_id=p["a"].peer_id, name="a", runner=None, mlx_lock=trio.Lock(), head=True)
    receiver = RingMember(peer_id=p["b"].peer_id, name="b", runner=None, mlx_lock=trio.Lock(), head=False)
    sender.next_link = out.link
    sender.next_name = "b"
    nursery.start_soon(receiver.feed_from, into.link)
    reports = []
    assert out.start_upgrades(sender, lambda: reports.append(("a", str(out.record.path))))
    assert into.start_upgrades(receiver, lambda: reports.append(("b", str(into.record.path))))
    got = []

    async def consume():  # what RingMember.run reads
        async for frame in receiver._inbox_recv:
            if "seq" in frame:  # not the wake-up a broken ring puts there
                got.append(frame["seq"])
    nursery.start_soon(consume)
    return net, hub, p, out, into, sender, receiver, got, reports


@trio_test
async def test_a_silent_direct_path_falls_back_within_5_s_and_returns_when_it_is_back(clock, monkeypatch):
    monkeypatch.setenv("KAFILA_REPROBE_S", "10")
    firewall: dict = {}
    async with trio.open_nursery() as nursery:
        net, hub, p, out, into, sender, receiver, got, reports = await _serving_pair(
            nursery, {"a": "O", "b": "C"}, firewall)
        assert out.record.path == into.record.path == PathKind.DIRECT
        direct_t = out.transport
        fell_back_at = restored_at = None
        dropped_at = lifted_at = None
        for seq in range(900):  # 90 s of frames, 0.1 s apart
            now = trio.current_time()
            if seq == 100:
                firewall["a->b"] = firewall["b->a"] = True  # the NAT starts dropping: the path is dead
                dropped_at = now
            if seq == 300:
                firewall.clear()  # the rule is removed
                lifted_at = now
            await sender.next_link.send({"t": "act", "seq": seq})
            if fell_back_at is None and out.record.path == PathKind.RELAYED:
                fell_back_at = now
            if fell_back_at is not None and restored_at is None and out.record.path == PathKind.DIRECT:
                restored_at = now
            await trio.sleep(0.1)
        await trio.sleep(1)

        assert got == list(range(900))  # every frame once, in order, across both moves
        assert not sender.broken and not receiver.broken
        assert fell_back_at is not None and fell_back_at - dropped_at <= 5.0, (dropped_at, fell_back_at)
        assert restored_at is not None and restored_at - lifted_at <= 60.0, (lifted_at, restored_at)
        rec = out.record.to_json()
        assert rec["path"] == "direct" and rec["fallbacks"] == 1 and rec["upgraded_from"] == "relayed"
        assert into.record.to_json()["fallbacks"] == 1 and into.record.path == PathKind.DIRECT
        fb = [e for e in p["a"].paths.events if e["event"] == "edge_fallback"]
        assert len(fb) == 1 and fb[0]["edge"] == "a -> b"
        assert fb[0]["reason"].startswith("the direct path to 203.0.113.2:") and " went silent for 3." in fb[0]["reason"]
        assert fb[0]["fallback_s"] < 1.0 and fb[0]["resent"] >= 1  # frames sent into the dead path went again
        (fb_b,) = [e for e in p["b"].paths.events if e["event"] == "edge_fallback"]
        assert fb_b["reason"] == fb[0]["reason"]  # the receiver learns why from the sender's hello
        failed = [e for e in p["a"].paths.events if e["event"] == "reprobe_failed"]
        assert failed and all(e["edge"] == "a -> b" for e in failed)  # blocked re-probes are reported too
        assert ("a", "relayed") in reports and reports[-1][1] == "direct"
        assert direct_t.closed_reason is not None and out.transport is not direct_t  # the dead path was let go
        assert len(out.links) == 3 and all(lk.closed_reason is not None for lk in out.links[:2])
        assert out.link.kept == 0 and out.link.acked == 900
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_path_dead_in_one_direction_only_is_seen_too(clock):
    firewall: dict = {}
    async with trio.open_nursery() as nursery:
        net, hub, p, out, into, sender, receiver, got, _ = await _serving_pair(nursery, {"a": "O", "b": "O"}, firewall)
        for seq in range(100):
            if seq == 20:
                firewall["b->a"] = True  # answers (ACKs, pongs) are lost; a's datagrams still arrive
                t0 = trio.current_time()
            await sender.next_link.send({"t": "act", "seq": seq})
            await trio.sleep(0.1)
        await trio.sleep(1)
        assert got == list(range(100)) and not sender.broken
        assert out.record.path == PathKind.RELAYED and out.record.fallbacks == 1
        (fb,) = [e for e in p["a"].paths.events if e["event"] == "edge_fallback"]
        assert fb["ts"] > 0 and out.record.fell_back_at is not None
        assert "went silent" in out.record.reason
        assert trio.current_time() - t0 > 5
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_fallback_that_cannot_reach_the_relay_fails_naming_the_edge(clock, monkeypatch):
    firewall: dict = {}
    async with trio.open_nursery() as nursery:
        net, hub, p, out, into, sender, receiver, got, reports = await _serving_pair(
            nursery, {"a": "O", "b": "O"}, firewall)
        rdv_a = hub.clients[p["a"].peer_id]

        async def no_relay(to, label):
            raise SessionError("the rendezvous connection was lost")
        monkeypatch.setattr(rdv_a, "open_circuit", no_relay)
        await sender.next_link.send({"t": "act", "seq": 0})
        firewall["a->b"] = firewall["b->a"] = True
        t0 = trio.current_time()
        with pytest.raises(LinkBroken) as e:
            for seq in range(1, 200):
                await sender.next_link.send({"t": "act", "seq": seq})
                await trio.sleep(0.1)
        assert trio.current_time() - t0 < edge_mod.SILENCE_S + 1.5
        assert str(e.value).startswith("the ring edge a -> b lost its direct path (the direct path to 203.0.113.2:")
        assert str(e.value).endswith("and could not fall back to the relay: the rendezvous connection was lost")
        assert out.record.reason == str(e.value) and out.record.path == PathKind.RELAYED
        assert [x["event"] for x in p["a"].paths.events if x["event"] == "edge_failed"] == ["edge_failed"]
        nursery.cancel_scope.cancel()


@trio_test
async def test_an_idle_edge_falls_back_too_and_the_next_frame_crosses_the_relay(clock):
    firewall: dict = {}
    async with trio.open_nursery() as nursery:
        net, hub, p, out, into, sender, receiver, got, _ = await _serving_pair(nursery, {"a": "O", "b": "O"}, firewall)
        await sender.next_link.send({"t": "act", "seq": 0})
        await trio.sleep(1)
        firewall["a->b"] = firewall["b->a"] = True
        t0 = trio.current_time()
        while out.record.path != PathKind.RELAYED:
            await trio.sleep(0.05)
        assert trio.current_time() - t0 <= 5.0
        await sender.next_link.send({"t": "act", "seq": 1})
        await trio.sleep(0.5)
        assert got == [0, 1] and out.link.resent == 0  # nothing was in flight
        assert into.record.path == PathKind.RELAYED
        nursery.cancel_scope.cancel()


@trio_test
async def test_closing_the_rings_end_of_a_direct_edge_is_not_repaired(clock):
    firewall: dict = {}
    async with trio.open_nursery() as nursery:
        net, hub, p, out, into, sender, receiver, got, _ = await _serving_pair(nursery, {"a": "O", "b": "O"}, firewall)
        await sender.next_link.send({"t": "act", "seq": 0})
        await out.link.close("the session replanned")  # what host.py / member.py do with their stage links
        await trio.sleep(30)
        assert out.record.path == PathKind.DIRECT and out.record.fallbacks == 0
        assert hub.clients[p["a"].peer_id].circuits == []  # no fallback circuit was opened
        assert not out._living and [e for e in p["a"].paths.events if e["event"].startswith("edge_")] == []
        assert receiver.broken == "member a is unreachable: the ring link from a closed: a closed the link"
        nursery.cancel_scope.cancel()

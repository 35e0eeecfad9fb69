"""Datagram size discovery and black holes on a direct ring edge (proto_spec 07 §4a; RFC 8899), mock clock.

Over the in-memory NAT network (tests/netsim.py) with the real ICE agents (padded size probes),
QUIC, Noise and RingEdge. "MTU 1280 with fragments dropped" is a firewall hook that loses every
datagram longer than 1,252 bytes (1280 minus the IPv4 and UDP headers) between the members.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, trio_test

from kafilad.node.paths.manager import PathKind
from kafilad.node.serving.ring import RingMember
from kafilad.proto import pmtu
from netsim import STUN_GRID
from pathworld import edge_pair, form_edges, world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MTU_1280_PAYLOAD = 1252


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


def _small_path(state: dict):
    def drop(data, src, dst):
        return state.get("mtu_1280", False) and len(data) > MTU_1280_PAYLOAD and \
            src not in STUN_GRID and dst not in STUN_GRID
    return drop


async def _pair(nursery, state):
    net, hub, p, roster = await world(nursery, {"a": "O", "b": "O"}, drop=_small_path(state))
    out, into = edge_pair(p["a"], p["b"], roster)
    await form_edges(out, into)
    sender = RingMember(peer_id=p["a"].peer_id, name="a", runner=None, mlx_lock=trio.Lock(), head=True)
    receiver = RingMember(peer_id=p["b"].peer_id, name="b", runner=None, mlx_lock=trio.Lock(), head=False)
    sender.next_link = out.link
    nursery.start_soon(receiver.feed_from, into.link)
    assert out.start_upgrades(sender) and into.start_upgrades(receiver)
    got = []

    async def consume():
        async for frame in receiver._inbox_recv:
            if "seq" in frame:
                got.append((trio.current_time(), frame["seq"]))
    nursery.start_soon(consume)
    return net, p, out, into, sender, receiver, got


@trio_test
async def test_a_path_of_mtu_1280_forms_direct_at_1200_bytes_and_finds_1252(clock):
    state = {"mtu_1280": True}
    async with trio.open_nursery() as nursery:
        net, p, out, into, sender, receiver, got = await _pair(nursery, state)
        assert out.record.path == PathKind.DIRECT and out.transport.datagram_bytes <= 1252
        await trio.sleep(10)
        rec = out.record.to_json()
        assert rec["datagram_bytes"] == 1252 and out.transport.datagram_bytes == 1252, rec
        assert rec["pmtu"]["state"] == "complete" and rec["pmtu"]["probes"] == 1 + pmtu.MAX_PROBES
        for seq in range(30):  # 20 kB frames: many full-size datagrams
            await sender.next_link.send({"t": "act", "seq": seq, "h": bytes(20_000)})
            await trio.sleep(0.1)
        await trio.sleep(1)
        assert [s for _, s in got] == list(range(30)) and out.link.resent == 0
        quic = [s for s in net.sent_by("a", kind="quic")]
        assert max(len(s.data) for s in quic) == 1252
        (ev,) = [e for e in p["a"].paths.events if e["event"] == "pmtu"]
        assert ev["datagram_bytes"] == 1252 and ev["edge"] == "a -> b"
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_size_black_holed_mid_session_is_seen_and_the_edge_shrinks_without_losing_a_frame(clock):
    state: dict = {}
    async with trio.open_nursery() as nursery:
        net, p, out, into, sender, receiver, got = await _pair(nursery, state)
        await trio.sleep(10)
        assert out.transport.datagram_bytes == max(pmtu.LADDER_BYTES)  # a clean path: the top of the ladder
        changed_at = None
        for seq in range(200):
            if seq == 50:
                state["mtu_1280"] = True  # a VPN comes up: fragments dropped, keepalives still pass
                changed_at = trio.current_time()
            await sender.next_link.send({"t": "act", "seq": seq, "h": bytes(20_000)})
            await trio.sleep(0.1)
        await trio.sleep(2)
        assert [s for _, s in got] == list(range(200))  # nothing lost, nothing twice
        assert out.record.path == PathKind.DIRECT and out.record.fallbacks == 0  # shrunk, not relayed
        holes = [e for e in p["a"].paths.events if e["event"] == "pmtu_black_hole"]
        assert len(holes) == 1 and holes[0]["from_bytes"] == max(pmtu.LADDER_BYTES)
        assert holes[0]["datagram_bytes"] == pmtu.BASE_BYTES
        times = [t for t, s in got if s >= 50]
        assert max(b - a for a, b in zip([changed_at] + times, times)) < 6.0  # the stall lasted seconds, not minutes
        await trio.sleep(pmtu.BLACK_HOLE_RETRY_S + 10)
        assert out.transport.datagram_bytes == 1252  # searched again: the largest size that crosses now
        assert out.record.to_json()["pmtu"]["black_holes"] == 1
        nursery.cancel_scope.cancel()

"""EdgeSender / EdgeReceiver (kafilad/node/paths/edgelink.py; proto_spec 07 §7, §7a) over in-memory Links.

No network: each path is a Link over a trio memory stream pair, so the frame codec runs; the
tests move the edge between paths by hand, as RingEdge does, and check that the ring sees
every frame once and in order. Time is trio's MockClock: the guards below (`fail_after`) count trio
time, which a loaded machine does not stretch.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, memory_stream_pair, trio_test

from kafilad.errors import LinkBroken, LinkEnded
from kafilad.node.paths import edgelink
from kafilad.node.paths.edgelink import EdgeReceiver, EdgeSender
from kafilad.node.paths.link import Link


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


def _path() -> tuple[Link, Link]:
    a, b = memory_stream_pair()
    return Link(a, peer_id="pb", peer_name="b", label="ring"), Link(b, peer_id="pa", peer_name="a", label="ring")


def _ends(nursery, *, on_broken_s=None, on_broken_r=None):
    out, into = _path()
    s = EdgeSender(out, edge_name="a -> b", spawn=nursery.start_soon, on_broken=on_broken_s)
    r = EdgeReceiver(into, edge_name="a -> b", spawn=nursery.start_soon, on_broken=on_broken_r)
    return s, r


@trio_test
async def test_frames_carry_a_sequence_the_receiver_strips_and_acks_trim_the_sender(clock):
    async with trio.open_nursery() as n:
        s, r = _ends(n)
        n.start_soon(s.read_acks)
        n.start_soon(r.send_acks)
        for i in range(5):
            size = await s.send({"t": "act", "i": i})
            assert size > 0
        assert [await r.receive() for _ in range(5)] == [{"t": "act", "i": i} for i in range(5)]
        assert r.delivered == 5 and s.sent == 5
        with trio.fail_after(1):
            while s.kept:
                await trio.sleep(0.01)
        assert s.acked == 5
        n.cancel_scope.cancel()


@trio_test
async def test_a_switch_resends_what_the_receiver_did_not_deliver_and_nothing_twice(clock):
    async with trio.open_nursery() as n:
        s, r = _ends(n)
        old_out, old_in = s.link, r.link
        for i in range(1, 6):
            await s.send({"t": "act", "i": i})
        assert [(await r.receive())["i"] for _ in range(3)] == [1, 2, 3]  # 4 and 5 stay on the old path
        new_out, new_in = _path()
        await r.switch_to(new_in)  # the receiver now reads only the new path and says so
        ready = await new_out.receive()
        assert ready == {"t": "path_ready", "es": 3}
        await s.propose(new_out, ready["es"])
        assert s.link is new_out and s.resent == 2
        await s.send({"t": "act", "i": 6})
        assert [(await r.receive())["i"] for _ in range(3)] == [4, 5, 6]
        assert r.repeats == 0 and r.delivered == 6
        await trio.sleep(0.1)
        assert old_out.closed_reason is not None  # the sender let the old path go
        n.cancel_scope.cancel()


@trio_test
async def test_repeats_are_dropped_and_a_gap_breaks_the_edge_with_a_sentence(clock):
    async with trio.open_nursery() as n:
        out, into = _path()
        r = EdgeReceiver(into, edge_name="a -> b", spawn=n.start_soon)
        for es in (1, 2, 2, 1, 3):
            await out.send({"t": "act", "es": es, "x": es})
        assert [(await r.receive())["x"] for _ in range(3)] == [1, 2, 3]
        assert r.repeats == 2
        await out.send({"t": "act", "es": 5})
        with pytest.raises(LinkBroken, match=r"^the ring edge a -> b skipped frames 4\.\.4$"):
            await r.receive()
        await out.send({"t": "act"})  # a frame without a sequence (an older sender) passes as it is
        assert await r.receive() == {"t": "act"}
        n.cancel_scope.cancel()


@trio_test
async def test_a_new_path_closed_before_use_is_dropped_and_the_old_one_read_again(clock):
    async with trio.open_nursery() as n:
        s, r = _ends(n)
        await s.send({"t": "act", "i": 1})
        assert (await r.receive())["i"] == 1
        new_out, new_in = _path()
        await r.switch_to(new_in)
        assert (await new_out.receive())["t"] == "path_ready"
        await new_out.close()  # the sender gave up on the new path (no confirmation in time): it never switched
        await s.send({"t": "act", "i": 2})
        with trio.fail_after(1):
            assert (await r.receive())["i"] == 2  # read on the previous path again
        assert r.link is not new_in and r.previous is None
        n.cancel_scope.cancel()


@trio_test
async def test_a_broken_path_waits_for_the_repair_and_a_failed_repair_raises_the_edges_sentence(clock, monkeypatch):
    monkeypatch.setattr(edgelink, "REPAIR_WAIT_S", 5.0)
    asked = []
    async with trio.open_nursery() as n:
        s, r = _ends(n, on_broken_s=lambda link, e: asked.append(e.reason) or True)
        await r.link.close("the path died")  # the peer's end goes away: the sender's next write breaks
        errors = []

        async def sender():
            try:
                for i in range(3):
                    await s.send({"t": "act", "i": i})
                    await trio.sleep(0.01)
            except LinkBroken as e:
                errors.append(str(e))
        n.start_soon(sender)
        with trio.fail_after(2):
            while not asked:
                await trio.sleep(0.01)
        s.fail("the ring edge a -> b lost its direct path (gone) and could not fall back to the relay: no relay")
        with trio.fail_after(2):
            while not errors:
                await trio.sleep(0.01)
        assert errors == ["the ring edge a -> b lost its direct path (gone) and could not fall back to the relay: "
                          "no relay"]
        with pytest.raises(LinkBroken, match="could not fall back"):
            await s.send({"t": "act"})
        n.cancel_scope.cancel()


@trio_test
async def test_a_closed_edge_raises_ended_and_is_not_repaired(clock):
    async with trio.open_nursery() as n:
        s, r = _ends(n, on_broken_s=lambda link, e: True)
        await s.close("the session replanned")
        with pytest.raises(LinkEnded, match="the session replanned"):
            await s.send({"t": "act"})
        n.cancel_scope.cancel()


# ---- ending an edge wakes every parked sender (issue 25 item 6: edge.py `aclose` set closed_reason and
# `ended` without a signal, so a send parked in `_repair` or on a full window slept on) ----------------
@trio_test
async def test_ending_an_edge_wakes_a_send_parked_on_a_full_window(monkeypatch):
    monkeypatch.setattr(edgelink, "KEEP_FRAMES", 2)
    async with trio.open_nursery() as n:
        s, r = _ends(n)  # nobody acknowledges: the window fills
        await s.send({"t": "act", "i": 1})
        await s.send({"t": "act", "i": 2})
        errors = []

        async def third():
            try:
                await s.send({"t": "act", "i": 3})
            except LinkEnded as e:
                errors.append(e.reason)
        n.start_soon(third)
        await trio.testing.wait_all_tasks_blocked()
        assert not errors and s.kept == 2
        s.end("the ring re-formed")
        with trio.fail_after(1):
            while not errors:
                await trio.sleep(0.01)
        assert errors == ["the ring re-formed"] and s.ended.is_set()
        n.cancel_scope.cancel()


@trio_test
async def test_ending_an_edge_wakes_a_send_parked_waiting_for_a_repair(monkeypatch):
    monkeypatch.setattr(edgelink, "REPAIR_WAIT_S", 60.0)
    asked = []
    async with trio.open_nursery() as n:
        s, r = _ends(n, on_broken_s=lambda link, e: asked.append(e.reason) or True)  # a repair "under way"
        await r.link.close("the path died")
        errors = []

        async def sender():
            try:
                for i in range(3):
                    await s.send({"t": "act", "i": i})
                    await trio.sleep(0.01)
            except (LinkEnded, LinkBroken) as e:
                errors.append((type(e), e.reason))
        n.start_soon(sender)
        with trio.fail_after(2):
            while not asked:
                await trio.sleep(0.01)
        s.end("the ring re-formed")
        with trio.fail_after(2):
            while not errors:
                await trio.sleep(0.01)
        assert errors == [(LinkEnded, "the ring re-formed")]
        n.cancel_scope.cancel()


@trio_test
async def test_a_malformed_sequence_number_breaks_the_edge_with_a_sentence(clock):
    async with trio.open_nursery() as n:
        out, into = _path()
        r = EdgeReceiver(into, edge_name="a -> b", spawn=n.start_soon)
        await out.send({"t": "act", "es": "1"})
        with pytest.raises(LinkBroken, match=r"^the ring edge a -> b carried a malformed frame \(malformed act "
                                             r"frame: its sequence number '1' is not an integer >= 1\)$"):
            await r.receive()
        n.cancel_scope.cancel()


@trio_test
async def test_a_malformed_ack_closes_the_senders_link_with_the_reason(clock):
    async with trio.open_nursery() as n:
        s, r = _ends(n)
        n.start_soon(s.read_acks)
        await s.send({"t": "act", "i": 1})
        assert (await r.receive())["i"] == 1
        await r.link.send({"t": "edge_ack", "es": -4})  # the receiver's end, misbehaving
        with trio.fail_after(1):
            while s.link.closed_reason is None:
                await trio.sleep(0.01)
        assert s.link.closed_reason == ("the ring edge a -> b carried a malformed frame back: malformed edge_ack "
                                        "frame: 'es' is -4, not >= 0")
        assert s.kept == 1  # nothing was acknowledged by it
        with pytest.raises(LinkBroken, match="carried a malformed frame back"):
            await s.send({"t": "act", "i": 2})
        n.cancel_scope.cancel()

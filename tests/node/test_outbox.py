"""The host's per-member outbox (kafilad/node/serving/outbox.py) over real Links on in-memory streams.

A lockstep stream pair has no buffer: a send completes only while the other end reads, so a peer
that does not read is a member that stopped reading its ctl link.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, lockstep_stream_pair, memory_stream_pair, trio_test

from kafilad.errors import LinkBroken, LinkEnded
from kafilad.node.paths.link import Link
from kafilad.node.serving.outbox import Outbox


def _links(pair=memory_stream_pair):
    a, b = pair()
    return Link(a, peer_id="m1", peer_name="m1", label="ctl"), Link(b, peer_id="h", peer_name="h", label="ctl")


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


@trio_test
async def test_frames_go_in_order_from_the_outbox_task():
    host_end, member_end = _links()
    box = Outbox(host_end)
    async with trio.open_nursery() as n:
        n.start_soon(box.run)
        for i in range(10):
            assert box.put({"t": "probe", "n": i})
        assert [(await member_end.receive())["n"] for _ in range(10)] == list(range(10))
        n.cancel_scope.cancel()


@trio_test
async def test_a_member_that_does_not_read_never_holds_up_the_caller_and_its_link_closes_after_the_bound(clock):
    host_end, member_end = _links(lockstep_stream_pair)
    box = Outbox(host_end, send_bound_s=5.0)
    async with trio.open_nursery() as n:
        n.start_soon(box.run)
        t0 = trio.current_time()
        for i in range(20):
            assert box.put({"t": "probe", "n": i})  # queued at once: the member reads nothing
        assert trio.current_time() == t0
        await trio.sleep(5.5)
        assert box.closed_reason == "m1 took no control frame for 5 s"
        assert host_end.closed_reason == "m1 took no control frame for 5 s"
        with pytest.raises(LinkBroken, match="took no control frame"):
            await host_end.send({"t": "probe"})
        assert not box.put({"t": "probe"})  # a closed outbox takes nothing more


@trio_test
async def test_a_full_outbox_closes_the_link_naming_the_member(clock):
    host_end, member_end = _links(lockstep_stream_pair)
    box = Outbox(host_end, limit=4, send_bound_s=60.0)
    async with trio.open_nursery() as n:
        n.start_soon(box.run)
        await trio.sleep(0.1)
        assert all(box.put({"t": "probe", "n": i}) for i in range(5))  # the task holds one, four wait
        assert not box.put({"t": "probe", "n": 5})
        assert box.closed_reason == "m1 stopped reading its control link (4 frames waiting)"
        await trio.sleep(61)  # the frame being sent is whole or the link is broken; then the task closes the link
        assert host_end.closed_reason == box.closed_reason


@trio_test
async def test_close_after_sends_what_is_queued_first_even_when_the_task_was_cancelled():
    host_end, member_end = _links()
    box = Outbox(host_end)
    assert box.put({"t": "close", "reason": "the host closed the session"})
    with trio.CancelScope() as cs:
        cs.cancel()
        await box.run()  # a session being cancelled: the task ends before it sent anything
    with trio.CancelScope(shield=True):  # as the host's shielded close
        await box.close_after("closed")
    assert (await member_end.receive()) == {"t": "close", "reason": "the host closed the session"}
    with pytest.raises(LinkEnded):
        await member_end.receive()


@trio_test
async def test_close_after_waits_for_the_running_task_to_send_the_queue_in_order():
    host_end, member_end = _links()
    box = Outbox(host_end)
    got = []

    async def read():
        try:
            while True:
                got.append((await member_end.receive())["n"])
        except LinkEnded:
            pass
    async with trio.open_nursery() as n:
        n.start_soon(read)
        n.start_soon(box.run)
        await trio.sleep(0)
        for i in range(30):
            box.put({"t": "probe", "n": i})
        await box.close_after("closed")
    assert got == list(range(30))
    assert host_end.closed_reason == "closed"

"""The head's progress deadline on a real ring (issue 11; kafilad/node/serving/ring.py, scheduler.py `overdue`).

Three RingMembers with real stages in one trio process; the edge m1 → m2 is a stream that, once
frozen, takes every byte and delivers none (a path that went silent without closing: no error,
no EOF, as a NAT that starts dropping a flow). A request in flight then fails with a sentence
naming the ring within the deadline, and the head's status records the stall; a request started
while the edge is frozen fails the same way. The deadline's floor is lowered for the test. What is
asserted is what happened (the request failed, past its deadline, with the sentence), not how soon
after the deadline the head's check ran: that depends on the machine's load.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import memory_stream_pair, trio_test

from kafilad.proto import scheduler as scheduler_mod
from kafilad.node.paths.link import Link
from tests.node.test_ring_batch import make_members, synth_model  # noqa: F401 - fixture

#: seconds after which a generation that never ends is a hung test (the deadline's floor is 1.5 s)
HANG_GUARD_S = 60.0


class Freezable(trio.abc.Stream):
    """A stream whose sends vanish once `frozen` (receives keep working)."""

    def __init__(self, inner):
        self.inner = inner
        self.frozen = False

    async def send_all(self, data) -> None:
        if self.frozen:
            await trio.lowlevel.checkpoint()
            return
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


@trio_test
async def test_a_silently_frozen_edge_fails_the_request_in_flight_with_a_sentence(synth_model, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "PROGRESS_FLOOR_S", 1.5)
    members = make_members(synth_model, [(0, 2), (2, 4), (4, 5)], batching=True)
    valve = None
    async with trio.open_nursery() as nursery:
        for i, m in enumerate(members):
            nxt = members[(i + 1) % 3]
            a, b = memory_stream_pair()
            if i == 1:
                a = valve = Freezable(a)
            m.next_link = Link(a, peer_id=nxt.peer_id, peer_name=nxt.name, label="ring")
            m.next_name, m.next_is_head = nxt.name, (i + 1) % 3 == 0
            m.ring_names = ["m0", "m1", "m2"]
            nursery.start_soon(nxt.feed_from, Link(b, peer_id=m.peer_id, peer_name=m.name, label="ring"))
        for m in members:
            nursery.start_soon(m.run)
        head = members[0]
        tokens = []

        async def on_event(e):
            tokens.append(e["token_id"])
            if len(tokens) == 5:
                valve.frozen = True  # mid-generation, silently
        with trio.fail_after(HANG_GUARD_S):  # no frame comes back: only the head's own check can end it
            st = await head.generate("a", "Once upon a time", max_tokens=500, temperature=0.0, on_event=on_event)
        assert st.error is not None and "made no progress" in st.error, st.error
        assert "m0 → m1 → m2 → m0" in st.error and "decode step" in st.error
        assert 5 <= len(st.generated) < 500
        stall = head.stalls[-1]
        assert stall["reqs"] == ["a"] and stall["bound_s"] >= 1.5
        assert stall["waited_s"] >= stall["bound_s"]  # failed past its deadline, never before (how long after: load)
        # a request started while the edge is frozen fails the same way: nothing hangs
        with trio.fail_after(HANG_GUARD_S):
            st2 = await head.generate("b", "Hello", max_tokens=5, temperature=0.0, on_event=lambda e: trio.sleep(0))
        assert st2.error is not None and "made no progress" in st2.error and "b" in st2.error
        assert not head.broken  # the ring is not declared broken: a stall is not a lost member
        nursery.cancel_scope.cancel()

"""Keepalives with a deadline on a ctl link (kafilad/node/session/liveness.py), under a mock clock."""

import pytest
import trio
import trio.testing

from kafilad.errors import LinkBroken
from kafilad.node.paths.link import Link
from kafilad.node.session.liveness import Liveness
from kafilad.proto import control as cf


def pair():
    a, b = trio.testing.memory_stream_pair()
    return Link(a, peer_id="pb", peer_name="beta", label="ctl"), Link(b, peer_id="pa", peer_name="alpha", label="ctl")


def test_a_silent_peer_is_closed_as_broken_within_the_deadline():
    async def main():
        a, b = pair()
        live = Liveness(a, interval_s=2.0, deadline_s=8.0)
        async with trio.open_nursery() as n:
            n.start_soon(live.run)
            t0 = trio.current_time()
            with pytest.raises(LinkBroken, match="beta sent nothing for .* s \\(frozen, asleep or cut off\\)"):
                while True:  # beta reads its pings (b receives) but never sends: "frozen"
                    await a.receive()
            assert 8.0 < trio.current_time() - t0 <= 10.0 + 1e-6

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_two_live_ends_keep_the_link_up_while_idle():
    async def main():
        a, b = pair()
        la, lb = Liveness(a), Liveness(b)

        async def reader(link, live, seen):
            while True:
                f = cf.decode_control(await link.receive())
                live.saw_frame()
                seen.append(f)

        seen_a, seen_b = [], []
        async with trio.open_nursery() as n:
            for args in ((a, la, seen_a), (b, lb, seen_b)):
                n.start_soon(reader, *args)
            n.start_soon(la.run)
            n.start_soon(lb.run)
            await trio.sleep(120)  # an idle minute or two: only pings cross
            assert a.closed_reason is None and b.closed_reason is None
            assert len(seen_a) >= 55 and all(isinstance(f, cf.Ping) for f in seen_a)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_time_our_own_loop_was_held_up_is_not_the_peers_silence():
    # One synchronous call holds the loop past the deadline; the peer's frame of that time is read
    # just after the loop resumes. The link stays up (seen: in the in-process session tests one
    # stall of the shared loop expired every link at once, blaming peers that were alive). Under
    # MockClock, `clock.jump` without a checkpoint is exactly a held loop: time passes, nothing runs.
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main():
        a, b = pair()
        live = Liveness(a, interval_s=0.1, deadline_s=0.5)

        async def peer_frames():
            while True:
                await trio.sleep(0.05)
                if held["now"]:
                    await trio.sleep(0.03)  # the buffered frame is read just after the watchdog's check
                    held["now"] = False
                live.saw_frame()

        held = {"now": False}
        async with trio.open_nursery() as n:
            n.start_soon(live._watchdog)
            n.start_soon(peer_frames)
            await trio.sleep(0.3)
            held["now"] = True
            clock.jump(0.9)  # the loop is held up: nothing runs, no frame is read
            await trio.sleep(0.5)
            assert a.closed_reason is None
            live.saw_frame()  # and a peer that is really silent is still found
            n.cancel_scope.cancel()
        live2 = Liveness(pair()[0], interval_s=0.1, deadline_s=0.5)
        t0 = trio.current_time()
        await live2._watchdog()
        assert "sent nothing for" in live2.link.closed_reason
        assert 0.5 < trio.current_time() - t0 <= 0.6 + 1e-6  # the deadline, then at most one check period

    trio.run(main, clock=clock)

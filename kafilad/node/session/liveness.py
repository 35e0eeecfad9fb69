"""Liveness of a ctl link: keepalives with a deadline (issue 8 §1; proto_spec 05 §2.3).

A closed socket is not the only way a member goes: a frozen process (SIGSTOP, a laptop asleep)
or a cut network keeps its TCP connections to the rendezvous, and its relayed circuits, open for
minutes. So both ends of every ctl link send a `ping` frame every ``interval_s`` and take any frame
received as proof of life; a link that carried nothing for ``deadline_s`` is closed as broken with
a sentence naming the peer, which the session then handles as that peer's loss. Time our own loop
was held up (longer than a ping period) does not count as the peer's silence: seen in the
in-process session tests, where one stall of the shared loop expired every link at once.
"""

from __future__ import annotations

import trio

from kafilad.errors import LinkClosed
from kafilad.proto import control as cf

#: seconds between pings on an idle ctl link
KEEPALIVE_INTERVAL_S = 2.0
#: seconds without any frame from the peer before its link is closed as broken
KEEPALIVE_DEADLINE_S = 8.0


class Liveness:
    """Keepalives and a deadline for one link (kafilad/node/paths/link.py ``Link``).

    Call :meth:`saw_frame` for every frame received; run :meth:`run` beside the receive loop.

    Args:
        link: the ctl link.
        interval_s: ping period; deadline_s: silence after which the link is closed as broken.
    """

    def __init__(self, link, *, interval_s: float = KEEPALIVE_INTERVAL_S, deadline_s: float = KEEPALIVE_DEADLINE_S):
        self.link = link
        self.interval_s = interval_s
        self.deadline_s = deadline_s
        self.last_s = trio.current_time()

    def saw_frame(self) -> None:
        self.last_s = trio.current_time()

    async def run(self) -> None:
        """Ping until the link ends; close it as broken once the peer has been silent for ``deadline_s``.

        The watchdog and the pinger are separate tasks: a ping is never cancelled part-way (that
        would cut a frame in two), and a send blocked by a peer that stopped reading cannot keep the
        watchdog from closing the link, which ends the blocked send too.
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pinger)
            await self._watchdog()
            nursery.cancel_scope.cancel()

    async def _watchdog(self) -> None:
        while self.link.closed_reason is None:
            before_s = trio.current_time()
            await trio.sleep(self.interval_s)
            now_s = trio.current_time()
            held_s = now_s - before_s - self.interval_s
            if held_s > self.interval_s:
                # our own loop was held up (a long synchronous call, a starved process, a resumed
                # laptop): the peer's frames of that time wait unread in our buffers, so the time
                # held up is not the peer's silence
                self.last_s = min(now_s, self.last_s + held_s)
            silent_s = now_s - self.last_s
            if silent_s > self.deadline_s:
                await self.link.close(f"{self.link.peer_name} sent nothing for {silent_s:.0f} s (frozen, asleep "
                                      f"or cut off)", broken=True)
                return

    async def _pinger(self) -> None:
        n = 0
        while self.link.closed_reason is None:
            await trio.sleep(self.interval_s)
            n += 1
            try:
                await self.link.send(cf.Ping(n).to_wire())
            except LinkClosed:
                return

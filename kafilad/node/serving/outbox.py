"""A member's outbox at the host: the session machine's frames to one ctl link, sent by their own task.

The host's session machine answers an event with `Send` actions (proto_spec 05 §2). Sending them
inline would make the task that fed the event wait on the receiving member: a member that stops
reading (frozen, cut off, or itself blocked sending to the host while the host blocks sending to
it) would hold up the loop reading another member's frames, and that member's silence would then
be counted against it (kafilad/node/session/liveness.py). So every admitted or pending member's ctl link
has an :class:`Outbox`: `put` never waits, and one task sends its frames in order.

A member whose outbox holds :data:`OUTBOX_FRAMES` unsent frames, or whose link does not take a
frame within :data:`SEND_BOUND_S`, has stopped reading: its link is closed with that reason (the
reading loop then reports the loss, as for any closed link). Nothing is dropped silently.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio

from kafilad.errors import LinkClosed

__all__ = ["OUTBOX_FRAMES", "SEND_BOUND_S", "Outbox"]

log = logging.getLogger("kafilad.host")

#: frames the host may hold for one member before it counts as not reading (control frames are few:
#: a plan, its start, edge reports, a close; a healthy member never has more than a handful waiting)
OUTBOX_FRAMES = 64
#: seconds one frame may take to send before the member counts as not reading (the old inline bound)
SEND_BOUND_S = 5.0


class Outbox:
    """Frames for one member's ctl link, sent in order by :meth:`run` (one task per link).

    Args:
        link: the member's ctl Link (kafilad/node/paths/link.py).
        limit: frames held before the member counts as not reading.
        send_bound_s: seconds one send may take before the same.
    Attributes:
        link: as given. closed_reason: why the outbox closed its link, or None.
    """

    def __init__(self, link, *, limit: int = OUTBOX_FRAMES, send_bound_s: float = SEND_BOUND_S):
        self.link = link
        self.send_bound_s = send_bound_s
        self._send, self._recv = trio.open_memory_channel(limit)
        self.closed_reason: Optional[str] = None
        self._stop = trio.CancelScope()
        self._done = trio.Event()

    def put(self, body: dict) -> bool:
        """Queue one frame (its wire dict) for the link; never waits.

        Returns:
            True if queued; False if the outbox is closed or was full, in which case the link is
            being closed as not reading (:meth:`run` closes it).
        """
        try:
            self._send.send_nowait(body)
            return True
        except trio.WouldBlock:
            self._give_up(f"{self.link.peer_name} stopped reading its control link "
                          f"({self._recv.statistics().current_buffer_used} frames waiting)")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        return False

    def _give_up(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            self._send.close()
            self._stop.cancel()

    async def run(self) -> None:
        """Send queued frames in order until the link ends or :meth:`close_after` closed the outbox.

        Each send is whole (shielded: a frame cut in the middle would corrupt the stream), bounded
        by ``send_bound_s``; one over the bound, or a full outbox, closes the link with the reason.
        A send that fails because the link ended ends this task quietly (the link's reading loop
        sees the end).
        """
        try:
            with self._stop:
                async for body in self._recv:
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(self.send_bound_s) as bound:
                            await self.link.send(body)
                    if bound.cancelled_caught:
                        self._give_up(f"{self.link.peer_name} took no control frame for {self.send_bound_s:g} s")
            if self.closed_reason is not None:
                with trio.CancelScope(shield=True):
                    await self.link.close(self.closed_reason, broken=True)
        except LinkClosed:
            pass
        finally:
            self._done.set()

    async def close_after(self, reason: str, bound_s: float = 2.0) -> None:
        """Send what is queued (in order, within ``bound_s``), then close the link with ``reason``.

        For the machine's `CloseLink`, whose frames (a `denied`, a `close`) must go out first, also
        while the session is being cancelled (the caller shields it; a cancelled :meth:`run` leaves
        the rest to this call). :meth:`run` must have been started (its task ends it). Later
        ``put`` calls do nothing.
        """
        self._send.close()
        with trio.move_on_after(bound_s):
            await self._done.wait()  # run sends what is queued, then ends (one reader: the order holds)
            try:
                while True:  # run ended early (cancelled): the rest goes from here
                    await self.link.send(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError, LinkClosed):
                pass
        await self.link.close(reason)

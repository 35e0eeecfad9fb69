"""The host's side of byte-range fetches (proto_spec 05 §2.1; DESIGN §6).

The host answers one member's `fetch` frames from a task of its own (:class:`MemberFetches`), so
its loop reading that member's link never waits on a 4 MiB `data` send: a member blocked sending
to the host while the host was blocked sending it data would stall both links until liveness
dropped it. A member may keep up to `cf.FETCHES_IN_FLIGHT_MAX` fetches unanswered.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import trio

from kafilad.errors import LinkClosed
from kafilad.node.paths.link import Link
from kafilad.node.shards.modelfiles import ModelFiles
from kafilad.proto import control as cf


class MemberFetches:
    """One member's `fetch` frames between the host's reading of its link and their answers.

    Args:
        link: the member's ctl link.
        serve: awaited with each frame, in the order they came (the host's `_serve_fetch`).
    Attributes:
        unanswered: fetches received and not yet answered (queued or being served).
    """

    def __init__(self, link: Link, serve: Callable[[cf.Fetch], Awaitable[None]]):
        self.link, self._serve = link, serve
        self._send, self._receive = trio.open_memory_channel(cf.FETCHES_IN_FLIGHT_MAX)
        self.unanswered = 0

    async def take(self, f: cf.Fetch) -> None:
        """Queue one `fetch` frame for :meth:`run`; never waits on the member.

        Raises:
            LinkClosed: the member now has more than `cf.FETCHES_IN_FLIGHT_MAX` unanswered (its link
                is closed with that reason).
        """
        self.unanswered += 1
        if self.unanswered > cf.FETCHES_IN_FLIGHT_MAX:
            reason = f"more than {cf.FETCHES_IN_FLIGHT_MAX} fetches in flight"
            await self.link.close(f"{self.link.peer_name} had {reason}")
            raise LinkClosed(f"it had {reason}")
        self._send.send_nowait(f)  # never full: at most FETCHES_IN_FLIGHT_MAX unanswered

    async def run(self) -> None:
        """Answer the queued frames in the order they came, until cancelled."""
        async for f in self._receive:
            try:
                await self._serve(f)
            finally:
                self.unanswered -= 1


async def serve_fetch(files: ModelFiles, link: Link, f: cf.Fetch) -> None:
    """Answer one `fetch` with its bytes, or a `fetch_error` naming why not (only ranges inside
    files of the model; a read error fails only this fetch).

    Raises:
        LinkClosed: the link ended while answering.
    """
    problem = files.check_range(f.file, f.offset, f.length)
    if problem is not None:
        await link.send(cf.FetchError(f.id, f"cannot serve it: {problem}").to_wire())
        return
    try:
        data = await trio.to_thread.run_sync(files.read, f.file, f.offset, f.length)
    except OSError as e:  # the host's own disk: that member's fetch fails, nothing else
        await link.send(cf.FetchError(f.id, f"cannot read it: {e}").to_wire())
        return
    await link.send(cf.Data(f.id, data).to_wire())

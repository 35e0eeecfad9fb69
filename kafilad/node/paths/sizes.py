"""Datagram size of a direct path: the search and black holes (proto_spec 07 §4a; RFC 8899).

:class:`PathSizes` is a part of :class:`kafilad.node.paths.manager.PathManager`, held in its ``sizes``
field: it owns the running searches and size probes, and is given the manager's ICE agents (by
transport), their drivers' wakers and the event log. The pure search is kafilad/proto/pmtu.py.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import trio

from kafilad.net.quic_transport import QuicTransport
from kafilad.node.paths.records import EdgeRecord
from kafilad.proto import ice
from kafilad.proto.pmtu import PROBE_TIMEOUT_MIN_S, PmtuSearch

log = logging.getLogger("kafilad.paths")


def _smoothed_rtt_s(t: QuicTransport) -> float:
    """``t``'s smoothed RTT in seconds (0.0 before a sample): ``QuicTransport.smoothed_rtt_s`` where
    the transport has it (the qh3 transport), else aioquic's loss recovery state."""
    rtt_s = getattr(t, "smoothed_rtt_s", None)
    if rtt_s is None:
        rtt_s = t.conn._loss._rtt_smoothed
    return float(rtt_s or 0.0)


class PathSizes:
    """The datagram sizes of one session's direct paths (RFC 8899 DPLPMTUD on ICE size probes).

    Args:
        agents: the manager's ``{QuicTransport: (IceAgent, ...)}`` (read, never written).
        wakers: the manager's ``{IceAgent: wake()}`` of running agent drivers (read).
        event: ``event(kind, **fields)``, the manager's path-event log (proto_spec 07 §6).
    """

    def __init__(self, agents, wakers: dict, event: Callable[..., None]):
        self._agents = agents
        self._wakers = wakers
        self.event = event
        self._searches: "weakref.WeakKeyDictionary[QuicTransport, tuple]" = weakref.WeakKeyDictionary()
        self._size_waiters: dict = {}  # ICE agent -> (size probed, trio.Event set when answered)

    def size_confirmed(self, agent: ice.IceAgent, size_bytes: int) -> None:
        """The agent's driver saw a SizeConfirmed for ``size_bytes``: wake the probe waiting on it."""
        waiter = self._size_waiters.get(agent)
        if waiter is not None and waiter[0] == size_bytes:
            waiter[1].set()

    async def search(self, t: QuicTransport, agent: ice.IceAgent, rec: EdgeRecord) -> None:
        """Probe larger datagram sizes on ``t``'s path with the agent's padded checks and raise
        ``t``'s size to each one answered (DPLPMTUD, RFC 8899), until the path is let go."""
        search = PmtuSearch(now=trio.current_time())
        wake = trio.Event()
        self._searches[t] = (search, rec, lambda: wake.set())
        rec.datagram_bytes, rec.pmtu = t.datagram_bytes, search.to_json()
        while t.closed_reason is None and agent.state == ice.AgentState.VERIFIED:
            now = trio.current_time()
            size = search.next_probe(now)
            if size is None:
                with trio.move_on_at(search.wake_at() or now + 60.0):
                    await wake.wait()
                wake = trio.Event()
                self._searches[t] = (search, rec, lambda: wake.set())
                continue
            rtt_s = _smoothed_rtt_s(t)
            answered = await self._probe_size(agent, size, max(PROBE_TIMEOUT_MIN_S, 3 * rtt_s))
            now = trio.current_time()
            if answered:
                search.confirmed(size, now)
                t.set_datagram_bytes(search.size)
                log.info("ring edge %s -> %s: datagrams of %d bytes cross the direct path", rec.src, rec.dst, size)
            else:
                search.failed(size, now)
            if t.closed_reason is None:
                rec.datagram_bytes, rec.pmtu = t.datagram_bytes, search.to_json()
            if search.probing is None:
                self.event("pmtu", edge=f"{rec.src} -> {rec.dst}", datagram_bytes=search.size, probes=search.probes)

    async def _probe_size(self, agent: ice.IceAgent, size: int, timeout_s: float) -> bool:
        answered = trio.Event()
        self._size_waiters[agent] = (size, answered)
        try:
            if not agent.send_size_probe(size, trio.current_time()):
                return False
            waker = self._wakers.get(agent)
            if waker is not None:
                waker()  # its driver sends the probe now
            with trio.move_on_after(timeout_s):
                await answered.wait()
            return answered.is_set()
        finally:
            self._size_waiters.pop(agent, None)

    async def small_datagrams_pass(self, t: QuicTransport, timeout_s: float = 1.0) -> bool:
        """Whether ``t``'s path still answers a small authenticated check (a size probe without
        padding, never bundled with data) within ``timeout_s``: tells a black hole for large
        datagrams from a dead path (RFC 8899 §4.2)."""
        agent, _ = self._agents.get(t, (None, None))
        if agent is None:
            return False
        return await self._probe_size(agent, agent.min_probe_bytes(), timeout_s)

    def black_hole(self, t: QuicTransport) -> int:
        """``t``'s datagrams of the current size stopped crossing its path (the edge saw stream data
        stall while PINGs pass): back to 1,200 bytes, search again later (RFC 8899 §4.2). The new size."""
        entry = self._searches.get(t)
        if entry is None:
            t.set_datagram_bytes(1200)
            return t.datagram_bytes
        search, rec, wake = entry
        before = t.datagram_bytes
        t.set_datagram_bytes(search.black_hole(trio.current_time()))
        rec.datagram_bytes, rec.pmtu = t.datagram_bytes, search.to_json()
        log.warning("ring edge %s -> %s: datagrams of %d bytes stopped crossing the direct path; sending %d-byte "
                    "datagrams", rec.src, rec.dst, before, t.datagram_bytes)
        self.event("pmtu_black_hole", edge=f"{rec.src} -> {rec.dst}", from_bytes=before, datagram_bytes=t.datagram_bytes)
        wake()
        return t.datagram_bytes


"""The ring's side of one edge: a link that outlives the edge's paths (proto_spec 07 §7, §7a).

RingMember sends on its next edge through an :class:`EdgeSender` and reads its previous edge
through an :class:`EdgeReceiver`, one object each for the edge's whole life. Underneath, the
edge's :class:`kafilad.node.paths.edge.RingEdge` moves them from one path (a :class:`Link`: Noise over a
QUIC stream, or over a relayed circuit) to another: an *upgrade* (relayed → direct, §7) or a
*fallback* (a direct path that went silent → relayed, §7a). No frame is lost, repeated or
reordered across a move, and the ring never notices::

    sender                                         receiver
    send(frame) ──> {**frame, "es": n} on the current link ──> delivered if es == delivered + 1
    keeps frame n until  <── {"t": "edge_ack", "es": n} ────── (coalesced, one in flight)
                                    a new path is made and secured (Noise) by RingEdge
                         <── {"t": "path_ready", "es": d} ─── on the new link; from now on the
                                                             receiver reads only the new link
    propose(new, d): resend every kept frame with es > d on the new link, then send there;
    let the old link go (make before break: the new one was confirmed before it)

``es`` (edge sequence) counts the frames of one edge from 1, across every path it used; the
receiver drops a frame it already delivered (es <= delivered), so a frame that arrived on the old
path after ``path_ready`` and is resent on the new one counts once. A frame without ``es`` (an
older peer) is delivered as it is. Those decisions (numbering, the window of kept frames, acks,
what is sent again) are the pure machines of kafilad/proto/edge_seq.py; the maps an edge carries
are read once, by kafilad/proto/ring_frames.py ``decode_edge``. This module is their driver: it
moves frames between links and parks callers while a path is repaired or the window is full.

A write or read that fails on a direct path asks the RingEdge to repair it (``on_broken``) and
waits, bounded, for the new path; once the edge gives up (``fail``), every waiting and later
call raises :class:`LinkBroken` with a sentence naming the edge.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import trio

from kafilad.errors import LinkBroken, LinkClosed, LinkEnded, MalformedFrame, SequenceGap
from kafilad.node.paths.link import Link
from kafilad.proto.edge_seq import KEEP_FRAMES, Delivery, ReceiveSequencer, SendSequencer
from kafilad.proto.ring_frames import EdgeAck, PathReady, Sequenced, decode_edge

log = logging.getLogger("kafilad.edge")

__all__ = ["ACK_DELAY_S", "KEEP_FRAMES", "EdgeReceiver", "EdgeSender", "PREVIOUS_KEEP_S", "REPAIR_WAIT_S"]

#: How long a receiver waits after a delivery before it acknowledges (coalescing what else comes):
#: the ack then goes out while the stage computes, not between the frame's arrival and the start
#: of its compute (bench_ring --timeline, 100 MB model: that hand-off 0.22-0.32 ms -> 0.11-0.20 ms
#: per stage). Frames are kept that much longer for a resend; KEEP_FRAMES bounds them.
ACK_DELAY_S = 0.003
#: How long a receiver whose link failed waits for the sender's fallback before it gives up.
REPAIR_WAIT_S = 15.0
#: How long a receiver keeps the previous path readable after a switch: if the new link closes
#: before it carried a frame (the sender gave up on it), the previous one is read again.
PREVIOUS_KEEP_S = 15.0

class _EdgeEnd:
    """What both ends share: the current link, failure, closing, and the repair hook."""

    def __init__(self, link: Link, *, edge_name: str, spawn: Callable, on_broken: Optional[Callable] = None):
        self.link = link
        self.peer_id = link.peer_id
        self.peer_name = link.peer_name
        self.label = "ring"
        self.edge_name = edge_name
        self.failed: Optional[str] = None
        self.closed_reason: Optional[str] = None
        self.on_broken = on_broken  # on_broken(link, error) -> bool: True if a repair is under way
        self._spawn = spawn
        self._changed = trio.Event()  # set whenever the link changes, the edge fails or closes
        self.ended = trio.Event()  # set once the edge failed or was closed: no more repairs

    @property
    def over(self) -> bool:
        """The edge failed or was closed."""
        return self.failed is not None or self.closed_reason is not None

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def fail(self, reason: str) -> None:
        """The edge cannot be repaired: every waiting and later call raises LinkBroken(``reason``)."""
        if self.failed is None and self.closed_reason is None:
            self.failed = reason
            log.warning("ring edge %s failed: %s", self.edge_name, reason)
        self.ended.set()
        self._signal()

    def _replacement_pending(self) -> bool:
        return False

    def _raise_if_over(self) -> None:
        if self.failed is not None:
            raise LinkBroken(self.failed)
        if self.closed_reason is not None:
            raise LinkEnded(self.closed_reason)

    async def _repair(self, link: Link, error: LinkClosed) -> None:
        """``link`` failed with ``error``: wait for the edge to replace it, or raise."""
        if self.on_broken is None or isinstance(error, LinkEnded) or not self.on_broken(link, error):
            raise error
        with trio.move_on_after(REPAIR_WAIT_S):
            while self.link is link and not self._replacement_pending():
                self._raise_if_over()
                await self._changed.wait()
            return
        self._raise_if_over()
        raise LinkBroken(f"the ring edge {self.edge_name} lost its path ({error.reason}) and was not repaired "
                         f"within {REPAIR_WAIT_S:g} s")

    @property
    def bytes_sent(self) -> int:
        return self.link.bytes_sent

    def end(self, reason: str) -> None:
        """Mark the edge closed without closing its link (its owner closes the links, kafilad/node/paths/edge.py
        ``RingEdge.aclose``): every call waiting on it (a repair, a full window) and every later one
        raises LinkEnded(``reason``)."""
        if self.closed_reason is None:
            self.closed_reason = reason if reason != "closed" else f"the ring edge {self.edge_name} was closed"
        self.ended.set()
        self._signal()

    async def close(self, reason: str = "closed") -> None:
        """Close the edge's current link; later calls raise LinkEnded (no repair is attempted)."""
        self.end(reason)
        await self.link.close(reason)

    async def aclose(self) -> None:
        await self.close()


class EdgeSender(_EdgeEnd):
    """The sending end of an edge as RingMember uses it: ``send(frame) -> bytes``.

    Args:
        link: the edge's first path. edge_name: "a -> b", for sentences.
        spawn: ``spawn(async_fn, *args)`` runs a background task (the path manager's nursery).
        on_broken: see :class:`_EdgeEnd`.
    """

    def __init__(self, link: Link, *, edge_name: str, spawn: Callable, on_broken: Optional[Callable] = None):
        super().__init__(link, edge_name=edge_name, spawn=spawn, on_broken=on_broken)
        self.seq = SendSequencer(KEEP_FRAMES)  # numbering, kept frames, resends (proto_spec 07 §7)
        self._lock = trio.Lock()
        self._proposal: Optional[tuple[Link, int]] = None
        self._write_scope: Optional[trio.CancelScope] = None
        self._acked_event = trio.Event()

    @property
    def kept(self) -> int:
        """Frames kept for a possible resend (sent, not yet acknowledged)."""
        return self.seq.kept

    @property
    def sent(self) -> int:
        """The highest es sent."""
        return self.seq.sent

    @property
    def acked(self) -> int:
        """The highest es the receiver acknowledged."""
        return self.seq.acked

    @property
    def resent(self) -> int:
        """Frames sent again after a switch."""
        return self.seq.resent

    async def send(self, body: dict) -> int:
        """Send one ring frame on the current path (proto_spec 07 §7); its size in bytes.

        Raises:
            LinkEnded: the edge was closed, or the peer closed it cleanly.
            LinkBroken: the edge failed and could not be repaired (a sentence naming it).
        """
        async with self._lock:
            self._raise_if_over()
            while self.seq.window_full:
                await self._acked_event.wait()
                self._raise_if_over()
            es, frame = self.seq.stamp(body)
            while True:
                if self._proposal is not None:
                    sizes = await self._apply()
                    return sizes.get(es, 0)
                link = self.link
                try:
                    with trio.CancelScope() as scope:
                        self._write_scope = scope
                        n = await link.send(frame)
                except LinkClosed as e:
                    if self._proposal is not None or link is not self.link:
                        continue
                    self._raise_if_over()
                    await self._repair(link, e)
                    continue
                finally:
                    self._write_scope = None
                if not scope.cancelled_caught:
                    return n

    async def propose(self, link: Link, delivered: int) -> None:
        """Move the edge onto ``link``, on which the receiver said `path_ready` with ``delivered``.

        Frames after ``delivered`` are sent again on ``link`` (a write blocked on the old path is
        interrupted), then the old link is closed in the background.
        """
        self._proposal = (link, delivered)
        if self._write_scope is not None:
            self._write_scope.cancel()
        self._signal()  # a send waiting for a repair applies the proposal itself
        async with self._lock:
            if self._proposal is not None:
                try:
                    await self._apply()
                except LinkClosed as e:  # the new path failed at once: repaired like any other
                    log.warning("ring edge %s: the new path failed while resending: %s", self.edge_name, e.reason)
                    if self.on_broken is None or not self.on_broken(self.link, e):
                        self.fail(f"the ring edge {self.edge_name} lost its new path at once ({e.reason})")

    def _replacement_pending(self) -> bool:
        return self._proposal is not None

    def _signal(self) -> None:
        super()._signal()
        self._wake_window()  # a send waiting on a full window looks again (the edge may be over)

    async def _apply(self) -> dict:
        link, delivered = self._proposal
        self._proposal = None
        old, self.link = self.link, link
        again = self.seq.on_path_ready(delivered)
        self._signal()  # also wakes a send parked on a full window
        self._spawn(old.close)  # the receiver reads only the new link now (reason "closed": a normal end)
        sizes = {}
        for es, frame in again:
            sizes[es] = await link.send(frame)
        if sizes:
            log.info("ring edge %s: %d frame(s) sent again on the new path (after %d)", self.edge_name, len(sizes),
                     delivered)
        return sizes

    def _wake_window(self) -> None:
        self._acked_event.set()
        self._acked_event = trio.Event()

    async def read_acks(self) -> None:
        """Read `edge_ack` frames from whichever link is current, until the edge ends (run it in the background)."""
        while self.closed_reason is None and self.failed is None:
            link = self.link
            try:
                frame = await link.receive()
            except LinkClosed as e:
                if link is self.link and self.closed_reason is None and self.failed is None:
                    if self.on_broken is None or isinstance(e, LinkEnded) or not self.on_broken(link, e):
                        return  # the next send sees the same error
                while link is self.link and self.closed_reason is None and self.failed is None:
                    await self._changed.wait()
                continue
            try:
                got = decode_edge(frame)
            except MalformedFrame as e:  # a malformed frame closes its link (repaired, or the next send fails)
                await link.close(f"the ring edge {self.edge_name} carried a malformed frame back: {e}", broken=True)
                continue
            if isinstance(got, EdgeAck) and self.seq.on_ack(got.es):
                self._wake_window()


class EdgeReceiver(_EdgeEnd):
    """The receiving end of an edge as RingMember uses it: ``receive() -> frame``.

    Args: as :class:`EdgeSender`.
    """

    def __init__(self, link: Link, *, edge_name: str, spawn: Callable, on_broken: Optional[Callable] = None):
        super().__init__(link, edge_name=edge_name, spawn=spawn, on_broken=on_broken)
        self.seq = ReceiveSequencer()  # in order, exactly once, acks (proto_spec 07 §7)
        self.previous: Optional[Link] = None  # the link before the last switch, until the new one carries a frame
        self._read_scope: Optional[trio.CancelScope] = None
        self._frames_on_link = 0
        self._ack_wanted = trio.Event()

    @property
    def delivered(self) -> int:
        """The highest es handed to the ring."""
        return self.seq.delivered

    @property
    def repeats(self) -> int:
        """Frames dropped as already delivered."""
        return self.seq.repeats

    async def receive(self) -> dict:
        """The next ring frame, in order, each once (proto_spec 07 §7).

        Raises:
            LinkEnded: the edge was closed, or the peer closed it cleanly.
            LinkBroken: the edge failed and could not be repaired (a sentence naming it).
        """
        while True:
            self._raise_if_over()
            link = self.link
            try:
                with trio.CancelScope() as scope:
                    self._read_scope = scope
                    frame = await link.receive()
            except LinkClosed as e:
                if link is not self.link:
                    continue
                if self._revert(link, e):
                    continue
                self._raise_if_over()
                await self._repair(link, e)
                continue
            finally:
                self._read_scope = None
            if scope.cancelled_caught or link is not self.link:
                continue  # read on a path we just left: the sender sends it again on the new one
            try:
                got = decode_edge(frame)
                if not isinstance(got, Sequenced):
                    continue  # the edge's own frames (edge_ack, path_ready, path_switched) never reach the ring
                verdict = self.seq.receive(got.es)
            except MalformedFrame as e:
                raise LinkBroken(f"the ring edge {self.edge_name} carried a malformed frame ({e})") from None
            except SequenceGap as e:
                raise LinkBroken(f"the ring edge {self.edge_name} skipped frames {e.expected}..{e.got - 1}") from None
            if verdict is Delivery.REPEAT:
                continue
            if got.es is None:
                return got.body  # an older sender's frame: delivered as it is, uncounted
            self._frames_on_link += 1
            if self._frames_on_link == 1 and self.previous is not None:
                old, self.previous = self.previous, None
                self._spawn(old.close)
            self._ack_wanted.set()
            return got.body

    def _revert(self, link: Link, error: LinkClosed) -> bool:
        """The new link closed before it carried a frame: read the previous one again, if it is open."""
        prev = self.previous
        if prev is None or self._frames_on_link or prev.closed_reason is not None:
            return False
        log.info("ring edge %s: the new path closed before use (%s); reading the previous one again", self.edge_name,
                 error.reason)
        self.previous, self.link = None, prev
        self._frames_on_link = 1  # the previous link carried frames: no revert from it
        self._signal()
        return True

    async def switch_to(self, link: Link) -> None:
        """Read only ``link`` from now on, and tell the sender so with `path_ready` (proto_spec 07 §7).

        Raises:
            LinkClosed: `path_ready` could not be sent (the new link is gone; the old one stays).
        """
        old = self.link
        self.link, self.previous, self._frames_on_link = link, old, 0
        if self._read_scope is not None:
            self._read_scope.cancel()
        delivered = self.delivered
        self._signal()
        self._spawn(self._forget_previous, old)
        try:
            await link.send(PathReady(delivered).to_wire())
        except LinkClosed:
            if self.link is link and self.previous is old:
                self.link, self.previous = old, None
                self._signal()
            raise

    async def _forget_previous(self, old: Link) -> None:
        await trio.sleep(PREVIOUS_KEEP_S)
        if self.previous is old:
            self.previous = None
            await old.close()

    async def send_acks(self) -> None:
        """Acknowledge delivered frames on the current link, coalesced (run it in the background)."""
        while self.closed_reason is None and self.failed is None:
            await self._ack_wanted.wait()
            await trio.sleep(ACK_DELAY_S)
            self._ack_wanted = trio.Event()
            es = self.seq.ack_due()
            if es is None:
                continue
            try:
                await self.link.send(EdgeAck(es).to_wire())
                self.seq.acked_up_to(es)
            except LinkClosed:
                await self._changed.wait()  # a new link (or the end) comes; ack there
                self._ack_wanted.set()

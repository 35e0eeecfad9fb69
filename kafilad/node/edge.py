"""One ring edge from formation to close: path choice, Noise, fallback, record, upgrade (proto_spec 07 §5-§7).

A :class:`RingEdge` is this daemon's end of one ring edge: the *sender* end (our outgoing edge:
ICE controlling, QUIC client, Noise initiator) or the *receiver* end. It lives on the session's
:class:`kafilad.node.paths.PathManager` and owns the edge's :class:`~kafilad.node.paths.EdgeRecord`::

    form()                                                    proto_spec 07 §5, DESIGN §3 step 5
      direct attempt 0 (offers, checks, QUIC) ──verified──> Noise XX ──> DIRECT
        │ no offer, predicted relay, checks failed,      │ did not finish (HandshakeTimeout)
        │ QUIC failed                                     v
        └──────────────────────────────────────> relayed circuit ──> Noise XX ──> RELAYED
      a key not in the roster (HandshakeRefused) is an error on either path

    start_upgrades(ring)          (RELAYED only, KAFILA_DIRECT not 0; proto_spec 07 §7, DESIGN §3 step 6)
      re-probe try=1,2,... ──verified──> Noise XX ──> `path_ready` ──> switch ──> DIRECT
      sender: next frame on the new link, `path_switched` on the old one, drain, close it
      receiver: read the new link beside the old one (RingMember.feed_from)

Everything an edge runs in the background (re-probes, the drain of an old path, reading an
upgraded link) runs in the path manager's nursery, so it ends with the session's
``open_session_paths`` block, or earlier with :meth:`RingEdge.aclose`. :func:`form_ring` forms
this member's two edges at once and closes those of the ring it formed before (a replan).

The ring side of an upgrade is any object with ``next_link``, ``broken``, ``broken_event`` and
``async feed_from(link)``: :class:`kafilad.node.ring.RingMember`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Awaitable, Callable, Optional

import trio

from kafilad.errors import HandshakeError, HandshakeRefused, HandshakeTimeout, KafilaError, SessionError, collapse_groups
from kafilad.net.quic_transport import QuicTransport
from kafilad.node.link import Link, LinkClosed, secure_link
from kafilad.node.paths import REPROBE_MAX_S, PathKind, PathManager, direct_enabled, reprobe_initial_s

log = logging.getLogger("kafilad.edge")

#: Bound on forming both ring edges of a member.
RING_FORM_TIMEOUT_S = 60.0
#: Bound on the Noise handshake over a direct path (then the edge relays).
DIRECT_NOISE_TIMEOUT_S = 10.0
#: How long the sender of an upgraded edge waits for the receiver to close the old path.
DRAIN_TIMEOUT_S = 10.0
#: How long the sender of an upgrade waits for the receiver's `path_ready` on the new link.
CONFIRM_TIMEOUT_S = 10.0

#: Errors that end one re-probe loop (logged; the edge stays relayed).
_REPROBE_ENDS = (KafilaError, LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError)


class RingEdge:
    """This daemon's end of one ring edge, from formation to close.

    Args:
        paths: the session's path manager (identity, signals, the nursery of background work).
        peer_id: the other end. roster: {peer_id: {"name", "public_key"}} of the session.
        sender: True for our outgoing edge.
        session_id: bound into Noise's prologue (DESIGN §4 "Identity").
        incoming: receiver only: the channel of relayed circuits labelled "ring" (from the
            session's accept loop).
    Attributes:
        record: the edge's EdgeRecord (registered with ``paths``, replacing an earlier ring's).
        link: the Link the edge uses now (None before it formed); links: every one it used.
    """

    def __init__(self, paths: PathManager, *, peer_id: str, roster: dict, sender: bool, session_id: str,
                 incoming: Optional[trio.MemoryReceiveChannel] = None):
        self.paths = paths
        self.peer_id = peer_id
        self.peer_name = roster[peer_id]["name"]
        self.roster = roster
        self.sender = sender
        self.session_id = session_id
        self.incoming = incoming
        self.record = paths.record(peer_id, self.peer_name, sender=sender, new=True)
        self.link: Optional[Link] = None
        self.links: list[Link] = []  # every link the edge used, oldest first
        self.closed = False
        self._hello = {"peer_id": paths.peer_id, "name": paths.name, "role": "ring"}
        self._background = trio.CancelScope()  # the edge's one background task (start_upgrades)

    def __repr__(self) -> str:
        return f"<RingEdge {self.record.src} -> {self.record.dst} {self.record.path}>"

    # ---- formation (proto_spec 07 §5) ----------------------------------------------------------
    async def form(self) -> Link:
        """Try the direct path, secure it, else relay; the edge's Link.

        Raises:
            HandshakeRefused / HandshakeError: the peer's key is not the roster's (on either path),
                or a handshake on the relayed circuit failed.
            SessionError: the relayed circuit could not be opened.
        """
        transport = await self.paths.try_direct(self.record, peer_id=self.peer_id, peer_name=self.peer_name,
                                                sender=self.sender)
        link = await self._secure_direct(transport) if transport is not None else None
        if link is None:
            link = await self._relay()
        self._use(link)
        return link

    def _use(self, link: Link) -> None:
        self.link = link
        self.links.append(link)
        if self.sender:
            self.record.link = link

    async def _relay(self) -> Link:
        if self.sender:
            circuit = await self.paths.rdv.open_circuit(self.peer_id, "ring")
        else:
            circuit = await self._incoming_circuit()
        link, _, _ = await secure_link(circuit, initiator=self.sender, static_private=self.paths.static_private,
                                       session_id=self.session_id, hello=self._hello, check_remote=self._check,
                                       label="ring")
        return link

    async def _incoming_circuit(self):
        while True:
            circuit = await self.incoming.receive()
            if circuit.peer_id == self.peer_id:
                return circuit
            log.warning("ring: refusing a ring circuit from %s (expected %s)", circuit.peer_id, self.peer_id)
            await circuit.aclose()

    def _check(self, remote_static: bytes, remote_hello: dict) -> str:
        if remote_static != self.roster[self.peer_id]["public_key"]:
            raise HandshakeRefused(f"ring neighbour {self.peer_name} presented a key not in the session roster")
        return self.peer_name

    async def _secure_direct(self, transport: QuicTransport) -> Optional[Link]:
        """Noise over a direct path; None (and the record says why) if it did not finish.

        Raises:
            HandshakeError: a refused key, or any failure other than a timeout: an error on any path.
        """
        try:
            link, _, _ = await secure_link(transport, initiator=self.sender, static_private=self.paths.static_private,
                                           session_id=self.session_id, hello=self._hello, check_remote=self._check,
                                           label="ring", timeout_s=DIRECT_NOISE_TIMEOUT_S)
            return link
        except HandshakeTimeout as e:  # this path does not carry us; a refused key (HandshakeRefused) propagates
            log.warning("ring: Noise over the direct path %s %s failed (%s); relaying",
                        "to" if self.sender else "from", self.peer_name, e)
            self.record.relayed(f"Noise over the direct path failed: {e}")
            await transport.aclose()
            return None

    # ---- upgrade (proto_spec 07 §7) ------------------------------------------------------------
    def start_upgrades(self, ring, on_edges: Optional[Callable[[], object]] = None) -> bool:
        """Re-probe this relayed edge in the background and switch the ring onto a direct path.

        Args:
            ring: the RingMember whose ``next_link`` (sender) or inbox (receiver) this edge feeds.
            on_edges: called (and awaited if it returns an awaitable) after the switch, to report
                the edges (proto_spec 07 §6).
        Returns:
            True if re-probing started (the edge is relayed and direct paths are enabled).
        """
        if self.record.path != PathKind.RELAYED or not direct_enabled() or self.closed:
            return False
        self.paths.nursery.start_soon(self._in_background, self._upgrade_sender if self.sender else
                                      self._upgrade_receiver, ring, on_edges)
        return True

    async def _in_background(self, fn, *args) -> None:
        with self._background:
            await fn(*args)

    async def aclose(self, reason: str = "the ring re-formed") -> None:
        """End this edge: stop its re-probes (or the reading of an upgraded link), close every link
        it used, and forget its record (the edges of a new ring replace it in status)."""
        self.closed = True
        self._background.cancel()
        for link in self.links:
            await link.close(reason)
        edge = self.paths.edge_id(self.peer_id, self.sender)
        if self.paths.edges.get(edge) is self.record:
            del self.paths.edges[edge]

    async def _upgrade_sender(self, ring, on_edges) -> None:
        """Re-probe, switch at a frame boundary, drain the old path (§7 steps 1-3, 5).

        Switching is safe between any two frames: frames of one request travel round the ring in
        causal order, so a request never has frames on both paths at once; ``Link.send`` holds a
        lock per frame, so the `path_switched` marker follows every frame already on the old path.
        """
        link = await self._reprobe_while_serving(ring, self._confirmed)
        old = ring.next_link
        if link is None:
            return
        if ring.broken or old is None:
            await link.close()
            return
        ring.next_link = link  # the next frame goes on the direct path
        self._use(link)
        self.record.upgraded(link)
        await _report(on_edges)
        try:
            await old.send({"t": "path_switched"})
            with trio.move_on_after(DRAIN_TIMEOUT_S):  # the receiver closes the old path once it read the marker
                while True:
                    await old.receive()
        except LinkClosed:
            pass
        await old.close()
        log.info("ring: the relayed path to %s drained and closed (%d bytes sent on it)", self.peer_name,
                 old.bytes_sent)

    async def _upgrade_receiver(self, ring, on_edges) -> None:
        """Answer re-probes, then read the new link beside the old one (§7 steps 1-2, 4)."""
        link = await self._reprobe_while_serving(ring, self._confirming)
        if link is None:
            return
        self._use(link)
        self.record.upgraded()
        await _report(on_edges)
        await ring.feed_from(_UpgradeLink(link))

    async def _reprobe_while_serving(self, ring, secure) -> Optional[Link]:
        """:meth:`reprobe` until it gives a link, the ring breaks (None) or a re-probe errs (None, logged)."""
        out: dict = {}
        with collapse_groups():
            async with trio.open_nursery() as n:
                async def watch() -> None:
                    await ring.broken_event.wait()
                    n.cancel_scope.cancel()

                n.start_soon(watch)
                try:
                    out["link"] = await self.reprobe(secure)
                except _REPROBE_ENDS as e:
                    log.warning("ring: stopped re-probing the edge %s %s: %s", "to" if self.sender else "from",
                                self.peer_name, e)
                n.cancel_scope.cancel()
        return out.get("link")

    async def reprobe(self, secure: Callable[[QuicTransport], Awaitable[Optional[Link]]]) -> Link:
        """Re-probe until a direct path verifies and ``secure`` makes a link over it (§7 steps 1-2).

        The sender makes attempts ``try`` = 1, 2, ... after a backoff doubling from
        :func:`reprobe_initial_s` to :data:`REPROBE_MAX_S`; the receiver answers the newest
        re-probe offer it holds from the sender, whenever one arrives. The record stays
        "relayed" (measurements in ``pending``) until the switch.
        """
        delay_s = reprobe_initial_s()
        attempt = 0
        while True:
            if self.sender:
                await trio.sleep(delay_s)
                attempt += 1
                delay_s = min(max(delay_s, 0.5) * 2, REPROBE_MAX_S)
            else:
                attempt = await self.paths.wait_reprobe(peer_id=self.peer_id)
            t = await self.paths.try_direct(self.record, peer_id=self.peer_id, peer_name=self.peer_name,
                                            sender=self.sender, attempt=attempt)
            if t is None:
                continue
            link = await secure(t)
            if link is not None:
                return link
            self.record.pending = None

    async def _confirmed(self, transport: QuicTransport) -> Optional[Link]:
        """Sender: the new link once the receiver said `path_ready` on it, else None (§7 step 2)."""
        link = await self._secure_direct(transport)
        if link is None:
            return None
        with trio.move_on_after(CONFIRM_TIMEOUT_S):
            try:
                if (await link.receive()).get("t") == "path_ready":
                    return link
            except LinkClosed:
                pass
        await link.close()
        return None

    async def _confirming(self, transport: QuicTransport) -> Optional[Link]:
        """Receiver: after Noise, tell the sender we read the new link (`path_ready`)."""
        link = await self._secure_direct(transport)
        if link is None:
            return None
        try:
            await link.send({"t": "path_ready"})
        except LinkClosed:
            return None
        return link


class _UpgradeLink:
    """A new incoming link as RingMember.feed_from reads it: if it closes before carrying any frame
    (the sender's side of the upgrade did not finish), that is not a ring failure; it is ignored."""

    def __init__(self, link: Link):
        self.link = link
        self.peer_name = link.peer_name
        self._used = False

    async def receive(self) -> dict:
        try:
            frame = await self.link.receive()
        except LinkClosed as e:
            if self._used:
                raise
            log.info("ring: an upgraded link from %s closed before use (%s); the relayed path stays", self.peer_name,
                     e.reason)
            await trio.sleep_forever()
        self._used = True
        return frame

    async def close(self, reason: str = "closed") -> None:
        await self.link.close(reason)


async def _report(on_edges) -> None:
    if on_edges is None:
        return
    try:
        out = on_edges()
        if inspect.isawaitable(out):
            await out
    except _REPROBE_ENDS as e:
        log.warning("ring: could not report the upgraded edge: %s", e)


async def form_ring(paths: PathManager, *, session_id: str, ring: list[str], roster: dict,
                    incoming: trio.MemoryReceiveChannel,
                    timeout_s: float = RING_FORM_TIMEOUT_S) -> tuple[Optional[RingEdge], Optional[RingEdge]]:
    """Form this member's edge to its next member and the one from its previous member, at once.

    Args:
        ring: peer ids in ring order, head first (ours among them).
        roster: {peer_id: {"name": str, "public_key": bytes}} of the session.
        incoming: channel of incoming relayed circuits labelled "ring".
    Returns:
        (next_edge, prev_edge), formed; both None when the ring is this member alone. The edges of
        a ring formed earlier on ``paths`` (a replan) are closed first (:func:`close_ring`).
    Raises:
        SessionError: an edge did not form within ``timeout_s``, or a key did not match the roster.
    """
    await close_ring(paths)
    me = paths.peer_id
    m = len(ring)
    if m == 1:
        return None, None
    i = ring.index(me)
    nxt, prv = ring[(i + 1) % m], ring[(i - 1) % m]
    out = RingEdge(paths, peer_id=nxt, roster=roster, sender=True, session_id=session_id)
    into = RingEdge(paths, peer_id=prv, roster=roster, sender=False, session_id=session_id, incoming=incoming)
    paths.ring_edges = [out, into]
    try:
        with trio.fail_after(timeout_s), collapse_groups():
            async with trio.open_nursery() as n:
                n.start_soon(out.form)
                n.start_soon(into.form)
    except trio.TooSlowError:
        raise SessionError(f"the ring edges to {out.peer_name} / from {into.peer_name} did not form "
                           f"within {timeout_s:g} s") from None
    except HandshakeError as e:
        raise SessionError(f"ring edge refused: {e}") from None
    return out, into


async def close_ring(paths: PathManager, reason: str = "the ring re-formed") -> None:
    """Close the edges of the ring formed last on ``paths`` (:meth:`RingEdge.aclose`); a replan calls it."""
    edges, paths.ring_edges = paths.ring_edges, []
    for e in edges:
        await e.aclose(reason)

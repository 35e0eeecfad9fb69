"""One ring edge from formation to close: path choice, Noise, fallback, record, upgrade (proto_spec 07 §5-§7a).

A :class:`RingEdge` is this daemon's end of one ring edge: the *sender* end (our outgoing edge:
ICE controlling, QUIC client, Noise initiator) or the *receiver* end. It lives on the session's
:class:`kafilad.node.paths.manager.PathManager` and owns the edge's :class:`~kafilad.node.paths.manager.EdgeRecord`.
The ring uses it through ``RingEdge.link``, an :class:`~kafilad.node.paths.edgelink.EdgeSender` or
:class:`~kafilad.node.paths.edgelink.EdgeReceiver` that stays the same object while the edge moves
between paths (kafilad/node/paths/edgelink.py: sequence numbers, acknowledgements, resends)::

    form()                                                    proto_spec 07 §5, DESIGN §3 step 5
      direct attempt 0 (offers, checks, QUIC) ──verified──> Noise XX ──> DIRECT
        │ no offer, predicted relay, checks failed,      │ did not finish (HandshakeTimeout)
        │ QUIC failed                                     v
        └──────────────────────────────────────> relayed circuit ──> Noise XX ──> RELAYED
      a key not in the roster (HandshakeRefused) is an error on either path

    start_upgrades(ring)      the edge's background life until it closes or the ring breaks
      DIRECT:  sender watches the QUIC path (PINGs every 0.5 s); silent for SILENCE_S, or the
               link broke ──> fallback (§7a): relayed circuit, Noise, `path_ready` ──> RELAYED
               (frames not acknowledged are sent again; fails with a sentence naming the edge
               if the relay cannot be reached within FALLBACK_TIMEOUT_S)
      RELAYED: re-probe try=1,2,... ──verified──> Noise XX ──> `path_ready` ──> DIRECT (§7)
               (after a fallback the re-probe wait is capped at REPROBE_FALLBACK_MAX_S; a C-S or
               S-S edge re-probes at once, by a birthday search on extra sockets, §7b)
      receiver: accepts the sender's fallback circuit at any time, answers its re-probes

Everything an edge runs in the background runs in the path manager's nursery, so it ends with the
session's ``open_session_paths`` block, or earlier with :meth:`RingEdge.aclose`. :func:`form_ring`
forms this member's two edges at once and closes those of the ring it formed before (a replan).

The ring side is any object with ``broken_event`` (:class:`kafilad.node.serving.ring.RingMember`): the
edge's life ends when the ring breaks.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Awaitable, Callable, Optional, Union

import trio

from kafilad.errors import (HandshakeError, HandshakeRefused, HandshakeTimeout, KafilaError, MalformedFrame,
                            RingEdgeError, SessionError, collapse_groups)
from kafilad.net.quic_transport import STALL_S, START_DATAGRAM_BYTES, QuicTransport
from kafilad.node.paths.edgelink import EdgeReceiver, EdgeSender
from kafilad.node.paths.link import Link, LinkClosed, secure_link
from kafilad.node.paths.birthday import birthday_enabled
from kafilad.node.paths.manager import REPROBE_MAX_S, PathKind, PathManager, direct_enabled, reprobe_initial_s
from kafilad.proto.birthday import role_for
from kafilad.proto.ring_frames import PathReady, decode_edge

log = logging.getLogger("kafilad.edge")

#: Bound on forming both ring edges of a member.
RING_FORM_TIMEOUT_S = 60.0
#: Bound on the Noise handshake over a direct path (then the edge relays).
DIRECT_NOISE_TIMEOUT_S = 10.0
#: How long the sender of an upgrade waits for the receiver's `path_ready` on the new link.
CONFIRM_TIMEOUT_S = 10.0
#: A direct path whose PINGs went unacknowledged this long is dead: the edge falls back (§7a).
SILENCE_S = 3.0
#: How often the sender looks at its direct path.
WATCH_INTERVAL_S = 0.25
#: When stream data stalls, how long a small check may take to tell a black hole from a dead path.
BLACK_HOLE_CHECK_S = 1.0
#: Bound on a fallback: relayed circuit, Noise over it, the receiver's `path_ready`.
FALLBACK_TIMEOUT_S = 10.0
#: Cap of the re-probe wait of an edge that was direct before (its path is likely to come back).
REPROBE_FALLBACK_MAX_S = 30.0
#: A C-S or S-S edge's first re-probe (a birthday search, proto_spec 07 §7b) starts this long after
#: its relay is up, not after KAFILA_REPROBE_S: the ring serves relayed meanwhile.
BIRTHDAY_FIRST_S = 0.0

#: Errors that end one re-probe loop (logged; the edge stays relayed).
_REPROBE_ENDS = (KafilaError, LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError)
#: Errors of a fallback attempt (the edge then fails with a sentence).
_FALLBACK_FAILS = (KafilaError, LinkClosed, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                   OSError)

EdgeEnd = Union[EdgeSender, EdgeReceiver]


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
        link: what the ring uses (EdgeSender / EdgeReceiver; None before it formed).
        path_link: the Link of the path in use; links: every Link the edge used, oldest first.
        transport: the QUIC transport of the direct path in use (None while relayed).
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
        self.edge_id = paths.edge_id(peer_id, sender)
        self.circuit_label = f"ring:{self.edge_id}"  # the relayed circuits of this edge (proto_spec 07 §5)
        self.name = f"{self.record.src} -> {self.record.dst}"
        self.link: Optional[EdgeEnd] = None
        self.path_link: Optional[Link] = None
        self.links: list[Link] = []  # every link the edge used, oldest first
        self.transport: Optional[QuicTransport] = None
        self.closed = False
        self._hello = {"peer_id": paths.peer_id, "name": paths.name, "role": "ring", "edge": self.edge_id}
        self._background = trio.CancelScope()  # the edge's background life (start_upgrades)
        self._living = False
        self._on_edges: Optional[Callable[[], object]] = None
        self._repair = trio.Event()
        self._repair_reason: Optional[str] = None
        self._trying: Optional[QuicTransport] = None  # the transport a re-probe is securing
        self._relayed_at: Optional[float] = None  # trio time the edge's relayed path came up

    def __repr__(self) -> str:
        return f"<RingEdge {self.name} {self.record.path}>"

    # ---- formation (proto_spec 07 §5) ----------------------------------------------------------
    async def form(self) -> EdgeEnd:
        """Try the direct path, secure it, else relay; the ring's end of the edge (``self.link``).

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
            self._relayed_at = trio.current_time()
        else:
            self.transport = transport
        self._use(link)
        end = EdgeSender if self.sender else EdgeReceiver
        self.link = end(link, edge_name=self.name, spawn=self.paths.nursery.start_soon, on_broken=self._on_broken)
        return self.link

    def _use(self, link: Link) -> None:
        self.path_link = link
        self.links.append(link)
        if self.sender:
            self.record.link = link

    async def _relay(self) -> Link:
        if self.sender:
            circuit = await self.paths.rdv.open_circuit(self.peer_id, self.circuit_label)
            link, _, _ = await self._secure(circuit, self._hello)
            return link
        while True:  # skip a stale circuit: a fallback (§7a), or one of an earlier ring's edge (§5)
            circuit = await self._incoming_circuit()
            try:
                link, _, hello = await self._secure(circuit, self._hello)
            except HandshakeTimeout as e:  # its sender gave up on it (an earlier formation): wait for the next
                log.info("ring: a relayed circuit from %s closed during its handshake (%s); waiting for another",
                         self.peer_name, e)
                continue
            if hello.get("switch"):
                await link.close("a fallback circuit of an earlier ring edge")
            elif hello.get("edge", self.edge_id) != self.edge_id:
                await link.close(f"a circuit of another ring's edge ({hello.get('edge')!r}, expected {self.edge_id!r})")
            else:
                return link

    async def _secure(self, transport, hello: dict, timeout_s: float = 20.0):
        return await secure_link(transport, initiator=self.sender, static_private=self.paths.static_private,
                                 session_id=self.session_id, hello=hello, check_remote=self._check, label="ring",
                                 timeout_s=timeout_s)

    async def _incoming_circuit(self):
        """The next relayed circuit from our peer for this edge; others are closed unread.

        A circuit labelled for another edge (an earlier ring's, whose sender may have given up on
        it without closing it yet) is dropped before any handshake; a bare "ring" label (a peer
        that does not name the edge) is taken, and its handshake's hello is checked instead.
        """
        while True:
            circuit = await self.incoming.receive()
            label = getattr(circuit, "label", "ring")
            if circuit.peer_id != self.peer_id:
                log.warning("ring: refusing a ring circuit from %s (expected %s)", circuit.peer_id, self.peer_id)
            elif label not in ("ring", self.circuit_label):
                log.info("ring: dropping a circuit from %s for another ring edge (%s; this edge is %s)",
                         self.peer_name, label, self.circuit_label)
            else:
                return circuit
            await circuit.aclose()

    def _check(self, remote_static: bytes, remote_hello: dict) -> str:
        if remote_static != self.roster[self.peer_id]["public_key"]:
            raise HandshakeRefused(f"ring neighbour {self.peer_name} presented a key not in the session roster")
        return self.peer_name

    async def _secure_direct(self, transport: QuicTransport) -> Optional[Link]:
        """Noise over a direct path; None (the record says why, the path is released) if it did not finish.

        Raises:
            HandshakeError: a refused key, or any failure other than a timeout: an error on any path.
        """
        try:
            link, _, _ = await self._secure(transport, self._hello, DIRECT_NOISE_TIMEOUT_S)
            return link
        except HandshakeTimeout as e:  # this path does not carry us; a refused key (HandshakeRefused) propagates
            log.warning("ring: Noise over the direct path %s %s failed (%s); relaying",
                        "to" if self.sender else "from", self.peer_name, e)
            self.record.relayed(f"Noise over the direct path failed: {e}")
            self.paths.release(transport)
            return None

    # ---- the background life (proto_spec 07 §7, §7a) ------------------------------------------
    def start_upgrades(self, ring, on_edges: Optional[Callable[[], object]] = None) -> bool:
        """Run the edge's background life: acknowledgements, the fallback of a direct path that
        goes silent (§7a), the re-probes and upgrade of a relayed one (§7).

        Args:
            ring: the RingMember this edge feeds (its ``broken_event`` ends the life).
            on_edges: called (and awaited if it returns an awaitable) after the edge changed path
                or a re-probe failed, to report the edges (proto_spec 07 §6).
        Returns:
            True if the life started (the edge formed and is open).
        """
        if self.closed or self.link is None or self._living:
            return False
        self._living = True
        self._on_edges = on_edges
        self.paths.nursery.start_soon(self._in_background, self._life, ring)
        return True

    async def _in_background(self, fn, *args) -> None:
        try:
            with self._background:
                await fn(*args)
        finally:
            self._living = False

    async def _life(self, ring) -> None:
        with collapse_groups():
            async with trio.open_nursery() as n:
                async def end_when(event) -> None:
                    await event.wait()
                    n.cancel_scope.cancel()
                n.start_soon(end_when, self.link.ended)  # the ring closed its end (a replan), or it failed
                broken = getattr(ring, "broken_event", None)
                if broken is not None:
                    n.start_soon(end_when, broken)
                if self.sender:
                    n.start_soon(self.link.read_acks)
                    await self._sender_life()
                    if not self.link.over and not self.closed:
                        await trio.sleep_forever()  # acknowledgements still flow on the path in use
                else:
                    n.start_soon(self.link.send_acks)
                    n.start_soon(self._accept_fallbacks)
                    if direct_enabled():
                        n.start_soon(self._answer_reprobes)
                    await trio.sleep_forever()
                n.cancel_scope.cancel()

    async def _sender_life(self) -> None:
        while not self.closed and not self.link.over:
            if self.transport is not None:
                why = await self._watch_direct()
                if why is None or not await self._fall_back(why):
                    return
            elif not direct_enabled():
                return
            else:
                try:
                    found = await self.reprobe(self._confirmed)
                except _REPROBE_ENDS as e:
                    log.warning("ring: stopped re-probing the edge %s: %s", self.name, e)
                    return
                link, es = found
                await self._switched(link, self._trying, es=es, upgrade=True)

    def _on_broken(self, link: Link, error: LinkClosed) -> bool:
        """The ring's end saw ``link`` fail: True if a repair (a fallback) will come."""
        if (self.closed or not self._living or self.link.over or link is not self.path_link
                or self.record.path != PathKind.DIRECT):
            return False
        if self._repair_reason is None:
            self._repair_reason = f"the direct path broke ({error.reason})"
        self._repair.set()
        return True

    async def _watch_direct(self) -> Optional[str]:
        """Sender: wait until the direct path in use dies; why (None: the peer closed it cleanly)."""
        t = self.transport
        where = f"{t.remote[0]}:{t.remote[1]}"
        reported = self._size_state()
        rtt_reported: Optional[float] = None
        while True:
            with trio.move_on_after(WATCH_INTERVAL_S):
                await self._repair.wait()
            if self._size_state() != reported:  # the datagram size search moved on (§4a): status shows it
                reported = self._size_state()
                await _report(self._on_edges)
            if t.rtt_samples and t.min_rtt_s is not None:  # the path's own round trip (§6 `path_rtt_ms`)
                self.record.path_rtt_ms, self.record.rtt_samples = t.min_rtt_s * 1000.0, t.rtt_samples
                if rtt_report_due(self.record.path_rtt_ms, self.record.rtt_samples, rtt_reported):
                    rtt_reported = self.record.path_rtt_ms
                    await _report(self._on_edges)
            if self.link.over:
                return None
            if self._repair_reason is not None:
                why, self._repair_reason = self._repair_reason, None
                self._repair = trio.Event()
                return why
            if t.closed_reason is not None and t.ended_cleanly:
                log.info("ring edge %s: the direct path ended cleanly (%s)", self.name, t.closed_reason)
                return None
            now = trio.current_time()
            silent_s = t.silent_for_s(now)
            if silent_s >= SILENCE_S:
                return f"the direct path to {where} went silent for {silent_s:.1f} s"
            stalled_s = t.stalled_for_s(now)  # data unacknowledged: a black hole, or a dead path (§4a)
            if stalled_s >= STALL_S and t.datagram_bytes > START_DATAGRAM_BYTES:
                if not await self.paths.sizes.small_datagrams_pass(t, BLACK_HOLE_CHECK_S):
                    silent_s = t.silent_for_s(trio.current_time())
                    return f"the direct path to {where} went silent for {silent_s:.1f} s"
                self.paths.sizes.black_hole(t)
                await _report(self._on_edges)
            elif stalled_s >= 2 * STALL_S:
                return (f"the direct path to {where} carries small datagrams only: stream data in "
                        f"{t.datagram_bytes}-byte datagrams went unacknowledged for {stalled_s:.1f} s")
            if t.closed_reason is not None:
                return f"the direct path to {where} ended ({t.closed_reason})"

    def _size_state(self) -> tuple:
        return self.record.datagram_bytes, (self.record.pmtu or {}).get("state")

    async def _fall_back(self, why: str) -> bool:
        """Sender: move the edge onto a relayed circuit (§7a); False if it failed (the ring's end says why)."""
        log.warning("ring edge %s: %s; falling back to the relay", self.name, why)
        t0 = trio.current_time()
        hello = {**self._hello, "edge": self.edge_id, "switch": "fallback", "reason": why}
        try:
            with trio.fail_after(FALLBACK_TIMEOUT_S):
                circuit = await self.paths.rdv.open_circuit(self.peer_id, self.circuit_label)
                link, _, _ = await self._secure(circuit, hello, FALLBACK_TIMEOUT_S)
                es = await self._ready_on(link)
        except _FALLBACK_FAILS as e:
            detail = "it did not finish in time" if isinstance(e, trio.TooSlowError) else str(e) or type(e).__name__
            reason = f"the ring edge {self.name} lost its direct path ({why}) and could not fall back to the relay: " \
                     f"{detail}"
            self.record.relayed(reason)
            self.link.fail(reason)
            self.paths.event("edge_failed", edge=self.name, reason=reason)
            await _report(self._on_edges)
            return False
        if es is None:
            await link.close("no path_ready on the fallback circuit")
            self.link.fail(f"the ring edge {self.name} lost its direct path ({why}) and its receiver did not take "
                           f"the relayed circuit")
            return False
        await self._switched(link, None, es=es, upgrade=False, why=why, took_s=trio.current_time() - t0)
        return True

    async def _ready_on(self, link: Link) -> Optional[int]:
        """The `es` of the receiver's `path_ready` on ``link`` (§7 step 2), or None if another frame came
        (or a malformed one: the caller then closes ``link``)."""
        frame = await link.receive()
        try:
            got = decode_edge(frame)
        except MalformedFrame as e:
            log.warning("ring edge %s: a malformed frame instead of path_ready: %s", self.name, e)
            return None
        return got.es if isinstance(got, PathReady) else None

    async def _switched(self, link: Link, transport: Optional[QuicTransport], *, es: Optional[int], upgrade: bool,
                        why: str = "", took_s: Optional[float] = None) -> None:
        """Move the ring's end onto ``link`` and record it (either end)."""
        old_t = self.transport
        if self.sender:
            await self.link.propose(link, es)
        else:
            await self.link.switch_to(link)
        self.transport = transport
        self._use(link)
        if upgrade:
            after_s = None if self._relayed_at is None else round(trio.current_time() - self._relayed_at, 3)
            self.record.upgraded(link if self.sender else None, direct_after_s=after_s, now_s=time.time())
            fields = {"edge": self.name, "remote": self.record.remote, "tries": self.record.tries}
            if self.record.birthday is not None:  # time to direct and the probes it took (§7b)
                fields.update(via="birthday", probes=self.record.birthday["probes"], direct_after_s=after_s)
            self.paths.event("edge_upgraded", **fields)
        else:
            self._relayed_at = trio.current_time()
            self.record.fell_back(why, link if self.sender else None, now_s=time.time())
            fields = {"edge": self.name, "reason": why}
            if self.sender:
                fields.update(resent=self.link.resent, fallback_s=took_s)
            self.paths.event("edge_fallback", **fields)
        self.paths.release(old_t)
        await _report(self._on_edges)

    async def _accept_fallbacks(self) -> None:
        """Receiver: take the sender's fallback circuit whenever it comes (§7a)."""
        while True:
            circuit = await self._incoming_circuit()
            try:
                link, _, hello = await self._secure(circuit, self._hello, FALLBACK_TIMEOUT_S)
            except HandshakeError as e:
                log.warning("ring edge %s: a fallback circuit failed its handshake: %s", self.name, e)
                continue
            if hello.get("switch") != "fallback" or hello.get("edge") != self.edge_id:
                await link.close("not a fallback circuit of this edge")
                continue
            why = hello.get("reason") if isinstance(hello.get("reason"), str) else "the sender's direct path failed"
            try:
                await self._switched(link, None, es=None, upgrade=False, why=why)
            except LinkClosed as e:
                log.warning("ring edge %s: the fallback circuit closed at once: %s", self.name, e.reason)

    async def _answer_reprobes(self) -> None:
        """Receiver: answer the sender's re-probes and take a path it confirms (§7)."""
        while True:
            try:
                link = await self.reprobe(self._secure_direct)
            except _REPROBE_ENDS as e:
                log.warning("ring: stopped answering re-probes of the edge %s: %s", self.name, e)
                return
            try:
                await self._switched(link, self._trying, es=None, upgrade=True)
            except LinkClosed as e:
                log.info("ring edge %s: the re-probed path closed before the switch: %s", self.name, e.reason)
                self.paths.release(self._trying)

    async def aclose(self, reason: str = "the ring re-formed") -> None:
        """End this edge: stop its background life, close every link it used, release its direct
        path, and forget its record (the edges of a new ring replace it in status)."""
        self.closed = True
        self._background.cancel()
        if self.link is not None and not self.link.over:
            self.link.end(reason)  # wakes a send parked in a repair or on a full window
        for link in self.links:
            await link.close(reason)
        self.paths.release(self.transport)
        if self.paths.edges.get(self.edge_id) is self.record:
            del self.paths.edges[self.edge_id]

    async def reprobe(self, secure: Callable[[QuicTransport], Awaitable[object]]):
        """Re-probe until a direct path verifies and ``secure`` makes something of it (§7 steps 1-2).

        The sender makes attempts ``try`` = tries+1, tries+2, ... after a wait doubling from
        :func:`reprobe_initial_s` to :data:`REPROBE_MAX_S` (:data:`REPROBE_FALLBACK_MAX_S` for an
        edge that fell back: its path is likely to return); each failed attempt is noted on the
        record (``last_attempt``), as a ``reprobe_failed`` event, and reported. The receiver
        answers the newest re-probe offer it holds from the sender, whenever one arrives. The
        record stays "relayed" (measurements in ``pending``) until the switch.

        Returns:
            What ``secure`` returned for the path (truthy); ``self._trying`` is its transport.
        """
        delay_s = reprobe_initial_s()
        first_s = BIRTHDAY_FIRST_S if self.sender and self._birthday_pair() else None
        attempt = self.record.tries
        while True:
            if self.sender:
                if first_s is not None:  # a birthday search right after the relay came up (§7b)
                    await trio.sleep(first_s)
                    first_s = None
                else:
                    await trio.sleep(delay_s)
                    cap_s = REPROBE_FALLBACK_MAX_S if self.record.fallbacks else REPROBE_MAX_S
                    delay_s = min(max(delay_s, 0.5) * 2, cap_s)
                attempt += 1
            else:
                attempt = await self.paths.wait_reprobe(peer_id=self.peer_id)
            t = await self.paths.try_direct(self.record, peer_id=self.peer_id, peer_name=self.peer_name,
                                            sender=self.sender, attempt=attempt)
            if t is None:
                if self.sender:
                    self.paths.event("reprobe_failed", edge=self.name, tries=attempt, reason=self.record.reason)
                    await _report(self._on_edges)
                continue
            self._trying = t
            out = await secure(t)
            if out:
                return out
            self.paths.release(t)
            self.record.pending = None

    def _birthday_pair(self) -> bool:
        """The ends' classes at the last attempt call for a birthday search (C-S or S-S, §7b)."""
        classes = self.record.classes
        return birthday_enabled() and role_for(classes.get(self.paths.name), classes.get(self.peer_name)) is not None

    async def _confirmed(self, transport: QuicTransport) -> Optional[tuple[Link, int]]:
        """Sender: (the new link, the receiver's delivered count) once it said `path_ready`, else None (§7 step 2)."""
        link = await self._secure_direct(transport)
        if link is None:
            return None
        with trio.move_on_after(CONFIRM_TIMEOUT_S):
            try:
                es = await self._ready_on(link)
                if es is not None:
                    return link, es
            except LinkClosed:
                pass
        await link.close()
        return None


#: RTT samples a direct path's `path_rtt_ms` needs before it is reported: the liveness PINGs alone
#: give two a second, so about 4 s after formation at the latest (§6)
RTT_SETTLED_SAMPLES = 8
#: a reported `path_rtt_ms` is reported again once it fell by this fraction and RTT_REPORT_MIN_MS
RTT_REPORT_FRACTION = 0.2
RTT_REPORT_MIN_MS = 1.0


def rtt_report_due(path_rtt_ms: float, samples: int, reported_ms: Optional[float]) -> bool:
    """Whether the sender reports its edge's settled round trip (an `edges` frame, proto_spec 05
    §2): first once RTT_SETTLED_SAMPLES samples were taken, then whenever the minimum fell by
    RTT_REPORT_FRACTION and RTT_REPORT_MIN_MS since the last report (a minimum only falls)."""
    if samples < RTT_SETTLED_SAMPLES:
        return False
    if reported_ms is None:
        return True
    drop_ms = reported_ms - path_rtt_ms
    return drop_ms >= RTT_REPORT_MIN_MS and drop_ms >= RTT_REPORT_FRACTION * reported_ms


async def _report(on_edges) -> None:
    if on_edges is None:
        return
    try:
        out = on_edges()
        if inspect.isawaitable(out):
            await out
    except _REPROBE_ENDS as e:
        log.warning("ring: could not report the edges: %s", e)


async def form_ring(paths: PathManager, *, session_id: str, ring: list[str], roster: dict,
                    incoming: trio.MemoryReceiveChannel, epoch: int = 0,
                    timeout_s: float = RING_FORM_TIMEOUT_S) -> tuple[Optional[RingEdge], Optional[RingEdge]]:
    """Form this member's edge to its next member and the one from its previous member, at once.

    Args:
        ring: peer ids in ring order, head first (ours among them).
        roster: {peer_id: {"name": str, "public_key": bytes}} of the session.
        incoming: channel of incoming relayed circuits labelled "ring".
        epoch: the plan's epoch (proto_spec 05 §2), part of every edge id of this ring (07 §2).
    Returns:
        (next_edge, prev_edge), formed; both None when the ring is this member alone. The edges of
        a ring formed earlier on ``paths`` (a replan) are closed first (:func:`close_ring`).
    Raises:
        RingEdgeError: an edge could not be made (a key did not match the roster, the peer left the
            rendezvous session, its circuit could not be opened); `peer_id` names that edge's peer.
        SessionError: the edges did not form within ``timeout_s``.
    """
    await close_ring(paths)
    paths.ring_epoch = epoch
    me = paths.peer_id
    m = len(ring)
    if m == 1:
        return None, None
    i = ring.index(me)
    nxt, prv = ring[(i + 1) % m], ring[(i - 1) % m]
    out = RingEdge(paths, peer_id=nxt, roster=roster, sender=True, session_id=session_id)
    into = RingEdge(paths, peer_id=prv, roster=roster, sender=False, session_id=session_id, incoming=incoming)
    paths.ring_edges = [out, into]

    async def form(edge: RingEdge) -> None:
        try:
            await edge.form()
        except HandshakeError as e:
            raise RingEdgeError(f"ring edge refused: {e}", edge.peer_id) from None
        except KafilaError as e:  # e.g. the rendezvous: "Peer ... is not a member of session ..."
            way = "to" if edge.sender else "from"
            raise RingEdgeError(f"the ring edge {way} {edge.peer_name} could not be made: {e}", edge.peer_id) from None

    try:
        with trio.fail_after(timeout_s), collapse_groups():
            async with trio.open_nursery() as n:
                n.start_soon(form, out)
                n.start_soon(form, into)
    except trio.TooSlowError:
        raise SessionError(f"the ring edges to {out.peer_name} / from {into.peer_name} did not form "
                           f"within {timeout_s:g} s") from None
    return out, into


async def close_ring(paths: PathManager, reason: str = "the ring re-formed") -> None:
    """Close the edges of the ring formed last on ``paths`` (:meth:`RingEdge.aclose`); a replan calls it."""
    edges, paths.ring_edges = paths.ring_edges, []
    for e in edges:
        await e.aclose(reason)

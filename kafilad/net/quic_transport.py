"""QUIC on the daemon's UDP endpoint: qh3's sans-IO QuicConnection driven by trio (DESIGN §4; proto_spec 07 §4).

One QUIC connection per direct ring edge. The edge's sender is the QUIC client, its receiver the
server (fixed roles, never both clients). The connection carries one bidirectional stream (id 0,
opened by the client) framed as proto_spec 01 §5.1 (u16 big-endian length + message), so it is a
:class:`kafilad.net.transport.MessageTransport` and the Noise channel of kafilad/node/paths/link.py runs
inside it unchanged. TLS certificates are self-signed, generated per process and not checked:
Noise authenticates the peer (DESIGN §4 "QUIC"). Settings and qh3 specifics: kafilad/net/quic_config.py.

The driver (:meth:`QuicTransport.run`) is the aioquic asyncio protocol's loop in trio: feed
datagrams as the endpoint delivers them, process events, flush ``datagrams_to_send(now)`` and
re-arm ``get_timer()``. For latency, as in aioquic's asyncio protocol, work happens where it
arises rather than one scheduler pass later: events are processed as each datagram arrives (the
endpoint reads bursts, so the driver wakes once per burst), and ``send_message`` transmits at once
and only moves the sleeping driver's deadline.

Datagrams start at 1,200 bytes on a network path (RFC 9000 §14.1; the edge's sender then raises
the size as path MTU probes confirm it, :meth:`QuicTransport.set_datagram_bytes`, proto_spec 07
§4a) and are 16,000 bytes toward this host (:func:`path_datagram_bytes`). qh3 can lower a
connection's size but not raise it, so a raise opens a *successor* connection at the new size on
the same sockets and hands stream 0 over to it, in order, without losing a byte::

    client (sender)                                  server (receiver)
    gen g carries stream 0 ...
    set_datagram_bytes(larger): Initial of gen g+1 --> DCID = successor_dcid(gen g's) is routed here
    gen g+1 handshake completes
    open stream 0 on g+1; FIN on g's stream 0 -------> read g until its FIN, then read g+1
                                                       (g+1's stream 0 open): FIN on g, send on g+1
    read g until its FIN, then g+1 <----------------- FIN on g
    close gen g ("superseded") ---------------------> gen g retired; its close is no end

Each side sends on the newest handed-over generation and reads generations in order, each to
its FIN, so messages stay whole and ordered across the switch.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio
from qh3.quic import events as qe
from qh3.quic.connection import QuicConnection, QuicConnectionError

from kafilad.errors import RemoteProtocolError
from kafilad.net.quic_config import (ALPN, FLOW_WINDOW_BYTES, IDLE_TIMEOUT_S, MAX_DATAGRAM_BYTES,  # noqa: F401
                                     MAX_SETTABLE_DATAGRAM_BYTES, SAME_HOST_DATAGRAM_BYTES, START_DATAGRAM_BYTES,
                                     cap_datagram_bytes, configuration, datagram_bytes_of, path_datagram_bytes,
                                     self_signed_certificate, successor_dcid)
from kafilad.net.quic_gen import SUPERSEDED, Generation, StallMeter
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.proto.quic_header import quic_dcid
from kafilad.proto.transport_messages import encode_message

log = logging.getLogger("kafilad.quic")



Address = tuple[str, int]

#: Stream data unacknowledged this long while PINGs are acknowledged: the datagram size is
#: black-holed on the path (RFC 8899 §4.2); see :meth:`QuicTransport.stalled_for_s`.
STALL_S = 2.0
PING_INTERVAL_S = 15.0
#: PING interval of a watched path (a ring edge, proto_spec 07 §7a): each acknowledged PING
#: proves the path carries datagrams both ways, so silence is seen within a few seconds.
LIVENESS_PING_S = 0.5
#: Unacknowledged stream bytes a sender may queue before send_message waits (backpressure).
SEND_WINDOW_BYTES = 4 * 1024 * 1024
#: A successor connection (a raised datagram size) that does not complete its handshake in this
#: long is given up; the transport keeps its current size.
SUCCESSOR_TIMEOUT_S = 5.0


class QuicTransport:
    """A MessageTransport over stream 0 of one QUIC connection (and its successors) on a shared
    :class:`UdpEndpoint`.

    Make it with :func:`quic_connect` (client) or :func:`quic_accept` (server); both return once
    the QUIC handshake completed and the driver runs in ``nursery``.

    Attributes:
        remote: the peer's (ip, port).
        bytes_sent, bytes_received: stream payload bytes (framing included).
        ping_interval_s: PING cadence (PING_INTERVAL_S keepalives; LIVENESS_PING_S on a watched path).
        last_ack_s: trio time the peer last acknowledged one of our PINGs (or the handshake
            completed): :meth:`silent_for_s` measures from it.
        generations: QUIC connections this transport has used (1 + raises of the datagram size).
    """

    def __init__(self, endpoint: UdpEndpoint, conn: QuicConnection, remote: Address):
        self.endpoint = endpoint
        self.remote = remote
        self.is_client = conn.configuration.is_client
        self.bytes_sent = 0
        self.bytes_received = 0
        self.connected = trio.Event()
        self.closed_reason: Optional[str] = None
        self._local_closed = False
        self._eof = False
        self._wake = trio.Event()
        self._readable = trio.Event()
        self._writable = trio.Event()
        self._send_lock = trio.Lock()
        self._next_ping_s = 0.0
        self._ping_uid = 0
        self.ping_interval_s = PING_INTERVAL_S
        self.last_ack_s: Optional[float] = None
        #: the smallest RTT sample of any generation (RFC 9002 §5.2 min_rtt: ack delay included, so
        #: an upper bound on the path's round trip), seconds; None before a sample
        self.min_rtt_s: Optional[float] = None
        #: RTT samples seen so far (each new `latest_rtt` reading; the liveness PINGs alone give two a
        #: second), how settled `min_rtt_s` is
        self.rtt_samples = 0
        self._backlog: list[tuple[bytes, Address]] = []
        self._sleep_scope: Optional[trio.CancelScope] = None
        self._gens: list[Generation] = []
        self.generations = 0
        first = self._add_gen(conn, conn.original_destination_connection_id)
        self._tx = self._rx = first
        self._target_bytes = int(conn.configuration.max_datagram_size)
        self._stall = StallMeter()

    # ---- generations ---------------------------------------------------------------------------
    @property
    def conn(self) -> QuicConnection:
        """The QUIC connection that carries what we send now."""
        return self._tx.conn

    @property
    def stream_id(self) -> int:
        return 0

    def _add_gen(self, conn: QuicConnection, odcid: bytes) -> Generation:
        g = Generation(self, conn, odcid, trio.current_time())
        self._gens.append(g)
        self.generations += 1
        self.endpoint.route_cid(conn.host_cid, g.on_datagram, g.on_datagrams)
        if not self.is_client:  # the Initial of a successor (a raised size) finds us by its DCID
            self.endpoint.route_cid(successor_dcid(g.odcid), self._on_successor_initial)
        return g

    def _after(self, g: Generation) -> Optional[Generation]:
        gens = self._gens
        i = gens.index(g) if g in gens else len(gens)
        return gens[i + 1] if i + 1 < len(gens) else None

    def _on_successor_initial(self, data: bytes, addr: Address) -> None:
        """Server: the first datagram of the client's next generation (proto_spec 07 §4a)."""
        dcid = quic_dcid(data)
        last = self._gens[-1]
        if dcid is None or dcid != successor_dcid(last.odcid) or self.closed_reason is not None:
            return
        conn = QuicConnection(configuration=configuration(is_client=False, datagram_bytes=self._target_bytes),
                              original_destination_connection_id=dcid)
        g = self._add_gen(conn, dcid)
        self.endpoint.route_cid(dcid, g.on_datagram)  # the client's retransmitted Initials
        g.on_datagram(data, addr)

    def _start_successor(self, n: int) -> None:
        """Client: open the next generation at ``n``-byte datagrams (the handshake runs in the driver)."""
        conn = QuicConnection(configuration=configuration(is_client=True, datagram_bytes=n))
        odcid = successor_dcid(self._gens[-1].odcid)
        conn._original_destination_connection_id = odcid  # qh3 2.1.0: read by connect()
        conn.connect(self.remote, now=trio.current_time())
        self._add_gen(conn, odcid)
        self._wake.set()

    def _hand_over(self) -> None:
        """Move sending to the next generation where the protocol allows it (module docstring)."""
        nxt = self._after(self._tx)
        if nxt is None or self._tx.fin_sent or self.closed_reason is not None:
            return
        old = self._tx
        if self.is_client and not nxt.connected or not self.is_client and not (old.fin_received and nxt.stream_seen):
            return
        try:
            if self.is_client:
                nxt.conn.send_stream_data(0, b"")  # opens stream 0 so the server may answer on it
            old.conn.send_stream_data(0, b"", end_stream=True)
        except QuicConnectionError as e:  # one of them closed under us: its termination says why
            self._broken(old if old.conn._close_event is not None else nxt, e)
            return
        old.fin_sent = True
        self._tx = nxt
        if not self.is_client:
            old.retired = True
        elif old.fin_received:
            self._retire(old)
        if self.is_client:
            size = datagram_bytes_of(nxt.conn)
            if self._target_bytes < size:
                cap_datagram_bytes(nxt.conn, self._target_bytes)
            elif self._target_bytes > size and self._after(nxt) is None:
                self._start_successor(self._target_bytes)  # raised again while this one connected
        self._stall.reset()
        self._writable.set()
        self._wake.set()

    def _retire(self, g: Generation) -> None:
        """Client: both directions of ``g`` ended at a hand-over; close it."""
        g.retired = True
        g.conn.close(error_code=0, reason_phrase=SUPERSEDED)
        self._wake.set()

    # ---- endpoint side -------------------------------------------------------------------------
    def _process_events(self, g: Generation) -> None:
        conn = g.conn
        while (ev := conn.next_event()) is not None:
            if isinstance(ev, qe.StreamDataReceived):
                if ev.stream_id != 0:
                    continue
                g.stream_seen = True
                if ev.data:
                    g.decoder.receive_data(ev.data)
                    self.bytes_received += len(ev.data)
                if ev.end_stream:
                    g.fin_received = True
                    if g.fin_sent and self.is_client and not g.retired and g is not self._tx:
                        self._retire(g)
                    self._hand_over()
                elif g is not self._tx and not self.is_client:
                    self._hand_over()  # a successor's stream 0 opened
                self._readable.set()
            elif isinstance(ev, qe.PingAcknowledged):
                self.last_ack_s = trio.current_time()
            elif isinstance(ev, qe.HandshakeCompleted):
                g.connected = True
                self.last_ack_s = trio.current_time()
                self.connected.set()
                if g is not self._tx:
                    self._hand_over()
            elif isinstance(ev, qe.ConnectionIdIssued):
                self.endpoint.route_cid(ev.connection_id, g.on_datagram, g.on_datagrams)
            elif isinstance(ev, qe.ConnectionTerminated):
                self._terminated(g, ev)
        core = conn._core
        rtt_s = core.latest_rtt if core is not None else None
        if rtt_s and rtt_s != g.last_rtt_s:  # a new sample: an ACK of an ack-eliciting packet arrived
            g.last_rtt_s = rtt_s
            self.rtt_samples += 1
            if self.min_rtt_s is None or rtt_s < self.min_rtt_s:
                self.min_rtt_s = rtt_s
        close = conn._close_event  # qh3 reports a peer's CONNECTION_CLOSE here, its event only after draining
        if close is not None and not g.terminated:
            if (close.error_code == 0 and close.frame_type is None and (g is self._rx or g is self._tx)
                    and not g.retired and close.reason_phrase != SUPERSEDED):
                # A clean close by the peer: the stream has ended (reads end now); the connection
                # drains for 3 PTOs (RFC 9000 §10.2.2) before it is over, as with aioquic
                self._eof = True
                self._readable.set()
            else:
                self._terminated(g, close)

    def _terminated(self, g: Generation, ev: qe.ConnectionTerminated) -> None:
        if g.terminated:
            return
        g.terminated = True
        if g.retired or ev.reason_phrase == SUPERSEDED:
            return  # handed over: expected
        if g is not self._tx and g is not self._rx and g in self._gens and self._tx in self._gens \
                and self._gens.index(g) > self._gens.index(self._tx):
            # a successor that never took over: keep the current generation and its size
            log.info("quic: a connection at %d-byte datagrams to %s:%d did not take over (%s)",
                     datagram_bytes_of(g.conn), self.remote[0], self.remote[1], ev.reason_phrase or ev.error_code)
            if self.is_client:
                self._target_bytes = datagram_bytes_of(self._tx.conn)
            return
        if ev.error_code == 0 and ev.frame_type is None:
            self._eof = True  # a NO_ERROR close by the application: a clean end of stream
        self.closed_reason = self.closed_reason or (
            f"the QUIC connection to {self.remote[0]}:{self.remote[1]} ended "
            f"(error {ev.error_code}{': ' + ev.reason_phrase if ev.reason_phrase else ''})")
        self._readable.set()
        self._writable.set()
        self.connected.set()

    def _broken(self, g: Generation, e: QuicConnectionError) -> None:
        """qh3 raised inside ``g``'s connection (its core refuses to go on): ``g`` ends there."""
        log.debug("quic: the connection to %s:%d failed inside qh3: %s", self.remote[0], self.remote[1], e)
        g.dead = True
        close = g.conn._close_event
        self._terminated(g, close if close is not None else
                         qe.ConnectionTerminated(e.error_code, e.frame_type, e.reason_phrase))

    def _transmit(self) -> None:
        """Send every datagram qh3 has ready now, in one burst and without yielding; what the
        kernel buffer cannot take waits in the backlog for :meth:`_flush`."""
        now = trio.current_time()
        send_many = self.endpoint.send_many_nowait
        backlog = self._backlog
        for g in self._gens:
            if g.dead:
                continue
            core = g.conn._core
            if core is None:
                continue
            out = []
            try:  # qh3's datagrams_to_send without its per-datagram logging hooks (no QUIC logger here)
                while (tr := core.poll_transmit(now)) is not None:
                    out.append((tr[0], tr[1]))
            except RuntimeError as e:  # what datagrams_to_send raises as QuicConnectionError
                self._broken(g, QuicConnectionError(1, None, str(e)))  # INTERNAL_ERROR
                continue
            if not out:
                continue
            if backlog:
                backlog.extend(out)  # keep the order
                continue
            sent = send_many(out)
            if sent < len(out):
                backlog.extend(out[sent:])
        if not backlog and self._unacked_bytes() < SEND_WINDOW_BYTES:
            self._writable.set()

    def _rearm(self) -> None:
        """After a transmit outside the driver: bring the sleeping driver's deadline forward to
        qh3's timer (loss detection, pacing), or wake the driver if it is not asleep or a
        backlog waits for the kernel buffer. Saves a driver pass per message sent."""
        scope = self._sleep_scope
        if scope is None or self._backlog:
            self._wake.set()
            return
        t = self._tx.conn.get_timer()
        if t is not None and t < scope.deadline:
            scope.deadline = t

    async def _flush(self) -> None:
        self._transmit()
        backlog = self._backlog
        while backlog:
            data, addr = backlog[0]
            await self.endpoint.sendto(data, addr)  # waits for room in the kernel buffer
            del backlog[0]
            del backlog[:self.endpoint.send_many_nowait(backlog)]
        if self._unacked_bytes() < SEND_WINDOW_BYTES:
            self._writable.set()

    def _unacked_bytes(self) -> int:
        """Stream bytes queued or in flight on the sending generation (qh3's gauges)."""
        conn = self._tx.conn
        core = conn._core
        if core is None:
            return 0
        return core.get_send_buffer_size(0) + core.bytes_in_flight

    def _next_timer(self) -> Optional[float]:
        timer = None
        for g in self._gens:
            t = None if g.dead else g.conn.get_timer()
            if t is not None and (timer is None or t < timer):
                timer = t
        return timer

    async def run(self) -> None:
        """Drive the connection(s) until the transport ends (run it in a nursery)."""
        try:
            while True:
                for g in self._gens:
                    self._process_events(g)
                await self._flush()
                now = trio.current_time()
                if self._drop_finished(now):
                    return
                timer = self._next_timer()
                if self.connected.is_set() and self.closed_reason is None:
                    if now >= self._next_ping_s:
                        self._ping_uid += 1
                        try:
                            self._tx.conn.send_ping(self._ping_uid)
                        except QuicConnectionError as e:
                            self._broken(self._tx, e)
                        self._next_ping_s = now + self.ping_interval_s
                        continue
                    timer = min(timer if timer is not None else float("inf"), self._next_ping_s)
                    pending = self._gens[-1]
                    if self.is_client and not pending.connected and not pending.terminated and pending is not self._tx:
                        timer = min(timer, pending.started_s + SUCCESSOR_TIMEOUT_S)
                with trio.move_on_at(timer if timer is not None else float("inf")) as scope:
                    self._sleep_scope = scope
                    await self._wake.wait()
                self._sleep_scope = None
                self._wake = trio.Event()
                now = trio.current_time()
                for g in self._gens:
                    t = None if g.dead else g.conn.get_timer()
                    if t is not None and now >= t:
                        try:
                            g.conn.handle_timer(now)
                        except QuicConnectionError as e:
                            self._broken(g, e)
        finally:
            for g in self._gens:
                self.endpoint.unroute(g.on_datagram)
            self.endpoint.unroute(self._on_successor_initial)
            self.closed_reason = self.closed_reason or "the QUIC driver stopped"
            self._readable.set()
            self._writable.set()
            self.connected.set()

    def _drop_finished(self, now: float) -> bool:
        """Forget generations that are over (terminated, or a successor past its time); True when
        the transport is closed and every generation is over (the driver's end)."""
        over = self.closed_reason is not None
        for g in list(self._gens):
            if (self.is_client and not g.connected and not g.terminated and g is not self._tx
                    and self.closed_reason is None and now >= g.started_s + SUCCESSOR_TIMEOUT_S):
                g.conn.close(error_code=0, reason_phrase=SUPERSEDED)
                self._terminated(g, qe.ConnectionTerminated(0, None, "the handshake did not finish"))
            ended = g.dead or g.conn._state.name == "TERMINATED" or (g.terminated and g.conn._core is None)
            over = over and ended
            if ended and g is not self._tx and g is not self._rx:
                self._gens.remove(g)
                self.endpoint.unroute(g.on_datagram)
        return over

    # ---- liveness and datagram size (proto_spec 07 §4a, §7a) --------------------------------------
    def watch(self, ping_interval_s: float = LIVENESS_PING_S) -> None:
        """PING every ``ping_interval_s`` from now on, so :meth:`silent_for_s` stays small on a live path."""
        self.ping_interval_s = ping_interval_s
        self._next_ping_s = min(self._next_ping_s, trio.current_time() + ping_interval_s)
        self._wake.set()

    @property
    def datagram_bytes(self) -> int:
        """The largest UDP payload this side sends from now on (a raise is in effect once its
        successor connection has taken over, one round trip later)."""
        return self._target_bytes

    @property
    def smoothed_rtt_s(self) -> float:
        """The sending connection's smoothed RTT (RFC 9002 §5.3), 0.0 before a sample."""
        core = self._tx.conn._core
        return (core.smoothed_rtt or 0.0) if core is not None else 0.0

    def set_datagram_bytes(self, n: int) -> None:
        """Send datagrams of at most ``n`` bytes from now on (1,200 .. 16,383; proto_spec 07 §4a).

        Lowering takes effect at once, and data already lost in larger datagrams is sent again in
        datagrams of the new size (RFC 9000 §13.3). Raising opens a successor connection at ``n``
        bytes (the client's side; see the module docstring); the server's own datagrams (mostly
        acknowledgements) keep their size.
        """
        n = max(START_DATAGRAM_BYTES, min(int(n), MAX_SETTABLE_DATAGRAM_BYTES))
        self._target_bytes = n
        tx = self._tx
        current = datagram_bytes_of(tx.conn)
        if n < current and cap_datagram_bytes(tx.conn, n) and self.connected.is_set() and self.closed_reason is None:
            # Shrinking after a black hole: an ack-eliciting PING now (small) gets the larger
            # packets in flight declared lost and sent again sooner (RFC 9002 §6.1.2), and the
            # smaller size gets a full SILENCE window of its own (the PINGs were riding in the
            # lost large packets too).
            self._ping_uid += 1
            tx.conn.send_ping(self._ping_uid)
            self.last_ack_s = trio.current_time()
        pending = self._gens[-1] if self._gens[-1] is not tx else None
        if pending is not None and not pending.terminated and n != datagram_bytes_of(pending.conn):
            if n < datagram_bytes_of(pending.conn):
                cap_datagram_bytes(pending.conn, n)  # no-op before its handshake: _hand_over caps it
        elif self.is_client and n > current and pending is None and self.connected.is_set() and self.closed_reason is None:
            self._start_successor(n)
        self._stall.reset()  # a stall is measured anew at the new size
        self._wake.set()

    def stalled_for_s(self, now: float) -> float:
        """Seconds full-sized datagrams have gone unacknowledged while some were outstanding or
        lost (0 when none are; :class:`kafilad.net.quic_gen.StallMeter`). With PINGs still
        acknowledged (:meth:`silent_for_s` small) a stall of STALL_S means datagrams of the current
        size are black-holed: too large for the path (RFC 8899 §4.2)."""
        return self._stall.stalled_for_s(self._tx.conn, now)

    @property
    def ended_cleanly(self) -> bool:
        """The peer ended the stream, or closed the connection with error 0 (a deliberate close)."""
        return self._eof

    def silent_for_s(self, now: float) -> float:
        """Seconds since the peer last acknowledged a PING of ours (0 before the handshake completed).

        On a path watched with :meth:`watch`, more than a few PING intervals means that datagrams
        stopped crossing it in at least one direction (every PING is ack-eliciting and a lost one
        is sent again, RFC 9000 §13.3).
        """
        return 0.0 if self.last_ack_s is None else max(0.0, now - self.last_ack_s)

    # ---- MessageTransport ----------------------------------------------------------------------
    async def send_message(self, data: bytes) -> None:
        framed = encode_message(data)  # LocalProtocolError over 65,535 bytes
        # trio's pattern for an operation that completes: raise a pending cancellation first, then
        # yield once after the data left (no scheduler pass in between on an uncontended lock).
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            while True:
                if self._local_closed:
                    raise trio.ClosedResourceError("this QUIC transport was closed")
                if self.closed_reason is not None:
                    raise trio.BrokenResourceError(self.closed_reason)
                if self._eof or (self._unacked_bytes() < SEND_WINDOW_BYTES and not self._tx.fin_sent):
                    break
                self._writable = trio.Event()
                await self._writable.wait()
            if not self._eof:  # else the peer closed cleanly and the connection drains: nothing goes out
                tx = self._tx
                try:
                    tx.conn.send_stream_data(0, framed)
                except QuicConnectionError as e:  # qh3 closed it before we saw the event
                    self._broken(tx, e)
                    raise trio.BrokenResourceError(self.closed_reason or str(e)) from None
                self.bytes_sent += len(framed)
                self._transmit()  # as aioquic's asyncio protocol does: the data leaves before we yield
                self._rearm()
        finally:
            self._send_lock.release()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_message(self) -> bytes:
        while True:
            if self._local_closed:
                raise trio.ClosedResourceError("this QUIC transport was closed")
            rx = self._rx
            msg = rx.decoder.next_message()
            if msg is not None:
                await trio.lowlevel.checkpoint()
                return msg
            if rx.fin_received:
                try:
                    rx.decoder.receive_eof()
                except RemoteProtocolError as exc:  # proto_spec 01 §5.1: an end inside a message is a loss
                    raise trio.BrokenResourceError(str(exc)) from None
                nxt = self._after(rx)
                if nxt is not None:  # handed over: read the next generation
                    self._rx = nxt
                    continue
                raise trio.EndOfChannel
            if self._eof:
                raise trio.EndOfChannel
            if self.closed_reason is not None:
                raise trio.BrokenResourceError(self.closed_reason)
            self._readable = trio.Event()
            await self._readable.wait()

    async def aclose(self) -> None:
        self._close_locally()
        await trio.lowlevel.checkpoint()

    def close_now(self) -> None:
        """Close as :meth:`aclose` does and send the CONNECTION_CLOSE at once, without waiting for
        the driver (RFC 9000 §10.2): for a scope that is ending, whose driver may never run again.
        The peer sees a clean end of stream."""
        self._close_locally()
        try:
            self._transmit()  # what the kernel buffer cannot take now is lost, as any datagram may be
        except Exception:  # closing is best effort: the connection is gone either way
            log.debug("quic: could not send the close to %s", self.remote, exc_info=True)

    def _close_locally(self) -> None:
        if not self._local_closed:
            self._local_closed = True
            if self.closed_reason is None:
                tx = self._tx
                if not tx.fin_sent and tx.stream_seen and not tx.terminated and not tx.dead:
                    # qh3 drops unsent stream data at close(): the FIN leaves first, so the peer
                    # reads a clean end of stream before it learns the connection closed
                    try:
                        tx.conn.send_stream_data(0, b"", end_stream=True)
                        tx.fin_sent = True
                        self._transmit()
                    except QuicConnectionError:
                        pass  # the close below says the same
                for g in self._gens:
                    if not g.terminated and not g.dead:
                        try:
                            g.conn.close(error_code=0, reason_phrase="closed")
                        except QuicConnectionError:  # its core gave up already: nothing to say
                            g.dead = True
                self.closed_reason = "closed locally"
                self._wake.set()
        self._readable.set()
        self._writable.set()

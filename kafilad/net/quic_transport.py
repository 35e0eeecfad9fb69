"""QUIC on the daemon's UDP endpoint: aioquic's sans-IO QuicConnection driven by trio (DESIGN §4; proto_spec 07 §4).

One QUIC connection per direct ring edge. The edge's sender is the QUIC client, its receiver the
server (fixed roles, never both clients). The connection carries one bidirectional stream (id 0,
opened by the client) framed as proto_spec 01 §5.1 (u16 big-endian length + message), so it is a
:class:`kafilad.net.transport.MessageTransport` and the Noise channel of kafilad/node/link.py runs
inside it unchanged. TLS certificates are self-signed, generated per process and not checked:
Noise authenticates the peer (DESIGN §4 "QUIC").

The driver (:meth:`QuicTransport.run`) is the aioquic asyncio protocol's loop in trio: feed
datagrams as the endpoint delivers them, process events, flush ``datagrams_to_send(now)`` and
re-arm ``get_timer()``. For latency, as in aioquic's asyncio protocol, work happens where it
arises rather than one scheduler pass later: events are processed as each datagram arrives (the
endpoint reads bursts, so the driver wakes once per burst), ``send_message`` transmits at once
and only moves the sleeping driver's deadline, and a pending ACK rides on outgoing stream data.
Datagrams start at 1,200 bytes on a network path (RFC 9000 §14.1; the edge's sender then raises
the size as path MTU probes confirm it, :meth:`QuicTransport.set_datagram_bytes`, proto_spec 07
§4a) and are 16,000 bytes toward this host (:func:`path_datagram_bytes`).
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import logging
import socket
import ssl
from typing import Optional

import trio
from aioquic import tls
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from kafilad.errors import RemoteProtocolError
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.proto.quic_header import quic_dcid
from kafilad.proto.transport_messages import MessageDecoder, encode_message

log = logging.getLogger("kafilad.quic")

Address = tuple[str, int]

ALPN = "kafila/1"
#: Datagram size of a network path until path MTU probes raise it: the size every QUIC path must
#: carry (RFC 9000 §14.1), so a handshake never depends on fragments (proto_spec 07 §4a).
START_DATAGRAM_BYTES = 1200
#: An Internet-sized datagram (fits a 1500-byte MTU with IPv6 + UDP headers and some tunnel
#: overhead); benchmarks use it on loopback (scripts/bench_paths.py).
MAX_DATAGRAM_BYTES = 1350
#: Stream data unacknowledged this long while PINGs are acknowledged: the datagram size is
#: black-holed on the path (RFC 8899 §4.2); see :meth:`QuicTransport.stalled_for_s`.
STALL_S = 2.0
#: Datagram size toward a peer on this host (loopback, or one of our own addresses), where the
#: path is the loopback interface (MTU 65,536) and nothing on it fragments or drops large
#: datagrams. Capped below 16,383: aioquic writes packet and STREAM frame lengths as 2-byte varints.
SAME_HOST_DATAGRAM_BYTES = 16000
#: QUIC idle timeout; keepalive PINGs go out well before it (aioquic closes silently after it).
IDLE_TIMEOUT_S = 60.0
PING_INTERVAL_S = 15.0
#: PING interval of a watched path (a ring edge, proto_spec 07 §7a): each acknowledged PING
#: proves the path carries datagrams both ways, so silence is seen within a few seconds.
LIVENESS_PING_S = 0.5
#: Unacknowledged stream bytes a sender may queue before send_message waits (backpressure).
SEND_WINDOW_BYTES = 4 * 1024 * 1024
#: QUIC flow-control windows (aioquic's 1 MiB default stalls a fast sender between MAX_DATA updates).
FLOW_WINDOW_BYTES = 16 * 1024 * 1024

_CERT: Optional[tuple] = None


def self_signed_certificate() -> tuple:
    """(certificate, private_key) for aioquic: EC P-256, self-signed, generated once per process."""
    global _CERT
    if _CERT is None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafila")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=30))
                .sign(key, hashes.SHA256()))
        _CERT = (cert, key)
    return _CERT


def path_datagram_bytes(remote: Address) -> int:
    """QUIC datagram size for the path to ``remote`` (ip, port) (proto_spec 07 §4).

    SAME_HOST_DATAGRAM_BYTES when ``remote`` is a loopback address or an address of this host (the
    kernel picks it as its own source toward it, so the path never leaves the loopback
    interface); START_DATAGRAM_BYTES otherwise, since an interface's MTU says nothing about the
    rest of an Internet path (probes raise it later). Asks the kernel's routing table; sends nothing.
    """
    try:
        ip = ipaddress.ip_address(remote[0])
    except ValueError:
        return START_DATAGRAM_BYTES
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return SAME_HOST_DATAGRAM_BYTES
    if ip.is_unspecified or ip.is_multicast:
        return START_DATAGRAM_BYTES
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((str(ip), int(remote[1]) or 9))
            local = ipaddress.ip_address(s.getsockname()[0].split("%")[0])
    except (OSError, ValueError):
        return START_DATAGRAM_BYTES
    return SAME_HOST_DATAGRAM_BYTES if local == ip else START_DATAGRAM_BYTES


def configuration(*, is_client: bool, datagram_bytes: int = START_DATAGRAM_BYTES) -> QuicConfiguration:
    """aioquic configuration of one edge (proto_spec 07 §4); ``datagram_bytes`` is the largest
    UDP payload this side sends (1200 .. 16,383)."""
    cfg = QuicConfiguration(is_client=is_client, alpn_protocols=[ALPN], idle_timeout=IDLE_TIMEOUT_S,
                            max_datagram_size=datagram_bytes, verify_mode=ssl.CERT_NONE,
                            server_name="kafila", max_data=FLOW_WINDOW_BYTES, max_stream_data=FLOW_WINDOW_BYTES)
    if not is_client:
        cfg.certificate, cfg.private_key = self_signed_certificate()
    return cfg


class QuicTransport:
    """A MessageTransport over stream 0 of one QUIC connection on a shared :class:`UdpEndpoint`.

    Make it with :func:`quic_connect` (client) or :func:`quic_accept` (server); both return once
    the QUIC handshake completed and the driver runs in ``nursery``.

    Attributes:
        remote: the peer's (ip, port).
        bytes_sent, bytes_received: stream payload bytes (framing included).
        ping_interval_s: PING cadence (PING_INTERVAL_S keepalives; LIVENESS_PING_S on a watched path).
        datagram_bytes: the largest UDP payload this side sends now (:meth:`set_datagram_bytes`).
        last_ack_s: trio time the peer last acknowledged one of our PINGs (or the handshake
            completed): :meth:`silent_for_s` measures from it.
    """

    def __init__(self, endpoint: UdpEndpoint, conn: QuicConnection, remote: Address):
        self.endpoint = endpoint
        self.conn = conn
        self.remote = remote
        self.is_client = conn.configuration.is_client
        self.stream_id = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.connected = trio.Event()
        self.closed_reason: Optional[str] = None
        self._local_closed = False
        self._eof = False
        self._decoder = MessageDecoder()  # proto_spec 01 §5.1 on stream 0
        self._wake = trio.Event()
        self._readable = trio.Event()
        self._writable = trio.Event()
        self._send_lock = trio.Lock()
        self._next_ping_s = 0.0
        self._ping_uid = 0
        self.ping_interval_s = PING_INTERVAL_S
        self.last_ack_s: Optional[float] = None
        self._acked_offset = 0           # stream bytes acknowledged from the start, as last seen
        self._progress_s: Optional[float] = None  # when that offset last moved (or nothing was unacked)
        self._data_queued = False
        self._backlog: collections.deque[tuple[bytes, Address]] = collections.deque()
        self._sleep_scope: Optional[trio.CancelScope] = None
        endpoint.route_cid(conn.host_cid, self._on_datagram)

    # ---- endpoint side -------------------------------------------------------------------------
    def _on_datagram(self, data: bytes, addr: Address) -> None:
        self.conn.receive_datagram(data, addr, trio.current_time())
        self._process_events()  # readers wake now, not one scheduler pass later via the driver
        self._wake.set()

    def _process_events(self) -> None:
        while (ev := self.conn.next_event()) is not None:
            if isinstance(ev, qe.HandshakeCompleted):
                self.last_ack_s = trio.current_time()
                self.connected.set()
            elif isinstance(ev, qe.PingAcknowledged):
                self.last_ack_s = trio.current_time()
            elif isinstance(ev, qe.ConnectionIdIssued):
                self.endpoint.route_cid(ev.connection_id, self._on_datagram)
            elif isinstance(ev, qe.StreamDataReceived) and ev.stream_id == self.stream_id:
                self._decoder.receive_data(ev.data)
                self.bytes_received += len(ev.data)
                if ev.end_stream:
                    self._eof = True
                self._readable.set()
            elif isinstance(ev, qe.ConnectionTerminated):
                if ev.error_code == 0 and ev.frame_type is None:
                    self._eof = True  # a NO_ERROR close by the application: a clean end of stream
                self.closed_reason = self.closed_reason or (
                    f"the QUIC connection to {self.remote[0]}:{self.remote[1]} ended "
                    f"(error {ev.error_code}{': ' + ev.reason_phrase if ev.reason_phrase else ''})")
                self._readable.set()
                self._writable.set()
                self.connected.set()

    def _transmit(self) -> None:
        """Send every datagram aioquic has ready now, in one burst and without yielding; what the
        kernel buffer cannot take waits in the backlog for :meth:`_flush`."""
        now = trio.current_time()
        if self._data_queued:
            self._data_queued = False
            # A pending ACK rides on the stream packets about to go out (RFC 9000 §13.2.1) rather
            # than leaving in its own datagram when aioquic's ACK delay expires; aioquic only
            # bundles ACKs that are already due.
            space = self.conn._spaces.get(tls.Epoch.ONE_RTT)
            if space is not None and space.ack_at is not None and space.ack_at > now:
                space.ack_at = now
        out = self.conn.datagrams_to_send(now)
        if self._backlog:
            self._backlog.extend(out)  # keep the order
        else:
            send = self.endpoint.send_nowait
            for i, (data, addr) in enumerate(out):
                if not send(data, addr):
                    self._backlog.extend(out[i:])
                    break
        if not self._backlog and self._unacked_bytes() < SEND_WINDOW_BYTES:
            self._writable.set()

    def _rearm(self) -> None:
        """After a transmit outside the driver: bring the sleeping driver's deadline forward to
        aioquic's timer (loss detection, pacing), or wake the driver if it is not asleep or a
        backlog waits for the kernel buffer. Saves a driver pass per message sent."""
        scope = self._sleep_scope
        if scope is None or self._backlog:
            self._wake.set()
            return
        t = self.conn.get_timer()
        if t is not None and t < scope.deadline:
            scope.deadline = t

    async def _flush(self) -> None:
        self._transmit()
        while self._backlog:
            data, addr = self._backlog[0]
            await self.endpoint.sendto(data, addr)  # waits for room in the kernel buffer
            self._backlog.popleft()
        if self._unacked_bytes() < SEND_WINDOW_BYTES:
            self._writable.set()

    def _unacked_bytes(self) -> int:
        stream = self.conn._streams.get(self.stream_id)  # aioquic exposes no public gauge for this
        if stream is None:
            return 0
        sender = stream.sender
        return sender._buffer_stop - sender._buffer_start

    async def run(self) -> None:
        """Drive the connection until it terminates (run it in a nursery)."""
        try:
            while True:
                self._process_events()
                await self._flush()
                if self.closed_reason is not None and self.conn._state.name in ("TERMINATED",):
                    return
                timer = self.conn.get_timer()
                now = trio.current_time()
                if self.connected.is_set() and self.closed_reason is None:
                    if now >= self._next_ping_s:
                        self._ping_uid += 1
                        self.conn.send_ping(self._ping_uid)
                        self._next_ping_s = now + self.ping_interval_s
                        continue
                    timer = min(timer if timer is not None else float("inf"), self._next_ping_s)
                with trio.move_on_at(timer if timer is not None else float("inf")) as scope:
                    self._sleep_scope = scope
                    await self._wake.wait()
                self._sleep_scope = None
                self._wake = trio.Event()
                now = trio.current_time()
                t = self.conn.get_timer()
                if t is not None and now >= t:
                    self.conn.handle_timer(now)
        finally:
            self.endpoint.unroute(self._on_datagram)
            self.closed_reason = self.closed_reason or "the QUIC driver stopped"
            self._readable.set()
            self._writable.set()
            self.connected.set()

    # ---- liveness (proto_spec 07 §7a) ----------------------------------------------------------
    def watch(self, ping_interval_s: float = LIVENESS_PING_S) -> None:
        """PING every ``ping_interval_s`` from now on, so :meth:`silent_for_s` stays small on a live path."""
        self.ping_interval_s = ping_interval_s
        self._next_ping_s = min(self._next_ping_s, trio.current_time() + ping_interval_s)
        self._wake.set()

    @property
    def datagram_bytes(self) -> int:
        return self.conn._max_datagram_size

    def set_datagram_bytes(self, n: int) -> None:
        """Send datagrams of at most ``n`` bytes from now on (1,200 .. 16,383; proto_spec 07 §4a).

        aioquic fixes the size at creation; this sets it where its packet builder, pacer and
        congestion controller read it (aioquic==1.7.2 internals, pinned). Data already lost in
        larger datagrams is sent again in datagrams of the new size (RFC 9000 §13.3).
        """
        n = max(1200, min(int(n), 16383))
        conn = self.conn
        if n < conn._max_datagram_size and self.connected.is_set() and self.closed_reason is None:
            # Shrinking after a black hole: probe at once (a PTO probe, now small) so that the
            # larger packets in flight are declared lost and sent again sooner (RFC 9002 §6.2.4),
            # and give the smaller size a full SILENCE window of its own (the PINGs were riding
            # in the lost large packets too).
            conn._loss._pto_count = 0
            conn._send_probe()
            self.last_ack_s = trio.current_time()
        conn._max_datagram_size = n
        conn._loss._pacer._max_datagram_size = n
        cc = conn._loss._cc
        for attr in ("_max_datagram_size", "additive_increase_factor"):
            if hasattr(cc, attr):
                setattr(cc, attr, n)
        self._progress_s = None  # a stall is measured anew at the new size
        self._wake.set()

    def stalled_for_s(self, now: float) -> float:
        """Seconds stream data has waited for an acknowledgement without the acknowledged offset
        moving (0 when nothing is unacknowledged). With PINGs still acknowledged
        (:meth:`silent_for_s` small) a stall of STALL_S means the data's datagrams are black-holed:
        too large for the path (RFC 8899 §4.2)."""
        stream = self.conn._streams.get(self.stream_id)
        acked = stream.sender._buffer_start if stream is not None else 0
        if acked != self._acked_offset or self._unacked_bytes() == 0 or self._progress_s is None:
            self._acked_offset, self._progress_s = acked, now
            return 0.0
        return now - self._progress_s

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
                if self._unacked_bytes() < SEND_WINDOW_BYTES:
                    break
                self._writable = trio.Event()
                await self._writable.wait()
            self.conn.send_stream_data(self.stream_id, framed)
            self.bytes_sent += len(framed)
            self._data_queued = True
            self._transmit()  # as aioquic's asyncio protocol does: the data leaves before we yield
            self._rearm()
        finally:
            self._send_lock.release()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_message(self) -> bytes:
        while True:
            if self._local_closed:
                raise trio.ClosedResourceError("this QUIC transport was closed")
            msg = self._decoder.next_message()
            if msg is not None:
                await trio.lowlevel.checkpoint()
                return msg
            if self._eof:
                try:
                    self._decoder.receive_eof()
                except RemoteProtocolError as exc:  # proto_spec 01 §5.1: an end inside a message is a loss
                    raise trio.BrokenResourceError(str(exc)) from None
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
                try:
                    self.conn.send_stream_data(self.stream_id, b"", end_stream=True)
                except Exception:  # the stream may be closed already: the connection close follows anyway
                    pass
                self.conn.close(error_code=0, reason_phrase="closed")
                self.closed_reason = "closed locally"
                self._wake.set()
        self._readable.set()
        self._writable.set()


async def quic_connect(endpoint: UdpEndpoint, remote: Address, nursery, *, timeout_s: float = 10.0,
                       datagram_bytes: Optional[int] = None) -> QuicTransport:
    """Open a QUIC connection to ``remote`` as client and its stream 0.

    ``datagram_bytes`` overrides :func:`path_datagram_bytes` (benchmarks measure Internet-sized
    datagrams on loopback with it).

    Raises:
        trio.BrokenResourceError: the handshake failed or did not finish in ``timeout_s``.
    """
    size = datagram_bytes or path_datagram_bytes(remote)
    conn = QuicConnection(configuration=configuration(is_client=True, datagram_bytes=size))
    conn.connect(remote, now=trio.current_time())
    t = QuicTransport(endpoint, conn, remote)
    nursery.start_soon(t.run)
    return await _established(t, timeout_s)


async def quic_accept(endpoint: UdpEndpoint, remote: Address, nursery, *, timeout_s: float = 10.0,
                      datagram_bytes: Optional[int] = None) -> QuicTransport:
    """Wait for a QUIC client at ``remote`` (an address the edge's checks verified) and accept it.

    ``datagram_bytes`` as for :func:`quic_connect`.

    Raises:
        trio.BrokenResourceError: no handshake completed within ``timeout_s``.
    """
    got: dict = {}
    arrived = trio.Event()
    size = datagram_bytes or path_datagram_bytes(remote)

    def on_initial(data: bytes, addr: Address) -> None:
        if "t" in got:
            got["t"]._on_datagram(data, addr)
            return
        dcid = quic_dcid(data)  # a long-header Initial: the DCID the client chose
        if dcid is None:
            return
        conn = QuicConnection(configuration=configuration(is_client=False, datagram_bytes=size),
                              original_destination_connection_id=dcid)
        t = QuicTransport(endpoint, conn, addr)
        endpoint.route_cid(dcid, t._on_datagram)
        got["t"] = t
        t._on_datagram(data, addr)
        arrived.set()

    endpoint.expect_quic_client(remote, on_initial)
    try:
        with trio.move_on_after(timeout_s):
            await arrived.wait()
    finally:
        endpoint.cancel_expectation(remote)
    if "t" not in got:
        raise trio.BrokenResourceError(f"no QUIC client arrived from {remote[0]}:{remote[1]} within {timeout_s:g} s")
    t = got["t"]
    nursery.start_soon(t.run)
    return await _established(t, timeout_s)


async def _established(t: QuicTransport, timeout_s: float) -> QuicTransport:
    with trio.move_on_after(timeout_s):
        await t.connected.wait()
    if t.closed_reason is not None or not t.connected.is_set():
        reason = t.closed_reason or f"the QUIC handshake with {t.remote[0]}:{t.remote[1]} did not finish in {timeout_s:g} s"
        await t.aclose()
        raise trio.BrokenResourceError(reason)
    if t.is_client:
        t.stream_id = t.conn.get_next_available_stream_id()
        t.conn.send_stream_data(t.stream_id, b"")  # opens stream 0 so the server sees it at once
        t._wake.set()
    return t


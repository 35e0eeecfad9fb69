"""One QUIC connection of a :class:`kafilad.net.quic_transport.QuicTransport` (a generation of its
stream 0; a raised datagram size starts the next one), and the transport's black-hole gauge
(proto_spec 07 §4a; RFC 8899 §4.2).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import trio
from qh3.quic.connection import QuicConnection, QuicConnectionError

from kafilad.net.quic_config import START_DATAGRAM_BYTES, datagram_bytes_of
from kafilad.proto.transport_messages import MessageDecoder

if TYPE_CHECKING:
    from kafilad.net.quic_transport import QuicTransport

Address = tuple[str, int]

#: Reason phrase of a generation closed after its stream was handed over (not an end of the link).
SUPERSEDED = "superseded"


class _QuietPeerClose(logging.Filter):
    """qh3 logs every CONNECTION_CLOSE from the peer as a warning; an application close with
    NO_ERROR (ours at every hand-over and link close) is routine, and its reason reaches
    :attr:`QuicTransport.closed_reason` anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        native = args[0] if args and isinstance(args[0], tuple) else ()
        return not (str(record.msg).startswith("Native peer close") and len(native) > 2 and native[2] == 0)


logging.getLogger("quic").addFilter(_QuietPeerClose())


class Generation:
    """One QUIC connection of a transport: a generation of its stream 0 (kafilad/net/quic_transport.py docstring).

    Attributes:
        conn: the qh3 connection. odcid: its original destination connection id.
        decoder: proto_spec 01 §5.1 messages read from its stream 0.
        fin_received / fin_sent: stream 0 ended by the peer / by us.
        stream_seen: the peer's stream 0 exists here (a server may send on it).
        retired: handed over both ways; its termination is expected.
    """

    __slots__ = ("t", "conn", "odcid", "decoder", "connected", "fin_received", "fin_sent", "stream_seen",
                 "retired", "terminated", "dead", "started_s", "last_rtt_s")

    def __init__(self, t: "QuicTransport", conn: QuicConnection, odcid: bytes, now: float):
        self.t, self.conn, self.odcid = t, conn, bytes(odcid)
        self.decoder = MessageDecoder()
        self.connected = self.fin_received = self.fin_sent = self.retired = self.terminated = self.dead = False
        self.stream_seen = conn.configuration.is_client
        self.started_s = now
        self.last_rtt_s: Optional[float] = None  # the connection's latest RTT sample seen (QuicTransport.min_rtt_s)

    def on_datagram(self, data: bytes, addr: Address) -> None:
        if self.dead:
            return
        try:
            self.conn.receive_datagram(data, addr, trio.current_time())
        except QuicConnectionError as e:
            self.t._broken(self, e)
        self.t._process_events(self)  # readers wake now, not one scheduler pass later via the driver
        self.t._wake.set()

    def on_datagrams(self, datagrams: list[bytes], addr: Address) -> None:
        """A burst of short-header datagrams (UdpEndpoint batch route): one qh3 call for all."""
        if self.dead:
            return
        try:
            self.conn.receive_many_datagrams(datagrams, addr, trio.current_time())
        except QuicConnectionError as e:
            self.t._broken(self, e)
        self.t._process_events(self)
        self.t._wake.set()


class StallMeter:
    """How long full-sized datagrams have gone unacknowledged on one connection.

    qh3 reports packets, not stream offsets: a "full-sized" packet is one above
    min(1,200, size - 100) bytes, so PINGs and acknowledgements never count. The sender made
    progress when more of the full-sized packets seen last time left flight than packets were
    declared lost meanwhile; the connection is idle when none is outstanding, none was lost and
    nothing waits to be sent.
    """

    def __init__(self) -> None:
        self._big_seen: set[int] = set()
        self._loss_seen = 0
        self._progress_s: Optional[float] = None

    def reset(self) -> None:
        """Measure anew (a new datagram size, or a new connection)."""
        self._progress_s = None

    def stalled_for_s(self, conn: QuicConnection, now: float) -> float:
        """Seconds without progress on ``conn`` at ``now`` (0.0 when idle or progressing)."""
        core = conn._core
        if core is None:
            return 0.0
        big = min(START_DATAGRAM_BYTES, datagram_bytes_of(conn) - 100)
        out = {pn for pn, size, _ in core.outstanding_application_packets if size > big}
        lost = core.loss_total
        left = sum(1 for pn in self._big_seen if pn not in out)
        progressed = left > lost - self._loss_seen
        idle = not out and lost == self._loss_seen and core.get_send_buffer_size(0) == 0
        self._big_seen, self._loss_seen = out, lost
        if progressed or idle or self._progress_s is None:
            self._progress_s = now
            return 0.0
        return now - self._progress_s

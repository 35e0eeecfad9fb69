"""Opening a :class:`kafilad.net.quic_transport.QuicTransport` on a verified path: as the edge's
sender (QUIC client, :func:`quic_connect`) or its receiver (server, :func:`quic_accept`), each
waiting for the handshake and stream 0 (proto_spec 07 §4).
"""

from __future__ import annotations

from typing import Optional

import trio
from qh3.quic.connection import QuicConnection, QuicConnectionError

from kafilad.net.quic_config import configuration, path_datagram_bytes
from kafilad.net.quic_transport import Address, QuicTransport
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.proto.quic_header import quic_dcid


async def quic_connect(endpoint: UdpEndpoint, remote: Address, nursery, *, timeout_s: float = 10.0,
                       datagram_bytes: Optional[int] = None, odcid: Optional[bytes] = None) -> QuicTransport:
    """Open a QUIC connection to ``remote`` as client and its stream 0.

    ``datagram_bytes`` overrides :func:`path_datagram_bytes` (benchmarks measure Internet-sized
    datagrams on loopback with it). ``odcid``: the Initial's DCID (quic_config.initial_dcid, so the
    receiver knows this connection from any other); random if None.

    Raises:
        trio.BrokenResourceError: the handshake failed or did not finish in ``timeout_s``.
    """
    size = datagram_bytes or path_datagram_bytes(remote)
    conn = QuicConnection(configuration=configuration(is_client=True, datagram_bytes=size))
    if odcid is not None:
        conn._original_destination_connection_id = bytes(odcid)  # qh3 2.1.0: read by connect()
    conn.connect(remote, now=trio.current_time())
    t = QuicTransport(endpoint, conn, remote)
    nursery.start_soon(t.run)
    return await _established(t, timeout_s)


async def quic_accept(endpoint: UdpEndpoint, remote: Address, nursery, *, timeout_s: float = 10.0,
                      datagram_bytes: Optional[int] = None, odcid: Optional[bytes] = None) -> QuicTransport:
    """Wait for a QUIC client at ``remote`` (an address the edge's checks verified) and accept it.

    ``datagram_bytes`` as for :func:`quic_connect`. ``odcid``: accept only a connection whose Initial
    carries this DCID (the client's ``odcid``); long-header datagrams from ``remote`` with any
    other unknown DCID (an earlier connection's, e.g. a closing one's CONNECTION_CLOSE) are
    ignored. None: the first one from ``remote`` is taken.

    Raises:
        trio.BrokenResourceError: no handshake completed within ``timeout_s``.
    """
    got: dict = {}
    arrived = trio.Event()
    size = datagram_bytes or path_datagram_bytes(remote)

    def on_initial(data: bytes, addr: Address) -> None:
        if "t" in got:
            got["t"]._gens[0].on_datagram(data, addr)
            return
        dcid = quic_dcid(data)  # a long-header Initial: the DCID the client chose
        if dcid is None or (odcid is not None and dcid != odcid):
            return  # not this attempt's connection (proto_spec 07 §4)
        conn = QuicConnection(configuration=configuration(is_client=False, datagram_bytes=size),
                              original_destination_connection_id=dcid)
        t = QuicTransport(endpoint, conn, addr)
        first = t._gens[0]
        endpoint.route_cid(dcid, first.on_datagram)
        got["t"] = t
        first.on_datagram(data, addr)
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
        try:
            t.conn.send_stream_data(0, b"")  # opens stream 0 so the server sees it at once
        except QuicConnectionError as e:
            await t.aclose()
            raise trio.BrokenResourceError(f"the QUIC connection to {t.remote[0]}:{t.remote[1]} failed: {e}") from None
        t._wake.set()
    return t

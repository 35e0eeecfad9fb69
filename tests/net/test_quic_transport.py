"""QUIC (qh3 sans-IO driven by trio) on the shared UDP endpoint, with Noise inside (kafilad.net.quic_transport)."""

from __future__ import annotations

import os

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import LocalProtocolError
from kafilad.net.quic_open import quic_accept, quic_connect
from kafilad.net.quic_transport import (MAX_DATAGRAM_BYTES, SAME_HOST_DATAGRAM_BYTES, START_DATAGRAM_BYTES,
                                        QuicTransport, path_datagram_bytes)
from kafilad.net.udp_endpoint import UdpEndpoint
from kafilad.node.paths.link import secure_link
from kafilad.proto.noise import generate_keypair


async def connected_pair(nursery, a: UdpEndpoint, b: UdpEndpoint, **kw) -> tuple[QuicTransport, QuicTransport]:
    out = {}

    async def server():
        out["s"] = await quic_accept(b, a.local_address, nursery, **kw)

    async with trio.open_nursery() as inner:
        inner.start_soon(server)
        out["c"] = await quic_connect(a, b.local_address, nursery, **kw)
    return out["c"], out["s"]


def own_address() -> str | None:
    """This host's address toward a documentation network (connecting a UDP socket sends nothing)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("203.0.113.9", 9))
            return s.getsockname()[0]
    except OSError:
        return None


def test_datagram_size_is_large_only_toward_this_host():
    assert SAME_HOST_DATAGRAM_BYTES < 16383 < SAME_HOST_DATAGRAM_BYTES * 2  # QUIC's 2-byte length varints
    assert path_datagram_bytes(("127.0.0.1", 4000)) == SAME_HOST_DATAGRAM_BYTES
    assert path_datagram_bytes(("127.8.9.10", 4000)) == SAME_HOST_DATAGRAM_BYTES
    assert path_datagram_bytes(("::1", 4000)) == SAME_HOST_DATAGRAM_BYTES
    assert path_datagram_bytes(("::ffff:127.0.0.1", 4000)) == SAME_HOST_DATAGRAM_BYTES
    # a network path starts at QUIC's minimum; probes raise it (issue 11, proto_spec 07 §4a)
    assert path_datagram_bytes(("203.0.113.9", 4000)) == START_DATAGRAM_BYTES == 1200
    assert path_datagram_bytes(("0.0.0.0", 4000)) == START_DATAGRAM_BYTES
    assert path_datagram_bytes(("kafila.example", 4000)) == START_DATAGRAM_BYTES
    me = own_address()
    if me is not None and me != "203.0.113.9":
        assert path_datagram_bytes((me, 4000)) == SAME_HOST_DATAGRAM_BYTES


@pytest.mark.parametrize("datagram_bytes, fewest, most", [(None, 5, 12), (MAX_DATAGRAM_BYTES, 49, 200)])
@trio_test
async def test_a_same_host_path_carries_large_datagrams_unless_told_otherwise(datagram_bytes, fewest, most):
    """A 65,535-byte message needs at least 65,537 / datagram size datagrams."""
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b, datagram_bytes=datagram_bytes)
            await client.send_message(b"warm")
            assert await server.receive_message() == b"warm"
            before = b.received
            blob = os.urandom(65535)
            await client.send_message(blob)
            assert await server.receive_message() == blob
            assert fewest <= b.received - before <= most
            nursery.cancel_scope.cancel()


@trio_test
async def test_messages_both_ways_and_a_16_mib_transfer_arrive_whole_and_in_order():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b)
            assert client.is_client and not server.is_client
            await client.send_message(b"hello")
            assert await server.receive_message() == b"hello"
            await server.send_message(b"")
            assert await client.receive_message() == b""
            blob = os.urandom(65535)
            count = 16 * 1024 * 1024 // len(blob)

            async def pump():
                for i in range(count):
                    await client.send_message(blob[:-1] + bytes([i % 256]))
            nursery.start_soon(pump)
            for i in range(count):
                assert await server.receive_message() == blob[:-1] + bytes([i % 256])
            with pytest.raises(LocalProtocolError, match="at most 65535 bytes"):
                await client.send_message(bytes(65536))
            await client.aclose()
            with pytest.raises(trio.EndOfChannel):
                await server.receive_message()
            with pytest.raises(trio.ClosedResourceError):
                await client.send_message(b"x")
            nursery.cancel_scope.cancel()


@trio_test
async def test_two_connections_between_the_same_sockets_are_kept_apart():
    """A two-member ring has an edge each way between the same two sockets (routing by DCID)."""
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            c1, s1 = await connected_pair(nursery, a, b)
            c2, s2 = await connected_pair(nursery, b, a)
            await c1.send_message(b"a->b")
            await c2.send_message(b"b->a")
            assert await s1.receive_message() == b"a->b"
            assert await s2.receive_message() == b"b->a"
            nursery.cancel_scope.cancel()


@trio_test
async def test_noise_runs_inside_the_quic_stream_unchanged():
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    (ka, pa), (kb, pb) = generate_keypair(), generate_keypair()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b)
            out = {}

            def expect(key):
                def check(remote_static, hello):
                    assert remote_static == key
                    return hello["name"]
                return check

            async def responder():
                out["s"], _, _ = await secure_link(server, initiator=False, static_private=kb, session_id="k3v9q2xa",
                                                   hello={"peer_id": "b", "name": "bee"}, check_remote=expect(pa),
                                                   label="ring")
            async with trio.open_nursery() as inner:
                inner.start_soon(responder)
                out["c"], _, _ = await secure_link(client, initiator=True, static_private=ka, session_id="k3v9q2xa",
                                                   hello={"peer_id": "a", "name": "ay"}, check_remote=expect(pb),
                                                   label="ring")
            await out["c"].send({"t": "act", "h": b"\x01" * 200_000})
            assert await out["s"].receive() == {"t": "act", "h": b"\x01" * 200_000}
            assert out["s"].peer_name == "ay" and out["c"].peer_name == "bee"
            nursery.cancel_scope.cancel()


@trio_test
async def test_accept_gives_up_when_no_client_comes():
    a = await UdpEndpoint.bind("127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        with pytest.raises(trio.BrokenResourceError, match="no QUIC client arrived from 127.0.0.1:9 within 0.2 s"):
            await quic_accept(a, ("127.0.0.1", 9), nursery, timeout_s=0.2)
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_stream_that_ends_inside_a_message_is_a_lost_link():
    """proto_spec 01 §5.1 on QUIC stream 0: an end between messages is clean, inside one is a loss."""
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b)
            await client.send_message(b"whole")
            # half of a 9-byte message, then FIN on the stream (what a peer dying mid-write leaves)
            client.conn.send_stream_data(client.stream_id, b"\x00\x09half", end_stream=True)
            client._transmit()
            assert await server.receive_message() == b"whole"
            with pytest.raises(trio.BrokenResourceError, match=r"ended inside a message \(6 bytes"):
                await server.receive_message()
            nursery.cancel_scope.cancel()


class _SizeWatch:
    """Records the length of every datagram the endpoint ``e`` sends (its real socket sends them)."""

    def __init__(self, e: UdpEndpoint):
        self.sizes: list[int] = []
        e.gso = False  # one send_nowait per datagram, so each one's length is seen here
        send = e.send_nowait

        def watched(data, addr):
            self.sizes.append(len(data))
            return send(data, addr)
        e.send_nowait = watched


@trio_test
async def test_raising_the_datagram_size_hands_the_stream_to_a_successor_connection_in_order():
    """qh3 cannot raise a connection's size: a successor connection takes over stream 0 mid-transfer
    (module docstring of kafilad/net/quic_transport.py), and lowering works in place."""
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    watch = _SizeWatch(a)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b, datagram_bytes=START_DATAGRAM_BYTES)
            blob = os.urandom(20_000)
            count = 300
            got = []

            async def read_all():
                for _ in range(count):
                    got.append(await server.receive_message())
            nursery.start_soon(read_all)
            for i in range(count):
                if i == 100:
                    assert max(watch.sizes) <= START_DATAGRAM_BYTES
                    client.set_datagram_bytes(1350)  # raise: a successor at 1,350 bytes
                    assert client.datagram_bytes == 1350
                    mark = len(watch.sizes)
                if i == 200:
                    while client.generations < 2 or client.conn is client._gens[0].conn:
                        await trio.sleep(0.01)
                    assert 1300 < max(watch.sizes[mark:]) <= 1350
                    client.set_datagram_bytes(1252)  # lower: in place, on the same connection
                    mark = len(watch.sizes)
                await client.send_message(blob[:-2] + i.to_bytes(2, "big"))
            while len(got) < count:
                await trio.sleep(0.01)
            assert got == [blob[:-2] + i.to_bytes(2, "big") for i in range(count)]  # whole, in order, once
            assert client.generations == server.generations == 2
            assert 1200 < max(watch.sizes[mark:]) <= 1252 and client.datagram_bytes == 1252
            await server.send_message(b"back")  # the server answers on the successor too
            assert await client.receive_message() == b"back"
            await client.aclose()
            with pytest.raises(trio.EndOfChannel):
                await server.receive_message()
            nursery.cancel_scope.cancel()


@trio_test
async def test_the_receiver_takes_only_the_attempts_connection_not_an_earlier_ones_leftover_datagram():
    """proto_spec 07 §4: a long-header datagram from the same socket with another DCID (here a
    real Initial of a connection its client gave up on) arrives first and waits in the stash; the
    server accepts the connection whose DCID is the attempt's (quic_config.initial_dcid)."""
    from qh3.quic.connection import QuicConnection

    from kafilad.net.quic_config import configuration, initial_dcid
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        await nursery.start(b.serve)
        stale = QuicConnection(configuration=configuration(is_client=True, datagram_bytes=1200))
        stale.connect(b.local_address, now=trio.current_time())
        for data, _ in stale.datagrams_to_send(now=trio.current_time()):
            await a.sendto(data, b.local_address)  # nobody expects a client yet: stashed at b
        await trio.sleep(0.05)
        odcid = initial_dcid("aaaa", "p" * 22, "bbbb", "q" * 22)
        assert len(odcid) == 8 and odcid != stale.original_destination_connection_id
        with trio.fail_after(5):
            c, s = await connected_pair(nursery, a, b, odcid=odcid, timeout_s=3)
        assert s.conn.original_destination_connection_id == odcid
        await c.send_message(b"this attempt")
        assert await s.receive_message() == b"this attempt"
        nursery.cancel_scope.cancel()


@trio_test
async def test_each_transport_keeps_its_smallest_rtt_sample_and_counts_them():
    """`min_rtt_s` (RFC 9002 §5.2 min_rtt) and `rtt_samples`: what a ring edge reports as its path's
    round trip once settled (proto_spec 07 §6 `path_rtt_ms`); each acknowledged message adds a sample."""
    a, b = await UdpEndpoint.bind("127.0.0.1"), await UdpEndpoint.bind("127.0.0.1")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            client, server = await connected_pair(nursery, a, b)
            seen = []
            for i in range(12):  # one message at a time, each answered: an ACK per round trip
                await client.send_message(b"ping %d" % i)
                assert await server.receive_message() == b"ping %d" % i
                await server.send_message(b"pong")
                assert await client.receive_message() == b"pong"
                await trio.sleep(0.01)
                seen.append(client.rtt_samples)
            assert client.rtt_samples >= 6 and seen == sorted(seen), seen
            assert client.min_rtt_s is not None and 0 < client.min_rtt_s <= client.smoothed_rtt_s + 1e-9
            nursery.cancel_scope.cancel()

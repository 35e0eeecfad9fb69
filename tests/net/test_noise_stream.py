"""The trio secure channel (kafilad.net.noise_stream, kafilad.net.transport), with frames over it."""

from __future__ import annotations

import math

import msgpack
import pytest
import trio
import trio.testing
from trio.testing import trio_test

from kafilad.errors import HandshakeError, LocalProtocolError, RemoteProtocolError
from kafilad.net.frame_stream import FrameStream
from kafilad.net.noise_stream import NoiseStream, noise_handshake
from kafilad.net.transport import (
    MessageTransport,
    StreamMessageTransport,
    memory_message_transport_pair,
)
from kafilad.proto import identity
from kafilad.proto.frames import encode_frame
from kafilad.proto.noise import MAX_PLAINTEXT_BYTES, generate_keypair

PROLOGUE = identity.session_prologue("k3v9q2xa")


async def _handshake_pair(
    t_init: MessageTransport,
    t_resp: MessageTransport,
    *,
    prologue_init: bytes = PROLOGUE,
    prologue_resp: bytes = PROLOGUE,
    check_init=None,
    check_resp=None,
    keys=None,
) -> tuple[NoiseStream | BaseException, NoiseStream | BaseException]:
    """Run both sides concurrently; each result is the stream or the exception it raised."""
    (ip, _), (rp, _) = keys or (generate_keypair(), generate_keypair())
    results: dict[str, object] = {}

    async def side(name, transport, initiator, priv, prologue, payload, check):
        try:
            results[name] = await noise_handshake(
                transport, initiator=initiator, static_private=priv, prologue=prologue,
                payload=payload, check_remote=check,
            )
        except (HandshakeError, trio.BrokenResourceError) as exc:
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "i", t_init, True, ip, prologue_init, b"member hello", check_init)
        nursery.start_soon(side, "r", t_resp, False, rp, prologue_resp, b"host hello", check_resp)
    return results["i"], results["r"]


async def _memory_streams() -> tuple[NoiseStream, NoiseStream]:
    a, b = memory_message_transport_pair()
    s1, s2 = await _handshake_pair(a, b)
    assert isinstance(s1, NoiseStream) and isinstance(s2, NoiseStream)
    return s1, s2


async def _socket_streams() -> tuple[NoiseStream, NoiseStream]:
    """Real kernel sockets (a socketpair), with the u16 length-prefixed stream transport."""
    sa, sb = trio.socket.socketpair()
    a = StreamMessageTransport(trio.SocketStream(sa))
    b = StreamMessageTransport(trio.SocketStream(sb))
    s1, s2 = await _handshake_pair(a, b)
    assert isinstance(s1, NoiseStream) and isinstance(s2, NoiseStream)
    return s1, s2


@trio_test
async def test_check_two_way_stream_over_memory_transport():
    await trio.testing.check_two_way_stream(_memory_streams, None)


@trio_test
async def test_check_two_way_stream_over_socketpair():
    await trio.testing.check_two_way_stream(_socket_streams, None)


@trio_test
async def test_handshake_exchanges_keys_payloads_and_hash():
    (ip, ipub), (rp, rpub) = generate_keypair(), generate_keypair()
    seen = []

    def check_init(remote_static, remote_payload):
        seen.append(("initiator saw", remote_static, remote_payload))

    def check_resp(remote_static, remote_payload):
        seen.append(("responder saw", remote_static, remote_payload))

    a, b = memory_message_transport_pair()
    s1, s2 = await _handshake_pair(a, b, check_init=check_init, check_resp=check_resp, keys=((ip, ipub), (rp, rpub)))
    assert s1.remote_static == rpub and s2.remote_static == ipub
    assert s1.remote_payload == b"host hello" and s2.remote_payload == b"member hello"
    assert s1.handshake_hash == s2.handshake_hash and len(s1.handshake_hash) == 64
    assert ("initiator saw", rpub, b"host hello") in seen and ("responder saw", ipub, b"member hello") in seen


@trio_test
async def test_tcp_loopback_five_mib_frame_round_trips():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    payload = bytes(range(256)) * (5 * 1024 * 1024 // 256)
    got: dict = {}
    async with trio.open_nursery() as nursery:

        async def server():
            stream = await listeners[0].accept()
            s = await noise_handshake(StreamMessageTransport(stream), initiator=False,
                                      static_private=generate_keypair()[0], prologue=PROLOGUE)
            ch = FrameStream(s)
            got["frame"] = await ch.receive()
            await ch.send({"t": "ack", "n": len(got["frame"]["data"])})
            assert await ch.receive() is None  # the client closed between frames
            await ch.aclose()

        nursery.start_soon(server)
        client_stream = await trio.open_tcp_stream("127.0.0.1", port)
        s = await noise_handshake(StreamMessageTransport(client_stream), initiator=True,
                                  static_private=generate_keypair()[0], prologue=PROLOGUE)
        ch = FrameStream(s)
        size = await ch.send({"t": "shard", "data": payload})
        assert await ch.receive() == {"t": "ack", "n": len(payload)}
        assert s.messages_sent == math.ceil(size / MAX_PLAINTEXT_BYTES) == 81
        assert s.ciphertext_bytes_sent == size + 16 * s.messages_sent
        await ch.aclose()
        for listener in listeners:
            await listener.aclose()
    assert got["frame"] == {"t": "shard", "data": payload}


@trio_test
async def test_concurrent_sends_do_not_interleave():
    s1, s2 = await _memory_streams()
    tx, rx = FrameStream(s1), FrameStream(s2)
    n_tasks, size = 8, 200_000  # each frame spans several Noise messages
    received = []
    async with trio.open_nursery() as nursery:
        for k in range(n_tasks):
            nursery.start_soon(tx.send, {"t": "blob", "k": k, "data": bytes([k]) * size})
        for _ in range(n_tasks):
            received.append(await rx.receive())
    assert sorted(f["k"] for f in received) == list(range(n_tasks))
    assert all(f["data"] == bytes([f["k"]]) * size for f in received)


async def _relay(src: MessageTransport, dst: MessageTransport, corrupt_message_index: int | None) -> None:
    """Forward messages one way, like the rendezvous relay; optionally flip a bit in one."""
    index = 0
    try:
        while True:
            message = await src.receive_message()
            if index == corrupt_message_index:
                message = bytes([message[0] ^ 0x01]) + message[1:]
            index += 1
            await dst.send_message(message)
    except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        await dst.aclose()


@trio_test
async def test_corrupted_ciphertext_breaks_only_that_link():
    """A relay flips a bit in one transport message of the A-B link; the A-C link is unaffected."""
    a_end, relay_a = memory_message_transport_pair()
    relay_b, b_end = memory_message_transport_pair()
    c1, c2 = memory_message_transport_pair()
    async with trio.open_nursery() as nursery:
        # In the A->B direction, index 0 is handshake message 1, index 1 is message 3, and index 2
        # is A's first transport message (the frame below).
        nursery.start_soon(_relay, relay_a, relay_b, 2)
        nursery.start_soon(_relay, relay_b, relay_a, None)
        ab, ba = await _handshake_pair(a_end, b_end)
        ac, ca = await _handshake_pair(c1, c2)
        a_to_b, b_from_a = FrameStream(ab), FrameStream(ba)
        a_to_c, c_from_a = FrameStream(ac), FrameStream(ca)
        await a_to_b.send({"t": "act", "x": 1})
        with pytest.raises(RemoteProtocolError, match="failed authentication"):
            await b_from_a.receive()
        with pytest.raises(trio.ClosedResourceError):  # the bad link is closed on B's side
            await b_from_a.receive()
        await a_to_c.send({"t": "act", "x": 2})
        assert await c_from_a.receive() == {"t": "act", "x": 2}
        # A learns the link is gone when it next uses it.
        with pytest.raises(trio.BrokenResourceError):
            for _ in range(100):
                await a_to_b.send({"t": "act", "x": 3})
        await a_to_c.aclose()
        await a_to_b.aclose()
        nursery.cancel_scope.cancel()


@trio_test
async def test_responder_refusal_is_a_handshake_error_on_both_sides():
    """The host refuses a key that is not in its roster; the member hears why."""

    def host_check(remote_static, payload):
        raise HandshakeError(f"Peer {identity.peer_id(remote_static)} is not in this session's roster.")

    a, b = memory_message_transport_pair()
    member, host = await _handshake_pair(a, b, check_resp=host_check)
    assert isinstance(host, HandshakeError) and "not in this session's roster" in str(host)
    assert isinstance(member, HandshakeError)
    assert "The peer refused the secure channel: Peer " in str(member)
    assert "not in this session's roster" in str(member)


@trio_test
async def test_initiator_refusal_of_host_key_is_a_handshake_error_on_both_sides():
    """A member given a code with another host's fingerprint refuses to join (DESIGN §3)."""
    code = identity.compose_session_code("k3v9q2xa", generate_keypair()[1])  # not the real host
    _, expected_fp = identity.parse_session_code(code)

    def member_check(remote_static, payload):
        if not identity.fingerprint_matches(expected_fp, remote_static):
            raise HandshakeError(
                f"The host's key {identity.fingerprint(remote_static)} does not match the session "
                f"code's fingerprint {expected_fp}; refusing to join."
            )

    a, b = memory_message_transport_pair()
    member, host = await _handshake_pair(a, b, check_init=member_check)
    assert isinstance(member, HandshakeError) and "does not match the session code" in str(member)
    assert isinstance(host, HandshakeError) and "closed the connection before Noise handshake message 3" in str(host)


@trio_test
async def test_different_session_prologue_fails_on_both_sides():
    a, b = memory_message_transport_pair()
    i, r = await _handshake_pair(a, b, prologue_resp=identity.session_prologue("otherid1"))
    assert isinstance(i, HandshakeError) and "prologue" in str(i)
    assert isinstance(r, HandshakeError)


@trio_test
async def test_frame_stream_over_noise_eof_and_malformed_frames():
    s1, s2 = await _memory_streams()
    tx, rx = FrameStream(s1), FrameStream(s2)
    await tx.send({"t": "bye"})
    await tx.aclose()
    assert await rx.receive() == {"t": "bye"}
    assert await rx.receive() is None  # a clean end between frames
    assert await rx.receive() is None

    s1, s2 = await _memory_streams()
    rx = FrameStream(s2)
    await s1.send_all(encode_frame({"t": "partial"})[:-1])
    await s1.aclose()
    with pytest.raises(RemoteProtocolError, match="ended inside a frame"):
        await rx.receive()

    s1, s2 = await _memory_streams()
    rx = FrameStream(s2)
    body = msgpack.packb(["not", "a", "map"])
    await s1.send_all(len(body).to_bytes(4, "big") + body)
    with pytest.raises(RemoteProtocolError, match="not a map"):
        await rx.receive()
    await s1.aclose()


@trio_test
async def test_stream_message_transport_limits_and_eof():
    left, right = trio.testing.memory_stream_pair()
    a, b = StreamMessageTransport(left), StreamMessageTransport(right)
    with pytest.raises(LocalProtocolError, match="at most 65535"):
        await a.send_message(b"x" * 65536)
    await a.send_message(b"")
    await a.send_message(b"y" * 65535)
    assert await b.receive_message() == b""
    assert await b.receive_message() == b"y" * 65535
    await left.send_all(b"\x00\x05abc")  # a message cut short by the peer closing
    await left.aclose()
    with pytest.raises(trio.BrokenResourceError, match="ended inside a message"):
        await b.receive_message()

    left, right = trio.testing.memory_stream_pair()
    a, b = StreamMessageTransport(left), StreamMessageTransport(right)
    await a.send_message(b"last")
    await a.aclose()
    assert await b.receive_message() == b"last"
    with pytest.raises(trio.EndOfChannel):
        await b.receive_message()

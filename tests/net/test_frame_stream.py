"""FrameStream, the one frame driver (kafilad/net/frame_stream.py; proto_spec 02), over memory streams."""

from __future__ import annotations

import msgpack
import pytest
import trio
import trio.testing
from trio.testing import trio_test

from kafilad.control.api import FramedStream
from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.net.frame_stream import FrameStream
from kafilad.proto.frames import encode_frame


def _pair() -> tuple[FrameStream, FrameStream, trio.abc.Stream, trio.abc.Stream]:
    left, right = trio.testing.memory_stream_pair()
    return FrameStream(left), FrameStream(right), left, right


def test_the_control_api_uses_the_same_class():
    assert FramedStream is FrameStream


@trio_test
async def test_round_trip_counts_frame_bytes():
    tx, rx, _, _ = _pair()
    body = {"t": "act", "req": "r1", "h": b"\x00\x01" * 100}
    size = await tx.send(body)
    assert size == len(encode_frame(body)) == 4 + len(msgpack.packb(body, use_bin_type=True))
    assert await rx.receive() == body
    assert (tx.bytes_sent, tx.frames_sent, rx.bytes_received) == (size, 1, size)
    assert rx.decoder.frames_decoded == 1 and rx.decoder.pending_bytes == 0


@trio_test
async def test_clean_end_between_frames_is_none_every_time():
    tx, rx, _, _ = _pair()
    await tx.send({"t": "bye"})
    await tx.aclose()
    assert await rx.receive() == {"t": "bye"}
    assert await rx.receive() is None
    assert await rx.receive() is None


@trio_test
async def test_an_end_inside_a_frame_is_a_remote_protocol_error_and_closes_the_stream():
    """The peer (a daemon, a member) dies after half a frame: not a clean end (proto_spec 02 §2)."""
    _, rx, left, _ = _pair()
    frame = encode_frame({"t": "reply", "ok": True, "result": "x" * 50})
    await left.send_all(frame[: len(frame) // 2])
    await left.aclose()
    with pytest.raises(RemoteProtocolError, match=rf"ended inside a frame \({len(frame) // 2} bytes"):
        await rx.receive()
    assert rx.decoder.error is not None
    with pytest.raises(RemoteProtocolError, match="ended inside a frame"):  # the decoder stays dead
        await rx.receive()


@trio_test
async def test_an_end_inside_the_length_header_is_also_an_error():
    _, rx, left, _ = _pair()
    await left.send_all(b"\x00\x00")
    await left.aclose()
    with pytest.raises(RemoteProtocolError, match=r"ended inside a frame \(2 bytes"):
        await rx.receive()


@trio_test
async def test_malformed_frames_raise_and_close():
    _, rx, left, _ = _pair()
    body = msgpack.packb({"no_type": 1})
    await left.send_all(len(body).to_bytes(4, "big") + body)
    with pytest.raises(RemoteProtocolError, match="no str key 't'"):
        await rx.receive()
    with pytest.raises(trio.BrokenResourceError):  # the receiving end closed the stream
        await left.send_all(b"more")
    with pytest.raises(RemoteProtocolError, match="no str key 't'"):  # and says why again
        await rx.receive()

    _, rx, left, _ = _pair()
    await left.send_all((2**32 - 1).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError, match="frames are 1..67108864 bytes"):
        await rx.receive()


@trio_test
async def test_frames_split_across_reads_and_several_in_one_read():
    tx, rx, left, _ = _pair()
    bodies = [{"t": "tok", "i": i, "pad": "y" * (i * 37)} for i in range(6)]
    stream = b"".join(encode_frame(b) for b in bodies)
    for i in range(0, len(stream), 7):  # 7-byte writes: every frame arrives in pieces
        await left.send_all(stream[i : i + 7])
    assert [await rx.receive() for _ in bodies] == bodies
    await left.send_all(stream)  # then all six in one write
    assert [await rx.receive() for _ in bodies] == bodies


@trio_test
async def test_invalid_body_raises_locally_and_sends_nothing():
    tx, rx, _, right = _pair()
    with pytest.raises(LocalProtocolError, match="non-empty str key 't'"):
        await tx.send({"x": 1})
    with pytest.raises(LocalProtocolError, match="cannot encode"):
        await tx.send({"t": "bad", "v": object()})
    assert tx.bytes_sent == 0 and tx.frames_sent == 0
    await tx.aclose()
    assert await rx.receive() is None


@trio_test
async def test_concurrent_sends_are_serialised_whole_frames():
    """A lockstep stream hands bytes over only as the reader takes them, so an unlocked second
    sender would hit trio's BusyResourceError; with the lock every frame arrives whole."""
    left, right = trio.testing.lockstep_stream_pair()
    tx, rx = FrameStream(left), FrameStream(right)
    n = 6
    got = []
    async with trio.open_nursery() as nursery:
        for k in range(n):
            nursery.start_soon(tx.send, {"t": "blob", "k": k, "data": bytes([k]) * 5000})
        for _ in range(n):
            got.append(await rx.receive())
    assert sorted(f["k"] for f in got) == list(range(n))
    assert all(f["data"] == bytes([f["k"]]) * 5000 for f in got)
    assert tx.frames_sent == n


@trio_test
async def test_send_after_the_peer_left_and_after_our_close():
    tx, rx, _, _ = _pair()
    await rx.aclose()
    with pytest.raises(trio.BrokenResourceError):
        await tx.send({"t": "late"})
    tx, rx, _, _ = _pair()
    await tx.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await tx.send({"t": "late"})

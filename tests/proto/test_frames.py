"""Frame layer (kafilad.proto.frames): layout, limits, chunking, arrays, property tests."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafilad.errors import FramingError, LocalProtocolError, RemoteProtocolError
from kafilad.proto import frames
from kafilad.proto.noise import MAX_PLAINTEXT_BYTES


def _decode_all(decoder: frames.FrameDecoder) -> list[dict]:
    out = []
    while (ev := decoder.next_event()) is not None:
        out.append(ev)
    return out


def test_layout_is_u32_be_length_then_msgpack_map():
    body = {"t": "tok", "ids": [1, 2, 300], "blob": b"\x00\x01"}
    data = frames.encode_frame(body)
    packed = msgpack.packb(body, use_bin_type=True)
    assert data == struct.pack(">I", len(packed)) + packed
    assert data[:4] == len(packed).to_bytes(4, "big")
    dec = frames.FrameDecoder()
    dec.receive_data(data)
    assert dec.next_event() == body  # bytes stay bytes, str stays str
    assert dec.next_event() is None and dec.pending_bytes == 0 and dec.frames_decoded == 1


def test_unknown_keys_and_trailing_bytes_are_ignored():
    dec = frames.FrameDecoder()
    dec.receive_data(frames.encode_frame({"t": "hello", "future_field": {"x": 1}}))
    assert dec.next_event() == {"t": "hello", "future_field": {"x": 1}}
    # A later version may append data after the map inside the frame (proto_spec 02 §1.2).
    dec.receive_data(_raw_frame(msgpack.packb({"t": "a"}) + b"\x00future") + frames.encode_frame({"t": "b"}))
    assert dec.next_event() == {"t": "a"}
    assert dec.next_event() == {"t": "b"}


@pytest.mark.parametrize(
    "body, message",
    [({"x": 1}, "key 't'"), ({"t": 5}, "key 't'"), ({"t": ""}, "key 't'"), (["t"], "must be a map"),
     ({"t": "x", "v": object()}, "cannot encode")],
)
def test_encode_frame_refuses_bad_bodies(body, message):
    with pytest.raises(LocalProtocolError, match=message):
        frames.encode_frame(body)


def test_encode_frame_refuses_oversize():
    with pytest.raises(LocalProtocolError, match="over the 67108864-byte limit"):
        frames.encode_frame({"t": "shard", "data": bytes(frames.MAX_FRAME_BYTES)})


def _raw_frame(body_bytes: bytes) -> bytes:
    return struct.pack(">I", len(body_bytes)) + body_bytes


@pytest.mark.parametrize(
    "stream, message",
    [
        (struct.pack(">I", frames.MAX_FRAME_BYTES + 1), "frames are 1..67108864 bytes"),
        (struct.pack(">I", 0), "frame of 0 bytes"),
        (_raw_frame(b"\xc1"), "not valid msgpack"),  # 0xc1 is never used in msgpack
        (_raw_frame(msgpack.packb([1, 2])), "not a map"),
        (_raw_frame(msgpack.packb({"x": 1})), "no str key 't'"),
        (_raw_frame(msgpack.packb({"t": "a", "n": 5})[:-1]), "not valid msgpack"),  # map cut short
        (_raw_frame(msgpack.packb({"t": b"bytes-not-str"}, use_bin_type=True)), "no str key 't'"),
        (_raw_frame(b"\xa2\xff\xfe"), "not valid msgpack"),  # str that is not UTF-8
    ],
)
def test_decoder_rejects_with_reason(stream: bytes, message: str):
    dec = frames.FrameDecoder()
    dec.receive_data(stream)
    with pytest.raises(RemoteProtocolError, match=message):
        dec.next_event()
    with pytest.raises(RemoteProtocolError, match=message):  # stays dead
        dec.receive_data(frames.encode_frame({"t": "ok"}))


@pytest.mark.parametrize("stream, code, check", [
    (struct.pack(">I", 0), "length", lambda e: e.header == b"\0\0\0\0" and e.length == 0),
    (_raw_frame(b"\xc1"), "msgpack", lambda e: e.raw == b"\xc1" and isinstance(e.cause, Exception)),
    (_raw_frame(msgpack.packb([1, 2])), "not_map", lambda e: e.value == [1, 2]),
    (_raw_frame(msgpack.packb({"x": 1})), "no_type", lambda e: e.length == 4),
])
def test_decoder_errors_carry_a_code_and_what_a_caller_words_them_from(stream, code, check):
    """Callers decide on the code, never the text (the control server words each for its clients)."""
    dec = frames.FrameDecoder()
    dec.receive_data(stream)
    with pytest.raises(FramingError) as info:
        dec.next_event()
    assert info.value.code == code and code in FramingError.CODES and check(info.value)


def test_a_decoder_that_does_not_require_a_type_returns_any_map():
    dec = frames.FrameDecoder(require_type=False)
    dec.receive_data(_raw_frame(msgpack.packb({"x": 1})))
    assert dec.next_event() == {"x": 1}


def test_oversize_length_is_refused_before_the_body_arrives():
    dec = frames.FrameDecoder(max_frame_bytes=1000)
    dec.receive_data(struct.pack(">I", 1001))
    with pytest.raises(RemoteProtocolError, match="1001 bytes"):
        dec.next_event()


def test_eof_inside_a_frame():
    data = frames.encode_frame({"t": "a"}) + frames.encode_frame({"t": "b", "x": 1})
    dec = frames.FrameDecoder()
    dec.receive_data(data[:-2])
    assert _decode_all(dec) == [{"t": "a"}]
    with pytest.raises(RemoteProtocolError, match="ended inside a frame"):
        dec.receive_eof()
    clean = frames.FrameDecoder()
    clean.receive_data(data)
    assert len(_decode_all(clean)) == 2
    clean.receive_eof()  # no error at a frame boundary


def test_chunk():
    data = bytes(range(256)) * 1000
    pieces = frames.chunk(data, 1000)
    assert len(pieces) == 256 and all(len(p) == 1000 for p in pieces)
    assert b"".join(pieces) == data
    five_mib = b"\x07" * (5 * 1024 * 1024)
    pieces = frames.chunk(five_mib)
    assert len(pieces) == -(-len(five_mib) // MAX_PLAINTEXT_BYTES) == 81
    assert max(len(p) for p in pieces) == MAX_PLAINTEXT_BYTES == 65519
    assert frames.chunk(b"") == []
    with pytest.raises(LocalProtocolError):
        frames.chunk(b"x", 0)


def test_array_round_trip_through_a_frame():
    data = struct.pack("<6f", 0.5, -1.0, 2.0, 3.25, 4.0, 5.5)
    arr = frames.encode_array("float32", (1, 2, 3), data)
    assert arr == {"dtype": "float32", "shape": [1, 2, 3], "data": data}
    dec = frames.FrameDecoder()
    dec.receive_data(frames.encode_frame({"t": "act", "h": arr}))
    assert frames.decode_array(dec.next_event()["h"]) == ("float32", (1, 2, 3), data)
    assert frames.decode_array(frames.encode_array("bfloat16", (), b"\x00\x00"))[1] == ()
    assert frames.decode_array(frames.encode_array("int32", (0, 4), b""))[1] == (0, 4)


@pytest.mark.parametrize(
    "arr, message",
    [
        ({"dtype": "float32", "shape": [2], "data": b"\x00" * 7}, r"7 data bytes .* \(expected 8\)"),
        ({"dtype": "complex64", "shape": [1], "data": b"\x00" * 8}, "dtype 'complex64'"),
        ({"dtype": "float32", "shape": [-1], "data": b""}, "non-negative"),
        ({"dtype": "float32", "shape": [True], "data": b"\x00" * 4}, "non-negative"),
        ({"dtype": "float32", "shape": [1] * 9, "data": b"\x00" * 4}, "9 dimensions"),
        ({"dtype": "float32", "shape": [1], "data": "abcd"}, "not bytes"),
        ({"dtype": "float32", "data": b""}, "no 'shape'"),
        ([1, 2], "not a map"),
    ],
)
def test_decode_array_rejects(arr, message):
    with pytest.raises(RemoteProtocolError, match=message):
        frames.decode_array(arr)


def test_encode_array_rejects_mismatch():
    with pytest.raises(LocalProtocolError, match="expected 12"):
        frames.encode_array("float32", (3,), b"\x00" * 8)


# --- property tests ------------------------------------------------------------------------------

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.binary(max_size=200),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_bodies = st.builds(
    lambda t, extra: {**extra, "t": t},
    st.text(min_size=1, max_size=12),
    st.dictionaries(st.text(max_size=8), _values, max_size=5),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(_bodies, min_size=1, max_size=6), data=st.data())
def test_any_split_of_a_stream_decodes_to_the_same_frames(bodies, data):
    stream = b"".join(frames.encode_frame(b) for b in bodies)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    dec = frames.FrameDecoder()
    got = []
    prev = 0
    for cut in cuts + [len(stream)]:
        dec.receive_data(stream[prev:cut])
        prev = cut
        got.extend(_decode_all(dec))
    assert got == bodies
    dec.receive_eof()


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=300), framed=st.booleans())
def test_garbage_raises_only_remote_protocol_error(garbage, framed):
    dec = frames.FrameDecoder()
    # Framed garbage gets a correct length so the msgpack path is exercised, not just the header.
    dec.receive_data(_raw_frame(garbage) if framed else garbage)
    try:
        _decode_all(dec)
        dec.receive_eof()
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(frames.DTYPE_BYTES)),
    shape=st.lists(st.integers(0, 5), max_size=4),
    delta=st.integers(-3, 3),
)
def test_decode_array_checks_byte_count(dtype, shape, delta):
    n = frames.DTYPE_BYTES[dtype]
    for s in shape:
        n *= s
    arr = {"dtype": dtype, "shape": shape, "data": b"\x01" * max(0, n + delta)}
    if max(0, n + delta) == n:
        assert frames.decode_array(arr) == (dtype, tuple(shape), arr["data"])
    else:
        with pytest.raises(RemoteProtocolError, match="data bytes"):
            frames.decode_array(arr)


# --- activations (proto_spec 02 §4.2): the one codec the executor uses ---------------------------


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(frames.ACTIVATION_DTYPES),
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_activation_round_trips_through_a_frame(dtype, shape, data):
    nbytes = frames.DTYPE_BYTES[dtype]
    for s in shape:
        nbytes *= s
    raw = data.draw(st.binary(min_size=nbytes, max_size=nbytes))  # any bit pattern: NaNs, -0.0
    dec = frames.FrameDecoder()
    dec.receive_data(frames.encode_frame({"t": "act", "h": frames.encode_activation(dtype, tuple(shape), raw)}))
    assert frames.decode_activation(dec.next_event()["h"]) == (dtype, tuple(shape), raw)


@pytest.mark.parametrize("dtype", sorted(set(frames.DTYPE_BYTES) - set(frames.ACTIVATION_DTYPES)))
def test_activation_dtypes_are_floats_only(dtype):
    raw = b"\x00" * frames.DTYPE_BYTES[dtype]
    with pytest.raises(LocalProtocolError, match=f"not '{dtype}'"):
        frames.encode_activation(dtype, (1,), raw)
    with pytest.raises(RemoteProtocolError, match=f"dtype '{dtype}'; expected float32, float16 or bfloat16"):
        frames.decode_activation(frames.encode_array(dtype, (1,), raw))


def test_activation_checks_are_the_array_checks():
    with pytest.raises(RemoteProtocolError, match=r"31 data bytes for shape \(1, 2, 4\) of float32 \(expected 32\)"):
        frames.decode_activation({"dtype": "float32", "shape": [1, 2, 4], "data": b"\x00" * 31})
    with pytest.raises(LocalProtocolError, match="expected 4"):
        frames.encode_activation("bfloat16", (2,), b"\x00")

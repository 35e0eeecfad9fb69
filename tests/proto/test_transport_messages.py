"""The u16 length prefix of proto_spec 01 §5.1 (kafilad/proto/transport_messages.py), sans-IO.

Its trio drivers (StreamMessageTransport, QuicTransport) are tested in tests/net.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.proto.transport_messages import (
    MAX_MESSAGE_BYTES,
    MessageDecoder,
    check_message_size,
    encode_message,
)


def _drain(dec: MessageDecoder) -> list[bytes]:
    out = []
    while (m := dec.next_message()) is not None:
        out.append(m)
    return out


def test_layout_and_limits():
    assert encode_message(b"abc") == b"\x00\x03abc"
    assert encode_message(b"") == b"\x00\x00"
    big = b"\x07" * MAX_MESSAGE_BYTES
    assert encode_message(big)[:2] == struct.pack(">H", 65535)
    with pytest.raises(LocalProtocolError, match="at most 65535 bytes, not 65536"):
        encode_message(big + b"\x07")
    with pytest.raises(LocalProtocolError, match="not 70000"):
        check_message_size(bytearray(70000))
    check_message_size(memoryview(big))


def test_eof_between_messages_is_clean_and_inside_one_is_an_error():
    dec = MessageDecoder()
    dec.receive_data(encode_message(b"one") + encode_message(b"two")[:3])
    assert _drain(dec) == [b"one"] and dec.pending_bytes == 3
    with pytest.raises(RemoteProtocolError, match=r"ended inside a message \(3 bytes of it arrived\)"):
        dec.receive_eof()
    clean = MessageDecoder()
    clean.receive_data(encode_message(b""))
    assert _drain(clean) == [b""]
    clean.receive_eof()


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(st.binary(max_size=300), max_size=8), data=st.data())
def test_any_split_decodes_to_the_same_messages(messages, data):
    stream = b"".join(encode_message(m) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    dec, got, prev = MessageDecoder(), [], 0
    for cut in cuts + [len(stream)]:
        dec.receive_data(stream[prev:cut])
        prev = cut
        got.extend(_drain(dec))
    assert got == messages
    dec.receive_eof()

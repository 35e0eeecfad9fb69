"""Whole messages over a byte stream: the u16 length prefix of proto_spec 01 §5.1, sans-IO.

A Noise message must arrive whole (proto_spec 01 §5), so a byte stream that carries a Noise
channel (TCP, a QUIC stream, a Unix socket) prefixes each message with its length::

    +--------+--------+------------------------------+
    |  n (u16, BE)    |  message (n bytes, 0..65535) |
    +--------+--------+------------------------------+

One codec for every such stream: ``kafilad.net.transport.StreamMessageTransport`` (any trio
stream) and ``kafilad.net.quic_transport.QuicTransport`` (QUIC stream 0). A stream that ends
between messages is a clean close; one that ends inside a message is a lost link.
"""

from __future__ import annotations

import struct

from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.proto.noise import MAX_MESSAGE_BYTES  # largest message: one Noise message (proto_spec 01 §3)

__all__ = ["MAX_MESSAGE_BYTES", "PREFIX", "PREFIX_BYTES", "MessageDecoder", "check_message_size", "encode_message"]

PREFIX = struct.Struct(">H")
PREFIX_BYTES = PREFIX.size


def check_message_size(data: bytes | bytearray | memoryview) -> None:
    """Raise LocalProtocolError if ``data`` is longer than a transport message may be (proto_spec 01 §5).

    For transports that frame messages themselves (a relayed circuit, memory channels).
    """
    n = memoryview(data).nbytes
    if n > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(
            f"A transport message is at most {MAX_MESSAGE_BYTES} bytes, not {n} (proto_spec 01 §5)."
        )


def encode_message(data: bytes | bytearray | memoryview) -> bytes:
    """``u16 BE length || data`` (proto_spec 01 §5.1).

    Returns:
        2 + len(data) bytes.
    Raises:
        LocalProtocolError: data is longer than 65,535 bytes.
    """
    check_message_size(data)
    return PREFIX.pack(memoryview(data).nbytes) + bytes(data)


class MessageDecoder:
    """Turns a byte stream back into whole messages (proto_spec 01 §5.1), sans-IO.

    Feed bytes with ``receive_data`` (any split); pull messages with ``next_message`` until it
    returns None; call ``receive_eof`` when the stream ends.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes from the stream."""
        self._buf += data

    def next_message(self) -> bytes | None:
        """The next whole message (possibly b""), or None until more bytes arrive."""
        if len(self._buf) < PREFIX_BYTES:
            return None
        (n,) = PREFIX.unpack_from(self._buf)
        end = PREFIX_BYTES + n
        if len(self._buf) < end:
            return None
        message = bytes(self._buf[PREFIX_BYTES:end])
        del self._buf[:end]
        return message

    def receive_eof(self) -> None:
        """The stream ended; call once ``next_message`` returned None.

        Raises:
            RemoteProtocolError: the stream ended inside a message (drivers report a lost link).
        """
        if self._buf:
            raise RemoteProtocolError(
                f"The stream ended inside a message ({len(self._buf)} bytes of it arrived)."
            )

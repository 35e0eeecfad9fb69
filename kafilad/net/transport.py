"""Message transports: what a Noise channel runs over (proto_spec 01 §5; DESIGN §4).

A Noise message must arrive whole and in order, so the secure channel needs a *message*
transport, not a byte stream. Three carry it:

- a relayed circuit (one WebSocket binary message per Noise message; kafilad.node, via the
  rendezvous), which implements ``MessageTransport`` itself;
- a byte stream (TCP, a QUIC stream, a Unix socket): ``StreamMessageTransport`` adds a 2-byte
  length prefix per message (proto_spec 01 §5.1; the codec is kafilad/proto/transport_messages.py)::

      +--------+--------+------------------------------+
      |  n (u16, BE)    |  message (n bytes, 0..65535) |
      +--------+--------+------------------------------+

- an in-process pair for tests: ``memory_message_transport_pair``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import trio

from kafilad.errors import RemoteProtocolError
from kafilad.proto.transport_messages import MAX_MESSAGE_BYTES, MessageDecoder, check_message_size, encode_message

#: Largest message any transport must carry: one Noise message (proto_spec 01 §3).
MAX_TRANSPORT_MESSAGE_BYTES = MAX_MESSAGE_BYTES
_RECEIVE_BYTES = 256 * 1024


@runtime_checkable
class MessageTransport(Protocol):
    """An ordered, reliable carrier of whole messages of 0..65535 bytes.

    ``send_message`` raises trio.BrokenResourceError when the peer is gone and
    trio.ClosedResourceError after our own ``aclose``. ``receive_message`` raises
    trio.EndOfChannel when the peer closed cleanly, trio.BrokenResourceError when the carrier was
    lost, and trio.ClosedResourceError after our own ``aclose``.
    """

    async def send_message(self, data: bytes) -> None: ...

    async def receive_message(self) -> bytes: ...

    async def aclose(self) -> None: ...


class StreamMessageTransport:
    """Messages over a trio byte stream, each prefixed with its u16 big-endian length.

    proto_spec 01 §5.1. Receiving is cancellation-safe (partial messages stay buffered). A send
    cut short by cancellation or an error leaves the stream mid-message, so the transport is then
    broken (later sends raise trio.BrokenResourceError).

    Args:
        stream: any trio.abc.Stream (SocketStream, a QUIC stream adapter, a memory stream).
    """

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self._decoder = MessageDecoder()
        self._send_lock = trio.Lock()
        self._send_broken = False
        self._eof = False

    async def send_message(self, data: bytes) -> None:
        framed = encode_message(data)
        async with self._send_lock:
            if self._send_broken:
                raise trio.BrokenResourceError("An earlier send on this transport was interrupted mid-message.")
            try:
                await self.stream.send_all(framed)
            except trio.ClosedResourceError:
                raise
            except BaseException:
                self._send_broken = True
                raise

    async def receive_message(self) -> bytes:
        while True:
            message = self._decoder.next_message()
            if message is not None:
                await trio.lowlevel.checkpoint()
                return message
            if self._eof:
                await trio.lowlevel.checkpoint()
                raise trio.EndOfChannel
            data = await self.stream.receive_some(_RECEIVE_BYTES)
            if not data:
                try:
                    self._decoder.receive_eof()
                except RemoteProtocolError as exc:  # proto_spec 01 §5.1: a lost link
                    raise trio.BrokenResourceError(str(exc)) from None
                self._eof = True
                raise trio.EndOfChannel
            self._decoder.receive_data(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


class MemoryMessageTransport:
    """One end of an in-process message transport (trio memory channels), for tests.

    Closing one end makes the other's ``receive_message`` raise trio.EndOfChannel (after the
    messages already sent) and its ``send_message`` raise trio.BrokenResourceError.
    """

    def __init__(self, send: trio.MemorySendChannel, receive: trio.MemoryReceiveChannel):
        self._send = send
        self._receive = receive

    async def send_message(self, data: bytes) -> None:
        check_message_size(data)
        await self._send.send(bytes(data))

    async def receive_message(self) -> bytes:
        return await self._receive.receive()

    async def aclose(self) -> None:
        self._send.close()
        self._receive.close()
        await trio.lowlevel.checkpoint()


def memory_message_transport_pair(
    max_buffer_messages: int = 16,
) -> tuple[MemoryMessageTransport, MemoryMessageTransport]:
    """Two connected in-process transports (a, b): what a sends, b receives, and back.

    Args:
        max_buffer_messages: messages in flight per direction before ``send_message`` blocks.
    """
    a_to_b_send, a_to_b_receive = trio.open_memory_channel(max_buffer_messages)
    b_to_a_send, b_to_a_receive = trio.open_memory_channel(max_buffer_messages)
    return MemoryMessageTransport(a_to_b_send, b_to_a_receive), MemoryMessageTransport(b_to_a_send, a_to_b_receive)

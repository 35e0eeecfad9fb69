"""The secure channel over trio: Noise XX handshake and NoiseStream (DESIGN §4).

Thin driver of the sans-IO machine in ``kafilad.proto.noise``::

    FrameStream     frames (proto_spec 02) over any trio stream: kafilad/net/frame_stream.py
    NoiseStream     trio.abc.Stream; every send_all is cut into Noise transport messages
                    of <= 65519 plaintext bytes (proto_spec 01 §3, 02 §3)
    MessageTransport  whole messages <= 65535 bytes: relayed circuit, TCP/QUIC stream, memory

``noise_handshake`` runs the three XX messages plus the responder's confirmation
(proto_spec 01 §4.3), calling ``check_remote`` as soon as the remote static key is known.
"""

from __future__ import annotations

import operator
from typing import Callable

import trio

from kafilad.errors import HandshakeError, HandshakeRefused, RemoteProtocolError
from kafilad.net.transport import MessageTransport
from kafilad.proto.frames import chunk
from kafilad.proto.noise import MAX_PLAINTEXT_BYTES, NoiseTransport, NoiseXX

#: Confirmation the responder sends as transport message 0 (proto_spec 01 §4.3).
CONFIRM_ACCEPT = b"\x01"
CONFIRM_REFUSE = b"\x00"
_MAX_REASON_BYTES = 1000


class _Guard:
    """Raises trio.BusyResourceError when two tasks use one direction of a stream at once."""

    def __init__(self, what: str):
        self._what = what
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(f"Another task is already {self._what} on this NoiseStream.")
        self._held = True

    def __exit__(self, *exc: object) -> None:
        self._held = False


class NoiseStream(trio.abc.Stream):
    """A trio.abc.Stream of plaintext over Noise transport messages on a MessageTransport.

    Made by ``noise_handshake``. ``send_all`` cuts data into messages of at most 65519 plaintext
    bytes; ``receive_some`` returns decrypted plaintext (b"" once the peer closed). A message that
    fails authentication raises kafilad.errors.RemoteProtocolError and breaks the stream (later
    calls raise trio.BrokenResourceError); so does a send interrupted by cancellation, since the
    nonces of the two sides would no longer agree.

    Attributes:
        remote_static: the peer's static public key (32 bytes), checked during the handshake.
        remote_payload: the peer's handshake payload.
        handshake_hash: the Noise handshake hash (64 bytes), unique to this channel.
        messages_sent, messages_received, ciphertext_bytes_sent, ciphertext_bytes_received: counters.
    """

    def __init__(
        self,
        transport: MessageTransport,
        noise: NoiseTransport,
        *,
        remote_static: bytes,
        remote_payload: bytes,
        handshake_hash: bytes,
    ):
        self.transport = transport
        self._noise = noise
        self.remote_static = remote_static
        self.remote_payload = remote_payload
        self.handshake_hash = handshake_hash
        self._send_guard = _Guard("sending")
        self._receive_guard = _Guard("receiving")
        self._buffer = bytearray()
        self._closed = False
        self._eof = False
        self._send_broken: str | None = None
        self._receive_broken: str | None = None
        self.messages_sent = self.messages_received = 0
        self.ciphertext_bytes_sent = self.ciphertext_bytes_received = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_guard:
            if self._closed:
                await trio.lowlevel.checkpoint()
                raise trio.ClosedResourceError("This NoiseStream was closed.")
            if self._send_broken:
                await trio.lowlevel.checkpoint()
                raise trio.BrokenResourceError(self._send_broken)
            await trio.lowlevel.checkpoint_if_cancelled()
            if not data:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            for piece in chunk(data, MAX_PLAINTEXT_BYTES):
                message = self._noise.encrypt(piece)
                try:
                    await self.transport.send_message(message)
                except trio.ClosedResourceError:
                    self._send_broken = "The transport was closed during a send."
                    raise
                except BaseException as exc:
                    self._send_broken = f"A send was interrupted ({type(exc).__name__}); the stream is broken."
                    raise
                self.messages_sent += 1
                self.ciphertext_bytes_sent += len(message)

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_guard:
            if self._closed:
                await trio.lowlevel.checkpoint()
                raise trio.ClosedResourceError("This NoiseStream was closed.")
            await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._receive_guard:
            if self._closed:
                await trio.lowlevel.checkpoint()
                raise trio.ClosedResourceError("This NoiseStream was closed.")
            if self._receive_broken:
                await trio.lowlevel.checkpoint()
                raise trio.BrokenResourceError(self._receive_broken)
            if self._buffer:
                await trio.lowlevel.checkpoint()
            while not self._buffer:
                if self._eof:
                    await trio.lowlevel.checkpoint()
                    return b""
                try:
                    message = await self.transport.receive_message()
                except trio.EndOfChannel:
                    self._eof = True
                    await trio.lowlevel.checkpoint()  # some transports raise EndOfChannel without one
                    return b""
                except trio.BrokenResourceError as exc:
                    self._receive_broken = f"The transport was lost: {exc}"
                    raise
                self.messages_received += 1
                self.ciphertext_bytes_received += len(message)
                try:
                    self._buffer += self._noise.decrypt(message)
                except RemoteProtocolError as exc:
                    self._receive_broken = str(exc)
                    raise
            n = len(self._buffer) if max_bytes is None else min(max_bytes, len(self._buffer))
            out = bytes(self._buffer[:n])
            del self._buffer[:n]
            return out

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._buffer = bytearray()
        await self.transport.aclose()


async def _receive_handshake_message(transport: MessageTransport, number: int) -> bytes:
    """Handshake message `number` (1-3) or the confirmation (4).

    Raises:
        HandshakeRefused: the transport ended before message 3: the initiator refused our key
            (proto_spec 01 §4.3).
        HandshakeError: the transport ended before another message.
    """
    try:
        return await transport.receive_message()
    except trio.EndOfChannel:
        error = HandshakeRefused if number == 3 else HandshakeError
        raise error(
            f"The peer closed the connection before Noise handshake message {number}; it may have refused "
            "our key (not admitted, or not the host the session code names) or our session id."
        ) from None


async def noise_handshake(
    transport: MessageTransport,
    *,
    initiator: bool,
    static_private: bytes,
    prologue: bytes,
    payload: bytes = b"",
    check_remote: Callable[[bytes, bytes], None] | None = None,
) -> NoiseStream:
    """Run Noise XX over ``transport`` and return the secure stream (proto_spec 01 §2, §4).

    The responder's payload rides in message 2, the initiator's in message 3. ``check_remote``
    is called with (remote_static, remote_payload) as soon as both are known (initiator: on
    message 2, before revealing its own static key; responder: on message 3) and may raise
    HandshakeError to refuse. The responder then confirms or refuses in its first transport
    message (proto_spec 01 §4.3), so a refusal on either side is a HandshakeError on both.
    Wrap the call in ``trio.fail_after`` for a timeout.

    Raises:
        HandshakeRefused: the peer refused our key (its confirmation, or its close before
            message 3), or ``check_remote`` raised it.
        HandshakeError: authentication failed (tampering, different prologue), ``check_remote``
            refused, or the peer closed before message 2 or the confirmation. The transport is
            closed on every failure.
        trio.BrokenResourceError: the transport was lost.
    """
    hs = NoiseXX(initiator, static_private, prologue)
    try:
        if initiator:
            await transport.send_message(hs.write_message())
            remote_payload = hs.read_message(await _receive_handshake_message(transport, 2))
            if check_remote is not None:
                check_remote(hs.remote_static, remote_payload)
            await transport.send_message(hs.write_message(payload))
            noise = hs.split()
            confirm = noise.decrypt(await _receive_handshake_message(transport, 4))
            if confirm != CONFIRM_ACCEPT:
                if confirm[:1] == CONFIRM_REFUSE:
                    reason = confirm[1:].decode("utf-8", "replace")
                    raise HandshakeRefused(f"The peer refused the secure channel: {reason}")
                raise HandshakeError("The peer sent a malformed handshake confirmation (proto_spec 01 §4.3).")
        else:
            hs.read_message(await _receive_handshake_message(transport, 1))
            await transport.send_message(hs.write_message(payload))
            remote_payload = hs.read_message(await _receive_handshake_message(transport, 3))
            noise = hs.split()
            if check_remote is not None:
                try:
                    check_remote(hs.remote_static, remote_payload)
                except HandshakeError as exc:
                    reason = str(exc).encode("utf-8")[:_MAX_REASON_BYTES]
                    with trio.move_on_after(1):
                        await transport.send_message(noise.encrypt(CONFIRM_REFUSE + reason))
                    raise
            await transport.send_message(noise.encrypt(CONFIRM_ACCEPT))
    except RemoteProtocolError as exc:  # a confirmation that fails to decrypt
        with trio.CancelScope(shield=True):
            await transport.aclose()
        if isinstance(exc, HandshakeError):
            raise
        raise HandshakeError(f"The Noise handshake confirmation did not authenticate: {exc}") from exc
    except BaseException:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise
    return NoiseStream(
        transport, noise, remote_static=hs.remote_static, remote_payload=remote_payload,
        handshake_hash=hs.handshake_hash,
    )

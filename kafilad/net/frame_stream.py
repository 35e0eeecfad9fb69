"""Frames over any trio stream: the one framing driver (proto_spec 02; DESIGN §4).

Thin driver of the sans-IO ``kafilad.proto.frames`` codec. Every place that exchanges frames
uses it:

    FrameStream(NoiseStream)        a secure link between members (kafilad/node/paths/link.py ``Link``
                                    adds the peer's identity and the LinkClosed errors)
    FrameStream(SocketStream)       the local control socket (kafilad/control/api.py
                                    ``FramedStream``, the same class), no Noise

Sends from several tasks never interleave (one lock per whole frame, proto_spec 02 §3);
receiving is for one task at a time. A stream that ends between frames is a clean end
(``receive`` returns None); one that ends inside a frame, a malformed frame, or a
``RemoteProtocolError`` of the stream itself (an undecryptable Noise message) raises
``RemoteProtocolError`` and closes the stream (proto_spec 02 §2).
"""

from __future__ import annotations

from typing import Any, Mapping

import trio

from kafilad.errors import RemoteProtocolError
from kafilad.proto.frames import MAX_FRAME_BYTES, FrameDecoder, encode_frame

#: Bytes asked of the stream per read. A NoiseStream returns at most one Noise message's
#: plaintext (65,519 bytes) per read whatever is asked; a socket returns what the kernel holds.
RECEIVE_BYTES = 64 * 1024


class FrameStream:
    """Frames (proto_spec 02) over a ``trio.abc.Stream``, with byte counters.

    Args:
        stream: any trio stream: a NoiseStream, a SocketStream, a memory stream.
        max_frame_bytes: frames announced longer than this are refused (proto_spec 02 §2).

    Attributes:
        stream: the stream underneath.
        decoder: the FrameDecoder (``decoder.error`` is set once a malformed frame arrived).
        bytes_sent: frame bytes sent (4 + L each; before any Noise overhead).
        bytes_received: bytes read from the stream.
        frames_sent: frames sent.
    """

    def __init__(self, stream: trio.abc.Stream, *, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.stream = stream
        self.decoder = FrameDecoder(max_frame_bytes)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self._send_lock = trio.Lock()

    async def send(self, body: Mapping[str, Any]) -> int:
        """Encode and send one frame; several tasks may send at once (whole frames, in lock order).

        Args:
            body: the frame body, a map with a str "t" (proto_spec 02 §1.2).
        Returns:
            The frame's size in bytes (4 + L).
        Raises:
            LocalProtocolError: the body is not a valid frame (see ``encode_frame``); nothing is sent.
            trio.BrokenResourceError: the stream is gone (peer lost, or an earlier send was cut).
            trio.ClosedResourceError: we closed the stream.
        """
        data = encode_frame(body)
        async with self._send_lock:
            await self.stream.send_all(data)
        self.bytes_sent += len(data)
        self.frames_sent += 1
        return len(data)

    async def receive(self) -> dict | None:
        """The next frame body, or None once the peer closed cleanly between frames.

        Returns:
            A dict with a str "t", or None at a clean end (again on every later call).
        Raises:
            RemoteProtocolError: a malformed frame, the stream ended inside a frame, or the stream's
                own RemoteProtocolError (a Noise message that failed authentication); the stream is
                then closed (proto_spec 02 §2).
            trio.BrokenResourceError: the stream was lost.
            trio.ClosedResourceError: we closed the stream.
        """
        try:
            while True:
                body = self.decoder.next_event()
                if body is not None:
                    return body
                data = await self.stream.receive_some(RECEIVE_BYTES)
                if not data:
                    self.decoder.receive_eof()  # raises inside a frame
                    return None
                self.bytes_received += len(data)
                self.decoder.receive_data(data)
        except RemoteProtocolError:
            with trio.CancelScope(shield=True):
                try:
                    await self.stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass  # the protocol error is the news
            raise

    async def aclose(self) -> None:
        """Close the stream underneath (idempotent)."""
        await self.stream.aclose()

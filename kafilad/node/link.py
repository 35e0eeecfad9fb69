"""A secure link between two members: Noise XX over any message transport, carrying frames.

Every link of a session (host control channel, ring edge) is made here, so the same checks apply
everywhere (DESIGN §4 "Identity"): the Noise prologue binds the session id, and the remote static
key must be the one expected (the session code's fingerprint for the host, the roster for ring
neighbours). A malformed frame closes only this link, with the reason logged.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import msgpack
import trio

from kafilad.errors import HandshakeError, RemoteProtocolError
from kafilad.net.noise_stream import noise_handshake
from kafilad.proto.frames import FrameDecoder, encode_frame
from kafilad.proto.identity import session_prologue

log = logging.getLogger("kafilad.link")

RECEIVE_BYTES = 1 << 20


class LinkClosed(Exception):
    """The link ended (cleanly or not); `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Link:
    """Frames (proto_spec 02) over an established Noise stream, with byte counters.

    Attributes:
        peer_id, peer_name: the remote member.
        bytes_sent, bytes_received: frame bytes (plaintext, before Noise overhead).
    """

    def __init__(self, stream, *, peer_id: str, peer_name: str, label: str):
        self.stream = stream
        self.peer_id = peer_id
        self.peer_name = peer_name
        self.label = label
        self.bytes_sent = 0
        self.bytes_received = 0
        self._decoder = FrameDecoder()
        self._send_lock = trio.Lock()
        self.closed_reason: Optional[str] = None

    async def send(self, body: dict) -> int:
        """Send one frame; return its size in bytes.

        Raises:
            LinkClosed: the transport is gone.
        """
        data = encode_frame(body)
        async with self._send_lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as e:
                raise LinkClosed(f"link to {self.peer_name} broke while sending: {e or type(e).__name__}") from None
        self.bytes_sent += len(data)
        return len(data)

    async def receive(self) -> dict:
        """Next frame.

        Raises:
            LinkClosed: clean EOF, loss of the transport, or a malformed frame (the link is then
                closed and the reason logged: "a malformed frame closes that link", DESIGN §7).
        """
        while True:
            try:
                ev = self._decoder.next_event()
            except RemoteProtocolError as e:
                await self.close(f"malformed frame from {self.peer_name}: {e}")
                raise LinkClosed(self.closed_reason) from None
            if ev is not None:
                return ev
            try:
                data = await self.stream.receive_some(RECEIVE_BYTES)
            except RemoteProtocolError as e:
                await self.close(f"undecryptable message from {self.peer_name}: {e}")
                raise LinkClosed(self.closed_reason) from None
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as e:
                self.closed_reason = self.closed_reason or f"link to {self.peer_name} was lost ({type(e).__name__})"
                raise LinkClosed(self.closed_reason) from None
            if not data:
                self.closed_reason = self.closed_reason or f"{self.peer_name} closed the link"
                raise LinkClosed(self.closed_reason)
            self.bytes_received += len(data)
            self._decoder.receive_data(data)

    async def close(self, reason: str = "closed") -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
            if reason != "closed":
                log.warning("closing %s link with %s: %s", self.label, self.peer_name, reason)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(2):
                try:
                    await self.stream.aclose()
                except Exception:
                    pass


async def secure_link(transport, *, initiator: bool, static_private: bytes, session_id: str,
                      hello: dict, check_remote: Callable[[bytes, dict], str],
                      label: str, timeout_s: float = 20.0) -> tuple[Link, bytes, dict]:
    """Run Noise XX over `transport` and return (link, remote_static, remote_hello).

    Args:
        hello: small msgpack-able dict sent as the handshake payload (name, peer id, role).
        check_remote: called with (remote_static, remote_hello); returns the peer's display name
            or raises HandshakeError to abort (wrong key, not in the roster).
    Raises:
        HandshakeError: handshake failed, timed out, or check_remote refused the key.
    """
    result: dict = {}

    def check(remote_static: bytes, payload: bytes) -> None:
        try:
            remote_hello = msgpack.unpackb(payload, raw=False) if payload else {}
        except Exception as e:
            raise HandshakeError(f"malformed handshake payload: {e}") from None
        if not isinstance(remote_hello, dict):
            raise HandshakeError("malformed handshake payload: not a map")
        result["name"] = check_remote(remote_static, remote_hello)
        result["hello"] = remote_hello

    try:
        with trio.fail_after(timeout_s):
            stream = await noise_handshake(
                transport, initiator=initiator, static_private=static_private,
                prologue=session_prologue(session_id), payload=msgpack.packb(hello), check_remote=check)
    except trio.TooSlowError:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise HandshakeError(f"the Noise handshake on the {label} link did not finish within {timeout_s:g} s") from None
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as e:
        raise HandshakeError(f"the {label} link closed during the Noise handshake ({type(e).__name__})") from None
    except HandshakeError:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise
    remote_hello = result.get("hello")
    if remote_hello is None:  # check_remote runs when the remote static arrives; payload may come later
        remote_hello = msgpack.unpackb(stream.remote_payload, raw=False) if stream.remote_payload else {}
        result["name"] = check_remote(stream.remote_static, remote_hello)
    link = Link(stream, peer_id=remote_hello.get("peer_id", "?"), peer_name=result["name"], label=label)
    return link, stream.remote_static, remote_hello

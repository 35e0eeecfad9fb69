"""A secure link between two members: Noise XX over any message transport, carrying frames.

Every link of a session (host control channel, ring edge) is made here, so the same checks apply
everywhere (DESIGN §4 "Identity"): the Noise prologue binds the session id, and the remote static
key must be the one expected (the session code's fingerprint for the host, the roster for ring
neighbours). A malformed frame closes only this link, with the reason logged.

Errors (kafilad/errors.py), split as trio splits ``ClosedResourceError`` / ``BrokenResourceError``:

    secure_link     HandshakeTimeout   did not finish in time, or the transport closed during it
                    HandshakeRefused   a key was refused (ours by the peer, or theirs by check_remote)
    Link.send/receive  LinkEnded       the peer closed cleanly between frames, or we closed the link
                       LinkBroken      transport lost, malformed frame, undecryptable message
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import msgpack
import trio

from kafilad.errors import (
    HandshakeError,
    HandshakeRefused,
    HandshakeTimeout,
    LinkBroken,
    LinkClosed,
    LinkEnded,
    RemoteProtocolError,
)
from kafilad.net.frame_stream import FrameStream
from kafilad.net.noise_stream import noise_handshake
from kafilad.proto.identity import session_prologue

__all__ = ["Link", "LinkBroken", "LinkClosed", "LinkEnded", "secure_link"]

log = logging.getLogger("kafilad.link")

#: Transport errors that mean the link is gone (ClosedResourceError after our own close).
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel)


class Link(FrameStream):
    """A FrameStream (proto_spec 02) to a known peer, raising LinkEnded / LinkBroken.

    Args:
        stream: the established stream (a NoiseStream from ``secure_link``; any trio stream in tests).
        peer_id, peer_name: the remote member.
        label: "ctl" or "ring" (proto_spec 05 §1), for logs.

    Attributes:
        peer_id, peer_name, label: as given.
        bytes_sent, bytes_received: frame bytes (plaintext, before Noise overhead).
        closed_reason: None while open; else why it ended (a sentence naming the peer).
    """

    def __init__(self, stream: trio.abc.Stream, *, peer_id: str, peer_name: str, label: str):
        super().__init__(stream)
        self.peer_id = peer_id
        self.peer_name = peer_name
        self.label = label
        self.closed_reason: Optional[str] = None
        self._closed_as: type[LinkClosed] = LinkEnded

    def _ended(self, closed_as: type[LinkClosed], reason: str) -> LinkClosed:
        """Record the first way the link ended; return the error for it (later calls repeat it)."""
        if self.closed_reason is None:
            self.closed_reason, self._closed_as = reason, closed_as
        return self._closed_as(self.closed_reason)

    async def send(self, body: dict) -> int:
        """Send one frame; return its size in bytes (4 + L).

        Raises:
            LinkEnded: we closed the link (``close``) or it had ended cleanly before.
            LinkBroken: the transport is gone, or the link broke before.
            LocalProtocolError: the body is not a valid frame; nothing was sent.
        """
        try:
            return await super().send(body)
        except trio.ClosedResourceError:
            raise self._ended(LinkEnded, f"the link to {self.peer_name} was closed") from None
        except _GONE as e:
            raise self._ended(
                LinkBroken, f"link to {self.peer_name} broke while sending: {e or type(e).__name__}") from None

    async def receive(self) -> dict:
        """Next frame.

        Raises:
            LinkEnded: the peer closed cleanly between frames, or we closed the link.
            LinkBroken: loss of the transport, a malformed frame, an undecryptable message, or a
                close inside a frame (the link is then closed and the reason logged: "a malformed
                frame closes that link", DESIGN §7).
        """
        try:
            body = await super().receive()
        except RemoteProtocolError as e:
            what = "malformed frame" if self.decoder.error is not None else "undecryptable message"
            reason = f"{what} from {self.peer_name}: {e}"
            await self.close(reason, broken=True)
            raise self._ended(LinkBroken, reason) from None
        except trio.ClosedResourceError:
            raise self._ended(LinkEnded, f"the link to {self.peer_name} was closed") from None
        except _GONE as e:
            raise self._ended(LinkBroken, f"link to {self.peer_name} was lost ({type(e).__name__})") from None
        if body is None:
            raise self._ended(LinkEnded, f"{self.peer_name} closed the link")
        return body

    async def close(self, reason: str = "closed", *, broken: bool = False) -> None:
        """Close the link (idempotent; shielded, at most 2 s). Later sends and receives raise
        LinkEnded with `reason` (LinkBroken if `broken`), unless the link had ended before.

        A reason other than "closed" is logged as a warning.
        """
        if self.closed_reason is None:
            self._ended(LinkBroken if broken else LinkEnded, reason)
            if reason != "closed":
                log.warning("closing %s link with %s: %s", self.label, self.peer_name, reason)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(2):
                try:
                    await self.stream.aclose()
                except Exception:  # closing is best effort: the link is gone either way
                    pass

    async def aclose(self) -> None:
        """As ``close()``."""
        await self.close()


async def secure_link(transport, *, initiator: bool, static_private: bytes, session_id: str,
                      hello: dict, check_remote: Callable[[bytes, dict], str],
                      label: str, timeout_s: float = 20.0) -> tuple[Link, bytes, dict]:
    """Run Noise XX over `transport` and return (link, remote_static, remote_hello).

    Args:
        transport: a MessageTransport (relayed circuit, QUIC stream, memory pair); closed on failure.
        hello: small msgpack-able dict sent as the handshake payload (name, peer id, role).
        check_remote: called with (remote_static, remote_hello); returns the peer's display name
            or raises HandshakeError to refuse (wrong key, not in the roster).
        label: "ctl" or "ring", for messages.
        timeout_s: bound on the whole handshake.
    Raises:
        HandshakeTimeout: the handshake did not finish within `timeout_s`, or the transport closed
            during it (on a direct path: "this path does not carry us", proto_spec 07 §3).
        HandshakeRefused: check_remote refused the peer's key (its message kept), or the peer
            refused ours (proto_spec 01 §4.3).
        HandshakeError: otherwise malformed or unauthenticated handshake (e.g. another session's
            prologue, a malformed payload).
    """
    result: dict = {}

    def check(remote_static: bytes, payload: bytes) -> None:
        try:
            remote_hello = msgpack.unpackb(payload, raw=False) if payload else {}
        except Exception as e:  # msgpack raises many types
            raise HandshakeError(f"malformed handshake payload: {e}") from None
        if not isinstance(remote_hello, dict):
            raise HandshakeError("malformed handshake payload: not a map")
        try:
            result["name"] = check_remote(remote_static, remote_hello)
        except HandshakeRefused:
            raise
        except HandshakeError as e:  # check_remote's refusal, message kept
            raise HandshakeRefused(str(e)) from None
        result["hello"] = remote_hello

    try:
        with trio.fail_after(timeout_s):
            stream = await noise_handshake(
                transport, initiator=initiator, static_private=static_private,
                prologue=session_prologue(session_id), payload=msgpack.packb(hello), check_remote=check)
    except trio.TooSlowError:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise HandshakeTimeout(
            f"the Noise handshake on the {label} link did not finish within {timeout_s:g} s") from None
    except _GONE as e:
        raise HandshakeTimeout(f"the {label} link closed during the Noise handshake ({type(e).__name__})") from None
    except HandshakeError:
        with trio.CancelScope(shield=True):
            await transport.aclose()
        raise
    remote_hello = result["hello"]  # noise_handshake calls `check` before it returns the stream
    link = Link(stream, peer_id=remote_hello.get("peer_id", "?"), peer_name=result["name"], label=label)
    return link, stream.remote_static, remote_hello

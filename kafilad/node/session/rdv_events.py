"""The events a rendezvous client hands its session (proto_spec 03 §2.2-§2.3), as frozen records:
kafilad/node/session/rdv_client.py's reader makes them; host, member and path drivers match on them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs


@attrs.frozen
class MemberJoined:
    """A member joined our session (proto_spec §2.2 `member_joined`)."""

    type: ClassVar[str] = "member_joined"

    peer_id: str
    name: str


@attrs.frozen
class MemberLeft:
    """A member left or lost its connection (proto_spec §2.2 `member_left`)."""

    type: ClassVar[str] = "member_left"

    peer_id: str
    reason: str


@attrs.frozen
class Signal:
    """An opaque signalling body from another member (proto_spec §2.2 `signal`)."""

    type: ClassVar[str] = "signal"

    from_peer_id: str
    body: Any


@attrs.frozen
class SessionClosed:
    """The host left; the session is gone (proto_spec §2.2 `session_closed`)."""

    type: ClassVar[str] = "session_closed"

    session_id: str
    reason: str


@attrs.frozen
class RendezvousErrorEvent:
    """A non-fatal `error` not tied to a waiting request, e.g. `budget_exhausted` (proto_spec §2.3)."""

    type: ClassVar[str] = "error"

    code: str
    reason: str


@attrs.frozen
class Disconnected:
    """The WebSocket to the rendezvous is gone; every circuit is broken. Always the last event."""

    type: ClassVar[str] = "disconnected"

    reason: str


#: Every event has a `type` class attribute equal to the proto_spec §2.2 message type.
RendezvousEvent = MemberJoined | MemberLeft | Signal | SessionClosed | RendezvousErrorEvent | Disconnected

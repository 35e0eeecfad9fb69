"""Client of the rendezvous service: registration, join, signalling and relayed circuits.

DESIGN §3 steps 1-2 and §4 "Relay"; wire format in proto_spec/03-rendezvous.md. One WebSocket per
daemon; a reader task routes replies to the waiting request, membership and signal messages to
`events`, relay data to the circuit it belongs to.

Identity (proto_spec §2.4): the rendezvous sends a `challenge` on connect; `open_rendezvous`
waits for it, and `register` / `join` carry the static public key and a proof made with the
static private key (`kafilad.proto.rendezvous_proof`), so nobody can claim another daemon's
peer id. The peer id is derived from the key, never given.

Backpressure: each circuit buffers at most `circuit_buffer` messages; when one is full the reader
waits, which stalls the whole WebSocket (and, through TCP, the sender at the rendezvous). Read
every circuit you open or accept, and read `events`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator

import attrs
import trio
import trio_websocket
from trio_websocket import ConnectionClosed, WebSocketConnection

from kafilad.errors import LocalProtocolError, RemoteProtocolError, RendezvousRefused, SessionError, collapse_groups
from kafilad.net.channels import send_noting_stall
from kafilad.node.session.rdv_events import (Disconnected, MemberJoined, MemberLeft, RendezvousErrorEvent,  # noqa: F401
                                     RendezvousEvent, SessionClosed, Signal)  # (re-exported: the drivers import them here)
from kafilad.proto.identity import peer_id as peer_id_of
from kafilad.proto.rendezvous import (
    ControlMessage,
    RelayData,
    RendezvousLimits,
    close_clause,
    decode_message,
    encode_control,
    encode_relay,
)
from kafilad.proto.rendezvous_proof import KEY_BYTES, NONCE_BYTES, Challenge, make_proof, public_key

log = logging.getLogger(__name__)
#: a circuit whose full buffer has held up the whole connection this long is named in the log (s)
STALL_WARNING_S = 1.0


def _closed_by_rendezvous(exc: ConnectionClosed) -> str:
    """How the rendezvous's WebSocket closed, in plain words ("the rendezvous is going away
    (shutting down)"); the close code goes to the log only."""
    close = exc.reason
    return close_clause(getattr(close, "code", None), getattr(close, "reason", None), who="the rendezvous",
                        peer="the rendezvous")


class Circuit:
    """A relayed circuit to one peer; implements the MessageTransport protocol (DESIGN §4).

    Attributes:
        circuit_id: the rendezvous' uint64 id (proto_spec §4).
        peer_id: the remote member's peer id.
        label: what the opener said the circuit is for.
    """

    def __init__(self, client: RendezvousClient, circuit_id: int, peer_id: str, label: str, buffer: int):
        self._client = client
        self.circuit_id, self.peer_id, self.label = circuit_id, peer_id, label
        self._in_send, self._in_recv = trio.open_memory_channel[bytes](buffer)
        self._closed_locally = False
        self.close_reason: str | None = None  # why the remote end or the rendezvous closed it
        self._broken = False

    def __repr__(self) -> str:
        return f"<Circuit {self.circuit_id:#x} to {self.peer_id} label={self.label!r}>"

    async def send_message(self, data: bytes) -> None:
        """Send one message (at most `max_payload_bytes`; one Noise message, DESIGN §4).

        Raises:
            trio.ClosedResourceError: we closed this circuit.
            trio.BrokenResourceError: the other end closed it or the rendezvous connection is lost.
            LocalProtocolError: `data` is larger than the relay accepts.
        """
        if self._closed_locally:
            raise trio.ClosedResourceError(f"The circuit to {self.peer_id} was closed by this side.")
        if self.close_reason is not None:
            raise trio.BrokenResourceError(f"The circuit to {self.peer_id} is closed: {self.close_reason}")
        limit = self._client.limits.max_relay_payload_bytes
        if len(data) > limit:
            raise LocalProtocolError(
                f"A relayed message of {len(data)} bytes exceeds the relay's limit of {limit} bytes; "
                "chunk it into Noise messages first."
            )
        await self._client._send_raw(encode_relay(self.circuit_id, data))

    async def receive_message(self) -> bytes:
        """Receive the next message, in order.

        Raises:
            trio.EndOfChannel: the other end closed the circuit (after its last message).
            trio.BrokenResourceError: the rendezvous connection was lost.
            trio.ClosedResourceError: we closed this circuit.
        """
        try:
            return await self._in_recv.receive()
        except trio.EndOfChannel:
            if self._broken:
                raise trio.BrokenResourceError(
                    f"The circuit to {self.peer_id} broke: {self.close_reason}"
                ) from None
            raise

    async def aclose(self, reason: str = "closed by peer") -> None:
        """Close the circuit; the other end gets EndOfChannel. Idempotent."""
        if self._closed_locally:
            return
        self._closed_locally = True
        self._in_recv.close()
        self._client._circuits.pop(self.circuit_id, None)
        if self.close_reason is None:
            try:
                await self._client._send_control(t="circuit_close", circuit=self.circuit_id, reason=reason)
            except trio.BrokenResourceError:
                pass

    def _remote_closed(self, reason: str, broken: bool) -> None:
        if self.close_reason is None:
            self.close_reason, self._broken = reason, broken
        self._in_send.close()


@attrs.define
class _Pending:
    done: trio.Event = attrs.Factory(trio.Event)
    reply: dict | None = None
    label: str = ""


#: seconds between WebSocket pings of a daemon's rendezvous connection (issue 8 §3: at most 30 s)
PING_INTERVAL_S = 20.0

class RendezvousClient:
    """One daemon's connection to the rendezvous; make it with `open_rendezvous`.

    Attributes:
        url, name: as given to `open_rendezvous`.
        static_public: the 32-byte X25519 public key of the static key given to `open_rendezvous`.
        peer_id: its peer id (proto_spec 01 §1.1), proven to the rendezvous (proto_spec 03 §2.4).
        session_id: set by `register` or `join`.
        roster: after `join`, the members as [{"peer_id", "name"}] (host first).
        events: receive channel of `RendezvousEvent`s; ends after `Disconnected`.
        incoming_circuits: receive channel of `Circuit`s opened to us.
    """

    def __init__(self, ws: WebSocketConnection, url: str, static_private: bytes, name: str,
                 limits: RendezvousLimits, circuit_buffer: int, event_buffer: int):
        self._ws, self.url, self.name, self.limits = ws, url, name, limits
        self._static_private = bytes(static_private)
        self.static_public = public_key(static_private)
        self.peer_id = peer_id_of(self.static_public)
        self._challenge: Challenge | None = None
        self._challenged = trio.Event()  # set on `challenge` or when the connection is lost
        self._circuit_buffer = circuit_buffer
        self._reqs = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._circuits: dict[int, Circuit] = {}
        self._events_send, self.events = trio.open_memory_channel[RendezvousEvent](event_buffer)
        self._incoming_send, self.incoming_circuits = trio.open_memory_channel[Circuit](event_buffer)
        self._lost: str | None = None
        self.session_id: str | None = None
        self.roster: list[dict] = []
        self.stun_servers: list[str] = []  # [paths] the rendezvous's STUN addresses, "ip:port"

    # --- requests -------------------------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why the connection to the rendezvous ended, or None while it is up."""
        return self._lost

    async def register(self, model_id: str, members: int, capability: dict, *, session_id: str | None = None) -> str:
        """Open a session as its host (DESIGN §3 step 1; proto_spec §2.1 `register`, §2.5 re-registration).

        Args:
            model_id: the model the host serves.
            members: expected member count, host included.
            capability: the host's capability map (msgpack-serialisable).
            session_id: re-create this session (after a rendezvous or host restart), proven with the
                same key; None opens a new one.
        Returns:
            the session id (8 lowercase base32 characters).
        Raises:
            SessionError: the rendezvous refused, with its reason, or the connection was lost.
        """
        extra = {"session_id": session_id} if session_id else {}
        reply = await self._request("register", model_id=model_id, members=members, capability=capability,
                                    **extra, **self._identity("register", session_id or ""))
        self.session_id = reply["session_id"]
        self.stun_servers = list(reply.get("stun") or [])  # [paths] proto_spec 07 §1
        return self.session_id

    async def join(self, session_id: str, host_fingerprint: str) -> str:
        """Join a session as a member (DESIGN §3 step 2; proto_spec §2.1 `join`).

        A member that joins again while its older connection is still in the session replaces
        that connection (proto_spec 03 §2.4 "superseded"). `host_fingerprint` is the code's part
        after its '-': the rendezvous holds a session under the whole code (proto_spec 03 §2.2).

        Returns:
            the host's peer id (check it against the code's fingerprint in the Noise handshake).

        Raises:
            SessionError: unknown session, session full, another key's member holds this peer id
                (the server's reason), or the connection was lost.
        """
        reply = await self._request("join", session_id=session_id, host_fingerprint=host_fingerprint,
                                    **self._identity("join", session_id))
        self.session_id, self.roster = reply["session_id"], list(reply.get("members", []))
        self.stun_servers = list(reply.get("stun") or [])  # [paths] proto_spec 07 §1
        return reply["host_peer_id"]

    async def leave(self, reason: str = "it left") -> None:
        """Leave the session and keep the connection (proto_spec §2.1 `leave`)."""
        await self._send_control(t="leave", reason=reason)
        self.session_id = None

    async def send_signal(self, to: str, body: Any) -> None:
        """Send an opaque signalling body to a member (proto_spec §2.1 `signal`).

        An unknown addressee comes back as a `RendezvousErrorEvent` with code `unknown_peer`.
        Raises:
            trio.BrokenResourceError: the rendezvous connection is lost.
        """
        await self._send_control(t="signal", to=to, body=body, req=next(self._reqs))

    async def open_circuit(self, to_peer_id: str, label: str) -> Circuit:
        """Open a relayed circuit to a member of our session (proto_spec §4).

        Raises:
            SessionError: the peer is not in the session, too many circuits, or the connection is lost.
        """
        reply = await self._request("circuit_open", to=to_peer_id, label=label)
        return self._circuits[reply["circuit"]]  # registered by the reader, before any data

    async def accept_circuit(self) -> Circuit:
        """Wait for the next circuit another member opens to us.

        Raises:
            trio.BrokenResourceError: the rendezvous connection is lost.
        """
        try:
            return await self.incoming_circuits.receive()
        except trio.EndOfChannel:
            raise trio.BrokenResourceError(
                f"The connection to the rendezvous at {self.url} is lost: {self._lost}") from None

    # --- plumbing -------------------------------------------------------------------------------

    def _identity(self, request_type: str, session_id: str) -> dict:
        """The identity fields of a `register` / `join` (proto_spec 03 §2.4)."""
        if self._challenge is None:
            raise SessionError(f"The connection to the rendezvous at {self.url} is lost: {self._lost}")
        try:
            static_public, proof = make_proof(self._static_private, self._challenge, request_type, session_id,
                                              self.name)
        except LocalProtocolError as exc:  # an unusable challenge key: the rendezvous is at fault
            raise SessionError(f"Cannot prove this daemon's key to the rendezvous at {self.url}: {exc}") from None
        return {"peer_id": self.peer_id, "name": self.name, "static_public": static_public, "proof": proof}

    async def _send_raw(self, data: bytes) -> None:
        if self._lost is not None:
            raise trio.BrokenResourceError(f"The connection to the rendezvous at {self.url} is lost: {self._lost}")
        try:
            await self._ws.send_message(data)
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError(
                f"The connection to the rendezvous at {self.url} is lost: {self._lost or _closed_by_rendezvous(exc)}"
            ) from None

    async def _send_control(self, **msg: Any) -> None:
        await self._send_raw(encode_control(msg))

    async def _request(self, type_: str, **fields: Any) -> dict:
        req = next(self._reqs)
        pending = self._pending[req] = _Pending(label=fields.get("label", ""))
        try:
            await self._send_control(t=type_, req=req, **fields)
            await pending.done.wait()
        except trio.BrokenResourceError as exc:
            raise SessionError(str(exc)) from None
        finally:
            self._pending.pop(req, None)
        reply = pending.reply
        if reply is None:
            raise SessionError(f"The connection to the rendezvous at {self.url} is lost: {self._lost}")
        if reply["t"] == "error":
            raise RendezvousRefused(str(reply.get("reason", "The rendezvous refused without a reason.")),
                                    str(reply.get("code") or ""))
        return reply

    async def _keepalive(self, interval_s: float) -> None:
        """A WebSocket ping every `interval_s` (≤ 30 s), so idle-timeout proxies (commonly 60-100 s) keep
        the connection; a ping unanswered for another interval closes it as lost (issue 8 §3)."""
        while self._lost is None:
            await trio.sleep(interval_s)
            try:
                with trio.move_on_after(interval_s) as scope:
                    await self._ws.ping()
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if scope.cancelled_caught:
                self._lost = self._lost or f"the rendezvous did not answer a ping within {interval_s:g} s"
                with trio.move_on_after(2):
                    await self._ws.aclose(1001, "no pong")
                return

    async def _reader(self) -> None:
        reason = "the connection closed"
        try:
            while True:
                try:
                    data = await self._ws.get_message()
                except ConnectionClosed as exc:
                    if self._lost is None:
                        reason = _closed_by_rendezvous(exc)
                        log.info("rendezvous %s: the connection closed (%s)", self.url, exc.reason)
                    break
                try:
                    msg = decode_message(data)
                    if isinstance(msg, RelayData):
                        await self._on_relay(msg)
                    else:
                        await self._on_control(msg)
                except (RemoteProtocolError, KeyError, TypeError) as exc:
                    reason = f"the rendezvous sent a malformed message: {exc}"
                    log.warning("rendezvous %s: %s", self.url, reason)
                    await self._ws.aclose(1008, reason[:120])
                    break
        finally:
            self._lost = self._lost or reason
            self._fail_everything()
        with trio.move_on_after(1.0):
            await self._events_send.send(Disconnected(self._lost))
        self._events_send.close()

    def _fail_everything(self) -> None:
        self._challenged.set()
        for pending in self._pending.values():
            pending.done.set()
        for circuit in list(self._circuits.values()):
            circuit._remote_closed(f"the connection to the rendezvous is lost: {self._lost}", broken=True)
        self._circuits.clear()
        self._incoming_send.close()

    async def _on_relay(self, msg: RelayData) -> None:
        circuit = self._circuits.get(msg.circuit_id)
        if circuit is None:
            return  # we closed it; the rendezvous will learn from our circuit_close
        try:
            await _put(circuit._in_send, msg.payload, repr(circuit))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # closed locally while we waited for buffer space

    async def _on_control(self, msg: ControlMessage) -> None:
        f, t = msg.fields, msg.type
        req = f.get("req")
        if t in ("registered", "joined", "circuit_opened", "error") and req in self._pending:
            pending = self._pending[req]
            if t == "circuit_opened":  # register now: the peer's first data may follow at once
                self._circuits[f["circuit"]] = Circuit(self, f["circuit"], f["to"], pending.label,
                                                       self._circuit_buffer)
            pending.reply = f
            pending.done.set()
            return
        if t == "circuit_opened":  # its open_circuit was cancelled: give the circuit back
            with contextlib.suppress(trio.BrokenResourceError):
                await self._send_control(t="circuit_close", circuit=f["circuit"], reason="the opener gave up")
        elif t == "challenge":
            server_public, nonce = f["server_public"], f["nonce"]
            if not (isinstance(server_public, bytes) and len(server_public) == KEY_BYTES
                    and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
                raise RemoteProtocolError(
                    f"A challenge needs a {KEY_BYTES}-byte 'server_public' and a {NONCE_BYTES}-byte 'nonce'.")
            self._challenge = Challenge(server_public, nonce)
            self._challenged.set()
        elif t == "circuit_incoming":
            circuit = Circuit(self, f["circuit"], f["from"], f["label"], self._circuit_buffer)
            self._circuits[circuit.circuit_id] = circuit
            await _put(self._incoming_send, circuit, "incoming circuits")
        elif t == "circuit_closed":
            circuit = self._circuits.pop(f["circuit"], None)
            if circuit is not None:
                circuit._remote_closed(f["reason"], broken=False)
        elif t == "member_joined":
            await _put(self._events_send, MemberJoined(f["peer_id"], f["name"]), "events")
        elif t == "member_left":
            await _put(self._events_send, MemberLeft(f["peer_id"], f["reason"]), "events")
        elif t == "signal":
            await _put(self._events_send, Signal(f["from"], f.get("body")), "events")
        elif t == "session_closed":
            self.session_id = None
            await _put(self._events_send, SessionClosed(f["session_id"], f["reason"]), "events")
        elif t == "error":
            if f.get("fatal"):
                self._lost = f"the rendezvous closed the connection: {f.get('reason')}"
            await _put(self._events_send, RendezvousErrorEvent(f.get("code", ""), f.get("reason", "")), "events")
        else:
            log.debug("rendezvous %s: ignoring message type %r", self.url, t)


def _handshake_reason(exc: trio_websocket.HandshakeError) -> str:
    """A sentence for a failed WebSocket opening handshake (trio_websocket's errors print as "HandshakeError()")."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, trio_websocket.ConnectionRejected):
        return f"it answered HTTP {exc.status_code} instead of opening a WebSocket"
    if isinstance(exc, trio_websocket.ConnectionTimeout):
        return "it did not answer within the connect timeout"
    if cause is not None:
        return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return str(exc) or "the WebSocket handshake failed"


async def _put(channel: trio.MemorySendChannel, item, what: str) -> None:
    """Hand one received item to its consumer; the connection's reader waits while `channel` is
    full (module docstring), and a wait longer than STALL_WARNING_S names the consumer in the log."""
    await send_noting_stall(channel, item, STALL_WARNING_S, lambda: log.warning(
        "the rendezvous connection has waited %g s for the reader of %s; every circuit of this connection "
        "waits with it", STALL_WARNING_S, what))


@asynccontextmanager
async def open_rendezvous(
    url: str,
    *,
    static_private: bytes,
    name: str,
    limits: RendezvousLimits | None = None,
    circuit_buffer: int = 64,
    event_buffer: int = 256,
    connect_timeout_s: float = 10.0,
    ping_interval_s: float = PING_INTERVAL_S,
) -> AsyncIterator[RendezvousClient]:
    """Connect to the rendezvous at `url` (ws:// or wss://) for the duration of the block.

    Args:
        url: the rendezvous URL (configuration, not part of the session code; DESIGN §3 step 1).
        static_private: this daemon's 32-byte X25519 static private key; the peer id is derived
            from it and proven to the rendezvous (proto_spec 03 §2.4).
        name: this daemon's display name.
        limits: must agree with the server's relay payload limit; None means the defaults.
        circuit_buffer: messages buffered per circuit before the reader waits (backpressure).
        event_buffer: events and incoming circuits buffered before the reader waits.
        connect_timeout_s: give up connecting, or waiting for the `challenge`, after this many seconds.
        ping_interval_s: seconds between WebSocket pings (a ping unanswered this long ends the connection).
    Raises:
        SessionError: the rendezvous cannot be reached, refused the WebSocket, or sent no challenge.
        LocalProtocolError: ``static_private`` is not 32 bytes.
    """
    limits = limits or RendezvousLimits()
    public_key(static_private)  # a bad key fails here, before any connection
    async with AsyncExitStack() as stack:
        try:
            ws = await stack.enter_async_context(trio_websocket.open_websocket_url(
                url, max_message_size=limits.ws_max_message_bytes, connect_timeout=connect_timeout_s,
                disconnect_timeout=5,
            ))
        except ValueError:  # trio_websocket's words for a malformed URL
            raise SessionError(f"The rendezvous URL {url!r} is not a WebSocket URL: it must look like "
                               "ws://HOST:PORT or wss://HOST:PORT.") from None
        except trio_websocket.HandshakeError as exc:
            raise SessionError(f"Cannot reach the rendezvous at {url}: {_handshake_reason(exc)}. Check the URL "
                               "and that the rendezvous is running.") from None
        except OSError as exc:
            raise SessionError(f"Cannot reach the rendezvous at {url}: {exc.strerror or exc}. Check the URL and "
                               "that the rendezvous is running.") from None
        client = RendezvousClient(ws, url, static_private, name, limits, circuit_buffer, event_buffer)
        stack.push_async_exit(_goodbye_on_error(ws))
        with collapse_groups():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)
                nursery.start_soon(client._keepalive, ping_interval_s)
                try:
                    with trio.move_on_after(connect_timeout_s):
                        await client._challenged.wait()
                    if client._challenge is None:
                        why = (f"the connection was lost: {client._lost}" if client._lost is not None else
                               f"it sent no key challenge within {connect_timeout_s:g} s; it may run a Kafila "
                               "version without key proofs (proto_spec 03 §2.4), so upgrade it")
                        raise SessionError(f"Cannot use the rendezvous at {url}: {why}.")
                    yield client
                finally:
                    nursery.cancel_scope.cancel()


#: seconds a stopping daemon's connection may take to send its close frame; the reply is not awaited (the
#: stop cancels the connection's reader too): a stop took 1.05 s with 1 s here, 0.28 s with 0.1 (0.27 without)
GOODBYE_BOUND_S = 0.1


def _goodbye_on_error(ws):
    """open_rendezvous's exit callback: a block ended by an exception (a stopping daemon's cancellation)
    closes `ws` with 1001 "going away" (RFC 6455 §7.4.1), shielded and bounded, so the others do not
    read "the connection dropped without a goodbye". A normal end closes with trio_websocket's 1000."""
    async def on_exit(exc_type, exc, tb) -> bool:
        if exc_type is not None and ws.closed is None:
            with trio.move_on_after(GOODBYE_BOUND_S) as scope:
                scope.shield = True
                await ws.aclose(1001)
        return False
    return on_exit


class CurrentRendezvous:
    """The session's rendezvous client of the moment: it is replaced on every reconnect, and the
    session's paths (kafilad/node/paths/manager.py) reach the current one through this handle.

    Attribute access goes to the current client; while there is none, a SessionError says so.
    """

    #: what the last client said of itself stays readable while there is none
    _KEPT = ("peer_id", "url", "stun_servers", "session_id", "lost", "name")

    def __init__(self):
        self.client = None
        self.last = None

    def __setattr__(self, name: str, value) -> None:
        if name == "client" and value is not None:
            object.__setattr__(self, "last", value)
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        client = self.__dict__.get("client")
        if client is None:
            last = self.__dict__.get("last")
            if name in self._KEPT and last is not None:
                return getattr(last, name)
            raise SessionError("the rendezvous is reconnecting")
        return getattr(client, name)

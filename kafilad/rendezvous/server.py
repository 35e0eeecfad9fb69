"""The rendezvous WebSocket server: a thin trio driver around `RendezvousState`.

DESIGN §2 (rendezvous role), §3 steps 1-2, §4 "Relay"; wire format and rules in
proto_spec/03-rendezvous.md. Every connection gets a reader (feeds the state machine, pauses for
rate limits) and a writer draining a bounded outbound queue. Actions are queued in the order the
state machine emits them, so causal order holds across connections: `circuit_incoming` is queued
to B before `circuit_opened` to A, hence before any data A or B can send on the circuit.
A slow receiver fills its queue and thereby slows whoever sends to it (backpressure, never drops),
except a connection the state machine has already closed (a violation, or `superseded` by a newer
proven connection of the same key, proto_spec §2.4): if its queue is full it is aborted instead, so
a stale half-open connection never stalls the one replacing it.

A connection must `register` or `join` (be told `registered` / `joined`, proto_spec §2.1) within
`register_timeout_s` of connecting; one that does not is closed (1008, the reason says why), so
idle or half-open WebSockets cannot pile up. Every connection runs inside a guard: an error in
its handling ends that connection, never the server. A plain HTTP request (a browser, `curl`) is
answered 426 with a sentence saying what this port is (`not_websocket_answer`), not wsproto's
empty 400. The log names the close code the rendezvous itself sent (1008 and its reason), not the
peer's echo of it.
"""

from __future__ import annotations

import itertools
import logging
import os
from functools import partial
from typing import BinaryIO, Optional

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, WebSocketRequest, WebSocketServer

from kafilad.proto.rendezvous import (
    CLOSE_POLICY_VIOLATION,
    Action,
    CloseConn,
    RecordPayload,
    RendezvousLimits,
    RendezvousState,
    SendTo,
    close_clause,
    decode_message,
    encode_relay_record,
)
from kafilad.errors import RemoteProtocolError
from kafilad.net.channels import send_noting_stall

log = logging.getLogger(__name__)

#: Environment variable naming the relay record file (proto_spec §7) when `record_path` is None.
RECORD_ENV = "KAFILA_RELAY_RECORD"
#: Outbound messages queued per connection before senders to it wait.
OUTBOUND_QUEUE_MESSAGES = 64
#: a sender held up this long by a full outbound queue is named in the log (s)
STALL_WARNING_S = 1.0
#: Seconds a connection may take to register or join before it is closed.
REGISTER_TIMEOUT_S = 10.0
#: the most bytes of a request's head read to tell a WebSocket upgrade from a plain HTTP request
MAX_HEAD_BYTES = 16 * 1024
#: what a plain HTTP request to the rendezvous is told (426 Upgrade Required, text/plain)
NOT_A_WEBSOCKET = "This is a Kafila rendezvous: connect with a WebSocket (kafilad --rendezvous ws://HOST:PORT).\n"


def not_websocket_answer(head: bytes) -> bytes | None:
    """The answer to a whole HTTP request head (up to its blank line) that asks for no WebSocket
    upgrade: 426 Upgrade Required (RFC 9110 §15.5.22: with `Upgrade: websocket`) and a plain-text
    sentence, no body for HEAD. None for an upgrade request (wsproto answers the handshake) and for
    bytes that are no HTTP/1 request (wsproto refuses those).
    """
    lines = head.split(b"\r\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or not request_line[2].startswith(b"HTTP/1."):
        return None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"upgrade" and b"websocket" in value.lower():
            return None
    body = b"" if request_line[0] == b"HEAD" else NOT_A_WEBSOCKET.encode()
    return (b"HTTP/1.1 426 Upgrade Required\r\nupgrade: websocket\r\nconnection: close\r\n"
            b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n\r\n" % len(NOT_A_WEBSOCKET.encode())
            ) + body


class _HeadCheckedStream(trio.abc.Stream):
    """A connection whose first request head is read here before trio-websocket sees it: a plain
    HTTP request gets `not_websocket_answer` and then reads as closed; anything else is passed on
    byte for byte. (trio-websocket has no hook for non-upgrade requests: wsproto answers them 400
    with no body.) Reading the head is bounded by the server's `connect_timeout`."""

    def __init__(self, stream: trio.abc.Stream):
        self._stream = stream
        self._pending = b""
        self._checked = False
        #: the TCP peer's address, for the limits per source address (proto_spec 03 §5); None if unknown
        self.peer_address: Optional[str] = None
        sock = getattr(stream, "socket", None)
        if sock is not None:
            try:
                self.peer_address = str(sock.getpeername()[0])
            except OSError:
                pass

    async def _check_head(self) -> None:
        self._checked = True
        head = b""
        while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
            data = await self._stream.receive_some(MAX_HEAD_BYTES)
            if not data:
                break
            head += data
        end = head.find(b"\r\n\r\n")
        answer = not_websocket_answer(head[:end]) if end >= 0 else None
        if answer is None:
            self._pending = head
            return
        try:
            await self._stream.send_all(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self._stream.aclose()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._checked:
            await self._check_head()
        if self._pending:
            n = len(self._pending) if max_bytes is None else max_bytes
            data, self._pending = self._pending[:n], self._pending[n:]
            return data
        try:
            return await self._stream.receive_some(max_bytes)
        except trio.ClosedResourceError:  # closed after a plain HTTP answer: reads as the end
            return b""

    async def send_all(self, data) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


class _HeadCheckedListener(trio.abc.Listener):
    """A TCP listener whose connections are `_HeadCheckedStream`s."""

    def __init__(self, listener: trio.SocketListener):
        self.listener = listener

    async def accept(self) -> _HeadCheckedStream:
        return _HeadCheckedStream(await self.listener.accept())

    async def aclose(self) -> None:
        await self.listener.aclose()


def describe_close(exc: ConnectionClosed) -> str:
    """How a member's WebSocket closed, as the rest of "member X left the session: ...", in plain words
    (`close_clause`: 1006 -> "the connection dropped without a goodbye (...)"); the code is logged."""
    reason = exc.reason
    if reason is None:
        return "its connection closed"
    return close_clause(reason.code, reason.reason)


class RendezvousServer:
    """Connection bookkeeping for `serve_rendezvous`; one instance per listening server.

    Args:
        limits: the server's limits (proto_spec §5).
        record: open binary file to append relay records to (proto_spec §7), or None.
        register_timeout_s: a connection not registered or joined by then is closed.
    """

    def __init__(self, limits: RendezvousLimits, record: BinaryIO | None = None, stun_addresses=(),
                 register_timeout_s: float = REGISTER_TIMEOUT_S):
        self.state = RendezvousState(limits, stun_addresses=stun_addresses)
        self._record = record
        self._ids = itertools.count(1)
        self._queues: dict[int, trio.MemorySendChannel] = {}
        self._scopes: dict[int, trio.CancelScope] = {}
        self._unregistered: set[int] = set()
        #: the close each connection was sent by this server (its peer's reply echoes another code)
        self._sent_close: dict[int, CloseReason] = {}
        self.register_timeout_s = register_timeout_s

    async def handle(self, request: WebSocketRequest) -> None:
        """Serve one WebSocket until it closes (trio-websocket handler); never raises an Exception."""
        try:
            await self._handle(request)
        except Exception:  # noqa: BLE001 - a bug must cost one connection, never the server (proto_spec §6)
            log.exception("rendezvous: internal error on a connection; closed it")

    async def _handle(self, request: WebSocketRequest) -> None:
        try:
            ws = await request.accept()
        except ConnectionClosed:
            return
        conn = next(self._ids)
        self._unregistered.add(conn)
        send_q, recv_q = trio.open_memory_channel(OUTBOUND_QUEUE_MESSAGES)
        self._queues[conn] = send_q
        # the source address our listener's stream recorded (trio-websocket keeps the stream it was given
        # as `_stream`; its own `remote` cannot see through our wrapper)
        source = getattr(getattr(ws, "_stream", None), "peer_address", None)
        self.state.connection_made(conn, trio.current_time(), source=source)
        hello = self.state.actions()  # the `challenge` (proto_spec §2.4)
        reason = "its connection closed"
        async with trio.open_nursery() as nursery:
            self._scopes[conn] = nursery.cancel_scope
            nursery.start_soon(self._writer, conn, ws, recv_q)
            deadline_scope = trio.CancelScope()
            nursery.start_soon(self._register_deadline, conn, deadline_scope)
            try:
                await self._dispatch(hello)
                reason = await self._reader(conn, ws)
            except Exception:  # a bug must cost one connection, never the server (proto_spec §6)
                log.exception("rendezvous: internal error on connection %d; closing it", conn)
                reason = "the rendezvous hit an internal error on its connection"
                self._sent_close[conn] = CloseReason(1011, "internal error")
                with trio.move_on_after(5.0):
                    await ws.aclose(1011, "internal error")
            finally:
                self._sent_close.pop(conn, None)
                del self._queues[conn]
                del self._scopes[conn]
                self._unregistered.discard(conn)
                deadline_scope.cancel()
                send_q.close()
                self.state.connection_lost(conn, reason)
                with trio.move_on_after(5.0) as scope:
                    scope.shield = True
                    await self._dispatch(self.state.actions())

    async def _register_deadline(self, conn: int, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(self.register_timeout_s)
        if scope.cancelled_caught or conn not in self._unregistered:
            return
        reason = f"did not register or join a session within {self.register_timeout_s:g} s"
        log.info("rendezvous: closing connection %d: it %s", conn, reason)
        queue = self._queues.get(conn)
        if queue is None:
            return
        try:
            queue.send_nowait(CloseConn(conn, CLOSE_POLICY_VIOLATION, reason))
        except trio.WouldBlock:  # not draining either: abort it
            self._scopes[conn].cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _note_registered(self, action: SendTo) -> None:
        """Mark `action.conn` registered when the state machine tells it `registered` / `joined`."""
        try:
            msg = decode_message(action.data)
        except RemoteProtocolError:
            return
        if getattr(msg, "type", None) in ("registered", "joined"):
            self._unregistered.discard(action.conn)

    async def _reader(self, conn: int, ws: WebSocketConnection) -> str:
        while True:
            try:
                data = await ws.get_message()
            except ConnectionClosed as exc:
                sent = self._sent_close.get(conn)
                close = sent or exc.reason  # the code this server sent, not the peer's echo (1000) of it
                log.info("rendezvous: connection %d closed%s (%s %s%s)", conn, " by the rendezvous" if sent else "",
                         getattr(close, "code", None), getattr(close, "name", "no close frame"),
                         f": {close.reason}" if close and close.reason else "")
                return describe_close(exc)
            pause_s = self.state.receive_message(conn, data, trio.current_time())
            await self._dispatch(self.state.actions())
            if pause_s > 0:
                await trio.sleep(pause_s)

    async def _writer(self, conn: int, ws: WebSocketConnection, queue: trio.MemoryReceiveChannel) -> None:
        async with queue:  # closing it on exit unblocks anyone still sending to this connection
            async for item in queue:
                try:
                    if isinstance(item, CloseConn):
                        self._sent_close.setdefault(conn, CloseReason(item.code, item.reason))
                        await ws.aclose(item.code, item.reason)
                        return
                    await ws.send_message(item)
                except ConnectionClosed:
                    return

    async def _dispatch(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, RecordPayload):
                if self._record is not None:
                    self._record.write(encode_relay_record(action.circuit_id, action.payload))
                    self._record.flush()
                continue
            queue = self._queues.get(action.conn)
            if isinstance(action, CloseConn):
                log.warning("rendezvous: closing connection %d: %s", action.conn, action.reason)
            if queue is None:
                continue
            if isinstance(action, SendTo) and action.conn in self._unregistered:
                self._note_registered(action)
            item = action.data if isinstance(action, SendTo) else action
            try:
                if self.state.knows(action.conn):
                    await send_noting_stall(queue, item, STALL_WARNING_S, partial(
                        log.warning, "rendezvous: a sender has waited %g s for connection %d, which is not draining",
                        STALL_WARNING_S, action.conn))
                    continue
                try:
                    queue.send_nowait(item)
                except trio.WouldBlock:  # closed by the protocol and not draining: abort it
                    scope = self._scopes.get(action.conn)
                    if scope is not None:
                        scope.cancel()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # that connection is going away; its own handler cleans up


async def serve_rendezvous(
    host: str,
    port: int,
    *,
    record_path: str | None = None,
    limits: RendezvousLimits | None = None,
    stun_addresses=(),
    register_timeout_s: float = REGISTER_TIMEOUT_S,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the rendezvous service (DESIGN §2) on ws://host:port until cancelled.

    Args:
        host: address to listen on ("127.0.0.1", "::", "0.0.0.0").
        port: TCP port; 0 picks a free one.
        record_path: append every relayed payload to this file (proto_spec §7); when None,
            the env var KAFILA_RELAY_RECORD is used if set.
        limits: server limits (proto_spec §5); None means the defaults.
        stun_addresses: (ip, port) of this rendezvous's STUN responder, advertised to members in
            `registered` / `joined` (proto_spec 07 §1).
        register_timeout_s: seconds a WebSocket may stay open without registering or joining.
        task_status: `started(actual_port)` is called once listening.
    Raises:
        OSError: the address cannot be bound.
    """
    limits = limits or RendezvousLimits()
    record_path = record_path or os.environ.get(RECORD_ENV) or None
    record = open(record_path, "ab") if record_path else None  # noqa: SIM115 (closed below)
    try:
        if not register_timeout_s > 0:
            raise ValueError(f"register_timeout_s must be positive (got {register_timeout_s})")
        server = RendezvousServer(limits, record, stun_addresses, register_timeout_s)
        listeners = await trio.open_tcp_listeners(port, host=host)
        async with trio.open_nursery() as nursery:
            ws_server = WebSocketServer(server.handle, [_HeadCheckedListener(x) for x in listeners],
                                        handler_nursery=nursery, max_message_size=limits.ws_max_message_bytes,
                                        connect_timeout=10, disconnect_timeout=5)
            await nursery.start(ws_server.run)
            # the caller says where it listens (`kafilad rendezvous` prints one line): not logged twice
            task_status.started(listeners[0].socket.getsockname()[1])
    finally:
        if record is not None:
            record.close()

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
its handling ends that connection, never the server.
"""

from __future__ import annotations

import itertools
import logging
import os
from functools import partial
from typing import BinaryIO

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

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
        self.state.connection_made(conn, trio.current_time())
        hello = self.state.actions()  # the `challenge` (proto_spec §2.4)
        reason = "its connection closed"
        async with trio.open_nursery() as nursery:
            self._scopes[conn] = nursery.cancel_scope
            nursery.start_soon(self._writer, ws, recv_q)
            deadline_scope = trio.CancelScope()
            nursery.start_soon(self._register_deadline, conn, deadline_scope)
            try:
                await self._dispatch(hello)
                reason = await self._reader(conn, ws)
            except Exception:  # a bug must cost one connection, never the server (proto_spec §6)
                log.exception("rendezvous: internal error on connection %d; closing it", conn)
                reason = "the rendezvous hit an internal error on its connection"
                with trio.move_on_after(5.0):
                    await ws.aclose(1011, "internal error")
            finally:
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
                close = exc.reason
                log.info("rendezvous: connection %d closed (%s %s%s)", conn, getattr(close, "code", None),
                         getattr(close, "name", "no close frame"), f": {close.reason}" if close and close.reason else "")
                return describe_close(exc)
            pause_s = self.state.receive_message(conn, data, trio.current_time())
            await self._dispatch(self.state.actions())
            if pause_s > 0:
                await trio.sleep(pause_s)

    async def _writer(self, ws: WebSocketConnection, queue: trio.MemoryReceiveChannel) -> None:
        async with queue:  # closing it on exit unblocks anyone still sending to this connection
            async for item in queue:
                try:
                    if isinstance(item, CloseConn):
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
        async with trio.open_nursery() as nursery:
            ws_server = await nursery.start(partial(
                serve_websocket, server.handle, host, port, None, handler_nursery=nursery,
                max_message_size=limits.ws_max_message_bytes, connect_timeout=10, disconnect_timeout=5,
            ))
            # the caller says where it listens (`kafilad rendezvous` prints one line): not logged twice
            task_status.started(ws_server.port)
    finally:
        if record is not None:
            record.close()

"""Unix-socket server for the local control API (DESIGN §7, kafilad/control/api.py).

A handler table maps op names to `async def handler(args: dict, emit) -> result`, where
`await emit(event_dict)` streams an event to the client. Handler errors that are KafilaError
become an error reply with their message. A malformed request (a length prefix no request can
have, a body that is not msgpack or not a map, a field missing or of the wrong type) gets an
error reply naming what was wrong, then that connection alone is closed (kafilad/control/api.py).

Nothing a client does can stop the daemon or starve the other clients (issue 9):
- at most `max_connections` connections at once (the HTTP API has its own, separate limits);
  past it a connection gets an error reply and is closed;
- a request frame is at most `max_request_bytes`, must arrive within `request_timeout_s`, and the
  unfinished request frames of all connections together hold at most `max_total_request_bytes`;
- `emit` never waits for the client: events queue (at most `max_queued_events`); a client that
  falls further behind has its operation ended with an error reply, so a stopped `kafila-ctl`
  never stalls the ring that produces its tokens;
- the client closing its connection ends its operation: `wait` and `watch` are cancelled; any
  other op's next `emit` raises (a session ends a request whose emit raises at that event, where
  a trio cancellation mid-send could break a link) and its reply is dropped;
- every connection runs inside a guard: an error in a handler or in this driver ends that
  connection (logged), never the server or the daemon's root nursery.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Awaitable, Callable

import attrs
import trio

import msgpack

from kafilad.control.api import API_VERSION, OP_ARGS, SHUTTING_DOWN
from kafilad.errors import FramingError, KafilaError, LocalProtocolError, find_kafila_error, only_cancelled
from kafilad.proto.frames import FrameDecoder, encode_frame

log = logging.getLogger("kafilad.control")

Handler = Callable[[dict, Callable[[dict], Awaitable[None]]], Awaitable[object]]

RECEIVE_BYTES = 65_536
#: ops that only wait, so a client leaving cancels them outright
CANCEL_ON_DISCONNECT = frozenset({"wait", "watch"})


class ClientGone(Exception):
    """Raised by `emit` once the control client closed its connection."""


@attrs.frozen
class ControlLimits:
    """Limits of the control server (tests shrink them)."""

    max_connections: int = 64
    max_request_bytes: int = 16 * 1024 * 1024
    max_total_request_bytes: int = 64 * 1024 * 1024
    request_timeout_s: float = 30.0
    max_queued_events: int = 4096
    send_timeout_s: float = 30.0


async def serve_control(socket_path: Path, handlers: dict[str, Handler], *, limits: ControlLimits = ControlLimits(),
                        cancel_on_disconnect: frozenset[str] = CANCEL_ON_DISCONNECT,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on `socket_path` (mode 0600) and dispatch requests to `handlers` until cancelled.

    Raises:
        KafilaError: another daemon already answers on the socket.
    """
    socket_path = Path(socket_path)
    if socket_path.exists():
        try:
            s = await trio.open_unix_socket(str(socket_path))
        except OSError:
            socket_path.unlink()  # stale socket from a daemon that died
        else:
            await s.aclose()
            raise KafilaError(f"Another kafilad already answers on {socket_path}.")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(socket_path))
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    sock.listen(64)
    listener = trio.SocketListener(sock)
    server = ControlServer(handlers, limits, cancel_on_disconnect)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(socket_path)
            await trio.serve_listeners(server.serve_stream, [listener], handler_nursery=nursery)
    finally:
        try:
            socket_path.unlink()
        except FileNotFoundError:
            pass


class ControlServer:
    """Serves control connections (see the module docstring); one instance per socket."""

    def __init__(self, handlers: dict[str, Handler], limits: ControlLimits = ControlLimits(),
                 cancel_on_disconnect: frozenset[str] = CANCEL_ON_DISCONNECT):
        self.handlers = handlers
        self.limits = limits
        self.cancel_on_disconnect = cancel_on_disconnect
        self.connections = 0
        self.held_request_bytes = 0

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection to its end; never raises an Exception (a structural guarantee)."""
        self.connections += 1
        try:
            if self.connections > self.limits.max_connections:
                await self._send(stream, _error(f"kafilad is answering {self.limits.max_connections} control "
                                                "connections, its limit; retry shortly."), timeout_s=1.0)
                return
            await self._connection(stream)
        except Exception:  # noqa: BLE001 - one connection's failure must not reach the daemon
            log.exception("control: internal error on a connection; closed it")
        finally:
            self.connections -= 1
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    async def _send(self, stream: trio.abc.Stream, body: dict, *, timeout_s: float | None = None) -> bool:
        """Send one frame; False when the client is gone or did not read in time."""
        try:
            data = encode_frame(body)
        except LocalProtocolError as e:  # a result msgpack cannot carry: say so instead
            log.error("control: cannot encode a reply: %s", e)
            data = encode_frame(_error(f"kafilad could not encode its reply ({e})."))
        with trio.move_on_after(self.limits.send_timeout_s if timeout_s is None else timeout_s):
            try:
                await stream.send_all(data)
                return True
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                return False
        return False

    async def _read_request(self, stream: trio.abc.Stream) -> tuple[dict | None, int, str | None]:
        """The request frame; returns (request or None, bytes held from the budget, error sentence or None).
        A sentence comes back for a request that cannot be read (`refusal`) or arrive, for a reply.
        The frame layer's one decoder (kafilad/proto/frames.py `FrameDecoder`) reads the frame."""
        lim = self.limits
        decoder = FrameDecoder(lim.max_request_bytes, require_type=False)  # `_check` answers a missing "t"
        held = 0
        with trio.move_on_after(lim.request_timeout_s):
            while True:
                try:
                    req = decoder.next_event()
                except FramingError as e:
                    sentence = refusal(e, lim.max_request_bytes)
                    log.warning("control: malformed request refused: %s", sentence)
                    return None, held, sentence
                if req is not None:
                    return req, held, None
                try:
                    data = await stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    if decoder.pending_bytes:
                        log.warning("control: a connection closed in the middle of its request frame")
                    return None, held, None
                if self.held_request_bytes + len(data) > lim.max_total_request_bytes:
                    return None, held, (f"kafilad is holding {self.held_request_bytes} bytes of unfinished control "
                                        "requests, its limit; retry shortly.")
                self.held_request_bytes += len(data)
                held += len(data)
                decoder.receive_data(data)
        return None, held, f"The control request did not arrive within {lim.request_timeout_s:g} s."

    async def _connection(self, stream: trio.abc.Stream) -> None:
        req, held, refusal = None, 0, None
        try:
            req, held, refusal = await self._read_request(stream)
            if refusal is not None:
                self.held_request_bytes -= held  # released before lingering
                held = 0
                await self._send(stream, _error(refusal), timeout_s=1.0)
                await _linger(stream)  # so the client reads the refusal rather than a reset
                return
            if req is None:
                return
            reply = self._check(req)
            if reply is not None:
                await self._send(stream, reply)
                return
            await self._dispatch(stream, req)
        finally:
            self.held_request_bytes -= held

    def _check(self, req: dict) -> dict | None:
        """An error reply for a request that cannot be dispatched, naming the field at fault, else None."""
        shape = ('a control request is {"t": "request", "v": %d, "op": NAME, "args": {NAME: VALUE, ...}}'
                 % API_VERSION)
        if req.get("t") != "request":
            return _error(f"This frame's \"t\" is {_shown(req.get('t'))}, not \"request\"; {shape}.")
        if "v" not in req:
            return _error(f"The control request has no \"v\" (the control API version; this kafilad speaks "
                          f"v{API_VERSION}); {shape}.")
        if req.get("v") != API_VERSION:
            return _error(f"kafila-ctl speaks control API v{_shown(req.get('v'))} but this kafilad speaks "
                          f"v{API_VERSION}; use matching versions.")
        if "op" not in req:
            return _error(f"The control request has no \"op\" naming its operation; {shape}.")
        if not isinstance(req["op"], str):
            return _error(f"The control request's \"op\" is {_kind(req['op'])}, not a string naming an "
                          "operation.")
        if req["op"] not in self.handlers:
            return _error(f"Unknown control operation '{req['op'][:80]}'.")
        if req.get("args") is not None and not isinstance(req["args"], dict):
            return _error(f"The control request's \"args\" is {_kind(req['args'])}; it must be a map of argument "
                          "names to values (an empty map for none).")
        takes = OP_ARGS.get(req["op"])
        unknown = sorted(str(k)[:40] for k in (req.get("args") or {}) if takes is not None and k not in takes)
        if unknown:
            return _error(f"'{req['op']}' takes no argument {', '.join(repr(k) for k in unknown[:5])}; it takes "
                          + (", ".join(sorted(takes)) if takes else "none") + ".")
        return None

    async def _dispatch(self, stream: trio.abc.Stream, req: dict) -> None:
        op, args = req["op"], req.get("args") or {}
        lim = self.limits
        send_q, recv_q = trio.open_memory_channel(lim.max_queued_events)
        writer_done = trio.Event()
        gone_event = trio.Event()  # `emit.client_gone`: a handler may watch it (a session's generate does)

        sending = [False]  # a frame is on its way: a stop now may have cut it, so nothing more is sent
        try:
            await self._dispatch_in(stream, op, args, send_q, recv_q, writer_done, gone_event, sending)
        except BaseException as e:  # the daemon stops: an operation not yet answered learns why
            if not only_cancelled(e):
                raise
            if not gone_event.is_set() and not sending[0]:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await self._send(stream, _error(f"The daemon is shutting down, so '{op}' was not finished; "
                                                    "send it again once the daemon is back.", code=SHUTTING_DOWN))
            raise

    async def _dispatch_in(self, stream, op: str, args: dict, send_q, recv_q, writer_done: trio.Event,
                           gone_event: trio.Event, sending: list) -> None:
        lim = self.limits
        gone = overflow = False
        reply: dict | None = None
        async with trio.open_nursery() as nursery:
            async def writer() -> None:
                nonlocal gone
                try:
                    async with recv_q:
                        async for frame in recv_q:
                            with trio.move_on_after(lim.send_timeout_s) as scope:
                                try:
                                    sending[0] = True
                                    await stream.send_all(frame)
                                    sending[0] = False
                                except (trio.BrokenResourceError, trio.ClosedResourceError):
                                    scope.cancel()
                            if scope.cancelled_caught:
                                gone = True
                                gone_event.set()
                                if op in self.cancel_on_disconnect:
                                    nursery.cancel_scope.cancel()
                                return
                finally:
                    writer_done.set()

            async def watch() -> None:  # the client leaving ends its operation
                nonlocal gone
                seen = 0
                while seen < RECEIVE_BYTES * 16:
                    try:
                        data = await stream.receive_some(RECEIVE_BYTES)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        gone = True
                        gone_event.set()
                        if op in self.cancel_on_disconnect:
                            nursery.cancel_scope.cancel()
                        return
                    seen += len(data)  # bytes after the one request are ignored (one request per connection)

            with trio.CancelScope() as op_scope:
                async def emit(event: dict) -> None:
                    nonlocal overflow
                    if gone:
                        raise ClientGone("The control client closed its connection.")
                    frame = encode_frame({**event, "t": "event", "kind": event.get("t")})
                    try:
                        send_q.send_nowait(frame)
                    except trio.WouldBlock:
                        overflow = True
                        op_scope.cancel()
                    await trio.lowlevel.checkpoint()  # let the writer run; never wait for the client

                emit.client_gone = gone_event
                nursery.start_soon(writer)
                nursery.start_soon(watch)
                reply = await self._run_handler(op, args, emit)
            if overflow:
                reply = _error(f"The client did not read the events of '{op}' in time "
                               f"({lim.max_queued_events} waiting); the operation was ended.")
            send_q.close()
            await writer_done.wait()
            if not gone and reply is not None:
                await self._send(stream, reply)
            nursery.cancel_scope.cancel()

    async def _run_handler(self, op: str, args: dict, emit) -> dict | None:
        handler = self.handlers[op]
        try:
            result = await handler(args, emit)
        except KafilaError as e:
            return _error(str(e), e.code or None)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ClientGone):
            return None  # the client went away mid-stream
        except Exception as e:  # noqa: BLE001 - a bug in a handler must not take the daemon down
            known = find_kafila_error(e)  # a refusal wrapped by a nursery is not a bug
            if known is not None:
                return _error(str(known), known.code or None)
            log.exception("control: handler %s failed", op)
            return _error(f"Internal error in '{op}': {e!r}.")
        return {"t": "reply", "ok": True, "result": result}


async def _linger(stream: trio.abc.Stream, timeout_s: float = 1.0, max_bytes: int = 64 * 1024 * 1024) -> None:
    """Shut down our side, then discard what the client still sends for a while."""
    with trio.move_on_after(timeout_s):
        try:
            await stream.send_eof()
            seen = 0
            while seen < max_bytes:
                data = await stream.receive_some(RECEIVE_BYTES)
                if not data:
                    return
                seen += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, AttributeError):
            return


def _error(message: str, code: str | None = None) -> dict:
    """A failed reply (proto_spec 05 §4): `message` for people, `code` for programs."""
    return {"t": "reply", "ok": False, "error": message, **({"code": code} if code else {})}


#: what a client that is not kafila-ctl is told to send (kafilad/control/api.py)
FRAME_HINT = "a control request is a u32 big-endian length, then that many bytes of one msgpack map (proto_spec 02 §1)"

#: msgpack's first bytes that are no type at all (the msgpack spec: 0xc1 is "never used")
_UNUSED_MSGPACK_BYTES = frozenset({0xC1})


def refusal(error: FramingError, max_bytes: int) -> str:
    """The error reply's sentence for a request frame the frame decoder refused (proto_spec 02 §1-2).

    Args:
        error: the FrameDecoder's error (decided on its ``code``). max_bytes: the request size limit.
    """
    if error.code == "length":
        return (f"The control request's length prefix announces {error.length} bytes (first bytes "
                f"{error.header.hex(' ')}), not 1 to {max_bytes}; {FRAME_HINT}.")
    if error.code == "msgpack":
        why = _msgpack_failure(error.cause, error.raw)
        return f"The control request's {error.length} bytes are not msgpack: {why}; {FRAME_HINT}."
    if error.code == "not_map":
        return f"The control request is {_kind(error.value)}, not a map; {FRAME_HINT}."
    return f"The control request cannot be read: {error}; {FRAME_HINT}."


def _msgpack_failure(exc: Exception, raw: bytes) -> str:
    """Why msgpack could not read `raw`, in words (some of its errors carry no message at all)."""
    if isinstance(exc, msgpack.OutOfData):
        return "the bytes end inside a msgpack value"
    if isinstance(exc, msgpack.FormatError) and raw and raw[0] in _UNUSED_MSGPACK_BYTES:
        return f"its first byte 0x{raw[0]:02x} is not a msgpack type"
    detail = str(exc).strip().rstrip(".")
    return f"{type(exc).__name__}: {detail}" if detail else f"{type(exc).__name__} at first byte 0x{raw[0]:02x}"


def _kind(value) -> str:
    """A msgpack value's type in the words of the msgpack spec (a request's fields are msgpack values)."""
    names = {dict: "a map", list: "an array", str: "a string", bytes: "binary data", bool: "a boolean",
             int: "an integer", float: "a float", type(None): "nil"}
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value) -> str:
    """A request field's value for a sentence, cut short."""
    return "missing" if value is None else repr(value)[:40]

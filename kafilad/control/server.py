"""Unix-socket server for the local control API (DESIGN §7, kafilad/control/api.py).

A handler table maps op names to `async def handler(args: dict, emit) -> result`, where
`await emit(event_dict)` streams an event to the client. Handler errors that are KafilaError
become an error reply with their message; a malformed request closes only that connection.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Awaitable, Callable

import trio

from kafilad.control.api import API_VERSION, FramedStream
from kafilad.errors import KafilaError, RemoteProtocolError, find_kafila_error

log = logging.getLogger("kafilad.control")

Handler = Callable[[dict, Callable[[dict], Awaitable[None]]], Awaitable[object]]


async def serve_control(socket_path: Path, handlers: dict[str, Handler], *,
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
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(socket_path)

            async def handle(stream: trio.SocketStream) -> None:
                await _handle_connection(stream, handlers)

            await trio.serve_listeners(handle, [listener], handler_nursery=nursery)
    finally:
        try:
            socket_path.unlink()
        except FileNotFoundError:
            pass


async def _handle_connection(stream: trio.abc.Stream, handlers: dict[str, Handler]) -> None:
    conn = FramedStream(stream)
    async with stream:
        try:
            req = await conn.receive()
        except RemoteProtocolError as e:
            log.warning("control: malformed request closed: %s", e)
            return
        except trio.BrokenResourceError:
            return
        if req is None:
            return
        if req.get("t") != "request" or not isinstance(req.get("op"), str):
            await _safe_send(conn, {"t": "reply", "ok": False, "error": "Malformed control request."})
            return
        if req.get("v") != API_VERSION:
            await _safe_send(conn, {"t": "reply", "ok": False, "error":
                                    f"kafila-ctl speaks control API v{req.get('v')} but this kafilad speaks "
                                    f"v{API_VERSION}; use matching versions."})
            return
        op = req["op"]
        handler = handlers.get(op)
        if handler is None:
            await _safe_send(conn, {"t": "reply", "ok": False, "error": f"Unknown control operation '{op}'."})
            return
        args = req.get("args") or {}

        async def emit(event: dict) -> None:
            await conn.send({**event, "t": "event", "kind": event.get("t")})

        try:
            result = await handler(args, emit)
        except KafilaError as e:
            await _safe_send(conn, {"t": "reply", "ok": False, "error": str(e)})
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the client went away mid-stream
        except Exception as e:  # a bug in a handler must not take the daemon down
            known = find_kafila_error(e)  # a refusal wrapped by a nursery is not a bug
            if known is not None:
                await _safe_send(conn, {"t": "reply", "ok": False, "error": str(known)})
                return
            log.exception("control: handler %s failed", op)
            await _safe_send(conn, {"t": "reply", "ok": False, "error": f"Internal error in '{op}': {e!r}."})
            return
        await _safe_send(conn, {"t": "reply", "ok": True, "result": result})


async def _safe_send(conn: FramedStream, body: dict) -> None:
    try:
        await conn.send(body)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass

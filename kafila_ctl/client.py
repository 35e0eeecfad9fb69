"""Typed client of kafilad's control socket (DESIGN §7, kafilad/control/api.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import trio

from kafilad.control.api import SHUTTING_DOWN, FramedStream, request
from kafilad.errors import KafilaError, RemoteProtocolError


class DaemonNotRunning(KafilaError):
    """No kafilad answers on the control socket."""


class DaemonStopped(KafilaError):
    """The daemon went away during an operation: nothing answers on its socket any more."""


class DaemonShutDown(DaemonStopped):
    """The daemon stopped in an orderly way (`kafila-ctl stop`, SIGTERM) before it finished the
    operation: its reply carried code `shutting_down` (proto_spec 05 §4)."""


class DaemonRefused(KafilaError):
    """The daemon answered an operation with an error (proto_spec 05 §4): the message is its sentence,
    ``code`` its `code` ("" when it sent none; e.g. kafilad/errors.py CONTEXT_LENGTH_EXCEEDED), which a
    caller decides on."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class UsageError(KafilaError):
    """An argument kafila-ctl refuses before it starts or changes anything (exit status 2, as argparse's
    own usage errors); the message is a sentence naming the argument and what it takes."""


class ControlClient:
    """Talks to one kafilad over `socket_path`."""

    def __init__(self, socket_path: Path):
        self.socket_path = Path(socket_path)

    async def _connect(self) -> FramedStream:
        try:
            stream = await trio.open_unix_socket(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError, OSError) as e:
            raise DaemonNotRunning(
                f"kafilad is not running at {self.socket_path} ({e.strerror or e}); "
                f"start it with `kafilad --state-dir {self.socket_path.parent}`.") from None
        return FramedStream(stream)

    async def _gone(self, op: str, how: str) -> KafilaError:
        """The error for a connection the daemon closed before its reply: when nothing answers on the
        socket any more the daemon stopped (it exited or was killed), and the sentence says where to
        look; else the daemon closed only this connection."""
        log = self.socket_path.parent / "kafilad.log"
        if not await self._answers():
            return DaemonStopped(
                f"kafilad stopped during '{op}': it closed the control connection{how}, and nothing answers on "
                f"{self.socket_path} now. Its log says why: {log} (as a service: `systemctl --user status "
                f"kafilad` or `journalctl --user -u kafilad`); start it again as it was started "
                f"(`systemctl --user start kafilad`, or its own command line with `--state-dir "
                f"{self.socket_path.parent}` and the same --rendezvous and --http).")
        return KafilaError(f"kafilad closed the control connection during '{op}'{how}; its log may say why: {log}.")

    async def _answers(self, timeout_s: float = 2.0) -> bool:
        """Whether a daemon replies to `keys` on the socket now (a dying daemon's listening socket may
        still take a connection for a moment, so a connection alone proves nothing)."""
        with trio.move_on_after(timeout_s):
            try:
                conn = FramedStream(await trio.open_unix_socket(str(self.socket_path)))
            except OSError:
                return False
            try:
                await conn.send(request("keys", {}))
                return (await conn.receive() or {}).get("t") == "reply"
            except (OSError, trio.BrokenResourceError, RemoteProtocolError):
                return False
            finally:
                await conn.aclose()
        return False

    async def call(self, op: str, **args: Any) -> Any:
        """One request; returns its result.

        Raises:
            DaemonNotRunning: nothing answers on the socket.
            DaemonShutDown: the daemon stopped before its reply (code `shutting_down`, proto_spec 05 §4).
            DaemonRefused: the daemon replied with an error (its message and code).
        """
        result = None
        async for kind, body in self.stream(op, **args):
            if kind == "result":
                result = body
        return result

    async def stream(self, op: str, **args: Any) -> AsyncIterator[tuple[str, Any]]:
        """Yield ("event", dict) for each streamed event, then ("result", result).

        Raises:
            DaemonNotRunning, KafilaError: as for `call`; the connection ended before the reply.
            RemoteProtocolError: the daemon sent a malformed frame or closed inside one (it died
                mid-frame), as opposed to a clean close before the reply (KafilaError).
        """
        conn = await self._connect()
        try:
            await conn.send(request(op, args))
            while True:
                try:
                    msg = await conn.receive()
                except RemoteProtocolError as e:  # a malformed frame, or the daemon died inside one
                    raise RemoteProtocolError(
                        f"kafilad closed the control connection during '{op}': {str(e).rstrip('.')}.") from None
                except trio.BrokenResourceError as e:
                    raise await self._gone(op, f": {e}") from None
                if msg is None:
                    raise await self._gone(op, " without a reply")
                if msg.get("t") == "event":
                    yield "event", msg
                elif msg.get("t") == "reply":
                    if not msg.get("ok"):
                        code = msg.get("code") if isinstance(msg.get("code"), str) else ""
                        text = str(msg.get("error") or f"'{op}' failed.")
                        if code == SHUTTING_DOWN:
                            raise DaemonShutDown(text)
                        raise DaemonRefused(text, code)
                    yield "result", msg.get("result")
                    return
        finally:
            await conn.aclose()

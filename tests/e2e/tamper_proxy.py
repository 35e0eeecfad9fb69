"""A WebSocket proxy between daemons and the rendezvous that can flip one bit of a relayed payload.

It stands for a malicious or faulty rendezvous path (DESIGN §2: the relay only ever sees
ciphertext, and a corrupted message must close only the link that carried it). It parses only
what the rendezvous itself parses (proto_spec 03: kind byte, circuit id, control maps).
"""

from __future__ import annotations

import threading

import msgpack
import trio
from trio_websocket import ConnectionClosed, open_websocket_url, serve_websocket


class TamperProxy:
    """Run in a background thread; `url` is what daemons should use as their rendezvous."""

    def __init__(self, upstream_url: str):
        self.upstream_url = upstream_url
        self.url = ""
        self.armed_for: str | None = None  # member name whose next relayed payload gets corrupted
        self.corrupted = threading.Event()
        self._ready = threading.Event()
        self._token = None
        self._thread = threading.Thread(target=lambda: trio.run(self._main), daemon=True)

    def __enter__(self) -> "TamperProxy":
        self._thread.start()
        assert self._ready.wait(10), "tamper proxy did not start"
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            self._token.run_sync_soon(self._cancel.cancel)
        self._thread.join(5)

    def arm(self, name: str) -> None:
        self.armed_for = name

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                server = await nursery.start(lambda task_status: serve_websocket(
                    self._handle, "127.0.0.1", 0, ssl_context=None, task_status=task_status))
                self.url = f"ws://127.0.0.1:{server.port}"
                self._ready.set()

    async def _handle(self, request) -> None:
        down = await request.accept()
        name = {"v": None}
        try:
            async with open_websocket_url(self.upstream_url) as up:
                async with trio.open_nursery() as nursery:
                    async def pump(src, dst, from_daemon: bool):
                        try:
                            while True:
                                msg = await src.get_message()
                                if from_daemon and isinstance(msg, (bytes, bytearray)):
                                    msg = self._inspect(bytes(msg), name)
                                await dst.send_message(msg)
                        except ConnectionClosed:
                            nursery.cancel_scope.cancel()
                    nursery.start_soon(pump, down, up, True)
                    nursery.start_soon(pump, up, down, False)
        except (ConnectionClosed, OSError):
            pass
        finally:
            await down.aclose()

    def _inspect(self, msg: bytes, name: dict) -> bytes:
        if msg[:1] == b"\x00":
            try:
                body = msgpack.unpackb(msg[1:], raw=False)
                if isinstance(body, dict) and body.get("name"):
                    name["v"] = body["name"]
            except Exception:
                pass
        elif msg[:1] == b"\x01" and self.armed_for is not None and name["v"] == self.armed_for and len(msg) > 40:
            self.armed_for = None
            b = bytearray(msg)
            b[30] ^= 0x01  # inside the Noise ciphertext, past the 9-byte relay header
            self.corrupted.set()
            return bytes(b)
        return msg

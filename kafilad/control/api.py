"""Local control API between kafila-ctl and kafilad (DESIGN §7; proto_spec/05-control.md).

Over the Unix socket `DIR/kafilad.sock` (mode 0600) each side sends frames of the frame layer
(proto_spec 02: u32 length || msgpack map with "t"). One request per connection:

```
ctl -> daemon   {"t": "request", "v": API_VERSION, "op": str, "args": {...}}
daemon -> ctl   {"t": "event", ...}*          zero or more, for streaming ops (generate, watch, join)
daemon -> ctl   {"t": "reply", "ok": true, "result": ...}
             or {"t": "reply", "ok": false, "error": "whole sentence"}
```
A request whose "v" differs from API_VERSION gets an error reply naming both versions.
"""

from __future__ import annotations

from typing import Any

import trio

from kafilad.errors import RemoteProtocolError
from kafilad.proto.frames import FrameDecoder, encode_frame

API_VERSION = 1

#: Operations and what they do; the daemon's handler table must cover exactly these.
OPS = {
    "keys": "this daemon's peer id, key fingerprint and public key",
    "host": "open a session as host: model_dir, members, context, concurrency, rendezvous, open",
    "join": "join a session by code (streams progress events)",
    "pending": "unknown keys waiting for admission",
    "admit": "admit a pending peer (by peer id or name)",
    "deny": "deny a pending peer (by peer id or name)",
    "status": "snapshot of the daemon and its session",
    "wait": "wait until the session state is one of `states` (or timeout_s passes)",
    "generate": "generate from a prompt (streams tokens)",
    "watch": "stream status snapshots on every change",
    "trace": "the session trace records",
    "leave": "leave or close the current session",
    "stop": "stop the daemon",
}


class FramedStream:
    """Frame-layer messages over a trio stream (one control connection)."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self._decoder = FrameDecoder()

    async def send(self, body: dict) -> None:
        await self.stream.send_all(encode_frame(body))

    async def receive(self) -> dict | None:
        """Next frame, or None at EOF.

        Raises:
            RemoteProtocolError: malformed frame, or EOF in the middle of one.
        """
        while True:
            ev = self._decoder.next_event()
            if ev is not None:
                return ev
            data = await self.stream.receive_some(65536)
            if not data:
                if self._decoder_has_partial():
                    raise RemoteProtocolError("The control connection closed in the middle of a frame.")
                return None
            self._decoder.receive_data(data)

    def _decoder_has_partial(self) -> bool:
        return bool(getattr(self._decoder, "buffered_bytes", 0))

    async def aclose(self) -> None:
        await self.stream.aclose()


def request(op: str, args: dict[str, Any] | None = None) -> dict:
    return {"t": "request", "v": API_VERSION, "op": op, "args": args or {}}

"""Local control API between kafila-ctl and kafilad (DESIGN §7; proto_spec 05 §4).

Over the Unix socket `DIR/kafilad.sock` (mode 0600) each side sends frames of the frame layer
(proto_spec 02: u32 length || msgpack map with "t"). One request per connection:

```
ctl -> daemon   {"t": "request", "v": API_VERSION, "op": str, "args": {...}}
daemon -> ctl   {"t": "event", ...}*          zero or more, for streaming ops (generate, watch, join)
daemon -> ctl   {"t": "reply", "ok": true, "result": ...}
             or {"t": "reply", "ok": false, "error": "whole sentence"}
```
A request whose "v" differs from API_VERSION gets an error reply naming both versions.
A request the daemon cannot read gets the same error reply, naming what was wrong, before the
daemon closes the connection: a length prefix of 0 or past the request limit (the reply is sent
at once, without reading the rest), a body that is not msgpack or not a map, "t" other than
"request", "v" or "op" missing or of the wrong type, "args" that is not a map (it may be absent),
or an argument the operation does not take (OP_ARGS).
Both ends read and write frames with ``FramedStream``, the one frame driver
(kafilad/net/frame_stream.py ``FrameStream``): ``receive`` returns None when the other end
closed between frames and raises RemoteProtocolError when it closed inside one.
"""

from __future__ import annotations

from typing import Any

from kafilad.net.frame_stream import FrameStream

API_VERSION = 1

#: Operations and what they do; the daemon's handler table must cover exactly these.
OPS = {
    "keys": "this daemon's peer id, key fingerprint and public key",
    "host": "open a session as host: model_dir, members, context, concurrency, queue, strategy, rendezvous, open",
    "join": "join a session by code (streams progress events)",
    "pending": "unknown keys waiting for admission",
    "admit": "admit a pending peer (by peer id or name)",
    "deny": "deny a pending peer (by peer id or name); a denied key is dropped from the roster",
    "trust_list": "the trusted keys: the roster, and keys the hosted session admitted for itself only",
    "trust_revoke": "forget a trusted key (by peer id or name): it waits for admission when it joins again",
    "status": "snapshot of the daemon and its session",
    "wait": "wait until the session state is one of `states` (or timeout_s passes)",
    "generate": "generate from a prompt (streams tokens)",
    "watch": "stream status snapshots on every change",
    "trace": "the session trace records",
    "schedule": "the head's decode schedule: mode auto | lockstep | per-request | M (micro-batches); none: show it",
    "speculate": "the head's speculative decoding: mode auto | off | k=N (drafts per pass); none: show it",
    "leave": "leave or close the current session",
    "stop": "stop the daemon",
}

#: The arguments each operation takes (a request naming another is refused with a sentence, so a
#: misspelt argument is never silently ignored)
OP_ARGS = {
    "keys": frozenset(),
    "host": frozenset({"model_dir", "members", "context", "concurrency", "queue", "strategy", "rendezvous", "open",
                       "admit_timeout_s", "head", "draft_model"}),
    "join": frozenset({"code", "rendezvous"}),
    "pending": frozenset(),
    "admit": frozenset({"peer"}),
    "deny": frozenset({"peer", "reason"}),
    "trust_list": frozenset(),
    "trust_revoke": frozenset({"peer"}),
    "status": frozenset(),
    "wait": frozenset({"states", "timeout_s"}),
    "generate": frozenset({"prompt", "messages", "max_tokens", "temperature"}),
    "watch": frozenset(),
    "trace": frozenset(),
    "schedule": frozenset({"mode"}),
    "speculate": frozenset({"mode"}),
    "leave": frozenset(),
    "stop": frozenset(),
}
assert set(OP_ARGS) == set(OPS)


#: The frame driver of a control connection: ``send(body) -> int``, ``receive() -> dict | None``
#: (None at a clean end; RemoteProtocolError for a malformed frame or an end inside one), ``aclose()``.
FramedStream = FrameStream

#: the code of a failed reply to an op that the daemon's stop cut short (proto_spec 05 §4)
from kafilad.errors import SHUTTING_DOWN  # noqa: E402,F401 - re-exported (kafila_ctl/client.py)


def request(op: str, args: dict[str, Any] | None = None) -> dict:
    return {"t": "request", "v": API_VERSION, "op": op, "args": args or {}}

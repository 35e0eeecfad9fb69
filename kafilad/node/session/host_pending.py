"""The host's wait for its decision on a device that waits for admission (proto_spec 05 §2 `pending`).

While a device is pending (`kafila-ctl admit` or `deny` to come, or the admit timeout), the host
still watches its ctl link: a device that goes meanwhile (`leaving`, §2.2, or its link's end)
must free its place at once, not hold it until the admit timeout runs out; a new user's trial
(2026-12-02) saw every later `join` of such a device refused for 120 s as "already in the session".
Used by kafilad/node/session/host.py ``HostSession._admitted_member``.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio

from kafilad.errors import LinkClosed, RemoteProtocolError
from kafilad.proto import control as cf

log = logging.getLogger("kafilad.host")


async def wait_while_pending(link, decided: trio.Event, timeout_s: float) -> tuple[Optional[dict], Optional[str]]:
    """Wait until `decided` is set or `timeout_s` passes, reading `link` meanwhile.

    A pending device sends nothing but a `leaving` frame before it goes (pings and unknown frames
    are ignored). Reading is cancel-safe (kafilad/node/paths/link.py keeps a partial frame for the next
    receive), so the read stops when the decision comes; a frame that arrives after the decision
    belongs to the admitted member and is handed back, never dropped.

    Args:
        link: the device's ctl Link. decided: set once the host admitted or turned it away.
        timeout_s: the admit timeout (`host --admit-timeout`).
    Returns:
        (first, gone): `first` is a frame the device sent after the decision (its member loop's
        first), else None; `gone` is why the device went while it waited ("it is leaving: ...",
        or its link's end), else None (decided, or timed out).
    """
    first: Optional[dict] = None
    gone: Optional[str] = None
    with trio.move_on_after(timeout_s):
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                nonlocal first, gone
                while True:
                    try:
                        raw = await link.receive()
                    except LinkClosed as e:
                        gone = e.reason
                        break
                    if decided.is_set():
                        first = raw
                        break
                    try:
                        f = cf.decode_control(raw)
                    except RemoteProtocolError as e:
                        gone = f"it sent a {e}"
                        break
                    if isinstance(f, cf.Leaving):
                        gone = f"it is leaving: {f.reason}"
                        break
                    if not isinstance(f, cf.Ping):
                        log.info("ignoring a %r frame from %s, which waits for admission", raw.get("t"),
                                 link.peer_name)
                nursery.cancel_scope.cancel()

            async def until_decided() -> None:
                await decided.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(until_decided)
    return first, gone

"""A send on a trio memory channel that names a consumer falling behind (DESIGN §7: a wait that
holds up others is logged, not silent)."""

from __future__ import annotations

from typing import Callable

import trio


async def send_noting_stall(channel: trio.MemorySendChannel, item, stall_s: float, on_stall: Callable[[], None]) -> None:
    """Send `item` on `channel`, waiting while it is full; `on_stall()` once the wait passes `stall_s`.

    Raises:
        trio.BrokenResourceError, trio.ClosedResourceError: as `channel.send`.
    """
    try:
        channel.send_nowait(item)
        return
    except trio.WouldBlock:
        pass
    with trio.move_on_after(stall_s):
        await channel.send(item)
        return
    on_stall()
    await channel.send(item)

"""The wait of a request for a daemon's restored session (docs/healing.md): the I/O half of the
comeback, whose pure half (backoff, giving up, records, status) is kafilad/proto/comeback.py."""

from __future__ import annotations

from typing import Optional

import trio


async def session_back(node, gone: Optional[trio.Event] = None) -> None:
    """Return once `node` (kafilad/daemon.py ``Node``) is no longer restoring its remembered
    session, at most host_requests.RECOVERY_WAIT_S: a request sent during a host restart is then
    served once the session is back (the session's own ``wait_serving`` waits for its members to
    rejoin). Returns at once when it is not restoring, and when `gone` (the client went away) is set.
    """
    from kafilad.node.serving.host_requests import RECOVERY_WAIT_S
    with trio.move_on_after(RECOVERY_WAIT_S):
        while node.restoring_sentence() is not None and not (gone is not None and gone.is_set()):
            await _either(node._changed, gone)  # _changed: set and replaced by Node.changed()


async def _either(first: trio.Event, second: Optional[trio.Event]) -> None:
    """Return once `first` or `second` (when given) is set."""
    async with trio.open_nursery() as nursery:
        async def wait_then_stop(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()
        for event in (first, second):
            if event is not None:
                nursery.start_soon(wait_then_stop, event)

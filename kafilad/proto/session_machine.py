"""The machinery shared by the session machines (kafilad/proto/session.py, session_member.py).

h11 ``_state.py`` style: a table ``TABLE[state][event type] -> states it may enter``; ``_row``
looks an event up, ``_enter`` is the one place a state is entered.
"""

from __future__ import annotations

from typing import Optional

from kafilad.errors import LocalProtocolError
from kafilad.proto import control as cf
from kafilad.proto.session_events import FrameFrom, HostState, MemberState

#: States in which a session is over: only Close is handled.
_OVER = (HostState.FAILED, HostState.CLOSED, MemberState.FAILED, MemberState.CLOSED)


class _Machine:
    TABLE: dict = {}

    def __init__(self, state):
        self.state = state
        self.error: Optional[str] = None
        #: set by every state change; the driver clears it after telling watchers
        self.changed = True

    def _enter(self, state, allowed) -> None:
        if state not in allowed:
            raise LocalProtocolError(f"{type(self).__name__}: {self.state} -> {state} is not in the table")
        if state != self.state:
            self.state = state
        self.changed = True

    def _row(self, event):
        """The states `event` may lead to from here, None when the event is ignored."""
        key = type(event.frame) if isinstance(event, FrameFrom) else type(event)
        row = self.TABLE[self.state]
        if key in row:
            return row[key]
        if self.state in _OVER:
            return None
        if isinstance(event, FrameFrom) or isinstance(event, cf.ControlFrame):
            return "peer-error"
        raise LocalProtocolError(f"{type(self).__name__}: event {key.__name__} in state {self.state}")

"""The daemon's lifecycle machine (kafilad/proto/lifecycle.py; issue 25 item 3). No trio, no sockets."""

from __future__ import annotations

import pytest

from kafilad.errors import LocalProtocolError
from kafilad.proto.lifecycle import (SHUTTING_DOWN, Ended, GaveUp, Hosted, Joined, Left, Lifecycle, Phase, Rejoin,
                                     Restore, Stop)

P = Phase


def walk(*events) -> Lifecycle:
    m = Lifecycle()
    for ev in events:
        m.handle(ev)
    return m


@pytest.mark.parametrize("events, phase", [
    ((), P.IDLE),
    ((Hosted(),), P.HOSTING),
    ((Joined(),), P.MEMBER),
    ((Restore(),), P.RESTORING),
    ((Restore(), Hosted()), P.HOSTING),
    ((Restore(), GaveUp()), P.IDLE),
    ((Rejoin(),), P.RECONNECTING),
    ((Rejoin(), Joined()), P.MEMBER),
    ((Rejoin(), GaveUp()), P.IDLE),
    ((Rejoin(), Left()), P.IDLE),
    ((Joined(), Ended(rejoin=True)), P.RECONNECTING),
    ((Joined(), Ended(rejoin=False)), P.IDLE),
    ((Joined(), Ended(rejoin=True), Joined()), P.MEMBER),
    ((Hosted(), Ended(rejoin=True)), P.IDLE),  # a host never rejoins: it re-registers by itself
    ((Hosted(), Left()), P.IDLE),
    ((Rejoin(), Hosted()), P.HOSTING),  # a user's `host` while the rejoin waits
])
def test_transitions(events, phase):
    assert walk(*events).phase == phase


@pytest.mark.parametrize("event", [GaveUp(), Restore(), Rejoin()])
def test_a_late_event_changes_nothing(event):
    """A rejoin loop's give-up after a user's `host` leaves the hosted session as it is."""
    m = walk(Hosted())
    m.changed = False
    assert m.handle(event) == P.HOSTING and not m.changed
    m = Lifecycle()
    assert m.handle(event if not isinstance(event, (Restore, Rejoin)) else GaveUp()) == P.IDLE and not m.changed


@pytest.mark.parametrize("before", [(), (Hosted(),), (Joined(),), (Restore(),), (Rejoin(),)])
def test_stopping_is_final_and_refuses_new_sessions_with_a_code(before):
    m = walk(*before, Stop())
    assert m.phase == P.STOPPING and m.changed
    for ev in (Hosted(), Joined(), Ended(rejoin=True), Left(), Restore(), GaveUp()):
        assert m.handle(ev) == P.STOPPING
    with pytest.raises(LocalProtocolError) as info:
        m.check_may_start("host")
    assert info.value.code == SHUTTING_DOWN


def test_a_running_daemon_may_start_sessions():
    for before in ((), (Hosted(),), (Rejoin(),)):
        walk(*before).check_may_start("join")  # no refusal: the session's own checks decide

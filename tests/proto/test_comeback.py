"""The pure half of a daemon's comeback (kafilad/proto/comeback.py, issue 25 item 1): backoff, records
and the status said meanwhile, as functions of errors, records and a clock reading (no sockets, no
trio)."""

from __future__ import annotations

from kafilad.errors import RendezvousRefused, SessionError
from kafilad.proto import comeback as cb
from kafilad.proto.status import MemberRow, MemberStatus


def test_a_record_is_due_its_wait_after_the_reading_it_was_given():
    assert cb.record("abcd-1234", 2, "the host went away", now_s=1000.0, wait_s=2.5) == {
        "code": "abcd-1234", "attempt": 2, "at": 1002.5, "reason": "the host went away"}


def test_the_rejoin_backoff_doubles_to_its_cap_and_an_unknown_session_is_retried_at_the_first_wait():
    waits, delay_s, unknown = [], cb.REJOIN_FIRST_S, 0
    for _ in range(5):
        wait_s, delay_s, unknown = cb.rejoin_delay_s(SessionError("the host is unreachable"), delay_s, unknown)
        waits.append(wait_s)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0] and unknown == 0
    away = RendezvousRefused("no session with that id is open", code="unknown_session")
    assert cb.rejoin_delay_s(away, 4.0, 0) == (cb.REJOIN_FIRST_S, 4.0, 1)
    assert cb.rejoin_delay_s(away, 4.0, cb.REJOIN_UNKNOWN_SESSION_TRIES) == (4.0, 5.0, cb.REJOIN_UNKNOWN_SESSION_TRIES)


def test_the_status_while_reconnecting_and_restoring_counts_down_from_the_reading():
    info = cb.record("abcd-1234", 3, "the rendezvous closed", now_s=100.0, wait_s=4.0)
    ended = MemberStatus(session_id="abcd", state="failed", host="h", blocks=[0, 4], head=True,
                         members=[MemberRow(name="h", blocks=[0, 8])])
    snap = cb.reconnecting_status(info, ended, now_s=101.0).to_json()
    assert snap["state"] == cb.RECONNECTING and snap["session_id"] == "abcd" and snap["host"] == "h"
    assert snap["blocks"] is None and snap["head"] is False and snap["members"] == [] and snap["role"] == "member"
    assert snap["reconnecting"] == {"attempt": 3, "next_in_s": 3.0, "reason": "the rendezvous closed"}
    assert snap["rendezvous"] == "reconnecting (attempt 3, next in 3 s)" and snap["control"] == "down"
    fresh = cb.reconnecting_status(info, None, now_s=200.0)
    assert fresh.reconnecting["next_in_s"] == 0.0 and fresh.control is None and fresh.host is None
    restoring = cb.restoring_status(info, now_s=110.0).to_json()
    assert restoring["state"] == cb.RESTORING and restoring["restoring"]["next_in_s"] == 0.0
    assert restoring["role"] == "host" and restoring["members"] == [] and restoring["pending"] == []
    assert restoring["rendezvous"] == "re-registering the session (attempt 3, under way)"
    assert "reconnecting" not in restoring and "restoring" not in snap
    assert "abcd-1234" in cb.restoring_sentence(info) and "attempt 3" in cb.restoring_sentence(info)
    assert cb.session_id_of("ABCD-1234") == "abcd" and cb.session_id_of("nodash") is None

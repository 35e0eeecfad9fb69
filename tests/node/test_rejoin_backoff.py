"""The member daemon's rejoin backoff (kafilad/node/daemon.py `rejoin_delay_s`, issue 8 §2).

After a rendezvous restart the members' rejoins reach it before their host re-registered (the
host's own reconnect waits from 1 s): the rendezvous answers "unknown_session". Doubling the wait
on that answer left a member out for 4-8 s after its host was back (a chaos run: 10 s recoveries
of rendezvous restarts); those answers are retried at the first wait instead.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import RendezvousRefused, SessionError
from kafilad.node.daemon import REJOIN_FIRST_S, REJOIN_MAX_S, REJOIN_UNKNOWN_SESSION_TRIES, rejoin_delay_s
from kafilad.proto.identity import compose_session_code
from node.session_harness import session_world


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


def test_unknown_session_answers_are_retried_at_the_first_wait_then_the_doubling_resumes():
    unknown = RendezvousRefused("No session 'abcd' is open at this rendezvous", "unknown_session")
    delay_s, tries, waits = REJOIN_FIRST_S, 0, []
    for _ in range(REJOIN_UNKNOWN_SESSION_TRIES + 3):
        wait_s, delay_s, tries = rejoin_delay_s(unknown, delay_s, tries)
        waits.append(wait_s)
    assert waits == [REJOIN_FIRST_S] * REJOIN_UNKNOWN_SESSION_TRIES + [1.0, 2.0, 4.0]


def test_other_failures_double_up_to_the_cap():
    delay_s, tries, waits = REJOIN_FIRST_S, 0, []
    for e in [SessionError("Cannot reach the rendezvous"), RendezvousRefused("full", "session_full")] * 4:
        wait_s, delay_s, tries = rejoin_delay_s(e, delay_s, tries)
        waits.append(wait_s)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, REJOIN_MAX_S, REJOIN_MAX_S, REJOIN_MAX_S] and tries == 0


@trio_test
async def test_a_join_to_a_session_the_rendezvous_does_not_hold_is_refused_as_unknown_session(tmp_path, model_dir,
                                                                                              monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2)
        gone = compose_session_code("zzzzzzzz", h.node.public_key)  # the host's key, a session not registered
        with trio.fail_after(10), pytest.raises(RendezvousRefused, match="is open at this rendezvous") as refused:
            await w.join("m1", gone)
        assert refused.value.code == "unknown_session"
        w.nursery.cancel_scope.cancel()

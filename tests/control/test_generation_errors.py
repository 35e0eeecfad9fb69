"""What an HTTP client is told when its generation fails (kafilad/control/api_common.py `generation_error`).

A new user's report (2026-12-01): a streaming request in flight when a member was SIGKILLed ended
with "The session is loading; it serves requests once it is ready." — the sentence naming the lost
member, which `kafila-ctl generate` shows, was replaced by the session's state.
"""

from __future__ import annotations

from types import SimpleNamespace

from kafilad.control.api_common import generation_error
from kafilad.errors import GenerationError, SessionNotReadyError
from kafilad.node.host import HostSession
from kafilad.proto.session import HostState


def session_in(state: HostState) -> HostSession:
    s = object.__new__(HostSession)  # only its state is read here
    s.machine = SimpleNamespace(state=state)
    return s


def test_a_request_failed_by_a_lost_member_names_it_and_then_the_state():
    dropped = "the connection dropped without a goodbye (network loss, or the other side was killed)"
    e = GenerationError(f"member mc (qyjt2e4o) left the session: {dropped}")
    err = generation_error(e, session_in(HostState.LOADING))
    assert err.status == 503 and err.kind == "service_unavailable"
    assert err.message == (f"member mc (qyjt2e4o) left the session: {dropped}. "
                           "The session is loading; it serves requests once it is ready.")
    assert any(name == "retry-after" for name, _ in err.headers)


def test_a_request_that_never_started_is_told_the_state_alone():
    err = generation_error(SessionNotReadyError("The session is not ready to generate (state: loading).", state="loading"),
                           session_in(HostState.LOADING))
    assert err.status == 503 and err.message == "The session is loading; it serves requests once it is ready."


def test_in_a_ready_session_a_failure_is_a_500_with_its_sentence():
    err = generation_error(GenerationError("member mb is unreachable: the ring link closed"), session_in(HostState.READY))
    assert err.status == 500 and err.message == "member mb is unreachable: the ring link closed"

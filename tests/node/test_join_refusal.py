"""A member refuses a host whose key does not match the session code, in one plain sentence (a new
user's report, 2026-12-01: "refusing to join" came twice in it) that does not show the key that
answered (a later report: a user could "fix" a man-in-the-middle by copying it into the code). A real HostSession and
MemberSession over the in-process world (tests/node/session_harness.py)."""

from __future__ import annotations

import pytest
from trio.testing import trio_test

from kafilad.errors import SessionError
from kafilad.proto.identity import compose_session_code, fingerprint
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_a_code_with_another_keys_fingerprint_is_refused_in_one_sentence(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2)
        other = w.node("x").public_key  # a key that is not the host's
        code = compose_session_code(h.session_id, other)
        with pytest.raises(SessionError) as refused:
            await w.join("m1", code)
        message = str(refused.value)
        assert message == (f"Refusing to join session {h.session_id}: the host's key does not match the "
                           "fingerprint in the session code (the code may be mistyped or out of date, or something "
                           "that is not the host answered); ask the host for the code again (`kafila-ctl status` "
                           "on the host shows it).")
        assert message.lower().count("refusing to join") == 1
        # the key that answered is not shown: copying it into the code must not be the "fix"
        assert fingerprint(h.node.public_key) not in message and h.node.peer_id not in message

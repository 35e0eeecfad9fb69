"""A member refuses a host whose key does not match the session code, in one plain sentence (a new
user's report, 2026-12-01: "refusing to join" came twice in it). A real HostSession and
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
        assert message == (f"Refusing to join session {h.session_id}: the host's key does not match the session "
                           f"code's fingerprint (expected {fingerprint(other)}, got {fingerprint(h.node.public_key)}).")
        assert message.lower().count("refusing to join") == 1

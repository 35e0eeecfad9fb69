"""A code with another key's fingerprint is refused in one plain sentence (a new user's report,
2026-12-01: "refusing to join" came twice in it) that does not show the host's key; since issue 22
the rendezvous itself finds no session for it (it holds sessions under their whole code), and the
member's own check of the host key in the Noise handshake stays behind it (kafilad/node/session/member.py) (a later report: a user could "fix" a man-in-the-middle by copying it into the code). A real HostSession and
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
        # the rendezvous holds the session under its whole code (proto_spec 03 §2.2): a code with another key's
        # fingerprint finds no session there, before any handshake with whatever would answer
        assert message.startswith(f"No session '{h.session_id}' is open at this rendezvous; check the code")
        assert message.count(".") == 1 and message.endswith(".")
        # the key that answered is not shown: copying it into the code must not be the "fix"
        assert fingerprint(h.node.public_key) not in message and h.node.peer_id not in message

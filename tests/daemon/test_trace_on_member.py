"""`kafila-ctl trace` on a member says where the trace is (issue 10): only the host writes it."""

from __future__ import annotations

import pytest
import trio

from kafilad.errors import KafilaError
from kafilad.daemon import Node
from kafilad.node.session.member import MemberSession
from kafilad.node.session.statedir import StateDir
from kafilad.proto.identity import compose_session_code
from kafilad.proto.noise import generate_keypair


def _member_node(tmp_path) -> tuple[Node, MemberSession]:
    node = Node(StateDir(tmp_path / "state"), name="bravo", rendezvous="ws://127.0.0.1:9")
    _, host_public = generate_keypair()
    code = compose_session_code("k3v9q2xa", host_public)
    node.session = MemberSession(node, code=code, rendezvous="ws://127.0.0.1:9")
    return node, node.session


def test_trace_on_a_member_names_the_host(tmp_path):
    node, session = _member_node(tmp_path)
    session.host_name = "alpha"  # set by the handshake with the host (member.py)
    with pytest.raises(KafilaError) as e:
        trio.run(node.op_trace, {}, None)
    assert str(e.value) == ("This daemon is a member of session k3v9q2xa hosted by alpha; "
                            "the session trace is on the host: run `kafila-ctl trace` there.")


def test_trace_on_a_member_before_the_handshake_names_the_host_key(tmp_path):
    node, session = _member_node(tmp_path)
    with pytest.raises(KafilaError) as e:
        trio.run(node.op_trace, {}, None)
    assert (f"member of session k3v9q2xa hosted by the host with key fingerprint {session.host_fingerprint};"
            in str(e.value))
    assert len(session.host_fingerprint) == 16


def test_trace_without_a_session(tmp_path):
    node = Node(StateDir(tmp_path / "state"), name="bravo", rendezvous=None)
    with pytest.raises(KafilaError, match="has no session, so there is no trace"):
        trio.run(node.op_trace, {}, None)

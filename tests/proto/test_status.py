"""The typed status snapshot (kafilad/proto/status.py, issue 25 item 1): its JSON keeps the
`status --json` document's shape, and a document reads back into the same types."""

from __future__ import annotations

from kafilad.proto.status import (HostMemberRow, HostStatus, MemberRow, MemberStatus, NodeStatus, RequestCounts)


def _host() -> HostStatus:
    rows = [HostMemberRow(name="h", peer_id="p-h", blocks=[0, 5], head=True, predicted_stage_s=0.002, ready=True,
                          head_allowed=True),
            HostMemberRow(name="m1", peer_id="p-m1", blocks=[5, 8], ready=True, control="up", nat_class="EIM"),
            HostMemberRow(name="m2", peer_id="p-m2", lost="its connection closed", control="down")]
    return HostStatus(session_id="abcd", code="abcd-1234", state="ready", members=rows, rendezvous="connected",
                      model_id="stories260K", requests=RequestCounts(running=1, queued=0, concurrency=2, queue_limit=8),
                      pending=[{"peer_id": "p-x", "name": "x"}], epoch=2, edges=[{"from": "h", "to": "m1"}])


def test_a_host_node_as_json_and_back():
    node = NodeStatus(name="h", peer_id="p-h", fingerprint="ab:cd", lifecycle="hosting", rendezvous="ws://r:1",
                      http="http://127.0.0.1:8400/v1", session=_host())
    doc = node.to_json()
    assert doc["session"] == "abcd" and doc["role"] == "host" and doc["state"] == "ready"
    assert doc["rendezvous"] == "connected"  # the session's connection state replaces the node's URL
    assert doc["requests"] == {"running": 1, "queued": 0, "concurrency": 2, "queue_limit": 8}
    assert [m["name"] for m in doc["members"]] == ["h", "m1", "m2"] and doc["members"][2]["lost"]
    assert doc["members"][1]["control"] == "up" and doc["pending"] == [{"peer_id": "p-x", "name": "x"}]
    assert "reconnecting" not in doc and "restoring" not in doc  # only while they apply
    back = NodeStatus.from_json(doc)
    assert back.session == node.session and back.state == "ready" and back.role == "host"
    assert isinstance(back.session.members[0], HostMemberRow) and back.to_json() == {**doc, "rendezvous": "connected"}


def test_an_idle_node_and_a_member():
    idle = NodeStatus(name="m9", lifecycle="idle", rendezvous="ws://r:1")
    assert idle.to_json() == {"name": "m9", "peer_id": None, "fingerprint": None, "lifecycle": "idle",
                              "rendezvous": "ws://r:1", "http": None, "session": None, "state": "idle", "members": []}
    assert NodeStatus.from_json(idle.to_json()) == idle and idle.state == "idle" and idle.role is None
    member = MemberStatus(session_id="abcd", state="ready", host="h", blocks=[5, 8], members=[MemberRow(name="h")],
                          reconnecting={"attempt": 2, "next_in_s": 1.5})
    doc = NodeStatus(name="m1", session=member).to_json()
    assert doc["role"] == "member" and doc["blocks"] == [5, 8] and doc["reconnecting"]["attempt"] == 2
    assert set(doc["members"][0]) == {"name", "peer_id", "blocks", "head", "predicted_stage_s", "measured_stage_s"}
    assert NodeStatus.from_json(doc).session == member

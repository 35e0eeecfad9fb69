"""A decode schedule set with `kafila-ctl schedule` while a member heads the ring follows the head when a
replan moves it to another member (issue 25 item 6): the host's plan frame carries the setting to the
new head (proto_spec 05 §2 `plan`, "schedule"). Real daemons' handlers (kafilad/daemon.py) and sessions
in the in-process world (tests/node/session_harness.py)."""

from __future__ import annotations

from trio.testing import trio_test

from kafilad.daemon import _ignore
from kafilad.proto.session import HostState
from node.session_harness import CAPABILITY, session_world


@trio_test
async def test_a_schedule_set_on_a_member_head_follows_the_head_that_a_replan_moves(tmp_path, session_model,
                                                                                   monkeypatch):
    async with session_world(tmp_path, session_model, monkeypatch) as w:
        w.host_capability = {**CAPABILITY, "bandwidth_Bps": CAPABILITY["bandwidth_Bps"] / 20}  # a slow host
        d = w.daemon("h")
        await d.op_host({"model_dir": str(session_model), "members": 3, "context": 256, "concurrency": 2,
                         "head": "any", "strategy": "kafila", "open": True}, _ignore)
        h = d.session
        ms = [await w.join(f"m{i}", h.code) for i in (1, 2)]
        await w.wait(lambda: h.state == HostState.READY and all(m.state == "ready" for m in ms), 20, "formation")
        head = h.machine.head()
        assert not head.is_host, h.snapshot()["plan"]
        assert (await d.op_schedule({"mode": "per-request"}, _ignore))["mode"] == "per-request"
        assert (await d.op_schedule({}, _ignore))["mode"] == "per-request"  # read back from the member head

        head_session = next(m for m in ms if m.node.peer_id == head.peer_id)
        survivor = next(m for m in ms if m is not head_session)
        await head_session.link.stream.transport.aclose()  # the head is lost: the host replans without it
        await w.wait(lambda: h.state == HostState.READY and h.machine.head() is not None
                     and h.machine.head().name == survivor.node.name and survivor.ring is not None
                     and survivor.ring.scheduler is not None, 20, "the replan with the other member as head")
        assert (await d.op_schedule({}, _ignore))["mode"] == "per-request"  # the new head holds the setting
        w.nursery.cancel_scope.cancel()

"""Ring circuits nobody reads do not hold up the host's other circuits (issue 25 item 6).

At a3f8e79 every session's accept loop handed each incoming "ring" circuit to a channel of 8 that
only a forming ring edge reads (kafilad/node/serving/stagehost.py ``accept_circuits``), one at a time: ring
circuits arriving between rings (stale ones of an earlier formation, a peer's retries) filled it, the
loop then waited on it, and the host accepted no control circuit more: a member's join hung. Here a
real host over the in-memory rendezvous and network (tests/node/session_harness.py)."""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.node.session.rdv_client import open_rendezvous
from kafilad.proto.identity import parse_session_code
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STALE = 12


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_a_member_joins_after_ring_circuits_nobody_reads(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=3)  # the host, the stray peer's place at the rendezvous, m1
        x = w.node("x")  # a peer of the session whose ring circuits reach no forming ring
        async with open_rendezvous(x.rdv_url, static_private=x.static_private, name="x") as rdv:
            host_pid = await rdv.join(*parse_session_code(h.code))
            with trio.fail_after(10):
                for i in range(STALE):
                    await rdv.open_circuit(host_pid, f"ring:stale-{i}")
            with trio.fail_after(20):
                m1 = await w.join("m1", h.code)  # its control circuit is accepted: it is admitted
            assert m1.was_admitted and m1.node.peer_id in h.machine.members
        w.nursery.cancel_scope.cancel()

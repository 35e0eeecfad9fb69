"""What a member daemon says while the rendezvous is away (README "The rendezvous restarts",
docs/healing.md): a new user's trial killed the rendezvous and saw the member's `kafila-ctl status`
say `failed` for the whole outage, while its daemon was in fact retrying to rejoin.

A real HostSession and a real member daemon (kafilad/node/daemon.py ``Node``: its rejoin loop and
snapshot) over the in-process rendezvous (tests/node/session_harness.py), whose "process" is killed
and started again on the same address. Every ring edge is relayed (``KAFILA_DIRECT=0``), so the
member's stage cannot serve on without the rendezvous: its session ends and the daemon rejoins.
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import KafilaError
from kafilad.node.daemon import _ignore
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_a_member_says_it_is_reconnecting_while_the_rendezvous_is_down_then_is_ready_again(
        tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("KAFILA_DIRECT", "0")
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2)
        m1 = w.daemon("m1")
        await m1.op_join({"code": h.code}, _ignore)
        await w.wait(lambda: h.state == "ready" and m1.snapshot()["state"] == "ready", 20, "formation")
        states: list[str] = []

        async def record_states() -> None:
            while True:
                states.append(m1.snapshot()["state"])
                await trio.sleep(0.02)

        w.nursery.start_soon(record_states)
        await w.rdv.kill()
        await w.wait(lambda: (m1.snapshot().get("reconnecting") or {}).get("attempt", 0) >= 2, 10,
                     "a second rejoin attempt")
        snap = m1.snapshot()
        assert snap["state"] == "reconnecting" and snap["error"] is None, snap
        assert snap["code"] == h.code and snap["session"] == h.session_id
        about = snap["reconnecting"]
        assert about["attempt"] >= 2 and 0 <= about["next_in_s"] <= 6, about
        assert about["reason"].startswith("Cannot reach the rendezvous at "), about
        assert snap["rendezvous"].startswith(f"reconnecting (attempt {about['attempt']}, next in "), snap
        with pytest.raises(KafilaError, match=r"Timed out waiting .*\(state: reconnecting\)"):
            await m1.op_wait({"states": ["ready"], "timeout_s": 0.3}, _ignore)  # not "The session failed"

        w.rdv.restart()
        await w.wait(lambda: m1.snapshot()["state"] == "ready" and h.state == "ready", 30, "the member ready again")
        snap = m1.snapshot()
        assert snap["rendezvous"] == "connected" and snap["code"] == h.code and "reconnecting" not in snap, snap
        lost_at = next(i for i, s in enumerate(states) if s != "ready")
        assert "failed" not in states[lost_at:], states[lost_at:]
        w.nursery.cancel_scope.cancel()

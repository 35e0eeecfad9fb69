"""A device waiting for admission that leaves, or is denied, frees its place at once.

A new user's trial (2026-12-02): a device that ran `kafila-ctl leave` while it waited for `admit`
was told "The host ended the session before admitting this device." (it had left), and for the
whole admit timeout (120 s) every new `join` of it was refused: "this device is already in the
session". The host kept the waiting device's link without watching it. Now it watches the link
while the device waits (kafilad/node/session/host.py `_admitted_member`): a `leaving` frame or the link's
end drops the pending entry and the link at once, and the device can join again.

Each test asserts what freed the place (the leave or the denial; the admit timeout is an hour away),
not how fast it went. A real HostSession (not --open) and a real member daemon (kafilad/daemon.py ``Node``) over the
in-process world (tests/node/session_harness.py).
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import DENIED, JoinRefused, KafilaError
from kafilad.daemon import _ignore
from kafilad.proto.lifecycle import Phase
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: the host's admit timeout: an hour, so that a place freed within HANG_GUARD_S was freed by the
#: device's leave (or the denial), whatever the machine's load, and never by the timeout
ADMIT_TIMEOUT_S = 3600.0
#: how long a wait may take before the test calls it hung (real time: MLX runs on a worker thread)
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


def _join_soon(w, daemon, code: str) -> dict:
    """`kafila-ctl join` in the background: the dict gets "result" or "error", and "done"."""
    out: dict = {"done": trio.Event()}

    async def attempt() -> None:
        try:
            out["result"] = await daemon.op_join({"code": code}, _ignore)
        except KafilaError as e:
            out["error"] = e
        finally:
            out["done"].set()
    w.nursery.start_soon(attempt)
    return out


async def _join_again_admitted(w, h, e) -> dict:
    """`e` joins the session again, is pending (not refused), and the host admits it; its join's outcome."""
    again = _join_soon(w, e, h.code)
    await w.wait(lambda: "e" in [p.name for p in h.pending.values()] or again["done"].is_set(), 10, "e pending again")
    assert "error" not in again, again.get("error")
    h.decide("e", "admit")
    await w.wait(lambda: again["done"].is_set(), 10, "the second join admitted")
    return again


@trio_test
async def test_a_device_that_leaves_while_pending_can_join_again_at_once(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2, open_=False, admit_timeout_s=ADMIT_TIMEOUT_S)
        e = w.daemon("e")
        first = _join_soon(w, e, h.code)
        await w.wait(lambda: "e" in [p.name for p in h.pending.values()], 10, "e pending")
        await e.op_leave({}, _ignore)
        await w.wait(lambda: first["done"].is_set(), HANG_GUARD_S, "the first join ended")
        assert str(first["error"]) == "This device left before the host admitted it.", first
        # freed by the leave, not by the admit timeout, which is far beyond this wait
        await w.wait(lambda: not h.pending and e.peer_id not in h.links, HANG_GUARD_S, "the host freed the place")

        again = await _join_again_admitted(w, h, e)
        assert again["result"]["host"] == "h", again
        await w.wait(lambda: h.state == "ready" and e.snapshot()["state"] == "ready", 30, "formation")
        w.nursery.cancel_scope.cancel()


@trio_test
async def test_a_denied_device_hears_what_to_do_and_can_join_again(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2, open_=False, admit_timeout_s=ADMIT_TIMEOUT_S)
        e = w.daemon("e")
        first = _join_soon(w, e, h.code)
        await w.wait(lambda: "e" in [p.name for p in h.pending.values()], 10, "e pending")
        h.decide("e", "deny")
        await w.wait(lambda: first["done"].is_set(), HANG_GUARD_S, "the join refused")
        assert str(first["error"]) == ("The host refused this device with `kafila-ctl deny`; to try again, run "
                                       "`kafila-ctl join` again and ask the host to run `kafila-ctl admit e`."), first
        # the host's `denied` frame carried its code to the join's error (issue 25 item 3: decided on it)
        assert isinstance(first["error"], JoinRefused) and first["error"].code == DENIED
        assert e.lifecycle.phase == Phase.IDLE and e.snapshot()["lifecycle"] == "idle"
        await w.wait(lambda: not h.pending and e.peer_id not in h.links, HANG_GUARD_S, "the host freed the place")

        again = await _join_again_admitted(w, h, e)
        assert "result" in again, again.get("error")
        assert e.lifecycle.phase == Phase.MEMBER and e.snapshot()["lifecycle"] == "member"
        await e.op_leave({}, _ignore)
        assert e.lifecycle.phase == Phase.IDLE
        w.nursery.cancel_scope.cancel()

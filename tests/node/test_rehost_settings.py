"""A restarted host daemon hosts its remembered session again with the settings it was hosted with
(kafilad/daemon.py ``_rehost``, issue 8 §4): `host --queue 1` was lost on a restart (issue 25
item 6: session.json had no queue), so the session admitted 4 x concurrency waiting requests."""

from __future__ import annotations

import json

import pytest
from trio.testing import trio_test

from kafilad.daemon import _ignore
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_a_restarted_host_keeps_its_request_queue(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = w.daemon("h")
        code = (await h.op_host({"model_dir": str(model_dir), "members": 1, "context": 256, "concurrency": 2,
                                 "queue": 1}, _ignore))["code"]
        await w.wait(lambda: h.snapshot()["state"] == "ready", 20, "the host alone ready")
        assert h.snapshot()["requests"]["queue_limit"] == 1
        assert json.loads((h.state.path / "session.json").read_text())["queue"] == 1
        h._session_scope.cancel()  # its process stops
        await w.wait(lambda: h.session.state in ("failed", "closed"), 10, "the old session ended")

        again = w.daemon("h")  # the restarted daemon, same state dir
        w.nursery.start_soon(again._rehost, again.state.remembered_session())
        await w.wait(lambda: again.snapshot()["state"] == "ready", 20, "the session hosted again")
        snap = again.snapshot()
        assert snap["code"] == code and snap["requests"]["queue_limit"] == 1, snap["requests"]
        assert snap["requests"]["concurrency"] == 2
        w.nursery.cancel_scope.cancel()

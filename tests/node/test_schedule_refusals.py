"""`kafila-ctl schedule` refusals (kafilad/daemon.py `op_schedule`), on a real daemon hosting a
session alone in the in-process world (tests/node/session_harness.py)."""

from __future__ import annotations

import pytest
from trio.testing import trio_test

from kafilad.errors import HEAD_UNREACHABLE, KafilaError
from kafilad.daemon import _ignore
from node.session_harness import session_world


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_a_bad_schedule_is_refused_for_what_it_is_in_words_that_fit_the_concurrency(tmp_path, model_dir,
                                                                                          monkeypatch):
    """A trial (2026-12-02): on a host whose head was a member, `schedule bogus` was told the host is not
    the head (the setting was never looked at); on a session of concurrency 1, `schedule 3` read "at
    most 1 requests run at once ... give 1 to 1"."""
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = w.daemon("h")
        await h.op_host({"model_dir": str(model_dir), "members": 1, "context": 256, "concurrency": 1}, _ignore)
        await w.wait(lambda: h.snapshot()["state"] == "ready", 20, "the host alone ready")
        with pytest.raises(KafilaError) as e:
            await h.op_schedule({"mode": "3"}, _ignore)
        assert str(e.value) == ("A schedule of 3 micro-batches cannot be filled: at most 1 request runs at once in "
                                "this session (--concurrency); give 1, auto, lockstep or per-request.")
        h.session.ring.scheduler = None  # as on a host whose head is a member: a bad setting is still named
        with pytest.raises(KafilaError) as e:
            await h.op_schedule({"mode": "bogus"}, _ignore)
        assert "not the ring's head" not in str(e.value) and "bogus" in str(e.value), e.value
        with pytest.raises(KafilaError) as e:  # a good one is asked of the member head, here with no link to it
            await h.op_schedule({"mode": "lockstep"}, _ignore)
        assert e.value.code == HEAD_UNREACHABLE, e.value
        w.nursery.cancel_scope.cancel()

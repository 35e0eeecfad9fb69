"""When the host's session fails (here: no plan fits the fleet), its members are told so and stop.

A new user's trial (2026-12-02): `host --concurrency 100000` left the host `failed` with a message
that did not say what to do, while its members looped forever trying to rejoin ("The host closed
the link before admitting this device"), and the host's log blamed them for going silent. A member
is told the session failed and why (`session_failed`, proto_spec 05 §2), forgets it (it is in no
session any more: no rejoin), and says so in its status; the host closes their links itself.

A real HostSession and real member daemons (kafilad/daemon.py ``Node``: its rejoin loop and
snapshot) over the in-process world (tests/node/session_harness.py).
"""

from __future__ import annotations

import logging

import pytest
import trio
from trio.testing import trio_test

from kafilad.errors import KafilaError, SessionError
from kafilad.daemon import _ignore
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


@trio_test
async def test_members_of_a_session_no_plan_fits_are_told_and_stop_rejoining(tmp_path, model_dir, monkeypatch,
                                                                                caplog):
    caplog.set_level(logging.INFO)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=3, concurrency=10 ** 8)  # KV memory for 10^8 requests: no device holds it
        m1, m2 = w.daemon("m1"), w.daemon("m2")
        await m1.op_join({"code": h.code}, _ignore)
        await m2.op_join({"code": h.code}, _ignore)
        await w.wait(lambda: h.state == "failed", 20, "the host failed")
        assert h.error.startswith("No plan fits this fleet: "), h.error
        assert h.error.endswith(". To try again, run `kafila-ctl leave` on the host and host the model again with "
                                "settings that fit (`kafila-ctl host`); the members then join its new code."), h.error
        assert "lower the context or concurrency. To try again" in h.error, h.error
        told = f"The session failed on the host: {h.error}"
        for m in (m1, m2):
            await w.wait(lambda: m.snapshot()["state"] == "failed", 10, "the member failed")
        await trio.sleep(3)  # a rejoin would have begun by now (its first wait is 1 s)
        for m in (m1, m2):
            snap = m.snapshot()
            assert snap["state"] == "failed" and snap["error"] == told, snap
            assert m.rejoining is None and m.state.remembered_session() is None
            with pytest.raises(KafilaError) as failed:
                await m.op_wait({"states": ["ready"], "timeout_s": 1}, _ignore)
            assert str(failed.value) == f"The session failed: {told.rstrip('.')}."
        assert not h.links and not h.outboxes  # the host closed their links itself
        blamed = [r.getMessage() for r in caplog.records if "sent nothing for" in r.getMessage()]
        assert not blamed, blamed

        # a device that joins the failed session now is refused at once, in a sentence saying what to do
        with pytest.raises(SessionError) as refused:
            await w.join("m3", h.code)
        assert str(refused.value) == (
            "The host refused this device: its session failed and admits no device; the host must run "
            "`kafila-ctl leave` and host the model again, then share the new session code.")
        w.nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kw, said", [
    ({"concurrency": 0}, "--concurrency must be at least 1 (got 0)."),
    ({"context": 1}, "--context must be at least 2 tokens, room for one prompt token and one generated token "
                     "(got 1)."),
    ({"context": 0}, "--context must be at least 2 tokens, room for one prompt token and one generated token "
                     "(got 0)."),
    ({"members": 4}, "--members counts every machine, the host included, and a session has at most one per block "
                     "of the model: it must be between 1 and 3 for synth (got 4)."),
])
def test_host_refuses_arguments_no_session_could_serve_in_a_sentence_about_them(tmp_path, model_dir, kw, said):
    """`host --concurrency 0` quoted a context the user had not passed; `--context 1` became ready and
    failed every request; `--members` claimed every member holds a block (not so for strategy load)."""
    from types import SimpleNamespace
    from kafilad.node.session.host import HostSession
    from kafilad.node.session.statedir import StateDir
    node = SimpleNamespace(state=StateDir(tmp_path / "h").ensure())  # refused before it uses anything else
    args = {"members": 2, "context": 256, "concurrency": 1, **kw}
    with pytest.raises(KafilaError) as refused:
        HostSession(node, model_dir=str(model_dir), rendezvous="ws://127.0.0.1:1", open_=True, admit_timeout_s=30,
                    **args)
    assert str(refused.value) == said


def test_join_exits_with_the_members_sentence_not_a_wrapped_one():
    from kafila_ctl.cli import join_failed_sentence
    told = "The session failed on the host: No plan fits this fleet: x. To try again, run `kafila-ctl leave`."
    assert join_failed_sentence(told) == told
    assert join_failed_sentence("the link to the host closed: gone") == "Joining failed: the link to the host closed: gone."
    assert join_failed_sentence(None) == "Joining failed: the session failed."

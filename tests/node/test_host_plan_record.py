"""The plan the host shows (`status`, `schedule`, the generation trace: ``HostSession.plan``) is the one
its machine accepted (issue 25 item 6).

At a3f8e79 host.py set ``self.plan`` before handing the planner's answer to the machine: a plan that
waited in ``drain_for`` (a member returned while requests ran) and was overtaken by a loss (the machine
replanned meanwhile, so it drops that answer as stale) overwrote the newer, accepted plan. The race
itself depends on the order trio runs two woken tasks in; these tests hand the host's planner step a
stale answer directly, as that race does, on a real session (tests/node/session_harness.py).
"""

from __future__ import annotations

import pytest
import trio
from trio.testing import trio_test

from kafilad.proto.session import HostState
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


def shown_blocks(h) -> dict:
    return {m["name"]: m["blocks"] for m in h.snapshot()["members"]}


@trio_test
async def test_a_plan_the_machine_drops_as_stale_does_not_replace_the_plan_shown(tmp_path, model_dir, monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, _ = await w.form(2)
        accepted = h.snapshot()["plan"]
        blocks = shown_blocks(h)
        assert h.state == HostState.READY and all(blocks.values()), blocks
        seq, epoch = h.machine.plan_seq, h.machine.epoch
        without_m2 = tuple(e for e in h.machine.live() if e.name != "m2")
        with trio.fail_after(20):
            await h._make_plan(without_m2, seq - 1)  # the answer to a plan request made before a later one
        assert h.machine.plan_seq == seq and h.machine.epoch == epoch and h.state == HostState.READY
        assert h.snapshot()["plan"] == accepted
        assert shown_blocks(h) == blocks and h.plan.to_json() == h.machine.planned.plan


@trio_test
async def test_the_planner_runs_on_a_worker_thread_not_the_event_loop(tmp_path, model_dir, monkeypatch):
    """Issue 25 item 6: host.py ran the planner on the trio thread, and a trial's plan froze the event
    loop for 36 s (no ping, no request, no status meanwhile). The real planner runs; the test notes
    the thread each call ran on."""
    import threading
    from kafilad.node.session import host as host_module
    threads = []
    real = host_module.make_plan

    def noting_plan(*args, **kw):
        threads.append(threading.current_thread())
        return real(*args, **kw)
    monkeypatch.setattr(host_module, "make_plan", noting_plan)
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h, _ = await w.form(2)
        assert h.state == HostState.READY and len(threads) == 1
        assert threads[0] is not threading.main_thread(), threads

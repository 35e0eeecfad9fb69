"""What a request meets while the session heals (kafilad/node/serving/host_requests.py `wait_serving`).

A new user's report (2026-12-01): a request that arrived during a 0.2 s recovery (a member lost,
the host replanning and re-forming the ring) failed at once with 503 + Retry-After. It now waits
for the session to serve again, at most RECOVERY_WAIT_S; it is refused, naming the state, when
the session fails or closes meanwhile, when the wait runs out, or when the session is not healing
(still forming, or degraded). A stage's measured time belongs to the plan it was measured under.
A real HostMachine fed through the driver's `_handle` (tests/node/healing_host.py); time is
trio's MockClock.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kafilad.errors import GenerationCancelled, SessionNotReadyError
from kafilad.node.serving import host_requests
from kafilad.node.serving.host_requests import RECOVERY_WAIT_S
from kafilad.proto import session as sm

from node.healing_host import HealingHost, lose_beta, ready_host
from proto.session_helpers import walk_host

H = sm.HostState


def run(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def waiter(h: HealingHost, out: dict, gone: trio.Event | None = None) -> None:
    """One request's wait; `out` gets its outcome and when it came (s since the wait began)."""
    t0 = trio.current_time()
    try:
        await h.wait_serving(gone)
        out["outcome"] = h.state
    except (SessionNotReadyError, GenerationCancelled) as e:
        out["outcome"] = e
    out["after_s"] = trio.current_time() - t0


def test_a_request_that_arrives_while_the_session_heals_runs_once_it_serves_again():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        out: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, h, out)
            await trio.sleep(1.5)
            await h.replan()  # the plan over host and alpha: loading
            assert h.state == H.LOADING and not out
            await trio.sleep(0.5)
            await h.load_all()
        assert out == {"outcome": H.READY, "after_s": 2.0}
    run(main)


@pytest.mark.parametrize("end, state, words", [
    (sm.Abort("the host's stage could not be loaded"), H.FAILED, "state: failed"),
    (sm.Close("the host closed the session", final=True), H.CLOSED, "state: closed"),
])
def test_a_session_that_fails_or_closes_meanwhile_refuses_the_waiting_request_then(end, state, words):
    async def main():
        h = await ready_host()
        await lose_beta(h)
        out: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, h, out)
            await trio.sleep(3)
            await h._handle(end)
        assert h.state == state and out["after_s"] == 3
        assert isinstance(out["outcome"], SessionNotReadyError) and words in str(out["outcome"])
    run(main)


def test_a_session_that_does_not_serve_again_in_time_refuses_after_the_wait():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        out: dict = {}
        await waiter(h, out)
        e = out["outcome"]
        assert out["after_s"] == RECOVERY_WAIT_S == 30
        assert isinstance(e, SessionNotReadyError) and e.state == "recovering"
        assert str(e) == ("The session is not ready to generate (state: recovering; member beta (B) left the session: "
                          "its connection closed; it did not serve again within 30 s).")
    run(main)


def test_the_wait_is_the_modules_constant(monkeypatch):
    monkeypatch.setattr(host_requests, "RECOVERY_WAIT_S", 4.0)

    async def main():
        h = await ready_host()
        await lose_beta(h)
        out: dict = {}
        await waiter(h, out)
        assert out["after_s"] == 4 and "within 4 s" in str(out["outcome"])
    run(main)


@pytest.mark.parametrize("walked", [H.FORMING, H.PLANNING, H.LOADING])
def test_a_session_that_never_served_is_not_waited_for(walked):
    async def main():
        h = HealingHost(walk_host(walked))
        out: dict = {}
        await waiter(h, out)
        assert out["after_s"] == 0 and isinstance(out["outcome"], SessionNotReadyError)
        assert out["outcome"].state == walked.value
    run(main)


def test_a_degraded_session_is_not_waited_for():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        await h._handle(sm.PlanFailed("Device 'alpha' cannot hold 6 blocks.", h.machine.plan_seq))
        assert h.state == H.DEGRADED
        out: dict = {}
        await waiter(h, out)
        assert out["after_s"] == 0 and out["outcome"].state == "degraded"
        assert "waiting for a member to join" in str(out["outcome"])
    run(main)


def test_a_client_that_goes_away_while_waiting_leaves_nothing_behind():
    async def main():
        h = await ready_host()
        await lose_beta(h)
        gone = trio.Event()
        out: dict = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, h, out, gone)
            await trio.sleep(1)
            gone.set()
        assert out["after_s"] == 1 and isinstance(out["outcome"], GenerationCancelled)
        assert "went away while its request waited" in str(out["outcome"])
        changed = h.requests._state_changed  # made for the waiter; nobody waits on it now
        assert changed is None or changed.statistics().tasks_waiting == 0
        await h.replan()
        await h.load_all()
        assert h.state == H.READY and h.requests._state_changed is None
    run(main)


def test_stage_times_of_an_earlier_plan_are_dropped_by_a_replan():
    async def main():
        h = await ready_host()
        h.measured_stage_s.update(host=0.0011, alpha=0.0012, beta=0.0013)  # measured under plan 1
        await lose_beta(h)
        assert h.machine.epoch == 1 and h.measured_stage_s["alpha"] == 0.0012  # the old plan still shown
        await h.replan()
        assert h.machine.epoch == 2 and h.measured_stage_s == {}
        await h.load_all()
        assert h.measured_stage_s == {}
    run(main)

"""A HostSession's request side over a real HostMachine, for tests of what a request meets while
the session heals (kafilad/node/serving/host_requests.py `wait_serving`, `measured_stage_s` per plan).

The test feeds the session's events through the driver's one entry point, ``_handle``
(kafilad/node/session/driver.py), so ``_handled`` runs after each as in a daemon; the machine's
actions (frames to send, plans to make, links to close) are recorded in ``actions`` instead of
performed, since these tests drive the plan and the members' readiness themselves. The machine is
walked to ``loading`` by tests/proto/session_helpers.py (host "host", members alpha and beta) and
its first ``ready`` comes through ``_handle``.
"""

from __future__ import annotations

from types import SimpleNamespace

from kafilad.node.session.host import HostSession
from kafilad.node.session.driver import SessionDriver
from kafilad.proto import session as sm

from kafilad.node.serving.host_requests import HostRequests
from proto.session_helpers import B, HOST, LOAD, planned, ready_frame, walk_host


class HealingHost(HostSession):
    """See the module docstring. ``changes`` counts the node's `changed()` calls."""

    def __init__(self, machine: sm.HostMachine):
        self.changes = 0

        def changed() -> None:
            self.changes += 1
        SessionDriver.__init__(self, SimpleNamespace(changed=changed))
        self.machine = machine
        self.measured_stage_s: dict[str, float] = {}
        self.generations: dict = {}
        self.actions: list = []
        self.requests = HostRequests(self)

    async def _perform(self, action) -> None:
        self.actions.append(action)

    async def load_all(self) -> None:
        """Every stage of the current plan reports ready (the host's own last)."""
        for pid in self.machine.ring_order:
            if pid != HOST:
                await self._handle(sm.FrameFrom(pid, ready_frame(self.machine.epoch)))
        await self._handle(sm.OwnStageLoaded(dict(LOAD), self.machine.epoch))

    async def replan(self) -> None:
        """Answer the machine's last MakePlan with a plan over the members still in (the host heads)."""
        names = [e.name for e in self.machine.live() if e.capability]
        await self._handle(planned(tuple(names), names[0], self.machine.plan_seq))


async def ready_host() -> HealingHost:
    """A HealingHost of host, alpha and beta, ready (it has served: a loss now heals)."""
    h = HealingHost(walk_host(sm.HostState.LOADING))
    await h.load_all()
    assert h.state == sm.HostState.READY and h.has_served
    return h


async def lose_beta(h: HealingHost) -> None:
    """beta's ctl link ends: requests in flight fail naming it, the host recovers (replans)."""
    await h._handle(sm.MemberLost(B, "its connection closed"))
    assert h.state == sm.HostState.RECOVERING, h.state

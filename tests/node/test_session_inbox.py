"""The session's one inbox (kafilad/node/session/driver.py ``SessionDriver._handle``; issue 25 item 3).

`_handle` is entered from many tasks (the rendezvous loop, every member's ctl loop, the stage, plan
and liveness tasks) and an action may await (a link's close, a stage's end). Events are handled one
at a time in arrival order: every action of one event is performed before the next event reaches
the machine. A driver of the test's own records what it performs; its machine answers each event with
two actions, and performing an action yields to the scheduler (as closing a link does).
"""

from __future__ import annotations

import attrs
import trio
from trio.testing import trio_test

from kafilad.node.session.driver import SessionDriver


@attrs.define
class TwoActions:
    """A machine answering each event with two actions; `changed` as the session machines keep it."""
    changed: bool = False
    seen: list = attrs.Factory(list)

    def handle(self, event) -> list:
        self.seen.append(event)
        self.changed = True
        return [(event, 1), (event, 2)]


class Node:
    def __init__(self):
        self.told = 0

    def changed(self) -> None:
        self.told += 1


class RecordingDriver(SessionDriver):
    def __init__(self, node, *, posts: dict | None = None):
        super().__init__(node)
        self.machine = TwoActions()
        self.performed: list = []
        self.posts = posts or {}  # action -> an event its performing raises (from inside the action)

    async def _perform(self, action) -> None:
        self.performed.append(action)
        await trio.sleep(0.01)  # an action that waits (a link's close): other tasks run meanwhile
        if action in self.posts:
            await self._handle(self.posts[action])


@trio_test
async def test_events_from_many_tasks_are_handled_in_arrival_order_without_interleaving():
    d = RecordingDriver(Node())
    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(d._handle, f"e{i}")
            await trio.sleep(0)  # e0 arrives first, then e1, ...
    assert d.performed == [(f"e{i}", k) for i in range(5) for k in (1, 2)]
    assert d.machine.seen == [f"e{i}" for i in range(5)] and d.node.told == 5


@trio_test
async def test_an_event_raised_by_an_action_runs_after_that_events_actions():
    d = RecordingDriver(Node(), posts={("a", 1): "from-a"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d._handle, "a")
        await trio.sleep(0)
        nursery.start_soon(d._handle, "b")
    # "from-a" comes after a's second action (not nested inside a's list) and before b, which arrived
    # while a was being handled
    assert d.performed == [("a", 1), ("a", 2), ("from-a", 1), ("from-a", 2), ("b", 1), ("b", 2)]


@trio_test
async def test_an_action_that_raises_ends_its_event_and_frees_the_inbox():
    class Refusing(RecordingDriver):
        async def _perform(self, action) -> None:
            await super()._perform(action)
            if action == ("bad", 1):
                raise ValueError("refused")

    d = Refusing(Node())
    try:
        await d._handle("bad")
    except ValueError:
        pass
    await d._handle("next")
    assert d.performed == [("bad", 1), ("next", 1), ("next", 2)]

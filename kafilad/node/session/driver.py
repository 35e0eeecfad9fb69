"""What the two session drivers share: :class:`SessionDriver`, base of kafilad/node/session/host.py's
``HostSession`` and kafilad/node/session/member.py's ``MemberSession``.

Each driver is a thin driver of a pure machine (kafilad/proto/session.py ``HostMachine``,
kafilad/proto/session_member.py ``MemberMachine``; base kafilad/proto/session_machine.py): the
machine decides, the driver does the I/O. Every event goes through :meth:`SessionDriver._handle`,
the session's one inbox: events are handled strictly one after another in the order they arrive
(a FIFO lock), each event's actions performed in order (the driver's ``_perform``) before the next
event reaches the machine, then status watchers are told once (issue 25 item 3: ``_handle`` is
entered from many tasks, and ``_perform`` awaits, so two events' actions used to interleave). Besides that one entry point, the base holds the plumbing both drivers need: the
machine's view (``state``, ``error``, ``rendezvous_lost``), the stage of the current plan (its
cancel scope and ring links, DESIGN §3 healing), joining the ring once a stage is built
(DESIGN §6), and the rendezvous reconnect backoff and status text (issue 8 §3).
"""

from __future__ import annotations

import random
import time
from typing import Awaitable, Callable, Optional

import trio

from kafilad.errors import KafilaError, collapse_groups
from kafilad.node.serving import stagehost
from kafilad.node.serving.schedule_settings import apply_schedule


#: rendezvous reconnect backoff: first delay and cap (s), each jittered by ±20 % (issue 8 §3).
#: The cap bounds how long a session stays down once the rendezvous is back: the wait already begun
#: runs out first, at most RECONNECT_MAX_S × 1.2. A 30 s cap left a new user's session down 27 s
#: after a 40 s outage. The rendezvous is our own service and one try is one WebSocket carrying a
#: few small frames (challenge, key proof, register or join): at 5 s a daemon costs it 0.2 tries/s,
#: a thousand waiting daemons 200 tries/s of small frames, nothing next to the relay traffic it carries.
RECONNECT_FIRST_S = 1.0
RECONNECT_MAX_S = 5.0


def reconnect_delay_s(attempt: int) -> float:
    """The wait before rendezvous attempt `attempt` (1, 2, ...): doubling from RECONNECT_FIRST_S,
    capped at RECONNECT_MAX_S, jittered by ±20 % (issue 8 §3).

    Args:
        attempt: how many attempts this wait precedes, counting from 1.
    Returns:
        The delay in seconds.
    """
    return min(RECONNECT_MAX_S, RECONNECT_FIRST_S * 2 ** (attempt - 1)) * random.uniform(0.8, 1.2)


class SessionDriver:
    """The plumbing of a session driver; subclasses set ``machine`` and define ``_perform``.

    Attributes:
        node: the daemon (kafilad/daemon.py ``Node``): its identity, state dir, ``changed()``.
        machine: the session's machine; ``state``, ``error`` and ``rendezvous_lost`` read it.
        ring: this node's RingMember (kafilad/node/serving/ring.py) once its stage joined a ring.
        rdv: the rendezvous (client, or the host's CurrentRendezvous) once reached.
        paths: the session's PathManager (kafilad/node/paths/manager.py) while it is open.
        reconnecting: {"attempt", "at", ...} while the rendezvous is away and being re-tried.
    """

    machine = None

    def __init__(self, node):
        self.node = node
        self.ring = None
        self.rdv = None
        self.schedule_mode = None  # the head's decode schedule set by `kafila-ctl schedule` (schedule_settings.apply_schedule)
        self.paths = None
        self.reconnecting: Optional[dict] = None
        self._ring_incoming_send, self._ring_incoming = trio.open_memory_channel(8)
        self._stage_scope: Optional[trio.CancelScope] = None
        self._stage_links: tuple = ()
        self._inbox = trio.StrictFIFOLock()  # held while one event's actions run; waiters enter in arrival order
        self._inbox_task: Optional[trio.lowlevel.Task] = None  # the task holding it
        self._posted: list = []  # events raised by an action of the event being handled

    # ---- the machine's view ----------------------------------------------------------------
    @property
    def state(self):
        return self.machine.state

    @property
    def error(self) -> Optional[str]:
        return self.machine.error

    @property
    def rendezvous_lost(self) -> Optional[str]:
        return self.machine.rendezvous_lost

    # ---- the one place events enter ----------------------------------------------------------
    async def _handle(self, event) -> None:
        """Feed one event to the machine and perform its actions in order; tell watchers once.

        Events from any task are handled one at a time, in the order they arrive: an event waits until
        every action of the events before it was performed, so no two events' actions interleave even
        where an action awaits (a link's close, a stage's end). An event raised by an action of the
        event being handled (the same task) is handled right after that event's actions, not nested
        inside them.

        Raises:
            whatever an action raises (the member's Refused: JoinRefused, SessionError); events posted
            by that event's actions are then dropped with it.
        """
        if self._inbox_task is trio.lowlevel.current_task():
            self._posted.append(event)
            return
        async with self._inbox:
            self._inbox_task = trio.lowlevel.current_task()
            try:
                pending = [event]
                while pending:
                    for action in self.machine.handle(pending.pop(0)):
                        await self._perform(action)
                    pending += self._posted
                    self._posted.clear()
                    self._handled()
                    if self.machine.changed:
                        self.machine.changed = False
                        self.node.changed()
            finally:
                self._inbox_task = None
                self._posted.clear()

    async def _perform(self, action) -> None:  # pragma: no cover - each driver defines it
        raise NotImplementedError

    def _handled(self) -> None:
        """After an event's actions, before watchers are told: the driver's own bookkeeping."""

    # ---- the stage of the current plan ---------------------------------------------------------
    async def _drop_stage(self) -> None:
        """End this node's stage of an earlier plan (a replan, DESIGN §3 healing): its ring tasks, both
        of its ring links, and the requests it still ran (they fail with a sentence, never hang)."""
        if self._stage_scope is not None:
            self._stage_scope.cancel()
            self._stage_scope = None
        for link in self._stage_links:
            if link is not None:
                await link.close("the session replanned")
        self._stage_links = ()
        if self.ring is not None:
            self.ring.fail_all("The session was replanned while this request ran (a member was lost, joined or "
                               "returned, or the ring re-formed); send it again.", member=None)

    async def _in_stage_scope(self, load: Callable[[trio.Nursery], Awaitable[None]],
                              failed: Callable[[KafilaError], Awaitable[None]]) -> None:
        """Run the stage of one plan in its own cancel scope (:meth:`_drop_stage` ends it).

        Args:
            load: awaited with the stage's nursery (the ring's tasks run in it).
            failed: awaited, still inside that scope, with the KafilaError that ended the stage.
        """
        with trio.CancelScope() as scope:
            self._stage_scope = scope
            try:
                with collapse_groups():
                    async with trio.open_nursery() as stage_nursery:
                        await load(stage_nursery)
            except KafilaError as e:
                await failed(e)

    async def _join_ring(self, stage, tokenizer, *, head: bool, epoch: int, roster: dict,
                         on_edges: Callable[[], Awaitable[None]], stage_nursery: trio.Nursery,
                         plan: Optional[dict] = None, draft_model=None) -> None:
        """Make the built stage this node's RingMember of plan `epoch` and join the ring (DESIGN §6).

        Args:
            stage, tokenizer: the stage built for this plan; the tokenizer at the head, else None.
            roster: {peer_id: {"name", "public_key"}} of the ring's members.
            on_edges: awaited when a ring edge changes path (an upgrade).
            stage_nursery: where the ring's tasks run (the stage's scope).
            plan: the plan's JSON (its context and concurrency size the head's prompt cache).
            draft_model: the head's draft model (kafilad/executor/draft.py; `host --draft-model`), or None.
        Raises:
            KafilaError: a ring link could not be made.
        """
        self.ring = stagehost.make_ring_member(self.node, stage=stage, head=head, tokenizer=tokenizer, plan=plan,
                                               draft_model=draft_model)
        self.ring.epoch = epoch
        if self.ring.scheduler is not None and getattr(self, "schedule_mode", None) is not None:
            apply_schedule(self.ring.scheduler, self.schedule_mode)  # `kafila-ctl schedule` outlives a replan
        if getattr(self.ring, "drafter", None) is not None and getattr(self, "speculate_setting", None) is not None:
            self.ring.drafter.setting = self.speculate_setting[1]  # so does `kafila-ctl speculate`
        nxt, prv = await stagehost.connect_ring(paths=self.paths, session_id=self.session_id,
                                                ring=self.ring_order, roster=roster, incoming=self._ring_incoming,
                                                member=self.ring, on_edges=on_edges, epoch=epoch)
        self._stage_links = (nxt, prv)
        stagehost.attach_ring(self.ring, nursery=stage_nursery, me=self.node.peer_id, ring_order=self.ring_order,
                              names=self._ring_names(), next_link=nxt, prev_link=prv, watch=self._watch_ring)

    async def _take_ring_circuit(self, circuit) -> None:
        """Hand an incoming "ring" circuit to the ring edges that form (kafilad/node/paths/edge.py reads
        ``_ring_incoming``), never waiting: when its buffer is full, nothing forms that reads it, so the
        oldest circuit there is stale and is closed to make room. Waiting here held up the session's
        accept loop, and with it every control circuit (a member's join hung; issue 25 item 6)."""
        while True:
            try:
                self._ring_incoming_send.send_nowait(circuit)
                return
            except trio.WouldBlock:
                stale = self._ring_incoming.receive_nowait()
                await stale.aclose()

    def _ring_names(self) -> dict:  # pragma: no cover - each driver defines it
        """{peer_id: name} of the session's members, for the ring's messages."""
        raise NotImplementedError

    async def _watch_ring(self, ring) -> None:  # pragma: no cover - each driver defines it
        raise NotImplementedError

    # ---- the rendezvous ------------------------------------------------------------------------
    def _note_reconnect(self, attempt: int, delay_s: float, **about) -> None:
        """The rendezvous is away: attempt `attempt` comes in `delay_s` (status shows it); tell watchers.

        Args:
            about: more keys for ``reconnecting``, before its "at".
        """
        self.reconnecting = {"attempt": attempt, **about, "at": time.time() + delay_s}
        self.node.changed()

    def _rendezvous_status(self) -> Optional[str]:
        """"connected", "lost", or "reconnecting (attempt n, next in s)" while it is away (issue 8 §3);
        None before the rendezvous was reached."""
        if self.reconnecting is not None and self._still_reconnecting():
            left_s = max(0.0, self.reconnecting["at"] - time.time())
            return f"reconnecting (attempt {self.reconnecting['attempt']}, next in {left_s:.0f} s)"
        if self.rendezvous_lost:
            return "lost"
        return "connected" if self._rendezvous_connected() else None

    def _reconnecting_status(self) -> Optional[dict]:
        """{"attempt", "next_in_s", "reason"?} for the status while the rendezvous is re-tried (the
        reason `kafila-ctl status` prints after the rendezvous line), else None."""
        r = self.reconnecting
        if r is None or not self._still_reconnecting():
            return None
        about = {k: v for k, v in r.items() if k not in ("at", "next_in_s")}
        return {**about, "next_in_s": round(max(0.0, r["at"] - time.time()), 1)}

    def _still_reconnecting(self) -> bool:
        """Whether ``reconnecting`` still describes the session (not once it is over)."""
        return True

    def _rendezvous_connected(self) -> bool:  # pragma: no cover - each driver defines it
        raise NotImplementedError

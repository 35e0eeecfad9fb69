"""The session as data: pure host and member state machines (DESIGN §3 steps 1-2, §5, §6; proto_spec 05).

In the style of h11's ``_state.py``: each machine has an enum of states and a transition table,
``TABLE[state][event type] -> the states it may enter``; :meth:`handle` takes one typed event and
returns the actions the driver (kafilad/node/session/host.py, member.py) performs: frames to send, links
to close, requests to fail, trace records to write. A machine enters a state in one place
(``_enter``), which records the change for watchers (``changed``). No trio, no sockets, no mlx:
every transition is tested without processes (tests/proto/test_session_machines.py).

Host states::

    starting --Registered--> forming --(every member admitted and measured)--> planning
    planning --Planned--> loading --(every stage ready)--> ready
    planning --PlanFailed--> failed
    planning/loading/ready --MemberLost | Leaving | Failed | RingFailed--> recovering (MakePlan over the live)
    ready --(a member joined or returned)--> recovering (the ring serves on; the same division is kept: ready)
    ready --Reassess (a report judged against measurement)--> recovering (likewise)
    recovering --Planned--> loading | ready (plan kept) | recovering (a member of it lost meanwhile)
    recovering --PlanFailed--> degraded --(a member joins: Capability)--> recovering
    loading/ready --RingFailed (more than MAX_REFORMS in a row)--> failed
    loading/recovering --(a stage could not be built: `failed` "stage_build", OwnStageFailed)--> failed
    ready --RendezvousLost--> ready (edges direct, head here) | recovering
    any --Abort--> failed;  any --Close--> closed   (a normal close is never recorded as a failure)

Member states::

    joining --Pending--> pending --Admitted--> admitted --CapabilitySent--> measured
    measured --PlanFrame--> loading --StageLoaded--> ready
    joining/pending --Denied--> failed (the join is refused);  any --failure--> failed
    ready --RendezvousLost--> ready (both ring edges direct) | failed
    any --Close--> closed

Events that arrive from a peer (a control frame) in a state whose row does not list them are the
peer's protocol error: the action closes that peer's link with a sentence. Local events out of
place are our bug: :class:`LocalProtocolError`. In ``failed`` and ``closed`` every event but
``Close`` is ignored (the session is over; late frames change nothing), except that a failed host
answers a device that joins with a ``denied`` saying what to do (FAILED_DENIAL), and its members,
told ``session_failed``, forget the session instead of rejoining it.
"""

from __future__ import annotations

from typing import Optional

from kafilad.errors import ALREADY_IN_SESSION, ADMIT_TIMEOUT, DENIED, SESSION_COMPLETE, SESSION_FAILED
from kafilad.proto import control as cf
from kafilad.proto.session_machine import _OVER, _Machine  # noqa: F401 - _OVER re-exported
from kafilad.proto.session_member import DENIED_BY_HOST, MEMBER_TABLE, MemberMachine  # noqa: F401 - re-exported
from kafilad.proto.session_events import (  # noqa: F401 - re-exported: the machines' vocabulary
    Registered, MemberJoined, Decision, PendingTimedOut, OwnCapability, FrameFrom,
    Planned, PlanFailed, OwnStageLoaded, MemberLost, RingFailed, RendezvousLost,
    JoinFailed, Abort, Close, CapabilitySent, StageLoaded, LoadFailed,
    HostLinkLost, SessionEnded, Send, CloseLink, Remember, MakePlan,
    DistributePlan, StartLoad, StandBy, FailRequests, Trace, Formed, EdgesChanged,
    Refused, JoinAccepted, MemberEntry, PendingEntry, HostState, MemberState, RendezvousBack, ForgetSession,
    OwnStageFailed, Reassess, stage_build_failed,
)




#: the session machines' vocabulary, re-exported so drivers and tests import one module
__all__ = [
    "Abort",
    "CapabilitySent",
    "Close",
    "CloseLink",
    "Decision",
    "DistributePlan",
    "EdgesChanged",
    "FailRequests",
    "ForgetSession",
    "Formed",
    "FrameFrom",
    "HOST_TABLE",
    "HostLinkLost",
    "HostMachine",
    "HostState",
    "JoinAccepted",
    "JoinFailed",
    "LoadFailed",
    "MAX_REFORMS",
    "MEMBER_TABLE",
    "MakePlan",
    "MemberEntry",
    "MemberJoined",
    "MemberLost",
    "MemberMachine",
    "MemberState",
    "OwnCapability",
    "OwnStageFailed",
    "OwnStageLoaded",
    "PendingEntry",
    "PendingTimedOut",
    "PlanFailed",
    "Planned",
    "Reassess",
    "Refused",
    "Remember",
    "RendezvousBack",
    "RendezvousLost",
    "RingFailed",
    "Send",
    "SessionEnded",
    "StageLoaded",
    "StandBy",
    "StartLoad",
    "stage_build_failed",
    "Trace",
    "_Machine",
    "_OVER",
]

H = HostState
#: rows every live state shares: admission stays open while the session is below its size
_ADMISSION = {MemberJoined, Decision, PendingTimedOut}
_LIVE = (H.FORMING, H.PLANNING, H.LOADING, H.READY, H.RECOVERING, H.DEGRADED)


def _row(state, **rows) -> dict:
    out = {ev: {state} for ev in _ADMISSION}
    if state in (H.PLANNING, H.LOADING, H.READY, H.RECOVERING):
        out[MemberJoined] = {state, H.RECOVERING}  # a member back after an outage replaces its old entry
    out.update({Abort: {H.FAILED}, Close: {H.CLOSED}, RendezvousBack: {state}, Reassess: {state}})
    for ev, targets in rows.items():
        out[_EVENTS[ev]] = set(targets)
    return out


_EVENTS = {"Registered": Registered, "OwnCapability": OwnCapability, "Capability": cf.Capability,
           "MemberLost": MemberLost, "Leaving": cf.Leaving, "Failed": cf.Failed, "RendezvousLost": RendezvousLost,
           "Planned": Planned, "PlanFailed": PlanFailed, "Reassess": Reassess, "Ready": cf.Ready, "OwnStageLoaded": OwnStageLoaded,
           "OwnStageFailed": OwnStageFailed,
           "Edges": cf.Edges, "RingBroken": cf.RingBroken, "RingFailed": RingFailed}

HOST_TABLE: dict = {
    H.STARTING: {Registered: {H.FORMING}, Abort: {H.FAILED}, Close: {H.CLOSED}},
    H.FORMING: _row(H.FORMING, OwnCapability={H.FORMING, H.PLANNING}, Capability={H.FORMING, H.PLANNING},
                    MemberLost={H.FORMING}, Leaving={H.FORMING}, Failed={H.FORMING}, RendezvousLost={H.FORMING}),
    H.PLANNING: _row(H.PLANNING, Planned={H.LOADING}, PlanFailed={H.FAILED}, Capability={H.PLANNING},
                     MemberLost={H.RECOVERING}, Leaving={H.RECOVERING}, Failed={H.RECOVERING},
                     RendezvousLost={H.PLANNING, H.RECOVERING}),
    H.LOADING: _row(H.LOADING, Ready={H.LOADING, H.READY, H.RECOVERING}, OwnStageLoaded={H.LOADING, H.READY, H.RECOVERING},
                    OwnStageFailed={H.LOADING, H.FAILED},
                    Edges={H.LOADING}, Capability={H.LOADING}, Failed={H.LOADING, H.RECOVERING, H.FAILED},
                    Leaving={H.LOADING, H.RECOVERING}, MemberLost={H.LOADING, H.RECOVERING}, RingBroken={H.LOADING, H.RECOVERING, H.FAILED},
                    RingFailed={H.LOADING, H.RECOVERING, H.FAILED}, RendezvousLost={H.LOADING, H.RECOVERING}),
    H.READY: _row(H.READY, Reassess={H.RECOVERING}, Edges={H.READY}, OwnStageFailed={H.READY}, Capability={H.RECOVERING}, Failed={H.READY, H.RECOVERING, H.FAILED},
                  Leaving={H.READY, H.RECOVERING}, MemberLost={H.READY, H.RECOVERING},
                  RingBroken={H.READY, H.RECOVERING, H.FAILED}, RingFailed={H.READY, H.RECOVERING, H.FAILED},
                  RendezvousLost={H.READY, H.RECOVERING}),
    H.RECOVERING: _row(H.RECOVERING, Planned={H.LOADING, H.RECOVERING, H.READY}, PlanFailed={H.DEGRADED},
                       Capability={H.RECOVERING}, Ready={H.RECOVERING}, OwnStageLoaded={H.RECOVERING},
                       OwnStageFailed={H.RECOVERING, H.FAILED},
                       Edges={H.RECOVERING}, Failed={H.RECOVERING, H.FAILED}, Leaving={H.RECOVERING},
                       MemberLost={H.RECOVERING}, RingBroken={H.RECOVERING}, RingFailed={H.RECOVERING},
                       RendezvousLost={H.RECOVERING}),
    H.DEGRADED: _row(H.DEGRADED, Capability={H.RECOVERING}, MemberLost={H.DEGRADED}, Leaving={H.DEGRADED},
                     Ready={H.DEGRADED}, OwnStageLoaded={H.DEGRADED}, OwnStageFailed={H.DEGRADED}, Edges={H.DEGRADED},
                     Failed={H.DEGRADED},
                     RingBroken={H.DEGRADED}, RingFailed={H.DEGRADED}, RendezvousLost={H.DEGRADED}),
    H.FAILED: {MemberJoined: {H.FAILED}, Close: {H.CLOSED}},  # a joining device is told (FAILED_DENIAL)
    H.CLOSED: {},
}
#: consecutive re-forms of the ring without reaching `ready` before the session gives up
MAX_REFORMS = 3
#: what a device that joins a failed session is told (proto_spec 05 §2 `denied`): the host admits no one
FAILED_DENIAL = ("its session failed and admits no device; the host must run `kafila-ctl leave` and host the model "
                 "again, then share the new session code")
#: why a request still running when a new plan replaces a serving ring (a member joined or returned)
#: ends: the host waited for the ring to drain first (kafilad/node/serving/host_requests.py `drain_for`)
PLAN_SWITCHED = ("The session switched to a new plan to take in a member that joined or returned, and this request "
                 "was still running when the wait for running requests ran out; send it again.")


class HostMachine(_Machine):
    """The host's session (proto_spec 05 §2; DESIGN §3 steps 1-2, §5).

    Args:
        host_peer_id, host_name, host_key: this daemon.
        expected: members of the session, the host included (`--members`).
        open_: admit any holder of the code (`host --open`).
        admitted: the session parameters every admitted member gets (model_id, config, dtype,
            context, concurrency).
    """

    TABLE = HOST_TABLE

    def __init__(self, *, host_peer_id: str, host_name: str, host_key: bytes, expected: int, open_: bool,
                 admitted: dict):
        super().__init__(HostState.STARTING)
        self.expected = expected
        self.open = open_
        self.params = admitted
        self.session_id = ""
        self.host_peer_id = host_peer_id
        self.members: dict[str, MemberEntry] = {
            host_peer_id: MemberEntry(peer_id=host_peer_id, name=host_name, public_key=host_key, is_host=True)}
        self.pending: dict[str, PendingEntry] = {}
        self.planned: Optional[Planned] = None
        self.ring_order: list[str] = []
        self.rendezvous_lost: Optional[str] = None
        self.culprit: Optional[str] = None
        #: the plan generation; plan, ready and ring_broken frames of another epoch are stale
        self.epoch = 0
        #: members lost since formation, by peer id (shown in status until they return)
        self.lost: dict[str, MemberEntry] = {}
        self.reforms = 0
        #: the latest MakePlan's sequence number
        self.plan_seq = 0
        #: the epoch whose ring still serves while the planner runs for a member that (re)joined;
        #: a plan equal to it is kept without reloading (None: the ring is not known intact)
        self.intact_epoch: Optional[int] = None
        #: keys admitted in this session (`--open` ones included): they may rejoin it, not later sessions
        self.session_keys: dict[str, bytes] = {}

    # -- queries --
    def name_of(self, peer_id: str) -> str:
        e = self.members.get(peer_id) or self.pending.get(peer_id)
        return e.name if e is not None else peer_id

    def live(self) -> list[MemberEntry]:
        return [e for e in self.members.values() if e.lost is None]

    def head(self) -> Optional[MemberEntry]:
        return self.members.get(self.ring_order[0]) if self.ring_order else None

    def _unique_name(self, wanted: str, peer_id: str) -> str:
        """``wanted``, or ``wanted-2``, ``-3``... when another device already has that name (names
        key the plan, DESIGN §5)."""
        taken = {e.name for p, e in {**self.members, **self.pending}.items() if p != peer_id}
        name, n = wanted, 1
        while name in taken:
            n += 1
            name = f"{wanted}-{n}"
        return name

    # -- the one entry point --
    def handle(self, event) -> list:
        """Apply one event; return the actions to perform, in order.

        Raises:
            LocalProtocolError: a local event this state does not take (a driver bug).
        """
        if isinstance(event, (Planned, PlanFailed)) and event.seq is not None and event.seq != self.plan_seq:
            return []  # the answer to a plan request made before a later loss
        row = self._row(event)
        if row is None:
            return []
        if row == "peer-error":
            frame = event.frame
            return [CloseLink(event.peer_id, f"{self.name_of(event.peer_id)} sent an unexpected "
                                             f"{getattr(frame, 'T', type(frame).__name__)} frame while the "
                                             f"session was {self.state}")]
        if isinstance(event, FrameFrom):
            if event.peer_id not in self.members:
                return []  # a frame already in flight from a member lost meanwhile
            return getattr(self, "_on_" + event.frame.T)(event.peer_id, event.frame, row)
        return getattr(self, "_on_" + type(event).__name__)(event, row)

    # -- formation --
    def _on_Registered(self, ev: Registered, row) -> list:
        self.session_id = ev.session_id
        self._enter(HostState.FORMING, row)
        return [Trace("session_opened", {"session_id": ev.session_id, "role": "host", "members": self.expected,
                                         **{k: self.params.get(k) for k in ("model_id", "context", "concurrency")}})]

    def _full(self) -> bool:
        return len(self.members) >= self.expected

    def _on_MemberJoined(self, ev: MemberJoined, row) -> list:
        if self.state == HostState.FAILED:
            return [Send(ev.peer_id, cf.Denied(FAILED_DENIAL, code=SESSION_FAILED)), CloseLink(ev.peer_id, "")]
        out = []
        old = self.members.get(ev.peer_id)
        if old is not None and old.control_down and old.public_key == ev.public_key:
            # it served on without its ctl link (rendezvous outage) and rejoins now: its old stage goes
            out = self._lose(ev.peer_id, "it rejoined after the rendezvous outage", row)
            out = [a for a in out if a != CloseLink(ev.peer_id, "")]
        if ev.peer_id in self.members or ev.peer_id in self.pending:
            return [Send(ev.peer_id, cf.Denied("this device is already in the session", code=ALREADY_IN_SESSION)), CloseLink(ev.peer_id, "")]
        if self._full():
            return [Send(ev.peer_id, cf.Denied("the session is already complete", code=SESSION_COMPLETE)), CloseLink(ev.peer_id, "")]
        name = self._unique_name(ev.name, ev.peer_id)
        if self.open or ev.trusted or self.session_keys.get(ev.peer_id) == ev.public_key:
            return out + self._admit(ev.peer_id, name, ev.public_key, remember=ev.trusted)  # --open: this session only
        self.pending[ev.peer_id] = PendingEntry(ev.peer_id, name, ev.public_key)
        self.changed = True
        return out + [Send(ev.peer_id, cf.Pending())]

    def _admit(self, peer_id: str, name: str, key: bytes, *, remember: bool) -> list:
        self.members[peer_id] = MemberEntry(peer_id=peer_id, name=name, public_key=key)
        self.session_keys[peer_id] = key
        self.changed = True
        out = [Remember(peer_id, name, key)] if remember else []
        return out + [Send(peer_id, cf.Admitted(session_id=self.session_id, name=name, **self.params))]

    def _on_Decision(self, ev: Decision, row) -> list:
        p = self.pending.pop(ev.peer_id, None)
        if p is None:
            return []
        self.changed = True
        if not ev.admit:
            return [Send(p.peer_id, cf.Denied(ev.reason or DENIED_BY_HOST, code=DENIED)), CloseLink(p.peer_id, "")]
        if self._full():
            return [Send(p.peer_id, cf.Denied("the session became complete while this device waited",
                                                code=SESSION_COMPLETE)),
                    CloseLink(p.peer_id, "")]
        return self._admit(p.peer_id, self._unique_name(p.name, p.peer_id), p.public_key, remember=True)

    def _on_PendingTimedOut(self, ev: PendingTimedOut, row) -> list:
        if self.pending.pop(ev.peer_id, None) is None:
            return []
        self.changed = True
        return [Send(ev.peer_id, cf.Denied(f"the host did not admit this device within {ev.timeout_s:g} s",
                                        code=ADMIT_TIMEOUT)),
                CloseLink(ev.peer_id, "")]

    def _on_OwnCapability(self, ev: OwnCapability, row) -> list:
        self.members[self.host_peer_id].capability = dict(ev.capability)
        return self._maybe_plan(row)

    def _on_capability(self, peer_id: str, frame: cf.Capability, row) -> list:
        entry = self.members.get(peer_id)
        if entry is None:
            return [CloseLink(peer_id, "a capability frame from a device that was not admitted")]
        entry.capability = frame.as_record()
        if self.state == HostState.FORMING:
            return self._maybe_plan(row)
        self.changed = True
        if self.state in (HostState.READY, HostState.DEGRADED):  # a member (re)joined: plan it in
            return [Trace("member_returned" if peer_id in self.lost else "member_joined", {"name": entry.name})] + \
                self._replan(row, intact=self.state == HostState.READY)
        return []  # planning, loading or recovering: planned in once the session is ready (_maybe_ready)

    def _on_Reassess(self, ev: Reassess, row) -> list:
        """A member's report was judged against its measured stage (issue 22 item 5): a ready session
        plans again, the ring serving on until the new plan differs (`_replan(intact=True)`)."""
        if self.state != HostState.READY:
            return []
        return [Trace("reassessed", {"name": ev.name, "reason": ev.reason})] + self._replan(row, intact=True)

    def _make_plan(self, entries) -> MakePlan:
        self.plan_seq += 1
        return MakePlan(tuple(entries), self.plan_seq)

    def _replan(self, row, *, intact: bool = False) -> list:
        """Plan again over every live, measured member (RECOVERING; MakePlan).

        `intact`: the current ring still serves (a member joined or returned while ready), so a plan
        that divides the model as the current one does is kept without reloading (_on_Planned)."""
        self.intact_epoch = self.epoch if intact else None
        self._enter(HostState.RECOVERING, row)
        return [self._make_plan(e for e in self.live() if e.capability)]

    def _maybe_plan(self, row) -> list:
        self.changed = True
        live = self.live()
        if len(live) < self.expected or not all(e.capability for e in live):
            return []
        self._enter(HostState.PLANNING, row)
        return [self._make_plan(live)]

    def _serving_ring_planned(self) -> bool:
        """Whether the plan being made is for a ring that still serves (a member joined or returned
        while ready: `_replan(intact=True)`), not for one a loss ended."""
        return self.planned is not None and self.intact_epoch == self.epoch

    def _same_division(self, ev: Planned) -> bool:
        old = self.planned
        return (tuple(ev.order) == tuple(old.order) and ev.head == old.head
                and dict(ev.blocks) == dict(old.blocks))

    def replaces_serving_ring(self, ev: Planned) -> bool:
        """Whether plan `ev`, once handled, replaces a ring that still serves (its requests then end
        with PLAN_SWITCHED; the driver lets them finish first, kafilad/node/serving/host_requests.py)."""
        return self._serving_ring_planned() and not self._same_division(ev)

    def _on_Planned(self, ev: Planned, row) -> list:
        names = {e.name: e.peer_id for e in self.live()}
        if any(n not in names for n in ev.order):  # a member was lost while the planner ran
            return self._replan(row)
        old = self.planned
        if self._serving_ring_planned() and self._same_division(ev):
            # the same division as the ring that still serves: keep it (only standbys changed)
            self.planned, self.intact_epoch = ev, None
            self._enter(HostState.READY, row)
            return [Trace("plan_kept", {"plan": ev.plan, "epoch": self.epoch, "standby": list(ev.standby)})] + \
                self._tell_standbys(ev, names)
        replaced = self._serving_ring_planned()  # a ring that still serves, with another division
        self.intact_epoch = None
        self.planned = ev
        self.epoch += 1
        self.ring_order = [names[n] for n in ev.order]
        for e in self.members.values():
            e.ready = False
        self.error = None
        self._enter(HostState.LOADING, row)
        fields = {"plan": ev.plan, "epoch": self.epoch}
        if old is not None:
            fields["old_plan"] = old.plan
        # requests still on the serving ring (the driver let them drain first, for a while) end here,
        # with a sentence, before its stages are dropped
        out = [FailRequests(PLAN_SWITCHED, None)] if replaced else []
        return out + [Trace("plan" if old is None else "replanned", fields),
                      DistributePlan(ev, epoch=self.epoch, replan=old is not None)] + self._tell_standbys(ev, names)

    def _tell_standbys(self, ev: Planned, names: dict) -> list:
        """A `standby` frame of this epoch to each remote member the plan leaves without blocks."""
        return [Send(names[n], cf.Standby(epoch=self.epoch)) for n in ev.standby
                if n in names and not self.members[names[n]].is_host]

    def _on_PlanFailed(self, ev: PlanFailed, row) -> list:
        if self.state == HostState.PLANNING:
            return self._fail(f"No plan fits this fleet: {ev.reason.rstrip('.')}. To try again, run `kafila-ctl leave` "
                              "on the host and host the model again with settings that fit (`kafila-ctl host`); "
                              "the members then join its new code.", None, row)
        self.error = (f"waiting for a member to join: the model no longer fits the {len(self.live())} member(s) "
                      f"left ({ev.reason.rstrip('.')})")
        self._enter(HostState.DEGRADED, row)
        return [Trace("degraded", {"reason": self.error})]

    def _on_ready(self, peer_id: str, frame: cf.Ready, row) -> list:
        e = self.members[peer_id]
        if self.state != HostState.LOADING or (frame.epoch is not None and frame.epoch != self.epoch):
            return []  # a stage of an earlier plan
        e.ready = True
        e.load = {"fetched_bytes": frame.fetched_bytes, "cached_bytes": frame.cached_bytes, "load_s": frame.load_s,
                  "edges": frame.edges}
        return self._maybe_ready(row)

    def _on_OwnStageLoaded(self, ev: OwnStageLoaded, row) -> list:
        e = self.members[self.host_peer_id]
        if self.state != HostState.LOADING or ev.epoch != self.epoch:
            return []
        e.ready = True
        e.load = dict(ev.load)
        return self._maybe_ready(row)

    def _maybe_ready(self, row) -> list:
        self.changed = True
        if not all(self.members[p].ready for p in self.ring_order if p in self.members):
            return []
        self._enter(HostState.READY, row)
        self.reforms = 0
        out = [Formed()]
        standby = set(self.planned.standby) if self.planned is not None else set()
        waiting = [e for e in self.live() if e.capability and e.peer_id not in self.ring_order
                   and e.name not in standby]
        if waiting:  # members that joined while the ring formed: plan them in now
            out += self._replan(row)
        return out

    def _on_edges(self, peer_id: str, frame: cf.Edges, row) -> list:  # noqa: ARG002
        e = self.members[peer_id]
        e.load = {**e.load, "edges": frame.edges}
        self.changed = True
        return [EdgesChanged(e.name)]

    def _on_OwnStageFailed(self, ev: OwnStageFailed, row) -> list:
        """The host's own stage of the current plan could not be built: no plan avoids that (issue 21 item 3)."""
        if self.state not in (HostState.LOADING, HostState.RECOVERING) or ev.epoch != self.epoch:
            return []  # the stage of a plan replaced since
        return self._fail(stage_build_failed(ev.reason), self.members[self.host_peer_id].name, row)

    # -- losses --
    def _on_failed(self, peer_id: str, frame: cf.Failed, row) -> list:
        """A member's stage did not load. One that could not be built (code "stage_build") fails the
        session while a plan loads or is being remade: any division fails the same way, and a member lost
        and replanned would rejoin and fail again (issue 21 item 3). Any other failure is a loss (§2.3)."""
        if frame.code == cf.FAILED_STAGE_BUILD and self.state in (HostState.LOADING, HostState.RECOVERING):
            return self._fail(stage_build_failed(frame.reason), self.members[peer_id].name, row)
        return self._lose(peer_id, f"it failed to load its stage: {frame.reason}", row)

    def _on_leaving(self, peer_id: str, frame: cf.Leaving, row) -> list:
        e = self.members.get(peer_id)
        out = self._lose(peer_id, f"it is leaving: {frame.reason}", row)
        if e is not None and e.lost is not None:
            e.left = True
        return out if CloseLink(peer_id, "") in out else out + [CloseLink(peer_id, "")]

    def _on_MemberLost(self, ev: MemberLost, row) -> list:
        if ev.peer_id in self.pending:
            self.pending.pop(ev.peer_id)
            self.changed = True
            return []
        e = self.members.get(ev.peer_id)
        if e is None or e.lost is not None or e.is_host:
            return []
        if self.rendezvous_lost is not None:
            e.control_down = True  # its ctl circuit died with the rendezvous; its stage may still run
            self.changed = True
            return []
        return self._lose(ev.peer_id, ev.reason, row)

    def _lose(self, peer_id: str, reason: str, row) -> list:
        """A member is gone: requests in flight fail naming it, and the host replans over the survivors.

        A standby (a member the plan left without blocks, strategy "load") holds no part of the
        ring: while the ring loads or serves, its loss is recorded and nothing else changes."""
        e = self.members.get(peer_id)
        if e is None or e.lost is not None or e.is_host:
            return []
        e.lost = reason
        self.changed = True
        del self.members[peer_id]
        if self.state == HostState.FORMING:
            return [CloseLink(peer_id, "")]  # so the same device can join again
        self.lost[peer_id] = e
        if (self.state in (HostState.LOADING, HostState.READY) and self.planned is not None
                and e.name in self.planned.standby and peer_id not in self.ring_order):
            return [Trace("member_lost", {"name": e.name, "peer_id": peer_id, "reason": reason, "standby": True}),
                    CloseLink(peer_id, "")]
        msg = f"member {e.name} ({peer_id}) left the session: {reason}"
        self.culprit = e.name
        out = [FailRequests(msg, e.name), Trace("member_lost", {"name": e.name, "peer_id": peer_id, "reason": reason}),
               CloseLink(peer_id, "")]
        if self.state == HostState.DEGRADED:
            return out
        self.error = msg
        return out + self._replan(row)

    def _ring_broke(self, member: Optional[str], reason: str, epoch: Optional[int], row) -> list:
        """The ring of the current plan broke: fail its requests, then re-form it (up to MAX_REFORMS times)."""
        if self.state == HostState.RECOVERING and self.intact_epoch is not None and epoch in (None, self.epoch):
            # the ring the planner may keep broke meanwhile: its plan is sent again whatever it is
            self.intact_epoch = None
            return [FailRequests(reason, member), Trace("ring_broken", {"reason": reason, "member": member})]
        if self.state not in (HostState.LOADING, HostState.READY) or (epoch is not None and epoch != self.epoch):
            return []  # recovering already, or a ring of an earlier plan
        out = []
        if self.rendezvous_lost is not None:
            reason += f" (the connection to the rendezvous was lost as well: {self.rendezvous_lost.rstrip('.')})"
            # members whose ctl links went with the rendezvous cannot be sent a new plan: they are lost
            # (they rejoin once it is back), and the ring re-forms without them
            for e in [e for e in self.members.values() if not e.is_host and e.control_down]:
                e.lost = f"the connection to the rendezvous was lost ({self.rendezvous_lost.rstrip('.')})"
                del self.members[e.peer_id]
                self.lost[e.peer_id] = e
                out += [CloseLink(e.peer_id, ""), Trace("member_lost", {"name": e.name, "peer_id": e.peer_id,
                                                                        "reason": e.lost})]
        self.reforms += 1
        if self.reforms > MAX_REFORMS:
            return self._fail(f"{reason}; the ring broke {self.reforms} times in a row while re-forming", member, row)
        self.culprit = member
        self.error = reason
        return [FailRequests(reason, member), Trace("ring_broken", {"reason": reason, "member": member})] + out + \
            self._replan(row)

    def _on_ring_broken(self, peer_id: str, frame: cf.RingBroken, row) -> list:
        return self._ring_broke(frame.member, f"{frame.reason} (reported by {self.name_of(peer_id)})",
                                frame.epoch, row)

    def _on_RingFailed(self, ev: RingFailed, row) -> list:
        return self._ring_broke(ev.member, ev.reason, ev.epoch, row)

    def _on_RendezvousLost(self, ev: RendezvousLost, row) -> list:
        """The rendezvous connection ended (DESIGN §2: signalling and a last-resort relay).

        A ready session whose ring edges are all direct and whose head is this host serves on (the
        members' ctl circuits are down meanwhile). Otherwise every remote member's ctl circuit is
        gone with it: they are lost, requests fail, the host replans over what is left and waits
        for the rendezvous and the members to come back (they rejoin by themselves).
        """
        if self.rendezvous_lost is not None:
            return []
        self.rendezvous_lost = ev.reason
        self.changed = True
        out = [Trace("rendezvous_lost", {"reason": ev.reason})]
        lost = f"the connection to the rendezvous was lost ({ev.reason.rstrip('.')})"
        head = self.head()
        if self.state == HostState.READY and not ev.relayed_edges and (head is None or head.is_host):
            for e in self.members.values():
                if not e.is_host:
                    e.control_down = True
            return out  # the direct ring serves on
        for p in list(self.pending):
            out.append(CloseLink(p, ""))
        self.pending.clear()
        remote = [e for e in self.members.values() if not e.is_host]
        for e in remote:
            e.lost = lost
            del self.members[e.peer_id]
            if self.state != HostState.FORMING:
                self.lost[e.peer_id] = e
            out.append(CloseLink(e.peer_id, ""))
        if self.state == HostState.FORMING or not remote:
            return out
        self.error = f"{lost}; the members rejoin once it is back"
        out += [FailRequests(self.error, None), Trace("member_lost", {"names": [e.name for e in remote],
                                                                       "reason": lost})]
        if self.state == HostState.DEGRADED:
            return out
        return out + self._replan(row)

    def _on_RendezvousBack(self, ev: RendezvousBack, row) -> list:
        self.rendezvous_lost = None
        self.changed = True
        return [Trace("rendezvous_reconnected", {"attempts": ev.attempts})]

    def _fail(self, reason: str, culprit: Optional[str], row, *, tell: bool = True) -> list:
        self.error = reason
        self.culprit = culprit
        self._enter(HostState.FAILED, row)
        out = [FailRequests(reason, culprit), Trace("session_failed", {"reason": reason})]
        for p in list(self.pending):  # a device still waiting for `admit` is answered, not left hanging
            out += [Send(p, cf.Denied(f"the session failed: {reason}", code=SESSION_FAILED)), CloseLink(p, "")]
        self.pending.clear()
        remote = [e for e in self.members.values() if not e.is_host]
        if tell:
            out += [Send(e.peer_id, cf.SessionFailed(reason)) for e in remote if e.lost is None and not e.control_down]
        # their links end here, after that frame: the members stop (no rejoin), none is blamed for going quiet
        return out + [CloseLink(e.peer_id, "the session failed") for e in remote]

    def _on_Abort(self, ev: Abort, row) -> list:
        return self._fail(f"internal error: {ev.reason}", None, row)

    def _on_Close(self, ev: Close, row) -> list:
        was = self.state
        self._enter(HostState.CLOSED, row)
        out = [Trace("session_closed", {"reason": ev.reason})] if was != HostState.STARTING else []
        if was != HostState.FAILED:
            out.append(FailRequests(ev.reason, None))
        out += [CloseLink(p, ev.reason) for p in list(self.pending)]
        remote = [e for e in self.members.values() if not e.is_host]
        if ev.final:  # members are told it ended for good: they forget it instead of rejoining
            out += [Send(e.peer_id, cf.SessionClosed(ev.reason)) for e in remote if not e.control_down]
        out += [CloseLink(e.peer_id, ev.reason) for e in remote]
        self.pending.clear()
        return out


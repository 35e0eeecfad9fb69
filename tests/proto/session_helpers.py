"""Helpers for the session machine tests (kafilad/proto/session.py): walkers and a host/member pump.

No trio, no sockets: a :class:`SessionPair` holds one HostMachine and its MemberMachines and
delivers each ``Send`` action to the other side after a round trip through the wire
(``to_wire`` -> proto_spec 02 frame -> ``FrameDecoder`` -> ``decode_control``), in the style of
h11's ``tests/helpers.py`` ``ConnectionPair`` and aioquic's ``roundtrip``. Closing a ctl link on
one side is the matching loss event on the other, as the drivers (kafilad/node/session/host.py,
member.py) turn a ``LinkClosed`` into ``MemberLost`` / ``HostLinkLost``.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, NamedTuple

from kafilad.errors import DENIED
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.frames import FrameDecoder, encode_frame

H, M = sm.HostState, sm.MemberState

HOST, HOST_NAME = "H", "host"
A, B, C = "A", "B", "C"
NAMES = {A: "alpha", B: "beta", C: "gamma"}
SESSION_ID = "S1"
#: What the host tells every admitted member (HostMachine's ``admitted``), as host.py builds it.
PARAMS = {"model_id": "test/tiny", "config": {"num_hidden_layers": 6, "hidden_size": 64}, "dtype": "float32",
          "context": 256, "concurrency": 2}
CAPABILITY = {"memory_bytes": 8 << 30, "bandwidth_Bps": 50e9, "step_overhead_s": 0.001,
              "rendezvous_rtt_ms": 12.5, "nat_class": "C", "dtype": "float32", "bandwidth_source": "probe"}
LOAD = {"fetched_bytes": 1000, "cached_bytes": 24, "load_s": 0.5, "edges": [{"from": "alpha", "path": "direct"}]}


def key(peer_id: str) -> bytes:
    """A stand-in 32-byte static key per peer id (the machines only store and forward it)."""
    return hashlib.sha256(peer_id.encode()).digest()


def cap_frame(memory_bytes: int = 8 << 30) -> cf.Capability:
    return cf.Capability.from_measurement({**CAPABILITY, "memory_bytes": memory_bytes})


def ready_frame(epoch=1) -> cf.Ready:
    return cf.Ready(fetched_bytes=1000, cached_bytes=24, load_s=0.5, edges=[{"from": "x", "path": "direct"}],
                    epoch=epoch)


def planned(order: tuple, head: str, seq=None, standby: tuple = ()) -> sm.Planned:
    """A Planned event over member names ``order`` (ring order, head first): two blocks each.
    ``seq``: the MakePlan it answers (host.py passes it; None: the latest); ``standby``: names the
    plan leaves without blocks (strategy "load")."""
    blocks = {name: (2 * i, 2 * i + 2) for i, name in enumerate(order)}
    return sm.Planned(plan={"blocks": {n: list(b) for n, b in blocks.items()}, "head": head,
                            "standby": list(standby)},
                      blocks=blocks, head=head, order=tuple(order), seq=seq, standby=tuple(standby))


def plan_frame(start: int = 2, end: int = 4, head: bool = False, epoch=1) -> cf.PlanFrame:
    return cf.PlanFrame(plan={"head": "host"}, ring=[HOST, A, B],
                        roster={p: {"name": n, "public_key": key(p)} for p, n in ((HOST, HOST_NAME), (A, "alpha"))},
                        start=start, end=end, head=head, tensors=[], files=[], epoch=epoch)


def admitted_frame(name: str = "alpha") -> cf.Admitted:
    return cf.Admitted(session_id=SESSION_ID, name=name, **PARAMS)


def new_host(*, expected: int = 3, open_: bool = False, host_name: str = HOST_NAME) -> sm.HostMachine:
    return sm.HostMachine(host_peer_id=HOST, host_name=host_name, host_key=key(HOST), expected=expected,
                          open_=open_, admitted=dict(PARAMS))


def walk_host(to: sm.HostState, *, expected: int = 3, members=(A, B), pending=(), head: str = HOST_NAME,
              ring=None, control_down=(), standby=()) -> sm.HostMachine:
    """A HostMachine driven through its public events into state ``to`` (the happy path).

    ``recovering``: ready, then the host's own ring stage broke naming beta (every member still
    in, a MakePlan out); ``degraded``: recovering, then no plan fits. ``failed``: ready, then Abort.

    Args:
        members: peer ids (names from NAMES) that join with a trusted key, in order.
        pending: peer ids that join untrusted right after the first member (so they wait in
            ``pending`` while the session fills).
        head, ring: the plan's head and ring order (names); default: the host heads, then members.
        standby: names the plan leaves without blocks (give `ring` without them).
        control_down: members whose join the host handled just after the rendezvous went (a race), and
            whose ctl circuit closed while it was down: measured, they stay in the roster with
            ``control_down`` (the rendezvous is back before the walk goes on).
    """
    h = new_host(expected=expected)
    assert h.state == H.STARTING
    if to == H.STARTING:
        return h
    h.handle(sm.Registered(SESSION_ID))
    if control_down:
        h.handle(sm.RendezvousLost("eof"))
    for i, pid in enumerate(members):
        h.handle(sm.MemberJoined(pid, NAMES[pid], key(pid), trusted=True))
        if pid in control_down:
            h.handle(sm.FrameFrom(pid, cap_frame()))
            h.handle(sm.MemberLost(pid, "circuit closed"))
        if i == 0:
            for p in pending:
                h.handle(sm.MemberJoined(p, NAMES[p], key(p), trusted=False))
    if control_down:
        h.handle(sm.RendezvousBack(1))
        assert [p for p, e in h.members.items() if e.control_down] == list(control_down)
    assert h.state == H.FORMING and set(h.pending) == set(pending)
    if to == H.FORMING:
        return h
    h.handle(sm.OwnCapability(dict(CAPABILITY)))
    for pid in members:
        if pid not in control_down:
            h.handle(sm.FrameFrom(pid, cap_frame()))
    assert h.state == H.PLANNING, h.state
    if to == H.PLANNING:
        return h
    names = ring or tuple([HOST_NAME] + [NAMES[p] for p in members])
    h.handle(planned(names, head, h.plan_seq, standby))
    assert h.state == H.LOADING and h.epoch == 1
    if to == H.LOADING:
        return h
    load_all(h)
    assert h.state == H.READY
    if to == H.READY:
        return h
    if to in (H.RECOVERING, H.DEGRADED):
        h.handle(sm.RingFailed("beta", "beta stopped answering", h.epoch))
        assert h.state == H.RECOVERING
        if to == H.DEGRADED:
            h.handle(sm.PlanFailed("Device 'alpha' cannot hold 3 blocks.", h.plan_seq))
    elif to == H.FAILED:
        h.handle(sm.Abort("walked into failed"))
    else:
        h.handle(sm.Close("walked into closed"))
    assert h.state == to
    return h


def load_all(h: sm.HostMachine) -> list:
    """Every stage of the host's current plan reports ready (the host's own last); the actions."""
    out = []
    for pid in h.ring_order:
        if pid != HOST:
            out += h.handle(sm.FrameFrom(pid, ready_frame(h.epoch)))
    return out + h.handle(sm.OwnStageLoaded(dict(LOAD), h.epoch))


def replan(h: sm.HostMachine, head: str = HOST_NAME) -> list:
    """Answer the host's last MakePlan (h.plan_seq) with a plan over the same members (``head`` first)."""
    names = [e.name for e in h.live() if e.capability]
    order = [head] + [n for n in names if n != head]
    return h.handle(planned(tuple(order), head, h.plan_seq))


def walk_member(to: sm.MemberState, *, epoch=1) -> sm.MemberMachine:
    """A MemberMachine driven through its public events into state ``to`` (the happy path)."""
    m = sm.MemberMachine()
    assert m.state == M.JOINING
    if to == M.JOINING:
        return m
    m.handle(cf.Pending())
    if to == M.PENDING:
        return m
    m.handle(admitted_frame())
    if to == M.ADMITTED:
        return m
    m.handle(sm.CapabilitySent(dict(CAPABILITY)))
    if to == M.MEASURED:
        return m
    if to == M.STANDBY:
        m.handle(cf.Standby(epoch=epoch or 0))
        return m
    m.handle(plan_frame(epoch=epoch))
    if to == M.LOADING:
        return m
    m.handle(sm.StageLoaded(dict(LOAD), epoch or 0))
    if to == M.READY:
        return m
    m.handle(sm.HostLinkLost("walked into failed") if to == M.FAILED else sm.Close("walked into closed"))
    assert m.state == to
    return m


def over_the_wire(frame: cf.ControlFrame):
    """``frame`` after the trip a real link gives it: to_wire, proto_spec 02 framing, msgpack, decode_control."""
    decoder = FrameDecoder()
    decoder.receive_data(encode_frame(frame.to_wire()))
    body = decoder.next_event()
    assert decoder.next_event() is None and decoder.pending_bytes == 0
    return cf.decode_control(body)


class SessionPair:
    """One host machine and its member machines, each action delivered to the other side in FIFO order.

    ``host_log`` / ``member_log[pid]`` hold every action each machine returned; ``wire`` holds
    (sender, receiver, frame map) of every frame that crossed a link.
    """

    def __init__(self, *, expected: int, open_: bool = False, host_name: str = HOST_NAME):
        self.host = new_host(expected=expected, open_=open_, host_name=host_name)
        self.members: dict[str, sm.MemberMachine] = {}
        self.links: set[str] = set()
        self.host_log: list = []
        self.member_log: dict[str, list] = {}
        self.wire: list = []
        self._queue: collections.deque = collections.deque()

    # -- inputs --
    def to_host(self, event) -> None:
        self._queue.append((HOST, event))
        self.pump()

    def to_member(self, pid: str, event) -> None:
        self._queue.append((pid, event))
        self.pump()

    def join(self, pid: str, name: str, *, trusted: bool) -> None:
        """``pid`` opens its ctl link and finishes the Noise handshake (the host's MemberJoined)."""
        self.members[pid] = sm.MemberMachine()
        self.member_log[pid] = []
        self.links.add(pid)
        self.to_host(sm.MemberJoined(pid, name, key(pid), trusted))

    def report_capability(self, pid: str, cap: dict = CAPABILITY) -> None:
        """What member.py's control loop does once admitted: send `capability`, then CapabilitySent."""
        self._send(pid, HOST, cf.Capability.from_measurement(cap))
        self._queue.append((pid, sm.CapabilitySent(dict(cap))))
        self.pump()

    def break_link(self, pid: str, reason: str) -> None:
        """The ctl link between the host and ``pid`` breaks: each side's driver sees LinkClosed."""
        self.links.discard(pid)
        self._queue.append((HOST, sm.MemberLost(pid, reason)))
        self._queue.append((pid, sm.HostLinkLost(reason)))
        self.pump()

    def plan(self, head: str = HOST_NAME) -> sm.Planned:
        """What host.py's planner task does with the last MakePlan: a Planned over its members."""
        make = [a for a in self.host_log if isinstance(a, sm.MakePlan)][-1]
        names = [e.name for e in make.order]
        ev = planned(tuple([head] + [n for n in names if n != head]), head, make.seq)
        self.to_host(ev)
        return ev

    def load(self, pid: str) -> None:
        """``pid``'s driver finished loading the stage of its current plan."""
        m = self.members[pid]
        self.to_member(pid, sm.StageLoaded(dict(LOAD), m.plan.epoch or 0))

    def load_own(self) -> None:
        self.to_host(sm.OwnStageLoaded(dict(LOAD), self.host.epoch))

    # -- the pump --
    def pump(self) -> None:
        while self._queue:
            target, event = self._queue.popleft()
            if target == HOST:
                actions = self.host.handle(event)
                self.host_log += actions
                for a in actions:
                    self._perform_host(a)
            else:
                actions = self.members[target].handle(event)
                self.member_log[target] += actions
                for a in actions:
                    self._perform_member(target, a)

    def _send(self, sender: str, receiver: str, frame: cf.ControlFrame) -> None:
        pid = receiver if sender == HOST else sender
        if pid not in self.links:
            return  # the driver drops a frame for a closed link (LinkClosed is swallowed)
        self.wire.append((sender, receiver, frame.to_wire()))
        received = over_the_wire(frame)
        assert received == frame, "a control frame changed on the wire"
        self._queue.append((receiver, received) if receiver != HOST else (HOST, sm.FrameFrom(sender, received)))

    def _perform_host(self, a) -> None:
        if isinstance(a, sm.Send):
            self._send(HOST, a.peer_id, a.frame)
        elif isinstance(a, sm.CloseLink):
            # host.py pops the link before closing it, so its own member loop reports no MemberLost
            if a.peer_id in self.links:
                self.links.discard(a.peer_id)
                self._queue.append((a.peer_id, sm.HostLinkLost(a.reason or "closed")))
        elif isinstance(a, sm.DistributePlan):
            h = self.host
            roster = {e.peer_id: {"name": e.name, "public_key": e.public_key} for e in h.members.values()}
            for pid in h.ring_order:
                e = h.members[pid]
                if e.is_host:
                    continue
                start, end = a.planned.blocks[e.name]
                self._send(HOST, pid, cf.PlanFrame(plan=a.planned.plan, ring=list(h.ring_order), roster=roster,
                                                   start=start, end=end, head=a.planned.head == e.name,
                                                   tensors=[], files=[], epoch=a.epoch))
        # MakePlan, Remember, FailRequests, Trace, Formed, EdgesChanged: the test reads host_log

    def _perform_member(self, pid: str, a) -> None:
        if isinstance(a, sm.Send):
            self._send(pid, HOST, a.frame)
        elif isinstance(a, sm.CloseLink):
            if pid in self.links:  # the member closed its end: the host's member loop gets LinkClosed
                self.links.discard(pid)
                self._queue.append((HOST, sm.MemberLost(pid, a.reason or "closed")))
        # StartLoad, JoinAccepted, Refused, FailRequests, Trace, ForgetSession: the test reads member_log


def traces(actions, kind: str) -> list:
    return [a for a in actions if isinstance(a, sm.Trace) and a.kind == kind]


def sends(actions, frame_type) -> dict:
    """peer_id -> frame of every Send of ``frame_type`` in ``actions``."""
    return {a.peer_id: a.frame for a in actions if isinstance(a, sm.Send) and isinstance(a.frame, frame_type)}


def sample_frames() -> dict:
    """One frame of every control frame type (kafilad/proto/control.py), every field set, by wire type."""
    result = cf.GenResult(text="Once upon", token_ids=[1, 2, 3], prompt_tokens=4, ttft_s=0.25, decode_tokens=2,
                          decode_tokens_per_s=8.0, circuit_s_median=0.125,
                          stats=[[HOST, 3, 0.5, 0.1, 4096], [A, 3, 0.25, 0.05, 2048]])
    frames = [
        cf.Pending(), cf.Denied("the host denied this device", code=DENIED), admitted_frame("alpha-2"),
        cf.Capability(memory_bytes=16 << 30, bandwidth_Bps=1.5e10, step_overhead_s=0.002, rendezvous_rtt_ms=30,
                      nat_class="S", dtype="float16", bandwidth_source="probe"),
        plan_frame(start=0, end=2, head=True, epoch=3),
        cf.Fetch(id=7, file="model.safetensors", offset=128, length=cf.FETCH_MAX_BYTES),
        cf.Data(id=7, data=bytes(range(256))), cf.FetchError(id=8, reason="no such file"),
        cf.Ready(fetched_bytes=10, cached_bytes=20, load_s=1.5, edges=[{"from": "a", "to": "b", "path": "relay"}],
                 epoch=2),
        cf.Failed("Member alpha could not build its stage.", code=cf.FAILED_STAGE_BUILD), cf.Leaving("its daemon is shutting down"),
        cf.Edges([{"from": "a", "to": "b", "path": "direct"}]),
        cf.Standby(epoch=3),
        cf.RingBroken(reason="beta stopped answering", member="beta", epoch=2),
        cf.Gen(req="r1", prompt="Once", max_tokens=8, temperature=0.7),
        cf.GenEvent(req="r1", event={"t": "token", "token_id": 5, "text": " upon"}),
        cf.GenDone(req="r1", result=result), cf.GenError(req="r1", message="member beta is unreachable"),
        cf.Cancel(req="r1", reason="The request's caller stopped waiting."), cf.Ping(n=3),
        cf.Schedule(req="schedule-1", mode="per-request"),
        cf.ScheduleState(req="schedule-1", result={"mode": "auto", "micro_batches": 1}, error="m2 is not the head now."),
        cf.Cancel(req="r1", reason="The client went away."),
        cf.SessionFailed("member beta (B) left the session: gone"),
        cf.SessionClosed("the host closed the session"),
    ]
    return {type(f).T: f for f in frames}


# ---- row cases: one event fired in one state of a transition table ----------------------------------
#: The host states whose rows test_session_machines.py covers; test_session_recovery.py covers the rest.
HOST_FORMATION_STATES = (H.STARTING, H.FORMING, H.PLANNING, H.LOADING)
HOST_SERVING_STATES = (H.READY, H.RECOVERING, H.DEGRADED, H.FAILED, H.CLOSED)


class Case(NamedTuple):
    state: object
    event_type: type
    expect: object
    fn: Callable
    walk: dict

    @property
    def id(self) -> str:
        return f"{self.state.value}-{self.event_type.__name__}-{self.fn.__name__}"


def _key(event) -> type:
    return type(event.frame) if isinstance(event, sm.FrameFrom) else type(event)


class Rows:
    """The cases of one transition table's rows for ``states``.

    ``@rows.case(state, EventType, expected_state, **walk)`` registers ``fn(machine, fire)``: the
    machine is walked into ``state`` (walk_host / walk_member with ``walk``), and ``fn`` calls
    ``fire(event)`` exactly once; ``fire`` checks the event's row and the state it leads to.
    """

    def __init__(self, table: dict, states, walk: Callable):
        self.table, self.states, self.walk = table, tuple(states), walk
        self.cases: list[Case] = []

    def case(self, state, event_type, expect, **walk):
        assert state in self.states, f"{state} rows belong to another module"

        def deco(fn):
            self.cases.append(Case(state, event_type, expect, fn, walk))
            return fn
        return deco

    def run(self, case: Case) -> None:
        machine = self.walk(case.state, **case.walk)
        row = self.table[case.state]
        fired = []

        def fire(event):
            assert machine.state == case.state, "the scenario's setup left the row's state"
            assert _key(event) is case.event_type
            machine.changed = False
            out = machine.handle(event)
            assert machine.state in row[case.event_type]
            assert machine.state == case.expect
            if case.expect != case.state:
                assert machine.changed, "a state change must tell the watchers (changed)"
            fired.append(event)
            return out

        fire.again = machine.handle  # the same kind of event again, from the state the first one reached
        case.fn(machine, fire)
        assert len(fired) == 1

    def pairs(self) -> tuple[set, set]:
        """(state, event type) of the cases, and of the table's rows for these states."""
        table = {(s, t) for s in self.states for t in self.table[s]}
        return {(c.state, c.event_type) for c in self.cases}, table

    def triples(self) -> tuple[set, set]:
        """(state, event type, new state) of the cases, and every one the table allows for these states."""
        table = {(s, t, to) for s in self.states for t, tos in self.table[s].items() for to in tos}
        return {(c.state, c.event_type, c.expect) for c in self.cases}, table


# ---- what the actions of a failure, a loss and a ring break look like ----------------------------
def failure(actions, reason: str, culprit, told=()) -> None:
    """The host failed: requests failed, one session_failed trace, every live member told (SessionFailed)."""
    assert actions[0] == sm.FailRequests(reason, culprit)
    assert traces(actions, "session_failed") == [sm.Trace("session_failed", {"reason": reason})]
    assert sends(actions, cf.SessionFailed) == {p: cf.SessionFailed(reason) for p in told}


def standby_lost(out, h, pid: str, name: str, reason: str) -> None:
    """A standby's loss: recorded, its link closed, nothing failed or replanned (the ring keeps on)."""
    assert out == [sm.Trace("member_lost", {"name": name, "peer_id": pid, "reason": reason, "standby": True}),
                   sm.CloseLink(pid, "")]
    assert h.lost[pid].lost == reason and pid not in h.members and h.error is None


def order_of(make_plan) -> list:
    assert isinstance(make_plan, sm.MakePlan)
    return [e.peer_id for e in make_plan.order]


def lost(actions, h, pid: str, name: str, reason: str, survivors) -> None:
    """The host lost member ``pid``: its requests fail naming it, a member_lost trace, its link closed,
    a replan over ``survivors``; never a session failure."""
    msg = f"member {name} ({pid}) left the session: {reason}"
    assert actions[:3] == [sm.FailRequests(msg, name),
                           sm.Trace("member_lost", {"name": name, "peer_id": pid, "reason": reason}),
                           sm.CloseLink(pid, "")]
    assert order_of(actions[3]) == list(survivors)
    assert not traces(actions, "session_failed") and not sends(actions, cf.SessionFailed)
    assert pid not in h.members and h.lost[pid].lost == reason
    assert h.error == msg and h.culprit == name


def ring_broke(actions, reason: str, member, survivors) -> None:
    assert actions[:2] == [sm.FailRequests(reason, member), sm.Trace("ring_broken", {"reason": reason, "member": member})]
    assert order_of(actions[2]) == list(survivors) and len(actions) == 3


def rdv_lost(reason: str) -> str:
    """How the host names a lost rendezvous connection (HostMachine._on_RendezvousLost)."""
    return f"the connection to the rendezvous was lost ({reason.rstrip('.')})"


def lost_with_the_rendezvous(actions, h, reason: str, members, survivors=None, pending=()) -> None:
    """The rendezvous went and every remote member's ctl circuit with it (HostMachine._on_RendezvousLost):
    one rendezvous_lost trace, each pending device's link and each member's link closed; past forming
    the members are moved to ``lost``, their requests fail naming nobody, one member_lost trace names
    them all, and (``survivors`` given) a replan over them. Never a session failure.

    Args:
        members: the remote members' peer ids, in roster order.
        survivors: the peer ids the MakePlan must hold; None: no MakePlan (forming, degraded).
        pending: devices that were waiting for `admit`.
    """
    msg = f"{rdv_lost(reason)}; the members rejoin once it is back"
    names = [NAMES[p] for p in members]
    expected = [sm.Trace("rendezvous_lost", {"reason": reason})]
    expected += [sm.CloseLink(p, "") for p in pending] + [sm.CloseLink(p, "") for p in members]
    forming = h.state == H.FORMING
    if not forming:
        expected += [sm.FailRequests(msg, None), sm.Trace("member_lost", {"names": names, "reason": rdv_lost(reason)})]
    assert actions[:len(expected)] == expected
    rest = actions[len(expected):]
    if survivors is None:
        assert rest == []
    else:
        assert len(rest) == 1 and order_of(rest[0]) == list(survivors) and rest[0].seq == h.plan_seq
    assert not traces(actions, "session_failed") and not sends(actions, cf.SessionFailed)
    assert list(h.members) == [HOST] and not h.pending and h.rendezvous_lost == reason
    if forming:
        assert not h.lost and h.error is None
    else:
        assert all(h.lost[p].lost == rdv_lost(reason) for p in members) and h.error == msg


def through_an_outage(h: sm.HostMachine, attempts: int = 2) -> sm.HostMachine:
    """A ready host with a direct ring serves through a rendezvous outage and reconnects: every remote
    member is still in the roster with ``control_down`` (its ctl circuit died with the rendezvous)."""
    assert h.state == H.READY
    h.handle(sm.RendezvousLost("eof"))
    for pid in list(h.members):
        h.handle(sm.MemberLost(pid, "circuit closed"))  # each member's ctl circuit ends as well
    h.handle(sm.RendezvousBack(attempts))
    assert h.state == H.READY and h.rendezvous_lost is None
    assert all(e.control_down and e.lost is None for e in h.members.values() if not e.is_host)
    return h


def rejoined(actions, h, pid: str, survivors, remembered: bool = True) -> None:
    """``pid`` came back after the outage while its old entry was ``control_down``: the old entry is
    lost (requests fail naming it, a member_lost trace, a replan over ``survivors``: None for none),
    its new link is NOT closed, and the device is admitted again at once (its key was admitted in this
    session), put in the roster only when ``remembered`` (it joined with a trusted key)."""
    name, reason = NAMES[pid], "it rejoined after the rendezvous outage"
    msg = f"member {name} ({pid}) left the session: {reason}"
    head = [sm.FailRequests(msg, name), sm.Trace("member_lost", {"name": name, "peer_id": pid, "reason": reason})]
    assert actions[:2] == head
    rest = actions[2:]
    if survivors is not None:
        assert order_of(rest[0]) == list(survivors)
        rest = rest[1:]
    assert rest == [sm.Remember(pid, name, key(pid))] * remembered + [sm.Send(pid, admitted_frame(name))]
    assert pid in h.members and not h.members[pid].control_down and h.members[pid].capability is None
    assert sm.CloseLink(pid, "") not in actions  # that would close the link it just rejoined on
    assert h.lost[pid].lost == reason and h.culprit == name and not h.pending


def member_failure(actions, reason: str, member=None) -> None:
    assert actions[:2] == [sm.FailRequests(reason, member), sm.Trace("session_failed", {"reason": reason})]


def rejoin_after_loss(h) -> None:
    """Ready at epoch 2 over host + alpha after beta was lost; beta's seat is free again."""
    h.handle(sm.MemberLost(B, "gone"))
    replan(h)
    load_all(h)
    assert h.state == H.READY and h.epoch == 2 and len(h.members) == 2



"""Session machines (kafilad/proto/session.py) across several events, and a host pumped against its members.

The rows one by one are in test_session_machines.py. Here: a member lost in each host state,
admission (pending, timeouts, a full session, unique names), a close is never a failure, every
event a state's row does not list (a peer's frame closes its link, a local event raises
LocalProtocolError, nothing changes once the session is over), races the drivers can produce
(stale planner answers, frames in flight from a lost member), a rendezvous outage (never a
failure: the host serves on or re-forms over what is left, the members rejoin once it is back),
and session_helpers.SessionPair: one host and two members whose frames cross the wire (to_wire,
proto_spec 02 framing, msgpack, decode_control). No trio, no sockets.
"""

from __future__ import annotations

import pytest

from kafilad.errors import ADMIT_TIMEOUT, ALREADY_IN_SESSION, SESSION_COMPLETE, SESSION_FAILED, LocalProtocolError
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.session import HOST_TABLE, MAX_REFORMS, MEMBER_TABLE

from proto.session_helpers import (
    A, B, C, CAPABILITY, HOST, HOST_NAME, LOAD, NAMES, H, M, SessionPair, admitted_frame, cap_frame, key, load_all,
    lost_with_the_rendezvous, new_host, planned, ready_frame, rejoined, replan, sample_frames, sends, through_an_outage, traces,
    walk_host, walk_member,
)

#: One instance of every local (driver-made) event type of both machines.
LOCAL_EVENTS = {type(e): e for e in [
    sm.Registered("S2"), sm.MemberJoined(C, "gamma", key(C), True), sm.Decision(C, True), sm.PendingTimedOut(C, 1.0),
    sm.OwnCapability(dict(CAPABILITY)), planned((HOST_NAME, "alpha", "beta"), HOST_NAME), sm.PlanFailed("too big"),
    sm.OwnStageLoaded(dict(LOAD), 1), sm.OwnStageFailed("Member boss could not build its stage.", 1), sm.MemberLost(A, "gone"), sm.RingFailed(None, "broke", None),
    sm.RendezvousLost("eof"), sm.JoinFailed("Cannot join."), sm.Abort("boom"), sm.Close("bye"),
    sm.CapabilitySent(dict(CAPABILITY)), sm.StageLoaded(dict(LOAD), 1), sm.LoadFailed("oom"),
    sm.HostLinkLost("eof"), sm.SessionEnded("ended"), sm.RendezvousBack(2), sm.Reassess("alpha", "x"),
]}
FRAMES = sample_frames()
HOST_LIVE = [s for s in sm.HostState if s not in (H.FAILED, H.CLOSED)]
MEMBER_LIVE = [s for s in sm.MemberState if s not in (M.FAILED, M.CLOSED)]


def _walk(state):
    return walk_host(state) if isinstance(state, sm.HostState) else walk_member(state)


def _every_event(machine):
    """Every local event and every control frame, as the machine would receive them."""
    frames = [sm.FrameFrom(A, f) for f in FRAMES.values()] if isinstance(machine, sm.HostMachine) else \
        list(FRAMES.values())
    return list(LOCAL_EVENTS.values()) + frames


def test_the_samples_cover_every_event_type():
    local = {t for table in (HOST_TABLE, MEMBER_TABLE) for row in table.values() for t in row
             if not issubclass(t, cf.ControlFrame)}
    assert local == set(LOCAL_EVENTS)
    assert set(FRAMES) == set(cf._TYPES)


# ---- a member lost in each host state -------------------------------------------------------------
@pytest.mark.parametrize("state", [H.PLANNING, H.LOADING, H.READY, H.RECOVERING])
def test_a_member_lost_fails_its_requests_and_the_host_replans_over_the_survivors(state):
    h = walk_host(state)
    out = h.handle(sm.MemberLost(A, "the link to alpha broke"))
    msg = "member alpha (A) left the session: the link to alpha broke"
    assert h.state == H.RECOVERING and h.error == msg and h.culprit == "alpha"
    assert out[0] == sm.FailRequests(msg, "alpha") and sm.CloseLink(A, "") in out
    assert [e.peer_id for e in out[-1].order] == [HOST, B]
    assert not traces(out, "session_failed") and not sends(out, cf.SessionFailed)  # B serves on after the replan
    assert A not in h.members and set(h.lost) == {A}
    # the second loss plans over the host alone
    out = h.handle(sm.MemberLost(B, "gone"))
    assert [e.peer_id for e in out[-1].order] == [HOST] and set(h.lost) == {A, B}


def test_a_member_lost_while_forming_is_only_dropped_from_the_roster():
    h = walk_host(H.FORMING)
    h.handle(sm.FrameFrom(A, cap_frame()))
    assert h.handle(sm.MemberLost(A, "gone")) == [sm.CloseLink(A, "")]
    assert h.state == H.FORMING and list(h.members) == [HOST, B] and not h.lost and h.error is None
    # its seat is free: another device completes the session, and planning starts without alpha
    h.handle(sm.MemberJoined(C, "gamma", key(C), True))
    h.handle(sm.OwnCapability(dict(CAPABILITY)))
    h.handle(sm.FrameFrom(B, cap_frame()))
    out = h.handle(sm.FrameFrom(C, cap_frame()))
    assert h.state == H.PLANNING and [e.peer_id for e in out[0].order] == [HOST, B, C]


def test_a_member_lost_while_degraded_waits_without_replanning():
    h = walk_host(H.DEGRADED)
    out = h.handle(sm.MemberLost(A, "gone"))
    assert h.state == H.DEGRADED and not any(isinstance(a, sm.MakePlan) for a in out)
    assert out[0] == sm.FailRequests("member alpha (A) left the session: gone", "alpha")


def test_a_member_lost_twice_or_unknown_changes_nothing():
    h = walk_host(H.READY)
    h.handle(sm.MemberLost(A, "gone"))
    assert h.handle(sm.MemberLost(A, "gone again")) == []
    assert h.handle(sm.MemberLost("Z", "who?")) == []
    assert h.handle(sm.MemberLost(HOST, "itself")) == [] and h.state == H.RECOVERING


def test_a_lost_member_returns_and_the_ring_re_forms_with_it():
    h = walk_host(H.READY)
    h.handle(sm.MemberLost(B, "gone"))
    replan(h)
    assert load_all(h) == [sm.Formed()] and h.ring_order == [HOST, A] and h.epoch == 2
    h.handle(sm.MemberJoined(B, "beta", key(B), True))
    out = h.handle(sm.FrameFrom(B, cap_frame()))
    assert out[0] == sm.Trace("member_returned", {"name": "beta"}) and h.state == H.RECOVERING
    replan(h)
    assert load_all(h) == [sm.Formed()] and h.ring_order == [HOST, A, B] and h.epoch == 3


# ---- admission --------------------------------------------------------------------------------
@pytest.mark.parametrize("state", HOST_LIVE[1:])
def test_a_pending_member_times_out_in_every_live_state(state):
    h = walk_host(state, pending=(C,))
    assert h.handle(sm.PendingTimedOut(C, 30.0)) == [
        sm.Send(C, cf.Denied("the host did not admit this device within 30 s", code=ADMIT_TIMEOUT)), sm.CloseLink(C, "")]
    assert not h.pending and h.state == state
    assert h.handle(sm.PendingTimedOut(C, 30.0)) == []  # decided already
    assert h.handle(sm.Decision(C, True)) == []


def test_a_pending_member_is_admitted_only_while_a_seat_is_free():
    h = walk_host(H.FORMING, members=(A,), pending=(C,))
    h.handle(sm.MemberJoined(B, "beta", key(B), trusted=True))  # the session is full now
    assert h.handle(sm.Decision(C, True)) == [
        sm.Send(C, cf.Denied("the session became complete while this device waited", code=SESSION_COMPLETE)), sm.CloseLink(C, "")]
    # below the declared size after a loss (healing), a pending device is admitted
    h = walk_host(H.READY, pending=(C,))
    h.handle(sm.MemberLost(B, "gone"))
    out = h.handle(sm.Decision(C, True))
    assert out[0] == sm.Remember(C, "gamma", key(C)) and isinstance(out[1].frame, cf.Admitted) and C in h.members


def test_a_pending_member_that_disconnects_is_forgotten():
    h = walk_host(H.FORMING, members=(A,), pending=(C,))
    assert h.handle(sm.MemberLost(C, "its link closed")) == [] and not h.pending and h.state == H.FORMING


def test_a_device_already_in_the_session_is_refused():
    h = walk_host(H.FORMING, members=(A,), pending=(C,))
    for pid in (A, C):
        assert h.handle(sm.MemberJoined(pid, "again", key(pid), True)) == [
            sm.Send(pid, cf.Denied("this device is already in the session", code=ALREADY_IN_SESSION)), sm.CloseLink(pid, "")]
    assert h.members[A].name == "alpha" and h.pending[C].name == "gamma"


def test_two_devices_with_the_same_name_get_unique_names():
    h = walk_host(H.FORMING, members=())
    h.expected = 5
    h.handle(sm.MemberJoined(A, "laptop", key(A), True))
    h.handle(sm.MemberJoined(B, "laptop", key(B), True))
    h.handle(sm.MemberJoined(C, HOST_NAME, key(C), False))  # pending, named like the host
    out = h.handle(sm.MemberJoined("D", "laptop", key("D"), True))
    assert [h.members[p].name for p in (A, B)] == ["laptop", "laptop-2"] and h.pending[C].name == "host-2"
    assert out[0] == sm.Remember("D", "laptop-3", key("D")) and out[1].frame.name == "laptop-3"
    assert h.handle(sm.Decision(C, True))[1].frame.name == "host-2"
    names = [e.name for e in h.members.values()]
    assert len(set(names)) == len(names) == 5


def test_a_name_freed_by_a_lost_member_is_given_again():
    h = walk_host(H.FORMING, members=())
    h.handle(sm.MemberJoined(A, "laptop", key(A), True))
    h.handle(sm.MemberLost(A, "gone"))
    assert h.handle(sm.MemberJoined(B, "laptop", key(B), True))[1].frame.name == "laptop"


# ---- a close is never a failure ------------------------------------------------------------------
@pytest.mark.parametrize("state", [s for s in sm.HostState if s != H.CLOSED] + MEMBER_LIVE + [M.FAILED])
def test_a_close_is_never_recorded_as_a_failure(state):
    m = _walk(state)
    err = m.error if state not in (M.JOINING, M.PENDING) else "This device left before the host admitted it."
    out = m.handle(sm.Close("the user left"))
    assert m.state in (H.CLOSED, M.CLOSED) and not traces(out, "session_failed")
    assert not sends(out, cf.SessionFailed)
    for event in _every_event(m):  # late frames, a ring failure, an abort: all ignored
        assert m.handle(event) == [], event
    assert m.state in (H.CLOSED, M.CLOSED) and m.error == err


# ---- events a state's row does not list -----------------------------------------------------------
@pytest.mark.parametrize("state", HOST_LIVE)
def test_an_unexpected_frame_closes_that_members_link(state):
    for t, frame in FRAMES.items():
        if type(frame) in HOST_TABLE[state]:
            continue
        h = walk_host(state)
        members, err = dict(h.members), h.error
        name = NAMES[A] if A in h.members else A
        assert h.handle(sm.FrameFrom(A, frame)) == [
            sm.CloseLink(A, f"{name} sent an unexpected {t} frame while the session was {state.value}")], t
        assert h.state == state and h.members == members and h.error == err


def test_a_stage_ready_again_while_ready_closes_that_link():
    h = walk_host(H.READY)
    assert h.handle(sm.FrameFrom(B, ready_frame(1))) == [
        sm.CloseLink(B, "beta sent an unexpected ready frame while the session was ready")]


@pytest.mark.parametrize("state", MEMBER_LIVE)
def test_an_unexpected_host_frame_closes_the_host_link(state):
    for t, frame in FRAMES.items():
        if type(frame) in MEMBER_TABLE[state]:
            continue
        m = walk_member(state)
        assert m.handle(frame) == [
            sm.CloseLink("", f"the host sent an unexpected {t} frame while this device was {state.value}")], t
        assert m.state == state and m.error is None


@pytest.mark.parametrize("state", HOST_LIVE + MEMBER_LIVE)
def test_a_local_event_out_of_place_is_a_local_protocol_error(state):
    table = HOST_TABLE if isinstance(state, sm.HostState) else MEMBER_TABLE
    machine = type(_walk(state)).__name__
    for t, event in LOCAL_EVENTS.items():
        if t in table[state]:
            continue
        m = _walk(state)
        with pytest.raises(LocalProtocolError, match=f"^{machine}: event {t.__name__} in state {state.value}$"):
            m.handle(event)
        assert m.state == state


@pytest.mark.parametrize("state", [H.FAILED, H.CLOSED, M.FAILED, M.CLOSED])
def test_events_after_the_session_is_over_are_ignored(state):
    m = _walk(state)
    err = m.error
    for event in _every_event(m):
        if isinstance(event, sm.Close) and state in (H.FAILED, M.FAILED):
            continue
        if isinstance(event, sm.MemberJoined) and state == H.FAILED:
            continue  # told it failed (test_session_recovery a_device_joining_a_failed_session_is_told_what_to_do)
        m.changed = False
        assert m.handle(event) == [], event
        assert m.state == state and m.error == err and not m.changed


# ---- races the drivers can produce ---------------------------------------------------------------
def test_planner_answers_to_earlier_requests_are_ignored():
    h = walk_host(H.READY)
    h.handle(sm.RingFailed("beta", "beta stopped", 1))  # request 2, over host, alpha, beta
    first = h.plan_seq
    h.handle(sm.MemberLost(B, "gone"))  # request 3, over host, alpha
    assert h.plan_seq == first + 1
    assert h.handle(planned((HOST_NAME, "alpha", "beta"), HOST_NAME, first)) == []  # stale: names beta
    assert h.handle(sm.PlanFailed("too big", first)) == [] and h.state == H.RECOVERING
    out = h.handle(planned((HOST_NAME, "alpha"), HOST_NAME, h.plan_seq))
    assert h.state == H.LOADING and h.epoch == 2 and out[1].epoch == 2
    assert h.handle(planned((HOST_NAME, "alpha"), HOST_NAME, first)) == []  # a late answer, in loading
    assert h.state == H.LOADING and h.epoch == 2


def test_a_frame_from_a_member_lost_meanwhile_is_ignored():
    h = walk_host(H.LOADING)
    h.handle(sm.MemberLost(B, "gone"))
    replan(h)
    assert h.handle(sm.FrameFrom(B, ready_frame(2))) == []
    assert h.handle(sm.FrameFrom(B, cf.Edges([]))) == [] and h.state == H.LOADING and B not in h.members


def test_a_stale_ring_failure_does_not_stop_a_member_serving_on():
    m = walk_member(M.READY, epoch=2)
    assert m.handle(sm.RingFailed("beta", "the ring of plan 1 broke", 1)) == [] and m.ring_broken is None
    assert m.handle(sm.RendezvousLost("eof", edges_direct=True))[0].kind == "rendezvous_lost"
    assert m.state == M.READY and m.keeps_serving


def test_a_pending_member_is_denied_when_the_session_fails():
    h = walk_host(H.READY, pending=(C,))
    out = h.handle(sm.Abort("boom"))
    assert sm.Send(C, cf.Denied("the session failed: internal error: boom", code=SESSION_FAILED)) in out and sm.CloseLink(C, "") in out
    assert not h.pending and C not in sends(out, cf.SessionFailed)


# ---- a host and two members, pumped through the wire ---------------------------------------------
def _formed_pair() -> SessionPair:
    p = SessionPair(expected=3)
    p.to_host(sm.Registered("S1"))
    p.join(A, "alpha", trusted=True)
    p.join(B, "beta", trusted=False)
    assert p.members[B].state == M.PENDING and p.members[A].state == M.ADMITTED
    p.to_host(sm.Decision(B, admit=True))
    assert p.members[B].state == M.ADMITTED and p.members[B].admitted.name == "beta"
    p.to_host(sm.OwnCapability(dict(CAPABILITY)))
    p.report_capability(A)
    p.report_capability(B, {**CAPABILITY, "memory_bytes": 4 << 30, "nat_class": "S"})
    assert p.host.state == H.PLANNING and p.host.members[B].capability["nat_class"] == "S"
    p.plan(head=HOST_NAME)
    assert p.host.state == H.LOADING
    for pid in (A, B):
        m = p.members[pid]
        assert m.state == M.LOADING and m.plan.epoch == 1 and m.plan.ring == [HOST, A, B]
        assert isinstance(p.member_log[pid][-1], sm.StartLoad)
        p.load(pid)
    p.load_own()
    return p


def test_pair_forms_a_three_member_session_over_the_wire():
    p = _formed_pair()
    assert p.host.state == H.READY and all(m.state == M.READY for m in p.members.values())
    assert [a for a in p.host_log if isinstance(a, sm.Formed)] == [sm.Formed()]
    kinds = [(s, r, w["t"]) for s, r, w in p.wire]
    assert kinds == [(HOST, A, "admitted"), (HOST, B, "pending"), (HOST, B, "admitted"), (A, HOST, "capability"),
                     (B, HOST, "capability"), (HOST, A, "plan"), (HOST, B, "plan"), (A, HOST, "ready"),
                     (B, HOST, "ready")]
    assert p.host.members[A].load["fetched_bytes"] == LOAD["fetched_bytes"]


def test_pair_a_member_lost_the_survivor_reloads_and_the_lost_one_returns():
    p = _formed_pair()
    p.break_link(A, "the ctl link to alpha broke")
    msg = "member alpha (A) left the session: the ctl link to alpha broke"
    assert p.host.state == H.RECOVERING and p.host.error == msg and sm.FailRequests(msg, "alpha") in p.host_log
    assert p.members[A].state == M.FAILED and p.members[A].error == "the link to the host closed: the ctl link to " \
                                                                    "alpha broke"
    assert p.members[B].state == M.READY  # healing: the survivor is not failed, it gets a new plan
    p.plan()
    assert p.members[B].state == M.LOADING and p.members[B].plan.epoch == 2 and p.members[B].plan.ring == [HOST, B]
    p.load(B)
    p.load_own()
    assert p.host.state == H.READY and p.host.ring_order == [HOST, B] and p.host.epoch == 2
    # alpha's daemon joins again: admitted below the declared size, planned back in
    p.join(A, "alpha", trusted=True)
    p.report_capability(A)
    assert p.host.state == H.RECOVERING and sm.Trace("member_returned", {"name": "alpha"}) in p.host_log
    p.plan()
    for pid in (A, B):
        assert p.members[pid].plan.epoch == 3
        p.load(pid)
    p.load_own()
    assert p.host.state == H.READY and p.host.ring_order == [HOST, B, A]  # the returning member comes last
    assert not traces(p.host_log, "session_failed")


def test_pair_a_ring_that_keeps_breaking_fails_every_member_naming_the_culprit():
    p = _formed_pair()
    for _ in range(MAX_REFORMS):
        p.to_member(A, sm.RingFailed("beta", "no answer from beta", p.members[A].plan.epoch))
        assert p.host.state == H.RECOVERING
        p.plan()
        assert p.host.state == H.LOADING and all(m.state == M.LOADING for m in p.members.values())
    p.to_member(A, sm.RingFailed("beta", "no answer from beta", p.members[A].plan.epoch))
    reason = f"no answer from beta (reported by alpha); the ring broke {MAX_REFORMS + 1} times in a row while re-forming"
    assert p.host.state == H.FAILED and p.host.error == reason and p.host.culprit == "beta"
    told = f"The session failed on the host: {reason}."
    for pid in (A, B):
        assert p.members[pid].state == M.FAILED and p.members[pid].error == told
        assert sm.FailRequests(told, "host") in p.member_log[pid] and sm.ForgetSession() in p.member_log[pid]


def test_pair_a_member_that_leaves_is_closed_not_failed():
    p = _formed_pair()
    p.to_member(B, sm.Close("its user ran `kafila-ctl leave`"))
    assert p.members[B].state == M.CLOSED and not traces(p.member_log[B], "session_failed")
    assert (B, HOST, {"t": "leaving", "reason": "its user ran `kafila-ctl leave`"}) in p.wire
    assert p.host.state == H.RECOVERING and p.host.culprit == "beta"
    assert p.host.error == "member beta (B) left the session: it is leaving: its user ran `kafila-ctl leave`"
    assert p.members[A].state == M.READY


def test_pair_a_host_close_ends_every_member_for_good_and_is_no_failure():
    p = _formed_pair()
    r = "the host closed the session"
    p.to_host(sm.Close(r))
    assert p.host.state == H.CLOSED and not traces(p.host_log, "session_failed")
    assert traces(p.host_log, "session_closed") == [sm.Trace("session_closed", {"reason": r})]
    for pid, m in p.members.items():
        assert (HOST, pid, {"t": "session_closed", "reason": r}) in p.wire
        assert m.state == M.CLOSED and m.error == r  # closed, not failed: its daemon does not rejoin
        assert p.member_log[pid][-3:] == [sm.FailRequests(r, "host"), sm.ForgetSession(), sm.CloseLink("", "")]
        assert not traces(p.member_log[pid], "session_failed")
    assert not p.links


def test_pair_a_host_daemon_that_stops_leaves_the_members_to_rejoin():
    p = _formed_pair()
    p.to_host(sm.Close("the host's daemon stopped", final=False))
    assert p.host.state == H.CLOSED and not [w for _, _, w in p.wire if w["t"] == "session_closed"]
    for pid, m in p.members.items():
        # failed (its daemon rejoins the remembered session once the host is back), nothing forgotten
        assert m.state == M.FAILED and m.error == "the link to the host closed: the host's daemon stopped"
        assert not any(isinstance(a, sm.ForgetSession) for a in p.member_log[pid])
    assert not p.links


def test_pair_same_names_are_made_unique_on_the_wire():
    p = SessionPair(expected=3, host_name="box")
    p.to_host(sm.Registered("S1"))
    p.join(A, "box", trusted=True)
    p.join(B, "box", trusted=True)
    assert [p.members[x].admitted.name for x in (A, B)] == ["box-2", "box-3"]


def test_pair_a_member_that_aborts_while_forming_is_dropped():
    p = SessionPair(expected=3)
    p.to_host(sm.Registered("S1"))
    p.join(A, "alpha", trusted=True)
    p.join(B, "beta", trusted=True)
    p.report_capability(A)
    p.to_member(A, sm.Abort("RuntimeError('probe')"))  # its daemon's internal error (daemon.py)
    assert p.members[A].state == M.FAILED
    assert not [a for a in p.host_log if isinstance(a, sm.CloseLink) and "unexpected" in a.reason]
    assert A not in p.host.members
    p.to_host(sm.OwnCapability(dict(CAPABILITY)))
    p.report_capability(B)
    assert p.host.state == H.FORMING  # two of three: still forming, not planning with a dead member


# ---- a rendezvous outage ---------------------------------------------------------------------------
@pytest.mark.parametrize("relayed", [(), ("alpha -> beta",)], ids=["direct", "relayed"])
@pytest.mark.parametrize("state", HOST_LIVE[1:])
def test_a_rendezvous_outage_never_fails_the_session(state, relayed):
    h = walk_host(state, pending=(C,))
    out = h.handle(sm.RendezvousLost("eof", relayed_edges=relayed))
    assert h.state not in (H.FAILED, H.CLOSED) and h.state in HOST_TABLE[state][sm.RendezvousLost]
    assert not traces(out, "session_failed") and not sends(out, cf.SessionFailed) and not sends(out, cf.Denied)
    if state == H.READY and not relayed:  # the direct ring serves on, headed here
        assert out == [sm.Trace("rendezvous_lost", {"reason": "eof"})] and h.state == H.READY and h.pending
    else:
        survivors = None if state in (H.FORMING, H.DEGRADED) else [HOST]
        lost_with_the_rendezvous(out, h, "eof", [A, B], survivors=survivors, pending=(C,))
    assert h.handle(sm.RendezvousLost("eof again")) == []  # one outage is reported once
    state = h.state
    assert h.handle(sm.RendezvousBack(7)) == [sm.Trace("rendezvous_reconnected", {"attempts": 7})]
    assert h.state == state and h.rendezvous_lost is None


@pytest.mark.parametrize("state", [H.PLANNING, H.LOADING])
def test_a_rendezvous_outage_of_a_host_alone_stays_within_the_table(state):
    h = walk_host(state, expected=1, members=())
    assert h.handle(sm.RendezvousLost("eof")) == [sm.Trace("rendezvous_lost", {"reason": "eof"})]
    assert h.state == state  # nothing to re-form: it carries on
    assert h.state in HOST_TABLE[state][sm.RendezvousLost]


def test_a_rendezvous_outage_while_loading_after_every_member_was_lost():
    h = walk_host(H.READY)
    h.handle(sm.MemberLost(A, "gone"))
    h.handle(sm.MemberLost(B, "gone"))
    replan(h)
    assert h.state == H.LOADING and h.ring_order == [HOST]
    assert h.handle(sm.RendezvousLost("eof")) == [sm.Trace("rendezvous_lost", {"reason": "eof"})]
    assert h.handle(sm.OwnStageLoaded(dict(LOAD), h.epoch)) == [sm.Formed()] and h.state == H.READY


def test_a_member_back_after_the_outage_of_a_degraded_session():
    h = walk_host(H.READY)
    through_an_outage(h)
    h.handle(sm.RingFailed(None, "alpha stopped", 1))
    h.handle(sm.PlanFailed("Device 'beta' cannot hold 3 blocks.", h.plan_seq))
    assert h.state == H.DEGRADED
    rejoined(h.handle(sm.MemberJoined(A, "alpha", key(A), True)), h, A, survivors=None)  # degraded: no replan
    assert h.state == H.DEGRADED
    out = h.handle(sm.FrameFrom(A, cap_frame()))
    assert out[0] == sm.Trace("member_returned", {"name": "alpha"})
    assert [e.peer_id for e in out[1].order] == [HOST, B, A]  # beta, its control still down, stays in the plan


def test_a_device_back_after_the_outage_without_a_trusted_key_is_admitted_again():
    # admitted in this session (its key was not in the roster at the rejoin): no `admit` needed, not remembered
    h = walk_host(H.READY)
    through_an_outage(h)
    rejoined(h.handle(sm.MemberJoined(B, "beta", key(B), trusted=False)), h, B, survivors=[HOST, A],
             remembered=False)


def test_an_open_session_admits_without_remembering_the_key():
    h = new_host(open_=True)
    h.handle(sm.Registered("S1"))
    assert h.handle(sm.MemberJoined(A, "alpha", key(A), trusted=False)) == [sm.Send(A, admitted_frame("alpha"))]
    assert h.handle(sm.MemberJoined(B, "beta", key(B), trusted=True))[0] == sm.Remember(B, "beta", key(B))


def test_pair_a_direct_ring_serves_through_the_outage_and_the_members_rejoin_after():
    p = _formed_pair()
    p.to_host(sm.RendezvousLost("eof"))
    for pid in (A, B):
        p.to_member(pid, sm.RendezvousLost("eof", edges_direct=True))
        p.break_link(pid, "the ctl circuit closed with the rendezvous")
    assert p.host.state == H.READY and all(e.control_down for e in p.host.members.values() if not e.is_host)
    assert all(m.state == M.READY and m.keeps_serving for m in p.members.values())
    p.to_host(sm.RendezvousBack(3))
    for pid in (A, B):  # member.py ends the session to rejoin on a fresh ctl link; its daemon rejoins
        p.to_member(pid, sm.SessionEnded("the rendezvous is back; rejoining to restore the control link"))
        assert p.members[pid].state == M.FAILED
        p.join(pid, NAMES[pid], trusted=True)
        assert p.members[pid].state == M.ADMITTED and pid in p.links  # the new link stays open
        p.report_capability(pid)
    assert p.host.state == H.RECOVERING and set(p.host.lost) == {A, B}
    p.plan()  # the last request: the host and alpha (beta was not measured yet)
    assert p.host.ring_order == [HOST, A]
    p.load(A)
    p.load_own()  # ready, and beta, measured meanwhile, is planned in at once
    assert p.host.state == H.RECOVERING
    p.plan()
    for pid in (A, B):
        p.load(pid)
    p.load_own()
    assert p.host.state == H.READY and p.host.ring_order == [HOST, A, B] and p.host.epoch == 3
    assert not traces(p.host_log, "session_failed")
    assert traces(p.host_log, "rendezvous_reconnected") == [sm.Trace("rendezvous_reconnected", {"attempts": 3})]


def test_pair_a_relayed_ring_re_forms_on_the_host_and_the_members_return():
    p = _formed_pair()
    p.to_host(sm.RendezvousLost("eof", relayed_edges=("alpha -> beta",)))
    assert all(m.state == M.FAILED for m in p.members.values()) and not p.links
    assert not [w for _, _, w in p.wire if w["t"] in ("session_failed", "session_closed")]
    p.plan()
    p.load_own()
    assert p.host.state == H.READY and p.host.ring_order == [HOST] and p.host.epoch == 2
    p.to_host(sm.RendezvousBack(1))
    for pid in (A, B):
        p.join(pid, NAMES[pid], trusted=True)
        p.report_capability(pid)
    assert sm.Trace("member_returned", {"name": "alpha"}) in p.host_log
    while p.host.state != H.READY or len(p.host.ring_order) < 3:
        p.plan()
        for pid in p.host.ring_order[1:]:
            p.load(pid)
        p.load_own()
    assert p.host.ring_order == [HOST, A, B] and p.host.epoch == 4
    assert not traces(p.host_log, "session_failed")

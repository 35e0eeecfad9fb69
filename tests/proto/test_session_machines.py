"""The pure session machines (kafilad/proto/session.py): every row of their transition tables, part 1.

Each case drives a machine into a state through its public events (session_helpers.walk_host /
walk_member), fires one event of the row's type and checks the new state (allowed by the row
AND the one this scenario must reach) and the key actions. The cases are compared with the
tables, so a new row (or a new target state of a row) without a case fails. Here: the host's
formation states (starting to loading); test_session_recovery.py: the host from ready on;
test_session_member.py: every member state; test_session_flows.py: scenarios across several
events and a host pumped against its members through the wire. No trio, no sockets.
"""

from __future__ import annotations

import pytest

from kafilad.errors import ADMIT_TIMEOUT, DENIED, SESSION_COMPLETE
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.session import HOST_TABLE, MAX_REFORMS, MEMBER_TABLE

from proto.session_helpers import (
    A, B, C, CAPABILITY, HOST, HOST_FORMATION_STATES, HOST_NAME, HOST_SERVING_STATES, LOAD, PARAMS, SESSION_ID,
    H, Rows, admitted_frame, cap_frame, failure, key, load_all, lost, lost_with_the_rendezvous, order_of, planned,
    ready_frame, rejoin_after_loss, rejoined, replan, ring_broke, standby_lost, through_an_outage, traces, walk_host,
)

HOST_ROWS = Rows(HOST_TABLE, HOST_FORMATION_STATES, walk_host)
host_case = HOST_ROWS.case


# ---- host: starting -----------------------------------------------------------------------------
@host_case(H.STARTING, sm.Registered, H.FORMING)
def registered_opens_the_session(h, fire):
    out = fire(sm.Registered(SESSION_ID))
    assert out == [sm.Trace("session_opened", {"session_id": SESSION_ID, "role": "host", "members": 3,
                                               "model_id": "test/tiny", "context": 256, "concurrency": 2})]
    assert h.session_id == SESSION_ID and h.changed


@host_case(H.STARTING, sm.Abort, H.FAILED)
def abort_before_registration(h, fire):
    failure(fire(sm.Abort("boom")), "internal error: boom", None)
    assert h.error == "internal error: boom"


@host_case(H.STARTING, sm.Close, H.CLOSED)
def close_before_registration(h, fire):
    assert fire(sm.Close("the daemon stopped")) == [sm.FailRequests("the daemon stopped", None)]


# ---- host: forming ------------------------------------------------------------------------------
@host_case(H.FORMING, sm.MemberJoined, H.FORMING, members=(A,))
def trusted_member_is_admitted(h, fire):
    out = fire(sm.MemberJoined(B, "beta", key(B), trusted=True))
    assert out == [sm.Remember(B, "beta", key(B)),
                   sm.Send(B, cf.Admitted(session_id=SESSION_ID, name="beta", **PARAMS))]
    assert h.members[B].name == "beta" and not h.pending


@host_case(H.FORMING, sm.MemberJoined, H.FORMING, members=(A,))
def unknown_member_waits(h, fire):
    assert fire(sm.MemberJoined(B, "beta", key(B), trusted=False)) == [sm.Send(B, cf.Pending())]
    assert B in h.pending and B not in h.members


@host_case(H.FORMING, sm.Decision, H.FORMING, members=(A,), pending=(C,))
def admit_a_pending_member(h, fire):
    out = fire(sm.Decision(C, admit=True))
    assert out == [sm.Remember(C, "gamma", key(C)),
                   sm.Send(C, cf.Admitted(session_id=SESSION_ID, name="gamma", **PARAMS))]
    assert C in h.members and not h.pending


@host_case(H.FORMING, sm.Decision, H.FORMING, members=(A,), pending=(C,))
def deny_a_pending_member(h, fire):
    out = fire(sm.Decision(C, admit=False, reason="not on my list"))
    assert out == [sm.Send(C, cf.Denied("not on my list", code=DENIED)), sm.CloseLink(C, "")]
    assert C not in h.members and not h.pending


@host_case(H.FORMING, sm.PendingTimedOut, H.FORMING, members=(A,), pending=(C,))
def pending_member_times_out(h, fire):
    out = fire(sm.PendingTimedOut(C, 120.0))
    assert out == [sm.Send(C, cf.Denied("the host did not admit this device within 120 s", code=ADMIT_TIMEOUT)), sm.CloseLink(C, "")]
    assert not h.pending


@host_case(H.FORMING, sm.OwnCapability, H.FORMING)
def own_capability_before_the_members(h, fire):
    assert fire(sm.OwnCapability(dict(CAPABILITY))) == []
    assert h.members[HOST].capability == CAPABILITY


@host_case(H.FORMING, sm.OwnCapability, H.PLANNING)
def own_capability_last_starts_planning(h, fire):
    for pid in (A, B):
        h.handle(sm.FrameFrom(pid, cap_frame()))
    out = fire(sm.OwnCapability(dict(CAPABILITY)))
    assert len(out) == 1 and order_of(out[0]) == [HOST, A, B]
    assert [e.name for e in out[0].order] == [HOST_NAME, "alpha", "beta"] and all(e.capability for e in out[0].order)


@host_case(H.FORMING, cf.Capability, H.FORMING)
def member_capability_recorded(h, fire):
    assert fire(sm.FrameFrom(A, cap_frame(4 << 30))) == []
    assert h.members[A].capability == cap_frame(4 << 30).as_record()
    assert h.members[A].capability["memory_bytes"] == 4 << 30


@host_case(H.FORMING, cf.Capability, H.PLANNING)
def last_capability_starts_planning(h, fire):
    h.handle(sm.OwnCapability(dict(CAPABILITY)))
    h.handle(sm.FrameFrom(A, cap_frame()))
    out = fire(sm.FrameFrom(B, cap_frame()))
    assert len(out) == 1 and order_of(out[0]) == [HOST, A, B]


@host_case(H.FORMING, sm.MemberLost, H.FORMING)
def member_lost_while_forming_is_dropped(h, fire):
    h.handle(sm.FrameFrom(A, cap_frame()))
    assert fire(sm.MemberLost(A, "its link broke")) == [sm.CloseLink(A, "")]  # it may join again
    assert A not in h.members and B in h.members and h.error is None and not h.lost


@host_case(H.FORMING, cf.Leaving, H.FORMING)
def member_leaving_while_forming_is_dropped(h, fire):
    assert fire(sm.FrameFrom(A, cf.Leaving("its user ran `kafila-ctl leave`"))) == [sm.CloseLink(A, "")]
    assert A not in h.members and h.error is None


@host_case(H.FORMING, cf.Failed, H.FORMING)
def member_failed_while_forming_is_dropped(h, fire):
    assert fire(sm.FrameFrom(A, cf.Failed("internal error: RuntimeError()"))) == [sm.CloseLink(A, "")]  # aborted
    assert A not in h.members and h.error is None


@host_case(H.FORMING, sm.RendezvousLost, H.FORMING, members=(A, B), pending=(C,))
def rendezvous_lost_while_forming_drops_everyone(h, fire):
    out = fire(sm.RendezvousLost("socket closed."))
    # the ctl circuits went down with it: members and pending devices are dropped, nothing is failed
    lost_with_the_rendezvous(out, h, "socket closed.", [A, B], pending=(C,))
    assert h.handle(sm.RendezvousLost("again")) == []  # reported once


@host_case(H.FORMING, sm.RendezvousBack, H.FORMING)
def rendezvous_back_while_forming(h, fire):
    h.handle(sm.RendezvousLost("eof"))
    assert fire(sm.RendezvousBack(3)) == [sm.Trace("rendezvous_reconnected", {"attempts": 3})]
    assert h.rendezvous_lost is None and h.changed and list(h.members) == [HOST]
    # the dropped devices join again, under the same names
    assert h.handle(sm.MemberJoined(A, "alpha", key(A), True))[1] == sm.Send(A, admitted_frame("alpha"))


@host_case(H.FORMING, sm.Abort, H.FAILED)
def abort_while_forming_tells_the_members(h, fire):
    failure(fire(sm.Abort("KeyError('x')")), "internal error: KeyError('x')", None, told=(A, B))


@host_case(H.FORMING, sm.Close, H.CLOSED, members=(A,), pending=(C,))
def close_while_forming(h, fire):
    r = "the host closed the session"
    assert fire(sm.Close(r)) == [sm.Trace("session_closed", {"reason": r}), sm.FailRequests(r, None),
                                 sm.CloseLink(C, r), sm.Send(A, cf.SessionClosed(r)), sm.CloseLink(A, r)]
    assert not h.pending  # a pending device is not a member: it is not told to forget the session


@host_case(H.FORMING, sm.Close, H.CLOSED, members=(A,), pending=(C,))
def daemon_stops_while_forming(h, fire):
    r = "the host's daemon stopped"
    assert fire(sm.Close(r, final=False)) == [sm.Trace("session_closed", {"reason": r}), sm.FailRequests(r, None),
                                              sm.CloseLink(C, r), sm.CloseLink(A, r)]  # no session_closed frame


# ---- host: planning -----------------------------------------------------------------------------
@host_case(H.PLANNING, sm.MemberJoined, H.PLANNING)
def join_while_planning_a_full_session_is_denied(h, fire):
    out = fire(sm.MemberJoined(C, "gamma", key(C), trusted=True))
    assert out == [sm.Send(C, cf.Denied("the session is already complete", code=SESSION_COMPLETE)), sm.CloseLink(C, "")]
    assert C not in h.members


@host_case(H.PLANNING, sm.Decision, H.PLANNING, pending=(C,))
def admit_after_the_session_filled(h, fire):
    out = fire(sm.Decision(C, admit=True))
    assert out == [sm.Send(C, cf.Denied("the session became complete while this device waited", code=SESSION_COMPLETE)),
                   sm.CloseLink(C, "")]
    assert C not in h.members and not h.pending


@host_case(H.PLANNING, sm.PendingTimedOut, H.PLANNING, pending=(C,))
def pending_times_out_while_planning(h, fire):
    out = fire(sm.PendingTimedOut(C, 2.5))
    assert out == [sm.Send(C, cf.Denied("the host did not admit this device within 2.5 s", code=ADMIT_TIMEOUT)), sm.CloseLink(C, "")]


@host_case(H.PLANNING, sm.Planned, H.LOADING)
def planned_distributes_epoch_1(h, fire):
    ev = planned(("beta", HOST_NAME, "alpha"), head="beta", seq=h.plan_seq)
    out = fire(ev)
    assert out == [sm.Trace("plan", {"plan": ev.plan, "epoch": 1}), sm.DistributePlan(ev, epoch=1, replan=False)]
    assert h.ring_order == [B, HOST, A] and h.head().peer_id == B and h.planned == ev and h.epoch == 1
    assert not any(e.ready for e in h.members.values())


@host_case(H.PLANNING, sm.Planned, H.LOADING)
def a_member_without_blocks_is_told_to_stand_by(h, fire):
    ev = planned((HOST_NAME, "alpha"), head=HOST_NAME, seq=h.plan_seq, standby=("beta",))
    out = fire(ev)
    assert out == [sm.Trace("plan", {"plan": ev.plan, "epoch": 1}), sm.DistributePlan(ev, epoch=1, replan=False),
                   sm.Send(B, cf.Standby(epoch=1))]
    assert h.ring_order == [HOST, A] and B in h.members
    load_all(h)
    assert h.state == H.READY  # the ring is ready without the standby


@host_case(H.PLANNING, sm.PlanFailed, H.FAILED)
def no_plan_fits_at_formation(h, fire):
    out = fire(sm.PlanFailed("Device 'alpha' cannot hold one block."))
    reason = ("No plan fits this fleet: Device 'alpha' cannot hold one block. To try again, run `kafila-ctl leave` on "
              "the host and host the model again with settings that fit (`kafila-ctl host`); the members then join "
              "its new code.")
    failure(out, reason, None, told=(A, B))
    assert h.error == reason


@host_case(H.PLANNING, cf.Capability, H.PLANNING)
def capability_again_while_planning(h, fire):
    assert fire(sm.FrameFrom(A, cap_frame(2 << 30))) == []
    assert h.members[A].capability["memory_bytes"] == 2 << 30


@host_case(H.PLANNING, sm.MemberLost, H.RECOVERING)
def member_lost_while_planning(h, fire):
    out = fire(sm.MemberLost(A, "the link to alpha broke"))
    lost(out, h, A, "alpha", "the link to alpha broke", [HOST, B])


@host_case(H.PLANNING, cf.Leaving, H.RECOVERING)
def leaving_while_planning(h, fire):
    out = fire(sm.FrameFrom(B, cf.Leaving("its daemon is shutting down")))
    lost(out, h, B, "beta", "it is leaving: its daemon is shutting down", [HOST, A])
    assert sm.CloseLink(B, "") in out


@host_case(H.PLANNING, cf.Failed, H.RECOVERING)
def member_failed_while_planning(h, fire):
    lost(fire(sm.FrameFrom(A, cf.Failed("oom"))), h, A, "alpha", "it failed to load its stage: oom", [HOST, B])


@host_case(H.PLANNING, sm.RendezvousLost, H.RECOVERING, pending=(C,))
def rendezvous_lost_while_planning(h, fire):
    first = h.plan_seq
    lost_with_the_rendezvous(fire(sm.RendezvousLost("gone.")), h, "gone.", [A, B], survivors=[HOST], pending=(C,))
    assert h.plan_seq == first + 1
    # the planner's answer to the formation request names the lost members: stale
    assert h.handle(planned((HOST_NAME, "alpha", "beta"), HOST_NAME, first)) == [] and h.state == H.RECOVERING


@host_case(H.PLANNING, sm.RendezvousLost, H.PLANNING, expected=1, members=())
def rendezvous_lost_while_planning_alone(h, fire):
    assert fire(sm.RendezvousLost("eof")) == [sm.Trace("rendezvous_lost", {"reason": "eof"})]  # nothing to re-form


@host_case(H.PLANNING, sm.RendezvousBack, H.PLANNING)
def rendezvous_back_while_planning(h, fire):
    assert fire(sm.RendezvousBack(1)) == [sm.Trace("rendezvous_reconnected", {"attempts": 1})]
    assert h.rendezvous_lost is None and list(h.members) == [HOST, A, B]


@host_case(H.PLANNING, sm.MemberJoined, H.RECOVERING, control_down=(A,))
def member_back_after_an_outage_while_planning(h, fire):
    """A race (walk_host ``control_down``): alpha's join was handled after the rendezvous went, and its
    ctl circuit closed while it was down, so alpha stayed in the roster; the session filled and planned."""
    assert h.members[A].control_down and h.members[A].capability and h.plan_seq == 1
    rejoined(fire(sm.MemberJoined(A, "alpha", key(A), True)), h, A, survivors=[HOST, B])
    assert h.plan_seq == 2  # the formation plan's answer will be stale


@host_case(H.PLANNING, sm.Abort, H.FAILED)
def abort_while_planning(h, fire):
    failure(fire(sm.Abort("x")), "internal error: x", None, told=(A, B))


@host_case(H.PLANNING, sm.Close, H.CLOSED)
def close_while_planning(h, fire):
    assert fire(sm.Close("bye")) == [sm.Trace("session_closed", {"reason": "bye"}), sm.FailRequests("bye", None),
                                     sm.Send(A, cf.SessionClosed("bye")), sm.Send(B, cf.SessionClosed("bye")),
                                     sm.CloseLink(A, "bye"), sm.CloseLink(B, "bye")]


# ---- host: loading ------------------------------------------------------------------------------
@host_case(H.LOADING, sm.MemberJoined, H.LOADING)
def join_while_loading_a_full_session_is_denied(h, fire):
    assert fire(sm.MemberJoined(C, "gamma", key(C), True))[0] == sm.Send(C, cf.Denied("the session is already complete", code=SESSION_COMPLETE))


@host_case(H.LOADING, sm.Decision, H.LOADING, pending=(C,))
def deny_while_loading(h, fire):
    assert fire(sm.Decision(C, admit=False)) == [sm.Send(C, cf.Denied("the host denied this device", code=DENIED)),
                                                 sm.CloseLink(C, "")]


@host_case(H.LOADING, sm.PendingTimedOut, H.LOADING, pending=(C,))
def pending_times_out_while_loading(h, fire):
    assert fire(sm.PendingTimedOut(C, 1))[1] == sm.CloseLink(C, "")


@host_case(H.LOADING, cf.Ready, H.LOADING)
def first_ready(h, fire):
    assert fire(sm.FrameFrom(A, ready_frame(epoch=1))) == []
    assert h.members[A].ready and h.members[A].load == {"fetched_bytes": 1000, "cached_bytes": 24, "load_s": 0.5,
                                                        "edges": [{"from": "x", "path": "direct"}]}


@host_case(H.LOADING, cf.Ready, H.LOADING)
def ready_of_an_earlier_plan_is_ignored(h, fire):
    assert fire(sm.FrameFrom(A, ready_frame(epoch=0))) == [] and not h.members[A].ready


@host_case(H.LOADING, cf.Ready, H.READY)
def last_ready_forms_the_session(h, fire):
    h.handle(sm.OwnStageLoaded(dict(LOAD), 1))
    h.handle(sm.FrameFrom(A, ready_frame()))
    assert fire(sm.FrameFrom(B, cf.Ready())) == [sm.Formed()]  # a Ready without epoch (an older member) counts
    assert h.reforms == 0


@host_case(H.LOADING, cf.Ready, H.RECOVERING)
def last_ready_plans_in_a_member_that_joined_meanwhile(h, fire):
    rejoin_after_loss(h)
    h.handle(sm.RingFailed(None, "alpha stopped", 2))
    replan(h)  # epoch 3 over host + alpha; a third member joins while it loads
    h.handle(sm.MemberJoined(C, "gamma", key(C), trusted=True))
    assert h.handle(sm.FrameFrom(C, cap_frame())) == [] and h.state == H.LOADING
    h.handle(sm.OwnStageLoaded(dict(LOAD), 3))
    out = fire(sm.FrameFrom(A, ready_frame(3)))
    assert out[0] == sm.Formed() and order_of(out[1]) == [HOST, A, C] and len(out) == 2


@host_case(H.LOADING, sm.OwnStageLoaded, H.LOADING)
def own_stage_first(h, fire):
    assert fire(sm.OwnStageLoaded(dict(LOAD), 1)) == []
    assert h.members[HOST].ready and h.members[HOST].load == LOAD


@host_case(H.LOADING, sm.OwnStageLoaded, H.READY)
def own_stage_last(h, fire):
    h.handle(sm.FrameFrom(A, ready_frame()))
    h.handle(sm.FrameFrom(B, ready_frame()))
    assert fire(sm.OwnStageLoaded(dict(LOAD), 1)) == [sm.Formed()]


@host_case(H.LOADING, sm.OwnStageLoaded, H.RECOVERING)
def own_stage_last_plans_in_a_member_that_joined_meanwhile(h, fire):
    rejoin_after_loss(h)
    h.handle(sm.RingFailed(None, "alpha stopped", 2))
    replan(h)
    h.handle(sm.MemberJoined(C, "gamma", key(C), trusted=True))
    h.handle(sm.FrameFrom(C, cap_frame()))
    h.handle(sm.FrameFrom(A, ready_frame(3)))
    out = fire(sm.OwnStageLoaded(dict(LOAD), 3))
    assert out[0] == sm.Formed() and order_of(out[1]) == [HOST, A, C]


@host_case(H.LOADING, cf.Edges, H.LOADING)
def edges_while_loading(h, fire):
    assert fire(sm.FrameFrom(A, cf.Edges([{"to": "beta", "path": "direct"}]))) == [sm.EdgesChanged("alpha")]
    assert h.members[A].load["edges"] == [{"to": "beta", "path": "direct"}]


@host_case(H.LOADING, cf.Capability, H.LOADING)
def capability_while_loading_waits(h, fire):
    assert fire(sm.FrameFrom(B, cap_frame(1 << 30))) == [] and h.members[B].capability["memory_bytes"] == 1 << 30


@host_case(H.LOADING, cf.Failed, H.RECOVERING)
def member_failed_to_load(h, fire):
    lost(fire(sm.FrameFrom(A, cf.Failed("out of memory"))), h, A, "alpha", "it failed to load its stage: out of memory",
         [HOST, B])


#: what kafilad/node/serving/stagehost.py `build_failure` says (issue 21 item 3)
ALPHA_CANNOT_BUILD = ("Member alpha could not build its stage (blocks [2, 4)) of this llama model: Weights for stage "
                      "[2, 4) head=False do not fit the model.")
HOST_CANNOT_BUILD = f"Member {HOST_NAME} could not build its stage (blocks [0, 2) and the head) of this llama model: x."


@host_case(H.LOADING, cf.Failed, H.FAILED)
def member_whose_stage_cannot_build_fails_the_session(h, fire):
    """Issue 21 item 3: a replan would fail the same way and the member would rejoin and fail again
    (the trial flapped between loading and recovering until `leave`)."""
    out = fire(sm.FrameFrom(A, cf.Failed(ALPHA_CANNOT_BUILD, code=cf.FAILED_STAGE_BUILD)))
    reason = sm.stage_build_failed(ALPHA_CANNOT_BUILD)
    failure(out, reason, "alpha", told=(A, B))
    assert not [a for a in out if isinstance(a, sm.MakePlan)] and not h.lost
    assert reason.startswith(ALPHA_CANNOT_BUILD[:-1] + ". ") and "`kafila-ctl leave` on the host" in reason
    assert h.error == reason and h.culprit == "alpha"


@host_case(H.LOADING, sm.OwnStageFailed, H.FAILED)
def own_stage_cannot_build(h, fire):
    failure(fire(sm.OwnStageFailed(HOST_CANNOT_BUILD, 1)), sm.stage_build_failed(HOST_CANNOT_BUILD), HOST_NAME,
            told=(A, B))


@host_case(H.LOADING, sm.OwnStageFailed, H.LOADING)
def own_stage_of_an_earlier_plan_cannot_build(h, fire):
    assert fire(sm.OwnStageFailed(HOST_CANNOT_BUILD, 0)) == [] and h.error is None


@host_case(H.LOADING, cf.Leaving, H.RECOVERING)
def leaving_while_loading(h, fire):
    lost(fire(sm.FrameFrom(A, cf.Leaving("bye"))), h, A, "alpha", "it is leaving: bye", [HOST, B])
    assert h.lost[A].left  # shown as "left", not "lost" (a new user's report)


@host_case(H.LOADING, cf.RingBroken, H.RECOVERING)
def ring_broken_while_loading(h, fire):
    out = fire(sm.FrameFrom(A, cf.RingBroken(reason="the ring edge to beta broke", member="beta", epoch=1)))
    ring_broke(out, "the ring edge to beta broke (reported by alpha)", "beta", [HOST, A, B])
    assert h.reforms == 1 and h.error == "the ring edge to beta broke (reported by alpha)" and h.culprit == "beta"


@host_case(H.LOADING, cf.RingBroken, H.LOADING)
def ring_broken_of_an_earlier_plan_is_ignored(h, fire):
    assert fire(sm.FrameFrom(A, cf.RingBroken(reason="old ring", member=None, epoch=0))) == [] and h.reforms == 0


@host_case(H.LOADING, cf.RingBroken, H.FAILED)
def ring_breaks_once_too_often_while_re_forming(h, fire):
    for _ in range(MAX_REFORMS):
        h.handle(sm.RingFailed("beta", "beta stopped", h.epoch))
        replan(h)
    assert h.state == H.LOADING and h.reforms == MAX_REFORMS and h.epoch == MAX_REFORMS + 1
    out = fire(sm.FrameFrom(A, cf.RingBroken("no path to beta", "beta", epoch=h.epoch)))
    failure(out, f"no path to beta (reported by alpha); the ring broke {MAX_REFORMS + 1} times in a row while "
            "re-forming", "beta", told=(A, B))


@host_case(H.LOADING, sm.MemberLost, H.RECOVERING)
def member_lost_while_loading(h, fire):
    lost(fire(sm.MemberLost(B, "it left the rendezvous")), h, B, "beta", "it left the rendezvous", [HOST, A])


@host_case(H.LOADING, sm.MemberLost, H.LOADING, ring=(HOST_NAME, "alpha"), standby=("beta",))
def standby_lost_while_loading(h, fire):
    standby_lost(fire(sm.MemberLost(B, "timed out")), h, B, "beta", "timed out")
    load_all(h)
    assert h.state == H.READY and h.ring_order == [HOST, A]


@host_case(H.LOADING, cf.Leaving, H.LOADING, ring=(HOST_NAME, "alpha"), standby=("beta",))
def standby_leaving_while_loading(h, fire):
    standby_lost(fire(sm.FrameFrom(B, cf.Leaving("bye"))), h, B, "beta", "it is leaving: bye")


@host_case(H.LOADING, cf.Failed, H.LOADING, ring=(HOST_NAME, "alpha"), standby=("beta",))
def standby_failed_while_loading(h, fire):
    standby_lost(fire(sm.FrameFrom(B, cf.Failed("oom"))), h, B, "beta", "it failed to load its stage: oom")


@host_case(H.LOADING, sm.RingFailed, H.RECOVERING)
def own_stage_cannot_join_the_ring(h, fire):
    ring_broke(fire(sm.RingFailed(None, "no path to alpha", 1)), "no path to alpha", None, [HOST, A, B])


@host_case(H.LOADING, sm.RingFailed, H.LOADING)
def own_ring_failure_of_an_earlier_plan_is_ignored(h, fire):
    assert fire(sm.RingFailed(None, "old", 0)) == []


@host_case(H.LOADING, sm.RingFailed, H.FAILED)
def own_ring_fails_once_too_often(h, fire):
    for _ in range(MAX_REFORMS):
        h.handle(sm.RingFailed(None, "no path", None))  # no epoch: the current plan's
        replan(h)
    failure(fire(sm.RingFailed(None, "no path", None)),
            f"no path; the ring broke {MAX_REFORMS + 1} times in a row while re-forming", None, told=(A, B))


@host_case(H.LOADING, sm.RendezvousLost, H.RECOVERING)
def rendezvous_lost_while_loading(h, fire):
    h.handle(sm.FrameFrom(A, ready_frame()))
    lost_with_the_rendezvous(fire(sm.RendezvousLost("eof", relayed_edges=("alpha -> beta",))), h, "eof", [A, B],
                             survivors=[HOST])
    assert set(h.lost) == {A, B} and h.culprit is None


@host_case(H.LOADING, sm.RendezvousLost, H.LOADING, expected=1, members=())
def rendezvous_lost_while_loading_alone(h, fire):
    assert fire(sm.RendezvousLost("eof")) == [sm.Trace("rendezvous_lost", {"reason": "eof"})]  # nothing to re-form


@host_case(H.LOADING, sm.RendezvousBack, H.LOADING)
def rendezvous_back_while_loading(h, fire):
    assert fire(sm.RendezvousBack(4)) == [sm.Trace("rendezvous_reconnected", {"attempts": 4})]
    assert h.epoch == 1 and not h.lost


@host_case(H.LOADING, sm.MemberJoined, H.RECOVERING)
def member_back_after_an_outage_while_loading(h, fire):
    load_all(h)
    through_an_outage(h)  # the ring served through it; then it broke and re-forms with the same members
    h.handle(sm.RingFailed("beta", "beta stopped", 1))
    replan(h)
    assert h.state == H.LOADING and h.epoch == 2 and h.members[A].control_down
    rejoined(fire(sm.MemberJoined(A, "alpha", key(A), True)), h, A, survivors=[HOST, B])


@host_case(H.LOADING, sm.Abort, H.FAILED)
def abort_while_loading(h, fire):
    failure(fire(sm.Abort("x")), "internal error: x", None, told=(A, B))


@host_case(H.LOADING, sm.Close, H.CLOSED)
def close_while_loading(h, fire):
    out = fire(sm.Close("bye"))
    assert traces(out, "session_closed") and not traces(out, "session_failed")
    assert out[2:] == [sm.Send(A, cf.SessionClosed("bye")), sm.Send(B, cf.SessionClosed("bye")),
                       sm.CloseLink(A, "bye"), sm.CloseLink(B, "bye")]


# ---- the row tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", HOST_ROWS.cases, ids=lambda c: c.id)
def test_host_row(case):
    HOST_ROWS.run(case)


#: Allowed by the table but never taken by the machine (listed so that the table and this file change
#: together): none in these states.
HOST_UNREACHABLE: set = set()


def test_every_row_has_a_case():
    cases, table = HOST_ROWS.pairs()
    assert cases == table


def test_every_allowed_transition_is_reached_by_a_case():
    cases, table = HOST_ROWS.triples()
    assert HOST_UNREACHABLE <= table and not HOST_UNREACHABLE & cases
    assert cases == table - HOST_UNREACHABLE


def test_the_tables_name_every_state_and_the_rows_are_split_between_two_modules():
    assert set(HOST_TABLE) == set(sm.HostState) and set(MEMBER_TABLE) == set(sm.MemberState)
    assert all(to in sm.HostState for row in HOST_TABLE.values() for tos in row.values() for to in tos)
    assert all(to in sm.MemberState for row in MEMBER_TABLE.values() for tos in row.values() for to in tos)
    assert set(HOST_FORMATION_STATES) | set(HOST_SERVING_STATES) == set(sm.HostState)
    assert not set(HOST_FORMATION_STATES) & set(HOST_SERVING_STATES)


# ---- Reassess (issue 22 item 5): ignored while the session forms; the plan under way counts it --------
@host_case(H.FORMING, sm.Reassess, H.FORMING)
def reassess_while_forming_is_ignored(h, fire):
    assert fire(sm.Reassess("alpha", "x")) == [] and h.plan_seq == 0


@host_case(H.PLANNING, sm.Reassess, H.PLANNING)
def reassess_while_planning_is_ignored(h, fire):
    seq = h.plan_seq
    assert fire(sm.Reassess("alpha", "x")) == [] and h.plan_seq == seq


@host_case(H.LOADING, sm.Reassess, H.LOADING)
def reassess_while_loading_is_ignored(h, fire):
    epoch = h.epoch
    assert fire(sm.Reassess("alpha", "x")) == [] and h.epoch == epoch

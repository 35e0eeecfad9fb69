"""A member's side of a session as a pure state machine (proto_spec 05 §2; DESIGN §3 steps 1-2, §6).

See kafilad/proto/session.py for the states, the conventions and the host's machine.
"""

from __future__ import annotations

from typing import Optional

from kafilad.errors import DENIED
from kafilad.proto import control as cf
from kafilad.proto.session_events import (
    Abort, CapabilitySent, Close, CloseLink, FailRequests, ForgetSession, HostLinkLost, JoinAccepted, JoinFailed,
    LoadFailed, MemberState, Refused, RendezvousLost, RingFailed, Send, SessionEnded, StageLoaded, StandBy, StartLoad,
    Trace, stage_build_failed,
)
from kafilad.proto.session_machine import _Machine

M = MemberState
#: the reason of the host's `denied` after `kafila-ctl deny` (kafilad/proto/session.py `_on_Decision`)
DENIED_BY_HOST = "the host denied this device"
_MEMBER_FAILURES = {HostLinkLost: {M.FAILED}, cf.SessionFailed: {M.FAILED}, SessionEnded: {M.FAILED},
                    cf.SessionClosed: {M.CLOSED},
                    RendezvousLost: {M.FAILED}, Abort: {M.FAILED}, Close: {M.CLOSED}}
MEMBER_TABLE: dict = {
    M.JOINING: {cf.Pending: {M.PENDING}, cf.Admitted: {M.ADMITTED}, cf.Denied: {M.FAILED}, JoinFailed: {M.FAILED},
                **_MEMBER_FAILURES},
    M.PENDING: {cf.Pending: {M.PENDING}, cf.Admitted: {M.ADMITTED}, cf.Denied: {M.FAILED}, JoinFailed: {M.FAILED},
                **_MEMBER_FAILURES},
    M.ADMITTED: {CapabilitySent: {M.MEASURED}, **_MEMBER_FAILURES},
    M.MEASURED: {cf.PlanFrame: {M.LOADING}, cf.Standby: {M.STANDBY}, **_MEMBER_FAILURES},
    M.LOADING: {StageLoaded: {M.LOADING, M.READY}, LoadFailed: {M.FAILED}, RingFailed: {M.LOADING, M.FAILED},
                cf.PlanFrame: {M.LOADING}, cf.Standby: {M.STANDBY}, **_MEMBER_FAILURES},
    M.READY: {**_MEMBER_FAILURES, RendezvousLost: {M.READY, M.FAILED}, HostLinkLost: {M.READY, M.FAILED},
              RingFailed: {M.READY, M.FAILED}, cf.PlanFrame: {M.LOADING, M.READY}, cf.Standby: {M.STANDBY}},
    # the events of a stage dropped on the way in (its load or ring tasks ending late) are stale here
    M.STANDBY: {cf.PlanFrame: {M.LOADING, M.STANDBY}, cf.Standby: {M.STANDBY}, StageLoaded: {M.STANDBY},
                LoadFailed: {M.STANDBY}, RingFailed: {M.STANDBY}, **_MEMBER_FAILURES},
    M.FAILED: {Close: {M.CLOSED}},
    M.CLOSED: {},
}


class MemberMachine(_Machine):
    """A member's side of a session (proto_spec 05 §2; DESIGN §3 steps 1-2, §6)."""

    TABLE = MEMBER_TABLE

    def __init__(self, name: str = "NAME"):
        super().__init__(MemberState.JOINING)
        #: this device's name, for the sentences that tell its user what to ask the host
        self.name = name
        self.admitted: Optional[cf.Admitted] = None
        self.plan: Optional[cf.PlanFrame] = None
        self.capability: Optional[dict] = None
        self.rendezvous_lost: Optional[str] = None
        self.ring_broken: Optional[RingFailed] = None
        #: the rendezvous is gone but both ring edges are direct: the stage serves on (DESIGN §2)
        self.keeps_serving = False
        #: the epoch of the plan that left this member on standby (None: not on standby)
        self.standby_epoch: Optional[int] = None

    def handle(self, event) -> list:
        """Apply one event (a typed host frame, or a local event); return the actions.

        Raises:
            LocalProtocolError: a local event this state does not take (a driver bug).
        """
        row = self._row(event)
        if row is None:
            return []
        if row == "peer-error":
            return [CloseLink("", f"the host sent an unexpected {event.T} frame while this device was "
                                  f"{self.state}")]
        name = event.T if isinstance(event, cf.ControlFrame) else type(event).__name__
        return getattr(self, "_on_" + name)(event, row)

    def _on_pending(self, ev, row) -> list:
        self._enter(MemberState.PENDING, row)
        return []

    def _on_admitted(self, ev: cf.Admitted, row) -> list:
        self.admitted = ev
        self._enter(MemberState.ADMITTED, row)
        return [JoinAccepted()]

    def _on_denied(self, ev: cf.Denied, row) -> list:
        if ev.code == DENIED:  # `kafila-ctl deny`: it may try again, if the host agrees
            self.error = (f"The host refused this device with `kafila-ctl deny`; to try again, run `kafila-ctl join` "
                          f"again and ask the host to run `kafila-ctl admit {self.name}`.")
        else:
            self.error = f"The host refused this device: {ev.reason.rstrip('.')}."
        self._enter(MemberState.FAILED, row)
        return [Refused(self.error, ev.code)]

    def _on_JoinFailed(self, ev: JoinFailed, row) -> list:
        self.error = ev.message
        self._enter(MemberState.FAILED, row)
        return []

    def _on_CapabilitySent(self, ev: CapabilitySent, row) -> list:
        self.capability = dict(ev.capability)
        self._enter(MemberState.MEASURED, row)
        return []

    def _on_plan(self, ev: cf.PlanFrame, row) -> list:
        """A plan; in loading or ready, a replan: the driver replaces the stage (cached tensors are re-used).

        A plan of an epoch older than the one held (the plan's, or standing by's) is stale: the host
        sent it before a replan and it arrived after the replan's (proto_spec 05 §2); it is ignored.
        """
        held = self.plan.epoch if self.plan is not None else self.standby_epoch
        if held is not None and ev.epoch is not None and ev.epoch < held:
            return []
        self.plan = ev
        self.ring_broken = None
        self.standby_epoch = None
        self._enter(MemberState.LOADING, row)
        return [StartLoad(ev)]

    def _on_standby(self, ev: cf.Standby, row) -> list:
        """The plan of `ev.epoch` leaves this member without blocks: drop any stage, hold none."""
        self.plan = None
        self.ring_broken = None
        self.standby_epoch = ev.epoch
        self.changed = True
        self._enter(MemberState.STANDBY, row)
        return [StandBy(ev.epoch)]

    def _on_StageLoaded(self, ev: StageLoaded, row) -> list:
        if self.plan is None or ev.epoch != (self.plan.epoch or 0):
            return []  # the stage of a plan the host has replaced since
        self._enter(MemberState.READY, row)
        return [Send("", cf.Ready(epoch=ev.epoch, **{k: ev.load[k] for k in ("fetched_bytes", "cached_bytes",
                                                                             "load_s", "edges") if k in ev.load}))]

    def _on_LoadFailed(self, ev: LoadFailed, row) -> list:
        """The stage did not load: the host is told why. A stage that could not be built
        (cf.FAILED_STAGE_BUILD) fails the session on the host (proto_spec 05 §2.3), so this device
        forgets it (no rejoin: it would fail the same way) and its error is the whole sentence."""
        if self.state == MemberState.STANDBY:
            return []  # the load of a plan the host has replaced with standing by
        if ev.code == cf.FAILED_STAGE_BUILD:
            out = self._fail(stage_build_failed(ev.reason) + ".", None, row)
            return out + [Send("", cf.Failed(ev.reason, code=ev.code)), ForgetSession()]
        return self._fail(ev.reason, None, row) + [Send("", cf.Failed(ev.reason))]

    def _on_RingFailed(self, ev: RingFailed, row) -> list:
        if self.state == MemberState.STANDBY:
            return []  # the ring of a dropped stage
        epoch = self.plan.epoch if self.plan is not None else None
        if ev.epoch is not None and epoch is not None and ev.epoch != epoch:
            return []  # the ring of an earlier plan
        self.ring_broken = ev
        if self.rendezvous_lost is not None and self.state == MemberState.READY:
            return self._fail(f"{ev.reason} (the connection to the rendezvous was lost: "
                              f"{self.rendezvous_lost.rstrip('.')})", ev.member, row)
        self.changed = True
        return [Send("", cf.RingBroken(reason=ev.reason, member=ev.member, epoch=epoch))]

    def _on_HostLinkLost(self, ev: HostLinkLost, row) -> list:
        if self.state == MemberState.READY and self.keeps_serving and self.ring_broken is None:
            self.changed = True
            return []  # the ring stage keeps serving without the ctl link (DESIGN §2)
        if self.ring_broken is not None:
            return self._fail(self.ring_broken.reason, self.ring_broken.member, row)
        if self.state in (MemberState.JOINING, MemberState.PENDING):
            msg = f"The host closed the link before admitting this device: {ev.reason}."
            self.error = msg
            self._enter(MemberState.FAILED, row)
            return [Refused(msg)]
        return self._fail(f"the link to the host closed: {ev.reason}", None, row)

    def _on_RendezvousLost(self, ev: RendezvousLost, row) -> list:
        first = self.rendezvous_lost is None
        self.rendezvous_lost = self.rendezvous_lost or ev.reason
        lost = f"the connection to the rendezvous was lost ({self.rendezvous_lost.rstrip('.')})"
        if self.state == MemberState.READY and ev.edges_direct and self.ring_broken is None:
            self.keeps_serving = True
            self.changed = True
            return [Trace("rendezvous_lost", {"reason": ev.reason, "serving": True})] if first else []
        if self.state in (MemberState.JOINING, MemberState.PENDING):
            self.error = f"Cannot join: {lost}."
            self._enter(MemberState.FAILED, row)
            return [Refused(self.error)]
        return self._fail(f"{lost} while this device was {self.state}" if self.state != MemberState.READY else
                          f"{lost}, and this device's ring edges were relayed through it", None, row)

    def _on_session_failed(self, ev: cf.SessionFailed, row) -> list:
        """The host's session failed (it plans nothing more, proto_spec 05 §2.3): this device is in no
        session any more, so it forgets it (no rejoin) and its status says why."""
        reason = (ev.reason or "the host reported a failure").rstrip(".")
        return self._fail(f"The session failed on the host: {reason}.", None, row, host=True) + [ForgetSession()]

    def _on_SessionEnded(self, ev: SessionEnded, row) -> list:
        if self.state in (MemberState.JOINING, MemberState.PENDING):
            self.error = f"Cannot join: {ev.reason}."
            self._enter(MemberState.FAILED, row)
            return [Refused(self.error)]
        return self._fail(ev.reason, ev.member, row)

    def _fail(self, reason: str, member: Optional[str], row, host: bool = False) -> list:
        self.error = reason
        self._enter(MemberState.FAILED, row)
        return [FailRequests(reason, member if member is not None else ("host" if host else None)),
                Trace("session_failed", {"reason": reason})]

    def _on_Abort(self, ev: Abort, row) -> list:
        return self._fail(f"internal error: {ev.reason}", None, row) + [Send("", cf.Failed(ev.reason))]

    def _on_session_closed(self, ev: cf.SessionClosed, row) -> list:
        self.error = ev.reason or "the host closed the session"
        self._enter(MemberState.CLOSED, row)
        return [FailRequests(self.error, "host"), ForgetSession(), CloseLink("", "")]

    def _on_Close(self, ev: Close, row) -> list:
        was = self.state
        if was in (MemberState.JOINING, MemberState.PENDING):  # what the interrupted join says
            self.error = "This device left before the host admitted it."
        self._enter(MemberState.CLOSED, row)
        out = [Send("", cf.Leaving(ev.reason))] if was not in (MemberState.FAILED,) else []
        return out + [FailRequests(ev.reason, None), CloseLink("", ev.reason)]

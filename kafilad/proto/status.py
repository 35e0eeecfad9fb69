"""The status snapshot as types (issue 25 item 1): what a daemon shows of itself and its session.

One snapshot feeds every reader: `kafila-ctl status --json` and `watch` (the control socket sends
``NodeStatus.to_json()``, proto_spec 05 §4), the web page's whitelist (kafilad/control/web.py
``public_status``) and GET /metrics (kafilad/control/metrics.py). It is built in one place,
kafilad/node/session/status.py, from the session machines' fields; the restarting daemon's two
statuses (reconnecting, restoring) come from kafilad/proto/comeback.py.

Typed at the levels a reader decides on (the node, the session, a member row, the request
counts); the nested documents that are shown as they are (the plan, edges, fleet, schedule,
speculation, prompt cache, the last generation) stay JSON dicts, each built by its owner.

The JSON document keeps the shape it had as a dict: the node's keys, then the session's (whose
``rendezvous``, the connection's state, replaces the node's rendezvous URL); ``session`` is the
session id (None when idle); ``reconnecting`` / ``restoring`` appear only while they apply.
``from_json`` reads such a document back (missing keys read as None; unknown keys are ignored).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs

#: the session state of a daemon in no session
IDLE = "idle"


def _rows(cls, rows) -> tuple:
    """Member rows of class `cls` from a document's "members" (rows already typed kept; others skipped)."""
    return tuple(r if isinstance(r, MemberRow) else cls.from_json(r) for r in rows or ()
                 if isinstance(r, (dict, MemberRow)))


def _from_json(cls, d: dict, **override) -> Any:
    """`cls` from the keys of `d` that are its fields (the rest ignored), then `override`."""
    names = {f.name for f in attrs.fields(cls)}
    return cls(**{**{k: v for k, v in d.items() if k in names}, **override})


def _to_json(obj, omit_none: tuple = ()) -> dict:
    """`obj`'s fields as JSON: typed values by their own `to_json`, tuples as lists; the fields
    named in `omit_none` left out while None."""
    out = {}
    for f in attrs.fields(type(obj)):
        v = getattr(obj, f.name)
        if v is None and f.name in omit_none:
            continue
        if isinstance(v, tuple) and v and hasattr(v[0], "to_json"):
            v = [x.to_json() for x in v]
        elif isinstance(v, tuple):
            v = list(v)
        elif hasattr(v, "to_json"):
            v = v.to_json()
        out[f.name] = v
    return out


@attrs.frozen(kw_only=True)
class RequestCounts:
    """The host's admission (kafilad/node/serving/admission.py): requests running and waiting."""

    running: int = 0
    queued: int = 0
    concurrency: Optional[int] = None
    queue_limit: Optional[int] = None

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: Optional[dict]) -> Optional["RequestCounts"]:
        return _from_json(cls, d) if isinstance(d, dict) else None


@attrs.frozen(kw_only=True)
class MemberRow:
    """One member of the session as the plan places it.

    Attributes:
        blocks: its blocks [start, end) in the plan, or None (standby, lost, no plan yet).
        predicted_stage_s / measured_stage_s: the plan's decode step time of its stage and the
            median measured on the last request (None where not known).
    """

    name: Optional[str] = None
    peer_id: Optional[str] = None
    blocks: Optional[list] = None
    head: bool = False
    predicted_stage_s: Optional[float] = None
    measured_stage_s: Optional[float] = None

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, d: dict) -> "MemberRow":
        return _from_json(cls, d)


@attrs.frozen(kw_only=True)
class HostMemberRow(MemberRow):
    """A member as the host sees it: its link, its report and the check of it (issue 22 item 5).

    Attributes:
        lost / left: why it was lost, or that it left (None otherwise).
        control: "up" / "down" for a member's control link, None for the host's own row.
        progress: "loading" while the session loads and it is not ready.
        capability: its report (proto_spec 05 §1); ``reported`` its time figures, ``planned_with``
            those the planner used, ``check`` the measured/predicted verdict
            (kafilad/planner/trust.py ``MemberChecks.status``), ``head_allowed`` whether it may head.
    """

    ready: bool = False
    lost: Optional[str] = None
    left: Optional[bool] = None
    standby: bool = False
    control: Optional[str] = None
    progress: Optional[str] = None
    capability: Optional[dict] = None
    reported: Optional[dict] = None
    planned_with: Optional[dict] = None
    check: Optional[dict] = None
    head_allowed: bool = False
    nat_class: Optional[str] = None


@attrs.frozen(kw_only=True)
class SessionStatus:
    """What host and member share of a session's status (kafilad/proto/session.py's states).

    Attributes:
        role: "host" or "member".
        rendezvous: the rendezvous connection: "connected", "lost", "reconnecting (...)", None.
        reconnecting / restoring: {"attempt", "next_in_s", "reason"} while the daemon retries the
            rendezvous or re-registers / rejoins its session; omitted from JSON otherwise.
        plan: the plan's JSON (kafilad/planner ``Plan.to_json``) or None.
    """

    ROLE: ClassVar[str] = ""
    OMIT_NONE: ClassVar[tuple] = ("reconnecting", "restoring")
    ROW: ClassVar[type] = MemberRow

    role: str = attrs.field(default=attrs.Factory(lambda self: self.ROLE, takes_self=True))
    session_id: Optional[str] = None
    code: Optional[str] = None
    state: str = IDLE
    error: Optional[str] = None
    members: tuple = attrs.field(default=(), converter=tuple)
    rendezvous: Optional[str] = None
    reconnecting: Optional[dict] = None
    restoring: Optional[dict] = None
    plan: Optional[dict] = None

    def to_json(self) -> dict:
        return _to_json(self, self.OMIT_NONE)

    @classmethod
    def from_json(cls, d: dict) -> "SessionStatus":
        kind = HostStatus if d.get("role") == HostStatus.ROLE else MemberStatus
        extra = {"requests": RequestCounts.from_json(d.get("requests"))} if kind is HostStatus else {}
        return _from_json(kind, d, members=_rows(kind.ROW, d.get("members")), **extra)


@attrs.frozen(kw_only=True)
class HostStatus(SessionStatus):
    """The hosted session (kafilad/node/session/host.py).

    Attributes:
        requests: admission's counts; ``pending``: devices waiting for admission [{"peer_id", "name"}].
        form_s: what the last formation took; ``epoch``: the plan's number (1 for the first).
        edges / schedule / plan_waits / prompt_cache / speculation / fleet / last_generation: their
            owners' documents (None where they do not apply: no head here, no fleet yet).
    """

    ROLE: ClassVar[str] = "host"
    ROW: ClassVar[type] = HostMemberRow

    model_id: Optional[str] = None
    expected_members: Optional[int] = None
    context: Optional[int] = None
    concurrency: Optional[int] = None
    requests: Optional[RequestCounts] = None
    pending: tuple = attrs.field(default=(), converter=tuple)
    form_s: Optional[float] = None
    last_generation: Optional[dict] = None
    fleet: Optional[dict] = None
    epoch: Optional[int] = None
    edges: tuple = attrs.field(default=(), converter=tuple)
    schedule: Optional[dict] = None
    plan_waits: Optional[dict] = None
    prompt_cache: Optional[dict] = None
    speculation: Optional[dict] = None


@attrs.frozen(kw_only=True)
class MemberStatus(SessionStatus):
    """A joined session (kafilad/node/session/member.py).

    Attributes:
        host: the host's name; ``control``: "up" / "down" for the link to it (None before it).
        blocks / head: this member's own stage [start, end) and whether it heads.
        capability: its own report; ``load``: the model load's progress.
    """

    ROLE: ClassVar[str] = "member"

    host: Optional[str] = None
    control: Optional[str] = None
    blocks: Optional[list] = None
    head: bool = False
    capability: Optional[dict] = None
    load: Optional[dict] = None


@attrs.frozen(kw_only=True)
class NodeStatus:
    """A daemon and its session: the `kafila-ctl status --json` document.

    Attributes:
        lifecycle: the daemon's own phase (kafilad/proto/lifecycle.py).
        rendezvous: the rendezvous URL it was started with (the JSON's ``rendezvous`` is the
            session's connection state while there is a session).
        http: the API's base URL, or None without the HTTP API.
        session: the session's status, or None when idle.
    """

    name: Optional[str] = None
    peer_id: Optional[str] = None
    fingerprint: Optional[str] = None
    lifecycle: Optional[str] = None
    rendezvous: Optional[str] = None
    http: Optional[str] = None
    session: Optional[SessionStatus] = None

    @property
    def state(self) -> str:
        """The session's state, "idle" without one."""
        return self.session.state if self.session is not None else IDLE

    @property
    def role(self) -> Optional[str]:
        return self.session.role if self.session is not None else None

    def to_json(self) -> dict:
        base = {"name": self.name, "peer_id": self.peer_id, "fingerprint": self.fingerprint,
                "lifecycle": self.lifecycle, "rendezvous": self.rendezvous, "http": self.http}
        if self.session is None:
            return {**base, "session": None, "state": IDLE, "members": []}
        return {**base, "session": self.session.session_id, **self.session.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "NodeStatus":
        session = SessionStatus.from_json(d) if d.get("role") in (HostStatus.ROLE, MemberStatus.ROLE) else None
        names = ("name", "peer_id", "fingerprint", "lifecycle", "http")
        return cls(**{k: d.get(k) for k in names}, rendezvous=None if session else d.get("rendezvous"),
                   session=session)


__all__ = ["IDLE", "RequestCounts", "MemberRow", "HostMemberRow", "SessionStatus", "HostStatus", "MemberStatus",
           "NodeStatus"]

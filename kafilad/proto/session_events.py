"""Events, actions and records of the session machines (kafilad/proto/session.py; proto_spec 05).

Events go into :meth:`HostMachine.handle` / :meth:`MemberMachine.handle`; actions come out for the
drivers (kafilad/node/session/host.py, member.py) to perform. All frozen attrs classes; pure.
"""

from __future__ import annotations

import enum
from typing import Optional

import attrs


class HostState(str, enum.Enum):
    STARTING = "starting"
    FORMING = "forming"
    PLANNING = "planning"
    LOADING = "loading"
    READY = "ready"
    #: a member was lost or the ring broke: requests failed, the host replans over the survivors
    RECOVERING = "recovering"
    #: the model no longer fits the members left; waits for a member to join (``error`` says what is missing)
    DEGRADED = "degraded"
    FAILED = "failed"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


class MemberState(str, enum.Enum):
    JOINING = "joining"
    PENDING = "pending"
    ADMITTED = "admitted"
    MEASURED = "measured"
    LOADING = "loading"
    READY = "ready"
    #: the plan left this member without blocks (strategy "load"): no stage, waiting for a replan
    STANDBY = "standby"
    FAILED = "failed"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


#: States in which a session is over: only Close is handled.
_OVER = (HostState.FAILED, HostState.CLOSED, MemberState.FAILED, MemberState.CLOSED)



# ---- events -----------------------------------------------------------------------------------
@attrs.frozen
class Registered:
    """The rendezvous created the session (proto_spec 03 `registered`)."""
    session_id: str


@attrs.frozen
class MemberJoined:
    """A member finished the Noise handshake on its ctl link (DESIGN §4). ``trusted``: its key is in the roster."""
    peer_id: str
    name: str
    public_key: bytes
    trusted: bool


@attrs.frozen
class Decision:
    """`kafila-ctl admit|deny` for a pending member."""
    peer_id: str
    admit: bool
    reason: str = ""


@attrs.frozen
class PendingTimedOut:
    peer_id: str
    timeout_s: float


@attrs.frozen
class OwnCapability:
    """The host measured itself (DESIGN §5.1)."""
    capability: dict


@attrs.frozen
class Reassess:
    """The driver judged member `name`'s report against its measured stage times
    (kafilad/planner/trust.py, issue 22 item 5): a ready session plans again over its live members,
    keeping the serving ring when the division does not change; any other state ignores it (a plan
    under way already counts the member as the driver now does)."""
    name: str
    reason: str


@attrs.frozen
class FrameFrom:
    """A control frame (kafilad/proto/control.py) from member ``peer_id``."""
    peer_id: str
    frame: object


@attrs.frozen
class Planned:
    """The planner's result: ``blocks`` name -> (start, end), ``head`` name, ``order`` names in ring order."""
    plan: dict
    blocks: dict
    head: str
    order: tuple
    #: the MakePlan this answers (None: the latest); an answer to an earlier request is stale
    seq: Optional[int] = None
    #: names of members the plan leaves without blocks (strategy "load"): they wait as standbys
    standby: tuple = ()


@attrs.frozen
class PlanFailed:
    reason: str
    seq: Optional[int] = None


@attrs.frozen
class OwnStageLoaded:
    load: dict
    epoch: int = 0


@attrs.frozen
class OwnStageFailed:
    """Host: its own stage of plan ``epoch`` could not be built (kafilad/errors.py StageBuildError);
    ``reason`` names this device, the architecture and what is wrong."""
    reason: str
    epoch: int = 0


@attrs.frozen
class MemberLost:
    """A member's ctl link ended, or the rendezvous said it left."""
    peer_id: str
    reason: str


@attrs.frozen
class RingFailed:
    """This daemon's ring stage broke; ``member`` is the one the failure names; ``epoch`` the plan it served."""
    member: Optional[str]
    reason: str
    epoch: Optional[int] = None


@attrs.frozen
class RendezvousLost:
    """The rendezvous connection ended (DESIGN §2). Host: ``relayed_edges`` lists "a -> b" of edges
    still relayed; member: ``edges_direct`` says both of its ring edges are direct."""
    reason: str
    relayed_edges: tuple = ()
    edges_direct: bool = False


@attrs.frozen
class JoinFailed:
    """Member: the join ended before admission (rendezvous unreachable, wrong host key...); ``message`` says why."""
    message: str


@attrs.frozen
class Abort:
    """The driver hit an internal error; the session fails with ``reason`` (the daemon lives on)."""
    reason: str


@attrs.frozen
class Close:
    """The user closes the session (`kafila-ctl leave`), or the daemon stops.

    ``final``: the session ends for good (`leave` on the host: members are told and forget it);
    False when the daemon merely stops (a restarted host re-hosts it, members rejoin).
    """
    reason: str
    final: bool = True


@attrs.frozen
class RendezvousBack:
    """The host reconnected to the rendezvous and re-registered its session (proto_spec 03 §2.5)."""
    attempts: int = 1


@attrs.frozen
class CapabilitySent:
    capability: dict


@attrs.frozen
class StageLoaded:
    load: dict
    epoch: int = 0


@attrs.frozen
class LoadFailed:
    """Member: its stage of the current plan did not load. ``code``: cf.FAILED_STAGE_BUILD when the
    stage could not be built (``reason`` is then kafilad/node/serving/stagehost.py's sentence), else None."""
    reason: str
    code: Optional[str] = None


@attrs.frozen
class HostLinkLost:
    reason: str


@attrs.frozen
class SessionEnded:
    """The rendezvous says the session is gone, or another member left it (member side)."""
    reason: str
    member: Optional[str] = None


# ---- actions ----------------------------------------------------------------------------------
@attrs.frozen
class Send:
    """Send ``frame`` on the ctl link of ``peer_id`` (member side: the host; peer_id "")."""
    peer_id: str
    frame: object


@attrs.frozen
class CloseLink:
    peer_id: str
    reason: str


@attrs.frozen
class Remember:
    """Store the member's key in the trusted roster (DESIGN §4)."""
    peer_id: str
    name: str
    public_key: bytes


@attrs.frozen
class MakePlan:
    """Run the planner over ``order`` (MemberEntry, the host first); answer with Planned/PlanFailed(seq=seq)."""
    order: tuple
    seq: int = 0


@attrs.frozen
class DistributePlan:
    """Send each remote member its `plan` frame (with ``epoch``) and load the host's own stage.
    ``replan``: stages of an earlier plan exist and are replaced (DESIGN §3, healing)."""
    planned: Planned
    epoch: int = 1
    replan: bool = False


@attrs.frozen
class StartLoad:
    """Member: fetch, verify and build the stage of this plan frame."""
    plan: object


@attrs.frozen
class StandBy:
    """Member: drop the stage of any earlier plan (its ring links, its requests) and hold none."""
    epoch: int


@attrs.frozen
class FailRequests:
    """Fail every request in flight with ``reason`` naming ``member``."""
    reason: str
    member: Optional[str]


@attrs.frozen
class Trace:
    kind: str
    fields: dict = attrs.field(factory=dict)


@attrs.frozen
class Formed:
    """Every stage is ready: the driver writes `edges` and `session_formed` trace records."""


@attrs.frozen
class EdgesChanged:
    reporter: str


@attrs.frozen
class Refused:
    """Member: the join ends before admission with this sentence. ``code``: the host's `denied` code
    (kafilad/errors.py JoinRefused) when the host refused it; "" when the join was cut (link or
    rendezvous lost), which is worth trying again."""
    message: str
    code: str = ""


@attrs.frozen
class ForgetSession:
    """Member: the host ended the session for good; stop remembering it (no rejoin after a restart)."""


@attrs.frozen
class JoinAccepted:
    """Member: admitted; the `join` command returns."""


# ---- records ----------------------------------------------------------------------------------
@attrs.define
class MemberEntry:
    """One member as the host sees it. The host's own entry has ``is_host``."""
    peer_id: str
    name: str
    public_key: bytes
    is_host: bool = False
    capability: Optional[dict] = None
    ready: bool = False
    lost: Optional[str] = None
    left: bool = False  # lost because it said `leaving` (proto_spec 05 §2.2): its user ended it on purpose
    control_down: bool = False
    load: dict = attrs.field(factory=dict)


@attrs.define
class PendingEntry:
    peer_id: str
    name: str
    public_key: bytes




def stage_build_failed(reason: str) -> str:
    """Why a session fails when a stage could not be built (issue 21 item 3; proto_spec 05 §2.3):
    the builder's sentence ``reason`` (member, architecture, what is wrong) and what to do, without a
    final period (the host's ``error``, the `session_failed` reason; the member's own error adds one)."""
    return (f"{reason.rstrip('.')}. Another division of the model would fail the same way, so the session "
            "failed: run `kafila-ctl leave` on the host and host a model whose architecture and files Kafila can run")

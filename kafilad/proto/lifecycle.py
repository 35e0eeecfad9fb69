"""The daemon's own lifecycle (issue 25 item 3): which kind of session, if any, a kafilad runs.

A pure machine (no I/O, no clock): kafilad/daemon.py ``Node`` feeds it what happened and reads
``phase``; the sessions themselves have their own machines (kafilad/proto/session.py). Phases:

- ``idle``: no session (never had one, left it, or gave up bringing it back);
- ``hosting`` / ``member``: a session runs (``kafila-ctl host`` / ``join``, or brought back);
- ``reconnecting``: a member whose session failed after admission rejoins it (``Node._rejoin``,
  README "The rendezvous restarts");
- ``restoring``: a restarted host daemon registers its remembered session again (``Node._rehost``);
- ``stopping``: the daemon shuts down; nothing starts any more (final).

Transitions (anything else leaves the phase as it is: a late event of a session already over
changes nothing)::

    idle          --Restore--> restoring      --Hosted--> hosting
    idle          --Rejoin-->  reconnecting   --Joined--> member
    idle|reconnecting|restoring --Hosted/Joined--> hosting/member   (a user's host/join)
    member        --Ended(rejoin=True)--> reconnecting
    hosting|member --Ended(rejoin=False) / Left--> idle
    reconnecting|restoring --GaveUp / Left--> idle
    any           --Stop--> stopping
"""

from __future__ import annotations

import enum
from typing import Union

import attrs

from kafilad.errors import SHUTTING_DOWN, LocalProtocolError


class Phase(enum.Enum):
    IDLE = "idle"
    HOSTING = "hosting"
    MEMBER = "member"
    RECONNECTING = "reconnecting"
    RESTORING = "restoring"
    STOPPING = "stopping"


@attrs.frozen
class Restore:
    """A restarted daemon remembers a session it hosted: it registers it again."""


@attrs.frozen
class Rejoin:
    """A restarted daemon remembers a session it was a member of: it rejoins it."""


@attrs.frozen
class Hosted:
    """A hosted session runs (registered at the rendezvous)."""


@attrs.frozen
class Joined:
    """A member session runs (admitted)."""


@attrs.frozen
class Ended:
    """The running session ended; ``rejoin``: the daemon rejoins it (a member admitted before)."""
    rejoin: bool = False


@attrs.frozen
class Left:
    """`kafila-ctl leave`: the session, or the attempt to bring it back, is given up by the user."""


@attrs.frozen
class GaveUp:
    """Bringing the remembered session back was refused for good (kafilad/proto/comeback.py
    ``rejoin_gives_up`` / ``rehost_gives_up``): the daemon forgets it."""


@attrs.frozen
class Stop:
    """The daemon shuts down (`kafila-ctl stop`, SIGTERM, SIGINT)."""


Event = Union[Restore, Rejoin, Hosted, Joined, Ended, Left, GaveUp, Stop]

_TABLE: dict[tuple[Phase, type], Phase] = {
    (Phase.IDLE, Restore): Phase.RESTORING,
    (Phase.IDLE, Rejoin): Phase.RECONNECTING,
    **{(p, Hosted): Phase.HOSTING for p in (Phase.IDLE, Phase.RECONNECTING, Phase.RESTORING)},
    **{(p, Joined): Phase.MEMBER for p in (Phase.IDLE, Phase.RECONNECTING, Phase.RESTORING)},
    (Phase.HOSTING, Ended): Phase.IDLE,
    (Phase.HOSTING, Left): Phase.IDLE,
    (Phase.MEMBER, Left): Phase.IDLE,
    (Phase.RECONNECTING, Left): Phase.IDLE,
    (Phase.RESTORING, Left): Phase.IDLE,
    (Phase.RECONNECTING, GaveUp): Phase.IDLE,
    (Phase.RESTORING, GaveUp): Phase.IDLE,
}


@attrs.define
class Lifecycle:
    """The daemon's lifecycle machine. ``phase`` is where it is; ``handle`` moves it.

    Attributes:
        phase: the current Phase.
        changed: set when ``handle`` moved the phase (the driver clears it after telling watchers).
    """

    phase: Phase = Phase.IDLE
    changed: bool = False

    def handle(self, event: Event) -> Phase:
        """Move on ``event``; returns the new phase (the same one when the event changes nothing)."""
        if self.phase == Phase.STOPPING:
            return self.phase
        if isinstance(event, Stop):
            new = Phase.STOPPING
        elif isinstance(event, Ended) and self.phase == Phase.MEMBER:
            new = Phase.RECONNECTING if event.rejoin else Phase.IDLE
        else:
            new = _TABLE.get((self.phase, type(event)), self.phase)
        if new != self.phase:
            self.phase = new
            self.changed = True
        return self.phase

    def check_may_start(self, what: str) -> None:
        """Refuse to start a session (``what``: "host", "join") while the daemon stops.

        Raises:
            LocalProtocolError: code SHUTTING_DOWN, in phase ``stopping``.
        """
        if self.phase == Phase.STOPPING:
            raise LocalProtocolError(f"The daemon is shutting down, so it starts no session ('{what}'); "
                                     "start it again once the daemon is back.", code=SHUTTING_DOWN)

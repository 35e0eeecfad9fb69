"""The pure half of a daemon's comeback with its remembered session (README "The rendezvous
restarts", docs/healing.md; issue 25 item 1): when to try again and when to give up, the comeback
record, and what status says meanwhile, as functions of errors, records and the clock's reading.
kafilad/daemon.py (``Node._rejoin``, ``Node._rehost``, ``Node.status``) drives them; the wait of a
request for a restored session is kafilad/node/session/comeback.py ``session_back``.

- ``reconnecting``: a member whose session ended with the rendezvous or its host; its daemon
  rejoins (``Node._rejoin``).
- ``restoring``: a restarted host daemon registering its remembered session again (``Node._rehost``).

A comeback record is {"code", "attempt", "at" (time.time() of the next try), "reason" (why the
session or the last try failed)}.
"""

from __future__ import annotations

from typing import Optional

import attrs

from kafilad.errors import ALREADY_IN_SESSION, DUPLICATE_PEER, JoinRefused, RendezvousRefused
from kafilad.proto.status import HostStatus, MemberStatus

RECONNECTING, RESTORING = "reconnecting", "restoring"

#: rejoin backoff (issue 8 §2): first wait and cap (s), doubling, each jittered by ±20 %; the cap is the
#: rendezvous reconnect's (kafilad/node/session/driver.py RECONNECT_MAX_S, which says why 5 s): a member
#: is back within a few seconds of the rendezvous or its host
REJOIN_FIRST_S, REJOIN_MAX_S = 1.0, 5.0
#: a rejoin refused as "unknown_session" (the rendezvous is up but the host is away: it re-registers
#: with its own backoff from 1 s after a rendezvous restart) is retried at the first wait, not doubled,
#: this many times before the doubling resumes
REJOIN_UNKNOWN_SESSION_TRIES = 20


def rejoin_delay_s(error: Exception, delay_s: float, unknown_tries: int) -> tuple[float, float, int]:
    """The wait before the next rejoin attempt after ``error`` (before jitter).

    Args:
        error: why the last attempt failed. delay_s: the doubling backoff's current wait.
        unknown_tries: "unknown_session" refusals answered at the fast cadence so far.
    Returns:
        (wait_s now, the backoff's next delay_s, the new unknown_tries). An "unknown_session"
        refusal (kafilad/errors.py RendezvousRefused; its codes: proto_spec 03 §2.3) waits REJOIN_FIRST_S and
        leaves the backoff where it was, for REJOIN_UNKNOWN_SESSION_TRIES tries; anything else
        waits ``delay_s`` and doubles it up to REJOIN_MAX_S.
    """
    if isinstance(error, RendezvousRefused) and error.code == "unknown_session" \
            and unknown_tries < REJOIN_UNKNOWN_SESSION_TRIES:
        return REJOIN_FIRST_S, delay_s, unknown_tries + 1
    return delay_s, min(delay_s * 2, REJOIN_MAX_S), unknown_tries


def rejoin_gives_up(error: Exception) -> bool:
    """Whether a failed rejoin of the remembered session ends the rejoining (the session is forgotten).

    True when the host refused this device (JoinRefused with any code but ALREADY_IN_SESSION: its old
    link is not gone yet, so a later try may pass), or this device refused the host (HOST_KEY_MISMATCH);
    False for anything else (host or rendezvous unreachable, the join cut short), which is retried.
    Decided on the error's type and code (proto_spec 05 §2 `denied`), never on its message.
    """
    return isinstance(error, JoinRefused) and error.code != ALREADY_IN_SESSION


def rehost_gives_up(error: Exception) -> bool:
    """Whether a failed re-hosting of the remembered session ends it (the session is forgotten): the
    rendezvous holds that session id for another host key (RendezvousRefused `duplicate_peer`, proto_spec
    03 §2.3), which no retry changes. Anything else is retried."""
    return isinstance(error, RendezvousRefused) and error.code == DUPLICATE_PEER


def rejoin_first_wait_s(failed_unready: int) -> float:
    """The wait before the first rejoin of a member session that failed (before jitter).

    None after a session that served (it reached ready or stood by: a loss heals at once,
    docs/healing.md). After ``failed_unready`` sessions in a row that failed before either, doubling
    from REJOIN_FIRST_S up to REJOIN_MAX_S: a stage that keeps failing to load is not retried in a
    tight loop (issue 21 item 3: a trial's member rejoined, failed and rejoined with no wait, and
    `join` printed ~3,680 "reconnecting (attempt 1, next try in 0 s)" lines).

    Args:
        failed_unready: sessions in a row, this one included, that failed before serving (0: it served).
    Returns:
        The wait in seconds.
    """
    if failed_unready <= 0:
        return 0.0
    return min(REJOIN_FIRST_S * 2 ** (failed_unready - 1), REJOIN_MAX_S)


def record(code: str, attempt: int, reason: Optional[str], *, now_s: float, wait_s: float = 0.0) -> dict:
    """A comeback record (module docstring): attempt `attempt` of `code`, due `wait_s` seconds after
    `now_s` (a time.time() reading)."""
    return {"code": code, "attempt": attempt, "at": now_s + wait_s, "reason": reason}


def session_id_of(code: str) -> Optional[str]:
    """The session id part of a session code (proto_spec 01 §1.2), or None."""
    return str(code).strip().lower().rpartition("-")[0] or None


def reconnecting_status(info: dict, session: Optional[MemberStatus], now_s: float) -> MemberStatus:
    """A member's status while its daemon rejoins: the ended session's (``session``, or None) with
    state ``reconnecting``, no stage, and ``reconnecting`` {"attempt", "next_in_s", "reason"}
    (kafilad/proto/status.py)."""
    left_s = max(0.0, info["at"] - now_s)
    sid = session_id_of(info["code"])
    return attrs.evolve(
        session if session is not None else MemberStatus(), session_id=sid, code=info["code"], state=RECONNECTING,
        error=None, members=(), plan=None, blocks=None, head=False, load={},
        control="down" if session is not None else None,
        rendezvous=f"reconnecting (attempt {info['attempt']}, next in {left_s:.0f} s)",
        reconnecting={"attempt": info["attempt"], "next_in_s": round(left_s, 1), "reason": info["reason"]})


def restoring_status(info: dict, now_s: float) -> HostStatus:
    """A restarted host's status until its remembered session is registered again: state
    ``restoring`` and ``restoring`` {"attempt", "next_in_s", "reason"} (kafilad/proto/status.py)."""
    left_s = info["at"] - now_s
    when = f"next in {left_s:.0f} s" if left_s > 0 else "under way"
    sid = session_id_of(info["code"])
    return HostStatus(session_id=sid, code=info["code"], state=RESTORING,
                      rendezvous=f"re-registering the session (attempt {info['attempt']}, {when})",
                      restoring={"attempt": info["attempt"], "next_in_s": round(max(0.0, left_s), 1),
                                 "reason": info["reason"]})


def restoring_sentence(info: dict) -> str:
    """What a restarted host is doing, for the requests and host commands it cannot serve yet."""
    return (f"This daemon is restoring its session {info['code']} after a restart: it is re-registering it "
            f"at the rendezvous (attempt {info['attempt']}).")

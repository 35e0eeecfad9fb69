"""ICE-style connectivity checks for one ring edge, sans-IO (RFC 8445; DESIGN §3 steps 5-6, §4; proto_spec 07 §2-§3).

One agent per chosen ring edge and side. Both sides send paced Binding requests (RFC 8445 §6.1.4.2,
one check every ``pace_s``) from the daemon's one UDP socket to every remote candidate, answer
authenticated requests at the *observed* source address (peer-reflexive, §7.3.1.3) and queue a
triggered check back to it (§7.3.1.4) — that pair of outbound packets is what opens both NATs. The
edge's sender is CONTROLLING (and the QUIC client); the receiver is CONTROLLED.

Check packet (a STUN Binding request, RFC 8445 §7.1.1 / RFC 8489 §5)::

    header  type 0x0001, magic cookie, 96-bit transaction id
    USERNAME         "<remote ufrag>:<local ufrag>"       (RFC 8445 §7.2.2)
    PRIORITY         u32, prflx priority of the sender's candidate (§7.1.1)
    ICE-CONTROLLING  u64 tie-breaker   | ICE-CONTROLLED u64
    USE-CANDIDATE    (empty; controlling side, once a pair succeeded: regular nomination §8.1.1)
    MESSAGE-INTEGRITY HMAC-SHA1 keyed with the *receiver's* password (short-term credentials)
    FINGERPRINT

Success response: type 0x0101, XOR-MAPPED-ADDRESS = the request's source, MESSAGE-INTEGRITY keyed
with the responder's password, FINGERPRINT. A check succeeds only if the response comes from the
address the request went to (symmetric pair, §7.2.5.2.1).

The controlling side selects the first pair that succeeds and repeats a USE-CANDIDATE request on it
until one is answered; the controlled side selects the pair a valid USE-CANDIDATE request came
from. With nothing selected after ``timeout_s`` the agent fails (the edge falls back to relay).
A selected pair is kept alive with a Binding request every ``keepalive_s`` (Linux conntrack
forgets unreplied UDP after 30 s and replied flows after 120 s, DESIGN §3 step 6); no answer for
``consent_timeout_s`` means the path is lost (RFC 7675 consent freshness, simplified).

Malformed or unauthenticated datagrams are dropped; nothing here raises on input.
"""

from __future__ import annotations

import enum
import ipaddress
import os
from collections.abc import Callable, Sequence
from typing import Optional, Union

import attrs
from aioice.candidate import Candidate, candidate_priority
from aioice.stun import Class, Message, Method

from kafilad.proto.stun import decode

Address = tuple[str, int]

#: Ta, the pacing interval between checks (RFC 8445 §14.2 uses 50 ms).
PACE_S = 0.05
#: Bound on checks before the edge falls back to relay (DESIGN §3 step 5).
CHECK_TIMEOUT_S = 5.0
#: Keepalive interval on a selected pair; well under conntrack's 30 s for unreplied UDP.
KEEPALIVE_S = 15.0
#: No answer to keepalives for this long: the direct path is lost.
CONSENT_TIMEOUT_S = 35.0
#: Component id (one component: the QUIC flow).
COMPONENT = 1


class AgentState(enum.Enum):
    CHECKING = "checking"
    VERIFIED = "verified"
    FAILED = "failed"
    LOST = "lost"
    CLOSED = "closed"  # the path's owner let it go (:meth:`IceAgent.close`): no more keepalives


@attrs.frozen
class Credentials:
    """Short-term ICE credentials (RFC 8445 §5.3): ufrag ≥ 4 chars, pwd ≥ 22 chars."""

    ufrag: str
    pwd: str

    def to_json(self) -> dict:
        return {"ufrag": self.ufrag, "pwd": self.pwd}


def new_credentials(random_bytes: Callable[[int], bytes] = os.urandom) -> Credentials:
    """Fresh random credentials (8-char ufrag, 32-char pwd, hex)."""
    return Credentials(random_bytes(4).hex(), random_bytes(16).hex())


@attrs.frozen
class PathVerified:
    """A pair is selected: datagrams to ``remote`` reach the peer and its answers reach us."""

    remote: Address
    rtt_ms: Optional[float]


@attrs.frozen
class ChecksFailed:
    """No pair was selected within the time bound; ``reason`` is a sentence."""

    reason: str


@attrs.frozen
class PathLost:
    """The selected pair stopped answering keepalives."""

    reason: str


@attrs.frozen
class SizeConfirmed:
    """A size probe (:meth:`IceAgent.send_size_probe`) of ``size_bytes`` was answered: datagrams that
    large reach the peer on the selected pair (proto_spec 07 §4a)."""

    size_bytes: int
    rtt_ms: float


Event = Union[PathVerified, ChecksFailed, PathLost, SizeConfirmed]


# ---- candidates (signalled as SDP a=candidate values, RFC 8839 §5.1) -----------------------------

def make_candidate(kind: str, addr: Address) -> Candidate:
    """An aioice Candidate of type ``kind`` ("host", "srflx", "prflx") for UDP ``addr``."""
    return Candidate(foundation=f"{kind[0]}{abs(hash(addr[0])) % 100000}", component=COMPONENT, transport="udp",
                     priority=candidate_priority(COMPONENT, kind), host=addr[0], port=int(addr[1]), type=kind)


def candidates_to_sdp(candidates: Sequence[Candidate]) -> list[str]:
    return [c.to_sdp() for c in candidates]


def candidates_from_sdp(lines: object, max_count: int = 16) -> list[Candidate]:
    """Parse signalled candidates; malformed entries, non-UDP and non-IP hosts are skipped."""
    out: list[Candidate] = []
    if not isinstance(lines, (list, tuple)):
        return out
    for line in lines[:max_count]:
        if not isinstance(line, str):
            continue
        try:
            c = Candidate.from_sdp(line)
            ipaddress.ip_address(c.host)
        except (ValueError, IndexError, TypeError, KeyError):
            continue
        if c.transport.lower() == "udp" and 0 < c.port < 65536:
            out.append(c)
    return out


@attrs.define
class _Pair:
    remote: Address
    priority: int
    succeeded: bool = False
    rtt_ms: Optional[float] = None
    checks: int = 0


def normalize_address(addr: Sequence) -> Optional[Address]:
    """(ip, port) with the IP in canonical text form, or None for anything that is not an address."""
    try:
        return (str(ipaddress.ip_address(addr[0])), int(addr[1]))
    except (ValueError, TypeError, IndexError):
        return None


def check_request(txid: bytes, *, local: Credentials, remote: Credentials, controlling: bool, tie_breaker: int,
                  use_candidate: bool) -> Message:
    """A connectivity check (RFC 8445 §7.2.2: BINDING request, USERNAME remote:local, PRIORITY of a
    peer-reflexive candidate, our role and tie-breaker, USE-CANDIDATE when nominating), not yet
    signed: the caller may pad it (a size probe) before MESSAGE-INTEGRITY with `remote.pwd` and
    FINGERPRINT. Shared by IceAgent and kafilad/proto/birthday.py."""
    attrs_ = {"USERNAME": f"{remote.ufrag}:{local.ufrag}", "PRIORITY": candidate_priority(COMPONENT, "prflx")}
    attrs_["ICE-CONTROLLING" if controlling else "ICE-CONTROLLED"] = tie_breaker
    if use_candidate:
        attrs_["USE-CANDIDATE"] = None
    return Message(Method.BINDING, Class.REQUEST, transaction_id=txid, attributes=attrs_)


def authentic(msg: Message, pwd: str) -> bool:
    """Whether `msg` carries a valid MESSAGE-INTEGRITY for `pwd` (a malformed one is not valid)."""
    try:
        return bool(msg.check_message_integrity(pwd.encode()))
    except (ValueError, TypeError, AttributeError):
        return False


def request_from(msg: Message, local: Credentials, remote: Credentials) -> Optional[bool]:
    """Whose check a BINDING request is: None when its USERNAME is not for our ufrag (not ours: the
    caller passes it on), False when it is ours but not from this peer or not authentic (drop;
    RFC 8445 §7.3 would answer 401), True for an authentic check from this peer."""
    username = msg.attributes.get("USERNAME")
    if not isinstance(username, str) or username.split(":", 1)[0] != local.ufrag:
        return None
    return username == f"{local.ufrag}:{remote.ufrag}" and authentic(msg, local.pwd)


def binding_response(msg: Message, src: Address, local: Credentials) -> bytes:
    """The success answer to check `msg` from `src`: XOR-MAPPED-ADDRESS, signed with `local.pwd`."""
    resp = Message(Method.BINDING, Class.RESPONSE, transaction_id=msg.transaction_id,
                   attributes={"XOR-MAPPED-ADDRESS": src})
    resp.add_message_integrity(local.pwd.encode())
    resp.add_fingerprint()
    return bytes(resp)


class IceAgent:
    """Connectivity checks of one edge, one side (RFC 8445 §6-§8, simplified to one local socket).

    Args:
        controlling: True on the edge's sender (which becomes the QUIC client).
        local, remote: our and the peer's short-term credentials (from the signal exchange).
        remote_candidates: the peer's candidates, best first (more may be added).
        now: current time, seconds (the trio driver passes trio.current_time()).
        tie_breaker: 64-bit value for ICE-CONTROLLING/CONTROLLED (RFC 8445 §7.1.3).
        pace_s, timeout_s, keepalive_s, consent_timeout_s: see the module constants.
    """

    def __init__(self, *, controlling: bool, local: Credentials, remote: Credentials,
                 remote_candidates: Sequence[Candidate], now: float, tie_breaker: int = 0,
                 pace_s: float = PACE_S, timeout_s: float = CHECK_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_S, consent_timeout_s: float = CONSENT_TIMEOUT_S,
                 random_bytes: Callable[[int], bytes] = os.urandom):
        self.controlling = controlling
        self.local = local
        self.remote = remote
        self.tie_breaker = tie_breaker & 0xFFFFFFFFFFFFFFFF
        self.pace_s, self.timeout_s = pace_s, timeout_s
        self.keepalive_s, self.consent_timeout_s = keepalive_s, consent_timeout_s
        self._random = random_bytes
        self.state = AgentState.CHECKING
        self.selected: Optional[Address] = None
        self.started_s = now
        self.verified_after_s: Optional[float] = None
        self.checks_sent = 0
        self._pairs: dict[Address, _Pair] = {}
        self._order: list[Address] = []
        self._rr = 0
        self._triggered: list[Address] = []
        self._tx: dict[bytes, tuple[Address, float, bool]] = {}  # txid -> (remote, sent_s, use_candidate)
        self._size_tx: dict[bytes, int] = {}  # txid -> size of a size probe (send_size_probe)
        self._out: list[tuple[bytes, Address]] = []
        self._events: list[Event] = []
        self._next_check_s = now
        self._nominated = False
        self._last_answer_s = now
        self._next_keepalive_s: Optional[float] = None
        for c in remote_candidates:
            self.add_remote_candidate((c.host, c.port), c.priority)

    # ---- sans-IO interface --------------------------------------------------------------------
    def add_remote_candidate(self, addr: Sequence, priority: int = 0) -> None:
        a = normalize_address(addr)
        if a is None or a in self._pairs or len(self._pairs) >= 32:
            return
        self._pairs[a] = _Pair(a, priority)
        self._order = sorted(self._pairs, key=lambda k: -self._pairs[k].priority)

    def min_probe_bytes(self) -> int:
        """The size of a size probe without padding: the smallest :meth:`send_size_probe` accepts."""
        return len(bytes(self._request(bytes(12), use_candidate=False))) + 24 + 8

    def send_size_probe(self, size_bytes: int, now: float) -> bool:
        """Queue a Binding request of exactly ``size_bytes`` (a UDP payload, a multiple of 4) on the
        selected pair, made that large with PADDING (RFC 5780 §7.6) and authenticated as any check
        (RFC 8899 §4.1: a probe carries no application data). An answer gives a :class:`SizeConfirmed`
        event; an unanswered probe gives nothing (the caller times it out).

        Returns:
            False (nothing queued) if no pair is selected or ``size_bytes`` is too small for a check.
        """
        if self.state != AgentState.VERIFIED or self.selected is None:
            return False
        txid = self._random(12)
        msg = self._request(txid, use_candidate=False)
        fixed = len(bytes(msg)) + 24 + 8  # + MESSAGE-INTEGRITY and FINGERPRINT
        pad = size_bytes - fixed - 4  # PADDING's own header
        if size_bytes != fixed and (pad < 0 or pad % 4):
            return False
        if size_bytes != fixed:
            msg.attributes["PADDING"] = bytes(pad)
        msg.add_message_integrity(self.remote.pwd.encode())
        msg.add_fingerprint()
        data = bytes(msg)
        self._tx[txid] = (self.selected, now, False)
        self._size_tx[txid] = len(data)
        while len(self._size_tx) > 16:  # unanswered probes are forgotten, oldest first
            self._size_tx.pop(next(iter(self._size_tx)))
        self._out.append((data, self.selected))
        return True

    def close(self) -> None:
        """Stop for good: no more checks or keepalives, requests dropped (the edge moved off this path)."""
        self.state = AgentState.CLOSED
        self._out.clear()
        self._triggered.clear()

    def next_event(self) -> Optional[Event]:
        return self._events.pop(0) if self._events else None

    def get_timer(self) -> Optional[float]:
        """When :meth:`handle_timer` must run next (seconds, same clock as ``now``), or None."""
        if self.state in (AgentState.FAILED, AgentState.LOST, AgentState.CLOSED):
            return None
        if self.state == AgentState.CHECKING:
            return min(self._next_check_s, self.started_s + self.timeout_s)
        t = min(self._next_keepalive_s or float("inf"), self._last_answer_s + self.consent_timeout_s)
        if self.controlling and not self._nominated:
            t = min(t, self._next_check_s)
        return t

    def handle_timer(self, now: float) -> None:
        if self.state == AgentState.CHECKING:
            if now >= self.started_s + self.timeout_s:
                self.state = AgentState.FAILED
                self._events.append(ChecksFailed(
                    f"no direct path answered within {self.timeout_s:g} s ({self.checks_sent} checks to "
                    f"{len(self._pairs)} candidate addresses)"))
                return
            if now >= self._next_check_s:
                self._send_next_check(now)
            return
        if self.state != AgentState.VERIFIED:
            return
        if now >= self._last_answer_s + self.consent_timeout_s:
            self.state = AgentState.LOST
            self._events.append(PathLost(f"the direct path to {self.selected[0]}:{self.selected[1]} stopped "
                                         f"answering for {self.consent_timeout_s:g} s"))
            return
        if self.controlling and not self._nominated and now >= self._next_check_s:
            self._send_check(self.selected, now, use_candidate=True)  # repeat until answered
            late = now - self.started_s > 2 * self.timeout_s
            self._next_check_s = now + (self.keepalive_s if late else self.pace_s)
        if self._next_keepalive_s is not None and now >= self._next_keepalive_s:
            self._send_check(self.selected, now, use_candidate=self.controlling)
            self._next_keepalive_s = now + self.keepalive_s

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        if self.state == AgentState.CHECKING and now >= self._next_check_s:
            self._send_next_check(now)
        out, self._out = self._out, []
        return out

    def receive_datagram(self, data: bytes, addr: Sequence, now: float) -> bool:
        """Process one STUN datagram; True if it belonged to this agent (even if then dropped)."""
        src = normalize_address(addr)
        if src is None:
            return False
        msg = decode(bytes(data))
        if msg is None or msg.message_method != Method.BINDING:
            return False
        if msg.message_class == Class.REQUEST:
            return self._on_request(msg, src, now)
        if msg.message_class in (Class.RESPONSE, Class.ERROR):
            return self._on_response(msg, src, now)
        return False

    # ---- internals ------------------------------------------------------------------------------
    def _send_next_check(self, now: float) -> None:
        target = None
        while self._triggered:
            cand = self._triggered.pop(0)
            if not self._pairs[cand].succeeded or (self.controlling and self.selected is None):
                target = cand
                break
        if target is None:
            waiting = [a for a in self._order if not self._pairs[a].succeeded] or self._order
            if waiting:
                target = waiting[self._rr % len(waiting)]
                self._rr += 1
        if target is not None:
            self._send_check(target, now, use_candidate=False)
        self._next_check_s = now + self.pace_s

    def _request(self, txid: bytes, *, use_candidate: bool) -> Message:
        return check_request(txid, local=self.local, remote=self.remote, controlling=self.controlling,
                             tie_breaker=self.tie_breaker, use_candidate=use_candidate)

    def _send_check(self, remote: Address, now: float, *, use_candidate: bool) -> None:
        txid = self._random(12)
        msg = self._request(txid, use_candidate=use_candidate)
        msg.add_message_integrity(self.remote.pwd.encode())
        msg.add_fingerprint()
        self._tx[txid] = (remote, now, use_candidate)
        if len(self._tx) > 256:
            self._tx.pop(next(iter(self._tx)))
        self._pairs[remote].checks += 1
        self.checks_sent += 1
        self._out.append((bytes(msg), remote))

    def _on_request(self, msg: Message, src: Address, now: float) -> bool:
        verdict = request_from(msg, self.local, self.remote)
        if verdict is None:
            return False
        if not verdict:
            return True  # ours, but not from this peer or not authentic: drop (RFC 8445 §7.3 would answer 401)
        if self.state in (AgentState.FAILED, AgentState.LOST, AgentState.CLOSED):
            return True
        self._out.append((binding_response(msg, src, self.local), src))
        if src not in self._pairs:
            self.add_remote_candidate(src, int(msg.attributes.get("PRIORITY") or 0))
        if src not in self._pairs:
            return True
        if self.state == AgentState.CHECKING and not self._pairs[src].succeeded and src not in self._triggered:
            self._triggered.append(src)  # triggered check (RFC 8445 §7.3.1.4)
        if src == self.selected:
            self._last_answer_s = now
        if not self.controlling and "USE-CANDIDATE" in msg.attributes and self.selected is None:
            self._select(src, now)
        return True

    def _on_response(self, msg: Message, src: Address, now: float) -> bool:
        entry = self._tx.pop(msg.transaction_id, None)
        if entry is None:
            return False
        remote, sent_s, use_candidate = entry
        if msg.message_class != Class.RESPONSE or src != remote or not authentic(msg, self.remote.pwd):
            return True  # an error answer, not a symmetric pair (RFC 8445 §7.2.5.2.1), or not authentic
        pair = self._pairs[remote]
        rtt_ms = (now - sent_s) * 1000.0
        size = self._size_tx.pop(msg.transaction_id, None)
        if size is not None:
            if remote == self.selected:
                self._last_answer_s = now
                self._events.append(SizeConfirmed(size, rtt_ms))
            return True
        if not pair.succeeded:
            pair.succeeded, pair.rtt_ms = True, rtt_ms
        if remote == self.selected:
            self._last_answer_s = now
            if use_candidate:
                self._nominated = True
        if self.controlling and self.selected is None and self.state == AgentState.CHECKING:
            self._select(remote, now)
            self._send_check(remote, now, use_candidate=True)  # nominate at once
            self._next_check_s = now + self.pace_s
        return True

    def _select(self, remote: Address, now: float) -> None:
        self.selected = remote
        self.state = AgentState.VERIFIED
        self.verified_after_s = now - self.started_s
        self._last_answer_s = now
        self._next_keepalive_s = now + self.keepalive_s
        self._triggered.clear()
        self._events.append(PathVerified(remote, self._pairs[remote].rtt_ms))

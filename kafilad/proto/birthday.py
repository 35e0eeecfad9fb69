"""Birthday-paradox probing across a symmetric NAT, sans-IO (proto_spec 07 §7b; docs/nat-birthday.md).

A symmetric NAT ("S", endpoint-dependent mapping) gives every (local socket, destination) flow
its own random public port, so the server-reflexive port STUN saw is useless to a peer. A
port-restricted cone ("C") admits only answers from an (IP, port) it sent to. Checks alone
cannot meet; tailscale's "hard NAT" trick (magicsock: 256 ports on the hard side, a port sweep
from the easy side) can, by the birthday paradox:

- the S side (role :attr:`Role.POOL`) opens ``sockets`` extra UDP sockets and sends one
  authenticated check from each to the C side's mapped address: its NAT makes ``sockets``
  random mappings S_IP:p_1..p_n toward it (the checks themselves die at the C side's filter);
- the C side (role :attr:`Role.SWEEP`) sends authenticated checks from its one socket to
  ``probes`` distinct ports q of S_IP (starting :data:`SWEEP_DELAY_S` later, so the mappings
  exist): each opens its own filter for S_IP:q, and a q equal to some p_i crosses the S NAT
  (conntrack sees the reply of flow i) into socket i;
- socket i answers it (and sends a triggered check back): both directions of the pair
  (socket i, C's mapped address) / (C's socket, S_IP:p_i) are proven, with the edge's ICE
  credentials (RFC 8445 §7.2: USERNAME, MESSAGE-INTEGRITY, FINGERPRINT) on every datagram.

For S facing S (role :attr:`Role.BOTH`) both ends sweep from their pools; a pair needs both
random mappings to coincide, so the paper's "relay" prediction is expected to hold (tried and
measured, docs/nat-birthday.md).

Check and answer (as :mod:`kafilad.proto.ice`; RFC 8489 §5)::

    request   Binding 0x0001  USERNAME "<their ufrag>:<our ufrag>", PRIORITY, ICE-CONTROLLING|
              ICE-CONTROLLED (u64 tie-breaker), [USE-CANDIDATE], MESSAGE-INTEGRITY (their pwd),
              FINGERPRINT
    response  Binding 0x0101  XOR-MAPPED-ADDRESS (the request's source), MESSAGE-INTEGRITY (our
              pwd), FINGERPRINT; valid only from the address the request went to (§7.2.5.2.1)

Probability: with R usable ports (Linux masquerade draws from 1024..65535 for a source port of
1024 or more: R = 64,512), n mappings and m distinct probed ports, the sweep misses every mapping
with probability C(R - n, m) / C(R, m) ≈ exp(-n m / R) (:func:`miss_probability`). The defaults,
n = 256 and m = 2,048, miss with probability 3e-4.

Hand-off (who picks the pair): the *controlling* end (the edge's sender) takes the first pair on
which a check of its own was answered (:class:`Answered`); the *controlled* end waits for the
controlling end's USE-CANDIDATE check (:class:`Nominated`), which it leaves unanswered: the
driver hands the pair to an :class:`kafilad.proto.ice.IceAgent`, which answers the repeated
nomination, selects the pair and keeps it alive (§3). Nothing here raises on input; malformed
or unauthenticated datagrams are dropped.

Drive it like the ICE agent, with a socket index on every datagram:
``datagrams_to_send(now) -> [(socket, data, addr)]``, ``receive_datagram(socket, data, addr, now)``,
``get_timer()`` / ``handle_timer(now)``, ``next_event()``.
"""

from __future__ import annotations

import enum
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Optional, Union

import attrs
from aioice.stun import Class, Message, Method

from kafilad.proto.ice import (Credentials, authentic, binding_response, check_request,
                               normalize_address, request_from)
from kafilad.proto.stun import decode

Address = tuple[str, int]

#: Ports a Linux NAT picks a mapping from for a source port of 1024 or more (nf_nat
#: ``nf_nat_l4proto_unique_tuple``: min 1024, range 65535 - 1024 + 1).
PORT_MIN = 1024
PORT_MAX = 65535
PORT_RANGE = PORT_MAX - PORT_MIN + 1
#: Extra sockets the S side opens (tailscale: 256).
POOL_SOCKETS = 256
#: Distinct destination ports the C side probes (1 - exp(-256 * 2048 / 64512) = 0.9997).
SWEEP_PROBES = 2048
#: The sweep starts this long after the search, so the S side's mappings exist before it.
SWEEP_DELAY_S = 0.5
#: Probes sent per tick, and the tick: 800 probes/s, a 2,048-port sweep in 2.6 s; a pool sends its
#: round of checks faster (256 in 80 ms), so every mapping exists before the sweep starts.
BURST = 16
POOL_BURST = 64
TICK_S = 0.02
#: The S side's pool sends its checks again at these offsets (s) after the first round, keeping
#: its mappings (conntrack forgets unreplied UDP after 30 s) and catching a sweep that came first.
POOL_RESEND_S = (1.5, 4.0)
#: The search gives up this long after it started (both roles).
SEARCH_TIMEOUT_S = 8.0
#: Triggered checks (answers to the peer's evidence) sent beyond the budget, at most.
MAX_TRIGGERED = 32


class Role(enum.Enum):
    POOL = "pool"     # S facing C: many local sockets, one destination (the C side's mapped address)
    SWEEP = "sweep"   # C facing S: one local socket, many destination ports on the S side's IP
    BOTH = "both"     # S facing S: many local sockets, many destination ports


class SearchState(enum.Enum):
    SEARCHING = "searching"
    FOUND = "found"
    FAILED = "failed"
    CLOSED = "closed"


def role_for(mine: Optional[str], theirs: Optional[str]) -> Optional[Role]:
    """Our role in a birthday search between NAT classes ``mine`` and ``theirs``; None when the
    pair does not need one (every pair but C–S and S–S punches or relays without it)."""
    if mine == "S" and theirs == "C":
        return Role.POOL
    if mine == "C" and theirs == "S":
        return Role.SWEEP
    if mine == "S" and theirs == "S":
        return Role.BOTH
    return None


def miss_probability(sockets: int, probes: int, port_range: int = PORT_RANGE) -> float:
    """Probability that ``probes`` distinct ports drawn at random miss all of ``sockets`` distinct
    random mappings among ``port_range`` ports: C(R - n, m) / C(R, m) (hypergeometric, exact).

    Raises:
        ValueError: a negative count, or more sockets or probes than ports.
    """
    if sockets < 0 or probes < 0 or sockets > port_range or probes > port_range:
        raise ValueError(f"counts out of range: {sockets} sockets, {probes} probes, {port_range} ports")
    if sockets + probes > port_range:
        return 0.0
    log_p = sum(math.log1p(-sockets / (port_range - k)) for k in range(probes))
    return math.exp(log_p)


def success_probability(sockets: int, probes: int, port_range: int = PORT_RANGE) -> float:
    """1 - :func:`miss_probability`: some probe lands on some mapping."""
    return 1.0 - miss_probability(sockets, probes, port_range)


def probes_for(target: float, sockets: int, port_range: int = PORT_RANGE) -> int:
    """The fewest distinct probes reaching success probability ``target`` against ``sockets`` mappings.

    Raises:
        ValueError: ``target`` not in [0, 1), or no sockets.
    """
    if not 0.0 <= target < 1.0 or sockets < 1:
        raise ValueError(f"need 0 <= target < 1 and sockets >= 1 (got {target}, {sockets})")
    log_miss, goal = 0.0, math.log1p(-target)
    for m in range(port_range - sockets + 1):
        if log_miss <= goal:
            return m
        log_miss += math.log1p(-sockets / (port_range - m))
    return port_range - sockets + 1


def sweep_ports(rng: random.Random, count: int, *, first: Iterable[int] = ()) -> list[int]:
    """``count`` distinct ports of PORT_MIN..PORT_MAX in the order to probe them.

    ``first`` (in range, deduplicated) lead; then the ports PORT_MIN..2*PORT_MIN-1 in random order
    (Linux draws a mapping as PORT_MIN + u16 % PORT_RANGE, so these 1,024 ports are twice as
    likely as the others; under a uniform draw the order costs nothing), then the rest at random.
    """
    count = max(0, min(count, PORT_RANGE))
    out: list[int] = []
    seen: set[int] = set()
    for p in first:
        if PORT_MIN <= p <= PORT_MAX and p not in seen and len(out) < count:
            out.append(p)
            seen.add(p)
    low = [p for p in range(PORT_MIN, 2 * PORT_MIN) if p not in seen]
    rng.shuffle(low)
    for p in low:
        if len(out) >= count:
            return out
        out.append(p)
        seen.add(p)
    need = count - len(out)
    if need > 0:
        rest = range(2 * PORT_MIN, PORT_MAX + 1)
        drawn = rng.sample(rest, min(need + len(seen), len(rest)))  # a few extra: some may lead already
        out.extend([p for p in drawn if p not in seen][:need])
    return out


@attrs.frozen
class Answered:
    """A check we sent from ``socket`` to ``remote`` was answered: the pair works both ways."""

    socket: int
    remote: Address
    rtt_ms: float
    probes: int        # checks this end had sent by then
    after_s: float     # since the search started


@attrs.frozen
class Nominated:
    """The controlling peer nominated the pair (``socket``, ``remote``) with USE-CANDIDATE (left
    unanswered for the ICE agent the driver hands the pair to)."""

    socket: int
    remote: Address
    probes: int
    after_s: float


@attrs.frozen
class SearchFailed:
    """Nothing was found within the time bound; ``reason`` is a sentence."""

    reason: str
    probes: int


Event = Union[Answered, Nominated, SearchFailed]


class BirthdaySearch:
    """One end's birthday search on one edge (module docstring).

    Args:
        role: POOL, SWEEP or BOTH (:func:`role_for`).
        controlling: True on the edge's sender (ICE controlling; it picks the pair).
        local, remote: our and the peer's short-term credentials (the attempt's offers).
        peer: the peer's server-reflexive address: the destination of a POOL, the IP of a SWEEP.
        sockets: local sockets, indexed 0..sockets-1 (1 for SWEEP: the daemon's own socket).
        now: the current time, seconds.
        probes: this end's budget of checks (triggered checks answering the peer's evidence are
            counted but allowed up to MAX_TRIGGERED beyond it). Default: SWEEP_PROBES for
            SWEEP/BOTH, ``sockets * (1 + len(POOL_RESEND_S))`` for POOL.
        timeout_s: the search fails this long after ``now``.
        rng: port order (SWEEP/BOTH); random_bytes: transaction ids.
    Attributes:
        state: SearchState. probes_sent: checks sent (the budget spent). answers_sent: checks answered.
        found: the pair picked (socket, remote) once FOUND.
    """

    def __init__(self, *, role: Role, controlling: bool, local: Credentials, remote: Credentials, peer: Address,
                 sockets: int, now: float, probes: Optional[int] = None, timeout_s: float = SEARCH_TIMEOUT_S,
                 tie_breaker: int = 0, burst: Optional[int] = None, tick_s: float = TICK_S,
                 sweep_delay_s: float = SWEEP_DELAY_S, resend_s: Sequence[float] = POOL_RESEND_S,
                 rng: Optional[random.Random] = None, random_bytes: Callable[[int], bytes] = os.urandom):
        peer_addr = normalize_address(peer)
        if peer_addr is None:
            raise ValueError(f"not an address: {peer!r}")
        if sockets < 1:
            raise ValueError("a search needs at least one socket")
        if role == Role.SWEEP:
            sockets = 1
        self.role, self.controlling = role, controlling
        self.local, self.remote = local, remote
        self.peer = peer_addr
        self.sockets = sockets
        self.tie_breaker = tie_breaker & 0xFFFFFFFFFFFFFFFF
        if burst is None:
            burst = POOL_BURST if role == Role.POOL else BURST
        self.burst, self.tick_s = max(1, burst), tick_s
        self.started_s = now
        self.deadline_s = now + timeout_s
        self._random = random_bytes
        rng = rng if rng is not None else random.Random(int.from_bytes(random_bytes(8), "big"))
        if role == Role.POOL:
            rounds = 1 + len(resend_s)
            self.budget = probes if probes is not None else sockets * rounds
            starts = [now] + [now + s for s in resend_s]
            self._plan = [(start, [(i, self.peer) for i in range(sockets)]) for start in starts]
        else:
            self.budget = probes if probes is not None else SWEEP_PROBES
            ports = sweep_ports(rng, self.budget)
            probes_ = [(j % sockets, (self.peer[0], p)) for j, p in enumerate(ports)]
            self._plan = [(now + (sweep_delay_s if role == Role.SWEEP else 0.0), probes_)]
        self._round, self._pos = 0, 0
        self._next_tick_s = self._plan[0][0]
        self.state = SearchState.SEARCHING
        self.probes_sent = 0
        self.answers_sent = 0
        self.triggered_sent = 0
        self.found: Optional[tuple[int, Address]] = None
        self._tx: dict[bytes, tuple[int, Address, float]] = {}  # txid -> (socket, remote, sent_s)
        self._out: list[tuple[int, bytes, Address]] = []
        self._events: list[Event] = []

    # ---- sans-IO interface --------------------------------------------------------------------
    def get_timer(self) -> Optional[float]:
        """When :meth:`handle_timer` must run next (same clock as ``now``), or None."""
        if self.state != SearchState.SEARCHING:
            return None
        if self._round < len(self._plan):
            return min(self._next_tick_s, self.deadline_s)
        return self.deadline_s

    def handle_timer(self, now: float) -> None:
        if self.state != SearchState.SEARCHING:
            return
        if now >= self.deadline_s:
            self.state = SearchState.FAILED
            self._events.append(SearchFailed(
                f"no birthday probe answered within {self.deadline_s - self.started_s:g} s ({self.probes_sent} checks "
                f"from {self.sockets} socket{'s' if self.sockets != 1 else ''}, role {self.role.value})",
                self.probes_sent))
            return
        self._send_due(now)

    def datagrams_to_send(self, now: float) -> list[tuple[int, bytes, Address]]:
        """(socket index, datagram, destination) to send now."""
        if self.state == SearchState.SEARCHING and now < self.deadline_s:
            self._send_due(now)
        out, self._out = self._out, []
        return out

    def next_event(self) -> Optional[Event]:
        return self._events.pop(0) if self._events else None

    def close(self) -> None:
        """Stop for good: nothing more is sent or claimed (the pair was handed on, or the attempt ended)."""
        if self.state != SearchState.FAILED:
            self.state = SearchState.CLOSED
        self._out.clear()
        self._tx.clear()

    def receive_datagram(self, socket: int, data: bytes, addr: Sequence, now: float) -> bool:
        """One STUN datagram that arrived on ``socket``; True if it belonged to this search."""
        src = normalize_address(addr)
        if src is None or self.state == SearchState.CLOSED:
            return False
        msg = decode(bytes(data))
        if msg is None or msg.message_method != Method.BINDING:
            return False
        if msg.message_class == Class.REQUEST:
            return self._on_request(socket, msg, src, now)
        if msg.message_class in (Class.RESPONSE, Class.ERROR):
            return self._on_response(socket, msg, src, now)
        return False

    # ---- internals ------------------------------------------------------------------------------
    def _send_due(self, now: float) -> None:
        while self._round < len(self._plan) and now >= self._next_tick_s:
            start, probes = self._plan[self._round]
            if now < start:
                self._next_tick_s = start
                return
            n = 0
            while self._pos < len(probes) and n < self.burst and self.probes_sent < self.budget:
                sock, dst = probes[self._pos]
                self._send_check(sock, dst, now, use_candidate=False)
                self._pos += 1
                n += 1
            if self._pos >= len(probes) or self.probes_sent >= self.budget:
                self._round, self._pos = self._round + 1, 0
                if self.probes_sent >= self.budget:
                    self._round = len(self._plan)
                if self._round < len(self._plan):
                    self._next_tick_s = max(self._plan[self._round][0], now + self.tick_s)
                return
            self._next_tick_s = now + self.tick_s
            return

    def _send_check(self, socket: int, dst: Address, now: float, *, use_candidate: bool) -> None:
        txid = self._random(12)
        msg = check_request(txid, local=self.local, remote=self.remote, controlling=self.controlling,
                            tie_breaker=self.tie_breaker, use_candidate=use_candidate)
        msg.add_message_integrity(self.remote.pwd.encode())
        msg.add_fingerprint()
        self._tx[txid] = (socket, dst, now)
        self.probes_sent += 1
        self._out.append((socket, bytes(msg), dst))

    def _on_request(self, socket: int, msg: Message, src: Address, now: float) -> bool:
        verdict = request_from(msg, self.local, self.remote)
        if verdict is None:
            return False
        if not verdict or self.state != SearchState.SEARCHING:
            return True
        if "USE-CANDIDATE" in msg.attributes and not self.controlling:
            self.state = SearchState.FOUND
            self.found = (socket, src)
            self._events.append(Nominated(socket, src, self.probes_sent, now - self.started_s))
            return True  # unanswered: the ICE agent taking the pair answers the repeat
        self._out.append((socket, binding_response(msg, src, self.local), src))
        self.answers_sent += 1
        if self.triggered_sent < MAX_TRIGGERED:  # triggered check (RFC 8445 §7.3.1.4): proves our direction
            self.triggered_sent += 1
            self._send_check(socket, src, now, use_candidate=False)
        return True

    def _on_response(self, socket: int, msg: Message, src: Address, now: float) -> bool:
        entry = self._tx.get(msg.transaction_id)
        if entry is None:
            return False
        sent_socket, dst, sent_s = entry
        if (msg.message_class != Class.RESPONSE or src != dst or socket != sent_socket
                or not authentic(msg, self.remote.pwd)):
            return True  # an error answer, not a symmetric pair (RFC 8445 §7.2.5.2.1), or not authentic
        del self._tx[msg.transaction_id]
        if self.state != SearchState.SEARCHING:
            return True
        event = Answered(socket, src, (now - sent_s) * 1000.0, self.probes_sent, now - self.started_s)
        self._events.append(event)
        if self.controlling:
            self.state = SearchState.FOUND
            self.found = (socket, src)
        return True

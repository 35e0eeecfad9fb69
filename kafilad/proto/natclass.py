"""Sans-IO NAT behaviour discovery: RFC 5780 mapping (§4.3) and filtering (§4.4) tests, giving the
member's NAT class O, C, S or "unknown" (DESIGN §3 steps 3-4; proto_spec §4.4-§4.6).

Probe sequence against a rendezvous STUN server P = (IP1, port1) whose OTHER-ADDRESS is
A = (IP2, port2) (proto_spec §4.4)::

    1. Test I        -> P                        mapped M1, OTHER-ADDRESS A, RTT
       (M1 == local address: no NAT; the mapping tests are skipped)
    2. Filtering II  -> P, CHANGE-REQUEST ip+port  answer from (IP2, port2) received => EIF
       Filtering III -> P, CHANGE-REQUEST port     answer from (IP1, port2) received => ADF
       (both at once; neither answered => APDF)
    3. Mapping II    -> (IP2, port1)             M2 == M1 => EIM, done
    4. Mapping III   -> (IP2, port2)             M3 == M2 => ADM, else APDM

Filtering runs before the mapping tests on purpose: a request to IP2 would open the NAT's filter
for IP2 and make an address-dependent filter look endpoint-independent.

At most 5 STUN transactions (6 when the first server does not answer and a second is tried);
retransmissions of a transaction do not count. RTO starts at 500 ms (RFC 8489 §6.2.1) and, once
Test I measured the RTT on its first transmission (Karn), becomes clamp(3 x RTT, min_rto_s,
rto_s) (the RFC 6298 first-sample rule); each transaction gives up after ``max_wait_s``, so a
classification takes at most about 3 x ``max_wait_s``.

Degraded servers (proto_spec §4.5):
- one IP x two ports (OTHER-ADDRESS has the same IP): Mapping II goes to (IP1, port2); a changed
  mapping means port-dependent mapping (S); an unchanged one is taken as EIM, which ASSUMES the
  NAT does not map per destination IP only (ADM NATs that keep the port per IP are rare). Only
  Filtering III runs: answered => filtering reported "address-dependent" (it is at most that: O),
  else APDF (C).
- no OTHER-ADDRESS: Mapping II goes to the second server in the list if any (different mapping =>
  reported "address-dependent", meaning at least that); filtering is "unknown" and an EIM NAT is
  then classed C, the conservative choice (a C prediction never promises a path O would get).
  With one such server only, the mapping cannot be tested: class "unknown".

Honest classes (proto_spec §4.6): whenever the mapping could not be measured (no answer at all,
a mapping test unanswered, a server that cannot test it, the run cut short) the class is
"unknown", never a guessed S, and ``NatReport.reason`` says why in a sentence. The session then
verifies such edges by checks (DESIGN §3 step 5) and retries the classification with backoff
(kafilad/node/paths/manager.py).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kafilad.errors import LocalProtocolError
from kafilad.proto.stun import CHANGE_IP, CHANGE_PORT, Class, Message, Method, decode, encode

Address = tuple[str, int]

EIM = EIF = "endpoint-independent"
ADM = ADF = "address-dependent"
APDM = APDF = "address-and-port-dependent"
UNKNOWN = "unknown"

#: The class of a NAT whose mapping behaviour was not measured (proto_spec §4.6).
UNKNOWN_CLASS = "unknown"
#: Every class a report may give.
CLASSES = ("O", "C", "S", UNKNOWN_CLASS)

#: (mapping, filtering) -> class (DESIGN §3 step 4; proto_spec §4.6). Unknown filtering with EIM
#: is C (the conservative reading of a measured mapping); an unknown mapping is "unknown".
CLASS_TABLE: dict[tuple[str, str], str] = {
    (EIM, EIF): "O", (EIM, ADF): "O", (EIM, APDF): "C", (EIM, UNKNOWN): "C",
    **{(m, f): "S" for m in (ADM, APDM) for f in (EIF, ADF, APDF, UNKNOWN)},
    **{(UNKNOWN, f): UNKNOWN_CLASS for f in (EIF, ADF, APDF, UNKNOWN)},
}

#: The likely cause of no answer at all, added to the reason.
BLOCKED_HINT = "UDP to the rendezvous's STUN ports may be blocked"
#: Largest number of sends of one transaction (RFC 8489 §6.2.1 Rc).
MAX_SENDS = 7


def nat_class(mapping: str, filtering: str) -> str:
    """Class "O", "C", "S" or "unknown" of a (mapping, filtering) behaviour pair (DESIGN §3 step 4)."""
    return CLASS_TABLE[(mapping, filtering)]


@dataclass(frozen=True)
class NatReport:
    """Result of NAT behaviour discovery (proto_spec §4.6).

    Attributes:
        mapping: "endpoint-independent" | "address-dependent" | "address-and-port-dependent" | "unknown".
        filtering: same vocabulary.
        mapped_address: (ip, port) the first server saw us as, or None if it never answered.
        nat_class: "O" | "C" | "S" | "unknown" (the mapping was not measured).
        probes: STUN transactions started (retransmissions not counted).
        rtt_ms: round trip to the first answering server from an unretransmitted Test I, or None.
        behind_nat: False when the mapped address equals the local address; None if unknown.
        discovery: "rfc5780" (2 IPs x 2 ports), "ports-only" (1 IP x 2 ports), "two-servers",
            "single" (one address, no OTHER-ADDRESS) or "failed" (no answer).
        reason: why the class is "unknown", a sentence ("" otherwise).
        probed: the server addresses the run sent to (pass them as ``contacted`` to a rerun).
    """

    mapping: str
    filtering: str
    mapped_address: Address | None
    nat_class: str
    probes: int
    rtt_ms: float | None = None
    behind_nat: bool | None = None
    discovery: str = "rfc5780"
    reason: str = ""
    probed: tuple = ()


@dataclass
class _Transaction:
    name: str
    dest: Address
    data: bytes
    transaction_id: bytes
    started_at: float
    deadline: float
    rto_s: float
    next_send_at: float
    sends: int = 1
    done: bool = False
    response: Message | None = None
    origin: Address | None = None
    answered_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.response is not None and self.response.message_class == Class.RESPONSE


def _addr(addr: Sequence) -> Address:
    return (str(ipaddress.ip_address(addr[0])), int(addr[1]))


@dataclass
class NatClassifier:
    """The discovery state machine (sans-IO; RFC 5780 §4; proto_spec §4.4).

    Drive it like aioquic's connection: ``datagrams_to_send(now)`` (the first call starts Test I),
    ``receive_datagram(data, addr, now)`` for each datagram from the socket, ``handle_timer(now)``
    when ``get_timer()`` expires; ``report`` is set once ``done``.

    Args:
        servers: STUN server (ip, port) pairs, IP literals; the first is the primary.
        local_address: our socket's (ip, port) as routed toward the server, to detect "no NAT";
            None if unknown.
        rto_s: initial retransmission timeout (RFC 8489 §6.2.1: 0.5 s).
        min_rto_s: floor of the RTT-derived RTO.
        max_wait_s: cap on one transaction's lifetime, seconds.
        max_probes: most transactions started (the issue's bound is 6).
        new_transaction_id: source of 12-byte transaction ids (RFC 8489 §5).
        contacted: server addresses this socket sent to recently (an earlier run, within the
            NAT's UDP timeout): their answers to the filtering tests prove nothing (proto_spec §4.4).
    """

    servers: Sequence[Address]
    local_address: Address | None = None
    rto_s: float = 0.5
    min_rto_s: float = 0.1
    max_wait_s: float = 1.5
    max_probes: int = 6
    new_transaction_id: Callable[[], bytes] = field(default=lambda: os.urandom(12))
    contacted: Sequence[Address] = ()

    def __post_init__(self) -> None:
        self.servers = [_addr(s) for s in self.servers]
        self.contacted = {_addr(a) for a in self.contacted}
        if not self.servers:
            raise LocalProtocolError("NAT discovery needs at least one STUN server address.")
        self.local_address = _addr(self.local_address) if self.local_address else None
        self.report: NatReport | None = None
        self._started = False
        self._txns: dict[bytes, _Transaction] = {}
        self._by_name: dict[str, _Transaction] = {}
        self._outbox: list[tuple[bytes, Address]] = []
        self._probes = 0
        self._server_index = 0
        self._phase = "test1"
        self._rtt_s: float | None = None
        self._mapped: Address | None = None
        self._other: Address | None = None
        self._mode = "single"
        self._filtering = UNKNOWN

    # --- sans-IO surface ------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.report is not None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        """Datagrams to send now, as (payload, destination (ip, port)); starts Test I on first use."""
        if not self._started:
            self._started = True
            self._start("test1", self.servers[0], None, now)
        out, self._outbox = self._outbox, []
        return out

    def get_timer(self) -> float | None:
        """Absolute time (same clock as ``now``) of the next retransmission or timeout, or None."""
        times = [min(t.next_send_at, t.deadline) for t in self._txns.values() if not t.done]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        """Retransmit what is due (RFC 8489 §6.2.1) and time out what has run ``max_wait_s``."""
        for t in list(self._txns.values()):
            if t.done:
                continue
            if now >= t.deadline:
                t.done = True
            elif now >= t.next_send_at:
                if t.sends < MAX_SENDS:
                    self._outbox.append((t.data, t.dest))
                    t.sends += 1
                    t.rto_s *= 2
                    t.next_send_at = now + t.rto_s
                else:
                    t.next_send_at = t.deadline
        self._advance(now)

    def receive_datagram(self, data: bytes, addr: Sequence, now: float) -> None:
        """Feed one received datagram from ``addr``; anything not answering our requests is ignored."""
        message = decode(data)
        if message is None or message.message_method != Method.BINDING:
            return
        if message.message_class not in (Class.RESPONSE, Class.ERROR):
            return
        t = self._txns.get(message.transaction_id)
        if t is None or t.done:
            return
        try:
            origin = _addr(addr)
        except (ValueError, TypeError, IndexError):
            return
        if message.message_class == Class.RESPONSE and not isinstance(
                message.attributes.get("XOR-MAPPED-ADDRESS", message.attributes.get("MAPPED-ADDRESS")), tuple):
            return
        t.done, t.response, t.origin, t.answered_at = True, message, origin, now
        self._advance(now)

    def abort(self, reason: str = "the classification was cut short") -> None:
        """Stop now and report what is known; an undecided mapping is "unknown" (class "unknown").

        Args:
            reason: why it stopped (a sentence for ``NatReport.reason``), e.g. the driver's timeout.
        """
        if self.report is None:
            if self._mapped is None:
                reason = f"{self._unanswered('test1')}; {reason} ({BLOCKED_HINT})"
            self._finish(UNKNOWN, self._filtering, self._mode if self._mapped else "failed", reason=reason)

    # --- internals ------------------------------------------------------------------------------

    def _start(self, name: str, dest: Address, change: int | None, now: float) -> None:
        if self._probes >= self.max_probes:
            return
        request = Message(Method.BINDING, Class.REQUEST, transaction_id=self.new_transaction_id())
        if change is not None:
            request.attributes["CHANGE-REQUEST"] = change
        data = encode(request)
        rto = self.rto_s if self._rtt_s is None else min(self.rto_s, max(self.min_rto_s, 3 * self._rtt_s))
        # Test I decides everything else and has no RTT yet: it gets twice the budget.
        wait_s = self.max_wait_s * (2 if name == "test1" else 1)
        t = _Transaction(name, dest, data, request.transaction_id, now, now + wait_s, rto, now + rto)
        self._txns[t.transaction_id] = t
        self._by_name[name] = t
        self._probes += 1
        self._outbox.append((data, dest))

    def _unanswered(self, name: str) -> str:
        """A sentence on transaction ``name``'s failure, for ``NatReport.reason``."""
        what = {"test1": "Test I", "map2": "Mapping II", "map3": "Mapping III"}.get(name, name)
        tried = [t for t in self._txns.values() if t.name == name]
        if not tried:
            return f"{what} was never sent"
        dests = ", ".join(dict.fromkeys(f"{t.dest[0]}:{t.dest[1]}" for t in tried))
        sends = sum(t.sends for t in tried)
        errors = [t for t in tried if t.response is not None and not t.ok]
        if errors:
            return f"{what} to {dests} got an error answer"
        return f"no STUN answer to {what} from {dests} ({sends} sends)"

    def _pending(self, *names: str) -> bool:
        return any(n in self._by_name and not self._by_name[n].done for n in names)

    @staticmethod
    def _mapped_of(t: _Transaction) -> Address | None:
        if not t.ok:
            return None
        attrs = t.response.attributes
        return attrs.get("XOR-MAPPED-ADDRESS", attrs.get("MAPPED-ADDRESS"))

    def _advance(self, now: float) -> None:
        # Loop: a finished phase may immediately finish the next (skipped tests).
        while self.report is None:
            before = self._phase
            getattr(self, f"_phase_{self._phase}")(now)
            if self._phase == before:
                return

    def _phase_test1(self, now: float) -> None:
        t = self._by_name["test1"]
        if not t.done:
            return
        if not t.ok:
            self._server_index += 1
            if self._server_index < len(self.servers) and self._probes < self.max_probes:
                del self._by_name["test1"]
                self._start("test1", self.servers[self._server_index], None, now)
                return
            self._finish(UNKNOWN, UNKNOWN, "failed", reason=f"{self._unanswered('test1')} ({BLOCKED_HINT})")
            return
        if t.sends == 1 and t.answered_at is not None:
            self._rtt_s = t.answered_at - t.started_at
        self._mapped = self._mapped_of(t)
        primary = t.dest
        other = t.response.attributes.get("OTHER-ADDRESS")
        if isinstance(other, tuple) and other[1] != primary[1]:
            self._other = _addr(other)
            self._mode = "rfc5780" if self._other[0] != primary[0] else "ports-only"
        elif len(self.servers) > self._server_index + 1:
            self._mode = "two-servers"
        else:
            self._mode = "single"
        if self._mode == "rfc5780":
            self._start("filter_ip_port", primary, CHANGE_IP | CHANGE_PORT, now)
            self._start("filter_port", primary, CHANGE_PORT, now)
        elif self._mode == "ports-only":
            self._start("filter_port", primary, CHANGE_PORT, now)
        self._phase = "filter"

    def _phase_filter(self, now: float) -> None:
        if self._pending("filter_ip_port", "filter_port"):
            return
        primary = self._by_name["test1"].dest
        fip, fport = self._by_name.get("filter_ip_port"), self._by_name.get("filter_port")
        # An address we sent to before the filtering tests (a failed-over Test I, an earlier run)
        # may have opened the NAT's filter for itself: an answer from it proves nothing.
        opened = self.contacted | {t.dest for t in self._txns.values() if t.name == "test1"}
        if self._mode == "rfc5780":
            alt_both = self._other
            alt_port = (primary[0], self._other[1])
            both_ok, port_ok = alt_both not in opened, alt_port not in opened
            if both_ok and fip is not None and fip.ok and fip.origin == alt_both:
                self._filtering = EIF
            elif port_ok and fport is not None and fport.ok and fport.origin == alt_port:
                self._filtering = ADF  # "at most" that when alt_both was opened before
            elif port_ok and fport is not None and fport.response is None and (
                    not both_ok or fip is None or fip.response is None):
                self._filtering = APDF  # a changed port alone is filtered
            else:  # errors, answers from the wrong place (CHANGE-REQUEST ignored), or opened filters
                self._filtering = UNKNOWN
        elif self._mode == "ports-only":
            if self._other in opened:
                self._filtering = UNKNOWN
            elif fport is not None and fport.ok and fport.origin == self._other:
                self._filtering = ADF  # at most address-dependent: cannot test a changed IP
            elif fport is not None and fport.response is None:
                self._filtering = APDF
        if self.local_address is not None and self._mapped == self.local_address:
            # No NAT: nothing maps. Open (DESIGN §3 step 4) unless a firewall measurably filters.
            self._finish(EIM, self._filtering, self._mode, "C" if self._filtering == APDF else "O")
            return
        if self._mode == "rfc5780":
            self._start("map2", (self._other[0], primary[1]), None, now)
        elif self._mode == "ports-only":
            self._start("map2", self._other, None, now)
        elif self._mode == "two-servers":
            self._start("map2", self.servers[self._server_index + 1], None, now)
        else:
            self._finish(UNKNOWN, self._filtering, self._mode,
                         reason=f"the STUN server {primary[0]}:{primary[1]} gave no OTHER-ADDRESS and no second server "
                                f"is configured, so the mapping cannot be tested")
            return
        self._phase = "map2"

    def _phase_map2(self, now: float) -> None:
        t = self._by_name["map2"]
        if not t.done:
            return
        m2 = self._mapped_of(t)
        if m2 is None:
            self._finish(UNKNOWN, self._filtering, self._mode, reason=self._unanswered("map2"))
        elif m2 == self._mapped:
            self._finish(EIM, self._filtering, self._mode)
        elif self._mode == "ports-only":
            self._finish(APDM, self._filtering, self._mode)
        elif self._mode == "two-servers":
            self._finish(ADM, self._filtering, self._mode)
        else:
            self._start("map3", self._other, None, now)
            self._phase = "map3"

    def _phase_map3(self, now: float) -> None:
        t = self._by_name["map3"]
        if not t.done:
            return
        m3 = self._mapped_of(t)
        if m3 is None:
            self._finish(UNKNOWN, self._filtering, self._mode, reason=self._unanswered("map3"))
        else:
            self._finish(ADM if m3 == self._mapped_of(self._by_name["map2"]) else APDM, self._filtering, self._mode)

    def _finish(self, mapping: str, filtering: str, discovery: str, cls: str | None = None, *,
                reason: str = "") -> None:
        for t in self._txns.values():
            t.done = True
        behind = None
        if self._mapped is not None and self.local_address is not None:
            behind = self._mapped != self.local_address
        self.report = NatReport(
            mapping=mapping, filtering=filtering, mapped_address=self._mapped,
            nat_class=cls or nat_class(mapping, filtering), probes=self._probes,
            rtt_ms=None if self._rtt_s is None else self._rtt_s * 1000.0,
            behind_nat=behind, discovery=discovery, reason=reason,
            probed=tuple(dict.fromkeys(t.dest for t in self._txns.values())))
        self._phase = "done"

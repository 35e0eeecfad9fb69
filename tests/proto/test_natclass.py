"""NAT behaviour discovery against an in-memory NAT model and a fake clock (no sockets).

The NAT model follows RFC 4787 §4.1 (mapping) and §5 (filtering); the server is the real
StunResponder. proto_spec §4.4-§4.6.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError
from kafilad.proto.natclass import ADF, ADM, APDF, APDM, EIF, EIM, UNKNOWN, NatClassifier, nat_class
from kafilad.proto.stun import Class, Message, Method, StunResponder, encode

LOCAL = ("10.0.1.2", 5000)
PUBLIC_IP = "203.0.113.5"
IP1, IP2, P1, P2 = "192.0.2.10", "192.0.2.11", 3478, 3479
FOUR = [(IP1, P1), (IP1, P2), (IP2, P1), (IP2, P2)]


@dataclass
class FakeNat:
    """One NAT box: ``mapping``/``filtering`` in RFC 4787 vocabulary; None mapping = no NAT."""

    mapping: str | None
    filtering: str | None
    next_port: int = 40000
    table: dict = field(default_factory=dict)        # mapping key -> public port
    reverse: dict = field(default_factory=dict)      # public port -> local address
    permits: set = field(default_factory=set)        # (public port, remote filter key)

    def outbound(self, src, dst):
        if self.mapping is None:
            return src
        key = {EIM: (src,), ADM: (src, dst[0]), APDM: (src, dst)}[self.mapping]
        if key not in self.table:
            self.table[key] = self.next_port
            self.reverse[self.next_port] = src
            self.next_port += 7
        port = self.table[key]
        self.permits.add((port, self._filter_key(dst)))
        return (PUBLIC_IP, port)

    def _filter_key(self, remote):
        return {EIF: None, ADF: remote[0], APDF: remote, None: None}[self.filtering]

    def inbound(self, src, dst):
        if self.mapping is None:
            if self.filtering is not None and (dst[1], self._filter_key(src)) not in self.permits:
                return None
            return dst
        if dst[0] != PUBLIC_IP or dst[1] not in self.reverse:
            return None
        if (dst[1], self._filter_key(src)) not in self.permits:
            return None
        return self.reverse[dst[1]]

    def note_outbound_without_nat(self, src, dst):
        self.permits.add((src[1], self._filter_key(dst)))


def run(nat: FakeNat, servers, responder_addresses=FOUR, *, loss=0.0, seed=0, local=LOCAL, **kw):
    """Pump datagrams between the classifier, the NAT and the responder on a fake clock."""
    rng = random.Random(seed)
    responder = StunResponder(responder_addresses) if responder_addresses else None
    machine = NatClassifier(servers, local_address=local, **kw)
    now, sent = 0.0, 0
    for _ in range(10_000):
        # Answers are handled inline and may start new tests: flush until nothing is queued.
        while batch := machine.datagrams_to_send(now):
            for data, dest in batch:
                sent += 1
                if rng.random() < loss:
                    continue
                if nat.mapping is None:
                    nat.note_outbound_without_nat(local, dest)
                public = nat.outbound(local, dest)
                if responder is None or tuple(dest) not in responder_addresses:
                    continue
                answer = responder.handle_datagram(data, dest, public)
                if answer is None or rng.random() < loss:
                    continue
                reply, origin = answer
                inside = nat.inbound(origin, public)
                if inside is not None:
                    machine.receive_datagram(reply, origin, now)
        if machine.done:
            return machine.report, now, sent
        timer = machine.get_timer()
        assert timer is not None and timer >= now
        now = timer
        machine.handle_timer(now)
    raise AssertionError("classifier never finished")


BEHAVIOURS = [(m, f) for m in (EIM, ADM, APDM) for f in (EIF, ADF, APDF)]


@pytest.mark.parametrize("mapping, filtering", BEHAVIOURS)
def test_full_discovery_finds_every_rfc4787_behaviour(mapping, filtering):
    report, elapsed_s, _ = run(FakeNat(mapping, filtering), [(IP1, P1)])
    assert (report.mapping, report.filtering) == (mapping, filtering)
    assert report.nat_class == {(EIM, EIF): "O", (EIM, ADF): "O", (EIM, APDF): "C"}.get((mapping, filtering), "S")
    assert report.discovery == "rfc5780"
    assert report.behind_nat is True
    assert report.mapped_address == (PUBLIC_IP, 40000)
    assert report.probes == (4 if mapping == EIM else 5)
    assert report.rtt_ms == 0.0
    # Two timed-out filtering tests at most: the whole run stays within 1.5 s + a hair.
    assert elapsed_s <= 1.5 + 1e-9


def test_no_nat_is_open_and_skips_mapping_tests():
    report, _, _ = run(FakeNat(None, None), [(IP1, P1)])
    assert (report.mapping, report.filtering, report.nat_class) == (EIM, EIF, "O")
    assert report.behind_nat is False and report.mapped_address == LOCAL
    assert report.probes == 3


def test_no_nat_behind_a_filtering_firewall_is_cone():
    report, _, _ = run(FakeNat(None, APDF), [(IP1, P1)])
    assert (report.mapping, report.filtering, report.nat_class) == (EIM, APDF, "C")


@pytest.mark.parametrize(
    "mapping, filtering, expected",
    [
        (EIM, EIF, (EIM, ADF, "O")),     # "address-dependent" here means "at most that"
        (EIM, ADF, (EIM, ADF, "O")),
        (EIM, APDF, (EIM, APDF, "C")),
        (APDM, APDF, (APDM, APDF, "S")),
        (APDM, EIF, (APDM, ADF, "S")),
        # Documented assumption: with one IP an address-dependent mapping looks independent.
        (ADM, APDF, (EIM, APDF, "C")),
    ],
)
def test_one_ip_two_ports_detects_port_dependent_mapping(mapping, filtering, expected):
    two_ports = [(IP1, P1), (IP1, P2)]
    report, _, _ = run(FakeNat(mapping, filtering), [(IP1, P1)], two_ports)
    assert (report.mapping, report.filtering, report.nat_class) == expected
    assert report.discovery == "ports-only"
    assert report.probes <= 3


@pytest.mark.parametrize("mapping, expected", [(EIM, EIM), (ADM, ADM), (APDM, ADM)])
def test_single_address_servers_use_the_second_server_for_mapping(mapping, expected):
    # Two single-address servers on different IPs; filtering cannot be tested.
    both = [(IP1, P1), (IP2, P1)]
    machine_servers = [(IP1, P1), (IP2, P1)]
    report, _, _ = run(FakeNat(mapping, APDF), machine_servers, both)
    # The responder has 2 IPs x 1 port: it advertises OTHER-ADDRESS with the same port, which
    # the classifier ignores, so this is the two-server path.
    assert report.discovery == "two-servers"
    assert (report.mapping, report.filtering) == (expected, UNKNOWN)
    assert report.nat_class == ("C" if mapping == EIM else "S")


def test_single_server_single_address_gives_an_unknown_class_and_says_why():
    report, _, _ = run(FakeNat(EIM, EIF), [(IP1, P1)], [(IP1, P1)])
    assert (report.mapping, report.filtering, report.nat_class, report.discovery) == (
        UNKNOWN, UNKNOWN, "unknown", "single")
    assert report.reason == ("the STUN server 192.0.2.10:3478 gave no OTHER-ADDRESS and no second server is "
                             "configured, so the mapping cannot be tested")
    assert report.probes == 1


def test_silent_server_fails_over_to_the_next_and_then_gives_up():
    report, elapsed_s, sent = run(FakeNat(EIM, APDF), [("192.0.2.99", P1), (IP1, P1)])
    assert report.discovery == "rfc5780" and report.nat_class == "C"
    assert report.probes == 5  # 1 lost + 4
    report, elapsed_s, sent = run(FakeNat(EIM, APDF), [("192.0.2.99", P1)], None)
    assert (report.mapping, report.nat_class, report.discovery, report.mapped_address) == (
        UNKNOWN, "unknown", "failed", None)
    assert report.reason == ("no STUN answer to Test I from 192.0.2.99:3478 (3 sends) (UDP to the rendezvous's "
                             "STUN ports may be blocked)")
    assert report.probes == 1
    # RFC 8489 §6.2.1 schedule 0, 0.5, 1.5 (then 3.5 > cap): three sends, then Test I's 3 s cap.
    assert sent == 3 and elapsed_s == pytest.approx(3.0)


def test_rto_follows_the_measured_rtt_but_not_below_the_floor():
    machine = NatClassifier([(IP1, P1)], local_address=LOCAL)
    (data, dest), = machine.datagrams_to_send(0.0)
    responder = StunResponder(FOUR)
    reply, origin = responder.handle_datagram(data, dest, (PUBLIC_IP, 40000))
    machine.receive_datagram(reply, origin, 0.040)  # 40 ms RTT
    sends = machine.datagrams_to_send(0.040)
    assert len(sends) == 2  # both filtering tests at once
    assert machine.get_timer() == pytest.approx(0.040 + 0.120)  # 3 x RTT
    machine.handle_timer(0.160)
    assert len(machine.datagrams_to_send(0.160)) == 2  # retransmissions...
    assert machine.report is None
    assert machine._probes == 3  # ...are not probes


RANK = {"O": 0, "C": 1, "S": 2}


@pytest.mark.parametrize("mapping, filtering", [(EIM, EIF), (EIM, ADF), (EIM, APDF), (APDM, APDF)])
def test_lossy_network_errs_only_towards_relay_or_unknown_and_mostly_gets_it_right(mapping, filtering):
    # 10% loss each way, 20 seeded runs. Retransmissions recover most losses; what they cannot
    # recover may only make the prediction more conservative (O -> C -> S), never less, or leave
    # the class honestly "unknown" with a reason.
    expected = nat_class(mapping, filtering)
    exact = 0
    for seed in range(20):
        report, elapsed_s, _ = run(FakeNat(mapping, filtering), [(IP1, P1)], loss=0.1, seed=seed)
        assert report.probes <= 6
        assert elapsed_s <= 5 * 1.5 + 1e-9
        if report.nat_class == "unknown":
            assert report.mapping == UNKNOWN and report.reason, (seed, report)
        else:
            assert RANK[report.nat_class] >= RANK[expected] and report.reason == "", (seed, report)
        exact += report.nat_class == expected
    assert exact >= 18


def test_an_unanswered_mapping_test_makes_the_class_unknown_not_s():
    # Test I and the filtering tests are answered, then every datagram to IP2 is lost (a firewall).
    responder = StunResponder(FOUR)
    machine = NatClassifier([(IP1, P1)], local_address=LOCAL)
    nat = FakeNat(EIM, APDF)
    now = 0.0
    while not machine.done:
        for data, dest in machine.datagrams_to_send(now):
            public = nat.outbound(LOCAL, dest)
            if dest[0] == IP2:
                continue
            reply, origin = responder.handle_datagram(data, dest, public)
            if nat.inbound(origin, public) is not None:
                machine.receive_datagram(reply, origin, now)
        if machine.done:
            break
        now = machine.get_timer()
        machine.handle_timer(now)
    report = machine.report
    assert (report.mapping, report.filtering, report.nat_class) == (UNKNOWN, APDF, "unknown")
    assert report.mapped_address == (PUBLIC_IP, 40000)  # Test I still gave the server-reflexive address
    assert report.reason.startswith("no STUN answer to Mapping II from 192.0.2.11:3478 ("), report.reason


def test_abort_reports_unknown_with_the_drivers_reason():
    machine = NatClassifier([(IP1, P1)], local_address=LOCAL)
    machine.datagrams_to_send(0.0)
    machine.abort("the classification did not finish within 6 s")
    assert machine.report.nat_class == "unknown" and machine.report.discovery == "failed"
    assert machine.report.reason == ("no STUN answer to Test I from 192.0.2.10:3478 (1 sends); the classification "
                                     "did not finish within 6 s (UDP to the rendezvous's STUN ports may be blocked)")


def test_the_capability_frame_accepts_the_unknown_class():
    from kafilad.proto import control as cf
    wire = {"t": "capability", "memory_bytes": 1 << 30, "nat_class": "unknown"}
    assert cf.decode_control(wire).nat_class == "unknown"


def test_ignores_unrelated_and_forged_datagrams():
    machine = NatClassifier([(IP1, P1)], local_address=LOCAL)
    machine.datagrams_to_send(0.0)
    machine.receive_datagram(b"\x00\x01garbage", (IP1, P1), 0.01)
    foreign = StunResponder(FOUR).handle_datagram(
        encode(Message(Method.BINDING, Class.REQUEST)), (IP1, P1), LOCAL)
    machine.receive_datagram(foreign[0], (IP1, P1), 0.01)  # unknown transaction id
    assert machine.report is None and machine.get_timer() == pytest.approx(0.5)


def test_needs_a_server():
    with pytest.raises(LocalProtocolError, match="at least one STUN server"):
        NatClassifier([])


# --- fuzzing ----------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, 200), junk=st.binary(max_size=80))
def test_fuzz_mutated_answers_never_raise_and_the_machine_still_finishes(flips, cut, junk):
    machine = NatClassifier([(IP1, P1)], local_address=LOCAL)
    responder = StunResponder(FOUR)
    (data, dest), = machine.datagrams_to_send(0.0)
    reply, origin = responder.handle_datagram(data, dest, (PUBLIC_IP, 40000))
    mutated = bytearray(reply)
    for pos, value in flips:
        if pos < len(mutated):
            mutated[pos] = value
    machine.receive_datagram(bytes(mutated[:cut] if cut < len(mutated) else mutated), origin, 0.01)
    machine.receive_datagram(junk, origin, 0.01)
    machine.receive_datagram(reply, ("not an ip", "x"), 0.01)
    machine.receive_datagram(reply, origin, 0.02)  # the genuine answer (ignored if a mutant won)
    now = 0.02
    while not machine.done:
        machine.datagrams_to_send(now)
        now = machine.get_timer()
        machine.handle_timer(now)
    assert machine.report.nat_class in ("O", "C", "S", "unknown")
    assert (machine.report.nat_class == "unknown") == bool(machine.report.reason)
    assert machine.report.probes <= 6


def test_a_filter_opened_by_an_earlier_run_is_not_read_as_open_filtering():
    # An earlier run (or a failed-over Test I) sent to the alternate port: an APDF NAT now lets
    # that address's answers in. Without knowing it, the classifier would report ADF (class O).
    def polluted():
        nat = FakeNat(EIM, APDF)
        nat.outbound(LOCAL, (IP1, P2))
        nat.outbound(LOCAL, (IP2, P2))
        return nat
    fooled, _, _ = run(polluted(), [(IP1, P1)])
    assert (fooled.filtering, fooled.nat_class) == (EIF, "O")  # what a rerun without memory concludes
    report, _, _ = run(polluted(), [(IP1, P1)], contacted=[(IP1, P2), (IP2, P2)])
    assert (report.mapping, report.filtering, report.nat_class) == (EIM, UNKNOWN, "C")  # the conservative class
    assert report.probed == ((IP1, P1), (IP2, P1))  # Test I and the filtering tests to P, Mapping II to IP2
    # only the alternate *port* opened: the changed-address test stays valid
    nat = FakeNat(EIM, APDF)
    nat.outbound(LOCAL, (IP2, P2))
    report, _, _ = run(nat, [(IP1, P1)], contacted=[(IP2, P2)])
    assert (report.filtering, report.nat_class) == (APDF, "C")

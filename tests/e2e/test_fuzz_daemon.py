"""Issue 3 "Done when": malformed STUN and check packets (property-based) and random datagrams fired
at RUNNING daemons' UDP sockets during a live session, and at the rendezvous's STUN ports, are
dropped: every process stays up, the session keeps generating token-identical output, its
direct edges stay direct, and the STUN responder still answers (proto_spec 07 §1, §3; 04 §4).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kafila_ctl.demo import LoopbackCluster
from kafila_testing import reference_tokens
from kafilad.proto.stun import Class, Message, Method, decode, encode

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="Linux loopback")]


def _free_udp_ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class FuzzCluster(LoopbackCluster):
    """A LoopbackCluster whose rendezvous also serves STUN on two ports and whose daemons bind
    their one UDP socket where the test can aim (``KAFILA_UDP_BIND=127.0.0.1:PORT``)."""

    def __init__(self, n: int, **kw):
        super().__init__(n, **kw)
        self.udp_ports = _free_udp_ports(n)
        p = _free_udp_ports(1)[0]
        self.stun = [("127.0.0.1", p), ("127.0.0.1", p + 1)] if p < 65535 else [("127.0.0.1", p)]

    def daemon_env(self, i: int) -> dict:
        return {**self.env, "KAFILA_UDP_BIND": f"127.0.0.1:{self.udp_ports[i]}"}


# ---- datagram strategies -----------------------------------------------------------------------

ufrag = st.text(alphabet="0123456789abcdef", min_size=0, max_size=12)


@st.composite
def stun_messages(draw) -> bytes:
    """Binding messages shaped like ICE checks and STUN answers, optionally signed, then mangled."""
    cls = draw(st.sampled_from([Class.REQUEST, Class.RESPONSE, Class.ERROR, Class.INDICATION]))
    msg = Message(Method.BINDING, cls, transaction_id=draw(st.binary(min_size=12, max_size=12)))
    if draw(st.booleans()):
        msg.attributes["USERNAME"] = f"{draw(ufrag)}:{draw(ufrag)}"
    if draw(st.booleans()):
        msg.attributes["PRIORITY"] = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        msg.attributes["ICE-CONTROLLING" if draw(st.booleans()) else "ICE-CONTROLLED"] = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        msg.attributes["USE-CANDIDATE"] = None
    if draw(st.booleans()):
        ip = str(ipaddress.IPv4Address(draw(st.integers(0, 2**32 - 1))))
        msg.attributes["XOR-MAPPED-ADDRESS"] = (ip, draw(st.integers(0, 65535)))
    if draw(st.booleans()):
        msg.attributes["CHANGE-REQUEST"] = draw(st.sampled_from([0, 2, 4, 6, 0xFFFFFFFF]))
    key = draw(st.one_of(st.none(), st.binary(min_size=1, max_size=32)))
    data = bytearray(encode(msg, integrity_key=key, fingerprint=draw(st.booleans())))
    how = draw(st.sampled_from(["intact", "truncate", "flip", "length", "append", "attr-length"]))
    if how == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif how == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    elif how == "length":
        data[2:4] = draw(st.integers(0, 65535)).to_bytes(2, "big")
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    elif how == "attr-length" and len(data) > 24:
        data[22:24] = draw(st.integers(0, 65535)).to_bytes(2, "big")
    return bytes(data)


def first_byte_in(lo: int, hi: int):
    return st.tuples(st.integers(lo, hi), st.binary(max_size=1400)).map(lambda t: bytes([t[0]]) + t[1])


datagrams = st.one_of(
    stun_messages(),
    first_byte_in(0, 3),        # STUN range, anything after
    first_byte_in(64, 127),     # QUIC short header: unknown connection ids
    first_byte_in(192, 255),    # QUIC long header: unknown connection ids, bogus Initials
    st.binary(max_size=1500),   # anything, including the empty datagram
)


def _stun_answers(addr) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        req = Message(Method.BINDING, Class.REQUEST)
        s.sendto(encode(req), addr)
        data, _ = s.recvfrom(2048)
        resp = decode(data)
        return resp is not None and resp.transaction_id == req.transaction_id and \
            resp.attributes["XOR-MAPPED-ADDRESS"][1] == s.getsockname()[1]
    finally:
        s.close()


def test_fuzzed_datagrams_leave_daemons_rendezvous_and_session_intact(tmp_path, synth_llama):
    prompt, n = "Kafila under fire", 200
    expected = reference_tokens(synth_llama, prompt, n)
    with FuzzCluster(3, root=str(tmp_path / "c")) as cluster:
        status = cluster.form(str(synth_llama))["status"]
        assert [e["path"] for e in status["edges"]] == ["direct"] * 3, status["edges"]
        assert {m["nat_class"] for m in status["members"]} == {"O"}  # classified against the rendezvous
        remotes = {int(e["remote"].rsplit(":", 1)[1]) for e in status["edges"]}
        assert remotes == set(cluster.udp_ports)  # the sockets we fire at are the ones the ring uses
        targets = [("127.0.0.1", p) for p in cluster.udp_ports] + cluster.stun
        assert all(_stun_answers(a) for a in cluster.stun)

        results: list = []
        stop = threading.Event()

        def generate() -> None:  # generations back to back for as long as the fuzzing lasts
            while not stop.is_set():
                try:
                    results.append(cluster.generate(prompt, n)["token_ids"])
                except Exception as e:  # reported by the assertion below
                    results.append(e)
                    return

        gen = threading.Thread(target=generate)
        gen.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sent = 0

        @settings(max_examples=600, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(datagrams)
        def fire(data: bytes) -> None:
            nonlocal sent
            for addr in targets:
                sock.sendto(data, addr)
                sent += 1

        try:
            fire()
        finally:
            stop.set()
            sock.close()
            gen.join(120)
        assert not gen.is_alive()
        assert sent >= 600 * len(targets) // 2
        assert results and all(r == expected for r in results), [r for r in results if r != expected][:1]

        for i, p in enumerate(cluster.daemons):
            assert p.poll() is None, f"{cluster.names[i]} died"
        assert cluster.rdv.poll() is None, "the rendezvous died"
        assert all(_stun_answers(a) for a in cluster.stun)
        after = cluster.generate(prompt, n)
        assert after["token_ids"] == expected
        snap = cluster.call(0, "status")
        assert snap["state"] == "ready" and [e["path"] for e in snap["edges"]] == ["direct"] * 3
        logs = {p.name: p.read_text(errors="replace") for p in cluster.root.glob("*.log")}
        assert not [name for name, text in logs.items() if "Traceback" in text], \
            {k: v[-2000:] for k, v in logs.items() if "Traceback" in v}

"""Rendezvous codec and sans-IO server state machine (proto_spec/03-rendezvous.md), no sockets."""

from __future__ import annotations

import hashlib
import hmac
import itertools

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError, RemoteProtocolError
from kafilad.proto.rendezvous import (
    CLOSE_POLICY_VIOLATION,
    CloseConn,
    ControlMessage,
    RecordPayload,
    RelayData,
    RendezvousLimits,
    RendezvousState,
    SendTo,
    TokenBucket,
    decode_message,
    encode_control,
    encode_relay,
    encode_relay_record,
    parse_relay_record,
)
from kafilad.proto.identity import fingerprint, peer_id
from kafilad.proto.rendezvous_proof import Challenge, make_proof, proof_input, public_key

# --- codec (proto_spec §1-§3, §7) -------------------------------------------------------------


def test_relay_layout_is_kind_then_big_endian_circuit_then_payload():
    assert encode_relay(0x0102030405060708, b"xyz") == b"\x01\x01\x02\x03\x04\x05\x06\x07\x08xyz"
    assert decode_message(b"\x01" + b"\xff" * 8) == RelayData(2**64 - 1, b"")


def test_control_layout_is_zero_then_msgpack_map():
    data = encode_control({"t": "join", "session_id": "abcdefgh"})
    assert data[0] == 0
    assert msgpack.unpackb(data[1:]) == {"t": "join", "session_id": "abcdefgh"}
    assert decode_message(data) == ControlMessage("join", {"t": "join", "session_id": "abcdefgh"})


def test_trailing_bytes_after_the_map_are_ignored():
    data = encode_control({"t": "leave"}) + b"\xc1future"
    assert decode_message(data).type == "leave"


@given(st.integers(0, 2**64 - 1), st.binary(max_size=300))
def test_relay_roundtrip(circuit_id, payload):
    assert decode_message(encode_relay(circuit_id, payload)) == RelayData(circuit_id, payload)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(st.text(min_size=1, max_size=20), st.dictionaries(st.text(max_size=8), _values, max_size=5))
def test_control_roundtrip(type_, fields):
    msg = {**fields, "t": type_}
    decoded = decode_message(encode_control(msg))
    assert decoded == ControlMessage(type_, msg)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"\x02abc", "Unknown rendezvous message kind 0x02"),
        (b"\x01\x00\x00\x00", "9-byte header"),
        (b"\x00" + msgpack.packb([1, 2]), "map with a string 't'"),
        (b"\x00" + msgpack.packb({"t": 5}), "map with a string 't'"),
        (b"\x00" + msgpack.packb({"t": "join", "x": "abcdef"})[:-3], "truncated"),
        (b"\x00\xc1", "not valid msgpack: it holds a byte that starts no msgpack value"),  # had no detail: ": ."
        (b"\x00" + b"\x91" * 2000 + b"\x00", "not valid msgpack: its values nest deeper than the decoder allows"),
        (b"\x00\x81\x01\x02", "not valid msgpack: int is not allowed for map key"),
        ("text", "binary WebSocket messages only"),
    ],
)
def test_malformed_messages_raise_remote_protocol_error(data, match):
    with pytest.raises(RemoteProtocolError, match=match):
        decode_message(data)


def test_encode_rejects_missing_type_and_oversized_circuit():
    with pytest.raises(LocalProtocolError, match="string 't'"):
        encode_control({"x": 1})
    with pytest.raises(LocalProtocolError, match="64-bit"):
        encode_relay(2**64, b"")


def test_relay_record_roundtrip_and_truncation():
    blob = encode_relay_record(7, b"abc") + encode_relay_record(0, b"") + encode_relay_record(2**64 - 1, b"z")
    assert blob[:12] == b"\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x03"
    assert parse_relay_record(blob) == [(7, b"abc"), (0, b""), (2**64 - 1, b"z")]
    with pytest.raises(RemoteProtocolError, match="truncated"):
        parse_relay_record(blob[:-1])


def test_token_bucket_lends_then_asks_for_the_debt_to_be_repaid():
    bucket = TokenBucket(rate_per_s=100.0, burst=50.0, now=0.0)
    assert bucket.consume(50, now=0.0) == 0.0
    assert bucket.consume(30, now=0.0) == pytest.approx(0.3)  # 30 tokens short at 100/s
    assert bucket.consume(10, now=1.0) == 0.0  # debt repaid, refilled to the 50-token cap
    assert bucket.consume(60, now=1.0) == pytest.approx(0.2)


# --- state machine (proto_spec §2, §4, §5, §6) -------------------------------------------------


def key(label: str) -> bytes:
    """A fixed X25519 static private key per test peer label ("H", "A", ...)."""
    return hashlib.blake2b(label.encode(), digest_size=32).digest()


def pid(label: str) -> str:
    """The peer id of `key(label)` (proto_spec 01 §1.1)."""
    return peer_id(public_key(key(label)))


#: the session code's host fingerprint of the harness host (key "H"), which a join must carry
HFP = fingerprint(public_key(key("H")))


H, A, B = pid("H"), pid("A"), pid("B")


class Harness:
    """One RendezvousState and the decoded traffic to each fake connection."""

    def __init__(self, limits: RendezvousLimits | None = None):
        counter = itertools.count(1)
        self.state = RendezvousState(limits, random_bytes=lambda n: next(counter).to_bytes(n, "big"))
        self.inbox: dict[int, list] = {}
        self.closed: dict[int, CloseConn] = {}
        self.challenges: dict[int, Challenge] = {}
        self.records: list[tuple[int, bytes]] = []
        self.now = 0.0

    def connect(self, conn: int, source: str | None = None) -> int:
        """Open `conn` (from address `source`); its `challenge` (proto_spec §2.4) is kept in
        `challenges`, not the inbox."""
        self.state.connection_made(conn, self.now, source)
        self.inbox[conn] = []
        self._drain()
        [hello] = self.take(conn)
        assert hello["t"] == "challenge" and len(hello["nonce"]) == 16
        self.challenges[conn] = Challenge(hello["server_public"], hello["nonce"])
        return conn

    def ident(self, conn: int, label: str, request_type: str, session_id: str = "", name: str = "",
              private: bytes | None = None) -> dict:
        """peer_id, name, static_public and proof of `key(label)` (or `private`) for a request on `conn`."""
        name = name or ("host" if label == "H" else label.lower())
        private = private or key(label)
        static_public, proof = make_proof(private, self.challenges[conn], request_type, session_id, name)
        return {"peer_id": peer_id(static_public), "name": name, "static_public": static_public, "proof": proof}

    def feed(self, conn: int, data) -> float:
        pause = self.state.receive_message(conn, data, self.now)
        self._drain()
        return pause

    def send(self, conn: int, **msg) -> float:
        return self.feed(conn, encode_control(msg))

    def lose(self, conn: int, reason: str = "gone") -> None:
        self.state.connection_lost(conn, reason)
        self._drain()

    def _drain(self) -> None:
        for action in self.state.actions():
            if isinstance(action, SendTo):
                msg = decode_message(action.data)
                self.inbox[action.conn].append(msg.fields if isinstance(msg, ControlMessage) else msg)
            elif isinstance(action, CloseConn):
                self.closed[action.conn] = action
            elif isinstance(action, RecordPayload):
                self.records.append((action.circuit_id, action.payload))

    def take(self, conn: int) -> list:
        out, self.inbox[conn] = self.inbox[conn], []
        return out

    def session(self, members: int = 3) -> str:
        """Host on conn 1, members on conns 2..; returns the session id."""
        self.connect(1)
        self.send(1, t="register", model_id="m", members=members, capability={"memory_bytes": 1}, req=1,
                  **self.ident(1, "H", "register"))
        [reply] = self.take(1)
        return reply["session_id"]

    def join(self, conn: int, sid: str, peer: str) -> list:
        self.connect(conn)
        self.send(conn, t="join", host_fingerprint=HFP, session_id=sid, req=9, **self.ident(conn, peer, "join", sid))
        return self.take(conn)


def test_register_returns_eight_base32_chars_and_join_tells_everyone():
    h = Harness()
    sid = h.session()
    assert len(sid) == 8 and set(sid) <= set("abcdefghijklmnopqrstuvwxyz234567")
    assert h.join(2, sid, "A") == [{"t": "joined", "session_id": sid, "host_peer_id": H, "model_id": "m",
                                   "members": [{"peer_id": H, "name": "host"}, {"peer_id": A, "name": "a"}],
                                   "req": 9}]
    assert h.take(1) == [{"t": "member_joined", "peer_id": A, "name": "a"}]
    h.join(3, sid.upper(), "B")  # codes may be typed in upper case
    assert h.take(1) == [{"t": "member_joined", "peer_id": B, "name": "b"}]
    assert h.take(2) == [{"t": "member_joined", "peer_id": B, "name": "b"}]


def test_join_refusals_are_errors_that_keep_the_connection():
    h = Harness()
    sid = h.session(members=2)
    [err] = h.join(2, "zzzzzzzz", "A")
    assert err["t"] == "error" and err["code"] == "unknown_session" and err["fatal"] is False
    assert err["req"] == 9 and "No session 'zzzzzzzz'" in err["reason"]
    [err] = h.join(3, sid, "H")
    assert err["code"] == "duplicate_peer"
    assert err["reason"] == f"Peer {H!r} is the host of session {sid!r}; a host cannot also join its own session."
    assert h.join(4, sid, "A")[0]["t"] == "joined"
    [err] = h.join(5, sid, "B")
    assert err["code"] == "session_full" and err["reason"] == f"Session {sid!r} already has all 2 members."
    assert h.closed == {}


def test_invalid_member_count_and_double_register_are_refused():
    h = Harness(RendezvousLimits(max_members=4))
    h.connect(1)
    h.send(1, t="register", model_id="m", members=5, capability={}, **h.ident(1, "H", "register"))
    assert h.take(1)[0]["reason"] == "A session has 1 to 4 members; 5 were asked for."
    h.send(1, t="register", model_id="m", members=2, capability={}, **h.ident(1, "H", "register"))
    assert h.take(1)[0]["t"] == "registered"
    h.send(1, t="join", host_fingerprint=HFP, session_id="x", **h.ident(1, "H", "join", "x"))
    assert h.take(1)[0]["code"] == "already_in_session"


def test_signal_is_forwarded_with_sender_and_recorded():
    h = Harness()
    sid = h.session()
    h.join(2, sid, "A")
    h.take(1)
    h.send(2, t="signal", to=H, body={"cand": [1, 2]})
    assert h.take(1) == [{"t": "signal", "from": A, "body": {"cand": [1, 2]}}]
    assert h.records == [(0, msgpack.packb({"cand": [1, 2]}))]
    h.send(2, t="signal", to="nobody", body=None, req=4)
    assert h.take(2) == [{"t": "error", "code": "unknown_peer", "fatal": False, "req": 4,
                          "reason": f"Peer 'nobody' is not a member of session {sid!r}."}]


def open_circuit(h: Harness, opener: int, to: str, req: int = 1) -> int:
    h.take(opener)  # earlier traffic is not under test here
    h.send(opener, t="circuit_open", to=to, label="ring", req=req)
    [opened] = h.take(opener)
    assert opened["t"] == "circuit_opened" and opened["req"] == req and opened["to"] == to
    return opened["circuit"]


def test_circuit_relays_both_ways_and_close_propagates():
    h = Harness()
    sid = h.session()
    h.join(2, sid, "A")
    h.take(1)
    cid = open_circuit(h, 1, A)
    assert h.take(2) == [{"t": "circuit_incoming", "circuit": cid, "from": H, "label": "ring"}]
    h.feed(1, encode_relay(cid, b"\x00ciphertext"))
    h.feed(2, encode_relay(cid, b"reply"))
    assert h.take(2) == [RelayData(cid, b"\x00ciphertext")]
    assert h.take(1) == [RelayData(cid, b"reply")]
    assert h.records == [(cid, b"\x00ciphertext"), (cid, b"reply")]
    cid2 = open_circuit(h, 2, H, req=2)
    assert cid2 != cid
    h.send(2, t="circuit_close", circuit=cid, reason="done")
    assert h.take(1)[1:] == [{"t": "circuit_closed", "circuit": cid, "reason": "done"}]
    h.feed(1, encode_relay(cid, b"late"))
    [closed] = h.take(1)
    assert closed["t"] == "circuit_closed" and closed["circuit"] == cid
    assert h.take(2) == []


def test_outsider_cannot_send_on_someone_elses_circuit():
    h = Harness()
    sid = h.session()
    h.join(2, sid, "A")
    h.join(3, sid, "B")
    cid = open_circuit(h, 1, A)
    h.take(2)
    h.feed(3, encode_relay(cid, b"inject"))
    assert h.take(2) == [] and h.take(3)[-1]["t"] == "circuit_closed"


def test_member_disconnect_closes_its_circuits_then_notifies():
    h = Harness()
    sid = h.session()
    h.join(2, sid, "A")
    h.join(3, sid, "B")
    cid_ha = open_circuit(h, 1, A)
    cid_ab = open_circuit(h, 2, B, req=5)
    cid_hb = open_circuit(h, 3, H, req=6)
    for c in (1, 2, 3):
        h.take(c)
    h.lose(2, "network unreachable")
    assert [m["t"] for m in h.take(1)] == ["circuit_closed", "member_left"]
    assert h.take(3) == [
        {"t": "circuit_closed", "circuit": cid_ab, "reason": "Peer 'a' left the session: network unreachable"},
        {"t": "member_left", "peer_id": A, "reason": "network unreachable"},
    ]
    h.feed(1, encode_relay(cid_hb, b"still"))
    assert h.take(3) == [RelayData(cid_hb, b"still")]
    assert cid_ha not in (cid_ab, cid_hb)


def test_host_leaving_closes_the_session():
    h = Harness()
    sid = h.session()
    h.join(2, sid, "A")
    cid = open_circuit(h, 2, H)
    h.take(1)
    h.send(1, t="leave", reason="bye")
    assert h.take(2) == [
        {"t": "circuit_closed", "circuit": cid, "reason": "The session host left: bye"},
        {"t": "session_closed", "session_id": sid, "reason": "The host 'host' left the session: bye"},
    ]
    assert h.state.session_count == 0
    assert h.join(3, sid, "B")[0]["code"] == "unknown_session"
    h.send(2, t="signal", to=H, body=1)
    assert h.take(2)[0]["code"] == "not_in_session"


@pytest.mark.parametrize(
    "data, code",
    [
        (b"\x07", "malformed"),
        ("a text message", "malformed"),
        (encode_control({"t": "join", "session_id": 5, "peer_id": "A", "name": "a"}), "malformed"),
        (encode_control({"t": "circuit_open", "to": "A", "label": "x", "req": True}), "malformed"),
        (encode_relay(1, b"x" * 101), "message_too_large"),
        (encode_control({"t": "signal", "to": "A", "body": "x" * 400}), "message_too_large"),
    ],
)
def test_violations_close_only_the_offending_connection(data, code):
    h = Harness(RendezvousLimits(max_relay_payload_bytes=100, max_control_bytes=400))
    sid = h.session()
    h.join(2, sid, "A")
    h.take(1)
    h.feed(2, data)
    [err] = h.take(2)
    assert err["t"] == "error" and err["code"] == code and err["fatal"] is True
    assert h.closed[2].code == (1008 if code == "malformed" else 1009)
    assert list(h.closed) == [2]
    assert h.take(1) == [{"t": "member_left", "peer_id": A, "reason": f"it sent a bad message: {err['reason']}"}]
    assert h.join(3, sid, "B")[0]["t"] == "joined"  # the server carries on


def test_unknown_type_is_a_non_fatal_error():
    h = Harness()
    h.connect(1)
    h.send(1, t="teleport", req=3)
    assert h.take(1) == [{"t": "error", "code": "unknown_type", "fatal": False, "req": 3,
                          "reason": "The rendezvous does not know message type 'teleport'."}]
    assert h.closed == {}


def test_byte_budget_drops_data_and_closes_the_circuit_with_a_clear_error():
    h = Harness(RendezvousLimits(session_budget_bytes=10))
    sid = h.session()
    h.join(2, sid, "A")
    cid = open_circuit(h, 1, A)
    h.take(2)
    h.feed(1, encode_relay(cid, b"123456"))
    h.feed(1, encode_relay(cid, b"1234"))
    h.feed(1, encode_relay(cid, b"x"))
    reason = f"Session {sid!r} has used its relay budget of 10 bytes; the circuit is closed."
    assert h.take(1) == [{"t": "error", "code": "budget_exhausted", "reason": reason, "fatal": False},
                         {"t": "circuit_closed", "circuit": cid, "reason": reason}]
    assert h.take(2) == [RelayData(cid, b"123456"), RelayData(cid, b"1234"),
                         {"t": "circuit_closed", "circuit": cid, "reason": reason}]
    assert [p for _, p in h.records] == [b"123456", b"1234"]


def test_rate_limit_pauses_the_reader_instead_of_dropping():
    h = Harness(RendezvousLimits(session_rate_Bps=1000.0, session_burst_bytes=1000.0,
                                 control_rate_per_s=10.0, control_burst=2.0))
    sid = h.session()  # 1 control message from conn 1
    h.join(2, sid, "A")
    cid = open_circuit(h, 1, A)  # 2nd: bucket empty, no pause yet
    h.take(2)
    assert h.feed(1, encode_relay(cid, b"x" * 1000)) == 0.0
    assert h.feed(1, encode_relay(cid, b"x" * 500)) == pytest.approx(0.5)
    assert len(h.take(2)) == 2  # both forwarded
    assert h.send(1, t="signal", to=A, body=0) == pytest.approx(0.1)
    h.now = 2.0
    assert h.feed(1, encode_relay(cid, b"x" * 500)) == 0.0


_field_values = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=10),
                          st.binary(max_size=10), st.dictionaries(st.text(max_size=4), st.integers(0, 9), max_size=2),
                          st.lists(st.integers(0, 9), max_size=2))
_fuzz_messages = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=10),
    st.builds(lambda t, f: encode_control({**f, "t": t}),
              st.sampled_from(["register", "join", "leave", "signal", "circuit_open", "circuit_close", "x"]),
              st.dictionaries(st.sampled_from(["model_id", "members", "capability", "peer_id", "name", "session_id",
                                               "to", "body", "label", "req", "circuit", "reason",
                                               "static_public", "proof"]),
                              _field_values, max_size=8)),
    st.builds(encode_relay, st.integers(0, 3), st.binary(max_size=20)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), _fuzz_messages), max_size=25))
def test_any_input_yields_actions_never_an_exception(script):
    h = Harness(RendezvousLimits(max_relay_payload_bytes=16))
    sid = h.session(members=3)
    h.join(2, sid, "A")
    h.connect(3)
    for conn, data in script:
        h.feed(conn, data)  # must not raise
    for conn in (1, 2, 3):
        h.lose(conn)
    assert h.state.session_count == 0


# --- identity: proof of the static key (proto_spec §2.4) -----------------------------------------

#: Two static keys whose peer ids collide (40 bits; found by a birthday search over
#: blake2b(b"kafila collision %d", 32) for i < 405,291). Both ids are "6vtnqtm4".
COLLIDING_KEYS = tuple(hashlib.blake2b(b"kafila collision %d" % i, digest_size=32).digest() for i in (119_529, 405_290))
PROOF_REQUIRED = ("A 'join' must carry 'static_public' (32 bytes) and 'proof' (64 bytes): this rendezvous admits a "
                  "peer id only with proof of its static key (proto_spec 03 §2.4). Upgrade the daemon.")


def bad_proof_reason(peer: str) -> str:
    return (f"The proof for peer {peer!r} does not verify against this connection's challenge: the client does "
            "not hold that peer's static key, or reused a proof made for another connection or request.")


def test_every_connection_gets_its_own_challenge():
    h = Harness()
    c1, c2 = h.challenges[h.connect(1)], h.challenges[h.connect(2)]
    assert len(c1.server_public) == 32 and len(c1.nonce) == 16
    assert c1.server_public != c2.server_public and c1.nonce != c2.nonce


def test_squatter_without_the_key_is_refused_and_the_real_member_still_joins():
    h = Harness()
    sid = h.session(members=2)  # one slot left
    h.connect(2)
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, peer_id=A, name="a", req=1)  # the id alone, as before proofs
    assert h.take(2) == [{"t": "error", "code": "proof_required", "fatal": False, "req": 1, "reason": PROOF_REQUIRED}]
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, req=2, **{**h.ident(2, "S", "join", sid, name="a"), "peer_id": A})
    [err] = h.take(2)
    assert (err["code"], err["fatal"]) == ("peer_id_mismatch", False)
    assert err["reason"] == (f"Peer id {A!r} is not the id of the static key presented (that key's id is "
                             f"{pid('S')!r}); a daemon may use only the peer id of its own key.")
    forged = h.ident(2, "S", "join", sid, name="a")["proof"]  # A's public key is no secret; its private key is
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, peer_id=A, name="a", static_public=public_key(key("A")), proof=forged, req=3)
    assert h.take(2) == [{"t": "error", "code": "bad_proof", "fatal": False, "req": 3, "reason": bad_proof_reason(A)}]
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, peer_id=A, name="a", static_public=public_key(key("A")),
           proof=bytes(64), req=4)
    assert h.take(2)[0]["code"] == "bad_proof"
    assert h.take(1) == [] and h.closed == {}  # the host never heard of the squatter
    assert h.join(3, sid, "A")[0]["t"] == "joined"  # the real A takes the last slot
    assert h.take(1) == [{"t": "member_joined", "peer_id": A, "name": "a"}]


def test_register_needs_a_proof_too():
    h = Harness()
    h.connect(1)
    h.send(1, t="register", model_id="m", members=2, capability={}, peer_id=H, name="host")
    [err] = h.take(1)
    assert err["code"] == "proof_required" and err["reason"].startswith("A 'register' must carry 'static_public'")
    assert h.state.session_count == 0


def test_a_low_order_key_proves_nothing():
    """X25519 with a low-order point gives an all-zero secret anyone can compute (RFC 7748 §6.1)."""
    h = Harness()
    sid = h.session()
    h.connect(2)
    low_order = bytes(32)
    mac = hmac.new(bytes(32), proof_input(h.challenges[2], low_order, "join", sid, "z"), hashlib.blake2b).digest()
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, peer_id=peer_id(low_order), name="z", static_public=low_order, proof=mac)
    assert h.take(2)[0]["code"] == "bad_proof"


def test_a_proof_replayed_on_another_connection_or_request_is_refused():
    h = Harness()
    sid = h.session(members=4)
    h.connect(2)
    seen = encode_control({"t": "join", "host_fingerprint": HFP, "session_id": sid, **h.ident(2, "A", "join", sid)})
    h.feed(2, seen)
    assert h.take(2)[0]["t"] == "joined"
    h.connect(3)  # an eavesdropper replays the bytes it saw on its own connection (another challenge)
    h.feed(3, seen)
    assert h.take(3) == [{"t": "error", "code": "bad_proof", "fatal": False, "reason": bad_proof_reason(A)}]
    h.connect(4)  # a proof is bound to the request type, session id and name, too
    register_proof = h.ident(4, "B", "register")
    h.send(4, t="join", host_fingerprint=HFP, session_id=sid, **register_proof)
    renamed = {**h.ident(4, "B", "join", sid), "name": "mallory"}
    h.send(4, t="join", host_fingerprint=HFP, session_id=sid, **renamed)
    assert [e["code"] for e in h.take(4)] == ["bad_proof", "bad_proof"]
    assert h.join(5, sid, "B")[0]["t"] == "joined"


def test_a_proven_rejoin_replaces_the_stale_connection_even_in_a_full_session():
    h = Harness()
    sid = h.session(members=2)
    h.join(2, sid, "A")
    cid = open_circuit(h, 1, A)
    h.take(2)
    [joined] = h.join(3, sid, "A")  # A's daemon reconnected; its old WebSocket is half-open
    assert joined["t"] == "joined"
    assert joined["members"] == [{"peer_id": H, "name": "host"}, {"peer_id": A, "name": "a"}]
    reason = f"Peer {A!r} joined session {sid!r} again from a newer connection, which replaces this one."
    assert h.take(2) == [{"t": "error", "code": "superseded", "reason": reason, "fatal": True}]
    assert h.closed == {2: CloseConn(2, 4001, reason[:120])}
    assert h.take(1) == [
        {"t": "circuit_closed", "circuit": cid, "reason": "Peer 'a' left the session: it rejoined from a new connection"},
        {"t": "member_left", "peer_id": A, "reason": "it rejoined from a new connection"},
        {"t": "member_joined", "peer_id": A, "name": "a"},
    ]
    h.send(1, t="signal", to=A, body="hi")
    assert h.take(3) == [{"t": "signal", "from": H, "body": "hi"}]
    h.send(2, t="signal", to=H, body="from the stale one")  # forgotten: ignored
    assert h.take(1) == [] and h.take(2) == []


def test_same_peer_id_under_another_key_cannot_replace_the_member():
    first, second = COLLIDING_KEYS
    assert peer_id(public_key(first)) == peer_id(public_key(second))
    h = Harness()
    sid = h.session()
    h.connect(2)
    h.send(2, t="join", host_fingerprint=HFP, session_id=sid, **h.ident(2, "", "join", sid, name="first", private=first))
    assert h.take(2)[0]["t"] == "joined"
    h.connect(3)
    h.send(3, t="join", host_fingerprint=HFP, session_id=sid, **h.ident(3, "", "join", sid, name="second", private=second))
    [err] = h.take(3)
    assert err["code"] == "duplicate_peer"
    assert err["reason"] == (f"Peer {peer_id(public_key(first))!r} is already a member of session {sid!r} "
                             "with a different static key.")
    assert h.closed == {}


def test_the_session_id_alone_finds_nothing_and_holds_no_slot():
    """issue 22 item 1: an outsider who saw the 8-character id (not the code's fingerprint) learns
    nothing, is told what a wrong id is told, and takes no slot; a session of another key under the
    same id is another session."""
    h = Harness()
    sid = h.session(members=2)
    h.connect(2)
    h.send(2, t="join", session_id=sid, req=1, host_fingerprint="a" * 16, **h.ident(2, "B", "join", sid))
    [guessed] = h.take(2)
    h.send(2, t="join", session_id="zzzzzzzz", req=1, host_fingerprint="a" * 16, **h.ident(2, "B", "join", "zzzzzzzz"))
    [absent] = h.take(2)
    assert guessed["code"] == absent["code"] == "unknown_session"
    assert guessed["reason"].replace(sid, "X") == absent["reason"].replace("zzzzzzzz", "X")
    h.send(2, t="join", session_id=sid, req=2, **h.ident(2, "B", "join", sid))  # no fingerprint at all
    assert h.take(2)[0]["code"] == "fingerprint_required"
    assert h.take(1) == []  # the host heard of none of it
    assert h.join(3, sid, "A")[0]["t"] == "joined"  # the one free slot is still free
    assert h.take(1) == [{"t": "member_joined", "peer_id": A, "name": "a"}]
    h.connect(4)  # another key registers the same id: its own session; H's is untouched
    h.send(4, t="register", model_id="m2", members=2, capability={}, session_id=sid, req=1,
           **h.ident(4, "B", "register", sid))
    assert h.take(4)[0]["t"] == "registered" and h.state.session_count == 2
    assert h.take(1) == [] and h.take(3) == []


def test_one_source_cannot_fill_the_rendezvous():
    """issue 22 item 2: connections, sessions, joins, circuits and relay bytes are limited per source
    address (and sessions per host key); past a limit a sentence, and other sources go on."""
    lim = RendezvousLimits(max_connections_per_source=3, max_sessions_per_source=2, max_sessions_per_key=2,
                           max_circuits_per_source=1, joins_per_source_per_s=1.0, joins_burst_per_source=2.0,
                           relay_rate_per_source_Bps=1000.0, relay_burst_per_source_bytes=1000.0)
    h = Harness(lim)
    for conn, label in ((1, "H"), (2, "B")):
        h.connect(conn, "10.0.0.9")
        h.send(conn, t="register", model_id="m", members=3, capability={}, req=1, **h.ident(conn, label, "register"))
        assert h.take(conn)[0]["t"] == "registered"
    h.connect(3, "10.0.0.9")
    h.send(3, t="register", model_id="m", members=3, capability={}, req=1, **h.ident(3, "C", "register"))
    [err] = h.take(3)
    assert err["code"] == "too_many_sessions" and "Address 10.0.0.9 already hosts 2 sessions" in err["reason"]
    h.inbox[4] = []
    h.state.connection_made(4, h.now, "10.0.0.9")  # a fourth connection from the same address
    h._drain()
    assert h.closed[4].code == CLOSE_POLICY_VIOLATION and "already has 3 connections" in h.closed[4].reason
    # another address is served as before
    h.connect(5, "10.0.0.7")
    h.send(5, t="register", model_id="m", members=3, capability={}, req=1, **h.ident(5, "R", "register"))
    assert h.take(5)[0]["t"] == "registered"
    # joins from one address: a burst of 2, then 1 a second
    sid = h.state._conns[1].session_id.split("-")[0]
    codes = []
    for conn, label in ((6, "A"), (7, "X"), (8, "Y")):
        h.connect(conn, "10.0.0.8")
        h.send(conn, t="join", host_fingerprint=HFP, session_id=sid, req=1, **h.ident(conn, label, "join", sid))
        codes.append(h.take(conn)[0].get("code", "joined"))
    assert codes == ["joined", "joined", "rate_limited"]
    # one circuit per address; relay bytes past the address's rate pause its reader
    h.take(1)
    h.send(6, t="circuit_open", to=H, label="x", req=2)
    [opened] = [m for m in h.take(6) if m["t"] == "circuit_opened"]
    h.send(7, t="circuit_open", to=H, label="x", req=2)
    assert [m["code"] for m in h.take(7) if m["t"] == "error"] == ["too_many_circuits"]
    assert h.feed(6, encode_relay(opened["circuit"], b"x" * 900)) == 0.0
    assert h.feed(6, encode_relay(opened["circuit"], b"x" * 900)) == pytest.approx(0.8)
    h.lose(6)  # its circuit and connection go back to the address
    h.connect(9, "10.0.0.8")
    h.send(9, t="circuit_open", to=H, label="x", req=2)
    assert h.take(9)[0]["code"] == "not_in_session"

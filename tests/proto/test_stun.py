"""STUN codec: RFC 5769 vectors, the RFC 5780 responder, and fuzzing (proto_spec §4)."""

from __future__ import annotations

import hashlib
import struct

import pytest
from aioice.stun import pack_xor_address
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError
from kafilad.proto.stun import (
    CHANGE_IP,
    CHANGE_PORT,
    Class,
    Message,
    Method,
    StunResponder,
    attribute_types,
    decode,
    encode,
    looks_like_stun,
)


def hexbytes(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


# RFC 5769 §2.1 Sample Request (short-term credential).
SAMPLE_REQUEST = hexbytes("""
    00 01 00 58 21 12 a4 42 b7 e7 a7 01 bc 34 d6 86 fa 87 df ae
    80 22 00 10 53 54 55 4e 20 74 65 73 74 20 63 6c 69 65 6e 74
    00 24 00 04 6e 00 01 ff
    80 29 00 08 93 2f f9 b1 51 26 3b 36
    00 06 00 09 65 76 74 6a 3a 68 36 76 59 20 20 20
    00 08 00 14 9a ea a7 0c bf d8 cb 56 78 1e f2 b5 b2 d3 f2 49 c1 b5 71 a2
    80 28 00 04 e5 7a 3b cf
""")
SAMPLE_PASSWORD = b"VOkJxbRl1RmTxUk/WvJxBt"
SAMPLE_TID = hexbytes("b7 e7 a7 01 bc 34 d6 86 fa 87 df ae")

# RFC 5769 §2.2 Sample IPv4 Response.
IPV4_RESPONSE = hexbytes("""
    01 01 00 3c 21 12 a4 42 b7 e7 a7 01 bc 34 d6 86 fa 87 df ae
    80 22 00 0b 74 65 73 74 20 76 65 63 74 6f 72 20
    00 20 00 08 00 01 a1 47 e1 12 a6 43
    00 08 00 14 2b 91 f5 99 fd 9e 90 c3 8c 74 89 f9 2a f9 ba 53 f0 6b e7 d7
    80 28 00 04 c0 7d 4c 96
""")

# RFC 5769 §2.3 Sample IPv6 Response.
IPV6_RESPONSE = hexbytes("""
    01 01 00 48 21 12 a4 42 b7 e7 a7 01 bc 34 d6 86 fa 87 df ae
    80 22 00 0b 74 65 73 74 20 76 65 63 74 6f 72 20
    00 20 00 14 00 02 a1 47 01 13 a9 fa a5 d3 f1 79 bc 25 f4 b5 be d2 b9 d9
    00 08 00 14 a3 82 95 4e 4b e6 7b f1 17 84 c9 7c 82 92 c2 75 bf e3 ed 41
    80 28 00 04 c8 fb 0b 4c
""")

# RFC 5769 §2.4 Sample Request with Long-Term Authentication.
LONG_TERM_REQUEST = hexbytes("""
    00 01 00 60 21 12 a4 42 78 ad 34 33 c6 ad 72 c0 29 da 41 2e
    00 06 00 12 e3 83 9e e3 83 88 e3 83 aa e3 83 83 e3 82 af e3 82 b9 00 00
    00 15 00 1c 66 2f 2f 34 39 39 6b 39 35 34 64 36 4f 4c 33 34 6f 4c 39 46 53 54 76 79 36 34 73 41
    00 14 00 0b 65 78 61 6d 70 6c 65 2e 6f 72 67 00
    00 08 00 14 f6 70 24 65 6d d6 4a 3e 02 b8 e0 71 2e 85 c9 a2 8c a8 96 66
""")
LONG_TERM_NONCE = b"f//499k954d6OL34oL9FSTvy64sA"
LONG_TERM_USERNAME = "\u30de\u30c8\u30ea\u30c3\u30af\u30b9"
LONG_TERM_KEY = hashlib.md5(f"{LONG_TERM_USERNAME}:example.org:TheMatrIX".encode()).digest()


# --- RFC 5769 vectors -----------------------------------------------------------------------------

def test_rfc5769_sample_request_decodes_and_authenticates():
    message = decode(SAMPLE_REQUEST)
    assert message is not None
    assert message.message_method == Method.BINDING and message.message_class == Class.REQUEST
    assert message.transaction_id == SAMPLE_TID
    assert message.attributes["SOFTWARE"] == "STUN test client"
    assert message.attributes["PRIORITY"] == 0x6E0001FF
    assert message.attributes["ICE-CONTROLLED"] == 0x932FF9B151263B36
    assert message.attributes["USERNAME"] == "evtj:h6vY"
    assert message.attributes["FINGERPRINT"] == 0xE57A3BCF
    assert message.check_message_integrity(SAMPLE_PASSWORD)
    assert not message.check_message_integrity(b"wrong password")


@pytest.mark.parametrize(
    "vector, mapped, xor_slice",
    [
        (IPV4_RESPONSE, ("192.0.2.1", 32853), slice(40, 48)),
        (IPV6_RESPONSE, ("2001:db8:1234:5678:11:2233:4455:6677", 32853), slice(40, 60)),
    ],
    ids=["ipv4", "ipv6"],
)
def test_rfc5769_responses_decode_authenticate_and_xor_address_encodes_exactly(vector, mapped, xor_slice):
    message = decode(vector)
    assert message is not None
    assert message.message_class == Class.RESPONSE
    assert message.attributes["SOFTWARE"] == "test vector"
    assert message.attributes["XOR-MAPPED-ADDRESS"] == mapped
    assert message.check_message_integrity(SAMPLE_PASSWORD)
    assert pack_xor_address(mapped, SAMPLE_TID) == vector[xor_slice]


def test_rfc5769_long_term_request_decodes_and_reencodes_byte_exact():
    message = decode(LONG_TERM_REQUEST)
    assert message is not None
    assert message.attributes["USERNAME"] == LONG_TERM_USERNAME
    assert message.attributes["NONCE"] == LONG_TERM_NONCE
    assert message.attributes["REALM"] == "example.org"
    assert message.check_message_integrity(LONG_TERM_KEY)

    rebuilt = Message(Method.BINDING, Class.REQUEST, transaction_id=message.transaction_id, attributes={
        "USERNAME": LONG_TERM_USERNAME, "NONCE": LONG_TERM_NONCE, "REALM": "example.org"})
    wire = encode(rebuilt, integrity_key=LONG_TERM_KEY)
    # Our encoder appends FINGERPRINT after MESSAGE-INTEGRITY; the vector stops at MESSAGE-INTEGRITY.
    without_fingerprint = wire[:2] + struct.pack("!H", len(wire) - 20 - 8) + wire[4:-8]
    assert without_fingerprint == LONG_TERM_REQUEST


def test_encode_roundtrip_with_integrity_and_fingerprint():
    request = Message(Method.BINDING, Class.REQUEST, transaction_id=SAMPLE_TID,
                      attributes={"USERNAME": "evtj:h6vY", "PRIORITY": 0x6E0001FF})
    wire = encode(request, integrity_key=SAMPLE_PASSWORD)
    back = decode(wire)
    assert back is not None and back.check_message_integrity(SAMPLE_PASSWORD)
    assert attribute_types(wire) == [0x0006, 0x0024, 0x0008, 0x8028]


def test_decode_rejects_bad_fingerprint_cookie_and_length():
    bad_fingerprint = SAMPLE_REQUEST[:-1] + bytes([SAMPLE_REQUEST[-1] ^ 1])
    assert decode(bad_fingerprint) is None
    bad_cookie = SAMPLE_REQUEST[:4] + b"\x21\x12\xa4\x43" + SAMPLE_REQUEST[8:]
    assert decode(bad_cookie) is None
    assert decode(SAMPLE_REQUEST[:-4]) is None  # length field no longer matches
    assert decode(b"\x40" + SAMPLE_REQUEST[1:]) is None  # first byte 64-127: QUIC (RFC 9443)
    assert not looks_like_stun(b"\xc0" + bytes(40))


# --- responder ------------------------------------------------------------------------------------

FOUR = [("192.0.2.10", 3478), ("192.0.2.10", 3479), ("192.0.2.11", 3478), ("192.0.2.11", 3479)]
CLIENT = ("198.51.100.7", 40001)


def binding(change: int | None = None, tid: bytes = b"0123456789ab") -> bytes:
    msg = Message(Method.BINDING, Class.REQUEST, transaction_id=tid)
    if change is not None:
        msg.attributes["CHANGE-REQUEST"] = change
    return encode(msg)


@pytest.mark.parametrize(
    "change, origin",
    [
        (None, ("192.0.2.10", 3478)),
        (0, ("192.0.2.10", 3478)),
        (CHANGE_PORT, ("192.0.2.10", 3479)),
        (CHANGE_IP, ("192.0.2.11", 3478)),
        (CHANGE_IP | CHANGE_PORT, ("192.0.2.11", 3479)),
    ],
)
def test_responder_two_by_two_honours_change_request(change, origin):
    responder = StunResponder(FOUR)
    data, sent_from = responder.handle_datagram(binding(change), ("192.0.2.10", 3478), CLIENT)
    assert sent_from == origin
    response = decode(data)
    assert response.message_class == Class.RESPONSE
    assert response.transaction_id == b"0123456789ab"
    assert response.attributes["XOR-MAPPED-ADDRESS"] == CLIENT
    assert response.attributes["MAPPED-ADDRESS"] == CLIENT  # for RFC 3489-era clients
    assert response.attributes["RESPONSE-ORIGIN"] == origin
    assert response.attributes["OTHER-ADDRESS"] == ("192.0.2.11", 3479)
    assert "FINGERPRINT" in response.attributes


def test_responder_other_address_is_relative_to_the_receiving_address():
    responder = StunResponder(FOUR)
    data, _ = responder.handle_datagram(binding(), ("192.0.2.11", 3479), CLIENT)
    assert decode(data).attributes["OTHER-ADDRESS"] == ("192.0.2.10", 3478)


def test_responder_one_ip_two_ports_changes_port_and_rejects_change_ip_with_420():
    responder = StunResponder([("192.0.2.10", 3478), ("192.0.2.10", 3479)])
    data, sent_from = responder.handle_datagram(binding(CHANGE_PORT), ("192.0.2.10", 3478), CLIENT)
    assert sent_from == ("192.0.2.10", 3479)
    assert decode(data).attributes["OTHER-ADDRESS"] == ("192.0.2.10", 3479)
    data, sent_from = responder.handle_datagram(binding(CHANGE_IP), ("192.0.2.10", 3478), CLIENT)
    error = decode(data)
    assert sent_from == ("192.0.2.10", 3478)
    assert error.message_class == Class.ERROR
    assert error.attributes["ERROR-CODE"] == (420, "Unknown Attribute")
    assert error.attributes["UNKNOWN-ATTRIBUTES"] == [0x0003]


def test_responder_single_address_answers_binding_without_other_address():
    responder = StunResponder([("192.0.2.10", 3478)])
    data, sent_from = responder.handle_datagram(binding(), ("192.0.2.10", 3478), CLIENT)
    response = decode(data)
    assert sent_from == ("192.0.2.10", 3478)
    assert "OTHER-ADDRESS" not in response.attributes
    assert response.attributes["XOR-MAPPED-ADDRESS"] == CLIENT


def test_responder_rejects_unknown_comprehension_required_attribute():
    wire = bytearray(binding())
    wire += struct.pack("!HHI", 0x0042, 4, 7)  # unknown type < 0x8000
    wire[2:4] = struct.pack("!H", len(wire) - 20)
    data, _ = StunResponder(FOUR).handle_datagram(bytes(wire), FOUR[0], CLIENT)
    assert decode(data).attributes["UNKNOWN-ATTRIBUTES"] == [0x0042]


def test_responder_drops_responses_indications_and_garbage():
    responder = StunResponder(FOUR)
    assert responder.handle_datagram(IPV4_RESPONSE, FOUR[0], CLIENT) is None
    indication = encode(Message(Method.BINDING, Class.INDICATION))
    assert responder.handle_datagram(indication, FOUR[0], CLIENT) is None
    assert responder.handle_datagram(b"hello", FOUR[0], CLIENT) is None


def test_responder_configuration_errors_are_sentences():
    with pytest.raises(LocalProtocolError, match="at least one address"):
        StunResponder([])
    with pytest.raises(LocalProtocolError, match="mix IPv4 and IPv6"):
        StunResponder([("192.0.2.1", 1), ("::1", 1)])
    with pytest.raises(LocalProtocolError, match="does not listen on 192.0.2.99:3478"):
        StunResponder(FOUR).handle_datagram(binding(), ("192.0.2.99", 3478), CLIENT)


# --- fuzzing --------------------------------------------------------------------------------------

VALID = [SAMPLE_REQUEST, IPV4_RESPONSE, IPV6_RESPONSE, LONG_TERM_REQUEST, binding(CHANGE_IP | CHANGE_PORT)]


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "fixlen"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(max_size=12))
        elif op == "fixlen" and len(data) >= 20:
            data[2:4] = struct.pack("!H", (len(data) - 20) & 0xFFFF)
    return bytes(data)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=120), mutated()))
def test_fuzz_decode_and_responder_never_raise(data):
    decode(data)
    attribute_types(data)
    result = StunResponder(FOUR).handle_datagram(data, FOUR[0], CLIENT)
    if result is not None:
        response, origin = result
        assert origin in FOUR
        assert decode(response) is not None

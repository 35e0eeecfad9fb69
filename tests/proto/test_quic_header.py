"""First-byte demultiplexing and QUIC DCIDs (kafilad/proto/quic_header.py), with qh3 (the QUIC stack) as the oracle."""

from __future__ import annotations

from qh3._hazmat import Buffer
from qh3.quic.packet import pull_quic_header
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.proto.quic_header import CID_BYTES, is_long_header, protocol_of, quic_dcid


def test_protocol_of_follows_rfc_9443_ranges():
    assert [protocol_of(bytes([b])) for b in (0, 3, 4, 63, 64, 127, 128, 191, 192, 255)] == [
        "stun", "stun", "other", "other", "quic", "quic", "other", "other", "quic", "quic"]
    assert protocol_of(b"") == "other"


def test_quic_dcid_of_long_and_short_headers():
    cid = bytes(range(8))
    assert quic_dcid(bytes([0xC3]) + b"\x00\x00\x00\x01" + bytes([8]) + cid + b"rest") == cid
    assert quic_dcid(bytes([0x41]) + cid + b"payload") == cid
    assert quic_dcid(bytes([0xC3, 0, 0, 0, 1, 30]) + bytes(40)) is None  # dcid longer than 20: not QUIC v1
    assert quic_dcid(bytes([0xC3, 0, 0, 0, 1, 8]) + cid[:5]) is None  # truncated inside the DCID
    assert quic_dcid(bytes([0x41, 1, 2])) is None
    assert quic_dcid(b"") is None
    assert quic_dcid(bytes([0xC3]) + b"\x00\x00\x00\x01" + bytes([0])) == b""  # a zero-length DCID
    assert is_long_header(b"\xc0") and not is_long_header(b"\x40") and not is_long_header(b"")


def _long_header(first: int, version: int, dcid: bytes, scid: bytes, rest: bytes) -> bytes:
    return bytes([first]) + version.to_bytes(4, "big") + bytes([len(dcid)]) + dcid + bytes([len(scid)]) + scid + rest


@settings(max_examples=300, deadline=None)
@given(
    packet=st.one_of(
        st.builds(
            _long_header,
            st.integers(0xC0, 0xFF),
            st.sampled_from([0x00000001, 0x6B3343CF, 0]),  # v1, v2, version negotiation
            st.binary(max_size=20),
            st.binary(max_size=20),
            st.binary(min_size=0, max_size=40),
        ),
        st.builds(lambda first, body: bytes([first]) + body, st.integers(0x40, 0x7F), st.binary(max_size=40)),
        st.binary(max_size=64),
    )
)
def test_dcid_agrees_with_qh3_wherever_qh3_parses_the_header(packet):
    """Whatever qh3 (the QUIC stack behind the demultiplexer) parses, we route by the same DCID."""
    try:
        header = pull_quic_header(Buffer(data=packet), host_cid_length=CID_BYTES)
    except Exception:  # qh3 raises ValueError or BufferReadError on junk
        return
    if protocol_of(packet) != "quic":
        return  # qh3 reads first bytes outside RFC 9443's QUIC range; the endpoint drops them earlier
    assert quic_dcid(packet) == header.destination_cid

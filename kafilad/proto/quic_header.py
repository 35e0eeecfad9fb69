"""First-byte demultiplexing and the QUIC destination connection id, pure (RFC 9443 §3; RFC 9000 §17).

The daemon's one UDP socket carries STUN, ICE checks and QUIC (DESIGN §4; proto_spec 07 §1);
``kafilad.net.udp_endpoint`` routes each datagram with these two functions::

    first byte   protocol (RFC 9443 §3)
    0 .. 3       STUN
    64 .. 127    QUIC short header (RFC 9000 §17.3)
    192 .. 255   QUIC long header (RFC 9000 §17.2)

QUIC headers up to the destination connection id (DCID)::

    long:   | 1 flags (0b1xxxxxxx) | 4 version | 1 dcid_len (<= 20) | dcid_len DCID | ...
    short:  | 1 flags (0b01xxxxxx) | DCID (the length we issued: CID_BYTES) | ...
"""

from __future__ import annotations

from typing import Literal, Optional

#: Length of the connection ids we issue (qh3's QuicConfiguration.connection_id_length default, which kafilad/net/quic_config.py sets).
CID_BYTES = 8
#: Longest connection id QUIC v1 allows (RFC 9000 §17.2).
MAX_CID_BYTES = 20


def protocol_of(data: bytes) -> Literal["stun", "quic", "other"]:
    """"stun", "quic" or "other" by the first byte (RFC 9443 §3); "other" for an empty datagram."""
    if not data:
        return "other"
    b = data[0]
    if b <= 3:
        return "stun"
    if 64 <= b <= 127 or b >= 192:
        return "quic"
    return "other"


def is_long_header(data: bytes) -> bool:
    """True for a QUIC long-header packet (the first bit set, RFC 9000 §17.2)."""
    return bool(data) and bool(data[0] & 0x80)


def quic_dcid(data: bytes, short_cid_bytes: int = CID_BYTES) -> Optional[bytes]:
    """Destination connection id of a QUIC packet (RFC 9000 §17.2, §17.3), or None if truncated.

    Args:
        data: a datagram that ``protocol_of`` calls "quic".
        short_cid_bytes: the DCID length of a short header (ours to know: we issued it).
    Returns:
        The DCID bytes; None for an empty or truncated packet, or a long header announcing more
        than 20 bytes (not QUIC v1).
    """
    if not data:
        return None
    if is_long_header(data):
        if len(data) < 6:
            return None
        n = data[5]
        if n > MAX_CID_BYTES or len(data) < 6 + n:
            return None
        return bytes(data[6:6 + n])
    if len(data) < 1 + short_cid_bytes:
        return None
    return bytes(data[1:1 + short_cid_bytes])

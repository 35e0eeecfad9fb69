"""STUN codec and a sans-IO Binding responder (RFC 8489, RFC 5780; proto_spec §4).

The wire codec is aioice's pure module ``aioice.stun`` (DESIGN §4: only ``aioice.stun`` and
``aioice.candidate`` are imported, never ``aioice.Connection``). aioice 0.13.0 already knows
CHANGE-REQUEST (0x0003), RESPONSE-ORIGIN (0x802B) and OTHER-ADDRESS (0x802C); this module adds
UNKNOWN-ATTRIBUTES (0x000A, RFC 8489 §14.9), which a server needs for its 420 answers, and a strict
front door, :func:`decode`, that never raises: malformed or non-STUN datagrams come back as None.

Message header (RFC 8489 §5; proto_spec §4.1)::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |0 0|     STUN Message Type     |         Message Length        |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |                 Magic Cookie = 0x2112A442                     |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |                Transaction ID (96 bits)                       |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+

CHANGE-REQUEST value (RFC 5780 §7.2): 32 bits, ``A`` (0x4) = change IP, ``B`` (0x2) = change port.
RESPONSE-ORIGIN and OTHER-ADDRESS (RFC 5780 §7.3, §7.4) use the MAPPED-ADDRESS layout
(reserved byte, family 0x01/0x02, port, address), not XORed.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Sequence

from aioice.stun import (
    ATTRIBUTES_BY_NAME,
    ATTRIBUTES_BY_TYPE,
    COOKIE,
    HEADER_LENGTH,
    Class,
    Message,
    Method,
    pack_bytes,
    parse_message,
    unpack_bytes,
)

from kafilad.errors import LocalProtocolError

__all__ = [
    "CHANGE_IP",
    "CHANGE_PORT",
    "Class",
    "Message",
    "Method",
    "StunResponder",
    "attribute_types",
    "decode",
    "encode",
    "looks_like_stun",
]

Address = tuple[str, int]

#: CHANGE-REQUEST flag bits (RFC 5780 §7.2).
CHANGE_IP = 0x4
CHANGE_PORT = 0x2

#: Attribute types (RFC 8489 §18.3, RFC 5780 §9.1).
CHANGE_REQUEST = 0x0003
UNKNOWN_ATTRIBUTES = 0x000A
RESPONSE_ORIGIN = 0x802B
OTHER_ADDRESS = 0x802C
#: PADDING (RFC 5780 §7.6): opaque bytes that make a request as large as a path MTU probe needs
#: (proto_spec 07 §4a).
PADDING = 0x0026

SOFTWARE = "kafila"


def _pack_unknown_attributes(value: Sequence[int]) -> bytes:
    return b"".join(struct.pack("!H", t) for t in value)


def _unpack_unknown_attributes(data: bytes) -> list[int]:
    if len(data) % 2:
        raise ValueError("STUN UNKNOWN-ATTRIBUTES length is odd")
    return [struct.unpack("!H", data[i : i + 2])[0] for i in range(0, len(data), 2)]


def _register(entry: tuple) -> None:
    # Additive only: never replaces an entry aioice already defines.
    if entry[0] not in ATTRIBUTES_BY_TYPE and entry[1] not in ATTRIBUTES_BY_NAME:
        ATTRIBUTES_BY_TYPE[entry[0]] = entry
        ATTRIBUTES_BY_NAME[entry[1]] = entry


_register((UNKNOWN_ATTRIBUTES, "UNKNOWN-ATTRIBUTES", _pack_unknown_attributes, _unpack_unknown_attributes))
_register((PADDING, "PADDING", pack_bytes, unpack_bytes))
for _type, _name in ((CHANGE_REQUEST, "CHANGE-REQUEST"), (RESPONSE_ORIGIN, "RESPONSE-ORIGIN"),
                     (OTHER_ADDRESS, "OTHER-ADDRESS")):
    if ATTRIBUTES_BY_TYPE.get(_type, (0, ""))[1] != _name:
        raise ImportError(f"aioice.stun no longer defines {_name}; install the pinned aioice==0.13.0.")


def looks_like_stun(data: bytes) -> bool:
    """Cheap demultiplexing test for the shared UDP socket (RFC 9443 §3, RFC 8489 §5).

    True when the first byte is 0-3, the datagram is at least a header long, its length field is a
    multiple of 4 matching the datagram, and the magic cookie is present.
    """
    if len(data) < HEADER_LENGTH or data[0] > 3:
        return False
    length, cookie = struct.unpack("!HI", data[2:8])
    return cookie == COOKIE and length % 4 == 0 and len(data) == HEADER_LENGTH + length


def attribute_types(data: bytes) -> list[int] | None:
    """Attribute types of a STUN message in wire order, or None if the TLV chain is malformed.

    Every attribute, with its padding to 4 bytes, must fit inside the message length
    (RFC 8489 §14). Does not interpret values.
    """
    if not looks_like_stun(data):
        return None
    types = []
    pos = HEADER_LENGTH
    while pos < len(data):
        if pos + 4 > len(data):
            return None
        attr_type, attr_len = struct.unpack("!HH", data[pos : pos + 4])
        pos += 4 + attr_len + (-attr_len % 4)
        if pos > len(data):
            return None
        types.append(attr_type)
    return types


def decode(data: bytes) -> Message | None:
    """Parse one STUN message; None for anything malformed or not STUN (never raises).

    Checks the header (RFC 8489 §5), the TLV chain, FINGERPRINT when present (§14.7), and each
    known attribute's value via aioice's parser. MESSAGE-INTEGRITY is NOT checked here: call
    ``message.check_message_integrity(key)`` (§14.5). Unknown attributes are skipped; use
    :func:`attribute_types` to find comprehension-required ones.
    """
    if attribute_types(data) is None:
        return None
    try:
        return parse_message(data)
    except (ValueError, struct.error, IndexError):
        return None


def encode(message: Message, *, integrity_key: bytes | None = None, fingerprint: bool = True) -> bytes:
    """Serialise a message, appending MESSAGE-INTEGRITY (if ``integrity_key``) then FINGERPRINT.

    RFC 8489 §14.5 (HMAC-SHA1 over the message up to the attribute) and §14.7 (CRC-32 XOR
    0x5354554e). Mutates ``message.attributes`` to hold the added attributes.
    """
    if integrity_key is not None:
        message.add_message_integrity(integrity_key)
    elif fingerprint:
        message.add_fingerprint()
    return bytes(message)


def _normalise(addr: Sequence) -> Address:
    return (str(ipaddress.ip_address(addr[0])), int(addr[1]))


class StunResponder:
    """Sans-IO STUN Binding server for one or more local addresses (RFC 8489 §6.3, RFC 5780 §6).

    Args:
        addresses: the (ip, port) pairs the server listens on. With two IPs x two ports (all four
            combinations) it supports full RFC 5780 discovery; with one IP x two ports it honours
            change-port only; with one address it answers plain Binding requests and rejects
            CHANGE-REQUEST with 420 (RFC 5780 §6.1).

    Raises:
        LocalProtocolError: ``addresses`` is empty or mixes address families.
    """

    def __init__(self, addresses: Sequence[Address]):
        if not addresses:
            raise LocalProtocolError("The STUN responder needs at least one address to listen on.")
        self.addresses: list[Address] = [_normalise(a) for a in addresses]
        families = {ipaddress.ip_address(ip).version for ip, _ in self.addresses}
        if len(families) != 1:
            raise LocalProtocolError(
                "The STUN responder's addresses mix IPv4 and IPv6; give addresses of one family.")
        self._set = set(self.addresses)
        ips = list(dict.fromkeys(ip for ip, _ in self.addresses))
        ports = list(dict.fromkeys(port for _, port in self.addresses))
        self._ips = ips
        self._ports = ports

    def _alternate(self, local: Address, change_ip: bool, change_port: bool) -> Address | None:
        ip, port = local
        if change_ip:
            others = [i for i in self._ips if i != ip]
            if not others:
                return None
            ip = others[0]
        if change_port:
            others_p = [p for p in self._ports if p != port]
            if not others_p:
                return None
            port = others_p[0]
        return (ip, port) if (ip, port) in self._set else None

    def other_address(self, local: Address) -> Address | None:
        """OTHER-ADDRESS advertised to clients reaching ``local`` (RFC 5780 §7.4).

        The address differing in both IP and port when configured; with one IP x two ports, the
        same IP and the other port (proto_spec §4.3); None with a single address.
        """
        local = _normalise(local)
        for change_ip, change_port in ((True, True), (False, True), (True, False)):
            alt = self._alternate(local, change_ip, change_port)
            if alt is not None:
                return alt
        return None

    def handle_datagram(self, data: bytes, local: Address, remote: Sequence) -> tuple[bytes, Address] | None:
        """Answer one datagram received on ``local`` from ``remote``.

        Args:
            data: the received UDP payload.
            local: the (ip, port) of ours it arrived on; must be one of ``addresses``.
            remote: the sender's (ip, port, ...) as the socket reports it.

        Returns:
            (response bytes, local (ip, port) to send it FROM) or None when the datagram is to be
            dropped (not STUN, malformed, not a Binding request). The response goes to ``remote``.

        Raises:
            LocalProtocolError: ``local`` is not one of the configured addresses (caller's bug).
        """
        local = _normalise(local)
        if local not in self._set:
            raise LocalProtocolError(f"The STUN responder does not listen on {local[0]}:{local[1]}.")
        types = attribute_types(data)
        if types is None:
            return None
        request = decode(data)
        if request is None or request.message_method != Method.BINDING or request.message_class != Class.REQUEST:
            return None
        try:
            source = _normalise(remote)
        except (ValueError, TypeError, IndexError):
            return None

        unknown = [t for t in dict.fromkeys(types) if t < 0x8000 and t not in ATTRIBUTES_BY_TYPE]
        if unknown:
            return self._error(request, 420, "Unknown Attribute", unknown), local

        flags = request.attributes.get("CHANGE-REQUEST", 0)
        origin = local
        if flags & (CHANGE_IP | CHANGE_PORT):
            alt = self._alternate(local, bool(flags & CHANGE_IP), bool(flags & CHANGE_PORT))
            if alt is None:
                return self._error(request, 420, "Unknown Attribute", [CHANGE_REQUEST]), local
            origin = alt

        response = Message(Method.BINDING, Class.RESPONSE, transaction_id=request.transaction_id)
        response.attributes["XOR-MAPPED-ADDRESS"] = source
        # Also the plain form: RFC 3489-era clients (coturn's turnutils_natdiscovery among them)
        # look for it (RFC 8489 §14.1).
        response.attributes["MAPPED-ADDRESS"] = source
        response.attributes["RESPONSE-ORIGIN"] = origin
        other = self.other_address(local)
        if other is not None:
            response.attributes["OTHER-ADDRESS"] = other
        response.attributes["SOFTWARE"] = SOFTWARE
        return encode(response), origin

    @staticmethod
    def _error(request: Message, code: int, reason: str, unknown: list[int]) -> bytes:
        response = Message(Method.BINDING, Class.ERROR, transaction_id=request.transaction_id)
        response.attributes["ERROR-CODE"] = (code, reason)
        response.attributes["UNKNOWN-ATTRIBUTES"] = unknown
        response.attributes["SOFTWARE"] = SOFTWARE
        return encode(response)

"""Rendezvous wire format (proto_spec/03-rendezvous.md §1-§3, §7): message kinds, control maps,
relay data and relay record files. Pure: no trio, no sockets.

Every WebSocket message is binary; byte 0 is the kind (proto_spec §1)::

    +------+---------------------------------------------+
    | 0x00 | msgpack map, key "t" = type   (control, §2) |
    +------+---------------------------------------------+
    | 0x01 | circuit id u64 BE | opaque payload  (§3)    |
    +------+---------------------------------------------+

The server's state machine is kafilad/proto/rendezvous.py, which re-exports these names.
"""

from __future__ import annotations

import struct

import attrs
import msgpack

from kafilad.errors import LocalProtocolError, RemoteProtocolError

KIND_CONTROL = 0x00
KIND_RELAY = 0x01
RELAY_HEADER = struct.Struct(">BQ")  # kind, circuit id (proto_spec §3)
RECORD_HEADER = struct.Struct(">QI")  # circuit id, payload length (proto_spec §7)
SIGNAL_RECORD_CIRCUIT = 0

CLOSE_POLICY_VIOLATION = 1008  # RFC 6455 §7.4.1
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_SUPERSEDED = 4001  # RFC 6455 §7.4.2 private range: a newer proven connection replaced this one

#: how a WebSocket closed, by close code (RFC 6455 §7.4), as a clause a user reads: {who} is the
#: side that closed it ("it", "the rendezvous"), {peer} the other side named for a dropped connection
_CLOSE_CLAUSES = {
    1000: "{who} closed the connection",
    1001: "{who} is going away (shutting down)",
    1002: "{who} closed the connection: the other side broke the WebSocket protocol",
    1003: "{who} closed the connection: it was sent data it does not accept",
    1006: "the connection dropped without a goodbye (network loss, or {peer} was killed)",
    1007: "{who} closed the connection: it was sent data it could not decode",
    CLOSE_POLICY_VIOLATION: "{who} closed the connection: it refused what it was sent",
    CLOSE_MESSAGE_TOO_BIG: "{who} closed the connection: it was sent a message too large for it",
    1011: "{who} closed the connection after an internal error",
    1012: "{who} is restarting",
    1013: "{who} is overloaded and closed the connection; try again later",
    1015: "the connection failed its TLS handshake",
    CLOSE_SUPERSEDED: "a newer connection from the same daemon replaced this one",
}


def close_clause(code: int | None, reason: str | None = None, *, who: str = "it",
                 peer: str = "the other side") -> str:
    """How a WebSocket closed, as a clause for users ("the connection dropped without a goodbye
    (network loss, or the other side was killed)"); the reason its closer gave follows a colon
    (in place of the code's own explanation). The numeric code is for log lines only, never here.

    Args:
        code: the close code (RFC 6455 §7.4; None: no close frame was seen, as 1006).
        reason: the close frame's reason text, if any.
        who: the side that closed it, as the subject of the clause.
        peer: the other side, named when the connection dropped (1006).
    """
    closed = "{who} closed the connection"
    clause = _CLOSE_CLAUSES.get(1006 if code is None else code, closed)
    reason = (reason or "").strip().rstrip(".")
    if reason and clause.startswith(closed):
        clause = closed  # the closer's own reason says more than the code
    clause = clause.format(who=who, peer=peer)
    return f"{clause}: {reason}" if reason else clause


@attrs.frozen
class ControlMessage:
    """A decoded control message (proto_spec §2): `type` is the "t" key, `fields` the whole map."""

    type: str
    fields: dict


@attrs.frozen
class RelayData:
    """Relay data (proto_spec §3): `circuit_id` uint64, `payload` opaque bytes."""

    circuit_id: int
    payload: bytes


def encode_control(msg: dict) -> bytes:
    """Encode a control message (proto_spec §2) as one binary WebSocket message.

    Args:
        msg: a map with a str "t" key and msgpack-serialisable values.
    Raises:
        LocalProtocolError: "t" is missing or not a string, or a value cannot be encoded.
    """
    if not isinstance(msg.get("t"), str):
        raise LocalProtocolError(f"A rendezvous control message needs a string 't' key; got {msg!r}.")
    try:
        return bytes([KIND_CONTROL]) + msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"Cannot encode rendezvous message {msg.get('t')!r}: {exc}.") from exc


def encode_relay(circuit_id: int, payload: bytes) -> bytes:
    """Encode relay data (proto_spec §3): 0x01, circuit id u64 BE, payload.

    Raises:
        LocalProtocolError: the circuit id does not fit in 64 bits.
    """
    if not 0 <= circuit_id < 1 << 64:
        raise LocalProtocolError(f"Circuit id {circuit_id} does not fit in an unsigned 64-bit integer.")
    return RELAY_HEADER.pack(KIND_RELAY, circuit_id) + bytes(payload)


def decode_message(data: bytes) -> ControlMessage | RelayData:
    """Decode one WebSocket message (proto_spec §1-§3). Bytes after the msgpack map are ignored.

    Raises:
        RemoteProtocolError: empty, unknown kind, bad msgpack, not a map, no string "t",
            or relay data shorter than its 9-byte header.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("The rendezvous protocol uses binary WebSocket messages only; got text.")
    data = bytes(data)
    if not data:
        raise RemoteProtocolError("Received an empty rendezvous message.")
    kind = data[0]
    if kind == KIND_RELAY:
        if len(data) < RELAY_HEADER.size:
            raise RemoteProtocolError(
                f"Relay data needs a {RELAY_HEADER.size}-byte header; got {len(data)} bytes."
            )
        _, circuit_id = RELAY_HEADER.unpack_from(data)
        return RelayData(circuit_id, data[RELAY_HEADER.size :])
    if kind != KIND_CONTROL:
        raise RemoteProtocolError(f"Unknown rendezvous message kind 0x{kind:02x} (expected 0x00 or 0x01).")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(data))
    unpacker.feed(data[1:])
    try:
        obj = unpacker.unpack()
    except msgpack.OutOfData:
        raise RemoteProtocolError("A rendezvous control message was truncated.") from None
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise RemoteProtocolError(f"A rendezvous control message is not valid msgpack: {_msgpack_fault(exc)}.") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise RemoteProtocolError("A rendezvous control message must be a msgpack map with a string 't'.")
    return ControlMessage(obj["t"], obj)


def _msgpack_fault(exc: Exception) -> str:
    """What msgpack found wrong, in words: its FormatError and StackError carry no text."""
    if isinstance(exc, msgpack.FormatError):
        return "it holds a byte that starts no msgpack value (such as 0xc1, which msgpack never uses)"
    if isinstance(exc, msgpack.StackError):
        return "its values nest deeper than the decoder allows"
    return str(exc).rstrip(".") or type(exc).__name__


def check_fields(msg: ControlMessage, schema: dict[str, type | tuple[type, ...]]) -> None:
    """Check that `msg` has every field of `schema` with the right type (bool is not an int).

    Raises:
        RemoteProtocolError: a field is missing or mistyped.
    """
    for key, kind in schema.items():
        value = msg.fields.get(key)
        if value is None or isinstance(value, bool) and kind is int or not isinstance(value, kind):
            raise RemoteProtocolError(
                f"Rendezvous message {msg.type!r} needs field {key!r} of type "
                f"{getattr(kind, '__name__', kind)}; got {value!r}."
            )
    if "body" not in msg.fields and msg.type == "signal":
        raise RemoteProtocolError("Rendezvous message 'signal' needs a 'body' field.")


def parse_relay_record(data: bytes) -> list[tuple[int, bytes]]:
    """Parse a relay record file's bytes (proto_spec §7) into (circuit id, payload) pairs.

    Raises:
        RemoteProtocolError: the file ends inside a record.
    """
    out, pos = [], 0
    while pos < len(data):
        if pos + RECORD_HEADER.size > len(data):
            raise RemoteProtocolError(f"The relay record is truncated at byte {pos}.")
        circuit_id, length = RECORD_HEADER.unpack_from(data, pos)
        pos += RECORD_HEADER.size
        if pos + length > len(data):
            raise RemoteProtocolError(f"The relay record is truncated at byte {pos}.")
        out.append((circuit_id, data[pos : pos + length]))
        pos += length
    return out


def encode_relay_record(circuit_id: int, payload: bytes) -> bytes:
    """One relay record (proto_spec §7): circuit id u64 BE, length u32 BE, payload."""
    return RECORD_HEADER.pack(circuit_id, len(payload)) + payload

"""The frame layer: length-prefixed msgpack maps (proto_spec 02; DESIGN §4), sans-IO.

A frame (proto_spec 02 §1)::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |                    L (u32, big-endian)                        |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
    |          body: one msgpack map, exactly L bytes  ...          |
    +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+

    1 <= L <= MAX_FRAME_BYTES (64 MiB). The body's key "t" (str) is the frame type; receivers
    ignore keys they do not know and bytes after the map inside the L bytes (forward
    compatibility, proto_spec 02 §1.2).

Frames form a byte stream (inside the Noise channel, proto_spec 01 §3), so one frame may span
many Noise messages and one Noise message may hold parts of several frames: ``chunk`` cuts a
stream into Noise-message-sized pieces (proto_spec 02 §3). Tensors travel as the array map of
proto_spec 02 §4 (``encode_array`` / ``decode_array``), raw little-endian bytes; activations
between ring stages are array maps of a float dtype (``encode_activation`` / ``decode_activation``,
proto_spec 02 §4.2), which the executor converts to and from MLX arrays.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Mapping

import msgpack

from kafilad.errors import FramingError, LocalProtocolError, RemoteProtocolError
from kafilad.proto.noise import MAX_PLAINTEXT_BYTES

#: Largest frame body (proto_spec 02 §2): bigger payloads must be split by the sender's protocol.
MAX_FRAME_BYTES = 64 * 1024 * 1024
HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
#: Most dimensions an array map may declare (proto_spec 02 §4).
MAX_ARRAY_DIMS = 8

#: Element sizes of the dtypes an array map may carry (proto_spec 02 §4.1); names as numpy/MLX.
DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
}
#: dtypes an activation (a hidden state between ring stages) may travel in (proto_spec 02 §4.2).
ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")


def encode_frame(body: Mapping[str, Any]) -> bytes:
    """Serialise one frame: ``u32 BE length || msgpack map`` (proto_spec 02 §1).

    Args:
        body: a map with a str key "t" (the frame type); values are msgpack types (bytes stay
            bytes, tuples become arrays).
    Returns:
        4 + L bytes.
    Raises:
        LocalProtocolError: no str "t", a value msgpack cannot encode, or L > MAX_FRAME_BYTES.
    """
    if not isinstance(body, Mapping):
        raise LocalProtocolError(f"A frame body must be a map, not {type(body).__name__}.")
    if not isinstance(body.get("t"), str) or not body["t"]:
        raise LocalProtocolError("A frame body needs a non-empty str key 't' naming its type (proto_spec 02 §1.2).")
    try:
        packed = msgpack.packb(dict(body), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"Frame {body['t']!r} holds a value msgpack cannot encode: {exc}.") from exc
    if len(packed) > MAX_FRAME_BYTES:
        raise LocalProtocolError(
            f"Frame {body['t']!r} is {len(packed)} bytes, over the {MAX_FRAME_BYTES}-byte limit "
            "(proto_spec 02 §2); split the payload across several frames."
        )
    return HEADER.pack(len(packed)) + packed


class FrameDecoder:
    """Turns a byte stream back into frame bodies (proto_spec 02 §1), sans-IO.

    Feed bytes with ``receive_data``; pull bodies (dicts) with ``next_event`` until it returns
    None. After a FramingError (a RemoteProtocolError with a ``code``) the decoder is dead and
    raises the same error again: the link that carried the stream must be closed (proto_spec 02 §2).
    It is the one u32 frame decoder: member links (kafilad/net/frame_stream.py) and the local
    control server (kafilad/control/server.py, which words each ``code`` for its clients) use it.

    Args:
        max_frame_bytes: frames longer than this are refused before being buffered.
        require_type: refuse a map without a str "t" (proto_spec 02 §1.2); the control server
            takes such a map and answers it itself.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES, *, require_type: bool = True):
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._require_type = require_type
        self._error: FramingError | None = None
        self.frames_decoded = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet returned as frames (non-zero at EOF: the stream ended inside a frame)."""
        return len(self._buf)

    @property
    def error(self) -> FramingError | None:
        """The FramingError that ended this decoder (a malformed frame), or None."""
        return self._error

    def receive_data(self, data: bytes) -> None:
        """Append bytes from the stream (any split is fine)."""
        if self._error is not None:
            raise self._error
        self._buf += data

    def receive_eof(self) -> None:
        """The stream ended; call after ``next_event`` returned None.

        Raises:
            FramingError: the stream stopped inside a frame (code "eof").
        """
        if self._buf:
            self._fail(f"The stream ended inside a frame ({len(self._buf)} bytes of an unfinished frame).", code="eof")

    def _fail(self, reason: str, **details) -> None:
        self._error = FramingError(reason, **details)
        self._buf = bytearray()
        raise self._error

    def next_event(self) -> dict | None:
        """The next complete frame body, or None until more bytes arrive.

        Raises:
            FramingError: a length of 0 or over the limit (code "length"), a body that does not start
                with a complete msgpack object ("msgpack") or map ("not_map"), or no str "t" ("no_type").
        """
        if self._error is not None:
            raise self._error
        if len(self._buf) < HEADER_BYTES:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        header = bytes(self._buf[:HEADER_BYTES])
        if length == 0 or length > self._max:
            self._fail(
                f"The peer announced a frame of {length} bytes; frames are 1..{self._max} bytes "
                "(proto_spec 02 §2).", code="length", header=header, length=length)
        end = HEADER_BYTES + length
        if len(self._buf) < end:
            return None
        raw = bytes(memoryview(self._buf)[HEADER_BYTES:end])
        del self._buf[:end]
        try:
            # One msgpack object; bytes after it inside the frame are ignored (proto_spec 02 §1.2).
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True, max_buffer_size=len(raw))
            unpacker.feed(raw)
            body = unpacker.unpack()
        except Exception as exc:  # msgpack raises many types (OutOfData, FormatError, ValueError, ...)
            self._fail(f"A frame of {length} bytes is not valid msgpack ({type(exc).__name__}: {exc}).",
                       code="msgpack", header=header, length=length, cause=exc, raw=raw)
        if not isinstance(body, dict):
            self._fail(f"A frame body is a msgpack {type(body).__name__}, not a map (proto_spec 02 §1.2).",
                       code="not_map", header=header, length=length, value=body)
        if self._require_type and (not isinstance(body.get("t"), str) or not body["t"]):
            self._fail("A frame body has no str key 't' naming its type (proto_spec 02 §1.2).", code="no_type",
                       header=header, length=length)
        self.frames_decoded += 1
        return body


def chunk(data: bytes, max_bytes: int = MAX_PLAINTEXT_BYTES) -> list[bytes]:
    """Cut ``data`` into pieces of at most ``max_bytes`` (one Noise message each, proto_spec 02 §3).

    Returns:
        ``ceil(len(data) / max_bytes)`` pieces, all full but the last; [] for empty data.
    Raises:
        LocalProtocolError: max_bytes < 1.
    """
    if max_bytes < 1:
        raise LocalProtocolError(f"Chunks must hold at least one byte, not {max_bytes}.")
    view = memoryview(data)
    return [bytes(view[i : i + max_bytes]) for i in range(0, len(view), max_bytes)]


def encode_array(dtype: str, shape: tuple[int, ...], data: bytes) -> dict:
    """The array map of proto_spec 02 §4: ``{"dtype", "shape", "data"}``, row-major, little-endian.

    Args:
        dtype: a key of DTYPE_BYTES, e.g. "float32".
        shape: dimensions, e.g. (B, L, D); () for a scalar.
        data: ``prod(shape) * itemsize`` bytes.
    Raises:
        LocalProtocolError: unknown dtype, bad shape, or a byte count that does not match.
    """
    try:
        shape = tuple(shape)
        _check_array(dtype, shape, data)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"Cannot encode array: {exc}") from None
    return {"dtype": dtype, "shape": list(shape), "data": bytes(data)}


def decode_array(d: Any) -> tuple[str, tuple[int, ...], bytes]:
    """Validate an array map from the peer and return (dtype, shape, data) (proto_spec 02 §4).

    Raises:
        RemoteProtocolError: not a map with str dtype, int-list shape and bytes data, unknown
            dtype, or ``len(data) != prod(shape) * itemsize``.
    """
    if not isinstance(d, dict):
        raise RemoteProtocolError(f"An array field is a {type(d).__name__}, not a map (proto_spec 02 §4).")
    dtype, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if not isinstance(shape, (list, tuple)):
        raise RemoteProtocolError("An array map has no 'shape' list (proto_spec 02 §4).")
    try:
        _check_array(dtype, shape, data)
    except ValueError as exc:
        raise RemoteProtocolError(f"The peer sent a malformed array: {exc}") from None
    return dtype, tuple(shape), data


def _check_array(dtype: Any, shape: Any, data: Any) -> None:
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}.")
    if len(shape) > MAX_ARRAY_DIMS:
        raise ValueError(f"{len(shape)} dimensions, more than {MAX_ARRAY_DIMS}.")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"shape {list(shape)!r} must be non-negative integers.")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data is a {type(data).__name__}, not bytes.")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    nbytes = memoryview(data).nbytes
    if nbytes != expected:
        raise ValueError(
            f"{nbytes} data bytes for shape {tuple(shape)} of {dtype} (expected {expected})."
        )


def encode_activation(dtype: str, shape: tuple[int, ...], data: bytes) -> dict:
    """The array map of an activation (proto_spec 02 §4.2), e.g. a hidden state (B, L, D).

    Args:
        dtype: one of ACTIVATION_DTYPES (bfloat16: the raw 16-bit patterns).
        shape: e.g. (B, L, D).
        data: C-order little-endian bytes, ``prod(shape) * itemsize``.
    Returns:
        ``{"dtype", "shape", "data"}`` as ``encode_array``.
    Raises:
        LocalProtocolError: a dtype that is not an activation dtype, or as ``encode_array``.
    """
    if dtype not in ACTIVATION_DTYPES:
        raise LocalProtocolError(
            f"Activations travel as {', '.join(ACTIVATION_DTYPES)}, not {dtype!r} (proto_spec 02 §4.2).")
    return encode_array(dtype, shape, data)


def decode_activation(d: Any) -> tuple[str, tuple[int, ...], bytes]:
    """Validate an activation from the previous stage and return (dtype, shape, data) (proto_spec 02 §4.2).

    Raises:
        RemoteProtocolError: not a valid array map (``decode_array``), or a dtype that is not an
            activation dtype.
    """
    dtype, shape, data = decode_array(d)
    if dtype not in ACTIVATION_DTYPES:
        raise RemoteProtocolError(
            f"An activation arrived in dtype {dtype!r}; expected {', '.join(ACTIVATION_DTYPES[:-1])} "
            f"or {ACTIVATION_DTYPES[-1]} (proto_spec 02 §4.2).")
    return dtype, shape, data

"""Typed ring and edge frames (proto_spec 05 §3, 07 §7), with the one decoder, sans-IO.

Wire form: frame-layer maps (proto_spec 02 §1.2) ``{"t": <type>, <field>: <value>, ...}``, the
same keys as ever. Every frame a ring edge carries is one frozen attrs class here;
:func:`decode_ring_frame` turns a received map into one, checking every field, and raises
:class:`~kafilad.errors.MalformedFrame` (a ``code``, the frame type and the field) otherwise: the
driver then ends that link or ring with the reason, never the daemon. Unknown keys are ignored; an
unknown ``"t"`` decodes to :class:`UnknownRingFrame`, which drivers log and drop (forward
compatibility, proto_spec 02 §1.2). ``to_wire()`` gives the map to send.

```
 class       "t"          fields (wire key: type)                                   proto_spec
 Act         act          req: str, sample: bool (absent: false), h: array | nil,    05 §3
                          hops: [[str, num], ...], from?: str, reuse?: int >= 0,
                          evict?: [str]
 BatchAct    act          reqs: [str, ...] (>= 1, distinct), mb: int 0..63            05 §3
                          (absent: 0), sample: bool (absent: true), h: array,
                          hops: [[str, num], ...]
 End         end          req: str, stats: [[str, int, num, num, int], ...],          05 §3
                          keep?: int >= 0, evict?: [str]
 EdgeAck     edge_ack     es: int >= 0                                               07 §7
 PathReady   path_ready   es: int >= 0                                               07 §7
 PathSwitched path_switched  (no fields; an older sender's, dropped by the edge)     07 §7
 IceOffer    ice_offer    edge: str, try: int (absent: 0), ufrag: str, pwd: str,     07 §2
                          cands?: [str], nat_class?, nat_reason?, birthday?: bool
                          (a rendezvous signal body, not a ring frame: decode_ice_offer)
```
An ``act`` with a ``reqs`` key is a :class:`BatchAct`, else an :class:`Act`. ``h`` is an activation
array map (proto_spec 02 §4.2), checked by :func:`kafilad.proto.frames.decode_activation`.

The edge envelope (proto_spec 07 §7): every ring frame a sender sends on an edge carries ``"es"``,
its sequence number on that edge. :func:`decode_edge` splits what an edge's receiver reads into the
edge's own frames (``EdgeAck``, ``PathReady``, ``PathSwitched``) and :class:`Sequenced` ring frame
bodies (the map without ``es``; ``es`` None for an older sender that sends none).

Pure: no trio, sockets or mlx (tests/test_import_boundary.py).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional, Union

import attrs

from kafilad.errors import LocalProtocolError, MalformedFrame, RemoteProtocolError
from kafilad.proto.frames import decode_activation
from kafilad.proto.natclass import CLASSES

#: Micro-batch groups a batched act may name (proto_spec 05 §3 `mb`).
MAX_GROUPS = 64
#: The sequence field every ring frame carries on an edge (proto_spec 07 §7).
SEQ = "es"

Hop = tuple  # (peer_id: str, compute_s: float)
StatsRow = tuple  # (peer_id: str, steps: int, compute_s_total: float, decode_stage_s_median: float, bytes_sent: int)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Reader:
    """Field checks of one received map, raising MalformedFrame naming the frame and the field."""

    def __init__(self, d: dict, t: str):
        self.d, self.t = d, t

    def fail(self, code: str, field: str, what: str) -> MalformedFrame:
        return MalformedFrame(f"malformed {self.t} frame: {what}", code=code, frame_type=self.t, field=field)

    def need(self, key: str):
        if key not in self.d:
            raise self.fail("missing", key, f"'{key}' is missing")
        return self.d[key]

    def str_(self, key: str, *, optional: bool = False) -> Optional[str]:
        v = self.d.get(key) if optional else self.need(key)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise self.fail("type", key, f"'{key}' is {_short(v)}, not a string")
        return v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail("type", key, f"'{key}' is {_short(v)}, not a boolean")
        return v

    def int_(self, key: str, *, default=None, minimum: int = 0, maximum: Optional[int] = None,
             optional: bool = False) -> Optional[int]:
        v = self.d.get(key)
        if v is None:
            if optional:
                return None
            if default is not None:
                return default
            v = self.need(key)
        if not _int(v):
            raise self.fail("type", key, f"'{key}' is {_short(v)}, not an integer")
        if v < minimum or (maximum is not None and v > maximum):
            bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
            raise self.fail("range", key, f"'{key}' is {v}, not {bound}")
        return v

    def strs(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        v = self.need(key) if required else self.d.get(key)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail("type", key, f"'{key}' is {_short(v)}, not a list of strings")
        return tuple(v)

    def hops(self) -> tuple[Hop, ...]:
        v = self.d.get("hops")
        if v is None:
            return ()
        if not isinstance(v, list):
            raise self.fail("type", "hops", f"'hops' is {_short(v)}, not a list")
        out = []
        for hop in v:
            if not (isinstance(hop, list) and len(hop) == 2 and isinstance(hop[0], str) and _num(hop[1])):
                raise self.fail("type", "hops", f"hop {_short(hop)} is not [peer_id, compute_s]")
            out.append((hop[0], hop[1]))
        return tuple(out)

    def activation(self, *, nullable: bool) -> Optional[dict]:
        v = self.d.get("h") if nullable else self.need("h")
        if v is None and nullable:
            return None
        try:
            decode_activation(v)
        except RemoteProtocolError as e:
            raise self.fail("type", "h", f"'h' is not an activation ({e})") from None
        return v


#: the most positions one act may take back from a request's caches (its rejected drafts)
MAX_TRIM = 1 << 16


class RingFrame:
    """Base of every ring and edge frame: ``T`` is the wire type, :meth:`to_wire` the map to send."""

    T: ClassVar[str] = ""

    def to_wire(self) -> dict:
        raise NotImplementedError


@attrs.frozen
class Act(RingFrame):
    """One request's pass (a prefill chunk or a single-form decode step), proto_spec 05 §3.

    Attributes:
        req: the request id. sample: the head samples the returned output (the last prefill chunk,
            every decode step). h: the activation map (1, L, D), None for an unsampled chunk on its
            way back to the head. hops: (peer_id, compute_s) of each stage so far, in ring order.
        from_entry, reuse: the prompt-cache entry (wire "from") its caches start from and how many
            of its tokens (None, 0: none). evict: prompt-cache entries to forget first.
        trim: positions every stage takes back from the request's caches before it runs this pass:
            the drafts the head rejected last pass (speculative decoding, proto_spec 05 §3.1).
    """

    T: ClassVar[str] = "act"
    req: str
    sample: bool = False
    h: Optional[dict] = None
    hops: tuple = ()
    from_entry: Optional[str] = None
    reuse: int = 0
    evict: tuple = ()
    trim: int = 0

    @property
    def reqs(self) -> tuple[str, ...]:
        """The rows this pass carries: its one request."""
        return (self.req,)

    def to_wire(self) -> dict:
        out = {"t": "act", "req": self.req, "sample": self.sample, "h": self.h, "hops": [list(x) for x in self.hops]}
        if self.from_entry is not None:
            out["from"], out["reuse"] = self.from_entry, self.reuse
        if self.evict:
            out["evict"] = list(self.evict)
        if self.trim:
            out["trim"] = self.trim
        return out

    def row_trims(self) -> tuple[int, ...]:
        """The positions to take back for each row: its one row's."""
        return (self.trim,)


@attrs.frozen
class BatchAct(RingFrame):
    """A batched decode step (proto_spec 05 §3): row i of ``h`` (B, L, D) belongs to ``reqs[i]``
    (L = 1, or 1 + k for a speculative pass, §3.1).

    Attributes:
        reqs: distinct request ids, in row order. mb: the micro-batch group, 0..MAX_GROUPS-1.
        sample: always true on the wire today. h: the activation map. hops: as :class:`Act`.
        trims: per row, positions to take back first (as :attr:`Act.trim`); () for none.
    """

    T: ClassVar[str] = "act"
    reqs: tuple
    h: dict
    mb: int = 0
    sample: bool = True
    hops: tuple = ()
    trims: tuple = ()

    def to_wire(self) -> dict:
        out = {"t": "act", "reqs": list(self.reqs), "mb": self.mb, "sample": self.sample, "h": self.h,
               "hops": [list(x) for x in self.hops]}
        if any(self.trims):
            out["trims"] = list(self.trims)
        return out

    def row_trims(self) -> tuple[int, ...]:
        """The positions to take back for each row, zeros when none are due."""
        return tuple(self.trims) if self.trims else (0,) * len(self.reqs)


@attrs.frozen
class End(RingFrame):
    """A request ended (proto_spec 05 §3): every stage frees (or keeps) its caches and adds its row.

    Attributes:
        req: the request id. stats: one row per stage so far, (peer_id, steps, compute_s_total,
            decode_stage_s_median, ring_bytes_sent). keep: positions every stage keeps as a
            prompt-cache entry named ``req`` (None: free them). evict: entries to forget.
    """

    T: ClassVar[str] = "end"
    req: str
    stats: tuple = ()
    keep: Optional[int] = None
    evict: tuple = ()

    @property
    def reqs(self) -> tuple[str, ...]:
        return (self.req,)

    def to_wire(self) -> dict:
        out = {"t": "end", "req": self.req, "stats": [list(r) for r in self.stats]}
        if self.keep is not None:
            out["keep"] = self.keep
        if self.evict:
            out["evict"] = list(self.evict)
        return out


@attrs.frozen
class EdgeAck(RingFrame):
    """receiver -> sender: frames up to ``es`` reached the ring (proto_spec 07 §7)."""

    T: ClassVar[str] = "edge_ack"
    es: int

    def to_wire(self) -> dict:
        return {"t": "edge_ack", SEQ: self.es}


@attrs.frozen
class PathReady(RingFrame):
    """receiver -> sender, on a new path only: it reads this path from now on; ``es`` = the last frame
    it handed to the ring (proto_spec 07 §7)."""

    T: ClassVar[str] = "path_ready"
    es: int

    def to_wire(self) -> dict:
        return {"t": "path_ready", SEQ: self.es}


@attrs.frozen
class PathSwitched(RingFrame):
    """An older sender's notice of a switch; carries nothing the receiver needs (dropped, 07 §7)."""

    T: ClassVar[str] = "path_switched"

    def to_wire(self) -> dict:
        return {"t": "path_switched"}


@attrs.frozen
class UnknownRingFrame:
    """A map whose ``"t"`` no ring frame of this version has: log and drop it (proto_spec 02 §1.2)."""

    t: str


#: what decode_ring_frame returns
AnyRingFrame = Union[Act, BatchAct, End, EdgeAck, PathReady, PathSwitched, UnknownRingFrame]
#: the edge's own frames (proto_spec 07 §7): they never reach the ring
EDGE_FRAMES = (EdgeAck, PathReady, PathSwitched)


def _stats(r: _Reader) -> tuple[StatsRow, ...]:
    v = r.d.get("stats")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise r.fail("type", "stats", f"'stats' is {_short(v)}, not a list")
    rows = []
    for row in v:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and _int(row[1])
                and _num(row[2]) and _num(row[3]) and _int(row[4])):
            raise r.fail("type", "stats", f"stats row {_short(row)} is not [peer_id, steps, compute_s_total, "
                                          "decode_stage_s_median, ring_bytes_sent]")
        rows.append(tuple(row))
    return tuple(rows)


def _act(r: _Reader) -> Union[Act, BatchAct]:
    if "reqs" in r.d:
        reqs = r.strs("reqs", required=True)
        if not reqs or len(set(reqs)) != len(reqs):
            raise r.fail("range", "reqs", f"'reqs' is {_short(list(reqs))}, not one or more distinct ids")
        trims = r.d.get("trims")
        if trims is not None and (not isinstance(trims, list) or len(trims) != len(reqs) or not all(
                _int(n) and 0 <= n <= MAX_TRIM for n in trims)):
            raise r.fail("type", "trims", f"'trims' is {_short(trims)}, not one integer 0..{MAX_TRIM} per row")
        return BatchAct(reqs=reqs, h=r.activation(nullable=False), mb=r.int_("mb", default=0, maximum=MAX_GROUPS - 1),
                        sample=r.bool_("sample", True), hops=r.hops(), trims=tuple(trims or ()))
    return Act(req=r.str_("req"), sample=r.bool_("sample", False), h=r.activation(nullable=True), hops=r.hops(),
               from_entry=r.str_("from", optional=True), reuse=r.int_("reuse", default=0), evict=r.strs("evict"),
               trim=r.int_("trim", default=0, maximum=MAX_TRIM))


def _end(r: _Reader) -> End:
    return End(req=r.str_("req"), stats=_stats(r), keep=r.int_("keep", optional=True), evict=r.strs("evict"))


_DECODERS = {
    "act": _act,
    "end": _end,
    "edge_ack": lambda r: EdgeAck(r.int_(SEQ)),
    "path_ready": lambda r: PathReady(r.int_(SEQ)),
    "path_switched": lambda r: PathSwitched(),
}


def decode_ring_frame(d: Any) -> AnyRingFrame:
    """The typed frame for a map received on a ring edge (proto_spec 05 §3, 07 §7).

    Args:
        d: a frame body as the frame layer returns it (a map with a str "t"), or any msgpack value.
    Returns:
        One of Act, BatchAct, End, EdgeAck, PathReady, PathSwitched; UnknownRingFrame for another "t".
    Raises:
        MalformedFrame: not a map with a non-empty str "t" (code "not_map"), or a field of a known
            frame missing or of the wrong type or range (codes "missing", "type", "range"); the
            message names the frame and the field.
    """
    if not isinstance(d, dict) or not isinstance(d.get("t"), str) or not d["t"]:
        raise MalformedFrame("malformed ring frame: not a map with a string 't'", code="not_map")
    t = d["t"]
    decode = _DECODERS.get(t)
    if decode is None:
        return UnknownRingFrame(t)
    return decode(_Reader(d, t))


@attrs.frozen
class Sequenced:
    """A ring frame's body as an edge carried it (proto_spec 07 §7).

    Attributes:
        es: its sequence number on the edge (>= 1); None from an older sender that sends none.
        body: the map without ``es``, for :func:`decode_ring_frame`.
    """

    es: Optional[int]
    body: dict


def decode_edge(d: Any) -> Union[EdgeAck, PathReady, PathSwitched, Sequenced]:
    """Split a map read on a ring edge into the edge's own frame or a sequenced ring frame body.

    Returns:
        EdgeAck / PathReady / PathSwitched, or Sequenced (a new map; ``d`` is not changed).
    Raises:
        MalformedFrame: not a map with a str "t"; an edge frame with a bad field (as
            :func:`decode_ring_frame`); a ring frame whose "es" is not an integer >= 1 (code "sequence").
    """
    if not isinstance(d, dict) or not isinstance(d.get("t"), str) or not d["t"]:
        raise MalformedFrame("malformed ring frame: not a map with a string 't'", code="not_map")
    if d["t"] in ("edge_ack", "path_ready", "path_switched"):
        return decode_ring_frame(d)
    if SEQ not in d:
        return Sequenced(None, d)
    es = d[SEQ]
    if not _int(es) or es < 1:
        raise MalformedFrame(f"malformed {d['t']} frame: its sequence number {_short(es)} is not an integer >= 1",
                             code="sequence", frame_type=d["t"], field=SEQ)
    body = dict(d)
    del body[SEQ]
    return Sequenced(es, body)


def stamp(body: dict, es: int) -> dict:
    """The map a sender puts on an edge: ``body`` with ``"es": es`` (proto_spec 07 §7).

    Raises:
        LocalProtocolError: ``es`` < 1, or ``body`` already has an "es".
    """
    if not _int(es) or es < 1:
        raise LocalProtocolError(f"An edge sequence number is an integer >= 1, not {es!r}.")
    if SEQ in body:
        raise LocalProtocolError("A ring frame body must not carry its own 'es' (proto_spec 07 §7).")
    return {**body, SEQ: es}


@attrs.frozen
class IceOffer:
    """One end's candidate offer for one attempt on one edge, a rendezvous ``signal`` body (proto_spec 07 §2).

    Attributes:
        edge: the edge id ``<session_id>:<epoch>:<sender>><receiver>``. attempt: wire "try", 0 at
            formation, 1, 2, ... for re-probes. ufrag, pwd: ICE credentials (RFC 8445 §5.3).
        cands: SDP candidate values, as sent (kafilad/proto/ice.py ``candidates_from_sdp`` parses
            them and skips what it cannot use). nat_class: one of natclass.CLASSES, else None.
        nat_reason: why the class is "unknown", or None. birthday: the end searches C-S / S-S
            re-probes by birthday probing (§7b).
    """

    T: ClassVar[str] = "ice_offer"
    edge: str
    attempt: int
    ufrag: str
    pwd: str
    cands: tuple = ()
    nat_class: Optional[str] = None
    nat_reason: Optional[str] = None
    birthday: bool = False

    def to_wire(self) -> dict:
        out = {"t": "ice_offer", "edge": self.edge, "try": self.attempt, "ufrag": self.ufrag, "pwd": self.pwd,
               "cands": list(self.cands), "nat_class": self.nat_class, "birthday": self.birthday}
        if self.nat_reason:
            out["nat_reason"] = self.nat_reason
        return out


def decode_ice_offer(d: Any) -> IceOffer:
    """The typed offer for a received signal body (proto_spec 07 §2).

    The optional fields are read leniently, as an older or newer peer may fill them otherwise: a
    ``cands`` that is not a list is empty and its non-str entries are dropped, a ``nat_class``
    outside natclass.CLASSES is None, a ``nat_reason`` that is not a non-empty str is None, ``birthday`` is
    true only when it is ``true``.

    Raises:
        MalformedFrame: not a map with "t" "ice_offer" (code "not_map"), or ``edge`` / ``ufrag`` /
            ``pwd`` not a str, ``try`` not an integer (the offer is dropped).
    """
    if not isinstance(d, dict) or d.get("t") != "ice_offer":
        raise MalformedFrame("malformed ice_offer: not a map with 't' 'ice_offer'", code="not_map")
    r = _Reader(d, "ice_offer")
    attempt = d.get("try", 0)
    if not _int(attempt):
        raise r.fail("type", "try", f"'try' is {_short(attempt)}, not an integer")
    cands = d.get("cands")
    nat_class, reason = d.get("nat_class"), d.get("nat_reason")
    return IceOffer(edge=r.str_("edge"), attempt=attempt, ufrag=r.str_("ufrag"), pwd=r.str_("pwd"),
                    cands=tuple(c for c in cands if isinstance(c, str)) if isinstance(cands, list) else (),
                    nat_class=nat_class if nat_class in CLASSES else None,
                    nat_reason=reason if isinstance(reason, str) and reason else None,
                    birthday=d.get("birthday") is True)

"""Typed control frames between a member and the host (proto_spec 05 §2), validated on receipt.

Wire form: a frame-layer map (proto_spec 02) ``{"t": <type>, <field>: <value>, ...}``. Every frame
of §2 is one frozen attrs class here; :func:`decode_control` turns a received map into one,
checking each field's type, and raises :class:`RemoteProtocolError` with a sentence naming the
frame and the field otherwise (the driver then closes that link with the reason: "a malformed
frame closes that link", DESIGN §7). Unknown keys are ignored (forward compatibility, proto_spec
05 preamble); an unknown ``"t"`` is reported as :class:`UnknownFrame` so drivers log and ignore it.

```
host -> member  Pending                         unknown key, held for `kafila-ctl admit`
host -> member  Denied(reason, code)            then the link closes
host -> member  Admitted(session_id, model_id, config, dtype, context, concurrency, name)
member -> host  Capability(memory_bytes, bandwidth_Bps?, step_overhead_s?, batch_row_cost?, rendezvous_rtt_ms?,
                           nat_class?, dtype?, fallback_dtype?, backend?)
host -> member  PlanFrame(plan, ring, roster, start, end, head, tensors, files, epoch?, dtype?)
member -> host  Fetch(id, file, offset, length)
host -> member  Data(id, data) | FetchError(id, reason)
member -> host  Ready(fetched_bytes, cached_bytes, load_s, edges) | Failed(reason, code?) | Leaving(reason)
member -> host  Edges(edges) | RingBroken(reason, member)
host -> head    Gen(req, prompt, max_tokens, temperature, sampling?)
head -> host    GenEvent(req, event) | GenDone(req, result: GenResult) | GenError(req, message, code)
host -> head    Cancel(req, reason?)             the request's client went away: end it now
host -> member  SessionFailed(reason) | SessionClosed(reason)      the latter: ended for good, forget it
either way      Ping(n)                                            every 2 s; 8 s without a frame = lost
```
Pure: no trio, sockets or mlx (tests/test_import_boundary.py).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Optional

import attrs

from kafilad.errors import RemoteProtocolError

#: NAT classes a capability may report (DESIGN §3 step 3; None = not classified; "unknown" =
#: classification ran but the mapping was not measured, proto_spec 04 §4.6).
NAT_CLASSES = (None, "O", "C", "S", "unknown")
#: Float dtypes a stage may hold and a capability may report (proto_spec 05 §2; 02 §4.1).
STAGE_DTYPES = ("float32", "bfloat16", "float16")
#: Largest byte range one `fetch` may ask for (proto_spec 05 §2).
FETCH_MAX_BYTES = 4 * 1024 * 1024
#: Most `fetch` frames a member may have unanswered; the host closes the link of a member with
#: more (proto_spec 05 §2.1).
FETCHES_IN_FLIGHT_MAX = 8

_NUM = (int, float)


def _is(value: Any, kind) -> bool:
    """Type check where bool is not a number and floats must be finite."""
    if kind is float or kind == _NUM:
        return isinstance(value, _NUM) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _field(kind, *, optional: bool = False, minimum: Optional[float] = None, maximum: Optional[float] = None,
           default=attrs.NOTHING):
    """An attrs field carrying its wire type and bounds for :func:`decode_control`."""
    if optional and default is attrs.NOTHING:
        default = None
    return attrs.field(default=default, metadata={"kind": kind, "optional": optional, "minimum": minimum,
                                                  "maximum": maximum})


class ControlFrame:
    """Base of every control frame: ``T`` is the wire type, :meth:`to_wire` the map to send."""

    T: ClassVar[str] = ""

    def to_wire(self) -> dict:
        out = {"t": self.T}
        for a in attrs.fields(type(self)):
            v = getattr(self, a.name)
            if isinstance(v, GenResult):
                v = v.to_wire()
            out[a.name] = v
        return out


_TYPES: dict[str, type] = {}


def _frame(t: str):
    def deco(cls):
        cls = attrs.frozen(cls)
        cls.T = t
        _TYPES[t] = cls
        return cls
    return deco


@_frame("pending")
class Pending(ControlFrame):
    pass


@_frame("denied")
class Denied(ControlFrame):
    reason: str = _field(str)
    #: kafilad/errors.py: DENIED, ALREADY_IN_SESSION, SESSION_COMPLETE, ADMIT_TIMEOUT, SESSION_FAILED; a
    #: member decides on it (whether to rejoin later), never on `reason`. Absent from older hosts: DENIED.
    code: str = _field(str, default="denied")


@_frame("admitted")
class Admitted(ControlFrame):
    session_id: str = _field(str)
    model_id: str = _field(str)
    config: dict = _field(dict)
    dtype: str = _field(str)
    context: int = _field(int, minimum=1)
    concurrency: int = _field(int, minimum=1)
    #: the member's name in this session (the host makes names unique; None: its own name)
    name: Optional[str] = _field(str, optional=True)


@_frame("capability")
class Capability(ControlFrame):
    memory_bytes: int = _field(int, minimum=1)
    bandwidth_Bps: Optional[float] = _field(_NUM, optional=True, minimum=0)
    step_overhead_s: Optional[float] = _field(_NUM, optional=True, minimum=0)
    #: rho: the extra cost of each further row of a batched decode step, as a fraction of a one-row
    #: step (kafilad/executor/probe.py times 4 rows against 1; kafilad/planner/throughput.py)
    batch_row_cost: Optional[float] = _field(_NUM, optional=True, minimum=0, maximum=1)
    rendezvous_rtt_ms: Optional[float] = _field(_NUM, optional=True, minimum=0)
    nat_class: Optional[str] = _field(str, optional=True)
    #: why the class is "unknown" (no STUN answer ...), a sentence (issue 11 honest classes)
    nat_reason: Optional[str] = _field(str, optional=True)
    #: the dtype the member's backend runs fastest with, which its probe timed, and where its bandwidth
    #: figure came from (kafilad/executor/probe.py; kafilad/planner/precision.py)
    dtype: Optional[str] = _field(str, optional=True)
    bandwidth_source: Optional[str] = _field(str, optional=True)
    #: the narrower dtype it holds a stage in when the stage does not fit in `dtype` (CPU: the checkpoint's)
    fallback_dtype: Optional[str] = _field(str, optional=True)
    #: the MLX backend it runs on: "cpu", "metal" or "cuda" (informational)
    backend: Optional[str] = _field(str, optional=True)

    @classmethod
    def from_measurement(cls, cap: dict) -> "Capability":
        """The frame for a probe's result dict (keys this version does not know are left out)."""
        return cls(**{a.name: cap[a.name] for a in attrs.fields(cls) if cap.get(a.name) is not None})

    def as_record(self) -> dict:
        """The planner's view (DESIGN §5.1): a dict with every key present."""
        return {"memory_bytes": self.memory_bytes, "bandwidth_Bps": self.bandwidth_Bps or None,
                "step_overhead_s": float(self.step_overhead_s or 0.0), "batch_row_cost": self.batch_row_cost,
                "rendezvous_rtt_ms": self.rendezvous_rtt_ms,
                "nat_class": self.nat_class, "dtype": self.dtype, "bandwidth_source": self.bandwidth_source,
                "fallback_dtype": self.fallback_dtype, "backend": self.backend}


@_frame("plan")
class PlanFrame(ControlFrame):
    plan: dict = _field(dict)
    ring: list = _field(list)
    roster: dict = _field(dict)
    start: int = _field(int, minimum=0)
    end: int = _field(int, minimum=0)
    head: bool = _field(bool)
    tensors: list = _field(list)
    files: list = _field(list, default=attrs.Factory(list))
    #: the plan generation (1 at formation, +1 per replan); stale ready/ring_broken frames are ignored
    epoch: Optional[int] = _field(int, optional=True)
    #: the float dtype the member holds its stage in (the plan's `dtype`); absent: float32
    dtype: Optional[str] = _field(str, optional=True)
    #: every tensor of the checkpoint as [name, dtype, shape], for the model's own sanitize
    #: (kafilad/executor/stage.py `build_stage`); absent: the member's tensors only
    checkpoint: Optional[list] = _field(list, optional=True)
    #: to the head only: the decode schedule `kafila-ctl schedule` set in this session (schedule_settings
    #: `parse_schedule`'s words), so the setting follows the head when a replan moves it; absent: none set
    schedule: Optional[str] = _field(str, optional=True)
    #: to the head only, when the host serves a draft model (`host --draft-model`, issue 24 item 1):
    #: its files, [{name, nbytes, sha256}], which the head fetches whole as `draft/NAME` (§2.1) and
    #: loads beside its stage; absent: no draft model
    draft_files: Optional[list] = _field(list, optional=True)


@_frame("fetch")
class Fetch(ControlFrame):
    id: int = _field(int)
    file: str = _field(str)
    offset: int = _field(int, minimum=0)
    length: int = _field(int, minimum=0)


@_frame("data")
class Data(ControlFrame):
    id: int = _field(int)
    data: bytes = _field(bytes)


@_frame("fetch_error")
class FetchError(ControlFrame):
    id: int = _field(int)
    reason: str = _field(str)


@_frame("ready")
class Ready(ControlFrame):
    fetched_bytes: int = _field(int, minimum=0, default=0)
    cached_bytes: int = _field(int, minimum=0, default=0)
    load_s: float = _field(_NUM, minimum=0, default=0.0)
    edges: Optional[list] = _field(list, optional=True)
    epoch: Optional[int] = _field(int, optional=True)


@_frame("standby")
class Standby(ControlFrame):
    """host -> member: plan `epoch` leaves this member without blocks (strategy "load"); it drops any
    stage of an earlier plan and waits, ready for a later plan (proto_spec 05 §2, §2.3)."""
    epoch: int = _field(int, minimum=0)


#: the `failed` frame's code for a stage that could not be built (proto_spec 05 §2.3): no plan avoids it
FAILED_STAGE_BUILD = "stage_build"


@_frame("failed")
class Failed(ControlFrame):
    """member -> host: its stage of the current plan did not load; ``code`` FAILED_STAGE_BUILD when it
    could not be built (the host then fails the session), absent for other failures (a loss)."""
    reason: str = _field(str)
    code: Optional[str] = _field(str, optional=True)


@_frame("leaving")
class Leaving(ControlFrame):
    reason: str = _field(str)


@_frame("edges")
class Edges(ControlFrame):
    edges: list = _field(list)


@_frame("ring_broken")
class RingBroken(ControlFrame):
    reason: str = _field(str)
    member: Optional[str] = _field(str, optional=True)
    epoch: Optional[int] = _field(int, optional=True)


@_frame("gen")
class Gen(ControlFrame):
    req: str = _field(str)
    prompt: str = _field(str)
    max_tokens: int = _field(int, minimum=1)
    temperature: float = _field(_NUM, minimum=0, default=0.0)
    #: the request's sampling parameters (kafilad/proto/sampling.py wire map; the head checks it with
    #: `Sampling.from_wire` and answers `gen_error` with the reason); absent: `temperature` alone
    sampling: Optional[dict] = _field(dict, optional=True)
    #: token ids the request already generated (a stream resumed after a member's loss, issue 25 item
    #: 4): the head appends them to the prompt's and generates the rest (proto_spec 05 §2 `gen`)
    cont: Optional[list] = _field(list, optional=True)


@_frame("gen_event")
class GenEvent(ControlFrame):
    req: str = _field(str)
    event: dict = _field(dict)


@attrs.frozen
class GenResult:
    """A finished request's record (proto_spec 05 §2 `gen_done`), checked field by field.

    ``stats`` rows are ``[peer_id, steps, compute_s_total, decode_stage_s_median, ring_bytes_sent]``
    (proto_spec 05 §3 `end`). Unknown keys are dropped, so nothing a head sends can add fields
    to the host's trace records.
    """

    text: str
    token_ids: list
    prompt_tokens: int
    ttft_s: Optional[float]
    decode_tokens: int
    decode_tokens_per_s: Optional[float]
    circuit_s_median: Optional[float]
    stats: list
    batch_rows_median: Optional[float] = None  # median rows of the request's decode steps (proto_spec 05 §3)
    cached_tokens: int = 0  # prompt tokens the head took from its prompt cache (kafilad/executor/prefix.py)
    drafted: int = 0  # drafts its speculative passes carried (kafilad/proto/speculation.py)
    accepted: int = 0  # of which the head accepted

    @classmethod
    def from_wire(cls, d: Any) -> "GenResult":
        if not isinstance(d, dict):
            raise RemoteProtocolError("malformed gen_done frame: 'result' is not a map")

        def need(key, kind, optional=False):
            v = d.get(key)
            if v is None and optional:
                return None
            if not _is(v, kind):
                raise RemoteProtocolError(f"malformed gen_done frame: result '{key}' is {v!r}")
            return v

        ids = need("token_ids", list)
        if not all(_is(i, int) for i in ids):
            raise RemoteProtocolError("malformed gen_done frame: result 'token_ids' holds a non-integer")
        stats = need("stats", list, optional=True) or []
        for row in stats:
            if not (isinstance(row, (list, tuple)) and len(row) == 5 and isinstance(row[0], str)
                    and _is(row[1], int) and _is(row[2], _NUM) and _is(row[3], _NUM) and _is(row[4], int)):
                raise RemoteProtocolError(f"malformed gen_done frame: stats row {row!r} is not "
                                          "[peer_id, steps, compute_s_total, decode_stage_s_median, ring_bytes_sent]")
        return cls(text=need("text", str), token_ids=list(ids), prompt_tokens=need("prompt_tokens", int),
                   ttft_s=need("ttft_s", _NUM, True), decode_tokens=need("decode_tokens", int),
                   decode_tokens_per_s=need("decode_tokens_per_s", _NUM, True),
                   circuit_s_median=need("circuit_s_median", _NUM, True), stats=[list(r) for r in stats],
                   batch_rows_median=need("batch_rows_median", _NUM, True),
                   cached_tokens=need("cached_tokens", int, True) or 0,
                   drafted=need("drafted", int, True) or 0, accepted=need("accepted", int, True) or 0)

    def to_wire(self) -> dict:
        return attrs.asdict(self)


@_frame("gen_done")
class GenDone(ControlFrame):
    req: str = _field(str)
    result: GenResult = _field(GenResult)


@_frame("gen_error")
class GenError(ControlFrame):
    req: str = _field(str)
    message: str = _field(str)
    #: why, for programs (kafilad/errors.py, e.g. INVALID_LOGIT_BIAS: the client's fault); "": the ring's
    code: str = _field(str, default="")


@_frame("cancel")
class Cancel(ControlFrame):
    """host -> head: end request `req` early, its client went away (proto_spec 05 §2.4). Once the
    request's `end` came round, the head answers `gen_done` with what was produced (`gen_error`
    if the request had not started)."""

    req: str = _field(str)
    reason: Optional[str] = _field(str, optional=True)


@_frame("schedule")
class Schedule(ControlFrame):
    """host -> head member: show (`mode` absent) or set the head's decode schedule for
    `kafila-ctl schedule` when a member is the head (proto_spec 05 §2). `mode` as the user gave it:
    auto | lockstep | per-request | M. Answered by `schedule_state` with the same `req`."""

    req: str = _field(str)
    mode: Optional[str] = _field(str, optional=True)


@_frame("schedule_state")
class ScheduleState(ControlFrame):
    """head -> host: the answer to `schedule` (proto_spec 05 §2): `result` as the host's own
    `schedule` op gives it ({"mode", "micro_batches", ...}), or `error`, a sentence (this member is
    not the head now, or the mode cannot be applied)."""

    req: str = _field(str)
    result: Optional[dict] = _field(dict, optional=True)
    error: Optional[str] = _field(str, optional=True)


@_frame("ping")
class Ping(ControlFrame):
    """Either side, every KEEPALIVE interval: proof of life on a ctl link (issue 8 §1; proto_spec 05 §2.3).
    Any frame counts as life; a ping is sent so that an idle link carries one. Never answered."""
    n: int = _field(int, minimum=0)


@_frame("session_failed")
class SessionFailed(ControlFrame):
    reason: str = _field(str)


@_frame("session_closed")
class SessionClosed(ControlFrame):
    """host -> member: the host ended the session for good (`kafila-ctl leave`); do not rejoin it."""
    reason: str = _field(str)


@attrs.frozen
class UnknownFrame:
    """A map whose ``"t"`` no frame of this version has: log and ignore it (forward compatibility)."""

    t: Any


def decode_control(d: Any) -> "ControlFrame | UnknownFrame":
    """The typed frame for a received map.

    Raises:
        RemoteProtocolError: not a map, no string "t", or a field of a known frame missing or of the
            wrong type (the message names the frame and the field).
    """
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise RemoteProtocolError("malformed control frame: not a map with a string 't'")
    cls = _TYPES.get(d["t"])
    if cls is None:
        return UnknownFrame(d["t"])
    kw = {}
    for a in attrs.fields(cls):
        meta = a.metadata
        v = d.get(a.name)
        if v is None:
            if meta["optional"]:
                continue
            if a.default is not attrs.NOTHING:
                continue
            raise RemoteProtocolError(f"malformed {cls.T} frame: '{a.name}' is missing")
        kind = meta["kind"]
        if kind is GenResult:
            v = GenResult.from_wire(v)
        elif kind is bytes:
            if isinstance(v, bytearray):
                v = bytes(v)
            if not isinstance(v, bytes):
                raise RemoteProtocolError(f"malformed {cls.T} frame: '{a.name}' is not bytes")
        elif not _is(v, kind):
            raise RemoteProtocolError(f"malformed {cls.T} frame: '{a.name}' is {_short(v)}")
        if meta["minimum"] is not None and v < meta["minimum"]:
            raise RemoteProtocolError(f"malformed {cls.T} frame: '{a.name}' is {_short(v)}, below {meta['minimum']}")
        if meta["maximum"] is not None and v > meta["maximum"]:
            raise RemoteProtocolError(f"malformed {cls.T} frame: '{a.name}' is {_short(v)}, above {meta['maximum']}")
        kw[a.name] = v
    frame = cls(**kw)
    if isinstance(frame, Capability) and frame.nat_class not in NAT_CLASSES:
        raise RemoteProtocolError(f"malformed capability frame: 'nat_class' is {_short(frame.nat_class)}")
    for name in ("dtype", "fallback_dtype"):
        if isinstance(frame, (Capability, PlanFrame)) and getattr(frame, name, None) not in (None, *STAGE_DTYPES):
            raise RemoteProtocolError(f"malformed {cls.T} frame: '{name}' is {_short(getattr(frame, name))}, "
                                      f"not one of {', '.join(STAGE_DTYPES)}")
    if isinstance(frame, Fetch) and frame.length > FETCH_MAX_BYTES:
        raise RemoteProtocolError(f"malformed fetch frame: 'length' {frame.length} exceeds {FETCH_MAX_BYTES} bytes")
    return frame


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."

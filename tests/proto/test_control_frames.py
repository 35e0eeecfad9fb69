"""Typed control frames (kafilad/proto/control.py, proto_spec 05 §2): round trips and validation on receipt.

Every frame type goes to_wire -> proto_spec 02 frame -> msgpack -> decode_control and back
equal; a malformed field is a RemoteProtocolError whose sentence names the frame and the field;
unknown keys are dropped and an unknown "t" is an UnknownFrame (forward compatibility). A
hypothesis property feeds decode_control arbitrary msgpack maps: it returns a frame or
UnknownFrame, or raises RemoteProtocolError, and nothing else.
"""

from __future__ import annotations

import math

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kafilad.errors import RemoteProtocolError
from kafilad.proto import control as cf

from proto.session_helpers import over_the_wire, sample_frames

SAMPLES = sample_frames()
FIELD_NAMES = sorted({a.name for cls in cf._TYPES.values() for a in attrs.fields(cls)})
RESULT_KEYS = [a.name for a in attrs.fields(cf.GenResult)]


def wire(t: str, **changes) -> dict:
    """The wire map of the sample ``t`` frame with ``changes`` applied (a value of ... removes the key)."""
    d = {**SAMPLES[t].to_wire(), **changes}
    return {k: v for k, v in d.items() if v is not ...}


def msgpack_trip(d):
    return msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False, strict_map_key=False)


def rejects(d, *fragments: str) -> str:
    with pytest.raises(RemoteProtocolError) as info:
        cf.decode_control(d)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, msg
    return msg


# ---- round trips ---------------------------------------------------------------------------------
def test_the_samples_hold_every_frame_type():
    assert set(SAMPLES) == set(cf._TYPES)
    assert all(type(f).T == t for t, f in SAMPLES.items())


@pytest.mark.parametrize("t", sorted(SAMPLES))
def test_every_frame_round_trips_through_the_wire(t):
    frame = SAMPLES[t]
    body = frame.to_wire()
    assert body["t"] == t and set(body) == {"t"} | {a.name for a in attrs.fields(type(frame))}
    assert over_the_wire(frame) == frame  # to_wire, proto_spec 02 framing, msgpack, decode_control
    assert cf.decode_control(msgpack_trip(body)) == frame


@pytest.mark.parametrize("t", sorted(SAMPLES))
def test_unknown_keys_are_ignored(t):
    assert cf.decode_control(wire(t, future_field=[1, 2], another={"x": b"y"})) == SAMPLES[t]


def test_session_closed_round_trips():
    """host -> member `session_closed` (proto_spec 05 §2): the session ended for good, the member forgets it."""
    f = cf.SessionClosed("the host closed the session")
    assert cf.SessionClosed.T == "session_closed" and cf._TYPES["session_closed"] is cf.SessionClosed
    assert f.to_wire() == {"t": "session_closed", "reason": "the host closed the session"}
    assert cf.decode_control({"t": "session_closed", "reason": "the host closed the session"}) == f
    assert cf.decode_control(msgpack_trip(f.to_wire())) == f and over_the_wire(f) == f
    assert cf.decode_control({"t": "session_closed", "reason": ""}) == cf.SessionClosed("")
    assert f != cf.SessionFailed("the host closed the session")  # a different frame, not a failure
    rejects({"t": "session_closed"}, "malformed session_closed frame: 'reason' is missing")
    rejects({"t": "session_closed", "reason": 5}, "malformed session_closed frame: 'reason' is 5")


def test_an_unknown_type_is_reported_for_the_driver_to_ignore():
    assert cf.decode_control({"t": "hello_v9", "x": 1}) == cf.UnknownFrame("hello_v9")


@pytest.mark.parametrize("d", [None, [], "pending", 5, {}, {"t": 1}, {"t": None}, {"t": b"pending"}, {"type": "pending"}])
def test_not_a_map_with_a_string_type(d):
    rejects(d, "malformed control frame: not a map with a string 't'")


REQUIRED = [(t, a.name) for t, f in SAMPLES.items() for a in attrs.fields(type(f))
            if a.default is attrs.NOTHING and not a.metadata["optional"]]


@pytest.mark.parametrize("t, field", REQUIRED, ids=[f"{t}.{n}" for t, n in REQUIRED])
def test_a_required_field_missing_or_null_is_named(t, field):
    rejects(wire(t, **{field: ...}), f"malformed {t} frame: '{field}' is missing")
    rejects(wire(t, **{field: None}), f"malformed {t} frame: '{field}' is missing")


def test_optional_and_default_fields_may_be_absent():
    assert cf.decode_control({"t": "ready"}) == cf.Ready(fetched_bytes=0, cached_bytes=0, load_s=0.0, edges=None,
                                                         epoch=None)
    assert cf.decode_control({"t": "capability", "memory_bytes": 1}) == cf.Capability(memory_bytes=1)
    assert cf.decode_control(wire("plan", files=..., epoch=None)).files == []
    assert cf.decode_control(wire("admitted", name=None)).name is None
    assert cf.decode_control(wire("ring_broken", member=None, epoch=...)) == cf.RingBroken("beta stopped answering")


#: A value of the wrong wire type for each kind of field.
WRONG = {str: 5, int: "5", list: {"a": 1}, dict: [1], bool: 1, bytes: "bytes as text", cf._NUM: "1.5",
         cf.GenResult: "a result"}
TYPED = [(t, a.name, a.metadata["kind"]) for t, f in SAMPLES.items() for a in attrs.fields(type(f))]


@pytest.mark.parametrize("t, field, kind", TYPED, ids=[f"{t}.{n}" for t, n, _ in TYPED])
def test_a_field_of_the_wrong_type_is_named(t, field, kind):
    rejects(wire(t, **{field: WRONG[kind]}), f"malformed {t} frame", f"'{field}'" if kind is not cf.GenResult
            else "'result' is not a map")


# ---- specific malformed inputs -------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 0, -(2 ** 63)])
def test_memory_bytes_must_be_positive(value):
    rejects(wire("capability", memory_bytes=value), "malformed capability frame: 'memory_bytes'", "below 1")


@pytest.mark.parametrize("t, field", [("capability", "memory_bytes"), ("fetch", "id"), ("fetch", "length"),
                                      ("plan", "start"), ("admitted", "context"), ("gen", "max_tokens"),
                                      ("ready", "fetched_bytes"), ("ready", "epoch"), ("data", "id")])
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_not_an_integer(t, field, value):
    rejects(wire(t, **{field: value}), f"malformed {t} frame: '{field}' is {value!r}")


@pytest.mark.parametrize("t, field", [("capability", "bandwidth_Bps"), ("ready", "load_s"), ("gen", "temperature")])
def test_a_bool_is_not_a_number(t, field):
    rejects(wire(t, **{field: True}), f"'{field}' is True")


def test_an_integer_is_not_a_bool():
    rejects(wire("plan", head=1), "malformed plan frame: 'head' is 1")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("t, field", [("capability", "bandwidth_Bps"), ("capability", "step_overhead_s"),
                                      ("capability", "rendezvous_rtt_ms"), ("ready", "load_s"), ("gen", "temperature")])
def test_numbers_must_be_finite(t, field, value):
    rejects(msgpack_trip(wire(t, **{field: value})), f"malformed {t} frame: '{field}'")


@pytest.mark.parametrize("t, field", [("capability", "bandwidth_Bps"), ("fetch", "offset"), ("gen", "temperature"),
                                      ("ready", "cached_bytes"), ("plan", "end")])
def test_negative_quantities_are_refused(t, field):
    rejects(wire(t, **{field: -1}), f"'{field}' is -1, below 0")


@pytest.mark.parametrize("nat_class", [None, "O", "C", "S"])
def test_nat_classes(nat_class):
    assert cf.decode_control(wire("capability", nat_class=nat_class)).nat_class == nat_class


@pytest.mark.parametrize("nat_class", ["X", "o", "", "symmetric"])
def test_an_unknown_nat_class_is_refused(nat_class):
    rejects(wire("capability", nat_class=nat_class), f"malformed capability frame: 'nat_class' is {nat_class!r}")


def test_a_fetch_is_at_most_4_mib():
    assert cf.FETCH_MAX_BYTES == 4 * 1024 * 1024  # proto_spec 05 §2
    assert cf.decode_control(wire("fetch", length=4 * 1024 * 1024)).length == 4 * 1024 * 1024
    rejects(wire("fetch", length=4 * 1024 * 1024 + 1), "malformed fetch frame: 'length' 4194305 exceeds 4194304 bytes")
    rejects(wire("fetch", length=2 ** 64 - 1), "exceeds")


def test_data_bytes():
    assert cf.decode_control(wire("data", data=bytearray(b"\x00\x01"))) == cf.Data(id=7, data=b"\x00\x01")
    rejects(wire("data", data=[0, 1]), "malformed data frame: 'data' is not bytes")


# ---- gen_done results ------------------------------------------------------------------------------
def result(**changes) -> dict:
    return {**SAMPLES["gen_done"].result.to_wire(), **changes}


@pytest.mark.parametrize("row", [["H", 3, 0.5, 0.1], ["H", 3, 0.5, 0.1, 4096, 1], [], "H,3,0.5,0.1,4096",
                                 [3, 3, 0.5, 0.1, 4096], ["H", 3.5, 0.5, 0.1, 4096], ["H", 3, "0.5", 0.1, 4096],
                                 ["H", 3, 0.5, math.nan, 4096], ["H", 3, 0.5, 0.1, 4096.0], ["H", True, 0.5, 0.1, 1]])
def test_a_stats_row_of_the_wrong_shape_is_refused(row):
    rejects(msgpack_trip(wire("gen_done", result=result(stats=[["A", 1, 0.1, 0.1, 1], row]))),
            "malformed gen_done frame: stats row",
            "is not [peer_id, steps, compute_s_total, decode_stage_s_median, ring_bytes_sent]")


def test_extra_keys_in_a_result_are_dropped():
    f = cf.decode_control(wire("gen_done", result=result(evil="x" * 10, kind="overwrite", wall_s=1e9)))
    assert f == SAMPLES["gen_done"]
    assert set(f.result.to_wire()) == set(RESULT_KEYS)


def test_a_result_without_optional_timings():
    f = cf.decode_control(wire("gen_done", result=result(ttft_s=None, decode_tokens_per_s=None, circuit_s_median=None,
                                                         stats=None)))
    assert f.result.ttft_s is None and f.result.stats == []


@pytest.mark.parametrize("changes, fragment", [
    ({"token_ids": [1, "2"]}, "'token_ids' holds a non-integer"),
    ({"token_ids": [1, True]}, "'token_ids' holds a non-integer"),
    ({"token_ids": None}, "result 'token_ids' is None"),
    ({"text": b"bytes"}, "result 'text' is b'bytes'"),
    ({"prompt_tokens": 1.5}, "result 'prompt_tokens' is 1.5"),
    ({"ttft_s": math.inf}, "result 'ttft_s' is inf"),
    ({"decode_tokens": ...}, "result 'decode_tokens' is None"),
    ({"stats": {"H": [1]}}, "result 'stats' is"),
])
def test_a_malformed_result_field_is_named(changes, fragment):
    r = {k: v for k, v in result(**changes).items() if v is not ...}
    rejects(msgpack_trip(wire("gen_done", result=r)), "malformed gen_done frame", fragment)


# ---- capability records --------------------------------------------------------------------------
def test_capability_from_a_measurement_keeps_known_keys_only():
    cap = cf.Capability.from_measurement({"memory_bytes": 1 << 30, "bandwidth_Bps": None, "nat_class": "O",
                                          "probe_blocks": 3, "dtype": "float32"})
    assert cap == cf.Capability(memory_bytes=1 << 30, nat_class="O", dtype="float32")
    assert cap.as_record() == {"memory_bytes": 1 << 30, "bandwidth_Bps": None, "step_overhead_s": 0.0,
                               "batch_row_cost": None, "rendezvous_rtt_ms": None, "nat_class": "O", "dtype": "float32",
                               "bandwidth_source": None, "fallback_dtype": None, "backend": None}


def test_capability_carries_the_dtype_its_fallback_and_backend():
    cap = cf.Capability.from_measurement({"memory_bytes": 1 << 30, "dtype": "float32",
                                          "fallback_dtype": "bfloat16", "backend": "cpu"})
    back = cf.decode_control(msgpack_trip(cap.to_wire()))
    assert back == cap
    rec = back.as_record()
    assert (rec["dtype"], rec["fallback_dtype"], rec["backend"]) == ("float32", "bfloat16", "cpu")


# ---- batch_row_cost: rho in [0, 1] (proto_spec 05 §2.6, issue 12) ----------------------------------------
@pytest.mark.parametrize("rho", [0, 0.0, 0.02, 0.5, 1, 1.0])
def test_capability_carries_the_batch_row_cost(rho):
    cap = cf.Capability.from_measurement({"memory_bytes": 1 << 30, "bandwidth_Bps": 5e9, "batch_row_cost": rho})
    assert cap.to_wire()["batch_row_cost"] == rho
    back = cf.decode_control(msgpack_trip(cap.to_wire()))
    assert back == cap and back.batch_row_cost == rho
    assert back.as_record()["batch_row_cost"] == rho


def test_a_capability_without_a_batch_row_cost_records_none():
    # an older member (or one whose probe could not batch): the host plans rho = 1 (Device None)
    assert cf.decode_control(wire("capability", batch_row_cost=...)).as_record()["batch_row_cost"] is None
    assert cf.Capability.from_measurement({"memory_bytes": 1, "batch_row_cost": None}).batch_row_cost is None


@pytest.mark.parametrize("rho, fragment", [(1.001, "is 1.001, above 1"), (2, "is 2, above 1"), (1e300, "above 1"),
                                           (-0.001, "is -0.001, below 0"), (-1, "is -1, below 0"),
                                           (True, "is True"), ("0.1", "is '0.1'")])
def test_a_batch_row_cost_outside_zero_to_one_is_refused(rho, fragment):
    rejects(wire("capability", batch_row_cost=rho), "malformed capability frame: 'batch_row_cost'", fragment)


@pytest.mark.parametrize("rho", [math.nan, math.inf, -math.inf])
def test_a_batch_row_cost_must_be_finite(rho):
    rejects(msgpack_trip(wire("capability", batch_row_cost=rho)), "malformed capability frame: 'batch_row_cost'")


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_batch_row_cost_is_accepted_exactly_in_zero_to_one(rho):
    d = msgpack_trip(wire("capability", batch_row_cost=rho))
    if 0.0 <= rho <= 1.0:
        assert cf.decode_control(d).batch_row_cost == rho
    else:
        rejects(d, "malformed capability frame: 'batch_row_cost'", "above 1" if rho > 1 else "below 0")


@pytest.mark.parametrize("t, field", [("capability", "dtype"), ("capability", "fallback_dtype"), ("plan", "dtype")])
def test_a_dtype_a_stage_cannot_hold_is_refused(t, field):
    for good in ("float32", "bfloat16", "float16"):
        assert getattr(cf.decode_control(wire(t, **{field: good})), field) == good
    rejects(wire(t, **{field: "int8"}), f"malformed {t} frame: '{field}' is 'int8', not one of float32")


def test_a_plan_frame_carries_its_stage_dtype_and_defaults_to_none():
    assert cf.decode_control(msgpack_trip(wire("plan", dtype="bfloat16"))).dtype == "bfloat16"
    assert cf.decode_control(msgpack_trip(wire("plan", dtype=...))).dtype is None


# ---- property: anything a peer can send ------------------------------------------------------------
_leaf = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=12)
         | st.binary(max_size=12))
_key = st.sampled_from(FIELD_NAMES + RESULT_KEYS + ["t"]) | st.text(max_size=6) | st.binary(max_size=3) | st.integers(-9, 9)
_value = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_key, inner, max_size=4),
                      max_leaves=10)
_type = st.sampled_from(sorted(cf._TYPES)) | st.text(max_size=8) | _leaf
_maps = st.builds(lambda t, rest: {**rest, "t": t}, _type, st.dictionaries(_key, _value, max_size=8))


def _check_decode(d) -> None:
    try:
        frame = cf.decode_control(d)
    except RemoteProtocolError as e:
        assert str(e).startswith("malformed ")
        return
    assert isinstance(frame, (cf.ControlFrame, cf.UnknownFrame))
    if isinstance(frame, cf.ControlFrame):
        assert type(frame).T == d["t"]
        # what was accepted goes out and comes back as the same bytes (NaN inside a dict field included)
        again = cf.decode_control(msgpack_trip(frame.to_wire()))
        assert msgpack.packb(again.to_wire(), use_bin_type=True) == msgpack.packb(frame.to_wire(), use_bin_type=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_maps)
def test_any_map_decodes_to_a_frame_or_a_remote_protocol_error(d):
    _check_decode(msgpack_trip(d))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_frame_with_any_one_field_replaced(data):
    t = data.draw(st.sampled_from(sorted(SAMPLES)), label="t")
    names = [a.name for a in attrs.fields(type(SAMPLES[t]))] or ["x"]
    field = data.draw(st.sampled_from(names), label="field")
    value = data.draw(_value | st.fixed_dictionaries({k: _value for k in RESULT_KEYS}), label="value")
    _check_decode(msgpack_trip(wire(t, **{field: value})))
